"""The planner against the layouts an expert sets by hand, on the simulator.

For each GPT shape, world size and precision, ``autoshard.plan`` runs twice: without a
budget, and under a budget halfway between the peaks of the two baselines it always compiles
(full shard, FSDP2's default, and hybrid sharding within a node and replication across nodes,
HSDP over nodes), rounded to 0.5 GiB: the regime where one baseline fits and the faster one
does not. Each row compares the plan with the faster of the baselines that fit the same
budget (both come from the plan's own compiles, so every figure is the simulator's, side by side):

    python bench/plan.py                                   # 1.3B and 8B x 64, 1024, 8192 ranks x fp32, bf16 (~1 h here)
    python bench/plan.py --shapes 8B --world-sizes 1024 --precisions fp32 --json plan.json

H100 profile, 8 ranks per node, seq 2048, one sequence per rank; energy over all ranks.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overlap import SHAPES  # noqa: E402

import autoshard  # noqa: E402
from autoshard.cost.simulator import kwh_per_million_tokens  # noqa: E402
from autoshard.tools.plan.layouts import Candidate  # noqa: E402
from autoshard.tools.plan.plan import OVER_BUDGET  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402


def _baselines(plan: autoshard.Plan) -> dict[str, autoshard.tools.plan.plan.Outcome]:
    per_node = plan.ranks_per_node
    wanted = {"full": Candidate("full", (plan.world_size,), plan.precision),
              "hsdp": Candidate("hybrid", (plan.world_size // per_node, per_node), plan.precision)}
    by = {o.candidate: o for o in plan.outcomes}
    return {name: by[c] for name, c in wanted.items() if c in by}


def _fits(o, limit: float) -> bool:
    return o.error is None and o.peak_bytes <= limit


def _row(shape: str, plan: autoshard.Plan, seconds: float) -> dict:
    limit = math.inf if plan.memory_budget_gb is None else plan.memory_budget_gb * 2**30
    base = _baselines(plan)
    fitting = [o for o in base.values() if _fits(o, limit)]
    best = min(fitting, key=lambda o: o.step_time, default=None)
    chosen = plan.chosen
    cell = lambda o: ("over budget" if not _fits(o, limit) else f"{o.step_time * 1e3:.1f} ms / {o.peak_bytes / 2**30:.1f} GiB")  # noqa: E731
    kwh = lambda o: kwh_per_million_tokens(o.energy_j, plan.world_size, plan.tokens_per_step)  # noqa: E731
    return {
        "shape": shape, "world": plan.world_size, "precision": plan.precision,
        "budget_gib": "none" if plan.memory_budget_gb is None else plan.memory_budget_gb,
        "full": cell(base["full"]) if "full" in base else "-",
        "hsdp_over_nodes": cell(base["hsdp"]) if "hsdp" in base else "-",
        "planned": plan.candidate.label(plan.ranks_per_node).replace(", shard over 1 node", " 1-node"),
        "planned_ms": chosen.step_time * 1e3, "planned_gib": chosen.peak_bytes / 2**30,
        "vs_best": chosen.step_time / best.step_time if best else float("nan"),
        "kwh_per_mtok": kwh(chosen) if chosen.energy_j is not None else None,
        "best_kwh_per_mtok": kwh(best) if best and best.energy_j is not None else None,
        "compiles": sum(o.error is None or o.error == OVER_BUDGET for o in plan.outcomes),
        "plan_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["1.3B", "8B"])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[64, 1024, 8192])
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--profile", default="h100")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    rows = []
    for shape in args.shapes:
        cfg = GPTConfig(block_size=args.seq, **SHAPES[shape])
        tokens = torch.zeros(1, args.seq, dtype=torch.long)
        for world in args.world_sizes:
            for precision in args.precisions:
                budget = None
                for _ in range(2):  # without a budget, then halfway between the baselines' peaks
                    start = time.perf_counter()
                    print(f"{shape} world={world} {precision} budget={budget} ...", end=" ", file=sys.stderr, flush=True)
                    plan = autoshard.plan(lambda: GPT(cfg), tokens, tokens, world_size=world, ranks_per_node=8,
                                          memory_budget_gb=budget, profile=args.profile, precisions=(precision,))
                    seconds = time.perf_counter() - start
                    print(f"{seconds:.0f} s", file=sys.stderr, flush=True)
                    rows.append(_row(shape, plan, seconds))
                    peaks = sorted(o.peak_bytes for o in _baselines(plan).values() if o.error is None)
                    if len(peaks) < 2 or peaks[0] == peaks[-1]:
                        break
                    budget = round((peaks[0] + peaks[-1]) / 2 / 2**30 * 2) / 2
    print(f"GPT, seq {args.seq}, 1 sequence per rank, profile {args.profile}, 8 ranks per node (predicted by the simulator); "
          "cells: step / peak per rank; vs_best: planned step / the faster baseline that fits")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
