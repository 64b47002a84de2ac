"""Gather a parameter shared by several modules once and reduce its gradient once."""
from __future__ import annotations

import torch
from torch import fx

from .graph_utils import call, is_op

aten = torch.ops.aten
annotations = torch.ops.autoshard


def merge_shared_parameters(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge duplicate annotations of one parameter (tied weights) in a joint graph.

    Guarantees: ``unshard`` calls with identical arguments (same shard) become one node, and
    ``reduce_grad(a) + reduce_grad(b)`` with identical arguments becomes
    ``reduce_grad(a + b)``: one gather and one reduce per parameter. Exact, because the ops
    are pure and the averaging reduce is linear. Run before :func:`lower_annotations`.
    """
    graph = gm.graph
    first: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        if is_op(node, annotations.unshard):
            kept = first.setdefault(node.args, node)
            if kept is not node:
                node.replace_all_uses_with(kept)
                graph.erase_node(node)
        elif node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            if not all(isinstance(x, fx.Node) and is_op(x, annotations.reduce_grad) and len(x.users) == 1 for x in (a, b)):
                continue
            if a.args[1:] != b.args[1:]:
                continue
            with graph.inserting_before(node):
                summed = call(graph, aten.add.Tensor, a.args[0], b.args[0])
                merged = call(graph, a.target, summed, *a.args[1:])
            node.replace_all_uses_with(merged)
            for dead in (node, a, b):
                graph.erase_node(dead)
    graph.lint()
    gm.recompile()
    return gm
