"""autoshard.plan: every layout of the world compiled on fake ranks and played on the cost
model; the fastest that fits the budget is chosen, and autoshard.shard(plan=...) applies it
on real ranks."""
from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys

import pytest
import torch

import autoshard
from autoshard._compat import fake_tensor_mode
from autoshard.cost.cost_model import get_profile
from autoshard.runtime.errors import UsageError
from autoshard.runtime.layout import ShardLayout
from autoshard.tools.launch import run_ranks
from autoshard.tools.plan.layouts import Bounds, Params, repeated_blocks
from autoshard.tools.plan.plan import OVER_BUDGET, Candidate, candidates

from fake_pg import fake_world
from models import build
from trainer import train_pair

pytestmark = pytest.mark.planner

TOKENS = torch.zeros(1, 16, dtype=torch.long)


@functools.cache
def _plan(world: int = 16, per_node: int = 4, budget: float | None = None) -> autoshard.Plan:
    lines: list[str] = []
    plan = autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, world_size=world, ranks_per_node=per_node,
                          memory_budget_gb=budget, progress=lines.append)
    assert len(lines) == len(plan.outcomes)  # a progress line per candidate
    return plan


def test_the_candidates_are_every_strategy_and_hybrid_shard_groups_of_whole_nodes():
    assert candidates(16, 4) == [Candidate("full", (16,)), Candidate("grad_op", (16,)), Candidate("hybrid", (4, 4)),
                                 Candidate("hybrid", (2, 8)), Candidate("replicate", (16,))]
    assert candidates(8, 8) == [Candidate("full", (8,)), Candidate("grad_op", (8,)), Candidate("replicate", (8,))]


def test_without_a_budget_the_plan_is_the_fastest_candidate():
    plan = _plan()
    assert [o.candidate for o in plan.outcomes] == candidates(16, 4)
    # This tiny model is compute-bound: no candidate's bounds rule it out, so each is compiled.
    assert all(o.error is None and o.step_time > 0 and o.peak_bytes > 0 for o in plan.outcomes)
    assert plan.chosen.step_time == min(o.step_time for o in plan.outcomes)
    assert not plan.blocks  # the fastest fits: nothing to mix
    # Energy on the h100 profile's power figures; tokens from the first input (16 per rank).
    assert plan.tokens_per_step == 16 * 16 and all(o.energy_j > 0 for o in plan.outcomes)
    assert "kWh/Mtok" in plan.summary()
    summary = plan.summary()
    assert summary.count("\n* ") == 1 and "hybrid, shard over 2 nodes" in summary and "(4, 4)" in summary


def test_a_budget_rules_out_the_candidates_above_it():
    """A budget between the smallest and the largest candidate peak: the plan is the fastest
    candidate that fits, never one above the budget (with the budget's schedule inside)."""
    free = _plan()
    peaks = sorted(o.peak_bytes for o in free.outcomes)
    budget_bytes = (peaks[0] + peaks[-1]) // 2
    plan = _plan(budget=budget_bytes / 2**30)
    fitting = [o for o in plan.outcomes if o.error is None and o.peak_bytes <= budget_bytes]
    assert fitting and len(fitting) < len(plan.outcomes)
    assert plan.chosen.peak_bytes <= budget_bytes
    assert plan.chosen.step_time == min(o.step_time for o in fitting)
    assert "over budget" in plan.summary() or any(o.error for o in plan.outcomes)


def test_a_budget_no_layout_fits_names_the_smallest_peak():
    with pytest.raises(ValueError, match="no layout of 16 ranks fits memory_budget_gb"):
        autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, world_size=16, ranks_per_node=4, memory_budget_gb=1e-9)


@pytest.mark.slow
def test_bf16_doubles_the_candidates_and_holds_its_gathers_in_half_the_bytes():
    plan = autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, world_size=16, ranks_per_node=4, precisions=("fp32", "bf16"))
    assert [o.candidate for o in plan.outcomes] == candidates(16, 4, ("fp32", "bf16"))
    by = {o.candidate: o for o in plan.outcomes}
    full, bf16 = by[Candidate("full", (16,))], by[Candidate("full", (16,), "bf16")]
    assert bf16.peak_bytes < full.peak_bytes  # gathered in bfloat16 (on this tiny model the casts cost more time than they save)
    assert plan.chosen.step_time == min(o.step_time for o in plan.outcomes)
    assert "full, bf16" in plan.summary()
    assert (plan.mixed_precision is None) == (plan.precision == "fp32")
    assert autoshard.Plan.from_json(plan.to_json()) == plan
    as_bf16 = dataclasses.replace(plan, strategy="hybrid", mesh_shape=(4, 4), precision="bf16")
    with fake_world(16):
        model = autoshard.shard(build("gpt"), plan=as_bf16)
    specs = [spec for m in model.modules() for spec in getattr(m, "_autoshard_specs", {}).values()]
    assert specs and all(s.param_dtype == torch.bfloat16 and s.reduce_dtype == torch.float32 and s.world_size == 4 for s in specs)
    with pytest.raises(ValueError, match="precisions must be some of"):
        autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, world_size=8, precisions=("fp8",))


