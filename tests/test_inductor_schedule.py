"""PyTorch's overlap scheduler + bucketer as a baseline pass, on a 4-layer GPT's forward and
backward graphs at world size 8 (fake process group, one process)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

import autoshard
from autoshard._compat import c10d, overlap_scheduler_state
from autoshard.cost.cost_model import estimators
from autoshard.passes.inductor_schedule import inductor_schedule

from fake_pg import captured_graphs, count, first_example, sharded_step
from gpt import GPT, GPTConfig
from models import batch, build

pytestmark = pytest.mark.inductor

WORLD = 8
GATHERS = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


@pytest.fixture(scope="module")
def captured():
    """The final forward and backward graphs of one training step; the fake world stays up
    for the module because the pass asks the process group for its size."""
    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))

    # schedule "none": the lowered graphs, before any bucketing or reordering.
    with sharded_step(gpt, first_example("gpt"), world_size=WORLD, options={"schedule": "none"}) as step:
        yield {"forward": step.forward, "backward": step.backward}
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def scheduled(captured):
    """stage -> (graph before, graph after the pass)."""
    return {stage: (_copy(gm), inductor_schedule(_copy(gm), *estimators("cpu"))) for stage, gm in captured.items()}


def _is_compute(node: fx.Node) -> bool:
    # The scheduler's own notion of compute (what can hide a collective): ops with a FLOP formula.
    return getattr(node.target, "overloadpacket", None) in flop_registry


def _gather_issue_points(gm: fx.GraphModule) -> dict[str, int]:
    """For each gathered shard (a placeholder), how many compute nodes run before its gather
    is issued (bucketed gathers are traced back through their copy-in to each shard)."""
    points, computed = {}, 0
    for node in gm.graph.nodes:
        computed += _is_compute(node)
        if node.target in GATHERS:
            todo, seen = [*node.all_input_nodes, *node.kwargs.values()], set()
            while todo:
                n = todo.pop()
                if isinstance(n, fx.Node) and n not in seen and not _is_compute(n):
                    seen.add(n)
                    if n.op == "placeholder":
                        points[n.name] = computed
                    todo.extend(n.all_input_nodes)
    return points


def _hidden_gathers(gm: fx.GraphModule) -> int:
    """Gathers with compute between their issue and their wait."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    compute = [order[n] for n in gm.graph.nodes if _is_compute(n)]
    waits = [(order[n], order[next(iter(n.users))]) for n in gm.graph.nodes if n.target in GATHERS]
    return sum(any(start < c < wait for c in compute) for start, wait in waits)


def _fake_inputs(gm: fx.GraphModule) -> list:
    g = torch.Generator().manual_seed(0)
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        v = node.meta["val"]
        if not isinstance(v, torch.Tensor):
            inputs.append(None)  # opaque objects the graph never reads
        elif v.dtype.is_floating_point:
            inputs.append(torch.rand(v.shape, dtype=v.dtype, generator=g) / 8)  # small: 4 layers stay finite
        else:
            inputs.append(torch.zeros(v.shape, dtype=v.dtype))  # token ids: 0 is always in range
    return inputs


