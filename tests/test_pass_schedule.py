"""schedule_overlap, the bucket planner and the step model alone, on the bucketed graphs.

Each test takes the stage a pass consumes (recorded from one compile with schedule "none",
so no pass beyond lowering has run; see pass_graphs.py for the graphs and the notation), runs
only that pass on a copy, and compares the sequence of communication and compute nodes with
the one its docstring draws.
"""
from __future__ import annotations

from typing import Callable

import pytest
from torch import fx

from autoshard._compat import c10d
from autoshard.compiler.bucket_plan import choose_bucket_mb, step_time_floor
from autoshard.cost.cost_model import collective_of
from autoshard.passes import bucket_collectives, schedule_overlap
from autoshard.passes.graph_utils import collective_kind, nbytes
from autoshard.passes.schedule import PLAN, SchedulePlan
from autoshard.passes.schedule_config import ProfileFigures, ScheduleConfig
from autoshard.passes.step_model import peak_bytes, release_points, step_time

from pass_graphs import Stack, bucketed, events, gathers, matmuls_take_one, stage

# schedule_overlap (bucketed forward / backward) ---------------------------------------------


@pytest.mark.parametrize("gather_time, max_prefetch, expected", [
    (0.5, 2, "1 ahead"),  # one block's matmul covers a gather
    (1.5, 2, "2 ahead"),  # two blocks' are needed
    (1.5, 1, "1 ahead"),  # ... but max_prefetch allows one
])
def test_schedule_prefetches_gathers_as_far_as_their_time_needs(gather_time, max_prefetch, expected, drawing):
    """Each gather is issued the fewest blocks ahead whose matmuls cover its time (at most
    max_prefetch) and waited right before its first use.

    before:   ag(0.w+0.b) wait(0.w+0.b) mm ag(1.w+1.b) wait(1.w+1.b) mm
              ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    1 ahead:  ag(0.w+0.b) wait(0.w+0.b) ag(1.w+1.b) mm
              wait(1.w+1.b) ag(2.w+2.b+norm.w+norm.b) mm wait(2.w+2.b+norm.w+norm.b) mm ln
    2 ahead:  ag(0.w+0.b) ag(1.w+1.b) wait(0.w+0.b) ag(2.w+2.b+norm.w+norm.b)
              mm wait(1.w+1.b) mm wait(2.w+2.b+norm.w+norm.b) mm ln

    Where a wait and an issue meet, the wait comes first: the comm stream runs them in turn
    anyway, and one collective in flight holds one buffer (and on gloo one workspace), not two.
    """
    forward = bucketed("forward")
    assert events(forward) == drawing("before")
    schedule_overlap(forward, ScheduleConfig(matmuls_take_one, lambda n: gather_time), max_prefetch=max_prefetch)
    assert events(forward) == drawing(expected)


def _gathered_bytes(gather: fx.Node) -> int:
    """What a gather bucket keeps alive: its flat result and the per-parameter copies of it."""
    return 2 * gather.meta["val"].numel() * gather.meta["val"].element_size()


def test_schedule_prefetches_less_to_stay_within_the_memory_bound(drawing):
    """On the bucketed forward drawn above: gathers want 2 blocks ahead (time 1.5), but the
    bound holds only blocks 1 and 2 at once, so the last gather is issued once block 0's
    parameters are dead, 1 block ahead. A bound below the largest bucket is an error.

    after:  ag(0.w+0.b) ag(1.w+1.b) wait(0.w+0.b) mm
            wait(1.w+1.b) ag(2.w+2.b+norm.w+norm.b) mm wait(2.w+2.b+norm.w+norm.b) mm ln
    """
    forward = bucketed("forward")
    _, second, third = gathers(forward)
    bound = _gathered_bytes(second) + _gathered_bytes(third)
    schedule_overlap(forward, ScheduleConfig(matmuls_take_one, lambda n: 1.5), max_inflight_bytes=bound)
    assert events(forward) == drawing("after")
    with pytest.raises(ValueError, match="option 'max_inflight_mb': .* MiB is below the"):  # not even gathering at use fits
        schedule_overlap(bucketed("forward"), ScheduleConfig(matmuls_take_one, lambda n: 1.5),
                         max_inflight_bytes=_gathered_bytes(third) - 1)


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_schedule_issues_reductions_early_and_waits_buckets_later(in_flight, drawing):
    """A reduce-scatter is issued right after its last gradient and waited right before the
    one in_flight buckets later is issued (or at the end; 0: right after its own issue, as
    FSDP2 eager's blocking collectives on CPU); re-gathers are prefetched.

    before:  ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ln_bw mm mm
             rs(norm.w+norm.b+2.b+2.w) wait(norm.w+norm.b+2.b+2.w)
             ag(1.w) wait(1.w) mm mm rs(1.b+1.w) wait(1.b+1.w) mm rs(0.b+0.w) wait(0.b+0.w)
    0:       ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ag(1.w) ln_bw mm mm
             rs(norm.w+norm.b+2.b+2.w) wait(norm.w+norm.b+2.b+2.w) wait(1.w) mm mm
             rs(1.b+1.w) wait(1.b+1.w) mm rs(0.b+0.w) wait(0.b+0.w)
    1:       ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ag(1.w) ln_bw mm mm
             rs(norm.w+norm.b+2.b+2.w) wait(1.w) mm mm wait(norm.w+norm.b+2.b+2.w)
             rs(1.b+1.w) mm wait(1.b+1.w) rs(0.b+0.w) wait(0.b+0.w)
    2:       ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ag(1.w) ln_bw mm mm
             rs(norm.w+norm.b+2.b+2.w) wait(1.w) mm mm rs(1.b+1.w) mm
             wait(norm.w+norm.b+2.b+2.w) rs(0.b+0.w) wait(1.b+1.w) wait(0.b+0.w)
    """
    backward = bucketed("backward")
    assert events(backward) == drawing("before")
    schedule_overlap(backward, ScheduleConfig(matmuls_take_one, lambda n: 0.5), max_reduces_in_flight=in_flight)
    assert events(backward) == drawing(str(in_flight))


