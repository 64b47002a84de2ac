"""The step simulator: one training step played from its final forward and backward graphs.

Compute runs on one stream; each process group has its own communication stream. Durations
come from :mod:`autoshard.cost_model`; memory is tracked per rank by liveness of tensor
storages. Works on graphs compiled under the fake process group with fake or meta tensors,
so any world size and model size can be simulated without their memory.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch import fx

from autoshard.compiler.cost_model import DeviceProfile, collective_of, collective_time, get_profile, node_time
from autoshard.passes.graph_utils import COLLECTIVE_KINDS, GATHERED, PARAMS, collective_kind, is_view, is_wait, tensor_bytes


@dataclass(frozen=True)
class Event:
    """One interval on a lane: "compute", or "comm:<group>" for a process group's stream.

    stage is "forward" or "backward" (node names repeat across the two graphs); a collective
    carries its kind, full-buffer bytes and the parameters it moves (empty if unknown).
    """

    lane: str
    name: str
    start: float
    end: float
    stage: str
    kind: str = "compute"
    nbytes: int = 0
    params: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepAnalysis:
    """Predicted time (seconds) and memory (bytes per rank) of one training step.

    Guaranteed (up to float rounding): ``max(compute_time, max(comm_by_group)) <= step_time <=
    compute_time + comm_time``, ``0 <= exposed_comm <= comm_time``, ``0 <= overlap_ratio <= 1``,
    ``step_lower_bound <= step_time``. ``timeline`` holds every collective and every compute node
    of nonzero time, in program order; ``memory_curve`` the live bytes after each node starts.
    """

    step_time: float
    compute_time: float  # sum of compute node times
    comm_time: float  # sum of collective durations, all groups
    comm_by_group: dict[str, float]  # busy time of each process group's stream
    exposed_comm: float  # step_time - compute_time: communication nothing hid
    overlap_ratio: float  # hidden / total communication; 1.0 without communication
    comm_bytes: dict[str, int]  # per collective kind, full-buffer convention of collective_time
    peak_bytes: int  # peak of live tensor storages
    peak_gathered_bytes: int  # peak of live gathered-parameter storages
    # No order of the same nodes beats this: compute, plus the shortest forward gather before
    # any compute that needs a parameter, plus the shortest backward reduction after the last
    # compute feeding one (less any compute free to run meanwhile); or the busiest comm stream.
    step_lower_bound: float
    # No order of the same compute beats this: at each node, everything but gathered
    # parameters (shards, batch, activations, gradients) plus the gathered storages that
    # node reads; the largest such total.
    memory_lower_bound: int
    timeline: list[Event] = field(repr=False)
    memory_curve: list[tuple[float, int]] = field(repr=False)


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
            f"autoshard.tools.simulator.analyze: backward takes {len(saved_inputs)} saved values but forward returns only "
            f"{len(outputs)} outputs: not an AOT autograd forward/backward pair; pass the forward and backward of one compiled graph."
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
    clock = compute_time = 0.0
    stream_free: dict[str, float] = {}  # per process group
    busy: dict[str, float] = {}
    ends: dict[fx.Node, float] = {}
    comm_bytes = dict.fromkeys(COLLECTIVE_KINDS, 0)
    timeline: list[Event] = []
    starts: list[float] = []  # compute clock when each node of ``order`` starts
    for stage, node in order:
        starts.append(clock)
        collective = collective_of(node)
        if collective is not None:
            kind, nbytes, group, ranks = collective
            # Issued when compute reaches it; each group's stream runs its collectives in order.
            start = max(clock, stream_free.get(group, 0.0))
            duration = collective_time(kind, nbytes, ranks, profile)
            stream_free[group] = ends[node] = start + duration
            # Where collectives take cycles from compute, compute loses that share meanwhile.
            clock += (1 - profile.comm_overlap) * duration
            busy[group] = busy.get(group, 0.0) + duration
            comm_bytes[kind] += nbytes
            params = tuple(node.meta.get(PARAMS, ()))
            timeline.append(Event(f"comm:{group}", node.name, start, start + duration, stage, kind, nbytes, params))
        elif is_wait(node):
            clock = max(clock, ends.get(_issuer(node.args[0], sources), 0.0))
        elif duration := node_time(node, profile):
            timeline.append(Event("compute", node.name, clock, clock + duration, stage))
            clock += duration
            compute_time += duration
    # A collective nobody waits for still has to finish within the step.
    step_time = max([clock, *stream_free.values()])
    comm_time = sum(busy.values())
    exposed = step_time - compute_time
    # exposed <= comm_time holds exactly (compute only stalls while a comm stream is busy);
    # the clamp only absorbs rounding.
    overlap = 1.0 if comm_time == 0 else min(1.0, max(0.0, (comm_time - exposed) / comm_time))
    return dict(
        step_time=step_time,
        compute_time=compute_time,
        comm_time=comm_time,
        comm_by_group=busy,
        exposed_comm=exposed,
        overlap_ratio=overlap,
        comm_bytes=comm_bytes,
        timeline=timeline,
        starts=starts,
    )


def _element_values(node: fx.Node) -> list:
    value = node.meta.get("val")
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _memory(order: list[tuple[str, fx.Node]], sources: dict[fx.Node, fx.Node], has_backward: bool) -> dict:
    """Live bytes after each node allocates, their peak, the gathered peak, and the lower
    bound of :class:`StepAnalysis`.

    A storage is allocated when its node runs and freed after its last use through any
    alias. Views, getitem and wait_tensor alias their input; a backward placeholder aliases
    the saved forward value it receives. Pinned until the end of the step: forward
    placeholders (owned by the caller: parameter shards, the batch), forward user outputs
    and backward outputs (gradients). Gathered storages: all-gather outputs and the storage
    of any node tagged ``meta[GATHERED]`` (bucket copy-outs).
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

    read_gathered: list[set[int]] = [set() for _ in range(end + 1)]  # gathered storages each node reads

    def use(nodes: list[fx.Node], pos: int) -> None:
        for arg in nodes:
            for s in storages.get(arg, ()):
                last_use[s] = max(last_use[s], pos)
                if gathered[s]:
                    read_gathered[pos].add(s)

    saved = set(sources.values())
    for pos, (stage, node) in enumerate(order):
        base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        base_storages = storages.get(base, [])
        if node in sources:
            storages[node] = storages[sources[node]]
        elif node.op == "call_function" and node.target is operator.getitem and len(base_storages) > node.args[1]:
            storages[node] = [base_storages[node.args[1]]]
        elif (is_view(node, hidden=True) or is_wait(node)) and base_storages:
            storages[node] = [base_storages[0]] * len(_element_values(node))
        elif node.op != "output":
            storages[node] = allocate(node, pos)
        if node.op == "call_function" and (collective_kind(node) == "all_gather" or node.meta.get(GATHERED)):
            for s in storages[node]:
                gathered[s] = True
        use(node.all_input_nodes, pos)
        if is_wait(node):
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
    live, live_gathered = _live(alloc, free), _live(alloc_gathered, free_gathered)
    return dict(
        live=live[:end],
        peak=max(live),
        peak_gathered=max(live_gathered),
        lower_bound=max(
            a - g + sum(size[s] for s in reads) for a, g, reads in zip(live, live_gathered, read_gathered)
        ),
    )


