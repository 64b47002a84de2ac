"""Gather a parameter shared by several modules once and reduce its gradient once."""
from __future__ import annotations

import torch
from torch import fx

from .graph_utils import call, is_op, val

aten = torch.ops.aten
annotations = torch.ops.autoshard


def _is_noop_view(node: fx.Node) -> bool:
    # DTensor's to_local adds these (forward and backward): views to the very same shape.
    return node.target is aten.view.default and val(node).shape == val(node.args[0]).shape


def _reduced(node: object) -> list[fx.Node] | None:
    """If ``node`` is a single-use ``reduce_grad``, possibly behind no-op views, the chain from
    the reduce to ``node``."""
    chain = []
    while isinstance(node, fx.Node) and len(node.users) == 1:
        chain.append(node)
        if is_op(node, annotations.reduce_grad):
            return chain[::-1]
        if not _is_noop_view(node):
            return None
        node = node.args[0]
    return None


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
            shard = node.args[0]
            while _is_noop_view(shard):
                shard = shard.args[0]
            kept = first.setdefault((shard, *node.args[1:-1]), node)  # the name may differ
            if kept is not node:
                node.replace_all_uses_with(kept)
                graph.erase_node(node)
        elif node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
            chains = [_reduced(arg) for arg in node.args]
            if None in chains or chains[0][0].args[1:-1] != chains[1][0].args[1:-1]:
                continue
            (a, *_), (b, *_) = chains
            with graph.inserting_before(node):
                summed = call(graph, aten.add.Tensor, a.args[0], b.args[0])
                merged = call(graph, a.target, summed, *a.args[1:])
            node.replace_all_uses_with(merged)
            graph.erase_node(node)
            for dead in reversed(chains[0] + chains[1]):
                graph.erase_node(dead)
    graph.lint()
    gm.recompile()
    return gm
