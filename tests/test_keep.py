"""passes/keep.py: which gathered blocks stay gathered from forward to backward, on the lowered
joint graph of a 4-block GPT at world size 8 (fake process group).

The joint graph runs the blocks forward, turns, and runs them back; the backward needs block 3
first::

    forward:  gather 0, 1, 2, 3, ln_f | turn | backward: 3, ln_f, 2, 1, 0
    kept, no budget:            3, ln_f (needed first)
    kept, a budget for all:     0, 1, 2, 3, ln_f
    kept, a budget with no room left over: 3, ln_f
    room left over: a block's reduction in flight (2 blocks) and a gather's copy-in (its shards)
"""
from __future__ import annotations

import pytest
import torch
from torch import fx

import autoshard
from autoshard._compat import c10d
from autoshard.passes.graph_utils import PARAMS, block_of, positions, wait_of
from autoshard.passes.keep import _Live, kept_for_backward, needed_first, room
from autoshard.passes.schedule import PLAN

from fake_pg import compile_step, count, same_tokens
from gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)


def _model() -> GPT:
    return GPT(CFG)


_tokens = same_tokens(lambda: torch.zeros(2, 16, dtype=torch.long))


@pytest.fixture(scope="module")
def joint() -> fx.GraphModule:
    """The lowered joint graph (default flags: every gather's ``reshard`` is None)."""
    return compile_step(_model, _tokens, world_size=8, options={"schedule": "none"}).only("lowered")


def _fulls(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Each parameter's gathered value in the joint forward (lowering gathers each once)."""
    return {n.meta[PARAMS][0]: wait_of(n) for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default}


def _blocks(names: set[str]) -> set[str | None]:
    return {block_of(n) for n in names}


def test_without_a_budget_only_what_the_backward_needs_first(joint):
    fulls, order = _fulls(joint), positions(joint.graph.nodes)
    first = needed_first(fulls, order)
    assert _blocks(first) == {"blocks.3", None} and "ln_f.weight" in first and "wte.weight" not in first
    assert kept_for_backward(joint.graph, fulls, order) == first


def test_the_budget_decides_how_many_blocks_stay(joint):
    fulls, order = _fulls(joint), positions(joint.graph.nodes)
    live = _Live(joint.graph, fulls)
    first, every = needed_first(fulls, order), {n for n in fulls if block_of(n) is not None} | needed_first(fulls, order)
    # Keeping more only ever adds bytes, and keeping a block costs about its gathered bytes.
    assert live.peak(set()) <= live.peak(first) < live.peak(every)
    block = live.bytes_of(n for n in fulls if block_of(n) == "blocks.0")
    widest = max(live.bytes_of(n for n in fulls if block_of(n) == f"blocks.{i}") for i in range(4))
    assert block > 0 and live.peak(every) - live.peak(first) <= 3 * block
    assert _blocks(kept_for_backward(joint.graph, fulls, order, budget_bytes=2**40)) == {f"blocks.{i}" for i in range(4)} | {None}
    # The schedule's room: a block's reduction in flight (two blocks' bytes) and a gather's
    # copy-in (its shards: 1/8 of the block at world size 8).
    candidates = [[n for n in fulls if block_of(n) == f"blocks.{i}"] for i in (2, 1, 0)]
    extra = room(live, candidates)
    assert 2 * widest < extra <= 2 * widest + widest // 8 + 64
    # Room for the last block's peak and the schedule's, nothing more; one block of room is not enough.
    assert kept_for_backward(joint.graph, fulls, order, budget_bytes=live.peak(first) + extra) == first
    one = first | set(candidates[0])
    assert kept_for_backward(joint.graph, fulls, order, budget_bytes=live.peak(one) + widest) == first
    # Just enough for two blocks more.
    two = first | {n for n in fulls if block_of(n) in ("blocks.1", "blocks.2")}
    assert _blocks(kept_for_backward(joint.graph, fulls, order, budget_bytes=live.peak(two) + extra)) == _blocks(two)


def test_a_kept_block_is_not_gathered_in_backward():
    """Through the backend: the memory budget option reaches the joint graph."""
    tight = compile_step(_model, _tokens, world_size=8, options={"schedule": "none"})
    roomy = compile_step(_model, _tokens, world_size=8, options={"schedule": "none", "memory_budget_gb": 4.0})
    gathered = [{name for n in s.backward.graph.nodes if n.target is c10d.all_gather_into_tensor.default for name in n.meta[PARAMS]}
                for s in (tight, roomy)]
    assert _blocks(gathered[0]) == {"blocks.0", "blocks.1", "blocks.2", None}  # the tied embedding/head is gathered again
    assert gathered[1] == {"wte.weight"}
    assert count(roomy.forward, "all_gather_into_tensor") == count(tight.forward, "all_gather_into_tensor")


# A GPT whose blocks are large against its activations, as in the 12.7M config where one block
# of room made budgets fail: at 2 ranks a budget between what the default needs and what keeping
# everything needs kept every block, then the schedule could not meet it (keeping fewer fits).
WIDE = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=256)


def _smallest(options: dict) -> int:
    """The least memory (bytes, optimizer state included) the step's plans need under ``options``."""
    report = autoshard.explain(lambda: GPT(WIDE), *_tokens(), world_size=2, profile="cpu", compiler="aot_eager", **options)
    return max(report.stages[side].meta[PLAN].smallest_bytes for side in ("forward", "backward"))


def test_every_budget_the_default_fits_compiles():
    low = _smallest({})  # only the block the backward needs first kept
    high = _smallest({"memory_budget_gb": 1e6})  # every block kept
    assert low < high
    for share in (0.25, 0.5, 0.75, 1.0):
        budget = (low + share * (high - low)) / 2**30
        report = autoshard.explain(lambda: GPT(WIDE), *_tokens(), world_size=2, profile="cpu", compiler="aot_eager",
                                   memory_budget_gb=budget)
        # The plans' peaks hold the optimizer state and parameter shards too: within the budget.
        assert all(report.stages[side].meta[PLAN].peak_bytes <= budget * 2**30 for side in ("forward", "backward"))
