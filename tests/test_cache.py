"""Inductor's compile caches under autoshard (docs/caching.md): a second process with the same
cache directory hits them and computes the same step; what changes the plan changes the key;
artifacts saved by one process warm another. Each compile runs in its own process (a cache is
only worth something across processes), on a 2-layer GPT at world size 2 (fake process group)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.inductor

ROOT = Path(__file__).resolve().parents[1]
WIDTH = dict(n_embd=32, n_head=2, block_size=16, vocab_size=64)
# Set, they force the caches on or off whatever the config says; conftest.py turns them off
# for the other tests. Here they are unset: the caches are on, as PyTorch ships them.
_CACHE_SWITCHES = ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")


def _child(options: dict, world: int, save: str | None, load: str | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard._compat import fake_process_group
    from autoshard._compat.caches import cache_counts
    from autoshard.compiler import backend, cache_key

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    if load:
        torch.compiler.load_cache_artifacts(Path(load).read_bytes())
    keys: list[str] = []
    real = cache_key.cache_key

    def recording(*args: Any) -> str:
        keys.append(real(*args))
        return keys[-1]

    backend.cache_key = recording
    fake_process_group(0, world)
    try:
        torch.manual_seed(0)
        model = autoshard.shard(GPT(GPTConfig(n_layer=2, **WIDTH)))
        compiled = torch.compile(model, backend="autoshard", options={"compiler": "inductor", **options})
        idx = torch.randint(0, WIDTH["vocab_size"], (2, WIDTH["block_size"]), generator=torch.Generator().manual_seed(1))
        compiled(idx, idx).backward()  # the fake group's collectives move no data: its values are not compared
    finally:
        dist.destroy_process_group()
    counts = cache_counts()  # before saving: what this compile hit and missed, nothing else
    if save:
        Path(save).write_bytes(torch.compiler.save_cache_artifacts()[0])
    return {"counts": counts, "keys": keys}


def _run(cache: Path, options: dict | None = None, world: int = 2, save: Path | None = None,
         load: Path | None = None) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONWARNINGS": "ignore"}
    for var in _CACHE_SWITCHES:
        env.pop(var, None)
    args = json.dumps([options or {}, world, save and str(save), load and str(load)])
    done = subprocess.run([sys.executable, __file__, args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_then_warm(tmp_path_factory) -> tuple[Path, dict, dict, Path]:
    """A cold compile, which also saves its cache artifacts, then a warm one in its cache
    directory: (that directory, cold, warm, the artifacts file). Each compile is a process of
    tens of seconds, so the tests below share these two."""
    cache = tmp_path_factory.mktemp("inductor_cache")
    artifacts = tmp_path_factory.mktemp("artifacts") / "artifacts.bin"
    cold = _run(cache, save=artifacts)
    return cache, cold, _run(cache), artifacts


@pytest.mark.slow
def test_a_second_process_hits_both_caches_with_the_same_key(cold_then_warm):
    """What the hit computes, against a miss, is checked on real ranks
    (test_ranks_whose_compile_hits_run_with_ranks_whose_compile_misses): here the process
    group is fake, and its reductions leave their outputs unwritten."""
    _, cold, warm, _ = cold_then_warm
    assert cold["counts"]["autograd_hit"] == 0 and cold["counts"]["autograd_miss"] == 1
    assert warm["counts"]["autograd_hit"] == 1 and warm["counts"]["autograd_miss"] == 0
    assert warm["counts"]["fxgraph_hit"] >= 1 and warm["counts"]["fxgraph_miss"] == 0
    assert warm["keys"] == cold["keys"]  # autoshard's key: no process-order state in it


@pytest.mark.slow
def test_an_option_that_changes_the_plan_misses(cold_then_warm):
    """End to end for one option (a compile each); that options, the budget, the profile and
    the world size each change autoshard's key is test_the_key_changes_with_what_changes_the_plan."""
    cache, cold, _, _ = cold_then_warm
    changed = _run(cache, options={"bucket_mb": 1.0})
    assert changed["counts"]["autograd_hit"] == 0 and changed["counts"]["autograd_miss"] == 1
    assert changed["keys"] != cold["keys"]


@pytest.mark.slow
def test_artifacts_saved_by_one_process_warm_another(cold_then_warm, tmp_path):
    _, cold, _, artifacts = cold_then_warm
    warm = _run(tmp_path / "empty", load=artifacts)  # a cache directory of its own
    assert warm["counts"]["autograd_hit"] == 1 and warm["counts"]["autograd_miss"] == 0
    assert warm["keys"] == cold["keys"]


def _batch_key(other_first: bool) -> str:
    from autoshard.runtime import batched, ops

    other = [(ops.UNSHARD, ("0", 2, 8, True, "v", None, None, None, "", 1))]
    for calls in ([other] if other_first else []) + [[(ops.UNSHARD, ("0", 2, 4, True, "w", None, None, None, "", 1))]]:
        key = batched.key_for(calls)
    return key