def _live(alloc: list[int], free: list[int]) -> list[int]:
    # At each position a node's outputs and inputs are live together: allocate, measure, free.
    live, curve = 0, []
    for added, removed in zip(alloc, free):
        live += added
        curve.append(live)
        live -= removed
    return curve


def _free_compute(gm: fx.GraphModule, profile: DeviceProfile, *, after_collectives: bool) -> float:
    """Compute time of ``gm``'s nodes unrelated to its collectives: not depending on any
    (``after_collectives=False``: what can run before the first gather lands) or not feeding
    any (``after_collectives=True``: what can run while the last reduction is on the wire)."""
    nodes = list(gm.graph.nodes)
    tied: set[fx.Node] = set()
    if after_collectives:
        for node in reversed(nodes):
            if collective_of(node) is not None or any(u in tied for u in node.users):
                tied.add(node)
    else:
        for node in nodes:
            if collective_of(node) is not None or any(a in tied for a in node.all_input_nodes):
                tied.add(node)
    return sum(node_time(n, profile) for n in nodes if n not in tied)


def _step_lower_bound(forward: fx.GraphModule, backward: fx.GraphModule | None, sim: dict, profile: DeviceProfile) -> float:
    def shortest(gm: fx.GraphModule | None, kinds: tuple[str, ...]) -> float:
        times = [
            collective_time(c.kind, c.nbytes, c.ranks, profile)
            for n in (gm.graph.nodes if gm is not None else ())
            if (c := collective_of(n)) is not None and c.kind in kinds
        ]
        return min(times, default=0.0)

    head = max(0.0, shortest(forward, ("all_gather",)) - _free_compute(forward, profile, after_collectives=False))
    tail = 0.0
    if backward is not None:
        tail = shortest(backward, ("reduce_scatter", "all_reduce"))
        tail = max(0.0, tail - _free_compute(backward, profile, after_collectives=True))
    return max(sim["compute_time"] + head + tail, max(sim["comm_by_group"].values(), default=0.0))


def analyze(forward: fx.GraphModule, backward: fx.GraphModule | None, profile: str | DeviceProfile) -> StepAnalysis:
    """Simulate one training step of a partitioned forward/backward pair (one rank).

    Nodes run in graph order, forward then backward, on one compute stream; collectives are
    issued when compute reaches them and run one at a time on their process group's stream;
    a ``wait_tensor`` stalls compute until its collective ends. ``backward=None`` analyses
    the forward alone (inference). Deterministic; linear in the number of nodes.
    """
    profile = get_profile(profile)
    stages = [("forward", forward)] + ([("backward", backward)] if backward is not None else [])
    order = [(stage, node) for stage, gm in stages for node in gm.graph.nodes]
    sources = _saved_sources(forward, backward)
    sim = _simulate(order, sources, profile)
    mem = _memory(order, sources, backward is not None)
    starts = sim.pop("starts")
    return StepAnalysis(
        **sim,
        peak_bytes=mem["peak"],
        peak_gathered_bytes=mem["peak_gathered"],
        step_lower_bound=_step_lower_bound(forward, backward, sim, profile),
        memory_lower_bound=mem["lower_bound"],
        memory_curve=list(zip(starts, mem["live"])),
    )
