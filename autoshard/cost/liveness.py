"""The memory side of the step simulator: every tensor storage of one step, when it is allocated
and freed, and what it holds (a parameter shard, a gathered parameter, a gradient, ...), read
from graph structure alone.

A storage is allocated when its node runs and freed after its last use through any alias.
Views, getitem and wait_tensor alias their input, a collective into a buffer (or in place) its
buffer; a backward placeholder aliases the saved forward value it receives. Pinned until the
end of the step: forward placeholders (owned by the caller: parameter shards, the batch), the
forward's user outputs and the backward's outputs (gradients). A value saved for the backward
dies at its last use there: the backend runs graphs in the boxed convention, so a compiled
backward owns what it takes. A collective whose profile stages its buffer (gloo) also holds a
workspace from its issue to its wait (to the next issue for the kinds the profile frees late);
one whose backend copies its input at the issue (gloo's reduce-scatter) no longer reads that
input after it.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Callable, Collection

import torch
from torch import fx

from autoshard.passes.graph_utils import GATHERED, PARAMS, block_of, collective_kind, is_copy, is_view, is_wait, out_buffer, tensor_bytes
from autoshard.passes.step_model import linger, never, reads_input_until_wait
from autoshard.runtime.errors import UsageError

Order = list[tuple[str, fx.Node]]  # (stage, node) in the order the step runs them

# What a storage holds, in the order the memory panel stacks them (long-lived at the bottom).
CATEGORIES: dict[str, str] = {
    "shards": "sharded parameters",
    "inputs": "inputs (batch, buffers)",
    "gradients": "gradients",
    "activations": "saved activations",
    "gathered": "gathered parameters",
    "comm_buffers": "collective buffers",
    "temporaries": "other temporaries",
}

_CAST = torch.ops.prims.convert_element_type.default


def saved_sources(forward: fx.GraphModule, backward: fx.GraphModule | None) -> dict[fx.Node, fx.Node]:
    """Backward placeholder -> the forward node it receives, as AOT autograd pairs them:
    the backward takes the saved values (in order) then ``tangents_*``, and the forward
    returns its user outputs then the saved values."""
    if backward is None:
        return {}
    saved_inputs = [n for n in backward.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    outputs = forward.graph.output_node().args[0]
    if len(saved_inputs) > len(outputs):
        raise UsageError(
            f"autoshard.cost.simulator.analyze: backward takes {len(saved_inputs)} saved values but forward returns only "
            f"{len(outputs)} outputs: not an AOT autograd forward/backward pair; pass the forward and backward of one compiled graph."
        )
    saved = outputs[len(outputs) - len(saved_inputs) :]
    return {bw: fw for bw, fw in zip(saved_inputs, saved) if isinstance(fw, fx.Node)}


def issuer(node: fx.Node, sources: dict[fx.Node, fx.Node]) -> fx.Node:
    """The node a wait_tensor's argument comes from: through getitem (coalesced
    collectives) and from a backward placeholder to the forward node it receives."""
    while True:
        if node.op == "call_function" and node.target is operator.getitem:
            node = node.args[0]
        elif node in sources:
            node = sources[node]
        else:
            return node


def _element_values(node: fx.Node) -> list:
    value = node.meta.get("val")
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass
class Storage:
    """One tensor storage: its bytes, the node (of ``stage``) that allocated it, the positions
    in the step's order where it is allocated and last used, and what it holds."""

    nbytes: int
    node: fx.Node
    stage: str
    alloc_at: int
    last_use: int
    gathered: bool = False
    category: str = "temporaries"

    def alive_at(self, pos: int) -> bool:
        return self.alloc_at <= pos <= self.last_use