def test_a_plan_round_trips_through_json(tmp_path):
    plan = _plan()
    plan.save(tmp_path / "plan.json")
    assert autoshard.Plan.load(tmp_path / "plan.json") == plan


def test_a_bad_backend_option_fails_before_any_compile():
    lines: list[str] = []
    with pytest.raises(ValueError, match="unknown option"):
        autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, world_size=8, progress=lines.append, bucket_size=4)
    assert lines == []


def test_a_factory_must_leave_the_sharding_to_the_plan():
    with pytest.raises(ValueError, match="return it unsharded"):
        autoshard.plan(lambda: autoshard.shard(build("gpt")), TOKENS, TOKENS, world_size=8)


def _train_planned(plans: dict[str, tuple[str, autoshard.Plan]]) -> dict[str, dict]:
    return {name: train_pair(model, functools.partial(autoshard.shard, plan=p)) for name, (model, p) in plans.items()}


@pytest.mark.slow
@pytest.mark.multirank
def test_a_plan_for_two_nodes_of_two_ranks_trains_like_one_process():
    """The plan made for 4 ranks as 2 nodes x 2 ranks, the same world laid out as hybrid
    sharding over one node (a 2x2 mesh), and a mixed layout (the GPT's first block hybrid,
    the rest full shard), applied on 4 gloo ranks: each trains like one process."""
    plan = autoshard.plan(lambda: build("uneven"), *_uneven_args(), world_size=4, ranks_per_node=2)
    hybrid = dataclasses.replace(plan, strategy="hybrid", mesh_shape=(2, 2))
    mixed = dataclasses.replace(plan, strategy="full", mesh_shape=(4,), blocks=("blocks.0",), block_strategy="hybrid",
                                block_mesh_shape=(2, 2))
    for rank in run_ranks(4, _train_planned, {"planned": ("uneven", plan), "hybrid": ("uneven", hybrid), "mixed": ("gpt", mixed)}):
        for name, found in rank.items():
            assert found["loss"] <= 1e-5 and found["params"] <= 1e-5, (name, found)


def _uneven_args() -> tuple:
    from models import GLOBAL_BATCH, batch
    x, y = batch("uneven", 0)
    return x[: GLOBAL_BATCH // 4], y[: GLOBAL_BATCH // 4]


def test_a_plan_for_another_world_size_is_refused():
    plan = _plan()
    with pytest.raises(ValueError, match="made for 16 ranks but this process group has 1"):
        autoshard.shard(build("gpt"), plan=plan)
    with pytest.raises(ValueError, match="either plan= or mesh/strategy/mixed_precision"):
        autoshard.shard(build("gpt"), plan=plan, strategy="replicate")


@pytest.mark.slow
def test_the_console_command_prints_each_candidate_and_writes_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "autoshard", "plan", "examples/train_gpt.py:build_model", "--world-size", "8",
                           "--ranks-per-node", "4", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    progress = [line for line in proc.stdout.splitlines() if line.startswith("autoshard plan: ")]
    plan = autoshard.Plan.load(out)
    assert len(progress) == len(plan.outcomes) == len(candidates(8, 4))
    assert plan.world_size == 8 and plan.summary().splitlines()[0] in proc.stdout


def test_the_bounds_are_below_what_the_compiled_candidates_cost():
    """The planner skips a layout whose bounds already lose, so they must never exceed what
    compiling the layout predicts: shards, gradients and optimizer state below its peak, its
    busiest group's collectives below its step; mixed layouts sit between their two parts."""
    plan = _plan()
    with fake_tensor_mode():
        params = Params.of(build("gpt"))
    assert params.blocks.keys() == {"blocks.0", "blocks.1"}
    bounds = Bounds(params, dataclasses.replace(get_profile("h100"), ranks_per_node=4), optimizer_states=2)
    for o in plan.outcomes:
        assert 0 < bounds.memory(o.candidate) <= o.peak_bytes, o
        assert 0 < bounds.step(o.candidate) <= o.step_time, o
    full, hybrid = Candidate("full", (16,)), Candidate("hybrid", (4, 4))
    mixed = full.mixed_layout(("blocks.0",), hybrid)
    assert bounds.memory(full) < bounds.memory(mixed) < bounds.memory(hybrid)
    # Full shard over 4 nodes sends everything across them; hybrid only its replicas' all-reduce.
    assert bounds.link_bytes(full)[0] == 0 < bounds.link_bytes(full)[1]
    within, across = bounds.link_bytes(hybrid)
    assert 0 < across < within and across < bounds.link_bytes(full)[1]
    assert dict((o.candidate, o.link_bytes) for o in plan.outcomes)[hybrid] == (within, across)


def test_repeated_blocks_are_the_largest_list_of_one_class():
    assert repeated_blocks(build("gpt")) == ("blocks.0", "blocks.1")
    assert repeated_blocks(build("mlp")) == ()


# Wide and shallow, at 64 ranks of 8 per node: communication-bound (every full-shard gather
# crosses nodes), yet quick to compile (a fake tensor's size costs nothing).
WIDE = dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=512)