def test_a_blocked_gather_is_waited_at_its_issue_and_its_result_kept_until_its_use(drawing):
    """A blocked bucket (FSDP2 eager's gathers on gloo block their caller) keeps its prefetch
    distance, but its wait comes right after its issue; the use stays where it was. So its
    workspace never meets the compute that follows, and the reference policy, blocked, holds
    less at its peak than the same policy in flight.

    before:  ag(0.w+0.b) wait(0.w+0.b) mm ag(1.w+1.b) wait(1.w+1.b) mm
             ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    after:   ag(0.w+0.b) wait(0.w+0.b) ag(1.w+1.b) wait(1.w+1.b) mm
             ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm mm ln
    """
    forward = bucketed("forward")
    assert events(forward) == drawing("before")
    n = len(gathers(forward))
    schedule_overlap(forward, ScheduleConfig(matmuls_take_one, lambda x: 1.5), plan=SchedulePlan((1,) * n, 0, blocked=(True,) * n))
    assert events(forward) == drawing("after")
    workspace = lambda x: nbytes(x) if collective_kind(x) == "all_gather" else 0  # noqa: E731  a staging copy as large as the result
    reference = {}
    for blocking in (False, True):
        gm = bucketed("forward")
        config = ScheduleConfig(matmuls_take_one, lambda x: 1.5, ProfileFigures(fsdp2_blocking=blocking), workspace)
        schedule_overlap(gm, config, no_more_than=(1, 0), only_plan=True)
        reference[blocking] = gm.meta[PLAN].reference_bytes
    assert reference[True] < reference[False]


def _gather_time(per_largest: float, sizes: list[int]) -> Callable[[fx.Node], float]:
    """A collective's time: a latency plus ``per_largest`` for the largest bucket's bytes."""
    return lambda n: 0.05 + per_largest * nbytes(n) / max(sizes)


@pytest.mark.parametrize("per_largest, split", [(0.5, None), (2.0, 4)])
def test_bucket_plan_splits_buckets_only_when_the_budget_stops_block_buckets_prefetching(per_largest, split):
    """The default budget is FSDP2's policy (1 ahead) on block buckets. Gathers of 0.5 per
    block are hidden 1 ahead: nothing to split. Gathers of 2 want 2 ahead, which the budget
    forbids; quarter buckets, prefetched, fit the same budget and run faster."""
    sizes = [nbytes(n) for n in bucketed("forward").graph.nodes if collective_kind(n) == "all_gather"]
    comm = _gather_time(per_largest, sizes)

    def schedule(gm: fx.GraphModule, budget: int | None) -> None:
        schedule_overlap(gm, ScheduleConfig(matmuls_take_one, comm), memory_budget_bytes=budget, no_more_than=(1, 1))

    mb, plan, _ = choose_bucket_mb(stage(Stack, "forward"), schedule, None)
    blocks = bucketed("forward")
    schedule(blocks, None)
    if split is None:
        assert mb is None and plan == blocks.meta[PLAN] and not plan.forced
        return
    budget = blocks.meta[PLAN].budget_bytes
    assert blocks.meta[PLAN].forced and mb == max(sizes) / split / 2**20 and plan.budget_bytes == budget
    chosen = bucket_collectives(stage(Stack, "forward"), mb)
    schedule(chosen, budget)
    assert chosen.meta[PLAN] == plan  # the plan handed back is the one the schedule finds
    assert plan.peak_bytes <= budget and plan.step_time < blocks.meta[PLAN].step_time


