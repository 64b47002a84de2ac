"""Small helpers shared by the graph passes: building nodes that carry fake values, finding
collectives, and reordering a graph by priorities."""
from __future__ import annotations

import heapq
from typing import Any, Iterable

import torch
from torch import fx

from autoshard._compat import c10d, tree_leaves, tree_map

# node.meta keys the passes share.
PARAMS = "autoshard_params"  # on a collective: names of the parameters it moves (a tuple)
GATHERED = "autoshard_gathered"  # on a copy-out node: its output is (part of) a gathered parameter


def val(node: Any) -> Any:
    """The fake value of a node (or the constant itself)."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    """Insert ``target(*args)`` at the graph's insertion point, with its fake value in
    ``meta["val"]`` so the partitioner and Inductor see shapes as for a traced node."""
    node = graph.call_function(target, args)
    fake_args = tree_map(val, args)
    fake = next(a for a in tree_leaves(fake_args) if isinstance(a, torch.Tensor)).fake_mode
    with fake:
        node.meta["val"] = target(*fake_args)
    return node


def is_op(node: fx.Node, op: Any) -> bool:
    """Whether ``node`` calls ``op`` (an OpOverloadPacket or OpOverload)."""
    return node.op == "call_function" and (node.target is op or getattr(node.target, "overloadpacket", None) is op)


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "is_view", False)


def collectives(graph: fx.Graph, op: Any) -> list[fx.Node]:
    """Calls of the c10d op ``op`` (an OpOverload), in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is op]


def wait_of(collective: fx.Node) -> fx.Node:
    """The ``wait_tensor`` of a functional collective (lowering gives each exactly one)."""
    (wait,) = [u for u in collective.users if u.target is c10d.wait_tensor.default]
    return wait


def outputs_of(wait: fx.Node) -> set[fx.Node]:
    """The wait and everything derived from it by views or copy-outs: the collective's result,
    before any computation uses it."""
    found, todo = set(), [wait]
    while todo:
        node = todo.pop()
        if node not in found:
            found.add(node)
            todo.extend(u for u in node.users if is_view(u) or u.meta.get(GATHERED))
    return found


_COPY_OPS = (torch.ops.aten.constant_pad_nd.default, torch.ops.aten.cat.default, torch.ops.aten.clone.default)


def is_copy(node: fx.Node) -> bool:
    """Data movement only: a view, pad, concatenation or copy."""
    return is_view(node) or (node.op == "call_function" and node.target in _COPY_OPS)


def exclusive_inputs(node: fx.Node) -> list[fx.Node]:
    """The copy-in of ``node``: views, pads, concatenations and copies computed only to feed
    it, in graph order. They can move with it."""
    chain: set[fx.Node] = set()
    changed = True
    while changed:  # grow to a fixpoint: a producer joins once all its users have
        changed = False
        for n in [node, *chain]:
            for a in n.all_input_nodes:
                if a not in chain and is_copy(a) and all(u is node or u in chain for u in a.users):
                    chain.add(a)
                    changed = True
    order = positions(node.graph.nodes)
    return sorted(chain, key=order.__getitem__)


def issue_inputs(node: fx.Node) -> list[fx.Node]:
    """What must move with a collective to issue it earlier: its copy-in, plus views of
    graph inputs it reads (free to compute at any point, even when shared)."""
    group = set(exclusive_inputs(node))
    for n in [node, *group]:
        for a in n.all_input_nodes:
            chain = []
            while is_view(a) and a not in group:
                chain.append(a)
                a = a.args[0]
            if a.op == "placeholder":
                group.update(chain)
    order = positions(node.graph.nodes)
    return sorted(group, key=order.__getitem__)


def reorder(gm: fx.GraphModule, priority: dict[fx.Node, float]) -> fx.GraphModule:
    """Put the nodes in the topological order that follows ``priority`` (lower first) as
    closely as dependencies allow; nodes without a priority keep their current position.

    Guarantees a valid order; deterministic (ties keep the current order).
    """
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    key = {n: (priority.get(n, float(i)), i) for n, i in index.items()}
    missing = {n: sum(1 for a in n.all_input_nodes if a in index) for n in nodes}
    ready = [key[n] + (n.name,) for n in nodes if missing[n] == 0]
    by_name = {n.name: n for n in nodes}
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        node = by_name[heapq.heappop(ready)[-1]]
        order.append(node)
        for user in node.users:
            if user in missing:
                missing[user] -= 1
                if missing[user] == 0:
                    heapq.heappush(ready, key[user] + (user.name,))
    assert len(order) == len(nodes), "graph has a cycle"
    output = graph.output_node()
    for node in order:
        output.prepend(node)
    graph.lint()
    gm.recompile()
    return gm


def nbytes(node: fx.Node) -> int:
    t = val(node)
    return t.numel() * t.element_size()


def positions(nodes: Iterable[fx.Node]) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(nodes)}
