"""Bucketing: one flat collective for a group of parameters, with copy-in and copy-out."""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

import torch
from torch import fx

from autoshard._compat import c10d

from .graph_utils import (
    COPY_IN,
    COPY_OUT,
    GATHERED,
    PARAMS,
    Replacer,
    arg,
    block_of,
    call,
    collectives,
    exclusive_inputs,
    issue_inputs,
    mib_to_bytes,
    nbytes,
    positions,
    reorder,
    val,
    wait_of,
)

aten = torch.ops.aten

# Without repeated blocks to follow, buckets fill up to this size.
DEFAULT_BUCKET_BYTES = 64 * 2**20
# Parameters outside the blocks join a neighbouring block's bucket when at most this fraction
# of it (final norms, small heads): one collective fewer for little extra memory.
SMALL_LEFTOVER = 0.25


def _even_exchange(node: fx.Node) -> bool:
    """An all-to-all that sends every rank an equal chunk and receives as much from each."""
    sizes = arg(node, "output_split_sizes")
    return sizes == arg(node, "input_split_sizes") and len(set(sizes)) == 1


def _compatible(a: fx.Node, b: fx.Node) -> bool:
    if a.target is c10d.all_to_all_single.default:  # chunks of other sizes share a bucket: each rank's side by side
        return (b.target is a.target and _even_exchange(a) and _even_exchange(b) and val(a).dtype == val(b).dtype
                and len(arg(a, "output_split_sizes")) == len(arg(b, "output_split_sizes"))
                and arg(a, "group_name") == arg(b, "group_name"))
    return a.target is b.target and a.args[1:] == b.args[1:] and val(a).dtype == val(b).dtype


def _split(bucket: list[fx.Node], cap: int) -> list[list[fx.Node]]:
    parts, size = [[]], 0
    for node in bucket:
        if parts[-1] and size + nbytes(node) > cap:
            parts.append([])
            size = 0
        parts[-1].append(node)
        size += nbytes(node)
    return parts


def plan_buckets(nodes: Sequence[fx.Node], bucket_bytes: int | None = None, blocks_per_bucket: int = 1) -> list[list[fx.Node]]:
    """Group collectives of one kind (in graph order) into buckets.

    One bucket per repeated block (consecutive collectives of parameters in the same block);
    a run of parameters outside any block joins the next (else the previous) block bucket
    when it is small (at most ``SMALL_LEFTOVER`` of that bucket), else it is a bucket of its
    own. Without blocks, consecutive collectives fill buckets up to ``bucket_bytes`` (default
    64 MiB). ``blocks_per_bucket``: the buckets of that many consecutive blocks are one (see
    :func:`_merge_blocks`). With ``bucket_bytes``, larger buckets are split.
    Only compatible collectives (same op, group, dtype) share a bucket. Deterministic: it
    depends on names, order and sizes only.
    """
    runs: list[list[fx.Node]] = []
    for node in nodes:
        unit = block_of(node.meta[PARAMS][0])
        if runs and _compatible(runs[-1][-1], node) and block_of(runs[-1][-1].meta[PARAMS][0]) == unit:
            runs[-1].append(node)
        else:
            runs.append([node])
    def size(run: list[fx.Node]) -> int:
        return sum(map(nbytes, run))

    is_block = [block_of(run[0].meta[PARAMS][0]) is not None for run in runs]
    if not any(is_block):
        cap = bucket_bytes or DEFAULT_BUCKET_BYTES
        merged: list[list[fx.Node]] = []
        for run in runs:
            if merged and _compatible(merged[-1][-1], run[0]):
                merged[-1].extend(run)
            else:
                merged.append(list(run))
        return [part for bucket in merged for part in _split(bucket, cap)]

    buckets = [list(r) for r in runs]
    for i in range(len(runs)):
        if is_block[i]:
            continue
        for j in (i + 1, i - 1):  # the next block first: leftovers gather with what follows them
            if 0 <= j < len(runs) and is_block[j] and buckets[j] and _compatible(buckets[j][0], runs[i][0]):
                if size(runs[i]) <= SMALL_LEFTOVER * size(buckets[j]):
                    buckets[j] = (runs[i] + buckets[j]) if j > i else (buckets[j] + runs[i])
                    buckets[i] = []
                    break
    order = positions(nodes)
    result = [sorted(b, key=order.__getitem__) for b in buckets if b]
    if blocks_per_bucket > 1:
        result = _merge_blocks(result, blocks_per_bucket)
    if bucket_bytes:
        result = [part for bucket in result for part in _split(bucket, bucket_bytes)]
    return result


