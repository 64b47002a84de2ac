"""Expert parallelism vs gathered experts on the simulator: a Mixtral-8x7B-like and a
DeepSeek-V3-like shape at 64 and 1024 ranks (h100 profile, 8 ranks per node), compiled for one
training step on fake ranks (``autoshard.explain``), predicted step and peak side by side.

    python bench/moe_sim.py                     # both shapes, 64 and 1024 ranks
    python bench/moe_sim.py --shapes deepseek --worlds 64
    python bench/moe_sim.py --plan 80          # also what autoshard.plan chooses under 80 GiB

Each shape keeps its real widths (hidden size, expert width, experts, top-k, heads, vocabulary)
and only its depth is cut (``--layers``, default 2 MoE blocks): one block's collectives and
compute repeat per layer, so the per-step ratio of two layouts at full depth lies between this
table's and the per-block ratio (the embedding and head add the same to both).

The experts here are examples/moe_balanced.py's: they compute as if the router were perfectly
balanced (each expert gets ``T * k / E`` rows, one batched matmul over all experts), a graph
with static shapes, so the gathered layout compiles in one graph too, with the same FLOPs as
the expert-parallel op's cost model counts.

Expert parallelism splits the experts over every rank (the only degree built), so a shape
with fewer experts than ranks (Mixtral's 8 at 64 ranks, DeepSeek-V3's 256 at 1024) has no
expert-parallel row: the table says so.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from moe_balanced import build  # noqa: E402
from moe_gpt import MoEConfig  # noqa: E402

import autoshard  # noqa: E402
from autoshard.tools.units import fmt_bytes, fmt_time  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    cfg: MoEConfig


# Widths of the published configurations; depth cut to --layers. DeepSeek-V3's shared expert
# and first dense layers are left out (dense MLP parameters: sharded alike in both layouts).
SHAPES = {
    "mixtral": Shape("Mixtral-8x7B-like", MoEConfig(vocab_size=32000, block_size=2048, n_head=32, n_embd=4096, n_expert=8, top_k=2,
                                                    expert_hidden=14336)),
    "deepseek": Shape("DeepSeek-V3-like", MoEConfig(vocab_size=129280, block_size=2048, n_head=128, n_embd=7168, n_expert=256,
                                                    top_k=8, expert_hidden=2048)),
}


def run(shape: Shape, layers: int, world: int, experts: str, seq: int) -> tuple[float, int] | str:
    """(predicted step, peak per rank) of one layout, or why it has none."""
    cfg = MoEConfig(**{**shape.cfg.__dict__, "n_layer": layers, "block_size": seq})
    if experts == "parallel" and cfg.n_expert % world:
        return f"n/a: {cfg.n_expert} experts over {world} ranks"

    def factory() -> nn.Module:
        model = build(cfg)
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        return autoshard.shard(model, mesh, experts=experts)

    tokens = torch.zeros(1, seq, dtype=torch.long)
    report = autoshard.explain(factory, tokens, tokens, world_size=world, profile="h100", stages=("captured", "forward", "backward"))
    return report.metrics["step_time"], int(report.metrics["peak_bytes"])


def planned(shape: Shape, layers: int, world: int, seq: int, budget_gb: float) -> str:
    """What ``autoshard.plan`` chooses for the shape at ``world`` ranks under ``budget_gb``."""
    cfg = MoEConfig(**{**shape.cfg.__dict__, "n_layer": layers, "block_size": seq})
    tokens = torch.zeros(1, seq, dtype=torch.long)
    try:
        plan = autoshard.plan(lambda: build(cfg), tokens, tokens, world_size=world, ranks_per_node=8, profile="h100",
                              memory_budget_gb=budget_gb)
    except autoshard.OverBudgetError as e:
        return f"nothing fits: {e}"
    chosen = plan.chosen
    return f"{plan.candidate.label(8)}: step {fmt_time(chosen.step_time)}, peak {fmt_bytes(chosen.peak_bytes)} (optimizer state included)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--worlds", nargs="+", type=int, default=[64, 1024])
    parser.add_argument("--layers", type=int, default=2, help="MoE blocks compiled (default 2)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per rank (one sequence)")
    parser.add_argument("--plan", type=float, metavar="GIB", help="also run autoshard.plan under this per-rank budget")
    args = parser.parse_args()
    print(f"h100 profile, 8 ranks per node, {args.layers} MoE blocks, 1 sequence of {args.seq} tokens per rank, fp32")
    print("| shape | ranks | gathered step | gathered peak | parallel step | parallel peak | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key in args.shapes:
        shape = SHAPES[key]
        for world in args.worlds:
            gathered = run(shape, args.layers, world, "gathered", args.seq)
            parallel = run(shape, args.layers, world, "parallel", args.seq)
            cells = [f"{fmt_time(r[0])} | {fmt_bytes(r[1])}" if isinstance(r, tuple) else f"{r} | " for r in (gathered, parallel)]
            speedup = f"{gathered[0] / parallel[0]:.2f}x" if isinstance(parallel, tuple) else ""
            print(f"| {shape.name} | {world} | {cells[0]} | {cells[1]} | {speedup} |", flush=True)
    if args.plan is not None:
        for key in args.shapes:
            for world in args.worlds:
                print(f"plan, {SHAPES[key].name}, {world} ranks, {args.plan:g} GiB: "
                      f"{planned(SHAPES[key], args.layers, world, args.seq, args.plan)}", flush=True)


if __name__ == "__main__":
    main()
