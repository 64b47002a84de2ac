"""Bucketing, overlap scheduling and the memory bound on a 6-layer GPT at world size 8."""
from __future__ import annotations

import pytest
import torch
from torch import fx

from autoshard._compat import c10d, remove_noop_ops
from autoshard.compiler.consistency import plan_signature
from autoshard.cost.simulator import analyze
from autoshard.passes.graph_utils import PARAMS, collectives, outputs_of, wait_of
from autoshard.passes.schedule import PLAN, SchedulePlan

from fake_pg import compile_step, same_tokens
from gpt import GPT, GPTConfig

WORLD, LAYERS = 8, 6
_cache: dict = {}


def _deep_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=LAYERS, n_head=4, n_embd=64))


def _compile(schedule: str = "autoshard", **options) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(forward, backward) of the 6-layer GPT compiled at world size 8 (cached per options)."""
    key = (schedule, tuple(sorted(options.items())))
    if key not in _cache:
        inputs = same_tokens(lambda: torch.randint(0, 256, (1, 32)))
        step = compile_step(_deep_gpt, inputs, world_size=WORLD, options={"schedule": schedule, "profile": "h100", **options})
        _cache[key] = (step.forward, step.backward)
    return _cache[key]



def _block(node: fx.Node) -> set[int]:
    """The block indices whose parameters a collective moves."""
    return {int(n.split(".")[1]) for n in node.meta[PARAMS] if n.startswith("blocks.")}


def _first_use(gather: fx.Node, order: dict[fx.Node, int]) -> int:
    outputs = outputs_of(wait_of(gather))
    return min(order[u] for o in outputs for u in o.users if u not in outputs)


def _by_block(gm: fx.GraphModule, op) -> dict[int, fx.Node]:
    return {b: n for n in collectives(gm.graph, op) for b in _block(n)}


def test_one_gather_per_block_plus_leftovers():
    fw, bw = _compile()
    gathers = collectives(fw.graph, c10d.all_gather_into_tensor.default)
    assert len(gathers) <= LAYERS + 2
    assert all(len(_block(g)) <= 1 for g in gathers)  # a bucket never spans two blocks
    assert len(collectives(bw.graph, c10d.reduce_scatter_tensor.default)) <= LAYERS + 2


def test_forward_gathers_are_issued_before_the_previous_blocks_compute():
    fw, _ = _compile()
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    gathers = _by_block(fw, c10d.all_gather_into_tensor.default)
    for k in range(1, LAYERS):
        assert order[gathers[k]] < _first_use(gathers[k - 1], order), f"block {k}"


def test_backward_prefetches_and_reduces_early():
    _, bw = _compile()
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    gathers = _by_block(bw, c10d.all_gather_into_tensor.default)
    reduces = _by_block(bw, c10d.reduce_scatter_tensor.default)
    # the blocks the backward starts with stay gathered from the forward (at least the last,
    # more where the memory allows: passes/keep.py); every block below them is gathered again
    regathered = len(gathers)
    assert 1 <= regathered < LAYERS and set(gathers) == set(range(regathered))
    for k in range(1, regathered):  # re-gathers prefetched in reverse order
        assert order[gathers[k - 1]] < _first_use(gathers[k], order), f"block {k}"
    for k in range(1, regathered + 1):  # a block's gradients are reduced before the block below computes
        assert order[reduces[k]] < _first_use(gathers[k - 1], order), f"block {k}"


def test_fsdp2_schedule_prefetches_one_block_and_reduces_one_at_a_time():
    fw, bw = _compile("fsdp2")
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    gathers = _by_block(fw, c10d.all_gather_into_tensor.default)
    for k in range(2, LAYERS):  # issued during the block before, not earlier
        assert _first_use(gathers[k - 2], order) < order[gathers[k]] < _first_use(gathers[k - 1], order), f"block {k}"
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    reduces = collectives(bw.graph, c10d.reduce_scatter_tensor.default)
    for r, later in zip(reduces, reduces[1:]):  # waited before the next one is issued
        assert order[wait_of(r)] < order[later]


def _plans(schedule: str = "autoshard", profile: str = "cpu", **options) -> list[SchedulePlan]:
    """The schedule's plan of the forward and the backward (gloo's workspaces: profile "cpu")."""
    return [g.meta[PLAN] for g in _compile(schedule, profile=profile, **options)]


def test_by_default_never_more_memory_than_fsdp2_nor_slower():
    """On GPUs FSDP2 prefetches as our graph can: the default step is no bigger and no slower.
    Both steps are played by the simulator from the final graphs, forward and backward
    together, not read from the plans the schedule chose them by."""
    ours, fsdp2 = (analyze(*_compile(schedule), "h100") for schedule in ("autoshard", "fsdp2"))
    assert ours.peak_bytes <= fsdp2.peak_bytes
    assert ours.step_time <= fsdp2.step_time * (1 + 1e-9)  # float sums in another order


def test_on_gloo_the_default_fits_fsdp2_eager_whose_collectives_block():
    """On CPU ranks FSDP2 eager's collectives block: its peak, the default's budget, is what
    our graph holds under its policy ("fsdp2": each gather waited at its issue), and at least
    that, since FSDP2 keeps a reduction's input until the next one is issued where our graph
    frees it at the wait. The default fits it, and is no slower than that policy."""
    ours, fsdp2 = _plans(), _plans("fsdp2")
    for mine, theirs in zip(ours, fsdp2):
        assert all(theirs.blocked) and theirs.reduces_in_flight == 0
        assert mine.peak_bytes <= mine.budget_bytes == mine.reference_bytes
        assert theirs.peak_bytes <= mine.reference_bytes
        assert mine.step_time <= theirs.step_time


def test_a_memory_budget_bounds_the_predicted_peak():
    """Three budgets between the smallest that fits (gathering at use) and the fastest plan's
    peak: each plan fits its budget, and a larger budget gives no slower a plan (the search is
    greedy: within 1%)."""
    fastest = _plans(memory_budget_gb=1e3)
    low, high = max(p.smallest_bytes for p in fastest), max(p.peak_bytes for p in fastest)
    assert low < high
    times = []
    for share in (0.25, 0.5, 0.75):
        budget = low + share * (high - low)
        plans = _plans(memory_budget_gb=budget / 2**30)
        assert all(p.peak_bytes <= budget and p.budget_bytes == int(budget / 2**30 * 2**30) for p in plans)
        times.append(sum(p.step_time for p in plans))
    assert all(later <= 1.01 * earlier for earlier, later in zip(times, times[1:])), times
    assert any(p.forced for p in _plans(memory_budget_gb=(low + 0.25 * (high - low)) / 2**30))  # the budget binds


def test_a_budget_no_schedule_fits_is_a_clear_error():
    with pytest.raises(Exception, match=r"autoshard option 'memory_budget_gb': 0\.000 GiB is below what this graph needs .* GiB"):
        _compile(memory_budget_gb=1e-6)


def test_a_bound_too_small_for_any_schedule_is_a_clear_error():
    with pytest.raises(Exception, match=r"autoshard option 'max_inflight_mb': 0\.010 MiB is below the .* MiB of gathered parameters"):
        _compile(max_inflight_mb=0.01)


def test_autoshard_exposes_less_communication_than_the_baselines():
    exposed = {s: analyze(*_compile(s), "h100").exposed_comm for s in ("none", "inductor", "autoshard")}
    assert exposed["autoshard"] < exposed["none"]
    assert exposed["autoshard"] <= exposed["inductor"]


def test_plan_signature_ignores_rank_dependent_padding():
    signatures = []
    for rank in (0, WORLD - 1):  # "uneven" pads shards on the last ranks only
        step = compile_step("uneven", lambda: (torch.randn(2, 16), torch.randn(2, 1)), world_size=WORLD, rank=rank)
        signatures.append(plan_signature(step.forward))
    assert signatures[0] == signatures[1]


def test_ranks_keep_the_same_nodes_when_a_compiler_drops_no_ops():
    """"uneven" pads and cuts shards on the last rank only (fc1's 10 rows are 3, 3, 3, 1; fc2's
    3 rows 1, 1, 1, 0): Inductor's partitioner drops the pads and cuts that change nothing, as
    on rank 0. Each rank's lowered joint graph keeps the same ops in the same order anyway, and
    the partitioned graphs compile to one plan (Qwen2-MoE split here under Inductor)."""
    graphs, signatures = [], []
    for rank in (0, WORLD - 1):
        step = compile_step("uneven", lambda: (torch.randn(2, 16), torch.randn(2, 1)), world_size=WORLD, rank=rank)
        (lowered,) = step.graphs["lowered"]
        remove_noop_ops(lowered.graph)
        graphs.append([str(n.target) for n in lowered.graph.nodes])
        signatures.append((plan_signature(step.forward), plan_signature(step.backward)))
    assert graphs[0] == graphs[1]
    assert signatures[0] == signatures[1]


def test_a_fake_model_compiles_and_its_gathers_are_used():
    """Models of fake tensors compile, so large shapes need no memory. A big tied embedding
    forms its own bucket: no gather goes unused."""
    step = compile_step(lambda: GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=2, n_head=4, n_embd=64)),
                        same_tokens(lambda: torch.zeros(1, 32, dtype=torch.long)),
                        world_size=WORLD, mesh=(WORLD,), fake=True, options={"profile": "h100"})
    for gm in (step.forward, step.backward):
        for gather in collectives(gm.graph, c10d.all_gather_into_tensor.default):
            outputs = outputs_of(wait_of(gather))
            assert any(u not in outputs for o in outputs for u in o.users), gather.meta[PARAMS]
