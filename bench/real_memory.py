"""How bench/real.py measures a system's memory: what a rank keeps between steps, and the highest
rise of allocated CPU bytes during one profiled step."""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

MEMORY_METHOD = (
    "peak = persistent state at step start (parameters + gradients + optimizer state: bytes of the local "
    "tensors; + DDP's gradient buckets) + highest rise of allocated CPU bytes during a steady-state step "
    "(running sum of torch.profiler '[memory]' alloc/free events, profile_memory=True, all threads, time "
    "order; the second of two profiled steps)"
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor shards: count this rank's part


def state_bytes(model, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank keeps between steps: parameters, gradients, optimizer state (and DDP's buckets)."""
    params = list(module.parameters())
    total = sum(_local(p).nbytes for p in params)
    if hasattr(model, "_get_ddp_logging_data"):
        # DDP's reducer keeps flat gradient buckets (one more full copy of the gradients, allocated
        # at construction) that no parameter points to; the sizes come from its (private) logging data.
        total += sum(int(b) for b in model._get_ddp_logging_data()["bucket_sizes"].split(",") if b)
    total += sum(_local(p.grad).nbytes for p in params if p.grad is not None)
    total += sum(_local(t).nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    return total


def peak_rise(prof: profile, window: str) -> int:
    """Highest allocated bytes during the ``window`` record_function, above its start.

    Kineto's "[memory]" events carry the signed size of every allocation (+) and free (-);
    their running sum in time order (all threads) is the allocated bytes, relative to when the
    profiler started. (FunctionEvent.cpu_memory_usage counts nested ops' allocations twice.)
    """
    events = list(prof.profiler.kineto_results.events())
    (start, end) = next((e.start_ns(), e.end_ns()) for e in events if e.name() == window)
    memory = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU), key=lambda e: e.start_ns())
    live = peak = base = 0
    for e in memory:
        if e.start_ns() > end:
            break
        if e.start_ns() < start:
            base = live = live + e.nbytes()
        else:
            live += e.nbytes()
            peak = max(peak, live - base)
    return peak


def profiled_peak(step: Callable[[], object], persistent: int) -> int:
    """``persistent`` plus the highest rise of allocated bytes during a steady-state ``step()``.
    Two steps, the second measured: the profiler drops frees of blocks allocated before it
    started (torch warns of "a block of unknown size"), so buffers one step hands to the next
    are only seen this way. Separate from timed steps: the profiler slows the steps it watches."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        with record_function("measured_step"):
            step()
    return persistent + peak_rise(prof, "measured_step")
