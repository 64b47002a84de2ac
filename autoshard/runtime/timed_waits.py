"""The timed waits under :class:`autoshard.Telemetry`: the ``autoshard::timed_wait`` op the
backend option ``telemetry`` puts before each wait of the compiled graphs
(passes/telemetry.py), the blocking collectives timed outside the graphs (the accumulation
flush), and what the running step's waits add up to. Low in the runtime, so that the flush and
the passes can use it without importing the rest of telemetry."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


class Recorder:
    """What the timed waits of the running step add up (one per process; None when off)."""

    def __init__(self, cuda: bool) -> None:
        self.wait = dict.fromkeys(KINDS, 0.0)
        self.bytes = dict.fromkeys(KINDS, 0)
        self.events: list[tuple[str, Any, Any]] = []  # CUDA: (kind, before, after), read at the step's end
        self.cuda = cuda
        self.waits = 0

    def add(self, kind: str, seconds: float, nbytes: int) -> None:
        self.wait[kind] += seconds
        self.bytes[kind] += nbytes
        self.waits += 1


recorder: Recorder | None = None  # the running step's, set by Telemetry.step


@torch.library.custom_op("autoshard::timed_wait", mutates_args=("tensor",))
def timed_wait(tensor: torch.Tensor, kind: str, nbytes: int) -> None:
    """Wait for the collective writing ``tensor`` (``kind``, moving ``nbytes``) and record how
    long the wait took in the running telemetry step, if any. Declared as writing ``tensor`` so
    that the graph's own wait (then a no-op) and every reader come after it."""
    running = recorder
    if running is None:
        torch.ops._c10d_functional.wait_tensor(tensor)
        return
    if running.cuda and tensor.is_cuda:
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        torch.ops._c10d_functional.wait_tensor(tensor)
        after.record()
        running.events.append((kind, before, after))
        running.add(kind, 0.0, nbytes)
        return
    start = time.perf_counter()
    torch.ops._c10d_functional.wait_tensor(tensor)
    running.add(kind, time.perf_counter() - start, nbytes)


@timed_wait.register_fake
def _(tensor, kind, nbytes):
    return None


@contextmanager
def timed_blocking(kind: str, nbytes: int) -> Iterator[None]:
    """Time a blocking collective run outside the graphs (the accumulation flush)."""
    running = recorder
    if running is None:
        yield
        return
    start = time.perf_counter()
    yield
    running.add(kind, time.perf_counter() - start, nbytes)
