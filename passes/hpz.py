"""Hierarchical backward gathers (ZeRO++'s hpZ; ``autoshard.shard(model, reshard_after_forward=G)``,
:mod:`autoshard.runtime.hpz`): the backward gathers a parameter within its node of G ranks.

Requires: the joint graph, its annotations lowered by ``passes/lower.py``, which hands over,
for each resharded parameter whose op has a ``node_size``, its forward gather's padded result
(``[N * chunk, ...]``, after the wait or the dequantization) and its full value.
Provides: the backward's uses of those full values (and of the views and casts hanging off
them) read a gather over the node group instead; the forward saves each parameter's node slice.

Guarantees: after the forward's gathered padded tensor, ``node_slice`` (this rank's rows
``[l * M, (l + 1) * M)``, M = its rows / G, l = its rank in the node group, a new tensor) is
tagged MUST_SAVE; a second chain ``all_gather_into_tensor(slice, G, node_group) -> wait_tensor
-> the forward's own cut to the real rows`` (recorded in ``meta["autoshard_params"]``) and
copies of the forward's views and casts of the full value, each tagged MUST_RECOMPUTE in the
parameter's region, feed every node from the joint graph's first use of a tangent on (the
graph's output aside) that read the full value or those views. The forward's chain keeps its
tags, so a forward op the backward recomputes (the partitioner's choice for cheap ops, a
user's activation checkpointing) would gather over all N ranks again: on each partitioned
graph, :func:`regather_within_nodes` (called by ``passes/normalize.py``) points such reads at
the parameter's node gather where the backward has one, leaving the N-rank gather unread. A
parameter the joint backward never reads (a bias) has no slice saved: recomputed forward ops
still gather it over all N ranks, exact, only not hierarchical. Numerics are unchanged: the
node gather rebuilds the very tensor the forward gathered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from autoshard._compat import c10d, must_recompute, must_save
from autoshard.runtime.hpz import NODE_SLICE

from .graph_utils import PARAMS, call, is_view, positions
from .keep import backward_start

WORLD_GATHERED = "autoshard_hpz_world"  # meta: on the forward's padded gather result, its parameter's name
NODE_GATHERED = "autoshard_hpz_node"  # meta: on the node gather's wait, its parameter's name
# (graph, the node gather's padded result) -> (the full value, the nodes made): the forward's cut.
Finish = Callable[[fx.Graph, fx.Node], tuple[fx.Node, list[fx.Node]]]


@dataclass
class NodeGathered:
    """A lowered parameter to gather within its node in the backward."""

    name: str
    gathered: fx.Node  # the forward's padded gather result
    full: fx.Node  # the forward's full value
    group: str  # the node group
    size: int  # G
    region: int  # the recompute region of its forward chain
    finish: Finish


def view_chain(node: fx.Node) -> list[fx.Node]:
    """Views and dtype casts hanging off ``node``, transitively, in discovery order."""
    chain, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if is_view(user) or user.target is torch.ops.prims.convert_element_type.default:
            chain.append(user)
            todo.extend(user.users)
    return chain


def gather_within_nodes(graph: fx.Graph, params: list[NodeGathered]) -> None:
    """Rewire each of ``params``' backward uses to a gather over its node group (see the module docstring)."""
    if not params:
        return
    nodes = list(graph.nodes)
    order = positions(nodes)
    turn = backward_start(nodes, order)
    for p in params:
        forward = [n for n in [p.full, *view_chain(p.full)] if order.get(n, turn) < turn]
        in_forward = set(forward)
        # (a forward node of the chain, a backward node reading it)
        uses = [(n, u) for n in forward for u in n.users if u.op != "output" and order.get(u, -1) >= turn and u not in in_forward]
        if not uses:
            continue
        with graph.inserting_after(p.gathered):
            node_slice = call(graph, NODE_SLICE, p.gathered, p.group, p.size)
        must_save(node_slice)
        with graph.inserting_before(min((u for _, u in uses), key=order.__getitem__)):
            gather = call(graph, c10d.all_gather_into_tensor.default, node_slice, p.size, p.group)
            gather.meta[PARAMS] = (p.name,)
            wait = call(graph, c10d.wait_tensor.default, gather)
            p.gathered.meta[WORLD_GATHERED] = wait.meta[NODE_GATHERED] = p.name
            full, made = p.finish(graph, wait)
            copies = {p.full: full}

            def copy(n: fx.Node) -> fx.Node:
                if n not in copies:
                    copies[n] = graph.node_copy(n, lambda a: copy(a) if a in in_forward else a)
                    made.append(copies[n])
                return copies[n]

            for n, u in uses:
                u.replace_input_with(n, copy(n))
        for n in dict.fromkeys([gather, wait, *made, full]):
            must_recompute(n, p.region)


def regather_within_nodes(graph: fx.Graph) -> bool:
    """In a partitioned backward holding both a parameter's node gather and the forward's
    gather over all N ranks (the partitioner recomputes forward ops that read it: cheap
    pointwise ops, a user's activation checkpointing), every read of the N-rank gather's
    padded result reads the node gather's instead (the same tensor), the node gather moved
    before the first such read (it reads only the saved slice, an input); whether anything
    changed. The N-rank gather is then unread (``passes/normalize.py`` drops it)."""
    # A backward's node gathers: of the saved slice, an input.
    waits = {n.meta[NODE_GATHERED]: n for n in graph.nodes
             if NODE_GATHERED in n.meta and all(a.op == "placeholder" for a in n.args[0].all_input_nodes)}
    if not waits:
        return False
    order = positions(graph.nodes)
    changed = False
    for node in [n for n in graph.nodes if n.meta.get(WORLD_GATHERED) in waits and NODE_GATHERED not in n.meta]:
        wait = waits[node.meta[WORLD_GATHERED]]
        if not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        if order[wait] > order[first]:
            gather = wait.args[0]
            first.prepend(gather)
            first.prepend(wait)
            order[gather] = order[wait] = order[first]  # before first: nothing else compares against them
        node.replace_all_uses_with(wait)
        if node.target is not c10d.wait_tensor.default:  # a dequantization: pure, now unread
            graph.erase_node(node)
        changed = True
    return changed
