"""Expert parallelism (``autoshard.shard(model, experts="parallel")``): experts stay on the rank
owning them and tokens travel by all-to-all. The example MoE GPT trains exactly as one
process on the whole batch (a ``transformers`` Mixtral too: tests/models/test_moe_models.py); the compiled graphs gather no expert
weight, one graph covers the model whatever the routing, and each rank holds 1/N of the
experts."""
from __future__ import annotations

import re
from pathlib import Path

import moe_trainer
import pytest
import torch
from torch import nn

import autoshard
from autoshard.launch import run_ranks
from autoshard.runtime.experts import is_experts

pytestmark = pytest.mark.multirank

TOL = 1e-5
_GATHER = re.compile(r'all_gather_into_tensor\w*: "\w+\[(\d+)\]')


def _check(found: dict) -> None:
    assert found["loss"] <= TOL and found["params"] <= TOL, (found["loss"], found["params"])


def _gathered_in_forward(debug_dir: Path) -> int:
    """Elements the rank-0 forward graphs all-gather, read from the dumped final graphs."""
    return sum(int(n) for f in sorted(debug_dir.glob("rank0/graph*/forward.py")) for n in _GATHER.findall(f.read_text()))


def _dense_padded(name: str, world: int) -> int:
    """Elements an all-gather of every non-expert parameter moves (each padded to whole rows per rank)."""
    model = moe_trainer.build(name)
    experts = {id(p) for m in model.modules() if is_experts(m) for p in m.parameters(recurse=False)}
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        if id(p) not in experts and p.dim() > 0:
            rows = -(-p.shape[0] // world) * world
            total += rows * p[0].numel()
    return total


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_moe_gpt_trains_like_one_process_gathering_no_expert(world: int, tmp_path: Path) -> None:
    found = run_ranks(world, moe_trainer.train, "moe_gpt", "aot_eager", 3, str(tmp_path), timeout=900)
    for f in found:
        _check(f)
        # One graph for forward and backward over three batches routed differently.
        assert f["graphs"] == 1, f["graphs"]
        local, full = f["expert_bytes"]
        assert local * world == full
    assert found[0]["state_dict_shapes"]["blocks.0.moe.experts.gate_up_proj"] == (8 // world, 256, 64)
    # Only the dense parameters are gathered (the tied-free MoE GPT gathers each once in forward).
    assert _gathered_in_forward(tmp_path) == _dense_padded("moe_gpt", world)
    forward = (tmp_path / "rank0" / "graph0" / "forward.py").read_text()
    backward = (tmp_path / "rank0" / "graph0" / "backward.py").read_text()
    assert forward.count("torch.ops.autoshard.expert_parallel.default(") == 2
    assert backward.count("torch.ops.autoshard.expert_parallel_backward.default(") == 2


def test_gathered_experts_handed_to_eager_code_train_like_one_process() -> None:
    """Experts sharded as any parameter (the default): the example's experts loop runs eagerly
    (``torch.compiler.disable``), handed the expert weights read in the graph before the break.
    Those reads must reach it gathered (they reached it as the NaN placeholders the backend
    gathers, and, with automatic dynamic shapes, a getter recompiled for another parameter's
    shape gathered with the first one's sizes)."""
    for found in run_ranks(2, moe_trainer.train, "moe_gpt", "aot_eager", 3, None, "gathered", timeout=900):
        _check(found)


def test_blocks_sharded_first_then_the_root() -> None:
    """Experts split by a block's shard call; the root's (default) call leaves them alone."""
    found = run_ranks(2, moe_trainer.train, "moe_gpt", "aot_eager", 2, None, "per_block", timeout=900)
    for f in found:
        _check(f)
        local, full = f["expert_bytes"]
        assert local * 2 == full


@pytest.mark.slow
@pytest.mark.inductor
def test_moe_gpt_under_inductor_at_4_ranks() -> None:
    found = run_ranks(4, moe_trainer.train, "moe_gpt", "inductor", 2, timeout=900)
    for f in found:
        _check(f)
        assert f["graphs"] == 1


class _NotDivisible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(3, 8, 4))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


def _shard_not_divisible() -> str:
    model = nn.Sequential(nn.Linear(4, 4), _NotDivisible())
    try:
        autoshard.shard(model, experts="parallel")
    except autoshard.UsageError as e:
        assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # nothing changed
        return str(e)
    return "no error"


def test_experts_that_do_not_divide_over_the_ranks_are_refused_by_name() -> None:
    message = run_ranks(2, _shard_not_divisible, timeout=300)[0]
    assert message == ("autoshard.shard: experts module '1' has 3 experts, which 2 ranks cannot split evenly; "
                       "use a world size dividing 3 or experts='gathered'.")


def test_the_experts_predicate() -> None:
    assert is_experts(moe_trainer.build("moe_gpt").blocks[0].moe.experts)
    assert is_experts(_NotDivisible())
    assert not is_experts(nn.Linear(4, 4))  # 2-D, and called as linear(x)
    mlp = nn.Module()
    mlp.w = nn.Parameter(torch.zeros(3, 8, 4))
    assert not is_experts(mlp)  # 3-D, but not called as experts(hidden_states, top_k_index, top_k_weights)


def test_the_cost_model_prices_the_expert_exchange_and_the_experts() -> None:
    """One MoE layer's op: its experts' matmuls and its own kernels and row copies, plus two
    all-to-alls of the routed rows in forward (in backward: the dispatch twice as wide, the
    experts recomputed: 3x the FLOPs)."""
    from torch import fx

    from autoshard._compat import FakeTensorMode
    from autoshard.cost.cost_model import collective_time, get_profile, node_time
    from autoshard.runtime.expert_ops import EXPERT_PARALLEL, EXPERT_PARALLEL_BACKWARD

    profile = get_profile("h100")
    tokens, k, width, inner, world = 4096, 2, 1024, 2048, 8

    def priced(op, ranks: int) -> float:
        g = fx.Graph()
        with FakeTensorMode():
            vals = {"g": torch.empty(tokens, k, width), "h": torch.empty(tokens, width), "i": torch.zeros(tokens, k, dtype=torch.long),
                    "a": torch.empty(8 // ranks, 2 * inner, width), "b": torch.empty(8 // ranks, width, inner)}
        nodes = {}
        for name, v in vals.items():
            nodes[name] = g.placeholder(name)
            nodes[name].meta["val"] = v
        args = (nodes["h"], nodes["i"], [nodes["a"], nodes["b"]], "key", "0", ranks)
        return node_time(g.call_function(op, args if op is EXPERT_PARALLEL else (nodes["g"], *args)), profile)

    flops = 2 * tokens * k * (2 * inner * width + width * inner)
    unit = tokens * k * width * 4
    forward = profile.op_overhead + 8 * profile.launch_overhead + 4 * unit / profile.mem_bandwidth
    backward = profile.op_overhead + 16 * profile.launch_overhead + 8 * unit / profile.mem_bandwidth
    exchange = collective_time("reduce_scatter", unit, world, profile)
    assert priced(EXPERT_PARALLEL, 1) == pytest.approx(forward + flops / profile.flops_per_s(torch.float32))
    assert priced(EXPERT_PARALLEL, world) == pytest.approx(forward + flops / profile.flops_per_s(torch.float32) + 2 * exchange)
    assert priced(EXPERT_PARALLEL_BACKWARD, world) == pytest.approx(
        backward + 3 * flops / profile.flops_per_s(torch.float32) + collective_time("reduce_scatter", 2 * unit, world, profile) + exchange)
