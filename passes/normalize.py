"""Drop collectives whose results nothing uses.

The partitioner copies a resharded parameter's gather into the backward when the forward needs
it, even where no backward node reads the result (a graph that ends at the gathered weight,
e.g. an embedding read before a graph break): ``wait_tensor`` is side-effecting, so its dead
code elimination keeps the gather and its wait. Left in, such a gather moves bytes for nothing
and breaks every pass that places a collective at its first use.
"""
from __future__ import annotations

from torch import fx

from .graph_utils import collective_kind, is_wait, outputs_of


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


def drop_unused_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove every collective none of whose results (its waits, their views and copy-outs)
    reaches a node outside them or the graph's output, then the copy-ins and casts left
    feeding nothing.

    Guarantees: a collective stays iff something computes with or returns its result; every
    remaining node is kept in place. The decision reads only the graph's structure, so ranks
    compiling the same graph drop the same collectives. Numerics are unchanged.

        before: shard -> pad -> all_gather -> wait -> slice        (slice feeds nothing)
        after:  shard
    """
    graph = gm.graph
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
    if unused:
        graph.lint()
        gm.recompile()
    return gm


def _erase(graph: fx.Graph, node: fx.Node) -> list[fx.Node]:
    inputs = list(node.all_input_nodes)
    graph.erase_node(node)
    return inputs
