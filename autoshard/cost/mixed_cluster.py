"""One training step on a mixed cluster (:class:`autoshard.cost.cluster.Cluster`): every rank
type (node group) plays the same forward and backward graphs on its own profile and with its
own share of the global batch, all types side by side.

Compute scales with a rank's share: a node's time above its fixed launch and op overheads is
multiplied by ``share * world_size`` (1 for an even share), and so are the bytes the memory
model counts as batch, saved activations and temporaries (shards, gradients, gathered
parameters and collective buffers do not change). Communication is collective: a collective
whose process group spans several node groups starts when the last of its ranks issues it, on
the slowest link among them; one whose groups lie inside a node group (a hybrid shard group
inside a node type) runs on that type's own links, at that type's pace. So a faster type
waits at every collective it shares with a slower one, and the step is the slowest type's.
The graphs are rank 0's; every rank of a type is taken to run them alike.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autoshard.cost.cluster import Cluster
from autoshard.cost.cost_model import collective_of, collective_time, node_time, schedule_config
from autoshard.cost.liveness import issuer, saved_sources
from autoshard.passes.graph_utils import is_wait

SCALED = ("inputs", "activations", "temporaries")  # memory categories that grow with a rank's batch


@dataclass(frozen=True)
class TypeStep:
    """One rank type (node group) in a mixed step: its ranks, each rank's share of the global
    batch, its busy (compute) and waiting seconds, its predicted peak per rank (bytes, optimizer
    state included) and its memory limit (bytes; None: none)."""

    name: str
    ranks: int
    share: float
    busy: float
    wait: float
    peak_bytes: int
    limit_bytes: float | None
    price_per_hour: float | None = None
    state_share: float | None = None  # each rank's share of the state (parameters, gradients, optimizer); None: even

    @property
    def fits(self) -> bool:
        return self.limit_bytes is None or self.peak_bytes <= self.limit_bytes


def _coupled(ranks: tuple[int, ...], cluster: Cluster) -> bool:
    """Whether the groups of a collective (``ranks``: rank 0's) span node groups: rank 0's is
    a contiguous block that tiles every node group (a shard group inside a node type), or not."""
    n = len(ranks)
    return not (ranks == tuple(range(n)) and all(g.ranks % n == 0 for g in cluster.nodes))


def compute_scale(time: float, overhead: float, factor: float) -> float:
    """A compute node's seconds at ``factor`` times the even batch: what exceeds the fixed overheads scales."""
    return overhead + max(0.0, time - overhead) * factor


def step_times(forward: fx.GraphModule, backward: fx.GraphModule | None, cluster: Cluster, factors: list[float],
               group_ranks: dict[str, tuple[int, ...]], comm_factor: float = 1.0) -> tuple[float, list[float], list[float]]:
    """(step seconds, busy seconds per type, waiting seconds per type) with each node group's
    ranks at ``factors[i]`` times the even batch; ``group_ranks``: rank 0's ranks of each
    process group named in the graphs (:attr:`autoshard.cost.simulator.Simulation.group_ranks`). ``comm_factor``:
    the widest state factor under state shares: every all-gather and reduce-scatter moves
    shards padded to the widest share (no all-gather-v), that many times the even bytes."""
    types = range(len(cluster.nodes))
    devices = [g.device for g in cluster.nodes]
    configs = [schedule_config(d) for d in devices]
    shared = cluster.link_profile(list(types))
    clock = [0.0 for _ in types]
    busy = [0.0 for _ in types]
    free: list[dict[str, float]] = [{} for _ in types]
    ends: list[dict[fx.Node, float]] = [{} for _ in types]
    stages = [forward] + ([backward] if backward is not None else [])
    sources = saved_sources(forward, backward)
    for gm in stages:
        for node in gm.graph.nodes:
            collective = collective_of(node)
            if collective is not None:
                kind, nbytes, group, ranks = collective
                ranks = group_ranks.get(group, ranks)
                if kind in ("all_gather", "reduce_scatter"):
                    nbytes = nbytes * comm_factor
                if _coupled(ranks, cluster):  # starts when the last rank issues it
                    start = max(max(clock[t], free[t].get(group, 0.0)) for t in types)
                    duration = collective_time(kind, nbytes, ranks, shared)
                    for t in types:
                        free[t][group] = ends[t][node] = start + duration
                        clock[t] += configs[t].figures.caller_cost(duration)
                else:
                    for t in types:
                        duration = collective_time(kind, nbytes, ranks, devices[t])
                        free[t][group] = ends[t][node] = max(clock[t], free[t].get(group, 0.0)) + duration
                        clock[t] += configs[t].figures.caller_cost(duration)
            elif is_wait(node):
                waited = issuer(node.args[0], sources)
                for t in types:
                    clock[t] = max(clock[t], ends[t].get(waited, 0.0))
            else:
                for t in types:
                    time = node_time(node, devices[t])
                    if time:
                        time = compute_scale(time, devices[t].op_overhead + devices[t].launch_overhead, factors[t])
                        clock[t] += time
                        busy[t] += time
    finish = [max([clock[t], *free[t].values()]) for t in types]
    step = max(finish)
    return step, busy, [step - b for b in busy]


def scaled_peak(memory_by_category: dict[str, list[int]], factor: float) -> int:
    """The peak of the memory curve with the batch-sized categories (:data:`SCALED`) at
    ``factor`` times their even-batch bytes."""
    curves = list(memory_by_category.values())
    if not curves or not curves[0]:
        return 0
    return int(max(sum((factor if c in SCALED else 1.0) * memory_by_category[c][i] for c in memory_by_category)
                   for i in range(len(curves[0]))))


def most_factor(memory_by_category: dict[str, list[int]], extra: float, limit: float | None) -> float:
    """The largest batch factor whose peak (plus ``extra``: optimizer state) fits ``limit``:
    0 where even none fits, inf without a limit or where the batch takes no memory."""
    if limit is None:
        return float("inf")
    fixed = scaled_peak(memory_by_category, 0.0) + extra
    if fixed > limit:
        return 0.0
    hi = 1.0
    while scaled_peak(memory_by_category, hi) + extra <= limit:
        hi *= 2
        if hi > 2**20:
            return float("inf")
    lo = 0.0
    for _ in range(40):  # the peak is a max of lines in the factor: monotone
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if scaled_peak(memory_by_category, mid) + extra <= limit else (lo, mid)
    return lo
