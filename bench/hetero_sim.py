"""Mixed clusters on the simulator: the plan for half H100 and half A100 nodes against the
single-type plan, for the same cluster taken as all A100 (every rank as slow and as small as the
slowest, even batch shares).

Both come from one ``autoshard.plan(cluster=...)`` call: it compiles and searches exactly as
``autoshard.plan(world_size=..., profile="a100", memory_budget_gb=<A100 memory>)`` does (the
even-share steps are those of the single-type plan: ``--check`` runs that call too and
compares), then
plays every compiled layout on the mixed cluster with its planned batch shares.

    python bench/hetero_sim.py                                  # 1.3B and 8B x 64, 1024 ranks, fp32
    python bench/hetero_sim.py --shapes 1.3B --world-sizes 64 --check

GPT, seq 2048, one sequence per rank at an even share, 8 ranks per node, AdamW state; H100
80 GiB and A100 40 GiB per rank; prices per device-hour are inputs (--prices), not quotes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overlap import SHAPES  # noqa: E402

import autoshard  # noqa: E402
from autoshard import Cluster, NodeGroup  # noqa: E402
from autoshard.tools.plan.mixed_summary import per_dollar, single_type_outcome, utilisation, variance  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402


def _row(shape: str, plan: autoshard.Plan, seconds: float) -> dict:
    chosen, base = plan.chosen, single_type_outcome(plan)
    fast, slow = chosen.types
    dollars, base_dollars = per_dollar(plan, chosen.mixed_step), per_dollar(plan, base.step_time)
    return {
        "shape": shape, "world": plan.world_size,
        "as_all_a100": f"{base.candidate.label(8)}: {base.step_time * 1e3:.1f} ms",
        "planned": f"{chosen.candidate.label(8)}: {chosen.mixed_step * 1e3:.1f} ms",
        "ratio": chosen.mixed_step / base.step_time,
        "h100_x_even": fast.share * plan.world_size, "a100_x_even": slow.share * plan.world_size,
        "h100_busy/wait_ms": f"{fast.busy * 1e3:.1f} / {fast.wait * 1e3:.1f}",
        "a100_busy/wait_ms": f"{slow.busy * 1e3:.1f} / {slow.wait * 1e3:.1f}",
        "peak_gib_h100/a100": f"{fast.peak_bytes / 2**30:.1f} / {slow.peak_bytes / 2**30:.1f}",
        "util_var": variance(utilisation(chosen)),
        "ktok_per_$": dollars[0] / 1e3 if dollars else None,
        "as_all_a100_ktok_per_$": base_dollars[0] / 1e3 if base_dollars else None,
        "plan_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["1.3B", "8B"])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[64, 1024])
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--memory-gb", nargs=2, type=float, default=[80.0, 40.0], metavar=("H100", "A100"))
    parser.add_argument("--prices", nargs=2, type=float, default=[4.0, 1.8], metavar=("H100", "A100"),
                        help="dollars per device-hour (assumed inputs)")
    parser.add_argument("--check", action="store_true", help="also run the single-type plan for all A100 and compare the steps")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    rows = []
    for shape in args.shapes:
        cfg = GPTConfig(block_size=args.seq, **SHAPES[shape])
        tokens = torch.zeros(1, args.seq, dtype=torch.long)
        for world in args.world_sizes:
            nodes = world // 8 // 2
            cluster = Cluster((NodeGroup(nodes, "h100", 8, args.memory_gb[0], args.prices[0]),
                               NodeGroup(nodes, "a100", 8, args.memory_gb[1], args.prices[1])))
            for precision in args.precisions:
                print(f"{shape} world={world} {precision} ...", end=" ", file=sys.stderr, flush=True)
                start = time.perf_counter()
                plan = autoshard.plan(lambda: GPT(cfg), tokens, tokens, cluster=cluster, precisions=(precision,))
                seconds = time.perf_counter() - start
                print(f"{seconds:.0f} s", file=sys.stderr, flush=True)
                rows.append({**_row(shape, plan, seconds), "precision": precision})
                print(plan.summary(), file=sys.stderr, flush=True)
                if args.check:
                    alone = autoshard.plan(lambda: GPT(cfg), tokens, tokens, world_size=world, ranks_per_node=8,
                                           profile="a100", memory_budget_gb=args.memory_gb[1], precisions=(precision,))
                    base = single_type_outcome(plan)
                    same = alone.chosen.candidate == base.candidate and alone.chosen.step_time == base.step_time
                    print(f"check: the single-type plan for all A100: {alone.chosen.candidate.label(8)} "
                          f"{alone.chosen.step_time * 1e3:.2f} ms: {'same' if same else 'DIFFERENT'}", file=sys.stderr)
    print(f"GPT, seq {args.seq}, half H100 ({args.memory_gb[0]:g} GiB, ${args.prices[0]:g}/h) and half A100 "
          f"({args.memory_gb[1]:g} GiB, ${args.prices[1]:g}/h) nodes of 8 (predicted by the simulator); "
          "ratio: planned step / the single-type plan for all A100; x_even: samples per rank over an even share")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
