"""Overlap scheduling: issue collectives early and wait late, within a memory budget."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable

from torch import fx

from autoshard._compat import c10d
from autoshard.runtime.errors import InflightCapError, OverBudgetError

from .graph_utils import (
    GATHERED,
    PARAMS,
    Ordering,
    collective_kind,
    collectives,
    exclusive_inputs,
    issue_inputs,
    nbytes,
    outputs_of,
    positions,
    reorder,
    wait_of,
)
from .schedule_config import ScheduleConfig, Workspace
from .step_model import PeakModel, Storages, TimeModel

PLAN = "autoshard_schedule"  # gm.meta key: the chosen SchedulePlan, for explain and the report


@dataclass(frozen=True)
class SchedulePlan:
    """One graph's schedule decisions and what the step model predicts for them.

    distances: per gather bucket (graph order), how many buckets ahead it is issued (0:
        gathered at its first use). reduces_in_flight: reductions of one kind issued before
        the oldest is waited for (0: each is waited right after its issue). peak_bytes: the
        graph's live peak plus ``outside_bytes``.
    """

    distances: tuple[int, ...]
    reduces_in_flight: int
    peak_bytes: int = 0
    step_time: float = 0.0
    budget_bytes: int | None = None
    forced: tuple[str, ...] = ()  # what the budget changed, in words
    smallest_bytes: int | None = None  # the peak gathering at use, each reduction waited at once
    reference_bytes: int | None = None  # the reference policy's peak (``no_more_than``), the default budget
    peak_at: float = 0.0  # where the peak is, as a position of the graph before scheduling
    # Per gather bucket (empty: none), whether it is waited right after its issue, its result
    # kept in the buffer until its copy-out at the use: a blocking call, as FSDP2 eager makes on
    # gloo (the reference policy there). Its staging copy (gloo's) then never meets the compute
    # that follows.
    blocked: tuple[bool, ...] = ()


class _Gather:
    """One gather bucket: what moves with its issue, what moves with its wait, where it is used."""

    def __init__(self, node: fx.Node, pos: dict[fx.Node, int]) -> None:
        self.node = node
        self.issue = issue_inputs(node) + [node]
        self.wait = wait_of(node)
        self.outputs = outputs_of(self.wait)
        uses = [pos[u] for o in self.outputs for u in o.users if u not in self.outputs]
        self.first_use, self.last_use = min(uses), max(uses)
        # Live gathered bytes: the flat result plus the per-parameter copies made from it.
        self.nbytes = nbytes(node) + sum(nbytes(o) for o in self.outputs if o.meta.get(GATHERED))


def _peak(intervals: list[tuple[int, int, int]], lo: int, hi: int) -> int:
    """Largest total of (start, end, bytes) intervals alive at one point of [lo, hi]."""
    points = [lo] + [s for s, _, _ in intervals if lo <= s <= hi]
    return max(sum(b for s, e, b in intervals if s <= p <= e) for p in points)


class _Graph:
    """A bucketed graph's collectives, measured once; :meth:`priorities` places them for a plan."""

    def __init__(self, gm: fx.GraphModule, compute_time: Callable[[fx.Node], float]) -> None:
        graph = gm.graph
        self.graph = graph
        self.pos = pos = positions(graph.nodes)
        # Only autoshard's own (they name the parameters they move): a tensor-parallel
        # collective DTensor put in the graph stays where it is, as its data dependences place it.
        self.gathers = [_Gather(g, pos) for g in collectives(graph, c10d.all_gather_into_tensor.default) if PARAMS in g.meta]
        # Reduce-scatters first: all-reduces may wait for them, never the other way round.
        self.reduce_kinds = [[r for r in collectives(graph, op) if PARAMS in r.meta]
                             for op in (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)]
        moved = {n for g in self.gathers for n in (*g.issue, *g.outputs)}
        self.reduce_issue = [[exclusive_inputs(r) + [r] for r in reduces] for reduces in self.reduce_kinds]
        self.reduce_outputs = [[outputs_of(wait_of(r)) for r in reduces] for reduces in self.reduce_kinds]
        moved |= {n for kind in self.reduce_issue + self.reduce_outputs for group in kind for n in group}
        self._moved, self._compute_time = moved, compute_time

    @functools.cached_property
    def elapsed(self) -> list[float]:
        """Compute time before each position, over the nodes that stay in place (only a
        search needs it: a given plan is placed without timing anything)."""
        elapsed, total = [], 0.0
        for node in self.graph.nodes:
            elapsed.append(total)
            if node not in self._moved:
                total += self._compute_time(node)
        return elapsed

    def issue_at(self, j: int, d: int) -> int:
        g = self.gathers[j]
        return g.first_use if d == 0 else (self.gathers[j - d].first_use if j - d >= 0 else 0)

    def hiding_distance(self, j: int, wanted: float, max_prefetch: int) -> int:
        """The smallest distance whose compute covers ``wanted`` seconds of gather (at most max_prefetch)."""
        first = self.elapsed[self.gathers[j].first_use]
        hides = (d for d in range(1, max_prefetch + 1) if j - d < 0 or first - self.elapsed[self.gathers[j - d].first_use] >= wanted)
        return next(hides, max_prefetch)

    def priorities(self, plan: SchedulePlan) -> dict[fx.Node, float]:
        """Where the plan puts the nodes it moves; the others keep their positions."""
        pos = self.pos
        priority: dict[fx.Node, float] = {}
        for j, (g, d) in enumerate(zip(self.gathers, plan.distances)):
            # At one point, the wait of the bucket used there comes first, then the issues (in
            # bucket order): the comm stream runs them one after another anyway, and a gather
            # issued before the previous one's wait would hold two in flight (two workspaces).
            for n in g.issue:
                priority[n] = self.issue_at(j, d) - 0.25 + j * 1e-6
            for n in g.outputs:
                priority[n] = g.first_use - 0.5
            if plan.blocked and plan.blocked[j]:
                priority[g.wait] = self.issue_at(j, d) - 0.25 + (j + 0.5) * 1e-6
        end = float(len(self.pos))
        for reduces, issues, outputs_by_reduce in zip(self.reduce_kinds, self.reduce_issue, self.reduce_outputs):
            for issue in issues:  # inputs already rescheduled (a reduce-scatter's wait) count where they now are
                ready = max((priority.get(a, pos[a]) for n in issue for a in n.all_input_nodes if a not in issue), default=0)
                for n in issue:
                    priority[n] = ready + 0.5
            for j, outputs in enumerate(outputs_by_reduce):
                later = j + plan.reduces_in_flight
                if plan.reduces_in_flight == 0:  # waited as soon as it is issued: nothing in flight
                    wait_at = priority.get(reduces[j], pos[reduces[j]]) + 0.01
                else:
                    wait_at = priority.get(reduces[later], pos[reduces[later]]) - 0.25 if later < len(reduces) else end
                for n in outputs:
                    priority[n] = wait_at
        return priority