def _wide():
    from gpt import GPT, GPTConfig
    return GPT(GPTConfig(**WIDE))


@functools.cache
def _wide_plans() -> tuple[autoshard.Plan, autoshard.Plan]:
    # Every block resharded after forward (the budget below is placed between peaks of that setting).
    free = autoshard.plan(_wide, TOKENS, TOKENS, world_size=64, ranks_per_node=8, reshard_after_forward=True)
    by = {o.candidate: o for o in free.outcomes}
    full, hybrid = by[Candidate("full", (64,))], by[Candidate("hybrid", (8, 8))]
    budget = full.peak_bytes + (hybrid.peak_bytes - full.peak_bytes) / 6  # full shard fits, hybrid over one node does not
    return free, autoshard.plan(_wide, TOKENS, TOKENS, world_size=64, ranks_per_node=8, memory_budget_gb=budget / 2**30,
                                reshard_after_forward=True)


@pytest.mark.slow
def test_bounds_skip_layouts_that_cannot_win_without_compiling_them():
    free, _ = _wide_plans()
    assert free.candidate == Candidate("hybrid", (8, 8))
    skipped = [o for o in free.outcomes if o.error and o.error.startswith("skipped")]
    assert skipped and all(o.step_time is None for o in skipped)
    assert {o.candidate.strategy for o in free.outcomes if o.error is None} >= {"full", "hybrid"}  # the baselines, always


def test_under_a_budget_hybrid_misses_some_blocks_go_hybrid_and_beat_every_whole_model_layout():
    """The budget lies between full shard's peak and hybrid-over-one-node's: the plan lays out
    some blocks sharded within a node and the rest as the fastest layout that fits, faster than
    every whole-model layout that fits and within the budget; explain of the model sharded by
    the plan predicts what the plan says."""
    _, plan = _wide_plans()
    limit = plan.memory_budget_gb * 2**30
    whole = [o for o in plan.outcomes if o.candidate.whole and o.error is None and o.peak_bytes <= limit]
    hybrid = next(o for o in plan.outcomes if o.candidate == Candidate("hybrid", (8, 8)))
    assert hybrid.error == OVER_BUDGET or hybrid.peak_bytes > limit
    assert plan.blocks and plan.block_strategy == "hybrid" and plan.block_mesh_shape == (8, 8)
    assert plan.chosen.peak_bytes <= limit
    assert whole and plan.chosen.step_time < min(o.step_time for o in whole)
    assert autoshard.Plan.from_json(plan.to_json()) == plan
    assert "hybrid, shard over 1 node for blocks.0" in plan.summary()
    report = autoshard.explain(lambda: autoshard.shard(_wide(), plan=plan), TOKENS, TOKENS, world_size=64, profile="h100",
                               memory_budget_gb=plan.memory_budget_gb, reshard_after_forward=True)
    assert report.metrics["step_time"] == pytest.approx(plan.chosen.step_time, rel=1e-9)
    with fake_world(64):
        model = autoshard.shard(_wide(), plan=plan)
    assert {spec.world_size for spec in model.blocks[0].fc._autoshard_specs.values()} == {8}
    assert {spec.world_size for spec in model.blocks[-1].fc._autoshard_specs.values()} == {plan.mesh_shape[-1]}


def test_a_plan_naming_a_block_the_model_lacks_is_refused_before_anything_changes():
    _, plan = _wide_plans()
    with fake_world(64):
        model = build("gpt")
        with pytest.raises(ValueError, match="does not have"):
            autoshard.shard(model, plan=dataclasses.replace(plan, blocks=("blocks.0", "blocks.7")))
        assert not any(getattr(m, "_autoshard_specs", None) for m in model.modules())


