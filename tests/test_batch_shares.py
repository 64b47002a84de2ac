"""Per-rank batch shares: ranks take different numbers of samples of the global batch and
training still equals one process on the whole batch (gloo, CPU), for every strategy, with
gradient accumulation, activation checkpointing, bf16 and clipping; bad shares are refused
alike on every rank.

One launch per world size trains every case next to a single-process reference.
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.runtime.errors import UsageError
from autoshard.tools.launch import run_ranks

from models import build
from trainer import BF16, train_mixed_precision, train_pair

pytestmark = pytest.mark.multirank

TOL = 1e-5
MAX_NORM = 0.05  # below the gradients' norm: clipping is active every step
BF16_COMPUTE = autoshard.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
SHARES = {2: [3, 1], 4: [3, 3, 1, 1]}


def _shard(strategy: str, **kwargs) -> functools.partial:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2)) if strategy == "hybrid" else None
    return functools.partial(autoshard.shard, mesh=mesh, strategy=strategy, **kwargs)


def _refusals() -> dict[str, str]:
    """The error each rank raised (or "none") for shares that differ between ranks, and for a
    batch the shares do not split."""
    found = {}
    model = autoshard.shard(build("mlp"))
    try:
        autoshard.set_batch_shares(model, [1 + dist.get_rank()] + [1] * (dist.get_world_size() - 1))
        found["differ"] = "none"
    except UsageError as e:
        found["differ"] = str(e)
    try:
        autoshard.split_batch(torch.zeros(7, 2), SHARES[dist.get_world_size()])
        found["indivisible"] = "none"
    except UsageError as e:
        found["indivisible"] = str(e)
    return found


def _compiles_alike() -> str:
    """One step of bench/hetero.py's MLP with shares [2, 1] of 384 samples: the cost model
    schedules 256 and 128 samples differently, so ranks must take the same decisions."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.GELU())]
    model = autoshard.shard(torch.nn.Sequential(*layers, torch.nn.Linear(1024, 1)), batch_shares=[2, 1])
    run = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"})
    run(autoshard.split_batch(torch.randn(384, 1024), model)).sum().backward()
    return "ok"


def _weights() -> dict[str, Any]:
    """This rank's gradient weight: after materializing a meta model sharded with shares, then
    back to equal shares; and whether the weight shows in the state_dict."""
    with torch.device("meta"):
        model = build("mlp")
    autoshard.shard(model, batch_shares=SHARES[dist.get_world_size()])
    autoshard.materialize(model, "cpu")
    weight = model._autoshard_batch_weight.item()
    in_state = any("batch_weight" in k for k in model.state_dict())
    autoshard.set_batch_shares(model, None)
    return {"materialized": weight, "equal": model._autoshard_batch_weight.item(), "in_state_dict": in_state}


def _cases() -> dict[str, Any]:
    world = dist.get_world_size()
    shares = SHARES[world]
    found: dict[str, Any] = {"rank": dist.get_rank(), "refused": _refusals(), "weights": _weights()}
    for strategy in ("full", "hybrid") if world == 4 else ("full", "grad_op", "replicate"):
        found[strategy] = train_pair("uneven", _shard(strategy), shares=shares, max_norm=MAX_NORM)
    found["gpt"] = train_pair("gpt", shares=shares, optimizer="sgd")
    found["checkpointed"] = train_pair("checkpointed", shares=shares, optimizer="sgd")
    # Accumulation: every micro-batch split by the shares (16 samples: 2 x 8 at 4 ranks).
    found["accumulation"] = train_pair("uneven", _shard("hybrid" if world == 4 else "full"), shares=shares,
                                       micro_batches=2, global_batch=16)
    found["bf16"] = train_mixed_precision("uneven", _shard("hybrid" if world == 4 else "full", mixed_precision=BF16_COMPUTE),
                                          shares=shares)
    if world == 2:
        found["compiles_alike"] = _compiles_alike()
        found["inductor"] = train_pair("mlp", shares=shares, compiler="inductor", optimizer="sgd")
        found["uncompiled"] = train_pair("uneven", shares=[0.25, 0.75], compiler="uncompiled")  # fractions work too
    return found


@functools.cache
def _results(world: int) -> list[dict[str, Any]]:
    return run_ranks(world, _cases)


