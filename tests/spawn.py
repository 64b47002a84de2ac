"""Run a function on N gloo ranks in fresh processes and collect what each returns."""
from __future__ import annotations

import faulthandler
import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple) -> None:
    faulthandler.enable()  # a rank that crashes (SIGSEGV) prints where
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 600) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results.

    A rank that raises, dies or outlives ``timeout`` fails the caller: a hang is a failure.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(r, world_size, init_file, tmp, fn, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            raise TimeoutError(f"{len(alive)} of {world_size} ranks still running after {timeout}s (hang?)")
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise RuntimeError(f"ranks exited with codes {codes}; see their stderr above")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
