"""Measure this machine and fit a :class:`~autoshard.compiler.cost_model.DeviceProfile` to it
(``python -m autoshard calibrate``).

What is measured, on ``w`` gloo ranks spawned on this machine for each world size ``w``; each
rank runs with ``os.cpu_count() // w`` threads, as training ranks do here, so every figure is
taken under the contention training sees:

- compute, in the ranks of the first world size, all ranks at once (a barrier before each timed
  call; median over repeats, then median over ranks): matmul FLOP/s per dtype (square ``mm``,
  ``2 n^3 / t``, ``n`` doubled from 128 until a warm call takes a millisecond), memory bandwidth
  (``torch.add(a, b, out=c)`` on 64 MiB tensors: input + output bytes / t, the bytes
  :func:`~autoshard.compiler.cost_model.node_time` counts) and launch overhead (``torch.add`` on
  1-element tensors, per call);
- collectives, at every world size: the functional ``all_gather_into_tensor``,
  ``reduce_scatter_tensor`` (as the graphs run it over gloo: ``all_to_all_single``, then a mean
  over the ranks) and ``all_reduce`` compiled graphs run (issue, then ``wait_tensor``)
  of float32 over a sweep of sizes, in cost_model's full-buffer convention
  (gathered output / pre-reduce input / buffer); a barrier before each timed call, median over
  repeats, max over ranks (a collective ends when its slowest rank does).

How it is fitted: per collective kind, one latency (per ring step) and one bus bandwidth, by
least squares over all sizes and world sizes of that kind on the single-node formula of
:func:`~autoshard.compiler.cost_model.collective_time`, ``t = m * ((n-1) * latency + (n-1)/n * nbytes /
bandwidth)`` (m = 2 for all_reduce, else 1). Residuals are relative (each row divided by its
measured time), so 4 KiB and 16 MiB collectives weigh alike; the fit is non-negative
(latency >= 0, 1/bandwidth >= 1e-15). :func:`fit_report` compares the fit with the measurements.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, replace
from datetime import date
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from tabulate import tabulate

from autoshard._compat import all_gather_single, c10d
from autoshard.compiler.cost_model import (
    COLLECTIVE_KINDS,
    GLOO_INPUT_COPIED,
    GLOO_WORKSPACE,
    DeviceProfile,
    Link,
    collective_time,
)
from autoshard.tools.launch import run_ranks

DEFAULT_SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB
QUICK_SIZES = tuple(4096 * 16**i for i in range(4))  # 4 KiB, 64 KiB, 1 MiB, 16 MiB
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = tuple(str(dt).removeprefix("torch.") for dt in MATMUL_DTYPES)
_MIN_INV_BANDWIDTH = 1e-15  # 1/bandwidth's floor: bandwidth stays finite (<= 1e15 B/s)


@dataclass(frozen=True)
class Sample:
    """One collective measurement: ``seconds`` for ``kind`` over ``nbytes`` (full buffer) on
    ``world_size`` ranks (median over repeats, max over ranks)."""

    kind: str
    world_size: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Measurements:
    """What :func:`measure` found; :func:`fit` turns it into a profile."""

    peak_flops: dict[str, float]  # FLOP/s per dtype name
    mem_bandwidth: float  # bytes/s
    launch_overhead: float  # seconds
    op_overhead: float  # seconds
    comm_overlap: float  # share of a collective's time compute keeps running at full speed
    comm_issue_cost: float  # seconds of compute each collective costs besides (DeviceProfile.comm_issue_cost)
    samples: list[Sample]
    threads: dict[int, int]  # world size -> threads per rank


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
        raise ValueError(f"autoshard calibrate: world sizes must be >= 2 (a collective needs two ranks), got {list(world_sizes)}; "
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
    return Measurements(
        peak_flops={name: compute[name] for name in _DTYPE_NAMES},
        mem_bandwidth=compute["mem_bandwidth"],
        launch_overhead=compute["launch_overhead"],
        op_overhead=compute["op_overhead"],
        comm_overlap=compute["comm_overlap"],
        comm_issue_cost=compute["comm_issue_cost"],
        samples=samples,
        threads={w: _threads(w) for w in world_sizes},
    )


def with_compute(profile: DeviceProfile, figures: dict[str, float], name: str) -> DeviceProfile:
    """``profile`` with the compute figures of :func:`compute_figures` instead of its own; its
    links (collective latencies and bandwidths) unchanged."""
    return replace(
        profile,
        name=name,
        peak_flops={dtype: figures[dtype] for dtype in _DTYPE_NAMES},
        mem_bandwidth=figures["mem_bandwidth"],
        launch_overhead=figures["launch_overhead"],
        op_overhead=figures["op_overhead"],
        comm_overlap=figures["comm_overlap"],
        comm_issue_cost=figures["comm_issue_cost"],
    )


def _fit_link(samples: Sequence[Sample]) -> tuple[float, float]:
    """(latency, bandwidth) minimising the relative squared error of the ring formula."""
    # t = latency * x1 + (1/bandwidth) * x2; divided by t, every row's target is 1.
    rows = []
    for s in samples:
        m = 2 if s.kind == "all_reduce" else 1
        n = s.world_size
        rows.append((m * (n - 1) / s.seconds, m * (n - 1) / n * s.nbytes / s.seconds))
    s11 = sum(x1 * x1 for x1, _ in rows)
    s12 = sum(x1 * x2 for x1, x2 in rows)
    s22 = sum(x2 * x2 for _, x2 in rows)
    r1, r2 = sum(x1 for x1, _ in rows), sum(x2 for _, x2 in rows)

    def residual(ab: tuple[float, float]) -> float:
        return sum((ab[0] * x1 + ab[1] * x2 - 1) ** 2 for x1, x2 in rows)

    # Non-negative least squares in two unknowns: the unconstrained optimum if it is feasible,
    # else the better of the two boundary optima.
    candidates = [(0.0, max(r2 / s22, _MIN_INV_BANDWIDTH)), (max(r1 / s11, 0.0), _MIN_INV_BANDWIDTH)]
    det = s11 * s22 - s12 * s12
    if det > 0:
        a, b = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
        if a >= 0 and b >= _MIN_INV_BANDWIDTH:
            candidates.append((a, b))
    latency, inv_bandwidth = min(candidates, key=residual)
    return latency, 1 / inv_bandwidth


def fit(measurements: Measurements, name: str = "calibrated") -> DeviceProfile:
    """The profile whose figures are the measured ones and whose intra link fits the collectives."""
    latency, bandwidth = {}, {}
    for kind in COLLECTIVE_KINDS:
        latency[kind], bandwidth[kind] = _fit_link([s for s in measurements.samples if s.kind == kind])
    worlds = list(measurements.threads)
    return DeviceProfile(
        name=name,
        peak_flops=dict(measurements.peak_flops),
        mem_bandwidth=measurements.mem_bandwidth,
        launch_overhead=measurements.launch_overhead,
        op_overhead=measurements.op_overhead,
        comm_overlap=measurements.comm_overlap,
        comm_issue_cost=measurements.comm_issue_cost,
        ranks_per_node=1024,  # every rank is on this one machine
        intra=Link("gloo-loopback", latency, bandwidth),
        inter=None,
        comm_workspace=dict(GLOO_WORKSPACE),  # calibration runs gloo
        comm_input_copied=GLOO_INPUT_COPIED,
        fsdp2_blocking=True,  # gloo: FSDP2 eager's collectives block
        source=(
            f"measured by python -m autoshard calibrate on {socket.gethostname()}, {date.today().isoformat()}, "
            f"torch {torch.__version__}, world sizes {', '.join(map(str, worlds))}, "
            f"threads per rank {', '.join(str(measurements.threads[w]) for w in worlds)}"
        ),
    )


def _relative_error(profile: DeviceProfile, s: Sample) -> float:
    return collective_time(s.kind, s.nbytes, s.world_size, profile) / s.seconds - 1


def fit_errors(profile: DeviceProfile, measurements: Measurements) -> dict[str, float]:
    """Median |predicted / measured - 1| per collective kind."""
    return {
        kind: statistics.median(abs(_relative_error(profile, s)) for s in measurements.samples if s.kind == kind)
        for kind in COLLECTIVE_KINDS
    }


def _kib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def fit_report(profile: DeviceProfile, measurements: Measurements) -> str:
    """Tables: the fitted link, then measured vs predicted time per (kind, world size, size)."""
    errors = fit_errors(profile, measurements)
    link = [
        (kind, f"{profile.intra.latency[kind] * 1e6:.1f}", f"{profile.intra.bandwidth[kind] / 1e9:.3f}", f"{errors[kind]:.1%}")
        for kind in COLLECTIVE_KINDS
    ]
    rows = [
        (s.kind, s.world_size, _kib(s.nbytes), f"{s.seconds * 1e6:.0f}",
         f"{collective_time(s.kind, s.nbytes, s.world_size, profile) * 1e6:.0f}", f"{_relative_error(profile, s):+.0%}")
        for s in measurements.samples
    ]
    compute = (
        f"matmul GFLOP/s: {', '.join(f'{k} {v / 1e9:.3g}' for k, v in profile.peak_flops.items())}; "
        f"memory {profile.mem_bandwidth / 1e9:.3g} GB/s; launch overhead {profile.launch_overhead * 1e6:.3g} us, "
        f"op overhead {profile.op_overhead * 1e6:.3g} us, comm overlap {profile.comm_overlap:.2f}, "
        f"comm issue cost {profile.comm_issue_cost * 1e6:.3g} us"
    )
    return "\n\n".join([
        compute,
        tabulate(link, headers=["kind", "latency/step (us)", "busbw (GB/s)", "median |error|"]),
        tabulate(rows, headers=["kind", "ranks", "bytes", "measured (us)", "predicted (us)", "error"]),
    ])


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
