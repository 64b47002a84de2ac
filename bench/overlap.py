"""Predicted step time, exposed communication and memory of each schedule, side by side.

Compiles a GPT for a large world in one process (fake process group), then plays the final
forward/backward graphs of each schedule on the cost model's device profile:

    python bench/overlap.py                         # 12-layer GPT-2-small shape, 8 ranks, H100
    python bench/overlap.py --layers 4 --embd 256 --world-size 64 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import autoshard  # noqa: E402
from autoshard._compat import fake_process_group  # noqa: E402
from autoshard.analysis import analyze  # noqa: E402
from autoshard.dump import recording  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

SCHEDULES = ("none", "inductor", "autoshard")


def measure(cfg: GPTConfig, batch: int, schedule: str, profile: str) -> dict:
    """Compile one training step with ``schedule`` and analyse its final graph pair."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = autoshard.shard(GPT(cfg))
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    options = {"compiler": "aot_eager", "schedule": schedule, "profile": profile}
    with recording() as graphs:
        torch.compile(model, backend="autoshard", options=options)(idx, idx).backward()
    (stages,) = graphs
    a = analyze(stages["forward"], stages["backward"], profile)
    return {
        "schedule": schedule,
        "step_ms": a.step_time * 1e3,
        "compute_ms": a.compute_time * 1e3,
        "comm_ms": a.comm_time * 1e3,
        "exposed_ms": a.exposed_comm * 1e3,
        "exposed_pct": 100 * a.exposed_comm / a.step_time,
        "overlap": a.overlap_ratio,
        "peak_mib": a.peak_bytes / 2**20,
        "peak_gathered_mib": a.peak_gathered_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--profile", default="h100")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    fake_process_group(0, args.world_size)
    rows = []
    for schedule in SCHEDULES:
        print(f"compiling schedule={schedule} ...", file=sys.stderr, flush=True)
        rows.append(measure(cfg, args.batch, schedule, args.profile))
    base = rows[0]
    for row in rows:
        row["step_vs_none"] = row["step_ms"] / base["step_ms"]
    params = sum(p.numel() for p in GPT(cfg).parameters()) / 1e6
    print(f"GPT {args.layers} layers x {args.embd}, {params:.0f}M parameters, seq {args.seq}, "
          f"batch {args.batch}/rank, world {args.world_size}, profile {args.profile} (predicted)")
    print(tabulate(rows, headers="keys", floatfmt=".3f"))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
