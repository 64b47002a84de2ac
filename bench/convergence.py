"""Convergence with compressed communication: examples/train_gpt.py for 500 steps on its corpus,
float32 against int8 gathers + int8 reductions (``autoshard.Compression(gather="int8",
reduce="int8")``), same seed, same batches; prints the mean of each run's last 100 losses and
their ratio (issue 49's bar: within 1.02x; DeepSpeed's own test of ZeRO++ asks 1.1x), and draws
both curves (a 20-step running mean) as an SVG:

    python bench/convergence.py                          # 2 gloo ranks, aot_eager, 500 steps
    python bench/convergence.py --svg docs/convergence.svg
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"float32": "none", "int8 gathers + int8 reductions": "int8"}
COLORS = ("#1f77b4", "#d62728")


def losses(compress: str, steps: int, world: int, extra: list[str]) -> list[float]:
    """Each step's loss (mean over ranks) of examples/train_gpt.py with ``--compress``."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps), "--world-size",
                          str(world), "--compress", compress, *extra], capture_output=True, text=True, check=True).stdout
    found = [float(m.group(1)) for m in re.finditer(r"^step\s+\d+\s+loss ([0-9.]+)$", out, re.M)]
    if len(found) != steps:
        raise RuntimeError(f"expected {steps} losses from train_gpt.py, read {len(found)}:\n{out[-2000:]}")
    return found


def running_mean(xs: list[float], window: int = 20) -> list[float]:
    return [statistics.fmean(xs[max(0, i - window + 1): i + 1]) for i in range(len(xs))]


def svg(curves: dict[str, list[float]], width: int = 640, height: int = 320, pad: int = 40) -> str:
    """Each curve as a polyline over step (x) and loss (y), with its label and the axes' ranges."""
    every = [v for c in curves.values() for v in c]
    low, high, steps = min(every), max(every), max(len(c) for c in curves.values())
    x = lambda i: pad + (width - 2 * pad) * i / max(steps - 1, 1)  # noqa: E731
    y = lambda v: height - pad - (height - 2 * pad) * (v - low) / ((high - low) or 1)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{pad}" y="{height - pad + 16}">0</text><text x="{width - pad - 24}" y="{height - pad + 16}">{steps - 1}</text>',
             f'<text x="{width / 2 - 20}" y="{height - 8}">step</text>',
             f'<text x="4" y="{pad + 4}">{high:.2f}</text><text x="4" y="{height - pad}">{low:.2f}</text>']
    for k, ((label, curve), color) in enumerate(zip(curves.items(), COLORS)):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(curve))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<text x="{width - pad - 230}" y="{pad + 16 * k}" fill="{color}">{label}</text>')
    return "\n".join(parts + ["</svg>"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--last", type=int, default=100, help="losses averaged at the end")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--svg", help="write both curves (20-step running means) here")
    args, extra = parser.parse_known_args()  # the rest goes to train_gpt.py (e.g. --n-layer 4 --n-embd 128)
    found = {label: losses(compress, args.steps, args.world_size, extra) for label, compress in RUNS.items()}
    means = {label: statistics.fmean(ls[-args.last:]) for label, ls in found.items()}
    (base, base_mean), (other, other_mean) = means.items()
    print(f"examples/train_gpt.py {' '.join(extra)}, {args.world_size} gloo ranks, {args.steps} steps; "
          f"mean of the last {args.last} losses:")
    for label, mean in means.items():
        print(f"  {label:<32s} {mean:.4f}   (first {found[label][0]:.4f}, last {found[label][-1]:.4f})")
    print(f"  {other} / {base}: {other_mean / base_mean:.4f}x")
    print("mean loss per 100 steps:")
    for start in range(0, args.steps, 100):
        row = "  ".join(f"{statistics.fmean(ls[start:start + 100]):.4f}" for ls in found.values())
        print(f"  steps {start:3d}-{min(start + 100, args.steps) - 1:3d}:  {row}")
    if args.svg:
        Path(args.svg).write_text(svg({label: running_mean(ls) for label, ls in found.items()}))
        print(f"curves: {args.svg}")


if __name__ == "__main__":
    main()
