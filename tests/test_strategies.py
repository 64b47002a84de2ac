"""Sharding strategies: "full" (ZeRO-3), "grad_op" (ZeRO-2), "replicate" (DDP) and "hybrid"
(HSDP, a 2x2 mesh).

Numerics and storage: one 4-rank gloo run trains each strategy next to a single-process
reference (the tests below read its results). Graphs: each strategy compiled at world size 8
on the fake process group, with the collectives it should have and no others.
"""
from __future__ import annotations

import functools
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard._compat import c10d
from autoshard.passes.graph_utils import PARAMS, block_of, collectives, positions, wait_of
from autoshard.passes.schedule import PLAN
from autoshard.runtime.ops import local_rows
from autoshard.tools.launch import run_ranks

from fake_pg import count, fake_world, same_tokens, sharded_step
from gpt import GPT, GPTConfig
from models import GLOBAL_BATCH, batch, build
from trainer import BF16, full_optimizer_state, param_error, train_mixed_precision, train_pair

pytestmark = pytest.mark.multirank

WORLD = 4
TOL = 1e-5
MAX_NORM = 0.05  # clipped every step: clip_grad_norm_ must see each layout's global norm
STRATEGIES = ("full", "grad_op", "replicate", "hybrid")
# Saved under one strategy, loaded under another: parameters and optimizer state come back bit for bit.
CHECKPOINT_PAIRS = [("replicate", "replicate"), ("hybrid", "hybrid"), ("hybrid", "full"), ("full", "replicate")]
SHARDS = {"full": WORLD, "grad_op": WORLD, "replicate": 1, "hybrid": 2}  # ranks a parameter is split over


