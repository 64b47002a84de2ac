"""Mixed clusters (issue 33, item 3): the cluster description, the simulator playing each rank
type on its own profile with its own batch share, and autoshard.plan choosing the shares."""
from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys

import pytest
import torch

import autoshard
from autoshard import Cluster, NodeGroup
from autoshard.cost.cost_model import get_profile
from autoshard.cost.mixed_cluster import step_times
from autoshard.cost.profiles import uniform_link
from autoshard.cost.simulator import analyze
from autoshard.runtime.errors import UsageError
from autoshard.tools.plan.mixed_summary import single_type_outcome

from gpt import GPT, GPTConfig
from models import build

pytestmark = pytest.mark.planner

TOKENS = torch.zeros(1, 64, dtype=torch.long)
# Overhead-free profiles, so compute follows flops and bytes: "slow" is "fast" at half speed.
FAST = dataclasses.replace(get_profile("cpu"), name="fast", op_overhead=0.0, launch_overhead=0.0, ranks_per_node=2)
SLOW = dataclasses.replace(FAST, name="slow", peak_flops={k: v / 2 for k, v in FAST.peak_flops.items()},
                           mem_bandwidth=FAST.mem_bandwidth / 2)


def _mixed_cluster(slow_memory_gb: float | None = None) -> Cluster:
    return Cluster((NodeGroup(1, FAST, ranks_per_node=2, price_per_hour=2.0),
                    NodeGroup(1, SLOW, ranks_per_node=2, memory_gb=slow_memory_gb, price_per_hour=1.0)))


@functools.cache
def _report() -> autoshard.Report:
    return autoshard.explain(lambda: build("gpt"), TOKENS, TOKENS, world_size=4, profile=SLOW,
                             stages=("captured", "forward", "backward"))


@functools.cache
def _plan(slow_memory_gb: float | None = None) -> autoshard.Plan:
    return autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, cluster=_mixed_cluster(slow_memory_gb))


@pytest.mark.parametrize("nodes, match", [
    ((), "non-empty sequence of NodeGroup"),
    ((NodeGroup(0, "h100"),), "count must be a positive int"),
    ((NodeGroup(1, "h100", ranks_per_node=0),), "ranks_per_node must be a positive int"),
    ((NodeGroup(1, "h100", memory_gb=-1),), "memory_gb must be a positive number"),
    ((NodeGroup(1, "h100", price_per_hour="4"),), "price_per_hour must be a positive number"),
    ((NodeGroup(1, "b300"),), "unknown device profile 'b300'"),
    ((NodeGroup(1, "h100", 8), NodeGroup(1, "a100", 4)), "same ranks_per_node"),
    ((NodeGroup(1, "h100", price_per_hour=4.0), NodeGroup(1, "a100")), "price_per_hour for every node group or for none"),
])
def test_a_bad_cluster_is_refused_naming_what_is_wrong(nodes, match):
    with pytest.raises(UsageError, match=match):
        Cluster(nodes)


def test_a_cluster_lays_its_node_groups_out_in_rank_order():
    c = Cluster([NodeGroup(4, "h100", memory_gb=80), NodeGroup(4, "a100", memory_gb=40)])
    assert c.world_size == 64 and c.ranks_per_node == 8 and c.first_ranks() == [0, 32]
    assert c.nodes[c.slowest()].name == "a100" and c.smallest_memory_gb(None) == 40 and not c.homogeneous
    assert c.label == "32x h100 + 32x a100"
    # Across node types the slower NIC paces a ring.
    assert c.link_profile([0, 1]).inter == get_profile("a100").inter
    assert Cluster.from_dict(c.to_dict()) == c


def test_the_mixed_simulator_on_one_profile_is_the_simulator():
    report = _report()
    same = Cluster((NodeGroup(1, SLOW, 2), NodeGroup(1, SLOW, 2)))
    step, busy, wait = step_times(report.stages["forward"], report.stages["backward"], same, [1.0, 1.0], report.simulation.group_ranks)
    analysis = analyze(report.stages["forward"], report.stages["backward"], SLOW)
    assert step == pytest.approx(analysis.step_time, rel=1e-9)
    assert busy == pytest.approx([analysis.compute_time] * 2, rel=1e-9)


def test_a_rank_twice_as_slow_sets_the_step_and_its_proportional_share_shortens_it():
    report = _report()
    fwd, bwd, groups = report.stages["forward"], report.stages["backward"], report.simulation.group_ranks
    even, busy, wait = step_times(fwd, bwd, _mixed_cluster(), [1.0, 1.0], groups)
    assert busy[1] == pytest.approx(2 * busy[0], rel=1e-9)  # half the flops and bytes per second
    assert wait[0] > wait[1]  # the fast ranks wait for the slow ones at every collective
    # The step is the slowest rank's: as long as the slow ones alone would take.
    alone = analyze(fwd, bwd, SLOW).step_time
    assert even == pytest.approx(alone, rel=1e-9)
    split, busy2, _ = step_times(fwd, bwd, _mixed_cluster(), [4 / 3, 2 / 3], groups)  # 2:1, samples kept
    assert busy2[0] == pytest.approx(busy2[1], rel=1e-9)
    assert split < even


def test_the_plan_gives_the_faster_type_more_of_the_batch():
    plan = _plan()
    shares = plan.batch_shares
    assert len(shares) == 4 and sum(shares) == pytest.approx(1.0, abs=1e-9)
    assert shares[0] == shares[1] and shares[2] == shares[3]
    assert shares[0] > 1.8 * shares[2]  # about twice: the fast type computes twice as fast
    chosen, base = plan.chosen, single_type_outcome(plan)
    assert chosen.mixed_step < base.step_time  # better than every rank as the slow one, even shares
    assert chosen.mixed_step == min(o.mixed_step for o in plan.outcomes if o.mixed_fits)
    summary = plan.summary()
    assert "share/rank" in summary and "utilisation variance" in summary and "throughput per dollar" in summary