class DistinctRanks(fx.Interpreter):
    """Rank 0's view when rank r holds rank 0's tensor + r/64: every collective has a closed
    form, and a wrong bucket layout or rank order shows up as different values."""

    def call_function(self, target, args, kwargs):
        if target is c10d.all_gather_into_tensor.default:
            return torch.cat([args[0] + r / 64 for r in range(args[1])])
        if target is c10d.all_gather_into_tensor_out.default:
            return kwargs["out"].copy_(torch.cat([args[0] + r / 64 for r in range(args[1])]))
        if target is c10d.reduce_scatter_tensor.default:
            assert args[1] == "avg"
            return args[0].chunk(args[2])[0] + (args[2] - 1) / 128
        if target is c10d.wait_tensor.default:
            return args[0]
        return super().call_function(target, args, kwargs)


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_buckets_gathers_and_reductions_and_keeps_the_interface(scheduled, stage):
    before, after = scheduled[stage]
    after.graph.lint()
    # Overlap-preserving bucketing merges gathers (and, in backward, reduce-scatters) that
    # can share one issue and one wait without un-hiding a collective the schedule hid.
    assert count(after, "all_gather_into_tensor") < count(before, "all_gather_into_tensor")
    if stage == "backward":
        assert count(after, "reduce_scatter_tensor") < count(before, "reduce_scatter_tensor")
    assert count(after, "wait_tensor") == count(after, "all_gather_into_tensor") + count(after, "reduce_scatter_tensor")
    names = lambda gm: [n.name for n in gm.graph.find_nodes(op="placeholder")]  # noqa: E731
    assert names(after) == names(before)
    assert len(after.graph.output_node().args[0]) == len(before.graph.output_node().args[0])


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_some_gather_is_issued_before_compute_it_used_to_follow(scheduled, stage):
    before, after = (_gather_issue_points(gm) for gm in scheduled[stage])
    assert before.keys() == after.keys()
    assert any(after[shard] < before[shard] for shard in before)


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_values_unchanged(scheduled, stage):
    before, after = scheduled[stage]
    inputs = _fake_inputs(before)
    expected, got = DistinctRanks(before).run(*inputs), DistinctRanks(after).run(*inputs)
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        assert e.isfinite().all() and torch.equal(e, g) if isinstance(e, torch.Tensor) else e == g


def test_transformed_forward_runs_on_the_fake_process_group(scheduled):
    _, after = scheduled["forward"]
    outputs = after(*_fake_inputs(after))
    for out, node in zip(outputs, after.graph.output_node().args[0]):
        if isinstance(out, torch.Tensor):
            assert out.shape == node.meta["val"].shape


def test_injected_estimators_steer_the_schedule_and_global_state_is_restored(captured):
    saved = overlap_scheduler_state()
    fw, seen_compute, seen_collectives = captured["forward"], [], []
    before = _gather_issue_points(fw)

    def collective_time(node: fx.Node, nbytes: int | None = None) -> float:
        if nbytes is not None:  # PyTorch pricing a size: latency only
            return 1e-5
        seen_collectives.append(node)
        return 1e-4

    # Free compute hides nothing: every gather stays exposed (it may still be bucketed).
    free = inductor_schedule(_copy(fw), lambda n: seen_compute.append(n) or 0.0, collective_time)
    assert _hidden_gathers(free) == 0
    assert len(seen_collectives) == count(fw, "all_gather_into_tensor")
    assert any(n.target is torch.ops.aten.mm.default for n in seen_compute)
    # Slow compute hides several gathers each, so gathers are prefetched layers ahead.
    slow = inductor_schedule(_copy(fw), lambda n: 1e-3, collective_time)
    after = _gather_issue_points(slow)
    assert _hidden_gathers(slow) > 0
    assert max(before[shard] - after[shard] for shard in before) >= 4
    assert overlap_scheduler_state() == saved


def test_graph_without_collectives_is_untouched():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    code = gm.code
    assert inductor_schedule(gm, *estimators("cpu")).code == code


def test_buckets_hold_one_kind_of_collective(captured):
    """A 0-d parameter's gradient is all-reduced in the same group, with the same op and dtype
    as the reduce-scattered ones: it must not join their bucket (the backend's estimates, which
    price copies at 0, make the bucketer try)."""
    backward = {}
    for schedule in ("none", "inductor"):
        torch._dynamo.reset()
        with captured_graphs() as graphs:  # in the module's fake world (held by ``captured``)
            model = autoshard.shard(build("uneven"))
            compiled = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager", "schedule": schedule})
            x, y = batch("uneven", 0)
            compiled(x, y).backward()
            (backward[schedule],) = graphs["backward"]
    torch._dynamo.reset()
    before, after = backward["none"], backward["inductor"]
    assert count(before, "all_reduce") == count(after, "all_reduce") == 1
    assert count(after, "reduce_scatter_tensor") < count(before, "reduce_scatter_tensor")  # the others were bucketed
