"""bench/real_summary.py: the ratios bench/real.py prints are taken within each run, then
summarised over the runs (median and range), for each of ours against each rival present."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
from real_summary import parity_lines, ratio_lines, sanity_lines  # noqa: E402


def _row(run: int, world: int, system: str, step: float, peak: float, parity: float = 0.0) -> dict:
    return {"run": run, "world": world, "system": system, "step_ms": step, "peak_mib": peak, "parity": parity}


def test_ratios_are_per_run_then_median_and_range():
    rows = [
        _row(1, 2, "autoshard", 90, 50), _row(1, 2, "simplefsdp_block", 100, 100),
        # run 2: both slower (a loaded machine): the ratio is taken within the run
        _row(2, 2, "autoshard", 160, 50), _row(2, 2, "simplefsdp_block", 200, 100),
        _row(3, 2, "autoshard", 70, 50), _row(3, 2, "simplefsdp_block", 100, 100),
    ]
    assert ratio_lines(rows, ("autoshard",), ("simplefsdp", "simplefsdp_block")) == [
        "world 2 autoshard / simplefsdp_block: step 0.80x (runs 0.70-0.90x), peak 0.50x (runs 0.50-0.50x)",
    ]


def test_one_run_prints_one_ratio_per_pair_and_world():
    rows = [_row(1, w, s, step, 10) for w in (2, 4) for s, step in (("autoshard", 50), ("autoshard_keep", 40), ("simplefsdp", 100))]
    assert ratio_lines(rows, ("autoshard", "autoshard_keep"), ("simplefsdp",)) == [
        "world 2 autoshard / simplefsdp: step 0.50x, peak 1.00x",
        "world 2 autoshard_keep / simplefsdp: step 0.40x, peak 1.00x",
        "world 4 autoshard / simplefsdp: step 0.50x, peak 1.00x",
        "world 4 autoshard_keep / simplefsdp: step 0.40x, peak 1.00x",
    ]


def test_parity_and_sanity_name_what_failed():
    rows = [_row(1, 2, "ddp", 10, 100), _row(1, 2, "autoshard", 10, 120, parity=3e-5)]
    first, by_system = parity_lines(rows, ["ddp", "autoshard"], 12)
    assert "3.0e-05" in first and "NOT within" in first and "autoshard 3.0e-05" in by_system
    assert sanity_lines(rows) == ["sanity, world 2 run 1: DDP peak 100.0 MiB does NOT exceed every sharded system's (autoshard)"]
