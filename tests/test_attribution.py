"""What the simulator says about where a step's memory and time go: each live storage in one
category (on a hand-built forward/backward pair with one of each, and on the GPT), the peak's
breakdown and largest tensors, and exposed time attributed to the collective that caused it."""
from __future__ import annotations

import pytest
import torch
from test_cost_model import WORLD, Builder, _gather_and_compute
from torch import fx

from autoshard._compat import c10d
from autoshard.cost.liveness import CATEGORIES, Liveness, categorize, saved_sources
from autoshard.cost.simulator import analyze

from fake_pg import compile_step

pytestmark = pytest.mark.planner

aten = torch.ops.aten


def _pair() -> tuple[fx.GraphModule, fx.GraphModule]:
    """A ZeRO-3 step of one weight: forward gathers the shard, backward reduce-scatters it.

        forward:  shard -> all_gather -> wait -> mm(x, .) -> relu (saved) -> sum
        backward: mul(saved, tangent) -> mm(x.t, .) (unreduced grad) -> cat -> reduce_scatter -> wait -> view (grad)
    """
    fw = Builder()
    shard, x = fw.input("shard", 32, 8), fw.input("x", 4, 256)  # 1 KiB shard, 4 KiB batch
    full = fw(c10d.wait_tensor.default, fw(c10d.all_gather_into_tensor.default, shard, WORLD, "0"))  # 8 KiB
    act = fw(aten.relu.default, fw(aten.mm.default, x, full))
    forward = fw.module(fw(aten.sum.default, act), act, x)  # saves act and x
    bw = Builder()
    saved_act, saved_x, tangent = bw.input("act", 4, 8), bw.input("x", 4, 256), bw.input("tangents_1")
    grad_act = bw(aten.mul.Tensor, saved_act, tangent)
    unreduced = bw(aten.mm.default, bw(aten.t.default, saved_x), grad_act)  # 8 KiB
    flat = bw(aten.cat.default, [bw(aten.view.default, unreduced, [-1])])  # the reduce-scatter's input buffer
    reduced = bw(c10d.wait_tensor.default, bw(c10d.reduce_scatter_tensor.default, flat, "avg", WORLD, "0"))
    backward = bw.module(bw(aten.view.default, reduced, [32, 8]), None)
    return forward, backward


def _categories(forward: fx.GraphModule, backward: fx.GraphModule) -> dict[tuple[str, str], str]:
    order = [("forward", n) for n in forward.graph.nodes] + [("backward", n) for n in backward.graph.nodes]
    sources = saved_sources(forward, backward)
    live = Liveness(order, sources)
    categorize(live, order, sources)
    return {(s.stage[0], s.node.name.removesuffix("_default").removesuffix("_tensor")): s.category for s in live.storages}


def test_each_storage_is_attributed_from_graph_structure(world8):
    assert _categories(*_pair()) == {
        ("f", "shard"): "shards", ("f", "x"): "inputs", ("b", "tangents_1"): "inputs",  # placeholders
        ("f", "all_gather_into"): "gathered",
        ("f", "mm"): "temporaries", ("f", "relu"): "activations", ("f", "sum"): "temporaries",  # the loss
        ("b", "mul"): "temporaries", ("b", "mm"): "gradients",  # unreduced: it feeds the reduce-scatter
        ("b", "cat"): "comm_buffers", ("b", "reduce_scatter"): "gradients",  # what the backward returns
    }


def test_the_peak_names_what_is_alive(world8):
    forward, backward = _pair()
    a = analyze(forward, backward, "h100")
    peak = a.memory_peak
    # At the reduce-scatter's copy-in: the unreduced gradient and its flat copy, the batch and
    # the shard (the caller's) and the loss; the gathered weight is freed, and so is the saved
    # relu, after its last use (the backward owns what it takes).
    assert (peak.stage, peak.node) == ("backward", "cat_default")
    assert {c: b for c, b in peak.by_category.items() if b} == {
        "shards": 1024, "inputs": 4096, "gradients": 8192, "comm_buffers": 8192, "temporaries": 4}
    assert sum(peak.by_category.values()) == a.peak_bytes
    assert [(t.nbytes, t.category, t.stage, t.node, t.value) for t in peak.largest] == [
        (8192, "gradients", "backward", "mm_default", "float32[256, 8]"),
        (8192, "comm_buffers", "backward", "cat_default", "float32[2048]"),
        (4096, "inputs", "forward", "x", "float32[4, 256]"),
        (1024, "shards", "forward", "shard", "float32[32, 8]"),
        (4, "temporaries", "forward", "sum_default", "float32[]"),
    ]
    assert peak.time == next(t for t, live in a.memory_curve if live == a.peak_bytes)


