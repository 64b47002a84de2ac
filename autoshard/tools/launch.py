"""Run a function on N local gloo ranks, each a fresh process, and collect what each returns.

The one launcher behind ``autoshard calibrate``, the benchmarks, the example and the tests.

Ranks start from a fork server that imported torch and autoshard once (3 s per launch of 2 ranks
and 9 s of 4 ranks with plain spawn here, 0.1 s from the server): a suite launches ranks about
150 times. The server's modules read the environment when it started, so a launch whose
environment differs from that one spawns fresh interpreters instead.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the fork server imports once for every later launch (autoshard imports torch, Dynamo and
# Inductor's compiler).
PRELOAD = ["torch", "torch.distributed", "autoshard"]
_server_environment: dict[str, str] | None = None
# Set by pytest to the running test's name: changes with every test, read by no import.
_VOLATILE = ("PYTEST_CURRENT_TEST",)


def _lasting(environment: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environment.items() if k not in _VOLATILE}


def _start_context() -> Any:
    """The fork server, preloaded, while the environment is the one it started with; spawn
    otherwise (or where there is no fork server)."""
    global _server_environment
    environment = _lasting(dict(os.environ))
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    if _server_environment is None:
        _server_environment = environment
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("forkserver" if environment == _server_environment else "spawn")


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


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple,
               environment: dict[str, str]) -> None:
    os.environ.clear()  # the caller's, not the fork server's
    os.environ.update(environment)
    # Tracebacks (and, on a crash or when the caller asks for a hang's stacks, every thread's
    # stack) go to this rank's file: the caller shows the failing rank's first.
    err = open(_err_file(out_dir, rank), "w")
    faulthandler.enable(file=err)
    faulthandler.register(signal.SIGUSR1, file=err, all_threads=True)
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
        traceback.print_exc(file=err)
    finally:
        err.flush()
        exit_without_finalization(code)


def _err_file(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.err")


def _written_at(out_dir: str, rank: int) -> float:
    try:
        return os.stat(_err_file(out_dir, rank)).st_mtime
    except FileNotFoundError:
        return float("inf")


def _report(out_dir: str, ranks: list[int], why: dict[int, str]) -> str:
    parts = []
    for r in ranks:
        try:
            with open(_err_file(out_dir, r)) as f:
                text = f.read().strip() or "(nothing printed)"
        except FileNotFoundError:
            text = "(had not started)"
        parts.append(f"--- rank {r} ({why[r]}) ---\n{text}")
    return "\n".join(parts)


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float | None = 600) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks in fresh processes; return their results,
    by rank. ``fn`` and its arguments must be picklable (a module-level function).

    A rank that raises or dies fails the caller at once: the other ranks are killed and the
    error shows the failing rank's traceback first. Ranks still running after ``timeout``
    seconds (None: no limit) fail it too, with every thread's stack: a hang is a failure.
    """
    ctx = _start_context()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        environment = dict(os.environ)
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_file, tmp, fn, args, environment)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = None if timeout is None else time.monotonic() + timeout

        def failures() -> list[int]:
            return [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]

        while not failures():
            running = [p.sentinel for p in procs if p.is_alive()]
            left = None if deadline is None else deadline - time.monotonic()
            if not running or left is not None and left <= 0:
                break
            # Until a rank exits, but look again every second: in a full suite run a rank's exit
            # went unnoticed until the deadline (a sentinel fires only when every copy of its
            # pipe is closed; a process the caller forks meanwhile may hold one).
            wait(running, 1.0 if left is None else min(left, 1.0))
        failed = failures()
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        if alive and not failed:  # a hang: ask for every thread's stack before killing
            for r in alive:
                os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(1.0)
        for r in alive:
            procs[r].kill()
        for p in procs:
            p.join()
        if failed:
            # First in time first: a peer that fails because of it writes its error later.
            failed.sort(key=lambda r: _written_at(tmp, r))
            why = {r: f"exit code {procs[r].exitcode}" for r in failed} | {r: "killed" for r in alive}
            raise RuntimeError(
                f"autoshard.tools.launch.run_ranks: rank {failed[0]} of {world_size} failed (exit code {procs[failed[0]].exitcode}); "
                f"{len(alive)} other ranks were then killed; fix the error of rank {failed[0]}, shown first:\n"
                + _report(tmp, failed + alive, why)
            )
        if alive:
            why = {r: "still running: its stacks" for r in alive}
            raise TimeoutError(f"autoshard.tools.launch.run_ranks: {len(alive)} of {world_size} ranks still running after {timeout}s "
                               "(a hang?); their stacks below show where each waits (raise timeout if it is just slow):\n"
                               + _report(tmp, alive, why))
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