def _merge_blocks(buckets: list[list[fx.Node]], k: int) -> list[list[fx.Node]]:
    """Consecutive compatible block buckets, ``k`` at a time, as one: one collective's latency
    for ``k`` blocks (what a latency-bound all-reduce across many nodes pays per bucket). A
    bucket of no block (a large leftover) stays alone and ends the run before it."""
    merged: list[list[fx.Node]] = []
    count = 0  # blocks in merged[-1]; 0: not a block bucket
    for bucket in buckets:
        in_block = any(block_of(n.meta[PARAMS][0]) is not None for n in bucket)
        if in_block and 0 < count < k and _compatible(merged[-1][-1], bucket[0]):
            merged[-1].extend(bucket)
            count += 1
        else:
            merged.append(list(bucket))
            count = 1 if in_block else 0
    return merged


def _view(graph: fx.Graph, x: fx.Node, shape: list[int]) -> fx.Node:
    """``x`` viewed as ``shape`` (one -1 allowed), or ``x`` itself where it has that shape
    already (a 1-D shard or gradient): a no-op view is a node every later pass would walk."""
    have = list(val(x).shape)
    if len(have) == len(shape) and all(s in (-1, h) for s, h in zip(shape, have)):
        return x
    return call(graph, aten.view.default, x, shape)


def _flat_view(graph: fx.Graph, x: fx.Node, shape: list[int]) -> fx.Node:
    if not val(x).is_contiguous():
        x = call(graph, aten.clone.default, x)
    return _view(graph, x, shape)


def _bucket_gathers(
    graph: fx.Graph, gathers: list[fx.Node], pos: dict[fx.Node, int], priority: dict[fx.Node, float], opaque: bool,
    replacer: Replacer,
) -> None:
    world, group = gathers[0].args[1:]
    inputs = [g.args[0] for g in gathers]
    sizes = [val(x).numel() for x in inputs]
    total = sum(sizes)
    with graph.inserting_before(gathers[0]):
        if opaque:
            flat = call(graph, COPY_IN, inputs, 1)
        else:
            flat = call(graph, aten.cat.default, [_flat_view(graph, x, [-1]) for x in inputs])
        gather = call(graph, c10d.all_gather_into_tensor.default, flat, world, group)
        gather.meta[PARAMS] = tuple(name for g in gathers for name in g.meta[PARAMS])
        wait = call(graph, c10d.wait_tensor.default, gather)
        by_rank = call(graph, aten.view.default, wait, [world, total])
    start = pos[gathers[0]] - 0.5
    for n in issue_inputs(flat) + [flat, gather]:
        priority[n] = start
    if opaque:
        _copy_out(graph, gathers, wait, by_rank, pos, priority, replacer)
        return
    offset = 0
    for g, x, n in zip(gathers, inputs, sizes):
        old_wait = wait_of(g)
        with graph.inserting_before(old_wait):
            # Its columns of every rank's row, copied out: one node for slice and clone.
            copy = call(graph, aten.narrow_copy.default, by_rank, 1, offset, n)
            full = _view(graph, copy, [world * val(x).shape[0], *val(x).shape[1:]])
        copy.meta[GATHERED] = True
        for node in (wait, by_rank, copy, full):
            priority.setdefault(node, pos[old_wait])
        offset += n
        replacer.replace(old_wait, full)
        replacer.erase(g)


def _copy_out(
    graph: fx.Graph, gathers: list[fx.Node], wait: fx.Node, by_rank: fx.Node, pos: dict[fx.Node, int],
    priority: dict[fx.Node, float], replacer: Replacer,
) -> None:
    """Every parameter of the bucket copied out of ``by_rank`` at once, where the first is
    used, each taken out of the result right there (so the list holds none of them longer)."""
    world = val(by_rank).shape[0]
    first_wait = wait_of(gathers[0])
    with graph.inserting_before(first_wait):
        parts = call(graph, COPY_OUT, by_rank, world, [val(g.args[0]).numel() for g in gathers])
        taken = [call(graph, operator.getitem, parts, i) for i in range(len(gathers))]
    for node in (wait, by_rank, parts, *taken):
        priority.setdefault(node, pos[first_wait])
    for g, part in zip(gathers, taken):
        part.meta[GATHERED] = True
        old_wait, shape = wait_of(g), val(g.args[0]).shape
        with graph.inserting_before(old_wait):
            full = _view(graph, part, [world * shape[0], *shape[1:]])
        priority.setdefault(full, pos[old_wait])
        replacer.replace(old_wait, full)
        replacer.erase(g)


