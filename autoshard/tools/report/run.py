"""A measured run as a page: ``autoshard report run.jsonl --html run.html``.

Reads the JSON-lines file :class:`autoshard.Telemetry` writes and draws each rank's lane of
steps, every step split into busy time and the waits of each collective kind (the measured
counterpart of the report's simulated lanes), with the KPIs and, when the run recorded one,
the prediction beside the measurement.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from autoshard.runtime.errors import UsageError
from autoshard.runtime.telemetry import busy_s, kpis
from autoshard.runtime.timed_waits import KINDS
from autoshard.tools.report.svg import esc
from autoshard.tools.units import fmt_bytes, fmt_time

COLORS = {"busy": "#4c78a8", "all_gather": "#f58518", "reduce_scatter": "#e45756", "all_reduce": "#72b7b2"}
LANE_H, WIDTH, LEFT = 22, 900, 70


def read_run(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's header and its step rows."""
    try:
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"autoshard report: cannot read the run file {path}: {e}; pass the JSON-lines file "
                         "autoshard.Telemetry(path=...) wrote.") from None
    if not lines or "run" not in lines[0]:
        raise UsageError(f"autoshard report: {path} has no run header; pass the file autoshard.Telemetry(path=...) wrote.")
    return lines[0]["run"], [line for line in lines[1:] if "step" in line]  # (adaptive splits are lines of their own)


def _lanes(rows: list[dict[str, Any]]) -> str:
    """One lane per rank, steps side by side, each width its time on a shared scale."""
    world = len(rows[0]["ranks"])
    total = max(sum(row["ranks"][r]["step_s"] for row in rows) for r in range(world)) or 1.0
    scale = (WIDTH - LEFT) / total
    parts = [f'<svg width="{WIDTH}" height="{world * LANE_H + 10}" xmlns="http://www.w3.org/2000/svg">']
    for r in range(world):
        y, x = r * LANE_H + 4, float(LEFT)
        parts.append(f'<text x="2" y="{y + 14}" font-size="12">rank {r}</text>')
        for row in rows:
            fields = row["ranks"][r]
            pieces = [("busy", max(busy_s(fields), 0.0)), *((k, fields[f"wait_{k}_s"]) for k in KINDS)]
            for name, seconds in pieces:
                w = seconds * scale
                if w > 0:
                    parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{LANE_H - 6}" fill="{COLORS[name]}">'
                                 f'<title>step {row["step"]}: {esc(name)} {esc(fmt_time(seconds))}</title></rect>')
                x += w
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + LANE_H - 6}" stroke="white"/>')
    parts.append("</svg>")
    return "".join(parts)


def _kpi_rows(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(what, measured, predicted) rows."""
    predicted = summary.get("prediction") or {}
    rows = [
        ("step (slowest rank, median)", fmt_time(summary["step_s"]),
         fmt_time(predicted["step_s"]) if "step_s" in predicted else ""),
        ("tokens/s (all ranks)", f"{summary['tokens_per_s']:,.0f}", ""),
        ("exposed communication", f"{summary['exposed_comm_fraction']:.1%} of the step",
         fmt_time(predicted["exposed_comm_s"]) if "exposed_comm_s" in predicted else ""),
        ("overlap", f"{summary['overlap_measured']:.1%}" if "overlap_measured" in summary else "",
         f"{predicted['overlap']:.1%}" if "overlap" in predicted else ""),
        ("busy fraction per rank", ", ".join(f"{b:.0%}" for b in summary["busy_fraction"]), ""),
        ("utilisation variance across ranks", f"{summary['busy_variance']:.4f}", ""),
        ("slowest / most waiting rank", f"{summary['slowest_rank']} / {summary['most_waiting_rank']}", ""),
        ("peak memory per rank", ", ".join(fmt_bytes(b) for b in summary["peak_bytes"]),
         fmt_bytes(predicted["peak_bytes"]) if "peak_bytes" in predicted else ""),
        ("memory imbalance (largest / smallest peak)", f"{summary['memory_imbalance']:.2f}", ""),
    ]
    if summary.get("gb_per_billion_parameters") is not None:
        rows.append(("GB per billion parameters (largest rank)", f"{summary['gb_per_billion_parameters']:,.1f}", ""))
    for kind, n in summary["bytes_per_step"].items():
        rows.append((f"{kind} bytes per step (rank 0)", fmt_bytes(n),
                     fmt_bytes(predicted["comm_bytes"][kind]) if kind in predicted.get("comm_bytes", {}) else ""))
    if summary.get("tokens_per_dollar") is not None:
        rows.append(("tokens per dollar", f"{summary['tokens_per_dollar']:,.0f}", ""))
    if summary.get("joules_per_step") is not None:
        rows.append(("energy per step (all ranks)", f"{summary['joules_per_step']:,.1f} J", ""))
    return rows


def run_summary(header: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's KPIs, from its header's figures and its steps."""
    if not rows:
        raise UsageError("autoshard report: the run file holds no steps yet; call Telemetry.flush() or close() in the run.")
    return kpis(rows, header["parameters"], header.get("price_per_hour"), header.get("power_w"), header.get("prediction"))


def render_run(header: dict[str, Any], rows: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> str:
    """The page: the KPIs (measured beside predicted) and the ranks' lanes."""
    summary = summary or run_summary(header, rows)
    table = "".join(f"<tr><td>{esc(a)}</td><td>{esc(b)}</td><td>{esc(c)}</td></tr>" for a, b, c in _kpi_rows(summary))
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {esc(name)}' for name, c in COLORS.items())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>autoshard run</title></head><body>"
            f"<h1>Measured run: {header['world_size']} ranks, {len(rows)} steps</h1>"
            f"<table border='1' cellpadding='4'><tr><th></th><th>measured</th><th>predicted</th></tr>{table}</table>"
            f"<h2>Per-rank lanes</h2><p>{legend}</p>{_lanes(rows)}</body></html>")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="the JSON-lines file autoshard.Telemetry(path=...) wrote")
    parser.add_argument("--html", help="write the page here (default: the run's name with .html)")


def run(args: argparse.Namespace) -> int:
    header, rows = read_run(args.run)
    out = Path(args.html or Path(args.run).with_suffix(".html"))
    summary = run_summary(header, rows)
    out.write_text(render_run(header, rows, summary))
    print(f"{len(rows)} steps on {header['world_size']} ranks: step {fmt_time(summary['step_s'])}, "
          f"{summary['tokens_per_s']:,.0f} tokens/s, slowest rank {summary['slowest_rank']}; wrote {out}")
    return 0
