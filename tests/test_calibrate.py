"""``python -m autoshard calibrate``: measure 2 gloo ranks once (few sizes and repeats), then
check the fitted profile against the measurements and the JSON that ``run`` writes."""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

import pytest

from autoshard.cost.cost_model import COLLECTIVE_KINDS, Link, collective_time, get_profile
from autoshard.tools.calibrate import measure as calibrate

SIZES = (16 * 2**10, 2**20, 8 * 2**20)


@pytest.fixture(scope="module")
def measured():
    measurements = calibrate.measure((2,), sizes=SIZES, repeats=3, quick=True)
    return measurements, calibrate.fit(measurements, "test")


def test_figures_positive_and_finite(measured):
    _, profile = measured
    figures = [*profile.peak_flops.values(), profile.mem_bandwidth, profile.op_overhead]
    figures += [*profile.intra.bandwidth.values()]
    assert set(profile.peak_flops) == {"float32", "bfloat16", "float16"}
    assert set(profile.intra.latency) == set(profile.intra.bandwidth) == set(COLLECTIVE_KINDS)
    assert all(math.isfinite(x) and x > 0 for x in figures), profile
    # The fit constrains latency to >= 0; on noisy, oversubscribed cores the bound can be active
    # (CI on torch 2.11 fitted one kind's latency to exactly 0).
    assert all(math.isfinite(x) and x >= 0 for x in profile.intra.latency.values()), profile
    assert 0 <= profile.comm_overlap <= 1 and 0 <= profile.launch_overhead < 1e-3
    assert 0 <= profile.comm_issue_cost < 0.1  # seconds per collective: gloo's are a fraction of a millisecond


def test_run_writes_the_profile(measured, tmp_path, monkeypatch):
    measurements, _ = measured
    calls = []

    def fake_measure(world_sizes, **kwargs):  # reuse the fixture's measurements
        calls.append((list(world_sizes), kwargs))
        return measurements

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    out = tmp_path / "cpu.json"
    assert calibrate.run(parser.parse_args(["--world-sizes", "2", "--out", str(out), "--name", "x", "--quick"])) == 0
    assert calls == [([2], {"sizes": None, "repeats": 3, "quick": True})]
    loaded = get_profile(str(out))
    assert loaded == calibrate.fit(measurements, "x")
    assert loaded.name == "x" and "world sizes 2" in loaded.source


def test_fit_recovers_the_link_that_made_the_samples(measured):
    # Measured times are too noisy here to assert a fit quality on; samples made by a known
    # link must give that link back, for every kind, with and without a latency term.
    measurements, _ = measured
    for latency in (2e-4, 0.0):
        truth = Link("truth", {k: latency for k in COLLECTIVE_KINDS}, {"all_gather": 3e9, "reduce_scatter": 2e9, "all_reduce": 5e9})
        known = replace(get_profile("cpu"), intra=truth, ranks_per_node=1024)
        samples = [
            calibrate.Sample(kind, w, nbytes, collective_time(kind, nbytes, w, known))
            for kind in COLLECTIVE_KINDS for w in (2, 4) for nbytes in SIZES
        ]
        synthetic = replace(measurements, samples=samples)
        profile = calibrate.fit(synthetic)
        link = profile.intra
        for kind in COLLECTIVE_KINDS:
            assert link.latency[kind] == pytest.approx(latency, rel=1e-6, abs=1e-12), kind
            assert link.bandwidth[kind] == pytest.approx(truth.bandwidth[kind], rel=1e-6), kind
        assert max(calibrate.fit_errors(profile, synthetic).values()) < 1e-6


def test_measured_collectives_are_fitted_per_kind(measured):
    measurements, profile = measured
    for kind in COLLECTIVE_KINDS:
        samples = [s for s in measurements.samples if s.kind == kind]
        assert sorted((s.world_size, s.nbytes) for s in samples) == [(2, n) for n in SIZES]
        times = [collective_time(kind, n, 2, profile) for n in SIZES]
        assert times == sorted(times) and times[0] < times[-1], (kind, times)


def test_matmul_size_is_chosen_on_warm_calls():
    # A cold first call (allocation, kernel selection) must not stop the search at a size
    # too small to time: that once made calibration report a quarter of the real FLOP/s.
    calls = []

    def slow_once() -> None:
        calls.append(None)
        if len(calls) == 1:
            time.sleep(0.05)

    assert calibrate._warm_seconds(slow_once) < 0.025 and len(calls) == 4
    cubic = lambda n: 1e-3 * (n / 512) ** 3  # noqa: E731  (a 512 x 512 matmul takes 1 ms)
    assert calibrate._matmul_size(cubic, 1e-3) == 512
    assert calibrate._matmul_size(cubic, 0.9e-3) == 512
    assert calibrate._matmul_size(cubic, 1.1e-3) == 1024
    assert calibrate._matmul_size(cubic, 10.0) == 2048  # capped
