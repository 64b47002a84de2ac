"""Lower autoshard's annotation ops to traceable c10d collectives."""
from __future__ import annotations

import operator

import torch
from torch import fx

from autoshard._compat import c10d, must_recompute
from autoshard.runtime.ops import chunk_rows
from autoshard.runtime.quantize import DEQUANTIZE, DEQUANTIZE_MEAN, QUANTIZE, QUANTIZE_CHUNKS, packed_numel

from .graph_utils import PARAMS, Replacer, arg, call, is_op, named_args, positions, val
from .hpz import NodeGathered, gather_within_nodes, view_chain
from .keep import KEPT_BLOCKS, extra_blocks, kept_for_backward

aten = torch.ops.aten
annotations = torch.ops.autoshard

# Offset so our recompute regions never share an id with the user's checkpoint regions.
_AC_GRAPH_ID_BASE = 1 << 20


# A parameter whose rows do not divide evenly is padded (and cut back) on *every* rank, by zero
# rows where its shard is full: ranks then compile the same graph, so no scheduler (ours or
# PyTorch's) can see different nodes on different ranks and decide differently.


def _uneven(rows: int, world: int) -> bool:
    return chunk_rows(rows, world) * world != rows


# Where the rows a node has depend on the rank (``shard``), its pad and its cut are ops no
# compiler takes for no-ops on the ranks where nothing is cut or padded: Inductor's partitioner
# drops a constant_pad_nd or a slice that changes nothing, which left the ranks whose shard is
# full with fewer nodes than the others, and its schedule with other positions.


def _pad_rows(graph: fx.Graph, x: fx.Node, rows: int, shard: bool = False) -> fx.Node:
    if shard:
        return call(graph, annotations.pad_shard.default, x, rows)
    missing = rows - val(x).shape[0]
    if missing == 0:
        return x
    return call(graph, aten.constant_pad_nd.default, x, [0, 0] * (val(x).dim() - 1) + [0, missing], 0.0)


def _take_rows(graph: fx.Graph, x: fx.Node, rows: int, shard: bool = False) -> fx.Node:
    have = val(x).shape[0]
    if shard:  # a view, as the slice: [rows, the rest]
        return call(graph, operator.getitem, call(graph, aten.split_with_sizes.default, x, [rows, have - rows]), 0)
    if rows == have:
        return x
    return call(graph, aten.slice.Tensor, x, 0, 0, rows)


def _cast(graph: fx.Graph, x: fx.Node, dtype: torch.dtype | None) -> fx.Node:
    if dtype is None or dtype == val(x).dtype:
        return x
    return call(graph, torch.ops.prims.convert_element_type.default, x, dtype)


def _all_reduce(graph: fx.Graph, x: fx.Node, group: str, name: str) -> fx.Node:
    reduce = call(graph, c10d.all_reduce.default, x, "avg", group)
    reduce.meta[PARAMS] = (name,)
    return call(graph, c10d.wait_tensor.default, reduce)


def _shared_rows(rows: tuple[int, ...] | list[int] | None) -> bool:
    """Whether state shares cut a parameter unevenly (``rows``: every rank's rows)."""
    return bool(rows) and len(set(rows)) > 1


def _join_rows(graph: fx.Graph, gathered: fx.Node, rows: list[int]) -> tuple[fx.Node, list[fx.Node]]:
    """Rank r's first ``rows[r]`` rows of its ``max(rows)``-row block of ``gathered``,
    concatenated (ops.join_rows), and the nodes made."""
    widest = max(rows)
    split = call(graph, aten.split_with_sizes.default, gathered, [n for r in rows for n in (r, widest - r)])
    pieces = [call(graph, operator.getitem, split, 2 * r) for r in range(len(rows))]
    full = call(graph, aten.cat.default, pieces)
    return full, [split, *pieces, full]


def _spread_rows(graph: fx.Graph, grad: fx.Node, rows: list[int]) -> fx.Node:
    """Each rank's rows of ``grad`` padded to ``max(rows)``, rank after rank (ops.spread_rows)."""
    split = call(graph, aten.split_with_sizes.default, grad, list(rows))
    pieces = [_pad_rows(graph, call(graph, operator.getitem, split, r), max(rows)) for r in range(len(rows))]
    return call(graph, aten.cat.default, pieces)


def _gather(graph: fx.Graph, padded: fx.Node, world: int, group: str, name: str, block: int,
            dtype: torch.dtype | None, codec: str = "int8") -> list[fx.Node]:
    """The gather of a padded shard ``[chunk, ...]``, the last node its ``[world * chunk, ...]``
    result; with ``block`` (compression), of its int8 packing (``codec`` "fp8": float8 e4m3
    bytes), dequantized to ``dtype`` after the wait: [quantize_blocks ->] all_gather -> wait
    [-> dequantize_blocks]."""
    extra = () if codec == "int8" else (codec,)  # int8, the ops' default: the graphs as before fp8
    moved = call(graph, QUANTIZE, padded, block, *extra) if block else padded  # int8 [nb * (block + 4)]
    gather = call(graph, c10d.all_gather_into_tensor.default, moved, world, group)
    gather.meta[PARAMS] = (name,)
    wait = call(graph, c10d.wait_tensor.default, gather)
    if not block:
        return [gather, wait]
    shape = list(val(padded).shape)
    return [moved, gather, wait, call(graph, DEQUANTIZE, wait, world, block, shape, dtype or val(padded).dtype, *extra)]


