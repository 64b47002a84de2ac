"""Big-model init as FSDP2 users do it (meta device, shard, materialize), and ranks that built
different models: the same clear error on every rank, before any parameter moves."""
from __future__ import annotations

import resource
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.tools.launch import run_ranks

from gpt import GPT, GPTConfig
from models import build
from trainer import train_pair

pytestmark = pytest.mark.multirank

CONFIG = dict(vocab_size=64, block_size=16, n_head=2, n_embd=32)  # models.build("gpt") has 2 layers


def _meta_gpt(_reference_copy: nn.Module) -> nn.Module:
    """What a user of a model too big for one rank writes; values must equal build("gpt")."""
    torch.manual_seed(0)  # the seed build("gpt") used
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, **CONFIG))
    autoshard.shard(model)
    assert all(p.to_local().is_meta for p in model.parameters())  # nothing allocated yet
    return autoshard.materialize(model, "cpu", init=GPT.init_weights)


def _init_and_divergence() -> dict:
    out = {}
    # Rank 1 reads a different config: 3 layers instead of 2.
    start = time.monotonic()
    try:
        autoshard.shard(GPT(GPTConfig(n_layer=2 + dist.get_rank(), **CONFIG)))
        out["divergence"] = "no error"
    except ValueError as e:
        out["divergence"] = str(e)
    out["divergence_s"] = time.monotonic() - start

    model, reference = _meta_gpt(None), build("gpt")
    out["equal_init"] = {n: torch.equal(p.full_tensor(), q.detach())
                         for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True)}
    out["tied"] = model.head._parameters["weight"] is model.wte._parameters["weight"]
    out["trained"] = train_pair("gpt", _meta_gpt, optimizer="sgd", steps=3)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(2, _init_and_divergence, timeout=300)


def test_meta_init_equals_one_process_init_and_trains_like_it(ranks) -> None:
    for out in ranks:
        assert all(out["equal_init"].values()), [n for n, same in out["equal_init"].items() if not same]
        assert out["tied"]
        assert out["trained"]["loss"] < 1e-5 and out["trained"]["params"] < 1e-5, out["trained"]


def test_ranks_that_built_different_models_all_raise_the_same_error_before_anything_moves(ranks) -> None:
    first = ranks[0]["divergence"]
    assert "ranks disagree on what to shard" in first and "rank 1 has" in first
    assert "blocks.2" in first or "nothing more" in first  # names the extra layer
    assert all(out["divergence"] == first for out in ranks)
    assert all(out["divergence_s"] < 60 for out in ranks)


LAYERS, WIDTH = 64, 2048  # 64 x 16 MiB of weights: 1 GiB in all, 512 MiB per rank


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _big(layers: int = LAYERS) -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))


def _memory(meta: bool) -> dict[str, float]:
    """The rise of this process's peak memory while a model of ``full`` MiB is built and
    sharded (each measurement in fresh processes: freed memory would be reused)."""
    with torch.device("meta"):  # first use loads code and fills caches: not the model's memory
        autoshard.materialize(autoshard.shard(_big(2)), "cpu")
    before = _rss_mib()
    if meta:
        with torch.device("meta"):
            model = _big()
        autoshard.shard(model)
        autoshard.materialize(model, "cpu")
    else:  # built whole, then cut
        autoshard.shard(_big())
    return {"full": LAYERS * WIDTH * WIDTH * 4 / 2**20, "rise": _peak_mib() - before}


@pytest.mark.slow
def test_meta_init_never_allocates_the_full_model() -> None:
    for meta, eager in zip(run_ranks(2, _memory, True, timeout=300), run_ranks(2, _memory, False, timeout=300), strict=True):
        # Each rank holds its half (512 MiB) plus one transient full parameter (16 MiB); runs
        # here measured 512-552 MiB, once 632 (torch 2.15 in CI). Below 3/4 of the model is
        # still far from holding it whole, which the eager build below does (over 1.4x).
        assert meta["rise"] < 0.75 * meta["full"], meta
        assert eager["rise"] > 1.4 * eager["full"], eager  # the measurement sees the full model (and the shards)