def _capped(g: _Graph, distances: list[int], max_inflight_bytes: int) -> list[int]:
    """Shrink distances, bucket by bucket, until the gathered bytes alive at once fit the cap."""
    alive: list[tuple[int, int, int]] = []
    for j, gather in enumerate(g.gathers):
        d = distances[j]
        while _peak(alive, g.issue_at(j, d), gather.last_use) + gather.nbytes > max_inflight_bytes:
            if d == 0:
                need = _peak(alive, g.issue_at(j, d), gather.last_use) + gather.nbytes
                raise InflightCapError(
                    f"autoshard option 'max_inflight_mb': {max_inflight_bytes / 2**20:.3f} MiB is below the {need / 2**20:.3f} MiB of "
                    "gathered parameters this graph holds at once even without prefetching; raise max_inflight_mb or "
                    "lower bucket_mb."
                )
            d -= 1
        distances[j] = d
        alive.append((g.issue_at(j, d), gather.last_use, gather.nbytes))
    return distances


def schedule_overlap(
    gm: fx.GraphModule, config: ScheduleConfig, *, plan: SchedulePlan | None = None, only_plan: bool = False, **search: Any
) -> fx.GraphModule:
    """Reorder a bucketed forward or backward graph so communication hides behind compute:
    :func:`find_plan` with ``search`` (its keyword arguments; unless ``plan`` is given:
    decisions found earlier on the same graph, no search), then :func:`apply_plan`. The plan
    is in ``gm.meta[PLAN]``; ``only_plan``: find it, leave the order as it is."""
    if plan is None:
        plan = find_plan(gm, config, **search)
    return apply_plan(gm, plan, only_plan)


def apply_plan(gm: fx.GraphModule, plan: SchedulePlan, only_plan: bool = False) -> fx.GraphModule:
    """Record ``plan`` in ``gm.meta[PLAN]`` and reorder ``gm`` as it says (``only_plan``: leave
    the order as it is). Guarantees, for each all-gather bucket j (in graph order): it is
    issued right before the first use of bucket j - d (its prefetch distance d; 0: at its own
    first use), after that bucket's wait, and its own wait and copy-out sit right before its
    first use (a blocked bucket, :attr:`SchedulePlan.blocked`: its wait right after its
    issue). Each gradient reduction (reduce-scatter, all-reduce) is issued right after its
    last input exists and waited right before the reduction of its kind ``r`` buckets later is
    issued, or at the end (r = 0: right after its own issue); an all-reduce of a
    reduce-scatter's result (hybrid sharding) is issued right after that reduce-scatter's wait.
    Numerics unchanged; nothing is timed."""
    gm.meta[PLAN] = plan
    return gm if only_plan else reorder(gm, _Graph(gm, _untimed).priorities(plan))


