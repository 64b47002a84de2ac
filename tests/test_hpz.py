"""Hierarchical backward gathers (ZeRO++'s hpZ): ``autoshard.shard(model, reshard_after_forward=G)``
(autoshard/runtime/hpz.py, passes/hpz.py).

Graphs at world size 8 on the fake process group: the forward gathers over all 8 ranks and
saves each parameter's node slice, the backward gathers over the G ranks of this rank's node.
Numerics at 4 gloo ranks, G = 2 (slow tier): losses and gradients as one process on the whole
batch, under aot_eager, Inductor, bf16 mixed precision and int8 gathers. Refusals change nothing.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard._compat import c10d
from autoshard.compiler.dump import recording
from autoshard.passes.graph_utils import PARAMS, collectives, group_ranks
from autoshard.runtime.errors import UsageError
from autoshard.runtime.hpz import NODE_SLICE
from autoshard.runtime.ops import chunk_rows
from autoshard.tools.launch import run_ranks

from fake_pg import fake_world, sharded_step
from models import GLOBAL_BATCH, batch, build

WORLD = 8
TOL = 1e-5
STEPS = 3
GATHERS = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default)  # over gloo: into buffers


# Graphs at world size 8 ------------------------------------------------------------------------

@pytest.mark.parametrize("node, rank", [(4, 0), (4, 5), (2, 3)])
def test_the_backward_gathers_within_the_node_and_the_forward_saves_node_slices(node, rank):
    with sharded_step("gpt", world_size=WORLD, rank=rank, reshard_after_forward=node) as step:
        specs = [s for m in step.model.modules() for s in getattr(m, "_autoshard_specs", {}).values()]
        shapes = {s.name: (s.dim0, tuple(p.shape[1:])) for s, p in zip(specs, _parameters(step.model), strict=True)}
        assert {s.node_size for s in specs if s.dim0 >= 0} == {node}
        (group,) = {s.node_group for s in specs if s.dim0 >= 0}
        first = rank // node * node
        assert group_ranks(group) == tuple(range(first, first + node))  # this rank's node: consecutive ranks
        forward = collectives(step.forward.graph, c10d.all_gather_into_tensor.default)
        backward = collectives(step.backward.graph, c10d.all_gather_into_tensor.default)
        assert forward and all(g.args[1] == WORLD and group_ranks(g.args[2]) == tuple(range(WORLD)) for g in forward)
        assert backward and all(g.args[1] == node and g.args[2] == group for g in backward), [g.args for g in backward]
        regathered = [name for g in backward for name in g.meta[PARAMS]]
        assert len(regathered) == len(set(regathered)) and "blocks.0.attn.qkv.weight" in regathered
        # Each parameter the backward gathers again is saved as its node slice: N / G padded shards' rows.
        saved = [a for a in step.forward.graph.output_node().args[0] if getattr(a, "target", None) is NODE_SLICE]
        expected = Counter((WORLD // node * chunk_rows(shapes[n][0], WORLD), *shapes[n][1]) for n in regathered)
        assert Counter(tuple(a.meta["val"].shape) for a in saved) == expected


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    return [m._parameters[n] for m in model.modules() for n in getattr(m, "_autoshard_specs", {})]


def test_g_equal_to_the_world_is_true_and_g_one_is_false():
    for value, reshard in ((WORLD, True), (1, False)):
        with fake_world(WORLD):
            model = build("mlp")
            with pytest.warns(UserWarning, match="same as False") if value == 1 else contextlib.nullcontext():
                autoshard.shard(model, reshard_after_forward=value)
            specs = [s for m in model.modules() for s in getattr(m, "_autoshard_specs", {}).values()]
            assert {(s.reshard, s.node_size, s.node_group) for s in specs} == {(reshard, 0, "")}


# Refused, with nothing changed ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"reshard_after_forward": 3}, r"reshard_after_forward=3 must divide the shard group's 8 ranks"),
    ({"reshard_after_forward": 16}, r"reshard_after_forward=16 must divide the shard group's 8 ranks"),
    ({"reshard_after_forward": 0}, r"must be at least 1 as an int .*got 0"),
    ({"reshard_after_forward": -2}, r"must be at least 1 as an int .*got -2"),
    ({"reshard_after_forward": 2.0}, r"must be True, False, None or an int .*got 2\.0"),
    ({"reshard_after_forward": "4"}, r"must be True, False, None or an int .*got '4'"),
    ({"reshard_after_forward": 4, "strategy": "grad_op"}, r"reshard_after_forward=4 reshards after forward, .*'grad_op'"),
    ({"reshard_after_forward": 4, "strategy": "replicate"}, r"reshard_after_forward=4 .*strategy='replicate' contradicts"),
    ({"reshard_after_forward": 2, "strategy": "hybrid", "mesh": (2, 4)}, r"strategy='hybrid' shards within a node already"),
])
def test_bad_node_sizes_are_refused_and_change_nothing(kwargs, message):
    with fake_world(WORLD):
        if "mesh" in kwargs:
            kwargs["mesh"] = init_device_mesh("cpu", kwargs["mesh"])
        model = build("mlp")
        before = [(type(m), [(id(p), p.detach().clone()) for p in m.parameters()]) for m in model.modules()]
        with pytest.raises(UsageError, match=message):
            autoshard.shard(model, **kwargs)
        after = [(type(m), list(m.parameters())) for m in model.modules()]
        assert not autoshard.is_sharded(model)
        for (t0, ps0), (t1, ps1) in zip(before, after, strict=True):
            assert t0 is t1 and [i for i, _ in ps0] == [id(p) for p in ps1]
            assert all(torch.equal(v, p) and type(p) is nn.Parameter for (_, v), p in zip(ps0, ps1, strict=True))


# Numerics at 4 gloo ranks, G = 2 ------------------------------------------------------------

def _train(name: str, compiler: str, node: int) -> tuple[float, float, set[int]]:
    """Train ``name`` sharded with ``reshard_after_forward=node`` on this rank's slice next to
    one process on the whole batch (SGD with momentum, the same steps): the largest loss and
    gradient differences, and the group sizes of the backward's gathers."""
    torch._dynamo.reset()  # each case compiles afresh (test_compression says why)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build(name)
    reference = copy.deepcopy(model)
    autoshard.shard(model, reshard_after_forward=node)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference))
    run = torch.compile(model, backend="autoshard", options={"compiler": compiler})
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    loss_error = grad_error = 0.0
    for step in range(STEPS):
        x, y = batch(name, step)
        with recording(("backward",)) as compiled:
            loss = run(x[mine], y[mine])
            loss.backward()
        if step == 0:
            sizes = {g.args[1] for graphs in compiled if "backward" in graphs
                     for op in GATHERS for g in collectives(graphs["backward"].graph, op)}
        total = loss.detach().clone()
        dist.all_reduce(total)
        expected = reference(x, y)
        expected.backward()
        loss_error = max(loss_error, abs(total.item() / world - expected.item()))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            grad_error = max(grad_error, (autoshard.full_tensor(p.grad) - q.grad).abs().max().item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return loss_error, grad_error, sizes


def _int8(name: str) -> tuple[float, float]:
    """tests/test_compression.py's int8 parity (its quantized single-process reference), hierarchical."""
    import test_compression

    test_compression.LAYOUTS["hpz"] = (lambda world: {"reshard_after_forward": 2},
                                       lambda dim0, world: test_compression.even_rows(dim0, world))
    return test_compression._parity(name, "aot_eager", "hpz")


def _bf16(name: str) -> dict:
    from trainer import BF16, train_mixed_precision

    mixed = autoshard.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    return train_mixed_precision(name, functools.partial(autoshard.shard, reshard_after_forward=2, mixed_precision=mixed))


def _cases(inductor: bool) -> dict[str, object]:
    if inductor:
        return {"gpt_inductor": _train("gpt", "inductor", 2)}
    return {"gpt": _train("gpt", "aot_eager", 2), "uneven": _train("uneven", "aot_eager", 2),
            "bf16": _bf16("uneven"), "int8": _int8("gpt"), "rank": dist.get_rank()}


@functools.cache
def _results(inductor: bool = False) -> list[dict]:
    return run_ranks(4, _cases, inductor)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case", ["gpt", "uneven"])
def test_hierarchical_gathers_train_like_one_process(case):
    for found in _results():
        loss_error, grad_error, sizes = found[case]
        assert max(loss_error, grad_error) <= TOL and sizes == {2}, (found["rank"], case, found[case])


@pytest.mark.slow
@pytest.mark.multirank
def test_hierarchical_gathers_under_bf16_are_the_per_rank_bf16_computation():
    for found in _results():
        bf16 = found["bf16"]
        assert bf16["emulated"] <= TOL, bf16  # the tolerances: tests/test_strategies.py's hybrid bf16
        assert bf16["loss"] <= 2 * bf16["loss_ulp"] and bf16["params"] <= 2 * bf16["bf16_params"], bf16


@pytest.mark.slow
@pytest.mark.multirank
def test_hierarchical_int8_gathers_match_the_quantized_reference():
    for found in _results():
        assert max(found["int8"]) <= 1e-6, (found["rank"], found["int8"])  # test_compression's TOL


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.inductor
def test_hierarchical_gathers_train_like_one_process_under_inductor():
    for found in _results(True):
        loss_error, grad_error, sizes = found["gpt_inductor"]
        assert max(loss_error, grad_error) <= TOL and sizes == {2}, found


def test_forward_ops_the_partitioner_recomputes_read_the_node_gather():
    """Uneven's backward recomputes ``out * gain`` (a cheap forward op) rather than save it:
    it reads the node gather the backward has for ``gain`` anyway, not a second gather over
    all 8 ranks (passes/hpz.py's regather_within_nodes)."""
    with sharded_step("uneven", world_size=WORLD, reshard_after_forward=4) as step:
        gathers = collectives(step.backward.graph, c10d.all_gather_into_tensor.default)
        assert gathers and {g.args[1] for g in gathers} == {4}
        assert "gain" in {name for g in gathers for name in g.meta[PARAMS]}
