"""The cost model and the step analysis: on hand-built graphs with known answers, and on the
GPT's real forward/backward graphs at world size 8 (fake process group, one process)."""
from __future__ import annotations

import dataclasses
import json
import math
import operator

import pytest
import torch
import torch.distributed as dist
from torch import fx

from autoshard._compat import c10d
from autoshard.cost.cost_model import (
    PROFILES,
    collective_of,
    collective_time,
    get_profile,
    input_copied,
    node_flops,
    node_time,
    workspace,
)
from autoshard.cost.simulator import analyze, kwh_per_million_tokens
from autoshard.passes.step_model import peak_bytes
from autoshard.runtime.errors import UsageError

from fake_pg import compile_step, fake_world

pytestmark = pytest.mark.planner

WORLD = 8
aten = torch.ops.aten


def _bytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return math.prod(val.shape) * val.dtype.itemsize


@pytest.fixture(scope="module")
def gpt():
    """``gpt(**options)``: the GPT's model and final (forward, backward) graphs compiled
    with those backend options, compiled once per module."""
    compiled = {}

    def get(**options):
        key = tuple(sorted(options.items()))
        if key not in compiled:
            step = compile_step("gpt", world_size=WORLD, options=options)
            compiled[key] = (step.model, step.forward, step.backward)
        return compiled[key]

    yield get
    torch._dynamo.reset()


