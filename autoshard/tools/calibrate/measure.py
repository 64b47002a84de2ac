"""Measure this machine and fit a :class:`~autoshard.cost.cost_model.DeviceProfile` to it
(``python -m autoshard calibrate``).

What is measured, on ``w`` gloo ranks spawned on this machine for each world size ``w``; each
rank runs with ``os.cpu_count() // w`` threads, as training ranks do here, so every figure is
taken under the contention training sees:

- compute, in the ranks of the first world size, all ranks at once (a barrier before each timed
  call; median over repeats, then median over ranks): matmul FLOP/s per dtype (square ``mm``,
  ``2 n^3 / t``, ``n`` doubled from 128 until a warm call takes a millisecond), memory bandwidth
  (``torch.add(a, b, out=c)`` on 64 MiB tensors: input + output bytes / t, the bytes
  :func:`~autoshard.cost.cost_model.node_time` counts) and launch overhead (``torch.add`` on
  1-element tensors, per call);
- collectives, at every world size: the functional ``all_gather_into_tensor``,
  ``reduce_scatter_tensor`` (as the graphs run it over gloo: ``all_to_all_single``, then a mean
  over the ranks) and ``all_reduce`` compiled graphs run (issue, then ``wait_tensor``)
  of float32 over a sweep of sizes, in cost_model's full-buffer convention
  (gathered output / pre-reduce input / buffer); a barrier before each timed call, median over
  repeats, max over ranks (a collective ends when its slowest rank does).

How it is fitted: see :mod:`autoshard.tools.calibrate.fit` (:func:`fit`, :func:`fit_report`),
whose names this module re-exports.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autoshard._compat import all_gather_single, c10d
from autoshard.cost.cost_model import COLLECTIVE_KINDS, DeviceProfile
from autoshard.runtime.errors import UsageError
from autoshard.tools.calibrate.fit import Measurements, Sample, fit, fit_errors, fit_report
from autoshard.tools.launch import run_ranks

__all__ = ["Measurements", "Sample", "add_arguments", "calibrate", "compute_figures", "fit", "fit_errors", "fit_report",
           "measure", "run", "with_compute"]

DEFAULT_SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB
QUICK_SIZES = tuple(4096 * 16**i for i in range(4))  # 4 KiB, 64 KiB, 1 MiB, 16 MiB
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = tuple(str(dt).removeprefix("torch.") for dt in MATMUL_DTYPES)


def _threads(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of ``fn()`` after one warm-up call, ``repeats`` times, all ranks starting together."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _warm_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Fastest of ``repeats`` timed calls of ``fn`` after an untimed one: the first call at a
    new shape pays allocation and kernel selection, which would make a small size look slow."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _matmul_size(seconds_at: Callable[[int], float], min_seconds: float, largest: int = 2048) -> int:
    """The smallest ``n`` in 128, 256, ... ``largest`` whose ``n x n`` matmul takes ``min_seconds``."""
    n = 128
    while n < largest and seconds_at(n) < min_seconds:
        n *= 2
    return n


def _matmul_flops(dtype: torch.dtype, repeats: int, min_seconds: float) -> float:
    def seconds_at(n: int) -> float:
        a = torch.randn(n, n, dtype=dtype)
        return _warm_seconds(lambda: torch.mm(a, a))

    # Each rank picks its size without collectives (ranks may stop at different n); all then
    # agree on the largest and time it together.
    agreed = torch.tensor([_matmul_size(seconds_at, min_seconds)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    n = int(agreed)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / statistics.median(_timed(lambda: torch.mm(a, b), repeats))


# The compute figures besides the matmul peaks: fields of both DeviceProfile and Measurements.
_SCALAR_FIGURES = ("mem_bandwidth", "launch_overhead", "op_overhead", "comm_overlap", "comm_issue_cost")


def _figure_fields(figures: dict[str, float]) -> dict[str, Any]:
    """:func:`compute_figures`' figures as the fields of a profile (or of :class:`Measurements`)."""
    return {"peak_flops": {dtype: figures[dtype] for dtype in _DTYPE_NAMES}, **{key: figures[key] for key in _SCALAR_FIGURES}}