class Liveness:
    """The storages of one step, built by walking ``order`` once.

    ``storages``: every storage, in allocation order; ``of``: node -> the storage of each of
    its output elements; ``reads_gathered[pos]``: the gathered storages the node at ``pos``
    reads (for the memory lower bound).
    """

    def __init__(
        self,
        order: Order,
        sources: dict[fx.Node, fx.Node],
        workspace: Callable[[fx.Node], int] | None = None,
        late_release: Collection[str] = (),
        input_copied: Callable[[fx.Node], bool] = never,
    ) -> None:
        self.end = len(order)
        self.storages: list[Storage] = []
        self.of: dict[fx.Node, list[int]] = {}
        self.workspaces: dict[fx.Node, int] = {}  # collective -> its workspace storage
        self.reads_gathered: list[set[int]] = [set() for _ in range(self.end + 1)]
        # For the kinds in late_release (gloo), a collective's input and workspace last until the next issue.
        issues = [i for i, (_, n) in enumerate(order) if collective_kind(n) is not None]

        def release(pos: int, collective: fx.Node) -> int:
            return linger(issues, pos) if collective_kind(collective) in late_release else pos
        saved = set(sources.values())
        for pos, (stage, node) in enumerate(order):
            self._place(node, stage, pos, sources)
            if workspace is not None and collective_kind(node) is not None and (extra := workspace(node)):
                self.workspaces[node] = len(self.storages)
                self.storages.append(Storage(extra, node, stage, pos, pos))
            self._use(node.all_input_nodes, pos)
            if is_wait(node):
                # The comm stream reads the collective's inputs until it ends, i.e. until the wait.
                collective = issuer(node.args[0], sources)
                if reads_input_until_wait(collective, input_copied):
                    self._use(collective.all_input_nodes, release(pos, collective))
                if collective in self.workspaces:
                    self.storages[self.workspaces[collective]].last_use = release(pos, collective)
            if node.op == "placeholder" and stage == "forward":
                self._use([node], self.end)
            elif node.op == "output":  # user outputs and gradients; saved values die in backward
                kept = [a for a in node.all_input_nodes if stage != "forward" or a not in saved]
                self._use(kept, self.end)

    def _place(self, node: fx.Node, stage: str, pos: int, sources: dict[fx.Node, fx.Node]) -> None:
        """Give ``node`` its storages: an alias's are its base's, anything else allocates."""
        base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        base_storages = self.of.get(base, [])
        if node in sources:
            self.of[node] = self.of[sources[node]]
        elif out_buffer(node) in self.of:  # a collective into a buffer returns the buffer
            self.of[node] = self.of[out_buffer(node)]
        elif node.op == "call_function" and node.target is operator.getitem and len(base_storages) > node.args[1]:
            self.of[node] = [base_storages[node.args[1]]]
        elif (is_view(node, hidden=True) or is_wait(node)) and base_storages:
            self.of[node] = [base_storages[0]] * len(_element_values(node))
        elif node.op != "output":
            first = len(self.storages)
            self.storages += [Storage(tensor_bytes(v), node, stage, pos, pos) for v in _element_values(node)]
            self.of[node] = list(range(first, len(self.storages)))
        # Gathered storages: all-gather outputs and bucket copy-outs (tagged by the bucketing pass).
        if node.op == "call_function" and (collective_kind(node) == "all_gather" or node.meta.get(GATHERED)):
            for s in self.of[node]:
                self.storages[s].gathered = True

    def _use(self, nodes: list[fx.Node], pos: int) -> None:
        for arg in nodes:
            for s in self.of.get(arg, ()):
                storage = self.storages[s]
                storage.last_use = max(storage.last_use, pos)
                if storage.gathered:
                    self.reads_gathered[pos].add(s)

    def curve(self, keep: str | None = None, *, gathered: bool = False) -> list[int]:
        """Live bytes at each position (and one past the end), of the storages of category
        ``keep`` (all when None), or of the gathered ones. At a position a node's outputs and
        inputs are live together: allocate, measure, then free what it used last."""
        alloc, free = [0] * (self.end + 1), [0] * (self.end + 1)
        for s in self.storages:
            if (keep is None or s.category == keep) and (s.gathered or not gathered):
                alloc[s.alloc_at] += s.nbytes
                free[s.last_use] += s.nbytes
        live, curve = 0, []
        for added, removed in zip(alloc, free):
            live += added
            curve.append(live)
            live -= removed
        return curve


# -- what each storage holds ---------------------------------------------------------------------