def _rank_major(graph: fx.Graph, inputs: list[fx.Node], world: int, opaque: bool) -> fx.Node:
    """The flat buffer a bucketed reduce-scatter or all-to-all sends: each input ``[world *
    chunk, ...]`` seen as ``[world, chunk]``, side by side, rank by rank (one opaque copy-in
    with ``opaque``)."""
    if opaque:
        return call(graph, COPY_IN, inputs, world)
    per_rank = [_flat_view(graph, x, [world, -1]) for x in inputs]
    return call(graph, aten.view.default, call(graph, aten.cat.default, per_rank, 1), [-1])


def _bucket_reduces(
    graph: fx.Graph, reduces: list[fx.Node], pos: dict[fx.Node, int], priority: dict[fx.Node, float], opaque: bool,
    replacer: Replacer,
) -> None:
    op, world, group = reduces[0].args[1:]
    last = reduces[-1]
    with graph.inserting_before(last):
        flat = _rank_major(graph, [r.args[0] for r in reduces], world, opaque)
        reduce = call(graph, c10d.reduce_scatter_tensor.default, flat, op, world, group)
        reduce.meta[PARAMS] = tuple(name for r in reduces for name in r.meta[PARAMS])
        wait = call(graph, c10d.wait_tensor.default, reduce)
    for n in exclusive_inputs(reduce) + [reduce]:
        priority[n] = pos[last]
    priority[wait] = pos[wait_of(last)]
    _slice_back(graph, wait, reduces, priority, lambda _: pos[wait_of(last)], replacer)


