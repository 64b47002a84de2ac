"""bench/simple_fsdp.py: SimpleFSDP (torchtitan's graph_trainer) as bench/real.py and bench/overlap.py
set it up. Without the ``bench`` extra only the skip is checked; with it, the captured graphs on fake
ranks and one short run on 2 gloo ranks, whose losses must match autoshard's."""
from __future__ import annotations

import argparse

import pytest
import torch

import simple_fsdp
from gpt import GPT, GPTConfig
from real_summary import PARITY_TOL

MISSING = simple_fsdp.missing()
needs_torchtitan = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
CFG = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_missing_is_one_line_or_none():
    assert MISSING is None or (MISSING.startswith("SimpleFSDP skipped") and "\n" not in MISSING)


@needs_torchtitan
@pytest.mark.parametrize("variant", ["simplefsdp", "simplefsdp_block", "simplefsdp_auto"])
def test_fake_rank_graphs_gather_forward_and_reduce_backward(variant):
    idx = torch.zeros(2, CFG.block_size, dtype=torch.long)
    step = simple_fsdp.fake_step(lambda: GPT(CFG), (idx, idx), 4, variant, "h100")
    fw, bw = (simple_fsdp._collectives(step[s]) for s in ("forward", "backward"))
    assert fw["all_gather"] > 0 and bw["reduce_scatter"] > 0
    assert bw["all_gather"] == 0  # SimpleFSDP keeps the gathered parameters for backward
    assert step["model"].head._parameters["weight"] is step["model"].wte._parameters["weight"]  # still tied
    if variant == "simplefsdp":  # no pass: one gather per parameter use, one reduce-scatter per parameter
        assert fw["all_gather"] > 4 * len(simple_fsdp.block_buckets(step["model"]))


@pytest.mark.multirank
@needs_torchtitan
def test_real_ranks_train_like_autoshard():
    from autoshard.tools.launch import run_ranks

    import real

    args = argparse.Namespace(layers=CFG.n_layer, embd=CFG.n_embd, heads=CFG.n_head, vocab=CFG.vocab_size, seq=CFG.block_size,
                              batch=2, warmup=1, steps=2, profile="cpu", fsdp2_compile_backend="aot_eager",
                              systems=["autoshard", "simplefsdp_block"])
    per_rank = run_ranks(2, real.run_systems, args, timeout=None)
    rows = real.rows_of(2, per_rank, args.systems)
    assert [r["system"] for r in rows] == args.systems
    assert all(r["parity"] <= PARITY_TOL for r in rows)
    assert all(r["peak_mib"] > 0 and r["step_ms"] > 0 for r in rows)
