"""Static analysis of one training step from its final forward and backward graphs.

Simulates the step on one compute stream and one communication stream with
:mod:`autoshard.cost_model`, and tracks per-rank memory by liveness of tensor storages.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch import fx

from ._compat import c10d
from .cost_model import (
    COLLECTIVE_KINDS,
    DeviceProfile,
    collective_of,
    collective_time,
    get_profile,
    is_alias,
    node_time,
    tensor_bytes,
)

_wait = c10d.wait_tensor.default
_all_gathers = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_coalesced.default)


@dataclass(frozen=True)
class Event:
    """One interval on a lane ("compute" or "comm"); stage is "forward" or "backward"
    (node names repeat across the two graphs)."""

    lane: str
    name: str
    start: float
    end: float
    stage: str


@dataclass(frozen=True)
class StepAnalysis:
    """Predicted time (seconds) and memory (bytes per rank) of one training step.

    Guaranteed (up to float rounding): ``max(compute_time, comm_time) <= step_time <=
    compute_time + comm_time``, ``0 <= exposed_comm <= comm_time``, ``0 <= overlap_ratio <= 1``.
    ``timeline`` holds every collective and every compute node of nonzero time, in program order.
    """

    step_time: float
    compute_time: float  # sum of compute node times
    comm_time: float  # sum of collective durations
    exposed_comm: float  # step_time - compute_time: communication nothing hid
    overlap_ratio: float  # hidden / total communication; 1.0 without communication
    comm_bytes: dict[str, int]  # per collective kind, full-buffer convention of collective_time
    peak_bytes: int  # peak of live tensor storages
    peak_gathered_bytes: int  # peak of live gathered-parameter storages
    timeline: list[Event] = field(repr=False)


def _saved_sources(forward: fx.GraphModule, backward: fx.GraphModule | None) -> dict[fx.Node, fx.Node]:
    """Backward placeholder -> the forward node it receives, as AOT autograd pairs them:
    the backward takes the saved values (in order) then ``tangents_*``, and the forward
    returns its user outputs then the saved values."""
    if backward is None:
        return {}
    saved_inputs = [n for n in backward.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    outputs = forward.graph.output_node().args[0]
    if len(saved_inputs) > len(outputs):
        raise ValueError(
            f"backward takes {len(saved_inputs)} saved values but forward returns only {len(outputs)} "
            "outputs: not an AOT autograd forward/backward pair."
        )
    saved = outputs[len(outputs) - len(saved_inputs) :]
    return {bw: fw for bw, fw in zip(saved_inputs, saved) if isinstance(fw, fx.Node)}


def _issuer(node: fx.Node, sources: dict[fx.Node, fx.Node]) -> fx.Node:
    """The node a wait_tensor's argument comes from: through getitem (coalesced
    collectives) and from a backward placeholder to the forward node it receives."""
    while True:
        if node.op == "call_function" and node.target is operator.getitem:
            node = node.args[0]
        elif node in sources:
            node = sources[node]
        else:
            return node


def _simulate(order: list[tuple[str, fx.Node]], sources: dict[fx.Node, fx.Node], profile: DeviceProfile) -> dict:
    clock = comm_free = compute_time = comm_time = 0.0
    ends: dict[fx.Node, float] = {}
    comm_bytes = dict.fromkeys(COLLECTIVE_KINDS, 0)
    timeline: list[Event] = []
    for stage, node in order:
        collective = collective_of(node)
        if collective is not None:
            kind, nbytes, group_size = collective
            # Issued when compute reaches it; the single comm stream runs collectives in order.
            start = max(clock, comm_free)
            comm_free = ends[node] = start + collective_time(kind, nbytes, group_size, profile)
            comm_time += comm_free - start
            comm_bytes[kind] += nbytes
            timeline.append(Event("comm", node.name, start, comm_free, stage))
        elif node.op == "call_function" and node.target is _wait:
            clock = max(clock, ends.get(_issuer(node.args[0], sources), 0.0))
        elif duration := node_time(node, profile):
            timeline.append(Event("compute", node.name, clock, clock + duration, stage))
            clock += duration
            compute_time += duration
    # A collective nobody waits for still has to finish within the step.
    step_time = max(clock, comm_free)
    exposed = step_time - compute_time
    # exposed <= comm_time holds exactly (compute only stalls while the comm stream is busy);
    # the clamp only absorbs rounding.
    overlap = 1.0 if comm_time == 0 else min(1.0, max(0.0, (comm_time - exposed) / comm_time))
    return dict(
        step_time=step_time,
        compute_time=compute_time,
        comm_time=comm_time,
        exposed_comm=exposed,
        overlap_ratio=overlap,
        comm_bytes=comm_bytes,
        timeline=timeline,
    )


def _element_values(node: fx.Node) -> list:
    value = node.meta.get("val")
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _peaks(order: list[tuple[str, fx.Node]], sources: dict[fx.Node, fx.Node], has_backward: bool) -> tuple[int, int]:
    """Peak live bytes and peak live gathered bytes, by storage liveness in program order.

    A storage is allocated when its node runs and freed after its last use through any
    alias. Views, getitem and wait_tensor alias their input; a backward placeholder aliases
    the saved forward value it receives. Pinned until the end of the step: forward
    placeholders (owned by the caller: parameter shards, the batch), forward user outputs
    and backward outputs (gradients). Gathered storages: all-gather outputs and the storage
    of any node tagged ``meta["autoshard_gathered"]`` (bucket copy-outs).
    """
    end = len(order)
    size: list[int] = []
    gathered: list[bool] = []
    alloc_at: list[int] = []
    last_use: list[int] = []
    storages: dict[fx.Node, list[int]] = {}  # per output element; one list entry per tensor

    def allocate(node: fx.Node, pos: int) -> list[int]:
        ids = []
        for value in _element_values(node):
            ids.append(len(size))
            size.append(tensor_bytes(value))
            gathered.append(False)
            alloc_at.append(pos)
            last_use.append(pos)
        return ids

    def use(nodes: list[fx.Node], pos: int) -> None:
        for arg in nodes:
            for s in storages.get(arg, ()):
                last_use[s] = max(last_use[s], pos)

    saved = set(sources.values())
    for pos, (stage, node) in enumerate(order):
        base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        base_storages = storages.get(base, [])
        if node in sources:
            storages[node] = storages[sources[node]]
        elif node.op == "call_function" and node.target is operator.getitem and len(base_storages) > node.args[1]:
            storages[node] = [base_storages[node.args[1]]]
        elif node.op == "call_function" and (is_alias(node) or node.target is _wait) and base_storages:
            storages[node] = [base_storages[0]] * len(_element_values(node))
        elif node.op != "output":
            storages[node] = allocate(node, pos)
        if node.op == "call_function" and (node.target in _all_gathers or node.meta.get("autoshard_gathered")):
            for s in storages[node]:
                gathered[s] = True
        use(node.all_input_nodes, pos)
        if node.target is _wait:
            # The comm stream reads the collective's inputs until it ends, i.e. until the wait.
            use(_issuer(node.args[0], sources).all_input_nodes, pos)

        pinned: list[fx.Node] = []
        if node.op == "placeholder" and stage == "forward":
            pinned = [node]
        elif node.op == "output":
            pinned = node.all_input_nodes
            if stage == "forward" and has_backward:
                pinned = [n for n in pinned if n not in saved]
        use(pinned, end)

    alloc = [0] * (end + 1)
    alloc_gathered = [0] * (end + 1)
    free = [0] * (end + 1)
    free_gathered = [0] * (end + 1)
    for s, nbytes in enumerate(size):
        alloc[alloc_at[s]] += nbytes
        free[last_use[s]] += nbytes
        if gathered[s]:
            alloc_gathered[alloc_at[s]] += nbytes
            free_gathered[last_use[s]] += nbytes
    return _peak(alloc, free), _peak(alloc_gathered, free_gathered)


def _peak(alloc: list[int], free: list[int]) -> int:
    # At each position a node's outputs and inputs are live together: allocate, then measure, then free.
    live = peak = 0
    for added, removed in zip(alloc, free):
        live += added
        peak = max(peak, live)
        live -= removed
    return peak


def analyze(forward: fx.GraphModule, backward: fx.GraphModule | None, profile: str | DeviceProfile) -> StepAnalysis:
    """Predict one training step of a partitioned forward/backward pair (one rank).

    Nodes run in graph order, forward then backward, on one compute stream; collectives are
    issued when compute reaches them and run one at a time on one comm stream; a
    ``wait_tensor`` stalls compute until its collective ends. ``backward=None`` analyses
    the forward alone (inference). Deterministic; linear in the number of nodes.
    """
    profile = get_profile(profile)
    stages = [("forward", forward)] + ([("backward", backward)] if backward is not None else [])
    order = [(stage, node) for stage, gm in stages for node in gm.graph.nodes]
    sources = _saved_sources(forward, backward)
    peak_bytes, peak_gathered = _peaks(order, sources, backward is not None)
    return StepAnalysis(**_simulate(order, sources, profile), peak_bytes=peak_bytes, peak_gathered_bytes=peak_gathered)
