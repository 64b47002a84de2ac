"""Step time against the per-rank memory budget (backend option ``memory_budget_gb``).

For each shape, first the fastest plan (an unbinding budget) and FSDP2's policy fix the range;
then budgets from the smallest that fits to the fastest plan's peak are compiled, and each
row gives the schedule's predicted peak (the step model, optimizer state included) and step
time, side by side with the default (no budget: never above FSDP2's peak).

    python bench/memory.py --sim                 # 125M and 1.3B at 64 ranks, H100 profile (simulator)
    python bench/memory.py --real                # the 12.7M GPT on 2 gloo ranks, measured
    python bench/memory.py --sim --real --svg bench/memory.svg --json memory.json

``--sim`` compiles on fake tensors (autoshard.explain) and plays the step on the simulator;
``--real`` trains on gloo CPU ranks and measures the peak as bench/real.py does.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overlap import SHAPES  # noqa: E402

import autoshard  # noqa: E402
from autoshard.passes.schedule import PLAN  # noqa: E402
from autoshard.tools.launch import run_ranks  # noqa: E402

import real  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

REAL = dict(layers=4, embd=512, heads=8, seq=32, batch=1, vocab=96)  # bench/real.py's 12.7M config


def predicted(factory, args: tuple, world: int, profile: str, **options) -> dict:
    """Compile one step on fake ranks: the plans' peak (max over forward and backward) and the simulated step."""
    report = autoshard.explain(factory, *args, world_size=world, profile=profile, **options)
    plans = [report.stages[side].meta[PLAN] for side in ("forward", "backward")]
    return {
        "peak_gib": max(p.peak_bytes for p in plans) / 2**30,
        "smallest_gib": max((p.smallest_bytes or 0) for p in plans) / 2**30,
        "step_ms": report.analysis.step_time * 1e3,
        "forced": sum(len(p.forced) for p in plans),
    }


def budgets(factory, args: tuple, world: int, profile: str, count: int) -> tuple[list[dict], list[float]]:
    """The default, FSDP2's and the fastest plan, and ``count`` budgets from the smallest that fits to the fastest's peak."""
    fastest = predicted(factory, args, world, profile, memory_budget_gb=1e6)
    rows = [{"plan": "fastest", **fastest}, {"plan": "default", **predicted(factory, args, world, profile)},
            {"plan": "fsdp2", **predicted(factory, args, world, profile, schedule="fsdp2")}]
    low, high = fastest["smallest_gib"], fastest["peak_gib"]
    return rows, [low + (high - low) * i / (count - 1) for i in range(count)]


def sweep_sim(args: argparse.Namespace) -> list[dict]:
    out = []
    for shape in args.shapes:
        cfg = GPTConfig(block_size=args.seq, **SHAPES[shape])
        idx = torch.zeros(1, args.seq, dtype=torch.long)
        rows, gibs = budgets(lambda: GPT(cfg), (idx, idx), args.world, "h100", args.points)
        for gib in gibs:
            rows.append({"plan": f"budget {gib:.3f} GiB", "budget_gib": gib,
                         **predicted(lambda: GPT(cfg), (idx, idx), args.world, "h100", memory_budget_gb=gib)})
        out += [{"where": f"sim {shape} @{args.world}", **r} for r in rows]
    return out


def _measure_with(options: dict | None) -> dict:
    # One system measured as bench/real.py measures: autoshard with these backend options
    # (None: FSDP2 eager).
    ns = argparse.Namespace(**REAL, warmup=2, steps=3, profile="cpu")

    def setup(model, _args):
        autoshard.shard(model)
        return torch.compile(model, backend="autoshard", options={"compiler": "aot_eager", **options}), model

    real.SETUPS["swept"] = setup
    torch.set_num_threads(1)
    return real.measure("fsdp2" if options is None else "swept", ns, real.get_profile("cpu"))


