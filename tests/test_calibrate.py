"""``python -m autoshard calibrate``: measure 2 gloo ranks once (few sizes and repeats), then
check the fitted profile against the measurements and the JSON that ``run`` writes."""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import pytest
import torch
from torch import fx

from autoshard import calibrate
from autoshard.cost_model import COLLECTIVE_KINDS, collective_time, get_profile, node_time

SIZES = (16 * 2**10, 2**20, 8 * 2**20)


@pytest.fixture(scope="module")
def measured():
    measurements = calibrate.measure((2,), sizes=SIZES, repeats=3, quick=True)
    return measurements, calibrate.fit(measurements, "test")


def test_figures_positive_and_finite(measured):
    _, profile = measured
    figures = [*profile.peak_flops.values(), profile.mem_bandwidth, profile.op_overhead]
    figures += [*profile.intra.latency.values(), *profile.intra.bandwidth.values()]
    assert set(profile.peak_flops) == {"float32", "bfloat16", "float16"}
    assert set(profile.intra.latency) == set(profile.intra.bandwidth) == set(COLLECTIVE_KINDS)
    assert all(math.isfinite(x) and x > 0 for x in figures), profile
    assert 0 <= profile.comm_overlap <= 1 and 0 <= profile.launch_overhead < 1e-3


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


def test_collective_time_matches_measurements(measured):
    measurements, profile = measured
    for kind in COLLECTIVE_KINDS:
        samples = sorted((s for s in measurements.samples if s.kind == kind), key=lambda s: s.nbytes)
        assert [s.world_size for s in samples] == [2] * len(SIZES)
        largest = samples[-1]
        predicted = collective_time(kind, largest.nbytes, 2, profile)
        assert 0.5 <= predicted / largest.seconds <= 2, (kind, predicted, largest)
        times = [collective_time(kind, s.nbytes, 2, profile) for s in samples]
        assert times == sorted(times) and times[0] < times[-1], (kind, times)


def _mm_node(m: int, k: int, n: int) -> fx.Node:
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    a.meta["val"] = torch.empty(m, k, device="meta")
    b.meta["val"] = torch.empty(k, n, device="meta")
    node = graph.call_function(torch.ops.aten.mm.default, (a, b))
    node.meta["val"] = torch.empty(m, n, device="meta")
    return node


def test_matmul_node_time_matches_a_measured_matmul(measured):
    _, profile = measured
    m, k, n = 384, 512, 640  # not the calibration's square shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() // 2))  # as a rank of world size 2
    try:
        torch.mm(a, b)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    predicted, actual = node_time(_mm_node(m, k, n), profile), statistics.median(times)
    assert actual / 3 <= predicted <= actual * 3, (predicted, actual)