def test_a_small_memory_caps_its_types_share_and_the_plan_keeps_within_it():
    """The fast type's cards hold less than its proportional share needs: its share stops
    where its memory does (state shards stay even: only the batch-sized memory moves)."""
    free = _plan()
    fast = free.chosen.types[0]
    even_peak = free.chosen.peak_bytes
    assert fast.peak_bytes > even_peak  # more samples, more activations
    limit = (even_peak + fast.peak_bytes) / 2
    capped = autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS,
                            cluster=Cluster((NodeGroup(1, FAST, 2, memory_gb=limit / 2**30), NodeGroup(1, SLOW, 2))))
    types = capped.chosen.types
    assert types[0].limit_bytes == limit and types[0].peak_bytes <= limit
    assert fast.share > types[0].share > types[1].share
    assert sum(capped.batch_shares) == pytest.approx(1.0, abs=1e-9)


def test_a_mixed_plan_round_trips_through_json(tmp_path):
    plan = _plan()
    plan.save(tmp_path / "plan.json")
    assert autoshard.Plan.load(tmp_path / "plan.json") == plan


def test_a_homogeneous_cluster_gives_exactly_the_single_type_plan():
    cluster = Cluster((NodeGroup(2, "h100", ranks_per_node=2, memory_gb=1.0),))
    assert cluster.homogeneous
    planned = autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, cluster=cluster)
    assert planned == autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, world_size=4, ranks_per_node=2, memory_budget_gb=1.0)
    assert planned.batch_shares is None


def test_a_cluster_and_a_world_size_together_are_refused():
    with pytest.raises(UsageError, match="either cluster or world_size"):
        autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, cluster=_mixed_cluster(), world_size=4)


def test_the_even_share_steps_are_the_single_type_plan_for_the_cluster_taken_as_all_slow():
    plan = _plan()
    alone = autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, world_size=4, ranks_per_node=2, profile=SLOW)
    assert single_type_outcome(plan).candidate == alone.chosen.candidate
    assert [(o.candidate, o.step_time, o.peak_bytes) for o in plan.outcomes] == \
        [(o.candidate, o.step_time, o.peak_bytes) for o in alone.outcomes]


def test_explain_on_a_mixed_cluster_reports_each_rank_types_share_busy_and_waiting_time():
    report = autoshard.explain(lambda: build("gpt"), TOKENS, TOKENS, cluster=_mixed_cluster(), stages=("captured", "forward", "backward"))
    assert report.world_size == 4 and report.profile.name == "slow"
    fast, slow = report.mixed_cluster_step.types
    assert fast.share > slow.share and fast.ranks * fast.share + slow.ranks * slow.share == pytest.approx(1.0)
    summary = report.summary()
    assert "mixed cluster: step (planned shares)" in summary and "utilisation variance across rank types" in summary
    assert "fast (2 ranks)" in summary and "waiting" in summary


@pytest.mark.slow
def test_the_console_command_plans_a_cluster_file(tmp_path):
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps({"nodes": [{"count": 1, "profile": "h100", "ranks_per_node": 4, "memory_gb": 80},
                                          {"count": 1, "profile": "a100", "ranks_per_node": 4, "memory_gb": 40}]}))
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "autoshard", "plan", "examples/train_gpt.py:build_model", "--cluster", str(spec),
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = autoshard.Plan.load(out)
    assert plan.world_size == 8 and len(plan.batch_shares) == 8 and "rank type" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "autoshard", "plan", "examples/train_gpt.py:build_model", "--cluster", str(spec),
                          "--world-size", "8"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1 and "either cluster or world_size" in bad.stderr


def _four_blocks() -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=2, n_embd=32))


def test_a_latency_bound_replica_all_reduce_merges_blocks_and_the_plan_records_it(tmp_path):
    """Nodes joined by a link of 20 ms per ring step: a replicated layout wins, and its
    all-reduce, one per block, is mostly latency. Two blocks per all-reduce halve it; the plan
    records the option, gives it to torch.compile, and saves and loads it. The single-type plan
    (every rank as the slow one) stays one all-reduce per block."""
    nic = uniform_link("slow-nic", latency=20e-3, bandwidth=1e9)
    cluster = Cluster((NodeGroup(1, dataclasses.replace(FAST, inter=nic), 2),
                       NodeGroup(1, dataclasses.replace(SLOW, inter=nic), 2)))
    plan = autoshard.plan(_four_blocks, TOKENS, TOKENS, cluster=cluster)
    assert plan.strategy in ("hybrid", "replicate") and plan.all_reduce_blocks == 2 and plan.candidate.all_reduce_blocks == 2
    assert plan.compile_options == {"all_reduce_blocks": 2}
    per_block = next(o for o in plan.outcomes if o.candidate == dataclasses.replace(plan.candidate, all_reduce_blocks=1))
    assert plan.chosen.mixed_step < per_block.mixed_step
    assert single_type_outcome(plan).candidate.all_reduce_blocks == 1
    assert "all-reduce per 2 blocks" in plan.summary()
    plan.save(tmp_path / "plan.json")
    assert autoshard.Plan.load(tmp_path / "plan.json") == plan
    older = json.loads((tmp_path / "plan.json").read_text())
    del older["all_reduce_blocks"]  # a plan saved before the option: one all-reduce per block
    assert autoshard.Plan.from_json(json.dumps(older)).all_reduce_blocks == 1