def copy_in(collective: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the views, pads, concatenations, copies and casts feeding ``collective``; the nodes
    that feed those and compute something)."""
    chain, producers, seen = [], [], set()
    todo = list(collective.all_input_nodes)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_copy(node) or (node.op == "call_function" and node.target is _CAST):
            chain.append(node)
            todo.extend(node.all_input_nodes)
        else:
            producers.append(node)
    return chain, producers


def categorize(live: Liveness, order: Order, sources: dict[fx.Node, fx.Node]) -> None:
    """Set each storage's ``category`` (a key of :data:`CATEGORIES`), the first that applies:

    1. ``shards``: forward placeholders that reach an all-gather through copies or get a
       gradient from the backward (AOT autograd returns one per forward input, None for the
       rest); ``inputs``: the other placeholders (batch, buffers, the backward's tangents).
    2. ``gathered``: all-gather outputs and bucket copy-outs.
    3. ``gradients``: what the backward returns (reduced shards) and what feeds a
       reduce-scatter or all-reduce once copies are skipped (unreduced gradients; a cast to
       the reduce dtype included).
    4. ``comm_buffers``: the other copy-ins of collectives (flat concatenations, pads) and
       their outputs: buffers alive while a collective is in flight.
    5. ``activations``: forward values saved for the backward.
    6. ``temporaries``: everything else.
    """
    claimed: list[str | None] = [None] * len(live.storages)

    def claim(nodes: list[fx.Node], category: str) -> None:
        for node in nodes:
            for s in live.of.get(node, ()):
                if claimed[s] is None:
                    claimed[s] = category

    forward_inputs = [n for stage, n in order if stage == "forward" and n.op == "placeholder"]
    outputs = [n for stage, n in order if stage == "backward" and n.op == "output"]
    gradients = list(outputs[0].args[0]) if outputs else []
    parameters = set()
    if len(gradients) == len(forward_inputs):
        parameters = {p for p, g in zip(forward_inputs, gradients) if isinstance(g, fx.Node)}
    gathers, reductions = [], []
    for _, node in order:
        kind = collective_kind(node)
        if kind is not None:
            (gathers if kind == "all_gather" else reductions).append((node, *copy_in(node)))
    for _, _, producers in gathers:
        parameters.update(sources.get(p, p) for p in producers if sources.get(p, p).op == "placeholder")

    claim([p for p in forward_inputs if p in parameters], "shards")
    claim([n for _, n in order if n.op == "placeholder" and n not in sources], "inputs")
    for s, storage in enumerate(live.storages):
        if storage.gathered and claimed[s] is None:
            claimed[s] = "gathered"
    claim([g for g in gradients if isinstance(g, fx.Node)], "gradients")
    for _, chain, producers in reductions:
        claim(producers + [n for n in chain if n.target is _CAST], "gradients")
    for node, chain, _ in gathers + reductions:
        claim(chain + [node], "comm_buffers")
    claim(list(sources.values()), "activations")
    for s in live.workspaces.values():
        claimed[s] = "comm_buffers"
    for storage, category in zip(live.storages, claimed):
        storage.category = category or "temporaries"


# -- naming what is alive --------------------------------------------------------------------------


def module_path(node: fx.Node) -> str | None:
    """The innermost module a node was traced in (``blocks.3.attn.qkv``), from Dynamo's
    ``nn_module_stack`` or, for backward nodes, the forward's (``fwd_nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    return str(list(stack.values())[-1][0]).removeprefix("L['self']").lstrip(".") or None


def parameters_label(names: tuple[str, ...]) -> str:
    """Parameters by the blocks they belong to: ``blocks.3.fc.weight``, or for a bucket
    ``wte.weight, blocks.0 (9 parameters)``."""
    if len(names) == 1:
        return names[0]
    groups = dict.fromkeys(block_of(n) or n for n in names)
    shown = ", ".join(list(groups)[:3]) + (", ..." if len(groups) > 3 else "")
    return f"{shown} ({len(names)} parameters)"


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def owner(node: fx.Node, limit: int = 64) -> str:
    """Who a storage belongs to: the module that made ``node``, or the parameters of the
    collective it feeds or came from, or the module of its nearest user, or else the source
    line that made it (``gpt.py:87``, code outside any submodule); "" if none."""
    todo, seen = [node], set()
    while todo and len(seen) < limit:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if names := n.meta.get(PARAMS):
            return parameters_label(tuple(names))
        if path := module_path(n):
            return path
        todo.extend(n.users)  # breadth first: the nearest user that knows
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    return f"{frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]}" if frames else ""


def describe(node: fx.Node) -> str:
    """A node's value as ``float32[1024, 768]`` (several for a tuple); "" without one."""
    values = [v for v in _element_values(node) if isinstance(v, torch.Tensor)]
    return ", ".join(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for v in values)


@dataclass(frozen=True)
class LiveTensor:
    """A storage alive at the memory peak: its bytes and category (a key of
    :data:`CATEGORIES`), the node (of ``stage``) that allocated it, its owner (module or
    parameters, "" if unknown) and its value (dtype and shape)."""

    nbytes: int
    category: str
    stage: str
    node: str
    owner: str
    value: str


@dataclass(frozen=True)
class MemoryPeak:
    """Where the memory peak is and what is alive there: the node running (of ``stage``) at
    simulated ``time``, the live bytes per category (summing to the peak) and the largest
    storages alive, largest first."""

    time: float
    stage: str
    node: str
    by_category: dict[str, int]
    largest: tuple[LiveTensor, ...]


def peak_of(live: Liveness, pos: int, time: float, order: Order, by_category: dict[str, list[int]], top: int = 10) -> MemoryPeak:
    """The :class:`MemoryPeak` at position ``pos`` of ``order``."""
    alive = sorted((s for s in live.storages if s.alive_at(pos) and s.nbytes), key=lambda s: -s.nbytes)[:top]
    stage, node = order[pos] if pos < len(order) else ("", None)
    return MemoryPeak(
        time, stage, node.name if node is not None else "",
        {c: curve[pos] for c, curve in by_category.items()},
        tuple(LiveTensor(s.nbytes, s.category, s.stage, s.node.name, owner(s.node), describe(s.node)) for s in alive),
    )
