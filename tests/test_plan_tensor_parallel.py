"""autoshard.plan(..., tensor_parallel=...): the tensor-parallel degree chosen with the sharding,
each candidate compiled as parallelize_module + shard on a 2-D fake mesh; tp above 1 where the
global batch cannot give every rank a sequence, tp 1 where FSDP alone fits and is fastest, and
the summary says why."""
from __future__ import annotations

import argparse
import functools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

import autoshard
from autoshard.runtime.errors import OverBudgetError, UsageError
from autoshard.tools.plan import plan as plan_module
from autoshard.tools.plan.layouts import Candidate, candidates
from autoshard.tools.plan.result import Outcome
from autoshard.tools.plan.tensor_parallel import _why, arguments, degrees, local_inputs

from gpt import GPT, GPTConfig

pytestmark = pytest.mark.planner

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
TOKENS = torch.zeros(1, 32, dtype=torch.long)


@functools.cache
def _plan(global_batch: int, tensor_parallel: tuple[int, ...]) -> autoshard.Plan:
    return autoshard.plan(lambda: GPT(CFG), TOKENS, TOKENS, world_size=8, ranks_per_node=8, tensor_parallel=tensor_parallel,
                          tp_plan=autoshard.gpt_tp_plan, global_batch=global_batch)


def test_tp_where_the_global_batch_is_smaller_than_the_world() -> None:
    plan = _plan(2, (1, 2, 4))  # 2 sequences, 8 ranks: only tp 4 leaves dp 2 <= 2
    assert plan.tensor_parallel == 4 and plan.mesh_shape == (2,)
    by_tp = {t: [o for o in plan.outcomes if o.candidate.tensor_parallel == t] for t in (1, 2, 4)}
    assert all(o.error.startswith("skipped: 2 sequences < ") for t in (1, 2) for o in by_tp[t])
    assert all(o.error is None and o.step_time > 0 for o in by_tp[4])
    # The TP all-reduces are priced: a step on 2 data-parallel ranks with tp 4 is not free of communication.
    assert plan.chosen.exposed_comm > 0
    assert plan.tokens_per_step == 2 * 32
    summary = plan.summary()
    assert "tensor parallel: tp 4 x dp 2, because FSDP alone (tp 1) and tp 2 would leave 8 and 4 data-parallel ranks" in summary
    assert "global batch of 2 sequences" in summary
    assert f"* {plan.candidate.label(8)}" in summary and ", tp 4" in plan.candidate.label(8)


def test_tp1_where_fsdp_alone_fits_and_is_fastest() -> None:
    plan = _plan(64, (1, 2))
    fastest = min((o for o in plan.outcomes if o.error is None), key=lambda o: o.step_time)
    assert plan.chosen == fastest
    assert plan.tensor_parallel == 1, plan.summary()
    tp2 = min((o for o in plan.outcomes if o.candidate.tensor_parallel == 2), key=lambda o: o.step_time)
    assert tp2.error is None and tp2.step_time > plan.chosen.step_time
    assert "tensor parallel: tp 1 x dp 8, because tp 2 is slower" in plan.summary()
    with pytest.raises(UsageError, match="parallelize_module"):  # tp > 1: applied by hand, as the message says
        _ = _plan(2, (1, 2, 4)).layout
    assert plan.layout.mesh_shape == plan.mesh_shape  # tp 1: shard(plan=) applies it as before


def test_json_round_trip_keeps_the_degree() -> None:
    plan = _plan(2, (1, 2, 4))
    again = autoshard.Plan.from_json(plan.to_json())
    assert again == plan and again.tensor_parallel == 4 and again.candidate.tensor_parallel == 4


