"""A rank that fails makes its peers fail within seconds, never wait out a collective timeout:
in ``autoshard.save`` / ``load`` (the failing rank closes the operation's own group) and in
the compile-time plan exchange (it records its error where the peers wait)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import autoshard
import autoshard.compiler.pipeline as pipeline
import autoshard.runtime.checkpoint as ckpt
from autoshard.tools.launch import run_ranks

from models import batch, build

pytestmark = pytest.mark.multirank

FAST = 30.0  # seconds: far below any collective timeout (gloo's default: 30 minutes)


def _timed(fn) -> tuple[str, float]:
    """(``ExceptionType: message`` or "ok", seconds until fn returned or raised)."""
    start = time.monotonic()
    try:
        fn()
        return "ok", time.monotonic() - start
    except BaseException as e:  # noqa: BLE001 - the test inspects whatever was raised
        return f"{type(e).__name__}: {e}", time.monotonic() - start


def _failures(folder: str) -> dict[str, tuple[str, float]]:
    rank = dist.get_rank()
    model = autoshard.shard(build("mlp"))
    out = {}

    # The bug users met: numpy missing on the coordinator, inside DCP's gather_object.
    numpy = torch.Tensor.numpy
    if rank == 0:
        def no_numpy(self, *args, **kwargs):
            raise RuntimeError("Numpy is not available")
        torch.Tensor.numpy = no_numpy
    try:
        out["save"] = _timed(lambda: autoshard.save(f"{folder}/a", model))
    finally:
        torch.Tensor.numpy = numpy

    autoshard.save(f"{folder}/b", model)  # both ranks can save again: nothing was left broken
    read = ckpt._read_checked
    if rank == 1:
        def unreadable(path):
            raise OSError("disk went away")
        ckpt._read_checked = unreadable
    try:
        out["load"] = _timed(lambda: autoshard.load(f"{folder}/b", model))
    finally:
        ckpt._read_checked = read

    # A compile step that raises on rank 1 only, before the plan exchange.
    merge = pipeline.merge_shared_parameters  # the pipeline looks passes up when it runs them
    if rank == 1:
        def broken(joint):
            raise RuntimeError("a pass failed on this rank")
        pipeline.merge_shared_parameters = broken
    compiled = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"})
    x, y = batch("mlp", 0)
    try:
        out["compile"] = _timed(lambda: compiled(x, y).backward())
    finally:
        pipeline.merge_shared_parameters = merge

    ones = torch.ones(1)
    dist.all_reduce(ones)  # the user's own group is untouched
    out["group"] = (str(ones.item()), 0.0)
    return out


def test_a_rank_that_fails_fails_every_rank_within_seconds(tmp_path) -> None:
    r0, r1 = run_ranks(2, _failures, str(tmp_path), timeout=300)
    # save: rank 0 raises its own error; rank 1, blocked in a DCP collective, names rank 0's.
    assert r0["save"][0] == "RuntimeError: Numpy is not available"
    assert r1["save"][0].startswith("RankFailedError: autoshard.save: failed on rank 0: RuntimeError: Numpy is not available")
    # load: rank 1's own error; rank 0 names it.
    assert r1["load"][0] == "OSError: disk went away"
    assert r0["load"][0].startswith("RankFailedError: autoshard.load: failed on rank 1: OSError: disk went away")
    # compile: rank 0 stops waiting for rank 1's plan.
    assert "a pass failed on this rank" in r1["compile"][0]
    assert "rank 1 failed compiling (RuntimeError: a pass failed on this rank)" in r0["compile"][0]
    for what in ("save", "load", "compile"):
        assert r0[what][1] < FAST and r1[what][1] < FAST, (what, r0[what], r1[what])
    assert r0["group"][0] == r1["group"][0] == "2.0"
