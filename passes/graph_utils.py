"""The graph helpers every pass and tool shares, each defined once: building nodes that carry
fake values, reading op arguments by name, recognising collectives and views, counting bytes,
looking up process groups, and reordering a graph by priorities.

Imports nothing from autoshard but ``_compat``, ``ops``, ``batched`` and ``fake_values`` (none imports back), so the cost
model, the simulator and the report can use it without an import cycle.
"""
from __future__ import annotations

import heapq
import operator
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import fx

from autoshard._compat import c10d, optimization_hint, resolve_process_group
from autoshard.runtime.batched import calls_of
from autoshard.runtime.ops import arguments

from .fake_values import fake_value

# The copies bucketing makes opaque (autoshard/runtime/ops.py): one per bucket, unfusable.
COPY_IN, COPY_OUT = torch.ops.autoshard.copy_in.default, torch.ops.autoshard.copy_out.default
# Zero rows appended: a shard's (autoshard::pad_shard, rank-dependent rows, opaque) or a
# full gradient's (the same on every rank).
PADS = (torch.ops.autoshard.pad_shard.default, torch.ops.aten.constant_pad_nd.default)

# node.meta keys the passes share.
PARAMS = "autoshard_params"  # on a collective: names of the parameters it moves (a tuple)
GATHERED = "autoshard_gathered"  # on a copy-out node: its output is (part of) a gathered parameter


def val(node: Any) -> Any:
    """The fake value of a node (or the constant itself)."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    """Insert ``target(*args)`` at the graph's insertion point, with its fake value in
    ``meta["val"]`` so the partitioner and Inductor see shapes as for a traced node.

    The passes insert thousands of nodes per graph: the value is computed without the fake
    mode's dispatch where shapes are static (:func:`fake_values.fake_value`)."""
    node = graph.call_function(target, args)
    if target is operator.getitem:  # one output of a node that returns several
        node.meta["val"] = val(args[0])[args[1]]
        return node
    # map_arg, not a pytree map: it visits only the nodes.
    node.meta["val"] = fake_value(target, fx.node.map_arg(args, val))
    return node


class Replacer:
    """Replace nodes by others in a pass, the graph's output last.

    The output of a backward graph reads hundreds of nodes (every gradient), and replacing
    one of them re-reads all of the output's arguments: a pass replacing each parameter's
    node one at a time was quadratic in parameters. Here every other use changes at once;
    the output's, for all replacements together, in :meth:`finish`, which then erases what
    was replaced (a node only the output read stays in the graph until then)."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph, self.output = graph, graph.output_node()
        self._later: dict[fx.Node, fx.Node] = {}  # what the output reads -> its replacement
        self._targets: set[fx.Node] = set()  # those replacements
        self._erase: list[fx.Node] = []

    def replace(self, old: fx.Node, new: fx.Node) -> None:
        """Every use of ``old`` becomes ``new``, and ``old`` is erased."""
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user is not self.output)
        if old.users or old in self._targets:  # the output reads it, now or after finish()
            self._later[old] = new
            self._targets.add(new)
        self.erase(old)

    def erase(self, node: fx.Node) -> None:
        """Erase ``node``: now, or in :meth:`finish` when a node erased there still uses it."""
        if node.users:
            self._erase.append(node)
        else:
            self.graph.erase_node(node)

    def finish(self) -> None:
        """Point the output at the replacements (followed through chains) and erase what
        waited for it; a node some other node still uses fails here, not silently later."""

        def new(n: fx.Node) -> fx.Node:
            while n in self._later:
                n = self._later[n]
            return n

        if self._later:
            self.output.args = fx.node.map_arg(self.output.args, new)
        for n in self._erase:
            self.graph.erase_node(n)
        self._later, self._targets, self._erase = {}, set(), []


def is_op(node: fx.Node, op: Any) -> bool:
    """Whether ``node`` calls ``op`` (an OpOverloadPacket or OpOverload)."""
    return node.op == "call_function" and (node.target is op or getattr(node.target, "overloadpacket", None) is op)


def arg(node: fx.Node, name: str) -> Any:
    """The argument ``name`` of an OpOverload call, by the op's schema: positional, keyword or
    its default. Passes read arguments this way, never by position."""
    return named_args(node)[name]


def named_args(node: fx.Node) -> dict[str, Any]:
    """Every argument of an OpOverload call by name (see :func:`arg`), for a pass that reads
    several: the schema is walked once."""
    return arguments(node.target, node.args, node.kwargs)


def parameter_reads(graph: fx.Graph) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Each parameter annotation of ``graph``: (``unshard`` or ``replicate``, its arguments by
    name), also those an ``unshard_all`` holds (autoshard/runtime/batched.py)."""
    for node in graph.nodes:
        if is_op(node, torch.ops.autoshard.unshard) or is_op(node, torch.ops.autoshard.replicate):
            yield node.target, named_args(node)
        elif is_op(node, torch.ops.autoshard.unshard_all):
            a = named_args(node)
            for tensor, (op, rest) in zip(a["tensors"], calls_of(a["key"])):
                yield op, arguments(op, (tensor, *rest))