def _untimed(node: fx.Node) -> float:
    raise AssertionError("placing a given plan times nothing")


class PlanPricer:
    """The evaluation: what the step model predicts for a plan of one bucketed graph, its
    dependencies, storages and times read once for many plans (the graph does not change).
    ``outside_bytes``: held outside the graph, added to its peak. ``shards_outside``: for a
    backward, the shards the gathers read count as held outside and the other inputs die at
    their last use."""

    def __init__(self, gm: fx.GraphModule, config: ScheduleConfig, outside_bytes: int = 0, shards_outside: bool = False) -> None:
        # Each plan re-times every node: each node is timed once.
        self.config = config = replace(config, compute_time=functools.cache(config.compute_time),
                                       comm_time=functools.cache(config.comm_time))
        self.graph = g = _Graph(gm, config.compute_time)
        # A backward's inputs that gathers read are parameter shards: the model holds them.
        self.shards = set()
        if shards_outside:
            self.shards = {a for x in g.gathers for n in x.issue for a in n.all_input_nodes if a.op == "placeholder"}
        self.shards_outside, self.outside_bytes = shards_outside, outside_bytes
        self.ordering = Ordering(g.graph)
        self.nodes = self.ordering.nodes
        self.storages = Storages(self.nodes)
        self.timed = TimeModel(self.nodes, config)
        self._memory: dict[tuple[tuple[str, ...], Workspace], PeakModel] = {}

    def memory(self, late: tuple[str, ...], ws: Workspace) -> PeakModel:
        if (late, ws) not in self._memory:
            held = self.config.collectives
            self._memory[late, ws] = PeakModel(
                self.nodes, ws, pin_inputs=not self.shards_outside, held_outside=self.shards, late_release=late,
                input_copied=held.copies_input, output_at_wait=held.output_at_wait, storages=self.storages)
        return self._memory[late, ws]

    def price(self, plan: SchedulePlan, late: tuple[str, ...] | None = None, ws: Workspace | None = None) -> SchedulePlan:
        """``plan`` with its peak bytes (plus ``outside_bytes``), step time and where its peak
        is; ``late``, ``ws``: instead of the config's late-released kinds and workspace."""
        g, nodes = self.graph, self.nodes
        late = self.config.collectives.late_release if late is None else late
        priority = g.priorities(plan)
        order = self.ordering.indices(priority)
        peak, at = self.memory(tuple(late), self.config.workspace if ws is None else ws).peak(order)
        seconds = self.timed.time(order)
        peak_at = priority.get(nodes[order[at]], float(order[at])) if order else 0.0  # an unmoved node: its position
        return replace(plan, peak_bytes=peak + self.outside_bytes, step_time=seconds, peak_at=peak_at)


