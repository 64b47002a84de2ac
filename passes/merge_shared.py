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


def _key(node: fx.Node) -> tuple:
    """The op and its arguments but the parameter's name, which differs between the modules
    sharing it."""
    schema = node.target._schema.arguments
    return (node.target, *(a for a, s in zip(node.args, schema) if s.name != "name"))


def _reduced(node: object) -> list[fx.Node] | None:
    """If ``node`` is a single-use ``reduce_grad`` or ``all_reduce_grad``, possibly behind
    no-op views, the chain from the reduce to ``node``."""
    chain = []
    while isinstance(node, fx.Node) and len(node.users) == 1:
        chain.append(node)
        if is_op(node, annotations.reduce_grad) or is_op(node, annotations.all_reduce_grad):
            return chain[::-1]
        if not _is_noop_view(node):
            return None
        node = node.args[0]
    return None


def merge_shared_parameters(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge duplicate annotations of one parameter (tied weights) in a joint graph.

    Guarantees: ``unshard`` (or ``replicate``) calls with identical arguments (same shard)
    become one node, and ``reduce_grad(a) + reduce_grad(b)`` with identical arguments becomes
    ``reduce_grad(a + b)`` (the same for ``all_reduce_grad``): one gather and one reduce per
    parameter. Exact, because the ops are pure and the averaging reduce is linear (mixed
    precision: the sum is taken in the gradients' dtype, before the cast to the reduce dtype,
    as the backward of one use of the parameter would). Run before :func:`lower_annotations`.
    """
    graph = gm.graph
    first: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        if is_op(node, annotations.unshard) or is_op(node, annotations.replicate):
            shard = node.args[0]
            while _is_noop_view(shard):
                shard = shard.args[0]
            kept = first.setdefault((node.target, shard, *_key(node)[2:]), node)
            if kept is not node:
                node.replace_all_uses_with(kept)
                graph.erase_node(node)
        elif node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
            chains = [_reduced(arg) for arg in node.args]
            if None in chains:
                continue
            a_key, b_key = _key(chains[0][0]), _key(chains[1][0])
            if (a_key[0], *a_key[2:]) != (b_key[0], *b_key[2:]):  # all but the gradient itself
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