def is_view(node: fx.Node, *, hidden: bool = False) -> bool:
    """Whether ``node`` only makes a view of its first input, as its schema declares.
    ``hidden``: also ``_unsafe_view``, a view whose schema hides the alias (for autograd's
    sake); storage accounting wants it, passes that follow schemas do not."""
    if node.op != "call_function":
        return False
    return getattr(node.target, "is_view", False) or (hidden and node.target is torch.ops.aten._unsafe_view.default)


# Every _c10d_functional op that starts communication, by the kind the cost model prices it as.
# all_gather_into_tensor_out is what PyTorch's bucketer (schedule "inductor") emits.
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_KIND_OF = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.all_gather_into_tensor_coalesced.default: "all_gather",
    c10d.all_gather_into_tensor_out.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_reduce_.default: "all_reduce",
    # What passes/gloo.py runs reduce-scatters as: the same bytes moved, then a local sum.
    c10d.all_to_all_single.default: "reduce_scatter",
    c10d.all_reduce_coalesced.default: "all_reduce",
}


def collective_kind(node: fx.Node) -> str | None:
    """``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"`` for a node that starts a
    collective; None for anything else, ``wait_tensor`` included."""
    return _KIND_OF.get(node.target) if node.op == "call_function" else None


def is_exchange(node: fx.Node) -> bool:
    """An all-to-all: a reduce-scatter's bytes, without the staging copy gloo makes of a
    reduce-scatter's input (passes/gloo.py)."""
    return node.op == "call_function" and node.target is c10d.all_to_all_single.default


def out_buffer(node: fx.Node) -> fx.Node | None:
    """The buffer a collective writes into and returns (its ``out``; its input for an in-place
    all-reduce), or the ``out`` of ``cat.out`` (passes/gloo.py concatenates shards into a
    gather's buffer); None for an out-of-place collective or anything else."""
    if node.op == "call_function" and node.target is torch.ops.aten.cat.out:
        return node.kwargs["out"]
    if node.op != "call_function" or collective_kind(node) is None:
        return None
    out = node.args[0] if node.target is c10d.all_reduce_.default else node.kwargs.get("out")
    return out if isinstance(out, fx.Node) else None



def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is c10d.wait_tensor.default


def collectives(graph: fx.Graph, op: Any) -> list[fx.Node]:
    """Calls of the c10d op ``op`` (an OpOverload), in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is op]


def group_ranks(group_name: str) -> tuple[int, ...] | None:
    """Global ranks of the process group called ``group_name``; None where this process does
    not know it (no process group, or a graph compiled elsewhere)."""
    if not dist.is_initialized():
        return None
    try:
        return tuple(dist.get_process_group_ranks(resolve_process_group(group_name)))
    except (RuntimeError, ValueError):
        return None


def group_rank(group_name: str) -> int:
    """This process's rank in the process group called ``group_name``."""
    return dist.get_rank(resolve_process_group(group_name))


def group_backend(group_name: str) -> str | None:
    """The backend (``"gloo"``, ``"nccl"``, ``"fake"`` ...) of the process group called
    ``group_name``; None where this process does not know it."""
    if not dist.is_initialized():
        return None
    try:
        return dist.get_backend(resolve_process_group(group_name))
    except (RuntimeError, ValueError):
        return None


def mib_to_bytes(mib: float | None) -> int | None:
    """A size option in MiB as bytes; None (no cap) stays None."""
    return None if mib is None else int(mib * 2**20)


def wait_of(collective: fx.Node) -> fx.Node:
    """The ``wait_tensor`` of a functional collective (lowering gives each exactly one)."""
    (wait,) = [u for u in collective.users if is_wait(u)]
    return wait


def outputs_of(wait: fx.Node) -> set[fx.Node]:
    """The wait and everything derived from it by views or copy-outs: the collective's result,
    before any computation uses it."""
    found, todo = set(), [wait]
    while todo:
        node = todo.pop()
        if node not in found:
            found.add(node)
            todo.extend(u for u in node.users if is_view(u) or u.meta.get(GATHERED) or u.target is COPY_OUT
                        or (u.target is operator.getitem and is_view(node)))  # a piece of split(...)
    return found


