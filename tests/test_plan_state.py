"""State shares in the plan (issue 33, items 2 and 3): the padded collectives priced, each rank
type's memory at its state share, and a model that does not fit the small-memory ranks under
even shards fitting under the state shares chosen by memory."""
from __future__ import annotations

import functools

import pytest
import torch
from test_cluster import FAST, SLOW

import autoshard
from autoshard import Cluster, NodeGroup
from autoshard.cost.mixed_cluster import scaled_peak, step_times
from autoshard.tools.plan.shares import best_split, per_rank, with_state

pytestmark = pytest.mark.planner

X = torch.randn(2, 256)


def _deep() -> torch.nn.Module:
    """Eight 256x256 layers on two samples: the state (shards, gradients, AdamW's two states)
    outweighs the batch's memory, as in a large model on few samples per rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])


@functools.cache
def _report() -> autoshard.Report:
    return autoshard.explain(_deep, X, world_size=4, profile=SLOW, stages=("captured", "forward", "backward"))


def _even_bytes() -> tuple[float, float]:
    """(a rank's peak at even shares with its optimizer state, the optimizer state)."""
    report = _report()
    extra = 2 * report.metrics["shard_bytes"]
    return scaled_peak(report.analysis.memory_by_category, 1.0) + extra, extra


def _cluster(small: float, big: float) -> Cluster:
    even, _ = _even_bytes()
    return Cluster((NodeGroup(1, FAST, 2, memory_gb=big * even / 2**30), NodeGroup(1, SLOW, 2, memory_gb=small * even / 2**30)))


def test_a_model_that_does_not_fit_the_small_ranks_under_even_shards_fits_under_planned_state_shares():
    report, (_, extra) = _report(), _even_bytes()
    cluster = _cluster(small=0.9, big=3.0)
    even = best_split(report.simulation, cluster, extra, None, state_shares=False)
    assert not even.fits and not even.types[1].fits  # the small type: over its memory even with no sample
    planned = best_split(report.simulation, cluster, extra, None, state_shares=True)
    assert planned.fits, planned
    fast, slow = planned.types
    assert slow.peak_bytes <= slow.limit_bytes and fast.peak_bytes <= fast.limit_bytes
    assert slow.state_share < 1 / 4 < fast.state_share  # the small memory holds less of the state
    assert 2 * fast.state_share + 2 * slow.state_share == pytest.approx(1.0)
    # A layout that cannot cut its state (replicate, hybrid) gets no state shares.
    roomy = _cluster(small=2.0, big=3.0)
    assert all(t.state_share is None for t in best_split(report.simulation, roomy, extra, None, state_shares=True).types)


def test_the_padding_is_priced_in_memory_and_time():
    report = _report()
    curves = report.analysis.memory_by_category
    # Gathered parameters and collective buffers grow with the widest share; shards and gradients with the rank's own.
    shared = with_state(curves, 0.5, 1.5)
    assert max(shared["shards"]) == int(0.5 * max(curves["shards"])) and shared["activations"] == curves["activations"]
    assert max(shared["gathered"]) == int(1.5 * max(curves["gathered"])) and with_state(curves, 1.0, 1.0) == curves
    fwd, bwd = report.stages["forward"], report.stages["backward"]
    cluster = _cluster(small=1.0, big=1.0)
    step, _, _ = step_times(fwd, bwd, cluster, [1.0, 1.0], report.simulation.group_ranks)
    wider, _, _ = step_times(fwd, bwd, cluster, [1.0, 1.0], report.simulation.group_ranks, comm_factor=1.5)
    assert wider > step  # gathers of N * max rows take longer


def test_state_shares_per_rank_sum_to_one_and_follow_the_rank_order():
    assert per_rank([1.5, 0.5], [2, 2], 4) == (0.375, 0.375, 0.125, 0.125)


def test_a_plan_carries_state_shares_through_json_and_into_shard(tmp_path):
    plan = autoshard.Plan("full", (4,), 4, 2, "x", None, state_shares=(0.375, 0.375, 0.125, 0.125))
    plan.save(tmp_path / "plan.json")
    assert autoshard.Plan.load(tmp_path / "plan.json").state_shares == plan.state_shares
    # Without a process group shard checks the plan's shares against one rank: refused, nothing changed.
    with pytest.raises(ValueError, match="the plan was made for 4 ranks"):
        autoshard.shard(_deep(), plan=plan)


def test_the_summary_shows_each_rank_types_state_share():
    from test_cluster import _plan
    summary = _plan().summary()
    assert "state/rank" in summary and "25.000%" in summary  # even shards: a quarter each at 4 ranks