def find_plan(
    gm: fx.GraphModule,
    config: ScheduleConfig,
    max_inflight_bytes: int | None = None,
    max_prefetch: int = 2,
    max_reduces_in_flight: int = 2,
    memory_budget_bytes: int | None = None,
    outside_bytes: int = 0,
    no_more_than: tuple[int, int] | None = None,
    shards_outside: bool = False,
    blocking: bool = False,
) -> SchedulePlan:
    """The search: the plan (:func:`apply_plan` places it) for a bucketed forward or backward
    graph, priced by :class:`PlanPricer`; ``gm`` is left as it is.

    The fastest plan takes, per bucket, the smallest d (1..``max_prefetch``) whose compute time
    covers ``config.comm_time`` of its gather, and r = ``max_reduces_in_flight``. With
    ``max_inflight_bytes``, d shrinks until the gathered bytes alive at once fit (ValueError
    if d = 0 does not).

    With ``memory_budget_bytes``, the graph's live peak (:func:`step_model.peak_bytes` with
    ``config``'s workspace and collectives; ``shards_outside`` as :class:`PlanPricer` takes
    it) plus ``outside_bytes`` must fit: one step at a time, the distance of a bucket
    prefetched across the peak, or r, drops by one (the step that lowers the peak most first,
    then the fastest); the fastest fitting plan of that search, gathering at use and the
    reference is taken. ValueError names the smallest budget that fits when none does.
    ``no_more_than=(d, r)``: a reference policy (FSDP2's on GPUs is (1, 1)) whose peak is the
    budget when none is given; where the profile's ``fsdp2_blocking`` says its collectives
    block their caller (FSDP2 eager on gloo), its peak is priced as FSDP2 eager runs there
    (:func:`_blocking_peak`). ``blocking``: every gather waited right after its issue
    (:attr:`SchedulePlan.blocked`; the "fsdp2" schedule where FSDP2 eager's collectives
    block). Times as :func:`step_model.step_time` prices them. Deterministic (graph
    structure, shapes and the cost functions).
    """
    pricer = PlanPricer(gm, config, outside_bytes, shards_outside)
    g, evaluate = pricer.graph, pricer.price
    fast = [g.hiding_distance(j, pricer.config.comm_time(x.node), max_prefetch) for j, x in enumerate(g.gathers)]
    if max_inflight_bytes is not None:
        fast = _capped(g, fast, max_inflight_bytes)

    plan = SchedulePlan(tuple(fast), max_reduces_in_flight, blocked=(True,) * len(fast) if blocking else ())
    budget = memory_budget_bytes
    reference = reference_bytes = None
    if no_more_than is not None:
        d, r = no_more_than
        policy = SchedulePlan(tuple(min(d, x) for x in fast), min(r, max_reduces_in_flight))
        reference = evaluate(policy)
        reference_bytes = _blocking_peak(policy, evaluate, config.workspace) if config.figures.fsdp2_blocking else reference.peak_bytes
        budget = reference_bytes if budget is None else budget
    if budget is not None:
        # Plans the greedy search may miss: gathering at use, and the reference policy (the
        # peak is not monotone in the distances).
        floors = [evaluate(SchedulePlan((0,) * len(fast), 0))] + ([reference] if reference is not None else [])
        smallest = min(p.peak_bytes for p in floors)
        if smallest > budget and memory_budget_bytes is None:
            budget = smallest  # the reference's peak is out of reach on this graph: come as close as we can
        if smallest > budget:
            raise OverBudgetError(
                f"autoshard option 'memory_budget_gb': {budget / 2**30:.3f} GiB is below what this graph needs even gathering "
                f"each bucket at its use and waiting each reduction at once, {smallest / 2**30:.3f} GiB; raise memory_budget_gb to "
                "at least that, lower bucket_mb, shard over more ranks, or recompute activations (torch.utils.checkpoint).",
                smallest_bytes=smallest,
            )
        fitting = [p for p in [_fit(g, evaluate(plan), budget, evaluate), *floors] if p.peak_bytes <= budget]
        plan = min(fitting, key=lambda p: (p.step_time, p.peak_bytes))
        return replace(plan, budget_bytes=budget, forced=_forced(fast, max_reduces_in_flight, plan), smallest_bytes=smallest,
                       reference_bytes=reference_bytes)
    return evaluate(plan)


def _blocking_peak(policy: SchedulePlan, evaluate: Callable[..., SchedulePlan], workspace: Workspace) -> int:
    """The peak of ``policy`` run as FSDP2 eager runs it where collectives block (gloo): each
    gather waited right after its issue, its result kept for its use; each reduction's input
    kept until the next reduction is issued (FSDP2 frees it there), a backend's staging copy
    of it only inside the call; nothing left for the backend's thread to free later."""
    reduction = ("reduce_scatter", "all_reduce")
    blocked = replace(policy, blocked=(True,) * len(policy.distances), reduces_in_flight=max(1, policy.reduces_in_flight))
    return evaluate(blocked, late=(), ws=lambda n: 0 if collective_kind(n) in reduction else workspace(n)).peak_bytes


def _fit(g: _Graph, plan: SchedulePlan, budget: int, evaluate: Callable[[SchedulePlan], SchedulePlan]) -> SchedulePlan:
    """Lower distances and reductions in flight, one step at a time, until the peak fits.

    Only buckets prefetched across the peak can lower it: each step tries those (all, if none
    is) and one reduction fewer in flight, so a step costs a few evaluations, not one per bucket."""
    while plan.peak_bytes > budget:
        lower = [j for j, d in enumerate(plan.distances) if d > 0]
        across = [j for j in lower if g.issue_at(j, plan.distances[j]) - 1 <= plan.peak_at <= g.gathers[j].first_use]
        steps = [replace(plan, distances=plan.distances[:j] + (plan.distances[j] - 1,) + plan.distances[j + 1 :])
                 for j in (across or lower)]
        if plan.reduces_in_flight > 0:
            steps.append(replace(plan, reduces_in_flight=plan.reduces_in_flight - 1))
        if not steps:  # gathering at use, no reduction in flight: the caller has other candidates
            return plan
        tried = [evaluate(s) for s in steps]
        # The step that lowers the peak most; among equals, the one predicted fastest.
        plan = min(tried, key=lambda p: (p.peak_bytes, p.step_time))
    return plan


def _forced(fast: list[int], reduces: int, plan: SchedulePlan) -> tuple[str, ...]:
    words = [f"bucket {j}: prefetch {a} -> {b}" for j, (a, b) in enumerate(zip(fast, plan.distances)) if a != b]
    if plan.reduces_in_flight != reduces:
        words.append(f"reductions in flight {reduces} -> {plan.reduces_in_flight}")
    return tuple(words)