def _shard(strategy: str, **kwargs) -> functools.partial:
    mesh = init_device_mesh("cpu", (2, WORLD // 2)) if strategy == "hybrid" else None  # (replicas, shard)
    return functools.partial(autoshard.shard, mesh=mesh, strategy=strategy, **kwargs)


def _round_trip(saved_as: str, loaded_as: str, folder: str) -> dict[str, float]:
    """Train a step as ``saved_as``, save, load into a fresh model sharded as ``loaded_as``:
    the largest differences in full parameters and in full optimizer state."""
    torch._dynamo.reset()
    models, optimizers = [], []
    for strategy in (saved_as, loaded_as):
        model = _shard(strategy)(build("uneven"))
        models.append(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = batch("uneven", 0)
    rows = GLOBAL_BATCH // WORLD
    mine = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    torch.compile(models[0], backend="autoshard", options={"compiler": "aot_eager"})(x[mine], y[mine]).backward()
    optimizers[0].step()
    path = f"{folder}/{saved_as}_to_{loaded_as}"
    autoshard.save(path, models[0], optimizers[0])
    autoshard.load(path, models[1], optimizers[1])
    saved, loaded = (full_optimizer_state(m, o) for m, o in zip(models, optimizers))
    return {
        "params": param_error(models[1], models[0]),
        "optimizer": max((saved[k] - loaded[k]).abs().max().item() for k in saved) if saved.keys() == loaded.keys() else float("inf"),
    }


def _strategies(folder: str) -> dict[str, dict[str, Any]]:
    found = {s: train_pair("uneven", _shard(s), max_norm=MAX_NORM) for s in STRATEGIES}
    for s in ("replicate", "hybrid"):  # PyTorch's bucketing and overlap scheduler on all-reduces
        found[f"{s}_inductor_schedule"] = train_pair("uneven", _shard(s), schedule="inductor")
    found["checkpoints"] = {pair: _round_trip(*pair, folder) for pair in CHECKPOINT_PAIRS}
    found["hybrid_accumulation"] = train_pair("uneven", _shard("hybrid"), micro_batches=2)
    found["hybrid_all_reduce_blocks"] = train_pair("gpt", _shard("hybrid"), options={"all_reduce_blocks": 2})
    mixed = autoshard.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    found["hybrid_bf16"] = train_mixed_precision("uneven", _shard("hybrid", mixed_precision=mixed))
    found["rank"] = dist.get_rank()
    return found


@functools.cache
def _results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        return run_ranks(WORLD, _strategies, folder)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_trains_like_one_process_and_clips_by_the_global_norm(strategy):
    for rank in _results():
        found = rank[strategy]
        assert found["clip_ratio"] > 1
        assert found["loss"] <= TOL and found["params"] <= TOL and found["norm"] <= TOL, (rank["rank"], found)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_stores_its_share_of_parameters_gradients_and_optimizer_state(strategy):
    """Each rank holds exactly its rows of every parameter split over SHARDS[strategy] ranks
    (0-d parameters whole); AdamW keeps two such tensors per parameter."""
    shards = SHARDS[strategy]
    params = list(build("uneven").parameters())
    full = sum(p.nbytes for p in params)
    for rank in _results():
        index = rank["rank"] % shards  # the shard index: the last mesh dimension varies fastest
        mine = sum(p.nbytes if p.dim() == 0 else local_rows(p.shape[0], shards, index) * p[0].nbytes for p in params)
        stored = rank[strategy]["stored"]
        assert stored == {"params": mine, "grads": mine, "optimizer": 2 * mine}, (rank["rank"], stored)
    largest = max(r[strategy]["stored"]["params"] for r in _results())
    print(f"{strategy}: the largest rank stores {largest / full:.3f} of the parameters (1/{shards} = {1 / shards:.3f})")


@pytest.mark.parametrize("strategy", ["replicate", "hybrid"])
def test_inductor_schedule_buckets_all_reduces_and_trains_alike(strategy):
    for rank in _results():
        found = rank[f"{strategy}_inductor_schedule"]
        assert found["loss"] <= TOL and found["params"] <= TOL, (rank["rank"], found)


@pytest.mark.parametrize("saved_as, loaded_as", CHECKPOINT_PAIRS)
def test_checkpoint_round_trips_between_strategies(saved_as, loaded_as):
    for rank in _results():
        found = rank["checkpoints"][saved_as, loaded_as]
        assert found == {"params": 0.0, "optimizer": 0.0}, (rank["rank"], found)


def test_hybrid_gradient_accumulation_matches_the_whole_batch():
    for rank in _results():
        found = rank["hybrid_accumulation"]
        assert found["loss"] <= TOL and found["params"] <= TOL and found["graphs"] == 2, (rank["rank"], found)


def test_hybrid_with_two_blocks_per_all_reduce_trains_like_one_process():
    for rank in _results():
        found = rank["hybrid_all_reduce_blocks"]
        assert found["loss"] <= TOL and found["params"] <= TOL, (rank["rank"], found)


def test_hybrid_mixed_precision_is_the_per_rank_bf16_computation():
    for rank in _results():
        found = rank["hybrid_bf16"]
        assert found["emulated"] <= TOL, (rank["rank"], found)  # see test_training_features for the tolerances
        assert found["loss"] <= 2 * found["loss_ulp"] and found["params"] <= 2 * found["bf16_params"], found
        assert found["param_dtypes"] == found["state_dtypes"] == {torch.float32}


# Graphs at world size 8 ------------------------------------------------------------------

GRAPH_WORLD = 8


def _graphs(strategy: str) -> tuple[fx.GraphModule, fx.GraphModule, dict[str, str]]:
    """(forward, backward, the process groups' names by role) of a GPT step, schedule autoshard."""
    shape = (2, GRAPH_WORLD // 2) if strategy == "hybrid" else (GRAPH_WORLD,)
    with sharded_step("gpt", world_size=GRAPH_WORLD, mesh=shape, strategy=strategy) as step:
        mesh = step.mesh  # its groups have names only while the world is up
        groups = {"shard": mesh.get_group(mesh.ndim - 1).group_name, "replica": mesh.get_group(0).group_name}
    return step.forward, step.backward, groups


def _groups(gm: fx.GraphModule, op) -> set[str]:
    return {n.args[-1] for n in collectives(gm.graph, op)}


def test_full_gathers_twice_and_reduce_scatters():
    fw, bw, _ = _graphs("full")
    assert count(fw, "all_gather_into_tensor") > 0 and count(bw, "all_gather_into_tensor") > 0
    assert count(bw, "reduce_scatter_tensor") > 0 and count(fw, "all_reduce") == count(bw, "all_reduce") == 0


def test_grad_op_gathers_once_and_reduce_scatters():
    fw, bw, _ = _graphs("grad_op")
    assert count(fw, "all_gather_into_tensor") > 0 and count(bw, "all_gather_into_tensor") == 0
    assert count(bw, "reduce_scatter_tensor") > 0 and count(bw, "all_reduce") == 0


def test_replicate_all_reduces_buckets_while_the_backward_computes():
    fw, bw, _ = _graphs("replicate")
    assert not [n for n in fw.graph.nodes if "c10d" in str(n.target)]  # nothing to gather
    assert count(bw, "all_gather_into_tensor") == count(bw, "reduce_scatter_tensor") == 0
    reduces = collectives(bw.graph, c10d.all_reduce.default)
    assert 1 < len(reduces) <= 3  # bucketed: one per block, small leftovers merged
    order = positions(bw.graph.nodes)
    matmuls = [order[n] for n in bw.graph.nodes if n.op == "call_function" and "mm" in str(n.target)]
    first, second = reduces[0], reduces[1]
    # The first bucket is reduced while the next one's gradients are computed, and waited when
    # the plan's reductions in flight say (FSDP2's memory by default: before the next is issued).
    assert any(order[first] < m < order[second] for m in matmuls)
    assert any(order[first] < m < order[wait_of(first)] for m in matmuls)
    in_flight = bw.meta[PLAN].reduces_in_flight
    assert (order[wait_of(first)] > order[second]) == (in_flight > 1)


def test_hybrid_reduce_scatters_within_and_all_reduces_across_replicas():
    fw, bw, groups = _graphs("hybrid")
    assert _groups(fw, c10d.all_gather_into_tensor.default) == {groups["shard"]}
    assert _groups(bw, c10d.reduce_scatter_tensor.default) == {groups["shard"]}
    assert _groups(bw, c10d.all_reduce.default) == {groups["replica"]}
    assert count(bw, "reduce_scatter_tensor") == count(bw, "all_reduce") > 0  # one all-reduce per bucket
    for reduce in collectives(bw.graph, c10d.reduce_scatter_tensor.default):
        assert reduce.args[2] == GRAPH_WORLD // 2  # sharded over 4 ranks, not 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"strategy": "zero3"}, r"strategy must be one of \('full', 'grad_op', 'replicate', 'hybrid'\), got 'zero3'"),
        ({"strategy": "hybrid"}, r"autoshard.shard: strategy='hybrid' needs a 2-D mesh; pass mesh=init_device_mesh"),
        ({"strategy": "grad_op", "reshard_after_forward": True}, "strategy='grad_op' keeps full parameters"),
        ({"reshard_after_forward": 1.0}, r"^autoshard.shard: reshard_after_forward must be True, False, None or an int .*got 1\.0; pass"),
        ({"strategy": "full", "mesh": (2, 4)}, "strategy='full' needs a 1-D DeviceMesh, got 2-D"),
        ({"strategy": "hybrid", "mesh": (8,)}, r"strategy='hybrid' needs a 2-D DeviceMesh, got 1-D .*\(replicas, shard_size\)"),
        ({"mixed_precision": torch.bfloat16}, "mixed_precision must be an autoshard.MixedPrecision, got dtype"),
    ],
)
def test_bad_arguments_are_refused_and_change_nothing(kwargs, message):
    with fake_world(GRAPH_WORLD):
        if "mesh" in kwargs:
            kwargs["mesh"] = init_device_mesh("cpu", kwargs["mesh"])
        model = build("mlp")
        before = [(type(m), [id(p) for p in m.parameters()]) for m in model.modules()]
        with pytest.raises(ValueError, match=message):
            autoshard.shard(model, **kwargs)
        assert [(type(m), [id(p) for p in m.parameters()]) for m in model.modules()] == before


def test_mixed_precision_dtypes_must_be_floating_point():
    message = r"autoshard.MixedPrecision: param_dtype must be a floating-point torch.dtype or None, got torch.int8"
    with pytest.raises(ValueError, match=message):
        autoshard.MixedPrecision(param_dtype=torch.int8)


def _four_blocks() -> nn.Module:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))


