"""autoshard's runtime ops: the sharding annotations that the backend finds and lowers.

Each op carries everything a pass needs as explicit arguments (group name, world size,
sizes), so it survives Dynamo and AOT autograd intact. Eagerly the ops run real, blocking
collectives, so a sharded model trains correctly even without ``torch.compile``.

Shards follow DTensor's ``Shard(0)`` layout (``torch.chunk``): every rank owns
``chunk = ceil(dim0 / world_size)`` rows except at the tail, where one rank may own fewer
and the rest none. Padding each shard to ``chunk`` rows therefore puts all padding after the
real rows, so a gather of padded shards followed by ``[:dim0]`` is exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._compat import c10d


def chunk_rows(dim0: int, world_size: int) -> int:
    """Rows each rank's padded shard holds."""
    return -(-dim0 // world_size)


def local_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows rank ``rank`` really owns under ``Shard(0)``."""
    chunk = chunk_rows(dim0, world_size)
    return max(0, min(chunk, dim0 - rank * chunk))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    missing = rows - t.shape[0]
    if missing == 0:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, missing])


@torch.library.custom_op("autoshard::unshard", mutates_args=())
def unshard(shard: torch.Tensor, group_name: str, world_size: int, dim0: int, reshard: bool, name: str) -> torch.Tensor:
    """All-gather ``shard`` (this rank's rows of a ``dim0``-row parameter) into the full parameter.

    ``reshard``: free the result after forward and gather again in backward. ``name``: the
    parameter's fully qualified name, which bucketing groups by.
    """
    padded = _pad_rows(shard, chunk_rows(dim0, world_size)).contiguous()
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(padded, world_size, group_name))
    return gathered[:dim0].clone()


@unshard.register_fake
def _(shard, group_name, world_size, dim0, reshard, name):
    return shard.new_empty((dim0, *shard.shape[1:]))


@torch.library.custom_op("autoshard::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, group_name: str, world_size: int, shard_rows: int, name: str) -> torch.Tensor:
    """Reduce-scatter a full gradient, averaged over the data-parallel ranks, to this rank's
    ``shard_rows`` rows."""
    padded = _pad_rows(grad, chunk_rows(grad.shape[0], world_size) * world_size).contiguous()
    reduced = c10d.wait_tensor(c10d.reduce_scatter_tensor(padded, "avg", world_size, group_name))
    return reduced[:shard_rows].clone()


@reduce_grad.register_fake
def _(grad, group_name, world_size, shard_rows, name):
    return grad.new_empty((shard_rows, *grad.shape[1:]))


def _unshard_setup(ctx, inputs, output):
    shard, group_name, world_size, _, _, name = inputs
    ctx.args = (group_name, world_size, shard.shape[0], name)


def _unshard_backward(ctx, grad):
    return reduce_grad(grad.contiguous(), *ctx.args), None, None, None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)


@torch.library.custom_op("autoshard::replicate", mutates_args=())
def replicate(tensor: torch.Tensor, group_name: str, world_size: int, name: str) -> torch.Tensor:
    """Use of a replicated parameter (one that cannot be split, e.g. 0-d): identity forward,
    gradient averaged over the ranks in backward."""
    return tensor.clone()


@replicate.register_fake
def _(tensor, group_name, world_size, name):
    return torch.empty_like(tensor)


@torch.library.custom_op("autoshard::all_reduce_grad", mutates_args=())
def all_reduce_grad(grad: torch.Tensor, group_name: str, world_size: int, name: str) -> torch.Tensor:
    """All-reduce a gradient, averaged over the data-parallel ranks."""
    return c10d.wait_tensor(c10d.all_reduce(grad.contiguous(), "avg", group_name)).clone()


@all_reduce_grad.register_fake
def _(grad, group_name, world_size, name):
    return torch.empty_like(grad)


def _replicate_setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _replicate_backward(ctx, grad):
    return all_reduce_grad(grad, *ctx.args), None, None, None


replicate.register_autograd(_replicate_backward, setup_context=_replicate_setup)
