"""The step simulator: one training step played from its final forward and backward graphs.

Compute runs on one stream; each process group has its own communication stream. Durations
come from :mod:`autoshard.cost_model`; memory is tracked per rank by liveness of tensor
storages (:mod:`autoshard.cost.liveness`), each attributed to what it holds. Works on graphs
compiled under the fake process group with fake or meta tensors, so any world size and model
size can be simulated without their memory.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import fx

from autoshard.cost.cost_model import (
    DeviceProfile,
    collective_of,
    collective_time,
    expert_parallel_parts,
    get_profile,
    node_time,
    schedule_config,
)
from autoshard.cost.liveness import CATEGORIES, Liveness, MemoryPeak, Order, categorize, issuer, peak_of, saved_sources
from autoshard.passes.graph_utils import COLLECTIVE_KINDS, PARAMS, is_wait
from autoshard.passes.schedule_config import ScheduleConfig
from autoshard.runtime.errors import UsageError
from autoshard.runtime.expert_ops import EXPERT_PARALLEL, EXPERT_PARALLEL_BACKWARD

ALL_TO_ALL = "all_to_all"  # an expert-parallel op's exchanges: a kind of event and of comm_bytes
EVENT_KINDS = (*COLLECTIVE_KINDS, ALL_TO_ALL)
_EXPERT_OPS = (EXPERT_PARALLEL, EXPERT_PARALLEL_BACKWARD)


@dataclass(frozen=True)
class Event:
    """One interval on a lane: "compute", or "comm:<group>" for a process group's stream.

    stage is "forward" or "backward" (node names repeat across the two graphs); a collective
    carries its kind, full-buffer bytes, the parameters it moves (empty if unknown) and
    ``exposed``: the step time it added (compute stalled at its wait, the step's tail it
    ran past the last compute, and compute slowed while it ran; see ``comm_overlap``).
    """

    lane: str
    name: str
    start: float
    end: float
    stage: str
    kind: str = "compute"
    nbytes: int = 0
    params: tuple[str, ...] = ()
    exposed: float = 0.0


@dataclass(frozen=True)
class Stall:
    """An interval in which compute waited for the collective ``name`` (of ``stage``), or the
    step ran on after its last compute to finish it: exposed communication, seen as a gap."""

    start: float
    end: float
    stage: str
    name: str


@dataclass(frozen=True)
class StepAnalysis:
    """Predicted time (seconds) and memory (bytes per rank) of one training step.

    Guaranteed (up to float rounding): ``max(compute_time, max(comm_by_group)) <= step_time <=
    compute_time + comm_time``, ``0 <= exposed_comm <= comm_time``, ``0 <= overlap_ratio <= 1``,
    ``step_lower_bound <= step_time``; the collectives' ``exposed`` sum to ``exposed_comm``.
    ``timeline`` holds every collective and every compute node of nonzero time, in program
    order; ``memory_curve`` the live bytes after each node starts; ``memory_by_category`` the
    same split by what the bytes hold (keys of :data:`autoshard.cost.liveness.CATEGORIES`):
    at every point the categories sum to the curve.

    ``energy_j``: joules of one step on one rank: ``compute_time`` at the profile's busy power
    (communication hidden behind compute costs nothing more: the device is busy anyway) plus
    ``exposed_comm`` at its idle power (the rank waits on the network). Every rank is taken to
    do the same work, so a step over all ranks costs ``world_size`` times this. None when the
    profile has no power figures.
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
    energy_j: float | None
    timeline: list[Event] = field(repr=False)
    memory_curve: list[tuple[float, int]] = field(repr=False)
    memory_by_category: dict[str, list[int]] = field(default_factory=dict, repr=False)
    memory_peak: MemoryPeak | None = field(default=None, repr=False)  # where the peak is, what is alive there
    stalls: list[Stall] = field(default_factory=list, repr=False)  # the exposed intervals, in time order


