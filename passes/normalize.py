"""Collectives as the later passes expect them: each has exactly one wait, and a use.

Two things break that after partitioning. The partitioner copies a resharded parameter's
gather into the backward when the forward needs it, even where no backward node reads the
result (a graph that ends at the gathered weight, e.g. an embedding read before a graph
break): ``wait_tensor`` is side-effecting, so its dead code elimination keeps the gather and
its wait. Left in, such a gather moves bytes for nothing
and breaks every pass that places a collective at its first use. And the partitioner's
common-subexpression elimination (Inductor's partitioner runs it) merges two collectives of
one value into one with two waits: in a ResNet block, the main path's last BatchNorm and the
shortcut's BatchNorm get the same bias gradient, so their two reduce-scatters are one node.
"""
from __future__ import annotations

from torch import fx

from .graph_utils import collective_kind, is_wait, outputs_of, positions
from .hpz import regather_within_nodes


def _dead(node: fx.Node) -> bool:
    return not node.users and node.op == "call_function" and (is_wait(node) or not node.is_impure())


def _results(collective: fx.Node) -> set[fx.Node]:
    found = {collective}
    for wait in collective.users:
        found |= outputs_of(wait) if is_wait(wait) else {wait}
    return found


def _unused(collective: fx.Node) -> bool:
    results = _results(collective)
    return all(u in results for r in results for u in r.users)


def normalize_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Give every collective one wait (the first; later waits of it are replaced by it), then
    remove every collective none of whose results (its waits, their views and copy-outs)
    reaches a node outside them or the graph's output, then the copy-ins and casts left
    feeding nothing.

    Guarantees: every collective has exactly one ``wait_tensor``; a collective stays iff
    something computes with or returns its result; every remaining node keeps its place. The
    decision reads only the graph's structure, so ranks compiling the same graph drop the same
    collectives. First, a backward holding a parameter's node gather (``reshard_after_forward=G``)
    reads it where it read the forward's gather over every rank (:func:`passes.hpz.regather_within_nodes`),
    which then goes unread. Numerics are unchanged.

        before: g -> reduce_scatter -> wait1 -> ... wait2 -> x     (one collective, two waits)
        after:  g -> reduce_scatter -> wait1 -> ... x               (x reads wait1)

        before: shard -> pad -> all_gather -> wait -> slice        (slice feeds nothing)
        after:  shard
    """
    graph = gm.graph
    merged = regather_within_nodes(graph)
    pos = positions(graph.nodes)
    for node in graph.nodes:
        if collective_kind(node) is None:
            continue
        waits = sorted((u for u in node.users if is_wait(u)), key=pos.__getitem__)
        if len(waits) > 1:
            first, *later = waits  # the earliest: every use of a later one comes after it
            for wait in later:
                wait.replace_all_uses_with(first)
                graph.erase_node(wait)
                merged = True
    unused = [n for n in graph.nodes if collective_kind(n) is not None and _unused(n)]
    for node in unused:
        inputs = set(node.all_input_nodes)
        results = _results(node)
        while results:  # closed under users: erase each once nothing uses it
            leaf = next(r for r in results if not r.users)
            results.discard(leaf)
            graph.erase_node(leaf)
        while inputs:  # the pads and casts that only fed it
            inputs = {a for n in inputs if _dead(n) for a in _erase(graph, n)}
    if merged or unused:
        graph.lint()
        gm.recompile()
    return gm


def _erase(graph: fx.Graph, node: fx.Node) -> list[fx.Node]:
    inputs = list(node.all_input_nodes)
    graph.erase_node(node)
    return inputs
