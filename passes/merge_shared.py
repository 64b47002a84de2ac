"""Gather a parameter shared by several modules once and reduce its gradient once."""
from __future__ import annotations

import torch
from torch import fx

from autoshard.runtime.ops import arguments

from .graph_utils import arg, call, is_op, val

aten = torch.ops.aten
annotations = torch.ops.autoshard


def _is_noop_view(node: fx.Node) -> bool:
    # DTensor's to_local adds these (forward and backward): views to the very same shape.
    return node.target is aten.view.default and val(node).shape == val(node.args[0]).shape


def _key(node: fx.Node, *leave_out: str) -> tuple:
    """The op and its arguments but the parameter's name, which differs between the modules
    sharing it, and ``leave_out``."""
    named = arguments(node.target, node.args, node.kwargs)
    return (node.target, *(v for k, v in named.items() if k not in ("name", *leave_out)))


def _with(node: fx.Node, **changed: object) -> list:
    """``node``'s arguments in schema order, with ``changed`` ones replaced."""
    return list({**arguments(node.target, node.args, node.kwargs), **changed}.values())


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
            first_input = "shard" if is_op(node, annotations.unshard) else "tensor"
            shard = arg(node, first_input)
            while _is_noop_view(shard):
                shard = shard.args[0]
            kept = first.setdefault((shard, *_key(node, first_input)), node)
            if kept is not node:
                node.replace_all_uses_with(kept)
                graph.erase_node(node)
        elif node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
            chains = [_reduced(arg) for arg in node.args]
            if None in chains:
                continue
            if _key(chains[0][0], "grad") != _key(chains[1][0], "grad"):  # all but the gradient itself
                continue
            (a, *_), (b, *_) = chains
            with graph.inserting_before(node):
                summed = call(graph, aten.add.Tensor, arg(a, "grad"), arg(b, "grad"))
                merged = call(graph, a.target, *_with(a, grad=summed))
            node.replace_all_uses_with(merged)
            graph.erase_node(node)
            for dead in reversed(chains[0] + chains[1]):
                graph.erase_node(dead)
    graph.lint()
    gm.recompile()
    return gm