@dataclass(frozen=True)
class Simulation:
    """One simulated training step and what it was played from: the final ``forward`` and
    ``backward`` graphs (None: inference), the ``profile``, the :class:`StepAnalysis`, and each
    process group's ranks (read while the groups lived: the mixed-cluster simulator replays
    the graphs later). What the report draws and the planner compares; neither recomputes it."""

    forward: fx.GraphModule
    backward: fx.GraphModule | None
    profile: DeviceProfile
    analysis: StepAnalysis
    group_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)


def simulate(forward: fx.GraphModule, backward: fx.GraphModule | None, profile: str | DeviceProfile) -> Simulation:
    """The :class:`Simulation` of :func:`analyze`'s step. Call it while the process group the
    graphs were compiled on is still initialised: collectives are priced by their group's ranks."""
    profile = get_profile(profile)
    groups = {c.group: tuple(c.ranks) for gm in (forward, backward) if gm is not None
              for n in gm.graph.nodes if (c := collective_of(n)) is not None}
    return Simulation(forward, backward, profile, analyze(forward, backward, profile), groups)


def _simulate(order: Order, sources: dict[fx.Node, fx.Node], profile: DeviceProfile, config: ScheduleConfig) -> dict:
    clock = compute_time = 0.0
    stream_free: dict[str, float] = {}  # per process group
    busy: dict[str, float] = {}
    ends: dict[fx.Node, float] = {}
    comm_bytes = dict.fromkeys(EVENT_KINDS, 0)
    timeline: list[Event] = []
    event_of: dict[fx.Node, int] = {}  # collective -> its index in timeline
    exposed: dict[fx.Node, float] = {}
    stalls: list[Stall] = []
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
            exposed[node] = config.figures.caller_cost(duration)
            clock += exposed[node]
            busy[group] = busy.get(group, 0.0) + duration
            comm_bytes[kind] += nbytes
            params = tuple(node.meta.get(PARAMS, ()))
            event_of[node] = len(timeline)
            timeline.append(Event(f"comm:{group}", node.name, start, start + duration, stage, kind, nbytes, params))
        elif is_wait(node):
            waited = issuer(node.args[0], sources)
            if ends.get(waited, 0.0) > clock:  # compute stalls until the collective ends
                stalls.append(Stall(clock, ends[waited], timeline[event_of[waited]].stage, waited.name))
                exposed[waited] += ends[waited] - clock
                clock = ends[waited]
        elif node.target in _EXPERT_OPS:
            # The op runs its all-to-alls inside, blocking: each waits for its group's stream
            # and compute waits for it, so each is exposed whole (dispatch, experts, combine).
            parts = expert_parallel_parts(node, profile)

            def exchange(name: str, duration: float, nbytes: int) -> float:  # the clock after it
                start = max(clock, stream_free.get(parts.group, 0.0))
                end = stream_free[parts.group] = start + duration
                busy[parts.group] = busy.get(parts.group, 0.0) + duration
                comm_bytes[ALL_TO_ALL] += nbytes
                timeline.append(Event(f"comm:{parts.group}", name, start, end, stage, ALL_TO_ALL, nbytes, exposed=end - clock))
                if end > clock:
                    stalls.append(Stall(clock, end, stage, name))
                return end

            clock = exchange(f"{node.name}.dispatch", *parts.dispatch)
            timeline.append(Event("compute", node.name, clock, clock + parts.compute, stage))
            clock += parts.compute
            compute_time += parts.compute
            clock = exchange(f"{node.name}.combine", *parts.combine)
        elif duration := node_time(node, profile):
            timeline.append(Event("compute", node.name, clock, clock + duration, stage))
            clock += duration
            compute_time += duration
    # A collective nobody waits for still has to finish within the step: the tail past the
    # last compute goes to the collectives running in it, each for the part it extends.
    step_time, covered = max([clock, *stream_free.values()]), clock
    for node in sorted((n for n in ends if ends[n] > clock), key=lambda n: (ends[n], event_of[n])):
        if ends[node] > covered:
            stalls.append(Stall(covered, ends[node], timeline[event_of[node]].stage, node.name))
            exposed[node] += ends[node] - covered
            covered = ends[node]
    for node, i in event_of.items():
        timeline[i] = dataclasses.replace(timeline[i], exposed=exposed[node])
    comm_time = sum(busy.values())
    exposed_comm = step_time - compute_time
    # exposed <= comm_time holds exactly (compute only stalls while a comm stream is busy);
    # the clamp only absorbs rounding.
    overlap = 1.0 if comm_time == 0 else min(1.0, max(0.0, (comm_time - exposed_comm) / comm_time))
    return dict(
        step_time=step_time,
        compute_time=compute_time,
        comm_time=comm_time,
        comm_by_group=busy,
        exposed_comm=exposed_comm,
        overlap_ratio=overlap,
        comm_bytes=comm_bytes,
        timeline=timeline,
        stalls=sorted(stalls, key=lambda s: s.start),
        starts=starts,
    )


