"""Expert parallelism on the simulator and in the planner: the report shows an MoE layer's
all-to-alls as communication, ``autoshard.plan`` weighs ``experts="parallel"`` against
gathered experts like its other layouts, and ``autoshard.shard(model, plan=plan)`` applies the
choice. Fake process group, one process: the MoE GPT with examples/moe_balanced.py's experts
(static shapes: the gathered layout compiles in one graph too)."""
from __future__ import annotations

import functools

import pytest
import torch
from moe_balanced import build
from moe_gpt import MoEConfig
from torch.distributed.tensor import DTensor

import autoshard
from autoshard._compat import fake_tensor_mode
from autoshard.runtime.experts import MARK

from fake_pg import fake_world

pytestmark = pytest.mark.planner

WORLD = 8
# Few tokens, wide experts: gathering every expert costs more than sending the tokens.
WIDE = MoEConfig(n_embd=64, n_expert=8, expert_hidden=1024, block_size=8)
# Many tokens, tiny experts: the exchanges cost more than gathering the experts (hidden behind compute).
TINY = MoEConfig(n_embd=64, n_expert=8, expert_hidden=8, block_size=2048)
SHAPES = {"wide": WIDE, "tiny": TINY}


def _tokens(cfg: MoEConfig) -> torch.Tensor:
    return torch.zeros(1, cfg.block_size, dtype=torch.long)


@functools.cache
def _plan(name: str, budget_gb: float | None = None) -> autoshard.Plan:
    cfg = SHAPES[name]
    return autoshard.plan(lambda: build(cfg), _tokens(cfg), _tokens(cfg), world_size=WORLD, ranks_per_node=4,
                          memory_budget_gb=budget_gb)


def test_the_report_shows_the_all_to_alls_as_exposed_communication() -> None:
    def factory():
        return autoshard.shard(build(WIDE), torch.distributed.device_mesh.init_device_mesh("cpu", (WORLD,)), experts="parallel")

    report = autoshard.explain(factory, _tokens(WIDE), _tokens(WIDE), world_size=WORLD, profile="h100")
    # Two MoE layers: a dispatch and a combine each, in forward and in backward.
    assert report.metrics["collectives"]["all_to_all"] == 8
    exchanges = [e for e in report.collectives() if e.kind == "all_to_all"]
    assert len(exchanges) == 8 and all(e.exposed > 0 and e.nbytes > 0 for e in exchanges)  # the op blocks: nothing hides them
    assert report.metrics["comm_bytes"]["all_to_all"] == sum(e.nbytes for e in exchanges)
    assert "all_to_all 8" in report.summary()
    # Compute no longer holds them: the step is compute plus exposed communication.
    a = report.analysis
    assert a.step_time == a.compute_time + a.exposed_comm


@pytest.mark.parametrize("world", [64, 1024])
def test_expert_parallelism_compiles_on_large_fake_worlds(world: int) -> None:
    """One MoE layer of 1024 small experts split over 64 and 1024 fake ranks: one graph, no
    expert gathered, the exchanges' bytes as priced (forward 2 units of T*k rows, backward 3)."""
    cfg = MoEConfig(n_embd=64, n_expert=1024, expert_hidden=16, block_size=512, n_layer=1)

    def factory():
        return autoshard.shard(build(cfg), torch.distributed.device_mesh.init_device_mesh("cpu", (world,)), experts="parallel")

    report = autoshard.explain(factory, _tokens(cfg), _tokens(cfg), world_size=world, profile="h100")
    unit = cfg.block_size * cfg.top_k * cfg.n_embd * 4
    assert report.metrics["collectives"]["all_to_all"] == 4
    assert report.metrics["comm_bytes"]["all_to_all"] == 5 * unit
    gathered = {p for e in report.collectives() if e.kind == "all_gather" for p in e.params}
    assert gathered and not any("experts" in p for p in gathered)


def test_the_plan_splits_wide_experts_and_the_summary_says_so(tmp_path) -> None:
    plan = _plan("wide")
    assert plan.experts == "parallel" and plan.layout.experts == "parallel"
    gathered = min(o.step_time for o in plan.outcomes if o.error is None and o.candidate.experts == "gathered")
    assert plan.chosen.step_time < gathered
    assert "experts parallel" in plan.summary() and "experts modules: split over all 8 ranks" in plan.summary()
    plan.save(tmp_path / "plan.json")
    assert autoshard.Plan.load(tmp_path / "plan.json") == plan


def test_the_plan_gathers_tiny_experts() -> None:
    plan = _plan("tiny")
    assert plan.experts == "gathered"
    assert any(o.candidate.experts == "parallel" and o.error is None for o in plan.outcomes)  # weighed, slower


def test_a_budget_only_split_experts_fit_splits_them() -> None:
    budget = 16 * 2**20  # between the tiny shape's split (about 14 MiB) and gathered (about 17 MiB) peaks
    plan = _plan("tiny", budget / 2**30)
    assert plan.experts == "parallel" and plan.chosen.peak_bytes <= budget
    gathered = [o for o in plan.outcomes if o.candidate.experts == "gathered"]
    assert gathered and all(o.error is not None or o.peak_bytes > budget for o in gathered)


def test_shard_with_a_plan_splits_the_experts() -> None:
    plan = _plan("wide")
    with fake_world(WORLD), fake_tensor_mode():
        model = autoshard.shard(build(WIDE), plan=plan)
    experts = model.blocks[0].moe.experts
    assert getattr(experts, MARK, False)
    assert isinstance(experts.gate_up_proj, DTensor) and experts.gate_up_proj.to_local().shape[0] == WIDE.n_expert // WORLD