def sweep_real(args: argparse.Namespace) -> list[dict]:
    cfg = GPTConfig(vocab_size=REAL["vocab"], block_size=REAL["seq"], n_layer=REAL["layers"], n_head=REAL["heads"], n_embd=REAL["embd"])
    x = torch.zeros(REAL["batch"], REAL["seq"], dtype=torch.long)
    rows, gibs = budgets(lambda: GPT(cfg), (x, x), 2, "cpu", args.points)
    systems = [("fsdp2 eager", None), ("default", {}), ("fastest", {"memory_budget_gb": 1e6})]
    systems += [(f"budget {g:.3f} GiB", {"memory_budget_gb": g}) for g in gibs[1:]]  # the smallest is below gloo's noise
    out = []
    for name, options in systems:
        per_rank = run_ranks(2, _measure_with, options, timeout=None)
        pred = {} if options is None else predicted(lambda: GPT(cfg), (x, x), 2, "cpu", **options)
        row = {"where": "real 12.7M @2 gloo", "plan": name, "budget_gib": options.get("memory_budget_gb") if options else None,
               "measured_peak_gib": max(r["peak_bytes"] for r in per_rank) / 2**30,
               "measured_step_ms": max(r["step_s"] for r in per_rank) * 1e3, **pred}
        if row["budget_gib"] and row["budget_gib"] > 1e5:
            row["budget_gib"] = None
        out.append(row)
        print(f"{name}: measured peak {row['measured_peak_gib'] * 1024:.1f} MiB", file=sys.stderr, flush=True)
    return out


def svg(rows: list[dict], path: str) -> None:
    """Predicted step time against budget, one panel per sweep, as a self-contained SVG."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("budget_gib"):
            groups.setdefault(r["where"], []).append((r["budget_gib"], r["step_ms"]))  # predicted: measured moves 2x with load
    w, h, m = 640, 120 * max(1, len(groups)) + 40, 60
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">']
    for i, (name, pts) in enumerate(sorted(groups.items())):
        top = 20 + 120 * i
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        # The step axis spans the points (from 0 the curve would be a flat line: budgets move it by a few %).
        x0, x1, y0, y1 = min(xs), max(xs) or 1, min(ys) * 0.98, max(ys) * 1.02
        def sx(x):
            return m + (x - x0) / ((x1 - x0) or 1) * (w - 2 * m)
        def sy(y):
            return top + 90 - (y - y0) / ((y1 - y0) or 1) * 90
        parts.append(f'<text x="{m}" y="{top - 4}">{name}: predicted step time (ms) vs memory budget (GiB per rank)</text>')
        parts.append(f'<line x1="{m}" y1="{top + 90}" x2="{w - m}" y2="{top + 90}" stroke="#888"/>')
        parts.append(f'<line x1="{m}" y1="{top}" x2="{m}" y2="{top + 90}" stroke="#888"/>')
        parts.append(f'<text x="{m - 4}" y="{top + 8}" text-anchor="end">{y1:.3g}</text>')
        parts.append(f'<text x="{m - 4}" y="{top + 90}" text-anchor="end">{y0:.3g}</text>')
        parts.append(f'<text x="{m}" y="{top + 104}">{x0:.3g}</text><text x="{w - m}" y="{top + 104}" text-anchor="end">{x1:.3g}</text>')
        poly = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        parts.append(f'<polyline points="{poly}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="#1f77b4"/>' for x, y in pts]
    parts.append("</svg>")
    Path(path).write_text("\n".join(parts) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sim", action="store_true", help="sweep on the simulator (fake ranks, H100 profile)")
    parser.add_argument("--real", action="store_true", help="sweep on 2 gloo CPU ranks, measured")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["125M", "1.3B"])
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--points", type=int, default=4, help="budgets per sweep, smallest that fits to the fastest's peak")
    parser.add_argument("--svg", help="draw step time vs budget here")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--from-json", nargs="+", metavar="FILE", help="no sweep: table and --svg from earlier --json files")
    args = parser.parse_args()
    if args.from_json:
        rows = [r for f in args.from_json for r in json.loads(Path(f).read_text())]
    elif not (args.sim or args.real):
        parser.error("choose --sim, --real or both (or --from-json)")
    else:
        rows = (sweep_sim(args) if args.sim else []) + (sweep_real(args) if args.real else [])
    print(tabulate(rows, headers="keys", floatfmt=".4g", missingval=""))
    if args.svg:
        svg(rows, args.svg)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