def _memory(order: Order, sources: dict[fx.Node, fx.Node], starts: list[float], config: ScheduleConfig) -> dict:
    """Live bytes after each node allocates (in total and per category), their peak and what
    is alive there, the gathered peak, and the lower bound of :class:`StepAnalysis`.
    Gathered storages: all-gather outputs and the storage of any node tagged
    ``meta[GATHERED]`` (bucket copy-outs)."""
    held = config.collectives
    live = Liveness(order, sources, config.workspace, held.late_release, held.copies_input)
    categorize(live, order, sources)
    total, gathered = live.curve(), live.curve(gathered=True)
    by_category = {c: live.curve(c) for c in CATEGORIES}
    end = live.end
    pos = max(range(end), key=lambda i: (total[i], -i)) if end else 0  # the first position of the peak
    sizes = [s.nbytes for s in live.storages]
    return dict(
        memory_curve=list(zip(starts, total[:end])),
        memory_by_category={c: curve[:end] for c, curve in by_category.items()},
        memory_peak=peak_of(live, pos, starts[pos] if end else 0.0, order, by_category),
        peak_bytes=max(total),
        peak_gathered_bytes=max(gathered),
        memory_lower_bound=max(
            a - g + sum(sizes[s] for s in reads) for a, g, reads in zip(total, gathered, live.reads_gathered)
        ),
    )


def _energy(sim: dict, profile: DeviceProfile) -> float | None:
    """Joules of one step on one rank (:attr:`StepAnalysis.energy_j`)."""
    if profile.busy_power_w is None or profile.idle_power_w is None:
        return None
    return sim["compute_time"] * profile.busy_power_w + sim["exposed_comm"] * profile.idle_power_w


def kwh_per_million_tokens(energy_j_per_rank: float, world_size: int, tokens_per_step: int) -> float:
    """kWh that a million tokens cost when one step costs ``energy_j_per_rank`` joules on
    each of ``world_size`` ranks and trains on ``tokens_per_step`` tokens over all of them."""
    if world_size < 1 or tokens_per_step < 1:
        raise UsageError(f"autoshard.cost.simulator.kwh_per_million_tokens: world_size and tokens_per_step must be positive, "
                         f"got {world_size} and {tokens_per_step}; pass the ranks and the tokens one step trains on over all of them.")
    return energy_j_per_rank * world_size / 3.6e6 * 1e6 / tokens_per_step  # 1 kWh = 3.6e6 J


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
    the forward alone (inference). Deterministic; linear in the number of nodes. Energy as
    :attr:`StepAnalysis.energy_j` models it, on the profile's power figures.
    """
    profile = get_profile(profile)
    stages = [("forward", forward)] + ([("backward", backward)] if backward is not None else [])
    order = [(stage, node) for stage, gm in stages for node in gm.graph.nodes]
    sources = saved_sources(forward, backward)
    config = schedule_config(profile)  # what the scheduler priced the graphs with, as the profile says
    sim = _simulate(order, sources, profile, config)
    mem = _memory(order, sources, sim.pop("starts"), config)
    return StepAnalysis(**sim, **mem, step_lower_bound=_step_lower_bound(forward, backward, sim, profile),
                        energy_j=_energy(sim, profile))
