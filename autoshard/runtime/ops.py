"""autoshard's runtime ops: the sharding annotations that the backend finds and lowers.

Each op carries everything a pass needs as explicit arguments (group names, world sizes,
sizes, dtypes), so it survives Dynamo and AOT autograd intact. Eagerly the ops run real,
blocking collectives, so a sharded model trains correctly even without ``torch.compile``.

Shards follow DTensor's ``Shard(0)`` layout (``torch.chunk``): every rank owns
``chunk = ceil(dim0 / world_size)`` rows except at the tail, where one rank may own fewer
and the rest none. Padding each shard to ``chunk`` rows therefore puts all padding after the
real rows, so a gather of padded shards followed by ``[:dim0]`` is exact.

Arguments shared by the ops:

* ``group_name`` / ``world_size``: the group a parameter is sharded (or, replicated, averaged)
  over. ``replica_group`` / ``replicas``: for hybrid sharding, the group of ranks holding the
  same shard; gradients reduced in ``group_name`` are then averaged over it (``replicas`` 1
  and ``""``: none).
* ``param_dtype``: dtype the parameter is gathered and computed in (None: its own).
  ``reduce_dtype``: dtype gradients are reduced in (None: the gradient's own). Gradients come
  back in the parameter's dtype.
* ``sink``: None normally. While gradient synchronisation is off, a full-size leaf that
  receives the unreduced gradient instead (autograd accumulates it in ``sink.grad``); the
  shard then gets no gradient and nothing is communicated in backward.
* ``name``: the parameter's fully qualified name, which bucketing groups by.
* ``rows``: None for the layout above. Under state shares (``autoshard.shard(...,
  state_shares=)``), every rank's row count, the same tuple on every rank: rank r owns rows
  ``[sum(rows[:r]), sum(rows[:r+1]))``. Collectives then pad every shard to ``max(rows)``
  (gloo and NCCL have no all-gather-v) and cut each rank's rows back out
  (:func:`join_rows`, :func:`spread_rows`).
* ``quant_block``: 0 normally. Under ``autoshard.Compression(gather="int8")``, the elements per
  scale: the padded shard is gathered as int8 blocks and dequantized to ``param_dtype`` (or its
  own dtype) after the gather (:mod:`autoshard.runtime.quantize`); the backward is unchanged.
  ``quant_codec``: how those blocks' values are encoded, ``"int8"`` (the default, left out of
  the graphs) or ``"fp8"`` (float8 e4m3 bytes, ``Compression(gather="fp8")``).
* ``node_group`` / ``node_size``: "" and 0 normally. Under ``reshard_after_forward=G`` (an
  int), this rank's node group and G: the backward gathers within the node (``passes/hpz.py``).
* ``reduce_block``: 0 normally. Under ``autoshard.Compression(reduce="int8")``, the elements
  per scale of the gradient's reduction: each destination rank's chunk of the padded gradient
  is quantized to int8 blocks, the chunks exchanged by one all-to-all, and the received ones
  dequantized, summed and averaged in float32 (``reduce_dtype`` is then not used); hybrid's
  replica average stays a float all-reduce.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from autoshard._compat import OpOverload, c10d, new_empty, schema_arguments
from autoshard.runtime import quantize


def arguments(op: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An op call's arguments by their schema names, defaults filled in: how passes and these
    ops' autograd read arguments, never by position (here because every layer imports ops)."""
    kwargs = kwargs or {}
    found = {}
    for i, a in enumerate(schema_arguments(op)):
        if i < len(args) and not a.kwarg_only:
            found[a.name] = args[i]
        elif a.name in kwargs:
            found[a.name] = kwargs[a.name]
        elif a.has_default_value():
            found[a.name] = a.default_value
    return found


def _gradients(op: OpOverload, **grads: Any) -> tuple:
    """What a custom op's backward returns: one entry per input of ``op``, None but ``grads``."""
    return tuple(grads.get(a.name) for a in schema_arguments(op))


