"""Training features on sharded models: gradient clipping, LoRA-style frozen parameters,
activation checkpointing, gradient accumulation and mixed precision.

Numerics: one 2-rank gloo run trains every feature next to single-process references (the
tests below read its results). Graphs: the same features compiled at world size 8 on the
fake process group.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import fx

import autoshard
from autoshard._compat import c10d
from autoshard.passes.graph_utils import PARAMS, collectives
from autoshard.runtime import grad_sync, ops
from autoshard.tools.launch import run_ranks

from fake_pg import compile_step, count
from models import build
from trainer import BF16, train_mixed_precision, train_pair

pytestmark = pytest.mark.multirank

TOL = 1e-5
MAX_NORM = 0.05  # well below the gradients' norm, so clipping changes every step
BF16_COMPUTE = autoshard.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)


def _one_collective_each(param, spec, grad: torch.Tensor) -> torch.Tensor:
    tail = (spec.name, spec.reduce_dtype, param.dtype, spec.replica_group, spec.replicas)
    if spec.dim0 < 0:
        return ops.all_reduce_grad(grad, spec.group_name, spec.world_size, *tail)
    return ops.reduce_grad(grad, spec.group_name, spec.world_size, param.to_local().shape[0], *tail)


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a - b).abs().max().item() if a.numel() else 0.0


def _bucketed_flush() -> dict[str, Any]:
    """Reduce made-up accumulated gradients of every "uneven" parameter (padded, empty and 0-d
    shards) with one collective each and in buckets (capped at a third of them, so buckets are
    cut); the largest difference and the collective counts."""
    model = autoshard.shard(build("uneven"))
    torch.manual_seed(dist.get_rank())  # ranks accumulated different gradients
    items = [(p, m._autoshard_specs[n], torch.randn(p.shape)) for m in model.modules()
             for n, p in sorted(m._parameters.items()) if n in getattr(m, "_autoshard_specs", {})]
    cap, grad_sync.FLUSH_BUCKET_BYTES = grad_sync.FLUSH_BUCKET_BYTES, sum(g.nbytes for _, _, g in items) // 3
    try:
        buckets = grad_sync._buckets(items)
    finally:
        grad_sync.FLUSH_BUCKET_BYTES = cap
    reduced = {id(p): r for bucket in buckets for (p, _, _), r in zip(bucket, grad_sync._reduce_bucket(bucket))}
    diffs = [_difference(reduced[id(p)], _one_collective_each(p, spec, g)) for p, spec, g in items]
    return {"error": max(diffs), "parameters": len(items), "buckets": len(buckets),
            "kinds": len({spec.dim0 < 0 for _, spec, _ in items})}


def _refreeze(step: int, model: torch.nn.Module) -> None:
    """fc1.weight frozen from the start (after shard, before the first compile), then
    unfrozen and fc2.weight frozen from step 1: set on the DTensor parameters directly."""
    params = dict(model.named_parameters())
    params["fc1.weight"].requires_grad_(step >= 1)
    params["fc2.weight"].requires_grad_(step == 0)


def _features() -> dict[str, dict[str, Any]]:
    mixed = functools.partial(autoshard.shard, mixed_precision=BF16_COMPUTE)
    return {
        "flush": _bucketed_flush(),
        "clip": train_pair("uneven", optimizer="sgd", max_norm=MAX_NORM),  # padded, empty and 0-d shards
        "lora": train_pair("lora"),
        "refreeze": train_pair("mlp", steps=3, trainable=_refreeze),
        "checkpointed": train_pair("checkpointed"),
        "accumulation": train_pair("gpt", micro_batches=2),  # tied weights share one accumulator
        "bf16_gpt": train_mixed_precision("gpt", mixed),
        "bf16_mlp": train_mixed_precision("mlp", mixed),  # float inputs, cast on the way in
    }


@functools.cache
def _results() -> dict[str, dict[str, Any]]:
    """Rank 0's results; every rank's errors must agree with them."""
    ranks = run_ranks(2, _features)
    for other in ranks[1:]:
        for feature, found in other.items():
            key = "error" if feature == "flush" else "params"
            assert found[key] == ranks[0][feature][key], feature
    return ranks[0]


def test_clip_grad_norm_on_sharded_gradients_is_the_global_norm():
    found = _results()["clip"]
    assert found["clip_ratio"] > 1, "the test's max_norm must be below the gradients' norm"
    assert found["norm"] <= TOL and found["params"] <= TOL and found["loss"] <= TOL, found


def test_freezing_and_unfreezing_parameters_between_compiled_steps_trains_like_one_process():
    """A change of requires_grad before the first compile is seen while tracing (one graph);
    one after it runs that step eagerly and recompiles for the next (a second graph)."""
    found = _results()["refreeze"]
    assert found["params"] <= TOL and found["loss"] <= TOL, found
    assert found["graphs"] == 2, found


def test_lora_trains_like_one_process():
    found = _results()["lora"]
    assert found["params"] <= TOL and found["loss"] <= TOL, found  # frozen weights stay as they were


def test_activation_checkpointing_trains_like_one_process():
    found = _results()["checkpointed"]
    assert found["params"] <= TOL and found["loss"] <= TOL, found


def test_turning_sync_back_on_reduces_accumulated_gradients_in_buckets():
    found = _results()["flush"]
    assert found["error"] == 0, found  # the same sums, fewer collectives
    assert found["kinds"] + 1 < found["buckets"] < found["parameters"], found  # cut at the cap


def test_gradient_accumulation_matches_the_whole_batch_with_two_compiled_variants():
    found = _results()["accumulation"]
    assert found["params"] <= TOL and found["loss"] <= TOL, found
    # 3 steps of 2 micro-batches, synchronisation off then on: one graph per setting.
    assert found["graphs"] == 2


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_mixed_precision_computes_in_bf16_and_reduces_and_stores_in_fp32(name):
    found = _results()[f"bf16_{name}"]
    # Exactly the per-rank computation: bf16 gathers are exact, each rank computes on its
    # slice in bf16, gradients are averaged in fp32 (measured: 0.0).
    assert found["emulated"] <= TOL, found
    # Against bf16 on the whole batch, sharding only moves where bf16 rounds (per-rank partial
    # sums of activations and gradients instead of whole-batch ones): the same kind and size
    # of error as computing in bf16 at all. So: the loss within 2 bf16 spacings of its value,
    # parameters within twice the distance between the bf16 and fp32 references
    # (measured: 0.5-1x that distance).
    assert found["loss"] <= 2 * found["loss_ulp"], found
    assert found["params"] <= 2 * found["bf16_params"], found
    assert found["bf16_params"] > 100 * TOL  # bf16 really differs from fp32 here
    assert found["loss_dtype"] == BF16
    assert found["param_dtypes"] == found["state_dtypes"] == {torch.float32}  # master copy, optimizer state


# Graphs at world size 8 ------------------------------------------------------------------

WORLD = 8


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()


def _graphs(name: str, *, sync: bool = True, **shard_kwargs) -> tuple[torch.nn.Module, fx.GraphModule, fx.GraphModule]:
    """(sharded model, forward, backward) of one training step at world size 8, schedule autoshard."""
    step = compile_step(name, world_size=WORLD, sync=sync, **shard_kwargs)
    return step.model, step.forward, step.backward


def _gathered(gm: fx.GraphModule) -> Counter:
    """How often each parameter is all-gathered in a graph."""
    return Counter(name for g in collectives(gm.graph, c10d.all_gather_into_tensor.default) for name in g.meta[PARAMS])


def test_lora_buckets_mix_frozen_and_trainable_parameters():
    model, fw, bw = _graphs("lora")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for gm in (fw, bw):
        mixed = [g.meta[PARAMS] for g in collectives(gm.graph, c10d.all_gather_into_tensor.default)]
        assert any(set(names) & trainable and set(names) - trainable for names in mixed)
    reduced = {n for r in collectives(bw.graph, c10d.reduce_scatter_tensor.default) for n in r.meta[PARAMS]}
    assert reduced == trainable  # every trainable gradient reduced once, no frozen one


@pytest.mark.parametrize("strategy", ["full", "grad_op"])
def test_activation_checkpointing_gathers_no_parameter_more_than_the_plan_says(strategy):
    model, fw, bw = _graphs("checkpointed", strategy=strategy)
    assert _gathered(fw) == Counter(n for n, _ in model.named_parameters())  # tied weights: once
    regathered = _gathered(bw)
    if strategy == "grad_op":
        assert not regathered  # kept gathered from forward, even for recomputed regions
    else:  # recomputing a block and computing its gradients share one gather
        assert regathered and max(regathered.values()) == 1


def test_without_gradient_sync_backward_communicates_nothing():
    model, fw, bw = _graphs("uneven", sync=False)
    assert count(fw, "all_gather_into_tensor") > 0
    assert count(bw, "reduce_scatter") == count(bw, "all_reduce") == 0


def test_mixed_precision_gathers_in_bf16_and_reduces_in_fp32():
    _, fw, bw = _graphs("gpt", mixed_precision=BF16_COMPUTE)
    for gm in (fw, bw):
        for gather in collectives(gm.graph, c10d.all_gather_into_tensor.default):
            assert gather.args[0].meta["val"].dtype == BF16
    reduces = collectives(bw.graph, c10d.reduce_scatter_tensor.default)
    assert reduces and all(r.args[0].meta["val"].dtype == torch.float32 for r in reduces)
