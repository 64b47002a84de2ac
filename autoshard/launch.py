"""Run a function on N local gloo ranks, each a fresh process, and collect what each returns.

The one launcher behind ``autoshard calibrate``, the benchmarks, the example and the tests.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def exit_without_finalization(code: int = 0) -> NoReturn:
    """End this process now, after flushing stdout and stderr, without Python's finalization.

    Call it after ``dist.destroy_process_group()``. A gloo group can outlive that call when a
    compiled graph or a mesh still references it; its worker threads then release finished
    work (whose tensors are Python objects) while the interpreter shuts down, the GIL they need
    is gone, and the process aborts with "terminate called without an active exception" after
    a successful run (seen in about 1 of 30 runs here; a core dump shows
    ``ProcessGroupGloo::runLoop`` destroying an ``AsyncAllgatherWork`` during ``Py_FinalizeEx``).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple) -> None:
    faulthandler.enable()  # a rank that crashes (SIGSEGV) prints where
    code = 1
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            result = fn(*args)
            dist.barrier()  # no rank tears down while another still talks to it
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        exit_without_finalization(code)


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float | None = 600) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks in spawned processes; return their results,
    by rank. ``fn`` and its arguments must be picklable (a module-level function).

    A rank that raises, dies or outlives ``timeout`` seconds (None: no limit) fails the caller:
    a hang is a failure.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_file, tmp, fn, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in procs:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            raise TimeoutError(f"{len(alive)} of {world_size} ranks still running after {timeout}s (a hang?)")
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise RuntimeError(f"ranks exited with codes {codes}; see their stderr above")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
