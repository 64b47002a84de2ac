"""Fitting a :class:`~autoshard.cost.cost_model.DeviceProfile` to what
:mod:`autoshard.tools.calibrate.measure` measured, and reporting how well it fits; no measuring here,
so this half runs (and is tested) on synthetic samples alone.

How it is fitted: per collective kind, one latency (per ring step) and one bus bandwidth, by
least squares over all sizes and world sizes of that kind on the single-node formula of
:func:`~autoshard.cost.cost_model.collective_time`, ``t = m * ((n-1) * latency + (n-1)/n * nbytes /
bandwidth)`` (m = 2 for all_reduce, else 1). Residuals are relative (each row divided by its
measured time), so 4 KiB and 16 MiB collectives weigh alike; the fit is non-negative
(latency >= 0, 1/bandwidth >= 1e-15). :func:`fit_report` compares the fit with the measurements.
"""
from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass
from datetime import date
from typing import Sequence

import torch
from tabulate import tabulate

from autoshard.cost.cost_model import (
    COLLECTIVE_KINDS,
    GLOO_INPUT_COPIED,
    GLOO_WORKSPACE,
    DeviceProfile,
    Link,
    collective_time,
)

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
    """What :func:`autoshard.tools.calibrate.measure.measure` found; :func:`fit` turns it into a profile."""

    peak_flops: dict[str, float]  # FLOP/s per dtype name
    mem_bandwidth: float  # bytes/s
    launch_overhead: float  # seconds
    op_overhead: float  # seconds
    comm_overlap: float  # share of a collective's time compute keeps running at full speed
    comm_issue_cost: float  # seconds of compute each collective costs besides (DeviceProfile.comm_issue_cost)
    samples: list[Sample]
    threads: dict[int, int]  # world size -> threads per rank


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
