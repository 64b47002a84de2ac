"""Hierarchical backward gathers (ZeRO++'s hpZ, FSDP2's ``reshard_after_forward=<int>``):
``autoshard.shard(model, reshard_after_forward=G)``.

The forward gathers each parameter over the whole shard group (N ranks), as with ``True``;
each rank then keeps its node's slice of the gathered parameter (1/G of its padded rows, in
``param_dtype``) instead of nothing, and the backward gathers the parameter again over its
node group of G ranks only (intra-node links), not over all N. The lowering does this
(``passes/hpz.py``); this module checks the value, makes the node groups and holds the op
that cuts the node's slice.

Nodes are G consecutive ranks of the shard group: node k holds its ranks ``[k*G, (k+1)*G)``.
As FSDP2: G == N is ``True``, G == 1 is ``False`` (nothing to reshard to: the full parameter
is kept, with a warning); G must divide N. Not with strategies ``"grad_op"`` and
``"replicate"`` (they keep full parameters) nor ``"hybrid"`` (its shard group is the node already).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autoshard._compat import new_empty, resolve_process_group
from autoshard.runtime.errors import UsageError

# (the shard group's ranks, G) -> this rank's node group: one set of groups however often shard is called.
_NODE_GROUPS: dict[tuple[tuple[int, ...], int], str] = {}


def check_value(value: Any, strategy: str) -> None:
    """Refuse a ``reshard_after_forward`` that no shard group could take (before anything changes)."""
    if value is None or isinstance(value, bool):  # bool first: True is an int
        return
    if not isinstance(value, int):
        raise UsageError(f"autoshard.shard: reshard_after_forward must be True, False, None or an int (the node size to "
                         f"reshard to), got {value!r}; pass e.g. reshard_after_forward=8 for nodes of 8 ranks.")
    if strategy in ("grad_op", "replicate"):
        raise UsageError(f"autoshard.shard: reshard_after_forward={value} reshards after forward, which strategy={strategy!r} "
                         "contradicts (it keeps full parameters from forward to backward); use strategy='full' for "
                         "hierarchical backward gathers.")
    if strategy == "hybrid":
        raise UsageError(f"autoshard.shard: reshard_after_forward={value}: strategy='hybrid' shards within a node already "
                         "(its shard group is the node), so its backward gathers are intra-node; pass "
                         f"reshard_after_forward=True (or None), or use strategy='full' with reshard_after_forward={value}.")
    if value < 1:
        raise UsageError(f"autoshard.shard: reshard_after_forward must be at least 1 as an int (the ranks per node), got "
                         f"{value}; pass e.g. the GPUs per node.")


def node_size(value: bool | int | None, world: int) -> tuple[bool | None, int]:
    """(the ``reshard`` flag, G or 0) of a checked ``reshard_after_forward`` for a shard group
    of ``world`` ranks; refuses a G that does not divide it."""
    if value is None or isinstance(value, bool):
        return value, 0
    if value > world or world % value:
        raise UsageError(f"autoshard.shard: reshard_after_forward={value} must divide the shard group's {world} ranks (nodes "
                         f"of {value} consecutive ranks); pass a divisor of {world}, e.g. the ranks per node, or True.")
    if value == 1:
        warnings.warn("autoshard.shard: reshard_after_forward=1 reshards to one rank, which keeps the whole parameter: "
                      "the same as False (as FSDP2).", stacklevel=3)
        return False, 0
    return (True, 0) if value == world else (True, value)


def node_group(mesh: DeviceMesh, size: int) -> str:
    """The name of this rank's node group: ``size`` consecutive ranks of ``mesh`` (1-D). Every
    rank makes every node's group, in the same order (``new_group`` asks all ranks to)."""
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    key = (ranks, size)
    name = _NODE_GROUPS.get(key)
    if name is not None:
        try:  # made in this process group (not one destroyed since)?
            if tuple(dist.get_process_group_ranks(resolve_process_group(name))) in _nodes(ranks, size):
                return name
        except (RuntimeError, ValueError):
            pass
    me = dist.get_rank()
    for node in _nodes(ranks, size):
        group = dist.new_group(list(node))
        if me in node:
            name = group.group_name
    _NODE_GROUPS[key] = name
    return name


def _nodes(ranks: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [ranks[k : k + size] for k in range(0, len(ranks), size)]


@torch.library.custom_op("autoshard::node_slice", mutates_args=())
def node_slice(gathered: torch.Tensor, node_group: str, node_size: int) -> torch.Tensor:
    """This rank's slice of a gathered padded parameter ``[N * chunk, ...]``: rows
    ``[l * M, (l + 1) * M)``, M = its rows / ``node_size``, l = this rank's rank in
    ``node_group``; a new tensor (a view would keep the whole gathered storage alive). The
    rank is read at run time, so every rank's graph holds the same op."""
    rows = gathered.shape[0] // node_size
    local = dist.get_rank(resolve_process_group(node_group))
    return gathered[local * rows : (local + 1) * rows].clone()


@node_slice.register_fake
def _(gathered, node_group, node_size):
    return new_empty(gathered, (gathered.shape[0] // node_size, *gathered.shape[1:]), gathered.dtype)


NODE_SLICE = torch.ops.autoshard.node_slice.default
