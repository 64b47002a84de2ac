"""bench/real_summary.py: the ratios bench/real.py prints are taken within each run, then
summarised over the runs (median and range), for each of ours against each rival present."""
from __future__ import annotations

from real_summary import parity_lines, ratio_lines, sanity_lines, verdict_lines


def _row(run: int, world: int, system: str, step: float, peak: float, parity: float = 0.0) -> dict:
    return {"run": run, "world": world, "system": system, "step_ms": step, "peak_mib": peak, "parity": parity}


def test_ratios_are_per_run_then_median_and_range():
    rows = [
        _row(1, 2, "autoshard", 90, 50), _row(1, 2, "simplefsdp_block", 100, 100),
        # run 2: both slower (a loaded machine): the ratio is taken within the run
        _row(2, 2, "autoshard", 160, 50), _row(2, 2, "simplefsdp_block", 200, 100),
        _row(3, 2, "autoshard", 70, 50), _row(3, 2, "simplefsdp_block", 100, 100),
    ]
    assert ratio_lines(rows, [("autoshard", "simplefsdp"), ("autoshard", "simplefsdp_block")]) == [
        "world 2 autoshard / simplefsdp_block: step 0.80x (runs 0.70-0.90x), peak 0.50x (runs 0.50-0.50x)",
    ]


def test_one_run_prints_one_ratio_per_pair_and_world():
    rows = [_row(1, w, s, step, 10) for w in (2, 4) for s, step in (("autoshard", 50), ("autoshard_keep", 40), ("simplefsdp", 100))]
    assert ratio_lines(rows, [("autoshard", "simplefsdp"), ("autoshard_keep", "simplefsdp")]) == [
        "world 2 autoshard / simplefsdp: step 0.50x, peak 1.00x",
        "world 2 autoshard_keep / simplefsdp: step 0.40x, peak 1.00x",
        "world 4 autoshard / simplefsdp: step 0.50x, peak 1.00x",
        "world 4 autoshard_keep / simplefsdp: step 0.40x, peak 1.00x",
    ]


def test_parity_and_sanity_name_what_failed():
    rows = [_row(1, 2, "ddp", 10, 100), _row(1, 2, "autoshard", 10, 120, parity=3e-5)]
    first, by_system = parity_lines(rows, ["ddp", "autoshard"], 12)
    assert "3.0e-05" in first and "NOT within" in first and "autoshard 3.0e-05" in by_system
    assert sanity_lines(rows) == ["sanity, world 2 run 1: DDP peak 100.0 MiB does NOT exceed autoshard 120.0 MiB"]


def test_the_verdict_names_each_simplefsdp_row_no_autoshard_row_beats():
    rows = [
        # block: at its own memory 0.85x and 0.95x, median 0.90x: met; at the lowest memory 1.00x
        _row(1, 2, "autoshard_iso_block", 85, 90), _row(1, 2, "simplefsdp_block", 100, 100),
        _row(2, 2, "autoshard_iso_block", 95, 90), _row(2, 2, "simplefsdp_block", 100, 100),
        _row(1, 2, "autoshard_iso", 100, 80), _row(2, 2, "autoshard_iso", 100, 80),
        # auto: 0.95x at its memory, 0.96x at the lowest: missed, named with the better of the two
        _row(1, 2, "autoshard_iso_auto", 95, 90), _row(1, 2, "simplefsdp_auto", 100, 100),
        _row(2, 2, "autoshard_iso_auto", 95, 90), _row(2, 2, "simplefsdp_auto", 100, 100),
    ]
    pairs = [("autoshard_iso", "simplefsdp_block"), ("autoshard_iso_block", "simplefsdp_block"),
             ("autoshard_iso_auto", "simplefsdp_auto")]
    (line,) = verdict_lines(rows, pairs)
    assert "NOT on world 2 simplefsdp_auto (best: autoshard_iso_auto, step 0.95x, peak 0.90x)" in line
    assert "simplefsdp_block" not in line and "(2 rows)" in line
    (line,) = verdict_lines([r for r in rows if not r["system"].endswith("_auto")], pairs)
    assert line.endswith(": every row (1 rows)")
    # A row whose peak is above its rival's misses whatever its step.
    (line,) = verdict_lines([_row(1, 4, "autoshard_iso_block", 50, 101), _row(1, 4, "simplefsdp_block", 100, 100)], pairs)
    assert "NOT on world 4 simplefsdp_block" in line and "peak 1.01x" in line


def test_sanity_names_the_systems_above_ddp():
    rows = [_row(1, 2, "ddp", 10, 100), _row(1, 2, "autoshard", 10, 80), _row(1, 2, "simplefsdp_auto", 10, 101)]
    assert sanity_lines(rows) == ["sanity, world 2 run 1: DDP peak 100.0 MiB does NOT exceed simplefsdp_auto 101.0 MiB"]