def compute_figures(repeats: int) -> dict[str, float]:
    """This rank's compute figures, measured as the module docstring says; every rank of the
    default group must call it together. Keys: the dtype names of MATMUL_DTYPES (FLOP/s),
    ``mem_bandwidth``, ``op_overhead``, ``launch_overhead``, ``comm_overlap``, ``comm_issue_cost``."""
    # Matmuls of about a millisecond, the size of a small model's layers: big ones run faster.
    figures = {name: _matmul_flops(dt, repeats, 0.001) for name, dt in zip(_DTYPE_NAMES, MATMUL_DTYPES)}
    a, b, c = (torch.ones(16 * 2**20) for _ in range(3))  # 64 MiB each, well past the caches
    figures["mem_bandwidth"] = 3 * a.nbytes / statistics.median(_timed(lambda: torch.add(a, b, out=c), repeats))
    # Overheads as aot_eager graphs pay them: ATen overloads called one by one from Python.
    # A view is the call alone; a tiny add adds the kernel launch.
    x, calls = torch.ones(1), 200

    def calls_of(op: Callable, *args: Any) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                op(*args)

        return run

    figures["op_overhead"] = statistics.median(_timed(calls_of(torch.ops.aten.view.default, x, [1]), repeats)) / calls
    add = statistics.median(_timed(calls_of(torch.ops.aten.add.Tensor, x, x), repeats)) / calls
    figures["launch_overhead"] = max(0.0, add - figures["op_overhead"])
    figures["comm_overlap"] = _comm_overlap(repeats)
    figures["comm_issue_cost"] = _comm_issue_cost(repeats, figures["comm_overlap"])
    return figures