@pytest.mark.parametrize("strategy, mesh", [("replicate", None), ("hybrid", (2, GRAPH_WORLD // 2))])
def test_all_reduce_blocks_puts_that_many_blocks_in_one_all_reduce_and_keeps_the_gradients(strategy, mesh):
    """all_reduce_blocks=2 on 4 blocks: two all-reduces of two blocks each (a leftover joins
    its block as before). Under replicate, every gradient as with one all-reduce per block
    (the fake group's all-reduce returns its input: a wrong slice shows); hybrid's gradients
    pass a reduce-scatter, which torch 2.11's fake group leaves unwritten, so hybrid's are
    checked on gloo ranks (test_hybrid_with_two_blocks_per_all_reduce_trains_like_one_process)."""
    tokens = same_tokens(lambda: torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0)))
    found = {}
    for k in (1, 2):
        torch.manual_seed(0)
        with sharded_step(_four_blocks, tokens, world_size=GRAPH_WORLD, mesh=mesh, strategy=strategy,
                          options={"all_reduce_blocks": k}) as step:
            grads = {n: getattr(p.grad, "_local_tensor", p.grad).clone() for n, p in step.model.named_parameters()}
        blocks = [{block_of(name) for name in r.meta[PARAMS]} - {None}
                  for r in collectives(step.backward.graph, c10d.all_reduce.default)]
        found[k] = blocks, grads
    assert [len(b) for b in found[1][0]] == [1] * 4
    assert [len(b) for b in found[2][0]] == [2, 2] and found[2][0][0] | found[2][0][1] == set().union(*found[1][0])
    if strategy == "replicate":  # hybrid's fake-group gradients are unwritten memory on torch 2.11: not compared
        assert found[1][1].keys() == found[2][1].keys() and any(g.abs().sum() > 0 for g in found[1][1].values())
        assert all(torch.equal(found[1][1][n], found[2][1][n]) for n in found[1][1])