@pytest.mark.multirank
def test_a_batch_is_named_by_its_calls_not_by_what_the_process_made_before():
    from autoshard.tools.launch import run_ranks

    assert _batch_key(False) == _batch_key(True)  # this process: the same key, made first or second
    assert run_ranks(1, _batch_key, True, timeout=300) == [_batch_key(False)]  # another process


def test_the_key_changes_with_what_changes_the_plan():
    import torch.distributed as dist
    from torch import fx

    from autoshard._compat import fake_process_group
    from autoshard.compiler.cache_key import cache_key
    from autoshard.compiler.options import Options
    from autoshard.cost.cost_model import get_profile

    gm, cpu = fx.GraphModule({}, fx.Graph()), get_profile("cpu")
    keys = {}
    for world in (2, 4):
        fake_process_group(0, world)
        try:
            keys[world] = cache_key(gm, Options(), cpu)
            if world == 2:
                changed = [cache_key(gm, Options(bucket_mb=1.0), cpu), cache_key(gm, Options(memory_budget_gb=1.0), cpu),
                           cache_key(gm, Options(schedule="fsdp2"), cpu), cache_key(gm, Options(), get_profile("h100")),
                           cache_key(gm, Options(all_reduce_blocks=2), cpu)]
                assert cache_key(gm, Options(debug_dir="somewhere"), cpu) == keys[2]  # what is written, not compiled
        finally:
            dist.destroy_process_group()
    assert len({keys[2], keys[4], *changed}) == 7


def _gloo_step(cache_root: str, batch_shares: list[int] | None = None) -> dict[str, Any]:
    """A training step on this gloo rank, with this rank's own cache directory: the whole
    global batch of 2 sequences, or this rank's share of 4 (``batch_shares``)."""
    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard._compat.caches import cache_counts
    from autoshard.compiler import backend

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    agreed: list[bool] = []  # each compile's key exchange, as every rank saw it
    real = backend.keys_agree
    backend.keys_agree = lambda *args: agreed.append(real(*args)) or agreed[-1]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"rank{dist.get_rank()}")
    torch.manual_seed(0)
    model = autoshard.shard(GPT(GPTConfig(n_layer=1, **WIDTH)), batch_shares=batch_shares)
    compiled = torch.compile(model, backend="autoshard", options={"compiler": "inductor"})
    idx = torch.randint(0, WIDTH["vocab_size"], (2 if batch_shares is None else 4, WIDTH["block_size"]),
                        generator=torch.Generator().manual_seed(1))
    mine = idx if batch_shares is None else autoshard.split_batch(idx, model)
    loss = compiled(mine, mine)
    loss.backward()
    grads = [p.grad.full_tensor().sum().item() for p in model.parameters() if p.grad is not None]
    return {"counts": cache_counts(), "loss": loss.item(), "rows": mine.shape[0], "grads": grads, "agreed": agreed}


@pytest.mark.slow
@pytest.mark.multirank
def test_ranks_whose_compile_hits_run_with_ranks_whose_compile_misses(tmp_path, monkeypatch):
    """Rank 0's cache is warm, rank 1's empty: a plan exchange on the misses only would leave
    rank 1 waiting for rank 0's plan; both exchange their cache key instead, and train to the
    gradients both computed when both missed."""
    from autoshard.tools.launch import run_ranks

    for var in _CACHE_SWITCHES:  # the ranks inherit this environment
        monkeypatch.delenv(var, raising=False)
    warm = tmp_path / "warm"
    cold, _ = run_ranks(2, _gloo_step, str(warm), timeout=900)
    (warm / "rank1").rename(tmp_path / "old_rank1")  # rank 1 starts cold
    hit, missed = run_ranks(2, _gloo_step, str(warm), timeout=900)
    assert hit["counts"]["autograd_hit"] == 1 and missed["counts"]["autograd_miss"] == 1
    assert hit["loss"] == missed["loss"] == cold["loss"]
    assert hit["grads"] == missed["grads"] == cold["grads"]


@pytest.mark.slow
@pytest.mark.multirank
def test_ranks_with_their_own_batch_shares_compile_uncached_and_agree(tmp_path, monkeypatch):
    """The model's graph has other input shapes on each rank, so its cache keys differ: rather
    than a mismatch error, every rank compiles it uncached and takes rank 0's decisions
    (runtime/batch_shares.py). A graph whose inputs are alike on both (after a graph break)
    agrees and goes through the cache."""
    from autoshard.tools.launch import run_ranks

    for var in _CACHE_SWITCHES:
        monkeypatch.delenv(var, raising=False)
    big, small = run_ranks(2, _gloo_step, str(tmp_path), [3, 1], timeout=900)
    assert (big["rows"], small["rows"]) == (3, 1)
    assert big["agreed"] == small["agreed"] and big["agreed"][0] is False  # the same decisions on both
    for found in (big, small):  # only the graphs whose keys agreed went to the AOT autograd cache
        assert found["counts"]["autograd_hit"] == 0 and found["counts"]["autograd_miss"] == found["agreed"].count(True)
    assert big["grads"] == small["grads"]  # the same reduced gradients on both ranks


if __name__ == "__main__":
    print(json.dumps(_child(*json.loads(sys.argv[1]))))
