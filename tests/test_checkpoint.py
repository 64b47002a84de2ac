"""Checkpoints: saved at one world size, loaded at another, training goes on as if uninterrupted;
saves are atomic; truncated, corrupted or mismatched checkpoints fail clearly and change nothing."""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autoshard
import autoshard.runtime.checkpoint as ckpt
from autoshard.runtime.checkpoint import full_state_dict, load, save
from autoshard.tools.launch import run_ranks

from gpt import GPT, GPTConfig
from models import GLOBAL_BATCH, batch, build

pytestmark = pytest.mark.multirank

STEPS, SAVE_AT, TOL = 4, 2, 1e-5


def _adamw(model: torch.nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train_losses(run, opt, steps: range, slices: tuple[int, int] | None = None) -> list[float]:
    """Train on this rank's slice of each global batch; return the global mean losses.
    ``slices``: (which, how many) slices of the batch, where ranks share one (tensor parallelism's
    dp rank and dp size); default (rank, world size)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    which, count = slices or ((dist.get_rank(), world) if dist.is_initialized() else (0, 1))
    per_rank = GLOBAL_BATCH // count
    mine = slice(which * per_rank, (which + 1) * per_rank)
    losses = []
    for step in steps:
        x, y = batch("gpt", step)
        loss = run(x[mine], y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def _resume(path: str) -> dict:
    """Load ``path`` into a differently initialised model and optimizer, train to STEPS."""
    model = autoshard.shard(build("gpt", seed=1))
    opt = _adamw(model, lr=0.5)  # the checkpoint's lr (1e-3) must replace this one
    params = list(model.parameters())
    load(path, model, opt)
    # Loaded in place: a compiled model and the optimizer keep seeing the same parameters.
    assert all(p is q for p, q in zip(params, model.parameters(), strict=True))
    return {"after": train_losses(model, opt, range(SAVE_AT, STEPS)), "params": full_state_dict(model, rank0_only=False)}


def _start(path: str) -> tuple[dict, torch.nn.Module]:
    """Train a fresh sharded model to SAVE_AT and save it."""
    model = autoshard.shard(build("gpt"))
    opt = _adamw(model)
    out = {"before": train_losses(model, opt, range(SAVE_AT))}
    save(path, model, opt)
    return out, model


def _snapshot(model, opt) -> list[torch.Tensor]:
    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.clone()
    state = [full(t) for s in opt.state.values() for t in s.values()]
    return [full(p.detach()) for p in model.parameters()] + state + [torch.tensor(opt.param_groups[0]["lr"])]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _bad_loads(good: str, scratch: str) -> dict[str, tuple[str, str, bool]]:
    """Load broken copies of ``good``; per case: (error type, message, model+optimizer unchanged)."""
    rank = dist.get_rank()

    def broken(name: str, damage) -> str:
        path = os.path.join(scratch, name)
        if rank == 0:
            shutil.copytree(good, path)
            damage(Path(path))
        dist.barrier()
        return path

    def data_file(path: Path) -> Path:
        return max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)

    def truncate(path: Path) -> None:
        f = data_file(path)
        os.truncate(f, f.stat().st_size // 2)

    def flip(path: Path) -> None:
        f = data_file(path)
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))

    cases = {
        "truncated": broken("truncated", truncate),
        "bit_flip": broken("bit_flip", flip),
        "metadata": broken("metadata", lambda p: (p / ".metadata").write_bytes(b"\x80\x04garbage")),
        "no_manifest": broken("no_manifest", lambda p: (p / "autoshard_manifest.json").unlink()),
    }
    results = {}
    # A fresh optimizer (empty state) and a mismatched model with a trained optimizer.
    model = autoshard.shard(build("gpt", seed=1))
    opt = _adamw(model, lr=0.5)
    other = autoshard.shard(GPT(GPTConfig(vocab_size=72, block_size=16, n_layer=3, n_head=2, n_embd=32)))
    other_opt = _adamw(other)
    x, y = batch("gpt", 0)
    other(x, y).backward()
    other_opt.step()
    for case, (m, o, path) in {**{c: (model, opt, p) for c, p in cases.items()}, "mismatch": (other, other_opt, good)}.items():
        before = _snapshot(m, o)
        try:
            load(path, m, o)
            results[case] = ("no error", "", True)
        except Exception as e:  # any: the test names the type it expects (CheckpointError)
            results[case] = (type(e).__name__, str(e), _same(before, _snapshot(m, o)))
    return results


def _full_state_dict_check(model) -> dict:
    sd = full_state_dict(model)
    gathered = {n: p.full_tensor() for n, p in model.named_parameters(remove_duplicate=False)}
    if dist.get_rank() != 0:
        return {"empty": sd == {}}
    plain = build("gpt", seed=1)
    plain.load_state_dict(sd, strict=True)
    return {"equal": all(torch.equal(p, gathered[n]) for n, p in plain.named_parameters(remove_duplicate=False)),
            "plain_cpu": all(type(t) is torch.Tensor and t.device.type == "cpu" for t in sd.values())}


def _world2_first(c2: str, scratch: str) -> dict:
    out, model = _start(c2)
    out["full_state_dict"] = _full_state_dict_check(model)
    out["bad"] = _bad_loads(c2, scratch)
    return out


def _in_group(rank: int, world: int, init_file: str, fn, *args):
    """``fn(*args)`` on ranks below ``world`` in a new process group of that size."""
    if rank >= world:
        return None
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def _world_sizes_2_4_2_1(tmp: str) -> dict:
    """One spawn of 4 processes (spawns are slow here) runs groups of 2, 4, 2 and 1 ranks in turn:
    save at 2 (+ bad loads); load at 4 (2 -> 4) and save at 4; load at 2 (4 -> 2); load at 1."""
    rank = dist.get_rank()
    dist.destroy_process_group()
    c2, c4 = f"{tmp}/c2", f"{tmp}/c4"
    try:
        return {
            "w2": _in_group(rank, 2, f"{tmp}/pg_a", _world2_first, c2, f"{tmp}/scratch"),
            "w4": _in_group(rank, 4, f"{tmp}/pg_b", lambda: {**_resume(c2), **_start(c4)[0]}),
            "w2_from_4": _in_group(rank, 2, f"{tmp}/pg_c", _resume, c4),
            "w1_from_4": _in_group(rank, 1, f"{tmp}/pg_d", _resume, c4),  # sharded, world size 1
        }
    finally:  # the group run_ranks destroys
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg_e", rank=rank, world_size=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    (tmp / "scratch").mkdir()
    model = build("gpt")
    reference = {"losses": train_losses(model, _adamw(model), range(STEPS)), "params": model.state_dict()}
    ranks = run_ranks(4, _world_sizes_2_4_2_1, str(tmp), timeout=400)
    results = {key: [r[key] for r in ranks if r[key] is not None] for key in ranks[0]}
    results["no_group_from_4"] = [_resume(str(tmp / "c4"))]  # unsharded, no process group
    return {"reference": reference, **results}


def _check_resumed(result: dict, reference: dict) -> None:
    losses = reference["losses"][SAVE_AT:]
    assert max(abs(a - b) for a, b in zip(result["after"], losses, strict=True)) < TOL, (result["after"], losses)
    assert result["params"].keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        assert (result["params"][name] - ref).abs().max().item() < TOL, name


@pytest.mark.parametrize("run", ["w4", "w2_from_4", "w1_from_4", "no_group_from_4"])
def test_resharded_load_continues_training_as_if_uninterrupted(runs, run: str) -> None:
    for key in ("w2", "w4"):  # the runs that saved: same losses as the reference up to SAVE_AT
        for rank in runs[key]:
            assert max(abs(a - b) for a, b in zip(rank["before"], runs["reference"]["losses"][:SAVE_AT])) < TOL
    for rank in runs[run]:
        _check_resumed(rank, runs["reference"])


def test_full_state_dict_loads_strict_into_the_unsharded_model(runs) -> None:
    first, second = (r["full_state_dict"] for r in runs["w2"])
    assert first == {"equal": True, "plain_cpu": True}
    assert second == {"empty": True}


@pytest.mark.parametrize("case, kind, names", [
    ("truncated", "CheckpointError", ["truncated or corrupted", "model."]),
    ("bit_flip", "CheckpointError", ["CRC32", "keys stored there"]),
    ("metadata", "CheckpointError", [".metadata"]),
    ("no_manifest", "CheckpointError", ["not a complete autoshard checkpoint"]),
    ("mismatch", "CheckpointError", ["missing (165): model.blocks.2.", "mismatched (4)",
                                     "model.wte.weight (checkpoint torch.float32 [64, 32], expected torch.float32 [72, 32])"]),
])
def test_bad_checkpoint_raises_naming_keys_and_changes_nothing(runs, case, kind, names) -> None:
    for rank in runs["w2"]:
        error, message, unchanged = rank["bad"][case]
        assert error == kind, message
        for name in names:
            assert name in message, message
        assert unchanged


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch) -> None:
    path = tmp_path / "ckpt"
    model = build("gpt")
    opt = _adamw(model)
    train_losses(model, opt, range(1))
    save(path, model, opt)
    saved = _snapshot(model, opt)
    train_losses(model, opt, range(1, 2))

    def loaded() -> list[torch.Tensor]:
        fresh = build("gpt", seed=1)
        fresh_opt = _adamw(fresh)
        load(path, fresh, fresh_opt)
        return _snapshot(fresh, fresh_opt)

    def crash(*args):
        raise KeyboardInterrupt("killed")

    # Killed after the new checkpoint is written, before the swap.
    monkeypatch.setattr(ckpt, "_swap", crash)
    with pytest.raises(KeyboardInterrupt):
        save(path, model, opt)
    assert _same(loaded(), saved)
    monkeypatch.undo()

    # Killed between moving the old checkpoint aside and moving the new one in.
    real_replace, calls = os.replace, []

    def replace_once(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace_once)
    with pytest.raises(KeyboardInterrupt):
        save(path, model, opt)
    monkeypatch.undo()
    assert not path.exists()
    assert _same(loaded(), saved)  # found at .ckpt.old

    save(path, model, opt)  # the next save recovers and completes
    assert _same(loaded(), _snapshot(model, opt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(ValueError, match="is not an autoshard checkpoint; not replacing it"):
        save(tmp_path, model)  # never replaces a directory that is not a checkpoint
    (tmp_path / "made_first").mkdir()  # users often mkdir first: an empty directory is fine
    save(tmp_path / "made_first", model)
    fresh = build("gpt", seed=1)
    load(tmp_path / "made_first", fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_metadata_is_unpickled_with_an_allowlist(tmp_path) -> None:
    path, marker = tmp_path / "ckpt", tmp_path / "pwned"
    model = build("gpt")
    save(path, model)
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    manifest = json.loads((path / "autoshard_manifest.json").read_text())
    manifest["files"][".metadata"] = ckpt._checksum(path / ".metadata")  # pass the checksum: reach the unpickler
    (path / "autoshard_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="builtins.exec, which is not allowed"):
        load(path, model)
    assert not marker.exists()


def test_extra_state_comes_back_and_only_plain_data_is_saved_or_read(tmp_path, monkeypatch) -> None:
    path, marker = tmp_path / "ckpt", tmp_path / "pwned"
    model = build("gpt")
    opt = _adamw(model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train_losses(model, opt, range(2))
    scheduler.step()
    scheduler.step()
    rng = torch.get_rng_state()
    save(path, model, opt, extra={"step": 2, "scheduler": scheduler.state_dict(), "rng": rng})

    fresh = build("gpt", seed=1)
    fresh_opt = _adamw(fresh)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    extra = load(path, fresh, fresh_opt)
    fresh_scheduler.load_state_dict(extra["scheduler"])
    assert extra["step"] == 2 and torch.equal(extra["rng"], rng)
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr() == [1e-3 / 4]
    save(tmp_path / "plain", fresh)
    assert load(tmp_path / "plain", fresh) == {}  # saved without extra

    # An object torch.load(weights_only=True) could not read back is refused before anything is written.
    saved = _snapshot(model, opt)
    with pytest.raises(TypeError, match=r"extra must hold only plain data and tensors .* state_dict\(\)"):
        save(path, model, opt, extra={"loader": _Exploit(marker)})
    assert _same(_snapshot(model, opt), saved) and load(path, fresh, fresh_opt)["step"] == 2

    # A checkpoint whose extra state would run code when unpickled fails to load and changes nothing.
    def malicious(extra: dict) -> bytes:
        buffer = io.BytesIO()
        torch.save(_Exploit(marker), buffer)
        return buffer.getvalue()

    monkeypatch.setattr(ckpt, "_pack", malicious)
    save(path, model, opt, extra={})
    before = _snapshot(fresh, fresh_opt)
    with pytest.raises(Exception, match="Weights only load failed"):
        load(path, fresh, fresh_opt)
    assert not marker.exists() and _same(_snapshot(fresh, fresh_opt), before)