def test_bucket_plan_meets_a_budget_block_buckets_cannot_with_smaller_ones():
    """A user's budget below the least block buckets need (gathering at use) is met by split
    buckets, which need less; below what every candidate needs it is the planner's error."""
    sizes = [nbytes(n) for n in bucketed("forward").graph.nodes if collective_kind(n) == "all_gather"]
    comm = _gather_time(2.0, sizes)

    def schedule(gm: fx.GraphModule, budget: int | None) -> None:
        schedule_overlap(gm, ScheduleConfig(matmuls_take_one, comm), memory_budget_bytes=budget, no_more_than=(1, 1))

    blocks = bucketed("forward")
    schedule(blocks, None)
    budget = blocks.meta[PLAN].smallest_bytes - 1
    mb, plan, chosen = choose_bucket_mb(stage(Stack, "forward"), schedule, budget)
    assert mb is not None and plan.peak_bytes <= budget
    with pytest.raises(ValueError, match="is below what this graph needs"):
        choose_bucket_mb(stage(Stack, "forward"), schedule, plan.smallest_bytes // 2)


@pytest.mark.parametrize("side", ["forward", "backward"])
@pytest.mark.parametrize("latency", [0.05, 3.0])
def test_bucket_plan_skips_only_splits_its_floor_rules_out(side, latency):
    """``step_time_floor`` is below every split's step time as the schedule finds it. With a
    latency of 3 per collective, splitting only adds collectives: the floor rules both splits
    out, so only the block buckets are bucketed and scheduled; with 0.05 both are tried.
    Either way the choice is the one found by trying every split."""
    sizes = [nbytes(n) for n in bucketed(side).graph.nodes if collective_kind(n) == "all_gather"]
    # Bytes as the cost model counts them (a reduction's input), as ScheduleConfig.comm_time takes them.
    comm = lambda n, size=None: latency + 2.0 * (collective_of(n).nbytes if size is None else size) / max(sizes)  # noqa: E731
    scheduled = []

    def schedule(gm: fx.GraphModule, budget: int | None) -> None:
        scheduled.append(gm)
        schedule_overlap(gm, ScheduleConfig(matmuls_take_one, comm), memory_budget_bytes=budget, no_more_than=(1, 1))

    timing = ScheduleConfig(matmuls_take_one, comm)
    every = choose_bucket_mb(stage(Stack, side), schedule, None)
    tried, scheduled[:] = list(scheduled), []
    skipping = choose_bucket_mb(stage(Stack, side), schedule, None, timing)
    assert every[:2] == skipping[:2] and events(every[2]) == events(skipping[2])
    for gm, parts in zip(tried[1:], (2, 4)):
        mb = max(sizes) / parts / 2**20
        assert step_time_floor(stage(Stack, side), mb, timing) <= gm.meta[PLAN].step_time
    forced = tried[0].meta[PLAN].forced
    assert len(tried) == (3 if forced else 1) and (len(scheduled) == 1) == (latency == 3.0 or not forced)


# the step model and the memory budget (bucketed forward of Stack) ---------------------------


def test_step_model_times_an_order_and_counts_workspace_until_the_wait():
    """Before scheduling (gather at use), each gather's 0.5 is exposed before its matmul (1):
    3 x 0.5 + 3 = 4.5. Prefetched one ahead, only the first is: 0.5 + 3 = 3.5; where compute
    keeps only 60% of its speed while a gather runs (overlap 0.6), each gather also costs
    compute 0.2, but the first one's is spent waiting for it anyway: 3.5 + 2 x 0.2 = 3.9. An
    issue cost adds to that (0.1 each: 3.5 + 2 x 0.3 = 4.1), but a collective never costs its
    caller more than its own time (issue cost 1: 3.5 + 2 x 0.5 = 4.5, gathering at use).
    A collective's workspace adds to the peak while it is in flight, at most once per
    collective in flight."""
    forward = bucketed("forward")
    order = [n for n in forward.graph.nodes if n.op != "output"]
    half = ScheduleConfig(matmuls_take_one, lambda n: 0.5)
    slowed = lambda overlap, issue_cost=0.0: ScheduleConfig(  # noqa: E731
        matmuls_take_one, lambda n: 0.5, ProfileFigures(comm_overlap=overlap, comm_issue_cost=issue_cost))
    assert step_time(order, half) == 4.5
    plain, _ = peak_bytes(order)
    with_workspace, _ = peak_bytes(order, lambda n: 1000)
    assert 0 < with_workspace - plain <= 1000  # gathered at use: one gather in flight at a time
    schedule_overlap(forward, ScheduleConfig(matmuls_take_one, lambda n: 0.5))
    prefetched = [n for n in forward.graph.nodes if n.op != "output"]
    assert step_time(prefetched, half) == 3.5
    assert step_time(prefetched, slowed(0.6)) == pytest.approx(3.9)
    assert step_time(prefetched, slowed(0.6, 0.1)) == pytest.approx(4.1)
    assert step_time(prefetched, slowed(0.6, 1.0)) == pytest.approx(4.5)


def test_a_collective_whose_backend_copies_its_input_frees_it_at_the_issue():
    """gloo reduces a clone of a reduce-scatter's input (its workspace): with input_copied the
    input is not held until the wait, so reductions kept in flight cost less; the clone still
    counts. Without a workspace, the peak can only drop by the inputs' bytes."""
    backward = bucketed("backward")
    schedule_overlap(backward, ScheduleConfig(matmuls_take_one, lambda n: 1.5))  # reductions in flight
    order = [n for n in backward.graph.nodes if n.op != "output"]
    copied = lambda n: collective_kind(n) == "reduce_scatter"  # noqa: E731
    inputs = sum(nbytes(n.args[0]) for n in order if copied(n))
    held, _ = peak_bytes(order, lambda n: nbytes(n.args[0]) if copied(n) else 0)
    freed, _ = peak_bytes(order, lambda n: nbytes(n.args[0]) if copied(n) else 0, input_copied=copied)
    assert held - inputs <= freed < held
    assert peak_bytes(order, input_copied=lambda n: False) == peak_bytes(order)
    # Reduced in place (passes/gloo.py), a reduction's result is made at its wait, not at the issue.
    later, _ = peak_bytes(order, lambda n: nbytes(n.args[0]) if copied(n) else 0, input_copied=copied,
                          output_at_wait=("reduce_scatter",))
    assert later < freed


def test_schedule_fits_a_memory_budget_and_names_the_smallest_that_fits():
    """Gathers want 2 blocks ahead (time 1.5). A budget between the peak of gathering at use
    and the peak of that plan prefetches less and fits; one below gathering at use fails,
    naming that peak; no_more_than=(1, 1) without a budget stays within FSDP2's peak."""
    def plan(**kwargs):
        forward = bucketed("forward")
        schedule_overlap(forward, ScheduleConfig(matmuls_take_one, lambda n: 1.5), **kwargs)
        return forward.meta[PLAN]

    fast, slowest = plan(), plan(max_prefetch=0)
    assert fast.distances == (1, 2, 2) and slowest.distances == (0, 0, 0)  # nothing precedes bucket 0
    assert slowest.peak_bytes < fast.peak_bytes and slowest.step_time > fast.step_time
    budget = (fast.peak_bytes + slowest.peak_bytes) // 2
    fitted = plan(memory_budget_bytes=budget)
    assert fitted.peak_bytes <= budget < fast.peak_bytes and fitted.forced
    assert fast.step_time <= fitted.step_time <= slowest.step_time
    with pytest.raises(ValueError, match=f"option 'memory_budget_gb': .* {slowest.peak_bytes / 2**30:.3f} GiB"):
        plan(memory_budget_bytes=slowest.peak_bytes - 1)
    fsdp2 = plan(max_prefetch=1, max_reduces_in_flight=1)
    capped = plan(no_more_than=(1, 1))
    assert capped.peak_bytes <= fsdp2.peak_bytes and capped.step_time <= fsdp2.step_time


def test_late_release_keeps_a_collectives_buffers_until_the_next_issue():
    """gloo frees a finished collective's buffers on its own thread: with late_release they
    count until the next collective is issued, never less than until the wait."""
    forward = bucketed("forward")
    order = [n for n in forward.graph.nodes if n.op != "output"]
    issues = [i for i, n in enumerate(order) if n.target is c10d.all_gather_into_tensor.default]
    on_time, late = release_points(order), release_points(order, late=("all_gather",))
    for a, b in zip(issues, issues[1:]):
        assert on_time[order[a]] < b and late[order[a]] == b  # gathered at use: the wait comes before the next issue
    assert late[order[issues[-1]]] == on_time[order[issues[-1]]]  # nothing is issued after the last
    assert peak_bytes(order, lambda n: 1000, late_release=("all_gather",))[0] >= peak_bytes(order, lambda n: 1000)[0]
    assert release_points(order, late=("reduce_scatter",)) == on_time  # only the kinds named linger
