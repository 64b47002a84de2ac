"""What ``bench/real.py`` prints: its rows (:func:`rows_of`), and under its table parity, the
prediction's error, and the step and peak ratios of autoshard against SimpleFSDP.

With ``--repeat N`` each world runs N times (fresh ranks each time). On 2 shared cores one
run's step ratio moves by 10-30% from the next (which rank gets which core, where gloo's
threads land); the summary gives each ratio's median over the runs and its range, so a
ratio is read with its spread, not from one draw.
"""
from __future__ import annotations

import statistics

PARITY_TOL = 1e-5


def parity_lines(rows: list[dict], systems: list[str], steps: int) -> list[str]:
    """Every system's losses against the first system's: the worst, then each system's worst."""
    worst = max(rows, key=lambda r: r["parity"])
    ok = "OK" if worst["parity"] <= PARITY_TOL else "NOT"
    by_system = {s: max(r["parity"] for r in rows if r["system"] == s) for s in systems[1:] if any(r["system"] == s for r in rows)}
    return [
        f"parity: every system's losses (each rank, each of the {steps} steps) within {worst['parity']:.1e} of "
        f"{systems[0]}'s ({worst['system']}, world {worst['world']}): {ok} within {PARITY_TOL:g}",
        "parity by system (worst world, worst run): " + ", ".join(f"{s} {e:.1e}" for s, e in by_system.items()),
    ]


def prediction_lines(rows: list[dict], profile: str) -> list[str]:
    lines = []
    for r in rows:
        if r["pred_error"] is not None:
            verdict = "within" if abs(r["pred_error"]) <= 0.25 else "NOT within"
            lines.append(f"world {r['world']} run {r['run']} {r['system']}: predicted fwd+bwd {r['predicted_ms']:.1f} ms "
                         f"(profile {profile}) "
                         f"vs measured {r['fwd_bwd_ms']:.1f} ms: error {r['pred_error']:+.0%}, {verdict} 25%; "
                         f"with compute measured in the run: {r['pred_error_in_run']:+.0%}")
    return lines


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{statistics.median(values):.2f}x (runs {min(values):.2f}-{max(values):.2f}x)"


def _runs(rows: list[dict], world: int) -> dict[int, dict[str, dict]]:
    runs: dict[int, dict[str, dict]] = {}
    for r in rows:
        if r["world"] == world:
            runs.setdefault(r["run"], {})[r["system"]] = r
    return runs


def _ratios(rows: list[dict], pairs: list[tuple[str, str]]) -> list[tuple[int, str, str, list[float], list[float]]]:
    """For each world and each (mine, rival) of ``pairs`` present in every run of it: the step and
    peak ratios, each measured within one run."""
    out = []
    for world in sorted({r["world"] for r in rows}):
        runs = _runs(rows, world)
        for mine, rival in pairs:
            if all(mine in run and rival in run for run in runs.values()):
                step = [run[mine]["step_ms"] / run[rival]["step_ms"] for run in runs.values()]
                peak = [run[mine]["peak_mib"] / run[rival]["peak_mib"] for run in runs.values()]
                out.append((world, mine, rival, step, peak))
    return out


def ratio_lines(rows: list[dict], pairs: list[tuple[str, str]]) -> list[str]:
    """For each world, each (ours, rival) of ``pairs`` present: step and peak ratios, each
    measured within one run, then their median and range over the runs."""
    return [f"world {world} {mine} / {rival}: step {_spread(step)}, peak {_spread(peak)}"
            for world, mine, rival, step, peak in _ratios(rows, pairs)]


def verdict_lines(rows: list[dict], pairs: list[tuple[str, str]], step_at_most: float = 0.9) -> list[str]:
    """Whether each SimpleFSDP row of ``pairs`` (autoshard given no more than that row's memory,
    that row) has an autoshard row with a step of at most ``step_at_most`` times its own and no
    higher peak, by the median over the runs; a row that has none is named with its best pair."""
    by_rival: dict[tuple[int, str], list[tuple[float, float, str]]] = {}  # (world, rival) -> (step, peak, mine)
    for world, mine, rival, step, peak in _ratios(rows, pairs):
        by_rival.setdefault((world, rival), []).append((statistics.median(step), statistics.median(peak), mine))
    if not by_rival:
        return []
    misses = []
    for (world, rival), ours in sorted(by_rival.items()):
        if not any(s <= step_at_most and p <= 1.0 for s, p, _ in ours):
            s, p, mine = min(ours)  # the fastest of them
            misses.append(f"world {world} {rival} (best: {mine}, step {s:.2f}x, peak {p:.2f}x)")
    head = (f"given no more than each SimpleFSDP row's memory, autoshard's step <= {step_at_most:.2f}x and peak <= 1.00x "
            "(median over runs)")
    return [f"{head}: {'every row' if not misses else 'NOT on ' + '; '.join(misses)} ({len(by_rival)} rows)"]