@pytest.mark.parametrize("options", [{}, {"reshard_after_forward": False}, {"schedule": "none"}])
def test_on_the_gpt_the_categories_sum_to_the_curve_everywhere(options):
    step = compile_step("gpt", world_size=WORLD, options=options)
    a = analyze(step.forward, step.backward, "h100")
    assert set(a.memory_by_category) == set(CATEGORIES)
    for i, (_, live) in enumerate(a.memory_curve):
        assert sum(curve[i] for curve in a.memory_by_category.values()) == live
    assert max(a.memory_by_category["gathered"]) == a.peak_gathered_bytes
    inputs = [n.meta["val"] for n in step.forward.graph.nodes if n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor)]
    shards = sum(t.nbytes for t in inputs if t.is_floating_point())
    batch = sum(t.nbytes for t in inputs if not t.is_floating_point())
    last = max(i for i, n in enumerate(step.forward.graph.nodes) if n.op == "placeholder")  # they allocate in turn
    assert set(a.memory_by_category["shards"][last:]) == {shards}  # owned by the caller: all step long
    assert a.memory_by_category["inputs"][0] > 0 and max(a.memory_by_category["inputs"]) <= batch + 4  # + the loss's tangent
    assert a.memory_by_category["gradients"][-1] > 0 and a.memory_by_category["gradients"][0] == 0
    assert max(a.memory_by_category["activations"]) > 0
    if "schedule" not in options:  # bucketed: flat copy-ins of gathers and reduce-scatters
        assert max(a.memory_by_category["comm_buffers"]) > 0
    peak = a.memory_peak
    assert peak.by_category == {c: curve[a.memory_curve.index((peak.time, a.peak_bytes))] for c, curve in a.memory_by_category.items()}
    assert len(peak.largest) == 10 and all(t.owner for t in peak.largest)


def test_a_stall_is_charged_to_the_collective_it_waits_for(world8):
    early = analyze(_gather_and_compute(wait_early=True), None, "h100")
    (gather,) = [e for e in early.timeline if e.lane != "compute"]
    (stall,) = early.stalls
    assert (stall.stage, stall.name) == (gather.stage, gather.name)
    assert stall.end - stall.start == pytest.approx(gather.exposed) == pytest.approx(early.exposed_comm)
    late = analyze(_gather_and_compute(wait_early=False), None, "h100")
    assert late.stalls == [] and all(e.exposed == 0 for e in late.timeline)


def test_a_collective_past_the_last_compute_is_charged_the_tail(world8):
    g = Builder()
    x = g.input("x", 2048)
    y = g(aten.relu.default, x)
    reduce = g(c10d.reduce_scatter_tensor.default, y, "avg", WORLD, "0")  # nobody waits: the step's tail
    a = analyze(g.module(g(aten.relu.default, y), reduce), None, "cpu")  # cpu: collectives also slow compute
    (event,) = [e for e in a.timeline if e.lane != "compute"]
    (stall,) = a.stalls
    assert stall.end == pytest.approx(a.step_time) and stall.name == event.name
    assert event.exposed == pytest.approx(a.exposed_comm)  # the tail plus what it took from compute
    assert event.exposed > stall.end - stall.start


def test_on_the_gpt_exposed_time_adds_up():
    step = compile_step("gpt", world_size=WORLD, options={"schedule": "none"})
    for profile in ("h100", "cpu"):
        a = analyze(step.forward, step.backward, profile)
        assert sum(e.exposed for e in a.timeline) == pytest.approx(a.exposed_comm, rel=1e-9)
        assert all(s.start < s.end and 0 <= s.start and s.end <= a.step_time * (1 + 1e-12) for s in a.stalls)
        assert all(a_.end <= b.start + 1e-15 for a_, b in zip(a.stalls, a.stalls[1:]))  # compute waits once at a time
        if profile == "h100":  # collectives take nothing from compute: every exposed second is a visible gap
            assert sum(s.end - s.start for s in a.stalls) == pytest.approx(a.exposed_comm)