class Builder:
    """Builds a graph by hand; nodes carry meta tensors as their values."""

    def __init__(self) -> None:
        self.graph = fx.Graph()

    def input(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        return node

    def __call__(self, target, *args) -> fx.Node:
        node = self.graph.call_function(target, args)
        node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
        return node

    def module(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(outputs)
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _mm_time(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, profile: str = "h100") -> float:
    g = Builder()
    return node_time(g(aten.mm.default, g.input("a", m, k, dtype=dtype), g.input("b", k, n, dtype=dtype)), profile)


def test_profiles():
    h100 = get_profile("h100")
    assert h100 is PROFILES["h100"] and get_profile(h100) is h100
    assert len({h100, get_profile("cpu")}) == 2  # hashable: profiles can key caches
    with pytest.raises(ValueError, match="'a100', 'cpu', 'h100'"):
        get_profile("tpu")


def test_profile_json_round_trip(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(get_profile("a100").to_json())
    assert get_profile(str(path)) == get_profile("a100")
    assert (get_profile(str(path)).busy_power_w, get_profile(str(path)).idle_power_w) == (400.0, 60.0)
    # A file written before profiles had power figures still loads, without them.
    old = {k: v for k, v in json.loads(get_profile("h100").to_json()).items() if not k.endswith("_power_w")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert get_profile(str(tmp_path / "old.json")) == dataclasses.replace(get_profile("h100"), busy_power_w=None, idle_power_w=None)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json.*autoshard calibrate"):
        get_profile(str(tmp_path / "bad.json"))


def test_matmul_time_scales_with_flops():
    g = Builder()
    mm = g(aten.mm.default, g.input("a", 64, 128), g.input("b", 128, 32))
    assert node_flops(mm) == 2 * 64 * 128 * 32
    # Large enough to be compute-bound: time above the launch overhead is proportional to FLOPs.
    overhead = get_profile("h100").launch_overhead
    base = _mm_time(4096, 4096, 4096) - overhead
    assert _mm_time(4096, 8192, 4096) - overhead == pytest.approx(2 * base)
    assert _mm_time(4096, 4096, 4096, torch.bfloat16) < _mm_time(4096, 4096, 4096)
    assert _mm_time(4096, 4096, 4096, profile="cpu") > 100 * _mm_time(4096, 4096, 4096)


def test_elementwise_time_is_memory_bound_and_views_are_free():
    g = Builder()
    x = g.input("x", 1024, 1024)
    add = g(aten.add.Tensor, x, x)
    view = g(aten.view.default, add, [1024 * 1024])
    h100 = get_profile("h100")
    assert node_flops(add) == 0
    assert node_time(add, h100) == pytest.approx(h100.launch_overhead + 3 * 4 * 2**20 / h100.mem_bandwidth)
    assert node_time(x, h100) == node_time(view, h100) == 0


def test_a_copy_out_costs_what_it_copies_not_the_whole_bucket():
    g = Builder()
    bucket = g.input("bucket", 8, 2**22)  # 8 ranks' rows of a gathered bucket (128 MiB)
    taken = g(aten.narrow_copy.default, bucket, 1, 2**20, 2**20)  # one parameter's columns: a quarter
    sliced = g(aten.clone.default, g(aten.slice.Tensor, bucket, 1, 2**20, 2**21))  # the same, in two ops
    assert node_time(taken, "h100") == pytest.approx(node_time(sliced, "h100"))
    assert node_time(taken, "h100") < node_time(g(aten.clone.default, bucket), "h100") / 3


def test_op_overhead_charges_every_aten_call_views_included():
    g = Builder()
    x = g.input("x", 1024, 1024)
    add = g(aten.add.Tensor, x, x)
    view = g(aten.view.default, add, [1024 * 1024])
    eager = dataclasses.replace(get_profile("h100"), op_overhead=1e-5)  # as if run op by op from Python
    assert node_time(view, eager) == 1e-5
    assert node_time(add, eager) == pytest.approx(1e-5 + node_time(add, "h100"))
    assert node_time(x, eager) == 0


def test_collective_time():
    h100 = get_profile("h100")
    ring = 7 * h100.intra.latency["all_gather"] + 7 / 8 * 2**30 / h100.intra.bandwidth["all_gather"]
    assert collective_time("all_gather", 2**30, 8, h100) == pytest.approx(ring)
    assert collective_time("reduce_scatter", 2**30, 8, h100) == collective_time("all_gather", 2**30, 8, h100)
    assert collective_time("all_reduce", 2**30, 8, h100) == 2 * collective_time("all_gather", 2**30, 8, h100)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert collective_time(kind, 2**30, 1, h100) == 0
        assert collective_time(kind, 2**20, 8, h100) < collective_time(kind, 2**21, 8, h100)
        assert collective_time(kind, 2**20, 2, h100) < collective_time(kind, 2**20, 8, h100)
        assert collective_time(kind, 2**20, 8, h100) < collective_time(kind, 2**20, 8, "cpu")
    with pytest.raises(ValueError, match="all_to_all"):
        collective_time("all_to_all", 1, 8, h100)


def test_collectives_across_nodes_are_paced_by_the_inter_node_link():
    h100 = get_profile("h100")
    intra, inter = h100.intra, h100.inter
    within = collective_time("all_gather", 2**30, 8, h100)
    across = collective_time("all_gather", 2**30, 16, h100)  # two nodes of 8
    latency = 14 * intra.latency["all_gather"] + 2 * inter.latency["all_gather"]
    assert across == pytest.approx(latency + 15 / 16 * 2**30 / inter.bandwidth["all_gather"])
    assert across > 5 * within
    # A replica group with one rank per node (HSDP's all-reduce) crosses nodes at every step.
    replicas = collective_time("all_reduce", 2**30, [0, 8, 16, 24], h100)
    assert replicas == pytest.approx(2 * (4 * inter.latency["all_reduce"] + 3 / 4 * 2**30 / inter.bandwidth["all_reduce"]))
    assert collective_time("all_reduce", 2**30, [0, 1, 2, 3], h100) < replicas


def test_collective_of(gpt):
    _, fw, bw = gpt()
    nodes = list(fw.graph.nodes) + list(bw.graph.nodes)
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    reduces = [n for n in nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert gathers and reduces
    ranks = tuple(range(WORLD))
    assert all(collective_of(n)[:2] == ("all_gather", _bytes(n)) and collective_of(n).ranks == ranks for n in gathers)
    assert all(collective_of(n)[:2] == ("reduce_scatter", _bytes(n.args[0])) and collective_of(n).ranks == ranks for n in reduces)
    assert all(collective_of(n) is None for n in nodes if n not in gathers and n not in reduces)

    with fake_world(WORLD):  # all_reduce takes its group size from the named group
        g = Builder()
        reduced = g(c10d.all_reduce.default, g.input("x", 4, 8), "avg", dist.group.WORLD.group_name)
        assert collective_of(reduced) == ("all_reduce", 4 * 8 * 4, dist.group.WORLD.group_name, tuple(range(WORLD)))
        both = [g.input("a", 2, 8), g.input("b", 1, 8)]
        coalesced = collective_of(g(c10d.all_gather_into_tensor_coalesced.default, both, WORLD, "0"))
        assert coalesced[:2] == ("all_gather", WORLD * 3 * 8 * 4) and len(coalesced.ranks) == WORLD


def test_gpt_step(gpt):
    model, fw, bw = gpt()
    result = analyze(fw, bw, "h100")
    nodes = list(fw.graph.nodes) + list(bw.graph.nodes)

    gathered = sum(_bytes(n) for n in nodes if n.target is c10d.all_gather_into_tensor.default)
    reduced = sum(_bytes(n.args[0]) for n in nodes if n.target is c10d.reduce_scatter_tensor.default)
    assert result.comm_bytes == {"all_gather": gathered, "reduce_scatter": reduced, "all_reduce": 0, "all_to_all": 0}
    # Every parameter is gathered in forward and its gradient reduced in backward (padding
    # only adds); the backward gathers again what it needs.
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert param_bytes < gathered < 2 * param_bytes
    assert param_bytes <= reduced

    assert max(result.compute_time, result.comm_time) <= result.step_time
    assert result.step_time <= result.compute_time + result.comm_time
    assert 0 <= result.exposed_comm <= result.comm_time
    assert result.step_time == pytest.approx(result.compute_time + result.exposed_comm)
    assert 0 <= result.overlap_ratio <= 1

    group = nodes[0].graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)[0].args[2]
    assert {e.lane for e in result.timeline} == {"compute", f"comm:{group}"}  # one process group
    for lane in {e.lane for e in result.timeline}:
        events = [e for e in result.timeline if e.lane == lane]
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))  # one stream: no overlap
        assert events[-1].end <= result.step_time
    assert sum(e.end - e.start for e in result.timeline if e.lane != "compute") == pytest.approx(result.comm_time)

    # Parameter shards and the batch live all step, and so do the gradient shards at its end.
    shards = sum(_bytes(n) for n in fw.graph.nodes if n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor))
    grads = sum(_bytes(n) for n in bw.graph.output_node().args[0] if isinstance(n, fx.Node) and n.op != "placeholder")
    assert result.peak_bytes >= shards + grads
    largest = max(_bytes(n) for n in nodes if n.target is c10d.all_gather_into_tensor.default)
    assert largest <= result.peak_gathered_bytes < result.peak_bytes

    assert max(live for _, live in result.memory_curve) == result.peak_bytes
    times = [t for t, _ in result.memory_curve]
    assert times == sorted(times) and len(times) == len(nodes)
    assert shards + largest < result.memory_lower_bound <= result.peak_bytes
    assert result.compute_time <= result.step_lower_bound <= result.step_time


def test_keeping_gathered_parameters_raises_the_gathered_peak(gpt):
    # Unscheduled (each parameter gathered at its use): with reshard_after_forward=False the
    # forward saves full parameters for backward, so at its end every one the backward needs
    # is live at once; resharding holds the tied embedding (used first and last in forward)
    # and a parameter or two. A prefetching schedule narrows the gap, so "none" isolates it.
    reshard, keep = (analyze(*gpt(schedule="none", reshard_after_forward=flag)[1:], "h100") for flag in (True, False))
    assert keep.peak_gathered_bytes > 2 * reshard.peak_gathered_bytes
    assert keep.comm_bytes["all_gather"] < reshard.comm_bytes["all_gather"]  # no regather
    assert keep.comm_bytes["reduce_scatter"] == reshard.comm_bytes["reduce_scatter"]


def _gather_and_compute(wait_early: bool) -> fx.GraphModule:
    g = Builder()
    shard, h = g.input("shard", 512, 4096), g.input("h", 4096, 4096)
    gathered = g(c10d.all_gather_into_tensor.default, shard, WORLD, dist.group.WORLD.group_name)
    if wait_early:
        gathered = g(c10d.wait_tensor.default, gathered)
    for _ in range(4):  # independent compute that could hide the gather
        h = g(aten.mm.default, h, h)
    if not wait_early:
        gathered = g(c10d.wait_tensor.default, gathered)
    return g.module(g(aten.mm.default, h, gathered))


def test_waiting_late_hides_the_gather(world8):
    late = analyze(_gather_and_compute(wait_early=False), None, "h100")
    early = analyze(_gather_and_compute(wait_early=True), None, "h100")
    assert late.comm_time == early.comm_time > 0
    assert late.compute_time == early.compute_time
    assert early.exposed_comm == pytest.approx(early.comm_time)  # compute stalls for all of it
    assert late.exposed_comm < early.exposed_comm
    assert late.exposed_comm == 0 and late.overlap_ratio == 1  # 4 big matmuls outlast the gather
    assert late.step_time < early.step_time
    # The matmuls not needing the gather outlast it, so the bound is compute alone: met by
    # waiting late, missed by the whole gather when waiting early.
    assert early.step_lower_bound == late.step_lower_bound == pytest.approx(late.compute_time)
    assert late.step_time == pytest.approx(late.step_lower_bound)


def test_energy_is_compute_at_busy_power_and_exposed_comm_at_idle_power(world8):
    h100 = get_profile("h100")
    early, late = (analyze(_gather_and_compute(wait_early=w), None, h100) for w in (True, False))
    assert early.exposed_comm > 0 and late.exposed_comm == 0
    for a in (early, late):
        assert a.energy_j == pytest.approx(a.compute_time * 700 + (a.step_time - a.compute_time) * 100)
    assert late.energy_j < early.energy_j  # the hidden gather costs no waiting
    assert analyze(_gather_and_compute(wait_early=True), None, "cpu").energy_j is None  # no power figures
    assert analyze(_gather_and_compute(wait_early=True), None, dataclasses.replace(h100, idle_power_w=None)).energy_j is None


def test_kwh_per_million_tokens():
    assert kwh_per_million_tokens(3600.0, 1000, 1_000_000) == pytest.approx(1.0)  # 3.6 MJ = 1 kWh per step
    assert kwh_per_million_tokens(36.0, 8, 8 * 2048) == pytest.approx(36 * 8 / 3.6e6 * 1e6 / (8 * 2048))
    with pytest.raises(UsageError, match="tokens_per_step must be positive"):
        kwh_per_million_tokens(36.0, 8, 0)


def test_each_process_group_has_its_own_stream(world8):
    g = Builder()
    other = dist.new_group(list(range(WORLD)))
    shard = g.input("shard", 512, 4096)
    issued = [g(c10d.all_gather_into_tensor.default, shard, WORLD, group) for group in ("0", other.group_name)]
    waits = [g(c10d.wait_tensor.default, gathered) for gathered in issued]
    result = analyze(g.module(g(aten.add.Tensor, *waits)), None, "h100")
    one = collective_time("all_gather", 4 * 512 * 4096 * WORLD, WORLD, "h100")
    assert result.comm_by_group == pytest.approx({"0": one, other.group_name: one})
    # The two gathers run side by side: the step waits for one gather, not two.
    assert result.step_time == pytest.approx(one + result.compute_time)
    assert result.step_lower_bound == pytest.approx(result.compute_time + one)


def test_liveness_frees_after_last_use_and_views_share_storage():
    g = Builder()
    x = g.input("x", 250)  # 1000 bytes each
    a = g(aten.relu.default, x)
    b = g(aten.add.Tensor, a, g(aten.view.default, a, [250]))  # x, a (once: a view), b live
    c = g(aten.relu.default, b)  # a is dead: x, b, c
    d = g(aten.relu.default, c)  # b is dead: x, c, d
    result = analyze(g.module(d), None, "h100")
    assert result.peak_bytes == 3000
    assert result.peak_gathered_bytes == 0


def test_gathered_storage_includes_waits_views_and_tagged_nodes(world8):
    g = Builder()
    shard, x = g.input("shard", 32, 8), g.input("x", 8, 4)  # the shard gathers to 8 KiB
    full = g(c10d.wait_tensor.default, g(c10d.all_gather_into_tensor.default, shard, WORLD, "0"))
    transposed = g(aten.t.default, full)
    copy = g(aten.clone.default, shard)
    copy.meta["autoshard_gathered"] = True  # as a bucketing pass tags its copy-outs
    out = g(aten.mm.default, transposed, g(aten.mm.default, full, x))  # last use of the gather
    result = analyze(g.module(g(aten.add.Tensor, out, g(aten.sum.default, copy))), None, "h100")
    assert result.peak_gathered_bytes == 8192 + 1024


def test_a_collective_reads_its_input_until_its_wait(world8):
    g = Builder()
    x = g.input("x", 2048)  # 8 KiB, like every full-size tensor here
    reduced = g(c10d.reduce_scatter_tensor.default, g(aten.relu.default, x), "avg", WORLD, "0")  # 1 KiB out
    other = g(aten.relu.default, x)  # the gradient is still being read: x, gradient, other, reduced live
    result = analyze(g.module(g(c10d.wait_tensor.default, reduced), other), None, "h100")
    assert result.peak_bytes == 3 * 8192 + 1024


def test_saved_values_keep_their_forward_storage():
    # Forward returns (loss, x, view of x): the last two are saved for backward, which takes
    # them as placeholders before its tangent. They are x's storage, not new bytes.
    fw = Builder()
    x = fw.input("x", 250)
    loss = fw(aten.sum.default, x)
    forward = fw.module(loss, x, fw(aten.view.default, x, [25, 10]))
    bw = Builder()
    saved_x, saved_view, tangent = bw.input("x", 250), bw.input("view", 25, 10), bw.input("tangents_1")
    grad = bw(aten.mul.Tensor, saved_x, tangent)
    backward = bw.module(bw(aten.add.Tensor, grad, bw(aten.view.default, saved_view, [250])))
    # At the last add: x 1000 (all step), loss 4 (a user output), grad 1000, result 1000.
    assert analyze(forward, backward, "h100").peak_bytes == 3004


# The step model (passes/step_model.py, what the schedule decides by) and the simulator (what
# the report shows) are two models of one thing: on the same graph, with the same profile's
# assumptions (workspaces, late releases, copied inputs), their peaks must be the same number.
def _step_model_peak(gm: fx.GraphModule, profile: str) -> int:
    p = get_profile(profile)
    nodes = list(gm.graph.nodes)
    return peak_bytes(nodes, workspace(p), late_release=p.comm_release_late, input_copied=input_copied(p.comm_input_copied))[0]


@pytest.mark.parametrize("profile, side", [
    ("h100", "forward"), ("h100", "backward"), ("cpu", "forward"), ("cpu", "backward"),
])
def test_the_step_model_and_the_simulator_agree_on_a_graphs_peak(gpt, profile, side):
    """Each final graph of the GPT (default schedule) played alone, its inputs held by the
    caller: the step model's peak is the simulator's."""
    _, fw, bw = gpt(profile=profile)
    gm = fw if side == "forward" else bw
    assert _step_model_peak(gm, profile) == analyze(gm, None, profile).peak_bytes


def test_each_output_of_a_multi_output_op_is_freed_after_its_own_last_use():
    """x (1000 B) -> layer norm: out (1000 B), mean, rstd (40 B each) -> relu(out) -> relu ->
    add(..., mean). Where the second relu runs, out is dead: x, mean, the two relus: 3040 B."""
    g = Builder()
    x = g.input("x", 10, 25)
    norm = g(aten.native_layer_norm.default, x, [25], None, None, 1e-5)
    out, mean = g(operator.getitem, norm, 0), g(operator.getitem, norm, 1)
    a = g(aten.relu.default, out)
    b = g(aten.relu.default, a)
    gm = g.module(g(aten.add.Tensor, b, mean))
    assert (analyze(gm, None, "h100").peak_bytes, _step_model_peak(gm, "h100")) == (3040, 3040)