def _lower_unshard(graph: fx.Graph, node: fx.Node, region: int = 0) -> tuple[fx.Node, list[fx.Node], NodeGathered | None]:
    """(the full value, the nodes made, what a gather within the node needs where the op has a node_size)."""
    a = named_args(node)
    shard, group, world, dim0, name = a["shard"], a["group_name"], a["world_size"], a["dim0"], a["name"]
    block = a.get("quant_block", 0) if world > 1 else 0
    # On the shard: the gather moves the low precision (quantized gathers start from the shard's own).
    cast = shard if block else _cast(graph, shard, a["param_dtype"])
    if world == 1:
        return cast, [cast] if cast is not shard else [], None
    shared = _shared_rows(a.get("rows"))
    chunk = max(a["rows"]) if shared else chunk_rows(dim0, world)
    padded = _pad_rows(graph, cast, chunk, shard=shared or _uneven(dim0, world))
    *moved, gathered = _gather(graph, padded, world, group, name, block, a["param_dtype"], a.get("quant_codec", "int8"))

    def finish(graph: fx.Graph, gathered: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
        return _join_rows(graph, gathered, list(a["rows"])) if shared else (_take_rows(graph, gathered, dim0), [])

    full, joined = finish(graph, gathered)
    node = NodeGathered(name, gathered, full, a["node_group"], a["node_size"], region, finish) if a.get("node_size") else None
    return full, [n for n in dict.fromkeys((cast, padded, *moved, gathered, *joined, full)) if n is not shard], node


def _exchange_quantized(graph: fx.Graph, padded: fx.Node, world: int, group: str, name: str, block: int) -> fx.Node:
    """A quantized reduction of the padded gradient ``[world * chunk, ...]`` (ZeRO++'s qgZ):
    quantize_chunks -> all_to_all_single of int8 -> wait -> dequantize_mean, this rank's
    ``[chunk, ...]`` averaged in float32."""
    shape = list(val(padded).shape)
    chunk = [shape[0] // world, *shape[1:]]
    sizes = [packed_numel(val(padded).numel() // world, block)] * world
    packed = call(graph, QUANTIZE_CHUNKS, padded, world, block)  # int8 [world * sizes[0]]
    exchange = call(graph, c10d.all_to_all_single.default, packed, sizes, sizes, group)
    exchange.meta[PARAMS] = (name,)
    wait = call(graph, c10d.wait_tensor.default, exchange)
    return call(graph, DEQUANTIZE_MEAN, wait, world, block, chunk)


def _lower_reduce_grad(graph: fx.Graph, node: fx.Node) -> fx.Node:
    a = named_args(node)
    group, world, name = a["group_name"], a["world_size"], a["name"]
    block = a.get("reduce_block", 0) if world > 1 else 0
    grad = a["grad"] if block else _cast(graph, a["grad"], a["reduce_dtype"])  # quantized from the gradient's own
    shared = _shared_rows(a.get("rows"))
    uneven = world > 1 and (shared or _uneven(val(grad).shape[0], world))
    if world > 1:
        if shared:
            padded = _spread_rows(graph, grad, list(a["rows"]))
        else:
            padded = _pad_rows(graph, grad, chunk_rows(val(grad).shape[0], world) * world)
        if block:
            grad = _exchange_quantized(graph, padded, world, group, name, block)
        else:
            reduce = call(graph, c10d.reduce_scatter_tensor.default, padded, "avg", world, group)
            reduce.meta[PARAMS] = (name,)
            grad = call(graph, c10d.wait_tensor.default, reduce)
    if a["replicas"] > 1:  # on the padded shard: the same shape on every rank
        grad = _all_reduce(graph, grad, a["replica_group"], name)
    return _cast(graph, _take_rows(graph, grad, a["shard_rows"], shard=uneven), a["out_dtype"])


def _lower_all_reduce_grad(graph: fx.Graph, node: fx.Node) -> fx.Node:
    a = named_args(node)
    grad = _cast(graph, a["grad"], a["reduce_dtype"])
    if a["world_size"] > 1:
        grad = _all_reduce(graph, grad, a["group_name"], a["name"])
    if a["replicas"] > 1:
        grad = _all_reduce(graph, grad, a["replica_group"], a["name"])
    return _cast(graph, grad, a["out_dtype"])


def lower_annotations(gm: fx.GraphModule, reshard_after_forward: bool | None = None,
                      budget_bytes: int | None = None, keep_at_most: int | None = None) -> fx.GraphModule:
    """Replace every autoshard annotation op with c10d functional collectives.

    Guarantees: ``unshard`` becomes [cast] -> pad -> all_gather_into_tensor -> wait_tensor ->
    slice (with the op's ``quant_block``, compression: pad -> quantize_blocks ->
    all_gather_into_tensor of int8 -> wait_tensor -> dequantize_blocks to ``param_dtype`` ->
    slice, no cast; the gradient path is unchanged, straight through), ``reduce_grad``
    becomes [cast] -> pad -> reduce_scatter_tensor(avg) -> wait_tensor
    [-> all_reduce(avg) over the replica group -> wait_tensor] -> slice [-> cast] (with the
    op's ``reduce_block``, compression: pad -> quantize_chunks -> all_to_all_single of int8 ->
    wait_tensor -> dequantize_mean, float32, no cast before; bucketing merges these
    all-to-alls as it merges reduce-scatters),
    Under uneven state shares (the ops' ``rows``) every shard is padded to ``max(rows)``: the
    gather's result is split and its real rows concatenated, and the gradient is split by
    ``rows``, each piece padded, concatenated and reduce-scattered, then cut to this rank's
    rows. ``all_reduce_grad`` becomes [cast] -> all_reduce(avg) -> wait_tensor [-> the same over
    the replica group] [-> cast] and ``replicate`` its input [cast] (casts only where a
    mixed-precision dtype differs; pads and slices only where dim 0 does not divide evenly, and
    then on every rank, by zero rows where the shard is full; no collective over a group of
    one rank). Each collective records its parameter name in
    ``meta["autoshard_params"]``. A gradient sent to a sink (synchronisation off) has no
    collective: autograd already routed it there.
    Gathers to reshard (the op's flag, or ``reshard_after_forward`` when given; a flag of
    None: all but those :func:`passes.keep.kept_for_backward` keeps within ``budget_bytes``,
    no more than ``keep_at_most`` blocks beyond the first, on a joint graph; how many it kept
    beyond the first is ``gm.meta["autoshard_kept_blocks"]``) and the views of their results
    are tagged MUST_RECOMPUTE, so a
    partitioned forward saves their shards, not the full parameters. A resharded gather whose
    op has a ``node_size`` G (``reshard_after_forward=G``) also gets :mod:`passes.hpz`'s
    hierarchical backward: its node slice of the gathered padded tensor tagged MUST_SAVE, and
    the backward's uses reading a gather of the slices over ``node_group`` (G ranks). Numerics are the annotation ops' run eagerly
    (unchanged, or quantized alike); the pass is idempotent.
    """
    graph = gm.graph
    if not any(graph.find_nodes(op="call_function", target=getattr(annotations, name).default)
               for name in ("unshard", "reduce_grad", "all_reduce_grad", "replicate")):
        return gm  # already lowered (the partitioned graphs of a joint graph): no lint, no recompile
    replacer = Replacer(graph)
    undecided: dict[str, tuple[int, fx.Node, list[fx.Node]]] = {}  # flag None: name -> (region, full, created)
    within_nodes: list[NodeGathered] = []  # reshard_after_forward=G: gathered again within the node
    for i, node in enumerate(list(graph.nodes)):
        if node.op != "call_function":
            continue
        recompute: list[fx.Node] = []
        with graph.inserting_before(node):
            if is_op(node, annotations.unshard):
                out, created, hierarchical = _lower_unshard(graph, node, _AC_GRAPH_ID_BASE + i)
                reshard = arg(node, "reshard") if reshard_after_forward is None else reshard_after_forward
                if reshard is None and created:
                    undecided[arg(node, "name")] = (i, out, created)
                elif reshard:
                    recompute = created
                    within_nodes += [hierarchical] if hierarchical is not None else []
            elif is_op(node, annotations.reduce_grad):
                out = _lower_reduce_grad(graph, node)
            elif is_op(node, annotations.all_reduce_grad):
                out = _lower_all_reduce_grad(graph, node)
            elif is_op(node, annotations.replicate):
                out = _cast(graph, arg(node, "tensor"), arg(node, "param_dtype"))
            else:
                continue
        replacer.replace(node, out)
        if recompute:
            for n in recompute + view_chain(out):  # else the partitioner saves a view as large as the weight
                must_recompute(n, _AC_GRAPH_ID_BASE + i)
    replacer.finish()  # the output reads the lowered nodes: the liveness the keeping reads
    gather_within_nodes(graph, within_nodes)  # passes/hpz.py
    fulls = {name: full for name, (_, full, _) in undecided.items()}
    order = positions(graph.nodes)
    kept = kept_for_backward(graph, fulls, order, budget_bytes, keep_at_most)
    gm.meta[KEPT_BLOCKS] = extra_blocks(kept, fulls, order)
    for name, (i, full, created) in undecided.items():
        if name not in kept:
            for n in created + view_chain(full):
                must_recompute(n, _AC_GRAPH_ID_BASE + i)
    graph.lint()
    gm.recompile()
    return gm