def _bucket_exchanges(
    graph: fx.Graph, exchanges: list[fx.Node], pos: dict[fx.Node, int], priority: dict[fx.Node, float], opaque: bool,
    replacer: Replacer,
) -> None:
    """Even all-to-alls (quantized reductions' int8 chunks) as one: each member's input laid out
    rank-major (``[world, its chunk]``), side by side, exchanged, and each member's columns of
    the ``[world, total]`` result copied back out as its own result, at the last member's wait."""
    world, group = len(arg(exchanges[0], "output_split_sizes")), arg(exchanges[0], "group_name")
    sizes = [val(e.args[0]).numel() // world for e in exchanges]
    total, last = sum(sizes), exchanges[-1]
    with graph.inserting_before(last):
        flat = _rank_major(graph, [e.args[0] for e in exchanges], world, opaque)
        exchange = call(graph, c10d.all_to_all_single.default, flat, [total] * world, [total] * world, group)
        exchange.meta[PARAMS] = tuple(name for e in exchanges for name in e.meta[PARAMS])
        wait = call(graph, c10d.wait_tensor.default, exchange)
        by_rank = call(graph, aten.view.default, wait, [world, total])
    for n in exclusive_inputs(exchange) + [exchange]:
        priority[n] = pos[last]
    at = pos[wait_of(last)]
    priority[wait] = priority[by_rank] = at
    if opaque:  # one opaque copy for all (as a gather bucket's copy-out): no narrow_copy for Inductor to decompose
        with graph.inserting_before(wait_of(exchanges[0])):
            parts = call(graph, COPY_OUT, by_rank, world, sizes)
        priority[parts] = at
    offset = 0
    for i, (e, n) in enumerate(zip(exchanges, sizes)):
        old_wait = wait_of(e)
        with graph.inserting_before(old_wait):
            # [world, n]: its chunk from each rank
            part = call(graph, operator.getitem, parts, i) if opaque else call(graph, aten.narrow_copy.default, by_rank, 1, offset, n)
            received = _view(graph, part, list(val(old_wait).shape))
        priority[part] = priority[received] = at
        offset += n
        replacer.replace(old_wait, received)
        replacer.erase(e)


def _bucket_all_reduces(
    graph: fx.Graph, reduces: list[fx.Node], pos: dict[fx.Node, int], priority: dict[fx.Node, float], opaque: bool,
    replacer: Replacer,
) -> None:
    op, group = reduces[0].args[1:]
    last = reduces[-1]
    with graph.inserting_before(last):
        if opaque:
            flat = call(graph, COPY_IN, [r.args[0] for r in reduces], 1)
        else:
            flat = call(graph, aten.cat.default, [_flat_view(graph, r.args[0], [-1]) for r in reduces])
        reduce = call(graph, c10d.all_reduce.default, flat, op, group)
        reduce.meta[PARAMS] = tuple(name for r in reduces for name in r.meta[PARAMS])
        wait = call(graph, c10d.wait_tensor.default, reduce)
    for n in exclusive_inputs(reduce) + [reduce]:
        priority[n] = pos[last]
    priority[wait] = pos[wait_of(last)]
    _slice_back(graph, wait, reduces, priority, lambda old_wait: pos[old_wait], replacer)


def _slice_back(
    graph: fx.Graph, wait: fx.Node, members: list[fx.Node], priority: dict[fx.Node, float], at: Callable[[fx.Node], float],
    replacer: Replacer,
) -> None:
    """Replace each member's wait by its slice of the flat result ``wait`` (members laid out
    one after another), placed at ``at(old wait)``; erase the members."""
    offset = 0
    for r in members:
        old_wait = wait_of(r)
        shape = list(val(old_wait).shape)
        n = math.prod(shape)
        with graph.inserting_before(old_wait):
            sliced = call(graph, aten.slice.Tensor, wait, 0, offset, offset + n)
            part = _view(graph, sliced, shape)
        priority[part] = priority[sliced] = at(old_wait)
        offset += n
        replacer.replace(old_wait, part)
        replacer.erase(r)


# Rewritten in this order: all-reduces may take reduce-scatters' (or quantized reductions') results (hybrid sharding).
_REWRITES = {
    c10d.all_gather_into_tensor.default: _bucket_gathers,
    c10d.reduce_scatter_tensor.default: _bucket_reduces,
    c10d.all_to_all_single.default: _bucket_exchanges,
    c10d.all_reduce.default: _bucket_all_reduces,
}


def planned_buckets(graph: fx.Graph, bucket_mb: float | None = None, all_reduce_blocks: int = 1) -> dict[Any, list[list[fx.Node]]]:
    """The buckets :func:`bucket_collectives` makes of ``graph``'s per-parameter collectives,
    by op (in rewrite order; a bucket of one is left as it is), without changing the graph.
    ``all_reduce_blocks``: blocks per all-reduce bucket (the backend option)."""
    bucket_bytes = mib_to_bytes(bucket_mb)
    return {op: plan_buckets([n for n in collectives(graph, op) if PARAMS in n.meta], bucket_bytes,
                             all_reduce_blocks if op is c10d.all_reduce.default else 1) for op in _REWRITES}


def bucket_collectives(
    gm: fx.GraphModule, bucket_mb: float | None = None, opaque_copies: bool = False, all_reduce_blocks: int = 1
) -> fx.GraphModule:
    """Replace the per-parameter all-gathers, reduce-scatters, all-reduces and even all-to-alls
    (quantized reductions) of a forward or backward graph by one flat collective per bucket
    (see :func:`plan_buckets`).

    Guarantees: numerics unchanged (gathers: shards are concatenated, gathered, and each
    parameter copied out of the rank-major result; reduce-scatters: each gradient is laid out
    rank-major, concatenated, reduced and sliced back; all-reduces: gradients are flattened,
    concatenated, reduced and sliced back; all-to-alls: each input laid out rank-major, side by
    side, exchanged, and each member's columns copied out); a bucket's collective sits where its first
    member was (gathers) or its last member was (reductions), so the graph keeps "gather at
    use, reduce at end" until a scheduling pass moves it. Copy-out nodes are tagged
    ``meta["autoshard_gathered"]``; the collective's ``meta["autoshard_params"]`` lists its
    parameters.

    ``opaque_copies``: each bucket's copy-in and copy-out is one ``autoshard::copy_in`` /
    ``autoshard::copy_out`` call, which a kernel compiler cannot fuse (FSDP2 copies alike).
    The copy-out sits at the bucket's first use, and each parameter is taken out of its
    result right there (those ``getitem`` nodes carry the tag). Inductor then compiles the
    parameters' consumers and the gradients' producers as for the unsharded model, into the
    same kernels for every block; fused, the copies at each bucket's offsets made kernels of
    their own.

    ``all_reduce_blocks``: the all-reduces of that many consecutive blocks share a bucket
    (the backend option of that name); gathers and reduce-scatters keep one per block.
    """
    graph = gm.graph
    pos = positions(graph.nodes)  # priorities refer to the order before any rewrite
    priority: dict[fx.Node, float] = {}
    replacer = Replacer(graph)
    # Planned before any rewrite: a rewrite leaves the other kinds' collectives as they are.
    for op, buckets in planned_buckets(graph, bucket_mb, all_reduce_blocks).items():
        for bucket in buckets:
            if len(bucket) > 1:
                _REWRITES[op](graph, bucket, pos, priority, opaque_copies, replacer)
    replacer.finish()
    for node in graph.nodes:
        priority.setdefault(node, pos.get(node, 0.0))
    return reorder(gm, priority)