def _comm_overlap(repeats: int) -> float:
    """How much of an all-gather hides behind matmuls issued after it: 1 if running both takes
    as long as the longer alone, 0 if as long as both in turn (they share the cores)."""
    w = dist.get_world_size()
    full, shard = torch.ones(_numel(4 * 2**20, w)), torch.ones(_numel(4 * 2**20, w) // w)
    a = torch.randn(256, 256)

    def matmuls() -> None:
        for _ in range(20):
            torch.mm(a, a)

    def both() -> None:
        work = all_gather_single(full, shard, async_op=True)
        matmuls()
        work.wait()

    t_mm = statistics.median(_timed(matmuls, repeats))
    t_comm = statistics.median(_timed(lambda: all_gather_single(full, shard), repeats))
    t_both = statistics.median(_timed(both, repeats))
    return min(1.0, max(0.0, (t_mm + t_comm - t_both) / min(t_mm, t_comm)))


def _comm_issue_cost(repeats: int, overlap: float) -> float:
    """What a tiny all-gather hidden behind ~1 ms of matmuls adds to their time, less the
    ``1 - overlap`` share of its own latency that :data:`comm_overlap` already counts."""
    w, group, n = dist.get_world_size(), dist.group.WORLD.group_name, 20
    shard, a = torch.ones(16), torch.randn(256, 256)

    def chunk() -> None:
        for _ in range(3):
            torch.mm(a, a)

    def hidden() -> None:
        for _ in range(n):
            gathered = c10d.all_gather_into_tensor(shard, w, group)
            chunk()
            c10d.wait_tensor(gathered)

    def alone() -> None:
        for _ in range(n):
            c10d.wait_tensor(c10d.all_gather_into_tensor(shard, w, group))

    t_mm = statistics.median(_timed(lambda: [chunk() for _ in range(n)], repeats))
    extra = (statistics.median(_timed(hidden, repeats)) - t_mm) / n
    latency = statistics.median(_timed(alone, repeats)) / n
    return max(0.0, extra - (1 - overlap) * latency)


def _numel(nbytes: int, world_size: int) -> int:
    """float32 elements of a full buffer of about ``nbytes``, divisible by the world size."""
    return max(1, nbytes // 4 // world_size) * world_size


def _collective_times(sizes: Sequence[int], repeats: int) -> dict[tuple[str, int], list[float]]:
    w = dist.get_world_size()
    times = {}
    for nbytes in sizes:
        numel = _numel(nbytes, w)
        full, shard = torch.ones(numel), torch.ones(numel // w)
        rows = [numel // w] * w
        group = dist.group.WORLD.group_name
        # The functional collectives compiled graphs run (issue, then wait_tensor), not the
        # blocking API: their overheads are part of what a graph pays.
        calls = {
            "all_gather": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(shard, w, group)),
            # Over gloo the graphs run a reduce-scatter as an all-to-all and a mean (passes/gloo.py).
            "reduce_scatter": lambda: c10d.wait_tensor(c10d.all_to_all_single(full, rows, rows, group)).view(w, -1).mean(0),
            "all_reduce": lambda: c10d.wait_tensor(c10d.all_reduce(full, "avg", group)),
        }
        for kind in COLLECTIVE_KINDS:
            times[kind, full.nbytes] = _timed(calls[kind], repeats)
    return times


def _rank_work(sizes: Sequence[int], repeats: int, compute: bool) -> dict[str, Any]:
    torch.set_num_threads(_threads(dist.get_world_size()))
    with torch.no_grad():
        figures = compute_figures(repeats) if compute else {}
        return {"compute": figures, "collectives": _collective_times(sizes, repeats)}


def measure(
    world_sizes: Sequence[int] = (2, 4), *, sizes: Sequence[int] | None = None, repeats: int = 5, quick: bool = False
) -> Measurements:
    """Run the measurements described in the module docstring."""
    if not world_sizes or any(w < 2 for w in world_sizes):
        raise UsageError(f"autoshard calibrate: world sizes must be >= 2 (a collective needs two ranks), got {list(world_sizes)}; "
                         "pass e.g. --world-sizes 2 4")
    sizes = tuple(sizes or (QUICK_SIZES if quick else DEFAULT_SIZES))
    samples: list[Sample] = []
    compute: dict[str, float] = {}
    for i, w in enumerate(world_sizes):
        results = run_ranks(w, _rank_work, sizes, repeats, i == 0, timeout=900)
        if i == 0:
            compute = {key: statistics.median(r["compute"][key] for r in results) for key in results[0]["compute"]}
        for kind, nbytes in results[0]["collectives"]:
            seconds = max(statistics.median(r["collectives"][kind, nbytes]) for r in results)
            samples.append(Sample(kind, w, nbytes, seconds))
    return Measurements(**_figure_fields(compute), samples=samples, threads={w: _threads(w) for w in world_sizes})


def with_compute(profile: DeviceProfile, figures: dict[str, float], name: str) -> DeviceProfile:
    """``profile`` with the compute figures of :func:`compute_figures` instead of its own; its
    links (collective latencies and bandwidths) unchanged."""
    return replace(profile, name=name, **_figure_fields(figures))


def calibrate(
    world_sizes: Sequence[int] = (2, 4),
    *,
    sizes: Sequence[int] | None = None,
    repeats: int = 5,
    name: str = "calibrated",
    quick: bool = False,
) -> DeviceProfile:
    """Measure this machine (see the module docstring) and return the fitted profile; the fit
    report goes to stderr."""
    measurements = measure(world_sizes, sizes=sizes, repeats=repeats, quick=quick)
    profile = fit(measurements, name)
    print(fit_report(profile, measurements), file=sys.stderr)
    return profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], metavar="N",
                        help="gloo world sizes to time the collectives at; compute is timed at the first (default: 2 4)")
    parser.add_argument("--out", default="profile.json",
                        help="where to write the profile; a .json name lets --profile / get_profile read it (default: profile.json)")
    parser.add_argument("--name", default="calibrated", help="the profile's name (default: calibrated)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default: 5; 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats: a rough profile fast")


def run(args: argparse.Namespace) -> int:
    """Calibrate with the parsed ``args`` and write the profile's JSON to ``args.out``."""
    repeats = args.repeats or (3 if args.quick else 5)
    profile = calibrate(args.world_sizes, repeats=repeats, name=args.name, quick=args.quick)
    with open(args.out, "w") as f:
        f.write(profile.to_json())
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