def test_why_memory() -> None:
    c = lambda t, s="full": Candidate(s, (8 // t,), tensor_parallel=t)  # noqa: E731
    over = Outcome(c(1), 1.0, 0.1, 100 * 2**30)
    fits = Outcome(c(2), 1.5, 0.2, 40 * 2**30)
    why = _why(fits, [over, fits], 64, 8, 80 * 2**30)
    assert why.startswith("tp 2 x dp 4, because FSDP alone (tp 1) does not fit the memory budget (its smallest peak is")


def test_bad_input() -> None:
    assert degrees((8, 1, 2, 2), 64, 8) == (1, 2, 8)
    for bad in ((3,), (16,), (0,), (), "2", (True,)):
        with pytest.raises(UsageError, match="tensor_parallel must be degrees"):
            degrees(bad, 64, 8)
    with pytest.raises(UsageError, match="needs tp_plan"):
        autoshard.plan(lambda: GPT(CFG), TOKENS, TOKENS, world_size=8, tensor_parallel=(1, 2))
    with pytest.raises(UsageError, match="global_batch must be a positive int"):
        autoshard.plan(lambda: GPT(CFG), TOKENS, TOKENS, world_size=8, tensor_parallel=(1,), global_batch=0)
    with pytest.raises(UsageError, match="no tensor-parallel degree of"):  # 1 sequence, dp at least 4
        autoshard.plan(lambda: GPT(CFG), TOKENS, TOKENS, world_size=8, tensor_parallel=(1, 2), tp_plan=autoshard.gpt_tp_plan,
                       global_batch=1)
    assert issubclass(OverBudgetError, ValueError)
    assert local_inputs((TOKENS, 3), 5)[0].shape == (5, 32)


def test_command_line_flags() -> None:
    parser = argparse.ArgumentParser()
    plan_module.add_arguments(parser)
    args = parser.parse_args("f.py:m --world-size 16 --tensor-parallel 1 2 4 --tp-plan gpt --global-batch 4".split())
    assert arguments(args) == {"tensor_parallel": (1, 2, 4), "tp_plan": autoshard.gpt_tp_plan, "global_batch": 4}
    assert arguments(parser.parse_args(["f.py:m", "--world-size", "16"])) == {}  # no flag: the search as before
    with pytest.raises(UsageError, match="go with --tensor-parallel"):
        arguments(parser.parse_args(["f.py:m", "--world-size", "16", "--global-batch", "4"]))
    with pytest.raises(UsageError, match="cannot load"):
        arguments(parser.parse_args(["f.py:m", "--tensor-parallel", "2", "--tp-plan", "nowhere.py:plan"]))


def test_default_search_is_unchanged() -> None:
    """Without tensor_parallel the candidates and their labels are as before (tp 1 everywhere)."""
    assert all(c.tensor_parallel == 1 and "tp" not in c.label(8) for c in candidates(64, 8, ("fp32", "bf16")))


@pytest.mark.slow
def test_the_70b_bench() -> None:
    """bench/tensor_parallel.py (about 30 s): torchtitan's layout predicted near its published bf16
    figure (the profile's known compute bias, docs/published.md, is about 1.3x fast), sequence
    parallelism keeping the predicted memory within the GPU, and the plans where the batch rules out FSDP alone."""
    from tensor_parallel import PUBLISHED, planned, replay  # bench/, on the path from conftest

    # The replay in a second process while this one plans (CI time: both single-threaded compiles).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        # Megatron's plan without SP (over the GPU's memory: the bench's --tp-plan megatron) is not rerun here.
        replayed = pool.submit(replay)
        # Degrees 1 and 2 only (CI time: each degree compiles 2 depths x 2 layouts; the bench's plan table has all four).
        plan, text = planned(1024, 512, degrees=(1, 2))
        titan = replayed.result()
    assert 0.8 < titan["tokens_per_s"] / PUBLISHED["vanilla TP"] < 1.4
    assert titan["memory_gib"] < 96e9 / 2**30  # SP and loss parallel: fits the GPU
    assert titan["tp_comm_s"] > 0
    assert plan is not None and plan.tensor_parallel == 2 and plan.mesh_shape[0] * plan.tensor_parallel == 1024
    assert plan.mesh_shape[0] <= 512 and "would leave 1024 data-parallel ranks" in text
    plan, text = planned(4096, 256)
    assert plan is None and "no tensor-parallel degree of (1, 2, 4, 8)" in text