def chunk_rows(dim0: int, world_size: int) -> int:
    """Rows each rank's padded shard holds."""
    return -(-dim0 // world_size)


def local_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows rank ``rank`` really owns under ``Shard(0)``."""
    chunk = chunk_rows(dim0, world_size)
    return max(0, min(chunk, dim0 - rank * chunk))


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    missing = rows - t.shape[0]
    if missing == 0:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, missing])


def join_rows(gathered: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """The full tensor from an all-gather of shards padded to ``max(rows)`` rows each: rank
    r's first ``rows[r]`` rows of its block, concatenated (a new tensor)."""
    widest = max(rows)
    pieces = gathered.split_with_sizes([n for r in rows for n in (r, widest - r)])
    return torch.cat(pieces[::2])


def spread_rows(full: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """A reduce-scatter's input for a ``full`` tensor cut by ``rows``: each rank's rows padded
    to ``max(rows)``, rank after rank (``len(rows) * max(rows)`` rows)."""
    widest = max(rows)
    return torch.cat([pad_rows(piece, widest) for piece in full.split_with_sizes(list(rows))])


@torch.library.custom_op("autoshard::pad_shard", mutates_args=())
def pad_shard(shard: torch.Tensor, rows: int) -> torch.Tensor:
    """``shard`` followed by zero rows up to ``rows``: a new tensor on every rank, also where
    no row is missing. A gather's input where a parameter's rows do not divide: opaque, so no
    compiler drops it as a no-op on the ranks whose shard is full (Inductor's partitioner
    removes a pad of nothing) and every rank's graph keeps the same nodes."""
    return pad_rows(shard, rows).clone()


@pad_shard.register_fake
def _(shard, rows):
    return new_empty(shard, (rows, *shard.shape[1:]), shard.dtype)


def _cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _new(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``t`` in ``dtype`` as a new tensor: a custom op may not return (a view of) its input."""
    return t.clone() if dtype is None or t.dtype == dtype else t.to(dtype)


def _average_over_replicas(t: torch.Tensor, replica_group: str, replicas: int) -> torch.Tensor:
    if replicas == 1:
        return t
    return c10d.wait_tensor(c10d.all_reduce(t.contiguous(), "avg", replica_group))


@torch.library.custom_op("autoshard::unshard", mutates_args=())
def unshard(  # one line per group of arguments (see the module docstring)
    shard: torch.Tensor, group_name: str, world_size: int, dim0: int, reshard: Optional[bool], name: str,
    sink: Optional[torch.Tensor], param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
    replica_group: str, replicas: int, rows: Optional[list[int]] = None, quant_block: int = 0, reduce_block: int = 0,
    node_group: str = "", node_size: int = 0, quant_codec: str = "int8",
) -> torch.Tensor:
    """All-gather ``shard`` (this rank's rows of a ``dim0``-row parameter), cast to
    ``param_dtype`` first (or, with ``quant_block``, quantized and dequantized to it after the
    gather), into the full parameter.

    ``reshard``: free the result after forward and gather again in backward; None: unless the
    backward needs it first (the lowering decides, see ``passes/lower.py``). Backward:
    :func:`reduce_grad`, or the full gradient to ``sink`` when one is given.
    ``node_group`` / ``node_size``: hierarchical backward gathers (``reshard_after_forward=``
    an int, :mod:`autoshard.runtime.hpz`): the lowering keeps this rank's node slice after the
    forward and gathers it again within ``node_group`` only (``passes/hpz.py``); eagerly the
    same as without.
    """
    chunk = max(rows) if rows else chunk_rows(dim0, world_size)
    if quant_block:
        padded = pad_rows(shard, chunk)  # [chunk, ...], in the shard's dtype
        packed = quantize.quantize(padded, quant_block, quant_codec)  # int8 [nb * (block + 4)]
        moved = c10d.wait_tensor(c10d.all_gather_into_tensor(packed, world_size, group_name))
        gathered = quantize.dequantize_blocks(moved, world_size, quant_block, list(padded.shape), param_dtype or shard.dtype,
                                              quant_codec)
    else:
        padded = pad_rows(_cast(shard, param_dtype), chunk).contiguous()
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(padded, world_size, group_name))
    return join_rows(gathered, rows) if rows else gathered[:dim0].clone()


@unshard.register_fake
def _unshard_fake(shard, group_name, world_size, dim0, reshard, name, sink, param_dtype, reduce_dtype, replica_group, replicas,
                  rows=None, quant_block=0, reduce_block=0, node_group="", node_size=0, quant_codec="int8"):
    return new_empty(shard, (dim0, *shard.shape[1:]), param_dtype or shard.dtype)


@torch.library.custom_op("autoshard::reduce_grad", mutates_args=())
def reduce_grad(
    grad: torch.Tensor, group_name: str, world_size: int, shard_rows: int, name: str,
    reduce_dtype: Optional[torch.dtype], out_dtype: torch.dtype,
    replica_group: str, replicas: int, rows: Optional[list[int]] = None, reduce_block: int = 0,
) -> torch.Tensor:
    """Reduce-scatter a full gradient in ``reduce_dtype``, averaged over the data-parallel
    ranks (``group_name``, then ``replica_group``), to this rank's ``shard_rows`` rows in
    ``out_dtype``; ``rows``: cut by state shares. With ``reduce_block``: by an all-to-all of
    int8 chunks, averaged in float32 (:mod:`autoshard.runtime.quantize`)."""
    grad = grad if reduce_block else _cast(grad, reduce_dtype)
    padded = (spread_rows(grad, rows) if rows else pad_rows(grad, chunk_rows(grad.shape[0], world_size) * world_size)).contiguous()
    if reduce_block:
        packed = quantize.quantize_chunks(padded, world_size, reduce_block)
        sizes = [packed.numel() // world_size] * world_size
        received = c10d.wait_tensor(c10d.all_to_all_single(packed, sizes, sizes, group_name))
        reduced = quantize.dequantize_mean(received, world_size, reduce_block, [padded.shape[0] // world_size, *padded.shape[1:]])
    else:
        reduced = c10d.wait_tensor(c10d.reduce_scatter_tensor(padded, "avg", world_size, group_name))
    # Over the replicas on the padded shard, as the lowered graph does: the same shape on every rank.
    return _new(_average_over_replicas(reduced, replica_group, replicas)[:shard_rows], out_dtype)


@reduce_grad.register_fake
def _reduce_grad_fake(grad, group_name, world_size, shard_rows, name, reduce_dtype, out_dtype, replica_group, replicas, rows=None,
                      reduce_block=0):
    return new_empty(grad, (shard_rows, *grad.shape[1:]), out_dtype)


def _sink_grad(ctx, grad: torch.Tensor) -> torch.Tensor | None:
    return None if ctx.sink_dtype is None else grad.to(ctx.sink_dtype)


def _backward_args(op: OpOverload, inputs: tuple, backward: OpOverload, **given: Any) -> tuple:
    """The arguments of ``backward`` after the gradient: those of the forward ``op`` of the
    same name, plus ``given``."""
    forward = {**arguments(op, inputs), **given}
    return tuple(forward[a.name] for a in schema_arguments(backward)[1:])


def _unshard_setup(ctx, inputs, output):
    a = arguments(UNSHARD, inputs)
    ctx.args = backward_call(UNSHARD, inputs)[1]
    ctx.sink_dtype = None if a["sink"] is None else a["sink"].dtype


def _unshard_backward(ctx, grad):
    if ctx.sink_dtype is not None:  # synchronisation off: the full gradient stays local
        return _gradients(UNSHARD, sink=_sink_grad(ctx, grad))
    return _gradients(UNSHARD, shard=reduce_grad(grad.contiguous(), *ctx.args))


UNSHARD, _REDUCE_GRAD = torch.ops.autoshard.unshard.default, torch.ops.autoshard.reduce_grad.default
unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)


@torch.library.custom_op("autoshard::replicate", mutates_args=())
def replicate(
    tensor: torch.Tensor, group_name: str, world_size: int, name: str,
    sink: Optional[torch.Tensor], param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
    replica_group: str, replicas: int,
) -> torch.Tensor:
    """Use of a replicated parameter (0-d, or every parameter under strategy "replicate"):
    a cast to ``param_dtype`` forward; backward :func:`all_reduce_grad` (or the gradient to
    ``sink`` when one is given)."""
    return _new(tensor, param_dtype)


@replicate.register_fake
def _replicate_fake(tensor, group_name, world_size, name, sink, param_dtype, reduce_dtype, replica_group, replicas):
    return torch.empty_like(tensor, dtype=param_dtype or tensor.dtype)


@torch.library.custom_op("autoshard::all_reduce_grad", mutates_args=())
def all_reduce_grad(
    grad: torch.Tensor, group_name: str, world_size: int, name: str,
    reduce_dtype: Optional[torch.dtype], out_dtype: torch.dtype,
    replica_group: str, replicas: int,
) -> torch.Tensor:
    """All-reduce a gradient in ``reduce_dtype``, averaged over the data-parallel ranks
    (``group_name``, then ``replica_group``), returned in ``out_dtype``."""
    reduced = _cast(grad, reduce_dtype)
    if world_size > 1:
        reduced = c10d.wait_tensor(c10d.all_reduce(reduced.contiguous(), "avg", group_name))
    return _new(_average_over_replicas(reduced, replica_group, replicas), out_dtype)


@all_reduce_grad.register_fake
def _all_reduce_grad_fake(grad, group_name, world_size, name, reduce_dtype, out_dtype, replica_group, replicas):
    return torch.empty_like(grad, dtype=out_dtype)


def _replicate_setup(ctx, inputs, output):
    a = arguments(REPLICATE, inputs)
    ctx.args = backward_call(REPLICATE, inputs)[1]
    ctx.sink_dtype = None if a["sink"] is None else a["sink"].dtype


def _replicate_backward(ctx, grad):
    if ctx.sink_dtype is not None:
        return _gradients(REPLICATE, sink=_sink_grad(ctx, grad))
    return _gradients(REPLICATE, tensor=all_reduce_grad(grad, *ctx.args))


REPLICATE, _ALL_REDUCE_GRAD = torch.ops.autoshard.replicate.default, torch.ops.autoshard.all_reduce_grad.default
replicate.register_autograd(_replicate_backward, setup_context=_replicate_setup)

# Each parameter op's fake kernel, by overload: for ops that apply many of them at once (batched.py).
FAKE = {UNSHARD: _unshard_fake, REPLICATE: _replicate_fake, _REDUCE_GRAD: _reduce_grad_fake,
        _ALL_REDUCE_GRAD: _all_reduce_grad_fake}


def backward_call(op: OpOverload, inputs: Sequence[Any]) -> tuple[OpOverload, tuple]:
    """What a synchronised backward of ``op`` (``unshard`` or ``replicate``) called with
    ``inputs`` applies to the gradient: the reduction op, and its arguments after the gradient."""
    tensor = inputs[0]  # the shard, or the replicated tensor
    backward = _REDUCE_GRAD if op == UNSHARD else _ALL_REDUCE_GRAD
    given = {"shard_rows": tensor.shape[0]} if op == UNSHARD else {}
    return backward, _backward_args(op, inputs, backward, out_dtype=tensor.dtype, **given)


@torch.library.custom_op("autoshard::copy_out", mutates_args=())
def copy_out(gathered: torch.Tensor, world_size: int, numels: list[int]) -> list[torch.Tensor]:
    """Each parameter's part of a bucket's gathered result (rank-major: ``world_size`` rows of
    ``sum(numels)``) as its own contiguous ``[world_size, numel]`` tensor: one copy per bucket,
    as FSDP2's ``split_with_sizes_copy``, and an opaque one, so a compiler gives the
    parameters' consumers ordinary inputs."""
    return list(torch.split_with_sizes_copy(gathered.view(world_size, -1), numels, dim=1))


@copy_out.register_fake
def _(gathered, world_size, numels):
    return [gathered.new_empty((world_size, n)) for n in numels]


@torch.library.custom_op("autoshard::copy_in", mutates_args=())
def copy_in(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """A bucket's collective input: each part laid out as ``rows`` rows, the parts side by
    side, flattened (rows 1: the shards one after another, for a gather; rows ``world_size``:
    each rank's chunk of every gradient together, for a reduce-scatter). One copy per bucket,
    opaque, so a compiler gives the parts' producers ordinary outputs."""
    return torch.cat([p.reshape(rows, -1) for p in parts], dim=1).view(-1)


@copy_in.register_fake
def _(parts, rows):
    return parts[0].new_empty((sum(p.numel() for p in parts),))


@torch.library.custom_op("autoshard::send_buffer", mutates_args=())
def send_buffer(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` for a collective to send from, opaque, so a compiler hands
    the collective this very storage (no layout copy of its own in between) and
    :func:`hold` can keep it alive until the wait."""
    return x.contiguous().clone()


@send_buffer.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("autoshard::hold", mutates_args=("held",))
def hold(done: torch.Tensor, held: list[torch.Tensor]) -> None:
    """Nothing, at run time. In a graph it reads ``held`` after ``done`` (a collective's wait):
    a compiler that plans its own buffers then keeps ``held`` (what the collective reads while in
    flight) alive, and unshared with any other buffer, until the wait (passes/gloo.py). Declared
    as writing ``held`` so that no compiler drops it as unused."""


@hold.register_fake
def _(done, held):
    return None