def sanity_lines(rows: list[dict]) -> list[str]:
    """DDP holds everything on every rank: every sharded system's peak must be below its own."""
    lines = []
    for world, run in sorted({(r["world"], r["run"]) for r in rows}):
        mine = {r["system"]: r for r in rows if r["world"] == world and r["run"] == run}
        if "ddp" in mine:
            sharded = [s for s in mine if s != "ddp"]
            above = [f"{s} {mine[s]['peak_mib']:.1f} MiB" for s in sharded if mine[s]["peak_mib"] >= mine["ddp"]["peak_mib"]]
            lines.append(f"sanity, world {world} run {run}: DDP peak {mine['ddp']['peak_mib']:.1f} MiB "
                         + (f"exceeds every sharded system's ({', '.join(sharded)})" if not above
                            else f"does NOT exceed {', '.join(above)}"))
    return lines


def rows_of(world: int, per_rank: list[dict], systems: list[str]) -> list[dict]:
    """One row per system. Times: max over ranks of each rank's median; peak: max over ranks."""
    rows = []
    systems = [s for s in systems if s in per_rank[0]]  # a skipped row is missing on every rank
    for system in systems:
        rs = [r[system] for r in per_rank]
        row = {
            "world": world,
            "system": system,
            "step_ms": max(r["step_s"] for r in rs) * 1e3,
            "fwd_bwd_ms": max(r["fwd_bwd_s"] for r in rs) * 1e3,
            "step_vs_ddp": None,
            "peak_mib": max(r["peak_bytes"] for r in rs) / 2**20,
            "peak_vs_ddp": None,
            "predicted_ms": None,
            "pred_error": None,
            "pred_error_in_run": None,
        }
        if "predicted_s" in rs[0]:
            row["predicted_ms"] = rs[0]["predicted_s"] * 1e3  # ranks compile identical graphs
            row["pred_error"] = row["predicted_ms"] / row["fwd_bwd_ms"] - 1
            row["pred_error_in_run"] = rs[0]["predicted_in_run_s"] * 1e3 / row["fwd_bwd_ms"] - 1
        # Not shown in the table, kept in --json.
        row["state_mib"] = max(r["state_bytes"] for r in rs) / 2**20
        row["step_ms_per_rank"] = [r["step_s"] * 1e3 for r in rs]
        row["peak_mib_per_rank"] = [r["peak_bytes"] / 2**20 for r in rs]
        if "predicted_s" in rs[0]:
            row["predicted_compute_ms"] = rs[0]["predicted_compute_s"] * 1e3
            row["predicted_comm_ms"] = rs[0]["predicted_comm_s"] * 1e3
            row["predicted_peak_mib"] = rs[0]["predicted_peak_bytes"] / 2**20  # analysis: no optimizer state
        row["warmup_s"] = max(r["warmup_s"] for r in rs)
        # Parity: the largest difference of a step's loss from the first system's (same rank, same step).
        ref = [r[systems[0]]["losses"] for r in per_rank]
        row["parity"] = max(abs(a - b) for mine, theirs in zip((r["losses"] for r in rs), ref) for a, b in zip(mine, theirs))
        row["graphs"] = rs[0]["graphs"]
        rows.append(row)
    ddp = next((r for r in rows if r["system"] == "ddp"), None)
    if ddp is not None:
        for row in rows:
            row["step_vs_ddp"] = row["step_ms"] / ddp["step_ms"]
            row["peak_vs_ddp"] = row["peak_mib"] / ddp["peak_mib"]
    return rows


TABLE = (
    "run", "world", "system", "step_ms", "fwd_bwd_ms", "step_vs_ddp", "peak_mib", "peak_vs_ddp", "predicted_ms", "pred_error",
    "pred_error_in_run",
)