_COPY_OPS = (*PADS, torch.ops.aten.cat.default, torch.ops.aten.clone.default,
             torch.ops.aten.narrow_copy.default, COPY_IN, COPY_OUT)


def taken_from_copy_out(node: fx.Node) -> bool:
    """One parameter taken out of a bucket's copy-out: a new tensor, not a view of the list."""
    return node.op == "call_function" and node.target is operator.getitem and node.args[0].target is COPY_OUT


def is_copy(node: fx.Node) -> bool:
    """Data movement only: a view, pad, concatenation or copy (a bucket's opaque copies and
    the parameters taken out of a copy-out too)."""
    return taken_from_copy_out(node) or is_view(node) or (node.op == "call_function" and node.target in _COPY_OPS)


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
    return near(node, chain)


def near(anchor: fx.Node, members: Iterable[fx.Node]) -> list[fx.Node]:
    """``members`` (nodes of ``anchor``'s graph) in graph order.

    Walks from ``anchor`` backwards, then forwards, only until every member is found: copy-ins
    sit close to their collective, where numbering the whole graph would cost a scan of it per
    collective (quadratic in the graph's size)."""
    remaining = set(members)
    earlier: list[fx.Node] = []
    later: list[fx.Node] = []
    for found, step in ((earlier, "prev"), (later, "next")):
        node = getattr(anchor, step)
        while remaining and node.op != "root":  # the graph's sentinel, before its first node
            if node in remaining:
                remaining.discard(node)
                found.append(node)
            node = getattr(node, step)
    assert not remaining, "not every member is in the anchor's graph"
    return earlier[::-1] + later


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
    return near(node, group)


class Ordering:
    """:func:`ordered` for many priorities over one graph that does not change in between (a
    schedule search): the graph's dependencies are read once, as indices."""

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = [n for n in graph.nodes if n.op != "output"]
        self.index = index = {n: i for i, n in enumerate(self.nodes)}
        self.inputs = [sum(1 for a in n.all_input_nodes if a in index) for n in self.nodes]
        self.users = [[index[u] for u in n.users if u in index] for n in self.nodes]
        self._in_place = [(float(i), i) for i in range(len(self.nodes))]  # every node at its position

    def __call__(self, priority: dict[fx.Node, float]) -> list[fx.Node]:
        return [self.nodes[i] for i in self.indices(priority)]

    def indices(self, priority: dict[fx.Node, float]) -> list[int]:
        """The order as indices into ``self.nodes``."""
        users, index = self.users, self.index
        key = list(self._in_place)
        for node, p in priority.items():  # a search's priorities name only the nodes it moves
            i = index.get(node)
            if i is not None:
                key[i] = (p, i)
        missing = list(self.inputs)
        ready = [key[i] for i, m in enumerate(missing) if m == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)[1]
            order.append(i)
            for u in users[i]:
                missing[u] -= 1
                if missing[u] == 0:
                    heapq.heappush(ready, key[u])
        assert len(order) == len(self.nodes), "graph has a cycle"
        return order


def ordered(graph: fx.Graph, priority: dict[fx.Node, float]) -> list[fx.Node]:
    """The graph's nodes but the output, in the topological order that follows ``priority``
    (lower first) as closely as dependencies allow; nodes without a priority keep their
    current position. Deterministic (ties keep the current order); changes nothing."""
    return Ordering(graph)(priority)


def reorder(gm: fx.GraphModule, priority: dict[fx.Node, float]) -> fx.GraphModule:
    """Put the nodes in :func:`ordered`'s order. Guarantees a valid order; deterministic."""
    graph = gm.graph
    output = graph.output_node()
    for node in ordered(graph, priority):
        output.prepend(node)
    # No lint: only the order changed, and ordered() emits each node after its inputs (it
    # asserts it placed every node); a lint of a 48-layer graph costs 40 ms.
    gm.recompile()
    return gm


def _int(x: Any) -> int:
    # A symbolic size's hint, without adding guards; unbacked sizes count as 1.
    return optimization_hint(x, fallback=1) if isinstance(x, torch.SymInt) else int(x)


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or nested lists/tuples), in order."""
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or nested lists/tuples); others count 0.

    numel x element size: the bytes a kernel reads or writes, whatever the strides.
    """
    return sum(_int(t.numel()) * t.element_size() for t in tensors(value))


def nbytes(node: fx.Node) -> int:
    """Bytes of a node's fake value."""
    return tensor_bytes(node.meta.get("val"))


def block_of(name: str) -> str | None:
    """The repeated block a parameter belongs to: the path up to its first numeric component
    (``blocks.3.attn.qkv.weight`` -> ``blocks.3``), or None outside any ModuleList/Sequential."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def positions(nodes: Iterable[fx.Node]) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(nodes)}