def test_hybrid_shard_groups_stop_growing_once_a_fitting_one_is_slower():
    from autoshard.tools.plan.plan import Outcome, _past_the_best_hybrid
    one, two, four = (Candidate("hybrid", (64 // n, n)) for n in (8, 16, 32))
    fast, slower = Outcome(one, 1.0, 0.1, 100), Outcome(two, 2.0, 0.2, 90)
    assert not _past_the_best_hybrid([fast], limit=1000)
    assert _past_the_best_hybrid([fast, slower], limit=1000)
    assert not _past_the_best_hybrid([fast, slower], limit=85)  # the slower one does not fit: bigger groups may
    assert not _past_the_best_hybrid([slower, Outcome(four, 1.5, 0.1, 80)], limit=1000)  # still getting faster


def test_the_mixed_search_compiles_two_block_counts_at_most_and_keeps_within_the_budget():
    """Compiles replaced by a peak linear in the blocks moved (3 MiB each over full shard's
    100 MiB, under a 160 MiB budget: 20 blocks fit). The state alone (0.5 MiB a block) would
    move all 40: that try misses, the next goes halfway back and fits; then nothing more
    (TRIES compiles), and the same pair is not searched again."""
    from autoshard.tools.plan.plan import TRIES, Outcome, _mixed_layouts, _Search

    blocks = tuple(f"blocks.{i}" for i in range(40))
    params = Params(nbytes=40 * 2**20, trainable_nbytes=40 * 2**20, element_size=4.0, blocks={b: (2**20, 2**20) for b in blocks})
    full, hybrid = Candidate("full", (1024,)), Candidate("hybrid", (128, 8))

    class Replayed(_Search):
        def add(self, c, skip=None):
            k = len(c.blocks)
            peak = 100 * 2**20 + (3 * 2**20 * k if c.blocks else (10**9 if c == hybrid else 0))
            self.outcomes.append(Outcome(c, 2.0 - 0.01 * k, 0.0, peak))
            return self.outcomes[-1]

    search = Replayed(None, (), {}, Bounds(params, get_profile("h100"), 2), 160 * 2**20, 8, None)
    search.add(full), search.add(hybrid)
    _mixed_layouts(search, blocks, "fp32")
    assert TRIES == 2 and [len(o.candidate.blocks) for o in search.outcomes[2:]] == [40, 20]
    assert search.fastest_fitting().candidate == full.mixed_layout(blocks[:20], hybrid)
    _mixed_layouts(search, blocks, "fp32")
    assert len(search.outcomes) == 4


def test_shard_takes_a_plans_layout_and_refuses_anything_else():
    """The runtime reads only its own type, ShardLayout, which a Plan carries as ``layout``."""
    layout = ShardLayout("full", (1,), 1)
    with fake_world(1):
        assert autoshard.is_sharded(autoshard.shard(build("mlp"), plan=layout))
    with pytest.raises(UsageError, match="plan= takes an autoshard.Plan or a ShardLayout, got dict"):
        autoshard.shard(build("mlp"), plan={"strategy": "full"})


def test_int8_gathers_are_planned_only_where_allowed_and_the_summary_says_what_they_save():
    """Lossy choices only where a user lists them: the int8 precisions gather int8 (never for
    replicate, which gathers nothing). Over a network 1000x slower than an H100 cluster's, with a
    budget full shard in float32 does not fit, the plan gathers int8, says so with the bytes it
    sends, and shard(plan=...) applies the compression."""
    from autoshard.cost.profiles import Link

    assert not any(c.precision.endswith("int8") for c in candidates(16, 4, ("fp32", "bf16")))
    assert all(c.strategy != "replicate" for c in candidates(16, 4, ("int8", "bf16_int8")))
    h100 = get_profile("h100")
    slow = dataclasses.replace(h100, name="h100_slow_network",
                               inter=Link("slow", h100.inter.latency, {k: v / 1000 for k, v in h100.inter.bandwidth.items()}))
    plan = autoshard.plan(lambda: build("gpt"), TOKENS, TOKENS, world_size=16, ranks_per_node=4, precisions=("fp32", "int8"),
                          profile=slow, memory_budget_gb=200 / 2**20)
    by = {o.candidate: o for o in plan.outcomes}
    full, full_int8 = by[Candidate("full", (16,))], by[Candidate("full", (16,), "int8")]
    assert full_int8.step_time < full.step_time
    # The gathers at 0.254x: what crosses nodes halves (the reduce-scatters stay float32).
    assert 0.45 < full_int8.link_bytes[1] / full.link_bytes[1] < 0.55
    assert plan.precision.endswith("int8") and plan.compression == autoshard.Compression(gather="int8")
    assert plan.mixed_precision is None  # "int8" computes in float32
    assert "gathers: int8 with a float32 scale per 256 elements" in plan.summary() and "sends" in plan.summary()
    assert autoshard.Plan.from_json(plan.to_json()) == plan
    with fake_world(16):
        model = autoshard.shard(build("gpt"), plan=plan)
        specs = [spec for m in model.modules() for spec in getattr(m, "_autoshard_specs", {}).values()]
        assert specs and all(s.quant_block == 256 for s in specs)  # every parameter of this GPT is a float gathered over > 1 rank
        with pytest.raises(UsageError, match="pass either plan= or compression="):
            autoshard.shard(build("gpt"), plan=plan, compression=autoshard.Compression(gather="int8"))
