"""What ``bench/real.py`` prints under its table: parity, the prediction's error, and the step
and peak ratios of autoshard against SimpleFSDP.

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


def ratio_lines(rows: list[dict], ours: tuple[str, ...], rivals: tuple[str, ...]) -> list[str]:
    """For each world, each of ``ours`` against each of ``rivals`` present: step and peak ratios,
    each measured within one run, then their median and range over the runs."""
    lines = []
    for world in sorted({r["world"] for r in rows}):
        runs: dict[int, dict[str, dict]] = {}
        for r in rows:
            if r["world"] == world:
                runs.setdefault(r["run"], {})[r["system"]] = r
        present = set().union(*runs.values())
        for mine in (o for o in ours if o in present):
            for rival in (s for s in rivals if s in present):
                step = [run[mine]["step_ms"] / run[rival]["step_ms"] for run in runs.values()]
                peak = [run[mine]["peak_mib"] / run[rival]["peak_mib"] for run in runs.values()]
                lines.append(f"world {world} {mine} / {rival}: step {_spread(step)}, peak {_spread(peak)}")
    return lines


def sanity_lines(rows: list[dict]) -> list[str]:
    """DDP holds everything on every rank: every sharded system's peak must be below its own."""
    lines = []
    for world, run in sorted({(r["world"], r["run"]) for r in rows}):
        mine = {r["system"]: r for r in rows if r["world"] == world and r["run"] == run}
        if "ddp" in mine:
            sharded = [s for s in mine if s != "ddp"]
            ok = all(mine["ddp"]["peak_mib"] > mine[s]["peak_mib"] for s in sharded)
            lines.append(f"sanity, world {world} run {run}: DDP peak {mine['ddp']['peak_mib']:.1f} MiB "
                         f"{'exceeds' if ok else 'does NOT exceed'} every sharded system's ({', '.join(sharded)})")
    return lines
