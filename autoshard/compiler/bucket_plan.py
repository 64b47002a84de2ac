"""Bucket boundaries as a memory-planning decision.

Without ``bucket_mb`` the autoshard schedule buckets per repeated block, FSDP2's unit. When the
memory budget (given, or by default FSDP2's peak on this device) makes that plan give up
prefetching or reductions in flight, smaller buckets can fit the same budget faster: what a
prefetched bucket holds (its gathered bytes, their copy-in and, on gloo, a workspace as large)
shrinks with the bucket, for one more collective's latency per split. :func:`choose_bucket_mb`
schedules the block buckets, and only if the budget forced that plan, halves and quarters of
the largest bucket, each on a copy of the graph, and keeps the fastest that fits (of those
within 2% of it, the one that holds least). The chosen copy, bucketed but not yet reordered,
is the graph the pipeline goes on with: nothing is bucketed twice. A split whose step time
cannot come within 2% of a fitting candidate's in any order (:func:`step_time_floor`: its
collectives alone, or the compute with what they take from it, already last longer) is not
bucketed at all: on a latency-bound link, splitting only adds collectives.

Deterministic, from graph structure and the cost model: every rank makes the same choice.
"""
from __future__ import annotations

from typing import Callable

from torch import fx

from autoshard._compat import copy_graph
from autoshard.cost.cost_model import collective_of
from autoshard.passes import bucket_collectives, planned_buckets
from autoshard.passes.graph_utils import collective_kind, is_wait, nbytes
from autoshard.passes.schedule import PLAN, SchedulePlan
from autoshard.passes.schedule_config import ScheduleConfig
from autoshard.runtime.errors import InflightCapError, OverBudgetError

SPLITS = (2, 4)  # candidate buckets: the largest block bucket cut into this many parts
TIES = 0.02  # step times within 2% of the fastest count as equal (run-to-run noise is larger): the smallest peak wins
# schedule(graph, budget_bytes or None for the default) finds a bucketed graph's plan and
# records it in graph.meta[PLAN], leaving the order as it is.
Schedule = Callable[[fx.GraphModule, "int | None"], None]
# What a trial raises when its buckets do not fit: any other error is a bug, and surfaces.
DOES_NOT_FIT = (OverBudgetError, InflightCapError)


def step_time_floor(gm: fx.GraphModule, bucket_mb: float | None, timing: ScheduleConfig, all_reduce_blocks: int = 1) -> float:
    """A lower bound of the step time of ``gm`` (lowered, not bucketed) bucketed at
    ``bucket_mb``, in any order: its collectives run one after another and each is waited for,
    so the step lasts at least their sum; and it runs every compute node of ``gm`` (bucketing
    adds copies, priced at 0 or more) plus what each collective takes from compute.
    ``timing``: the config the schedule prices graphs with (a floor must price them alike);
    ``all_reduce_blocks``: as :func:`bucket_collectives` takes it."""
    graph = gm.graph
    durations, bucketed = [], set()
    for buckets in planned_buckets(graph, bucket_mb, all_reduce_blocks).values():
        for bucket in buckets:
            durations.append(timing.comm_time(bucket[0], sum(collective_of(n).nbytes for n in bucket)))
            bucketed.update(bucket)
    compute = 0.0
    for n in graph.nodes:
        if collective_kind(n) is not None:
            if n not in bucketed:
                durations.append(timing.comm_time(n))
        elif n.op != "output" and not is_wait(n):
            compute += timing.compute_time(n)
    taken = sum(timing.figures.caller_cost(d) for d in durations)
    return max(sum(durations), compute + taken)


class _Trial(fx.GraphModule):
    """A graph that is measured and, if chosen, handed back: no Python code is generated for
    it here (the graph it joins recompiles)."""

    def recompile(self) -> None:
        return None


def _bucketed(gm: fx.GraphModule, bucket_mb: float | None, opaque_copies: bool, all_reduce_blocks: int) -> fx.GraphModule:
    # A copy sharing the nodes' values (a deep copy would copy every fake tensor).
    return bucket_collectives(_Trial(gm, copy_graph(gm.graph)), bucket_mb, opaque_copies, all_reduce_blocks)


def _trial(gm: fx.GraphModule, bucket_mb: float | None, schedule: Schedule, budget: int | None, opaque_copies: bool,
           all_reduce_blocks: int) -> fx.GraphModule:
    trial = _bucketed(gm, bucket_mb, opaque_copies, all_reduce_blocks)
    schedule(trial, budget)
    return trial


Choice = tuple["float | None", "SchedulePlan | None", fx.GraphModule]


def choose_bucket_mb(
    gm: fx.GraphModule, schedule: Schedule, budget: int | None, timing: ScheduleConfig | None = None, opaque_copies: bool = False,
    all_reduce_blocks: int = 1,
) -> Choice:
    """(bucket cap in MiB, None for block buckets; the schedule's plan for it; ``gm``'s
    graph bucketed at that cap, in its order before scheduling) for a lowered graph.
    ``budget``: the user's, or None for the default (FSDP2's peak on the block buckets: a
    split must fit that, not the smaller peak FSDP2's policy has on split buckets).
    OverBudgetError (or InflightCapError) when a user's budget fits no candidate (the error of
    the smallest buckets); the default always has a plan (block buckets, as close to FSDP2's
    peak as they come); any other error a trial raises is a bug and propagates. The
    plan is the one to schedule the bucketed graph with (no second search). ``gm`` is left
    as it is. ``timing``: how ``schedule`` prices graphs; with it, a split that
    :func:`step_time_floor` rules out is not tried (the choice is the same).
    ``opaque_copies``, ``all_reduce_blocks``: as :func:`bucket_collectives` takes them."""
    default = budget is None
    plan: SchedulePlan | None = None
    try:
        blocks = _trial(gm, None, schedule, budget, opaque_copies, all_reduce_blocks)
    except DOES_NOT_FIT:
        if budget is None:
            raise
        blocks = _bucketed(gm, None, opaque_copies, all_reduce_blocks)
    else:
        plan = blocks.meta[PLAN]
        if not plan.forced:  # the fastest plan fits: nothing to gain from splitting
            return None, plan, blocks
        budget = plan.reference_bytes if budget is None else budget
    sizes = [nbytes(n) for n in blocks.graph.nodes if collective_kind(n) == "all_gather"]
    fitting: list[Choice] = [(None, plan, blocks)] if plan is not None and plan.peak_bytes <= budget else []
    error = None
    for parts in SPLITS if sizes else ():
        mb = max(sizes) / parts / 2**20
        floor = step_time_floor(gm, mb, timing, all_reduce_blocks) if timing is not None and fitting else None
        if floor is not None and floor > min(c[1].step_time for c in fitting) * (1 + TIES):
            continue  # slower than a fitting candidate beyond ties, whatever its order: never chosen
        try:
            trial = _trial(gm, mb, schedule, budget, opaque_copies, all_reduce_blocks)
            fitting.append((mb, trial.meta[PLAN], trial))
        except DOES_NOT_FIT as e:
            error = e
    if not fitting:
        if default or error is None:  # the default: block buckets, as close to FSDP2's peak as they come
            return None, plan, blocks
        raise error
    # The fastest, unless one within TIES of its time holds less: a cost model this coarse
    # cannot tell them apart, and memory is why people shard.
    fastest = min(c[1].step_time for c in fitting)
    return min((c for c in fitting if c[1].step_time <= fastest * (1 + TIES)), key=lambda c: (c[1].peak_bytes, c[1].step_time))
