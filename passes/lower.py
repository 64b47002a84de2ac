"""Lower autoshard's annotation ops to traceable c10d collectives."""
from __future__ import annotations

import torch
from torch import fx

from autoshard._compat import c10d, must_recompute
from autoshard.ops import chunk_rows

from .graph_utils import PARAMS, call, is_op, is_view, val

aten = torch.ops.aten
annotations = torch.ops.autoshard

# Offset so our recompute regions never share an id with the user's checkpoint regions.
_AC_GRAPH_ID_BASE = 1 << 20


def _pad_rows(graph: fx.Graph, x: fx.Node, rows: int) -> fx.Node:
    missing = rows - val(x).shape[0]
    if missing == 0:
        return x
    return call(graph, aten.constant_pad_nd.default, x, [0, 0] * (val(x).dim() - 1) + [0, missing], 0.0)


def _take_rows(graph: fx.Graph, x: fx.Node, rows: int) -> fx.Node:
    if rows == val(x).shape[0]:
        return x
    return call(graph, aten.slice.Tensor, x, 0, 0, rows)


def _lower_unshard(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    shard, group, world, dim0, _, name = node.args
    if world == 1:
        return shard, []
    padded = _pad_rows(graph, shard, chunk_rows(dim0, world))
    gather = call(graph, c10d.all_gather_into_tensor.default, padded, world, group)
    gather.meta[PARAMS] = (name,)
    gathered = call(graph, c10d.wait_tensor.default, gather)
    full = _take_rows(graph, gathered, dim0)
    return full, [n for n in (padded, gathered.args[0], gathered, full) if n is not shard]


def _lower_reduce_grad(graph: fx.Graph, node: fx.Node) -> fx.Node:
    grad, group, world, rows, name = node.args
    if world == 1:
        return grad
    padded = _pad_rows(graph, grad, chunk_rows(val(grad).shape[0], world) * world)
    reduce = call(graph, c10d.reduce_scatter_tensor.default, padded, "avg", world, group)
    reduce.meta[PARAMS] = (name,)
    reduced = call(graph, c10d.wait_tensor.default, reduce)
    return _take_rows(graph, reduced, rows)


def _lower_all_reduce_grad(graph: fx.Graph, node: fx.Node) -> fx.Node:
    grad, group, world, name = node.args
    if world == 1:
        return grad
    reduce = call(graph, c10d.all_reduce.default, grad, "avg", group)
    reduce.meta[PARAMS] = (name,)
    return call(graph, c10d.wait_tensor.default, reduce)


def _view_chain(node: fx.Node) -> list[fx.Node]:
    """Views and dtype casts hanging off ``node``: the partitioner would otherwise save them
    (a transposed full weight is as large as the weight)."""
    chain, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if is_view(user) or user.target is torch.ops.prims.convert_element_type.default:
            chain.append(user)
            todo.extend(user.users)
    return chain


def lower_annotations(gm: fx.GraphModule, reshard_after_forward: bool | None = None) -> fx.GraphModule:
    """Replace every autoshard annotation op with c10d functional collectives.

    Guarantees: ``unshard`` becomes pad -> all_gather_into_tensor -> wait_tensor -> slice,
    ``reduce_grad`` becomes pad -> reduce_scatter_tensor(avg) -> wait_tensor -> slice,
    ``all_reduce_grad`` becomes all_reduce(avg) -> wait_tensor and ``replicate`` its input
    (pads and slices only where dim 0 does not divide evenly; at world size 1 no collective
    at all). Each collective records its parameter name in ``meta["autoshard_params"]``.
    Gathers to reshard (the op's flag, or ``reshard_after_forward`` when given) and
    the views of their results are tagged MUST_RECOMPUTE, so a partitioned forward saves
    shards, never full parameters. Numerics are unchanged; the pass is idempotent.
    """
    graph = gm.graph
    for i, node in enumerate(list(graph.nodes)):
        if node.op != "call_function":
            continue
        recompute: list[fx.Node] = []
        with graph.inserting_before(node):
            if is_op(node, annotations.unshard):
                out, created = _lower_unshard(graph, node)
                if node.args[4] if reshard_after_forward is None else reshard_after_forward:
                    recompute = created
            elif is_op(node, annotations.reduce_grad):
                out = _lower_reduce_grad(graph, node)
            elif is_op(node, annotations.all_reduce_grad):
                out = _lower_all_reduce_grad(graph, node)
            elif is_op(node, annotations.replicate):
                out = node.args[0]
            else:
                continue
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        if recompute:
            for n in recompute + _view_chain(out):
                must_recompute(n, _AC_GRAPH_ID_BASE + i)
    graph.lint()
    gm.recompile()
    return gm