PARITY = [(2, c) for c in ("full", "grad_op", "replicate", "gpt", "checkpointed", "accumulation", "inductor", "uncompiled")]
PARITY += [(4, c) for c in ("full", "hybrid", "gpt", "checkpointed", "accumulation")]


@pytest.mark.slow
@pytest.mark.parametrize("world,case", PARITY)
def test_uneven_shares_train_like_one_process_on_the_whole_batch(world, case):
    for rank in _results(world):
        found = rank[case]
        assert found["loss"] <= TOL and found["params"] <= TOL, (rank["rank"], found)
        if "clip_ratio" in found and found["clip_ratio"] != float("inf"):
            assert found["clip_ratio"] > 1 and found["norm"] <= TOL, (rank["rank"], found)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_uneven_shares_in_bf16_are_the_weighted_per_rank_bf16_computation(world):
    for rank in _results(world):
        found = rank["bf16"]
        assert found["emulated"] <= TOL, found  # operation for operation what the ranks compute
        assert found["loss"] <= 2 * found["loss_ulp"], found
        assert found["params"] <= 2 * found["bf16_params"], found
        assert found["loss_dtype"] == BF16 and found["param_dtypes"] == {torch.float32}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_bad_shares_raise_the_same_error_on_every_rank(world):
    ranks = _results(world)
    for key, words in {"differ": "ranks disagree", "indivisible": "not a whole number"}.items():
        messages = {rank["refused"][key] for rank in ranks}
        assert len(messages) == 1 and words in messages.pop(), (key, ranks[0]["refused"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_gradient_weight_is_world_size_times_the_share_and_survives_materialize(world):
    for rank in _results(world):
        share = SHARES[world][rank["rank"]] / sum(SHARES[world])
        assert rank["weights"] == {"materialized": world * share, "equal": 1.0, "in_state_dict": False}, rank["weights"]


@pytest.mark.slow
def test_ranks_with_different_batch_sizes_compile_the_same_plan():
    assert [rank["compiles_alike"] for rank in _results(2)] == ["ok", "ok"]


def test_split_batch_cuts_tensors_and_containers_on_dim_0():
    x, y = torch.arange(8.0).view(8, 1), torch.arange(8)
    parts = [autoshard.split_batch({"x": x, "y": (y,)}, [3, 1], rank=r) for r in range(2)]
    assert parts[0]["x"].flatten().tolist() == [0, 1, 2, 3, 4, 5] and parts[0]["y"][0].tolist() == [0, 1, 2, 3, 4, 5]
    assert parts[1]["x"].flatten().tolist() == [6, 7] and parts[1]["y"][0].tolist() == [6, 7]
    assert autoshard.split_batch(x, [0.25, 0.75], rank=1).shape == (6, 1)


class _Plan:
    batch_shares = (2 / 3, 1 / 3)


def test_shares_come_from_anything_with_batch_shares_and_round_to_sample_counts():
    assert autoshard.batch_sizes(_Plan(), 9) == [6, 3]
    assert autoshard.batch_sizes(_Plan(), 10) == [7, 3]  # rounded, summing to the batch
    assert autoshard.batch_sizes([3, 3, 1, 1], 8) == [3, 3, 1, 1]


@pytest.mark.parametrize(
    "shares,message",
    [
        ([3, 1, 1], r"3 shares given for 2 ranks"),
        ([3, 0], r"rank 1's share is 0; every share must be a positive"),
        ([3, -1.0], r"rank 1's share is -1.0"),
        ([1, float("nan")], r"rank 1's share is nan"),
        ("ab", r"rank 0's share is 'a'"),
        (None, r"one positive number per rank"),
    ],
)
def test_bad_shares_are_refused(shares, message):
    with pytest.raises(UsageError, match=message):
        autoshard.runtime.batch_shares.normalize(shares, 2)


def test_shares_that_do_not_split_the_batch_are_refused_with_the_fix():
    message = r"rank 0's share 0.666667 of the global batch of 10 samples is 6.66667 samples.*gives \[7, 3\]"
    with pytest.raises(UsageError, match=message):
        autoshard.split_batch(torch.zeros(10, 2), _Plan(), rank=1)


def test_batch_tensors_must_agree_on_the_batch_size():
    with pytest.raises(UsageError, match=r"disagree on dim 0 \(sizes \[4, 8\]\)"):
        autoshard.split_batch((torch.zeros(8), torch.zeros(4)), [1], rank=0)
