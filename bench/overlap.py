"""Predicted step time, exposed communication and memory of each schedule, side by side.

Compiles GPT shapes from 125M to 8B parameters for world sizes from 8 to 1024 in one process
(fake process group, fake tensors: no memory for weights or activations), then plays each schedule's final
forward/backward graphs on the cost model's device profile (autoshard.cost.simulator):

    python bench/overlap.py --quick                  # 125M at 64 ranks (~1.5 min here)
    python bench/overlap.py --json overlap.json      # every shape and world size (~30 min)
    python bench/overlap.py --shapes 1.3B --world-sizes 64 --profile a100

Schedules: "none" (gather at use, reduce at the end), "fsdp2" (FSDP2's policy on the same
buckets: prefetch the next block, one reduce-scatter in flight), "inductor" (PyTorch's own
bucketing and overlap scheduler), "autoshard", and "autoshard_keep" (autoshard with
``reshard_after_forward=False``: gathered parameters kept from forward to backward, as SimpleFSDP
keeps them). Gaps are to the simulator's lower bounds
(autoshard.cost.simulator.StepAnalysis). ``--precisions fp32 bf16`` adds each schedule gathered and
computed in bfloat16 with gradients reduced in float32 (``MixedPrecision(bfloat16, float32)``);
shards and optimizer state stay float32. ``--planned`` adds a row per precision for the layout
``autoshard.plan`` chooses (no budget), with the autoshard schedule.
``simplefsdp_auto`` and ``simplefsdp_block`` (run when torchtitan imports, fp32 only): torchtitan's
SimpleFSDP with graph_trainer's automatic or per-block bucketing/reordering (bench/simple_fsdp.py),
its graphs captured the same way and played on the same profile.
Energy: ``energy_j`` per rank per step and ``kwh_per_mtok`` over all ranks, on the profile's busy
and idle power (StepAnalysis.energy_j; empty on profiles without power figures).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import autoshard  # noqa: E402
from autoshard._compat import fake_process_group, fake_tensor_mode  # noqa: E402
from autoshard.compiler.dump import recording  # noqa: E402
from autoshard.cost.simulator import analyze, kwh_per_million_tokens  # noqa: E402

import simple_fsdp  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

SCHEDULES = ("none", "fsdp2", "inductor", "autoshard", "autoshard_keep")
SIMPLE_FSDP = ("simplefsdp_auto", "simplefsdp_block")
BF16 = autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# GPT-2 small / medium, GPT-3 XL, and an 8B shape with Llama 3's width and vocabulary.
SHAPES = {
    "125M": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50304),
    "350M": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50304),
    "1.3B": dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304),
    "8B": dict(n_layer=40, n_embd=4096, n_head=32, vocab_size=128256),
}


def measure(cfg: GPTConfig, world: int, batch: int, schedule: str, profile: str, precision: str = "fp32",
            plan: autoshard.Plan | None = None) -> dict:
    """Compile one training step with ``schedule`` at ``world`` ranks (full shard in
    ``precision``, or ``plan``'s layout); analyse its graphs."""
    if schedule in SIMPLE_FSDP:
        idx = torch.zeros(batch, cfg.block_size, dtype=torch.long)
        stages = simple_fsdp.fake_step(lambda: GPT(cfg), (idx, idx), world, schedule, profile)
        model = stages["model"]
        return _row(schedule, precision, analyze(stages["forward"], stages["backward"], profile), model, batch, cfg, world)
    torch._dynamo.reset()
    fake_process_group(0, world)
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside fake mode: building a mesh reads real tensors
        # autoshard_keep: the autoshard schedule with gathered parameters kept for backward
        # (SimpleFSDP's choice, like for like), set on shard() as in bench/real.py.
        keep = schedule == "autoshard_keep"
        with fake_tensor_mode(), recording() as graphs:
            if plan is not None:
                model = autoshard.shard(GPT(cfg), plan=plan)
            else:
                model = autoshard.shard(GPT(cfg), mesh, mixed_precision=BF16 if precision == "bf16" else None,
                                        reshard_after_forward=False if keep else None)
            idx = torch.zeros(batch, cfg.block_size, dtype=torch.long)
            options = {"compiler": "aot_eager", "schedule": "autoshard" if keep else schedule, "profile": profile}
            torch.compile(model, backend="autoshard", options=options)(idx, idx).backward()
        (stages,) = graphs
        a = analyze(stages["forward"], stages["backward"], profile)
    finally:
        dist.destroy_process_group()
    return _row(schedule if plan is None else "planned: " + plan.candidate.label(plan.ranks_per_node), precision, a, model,
                batch, cfg, world)


def _row(schedule: str, precision: str, a, model, batch: int, cfg: GPTConfig, world: int) -> dict:
    params = sum(p.numel() for p in model.parameters())  # DTensor (SimpleFSDP): the global count
    tokens = batch * cfg.block_size * world  # each rank takes its own slice of the global batch
    return {
        "schedule": schedule,
        "precision": precision,
        "step_ms": a.step_time * 1e3,
        "exposed_pct": 100 * a.exposed_comm / a.step_time,
        "overlap": a.overlap_ratio,
        "peak_gib": a.peak_bytes / 2**30,
        "bytes_per_param": a.peak_bytes / params,
        "step_gap_pct": 100 * (a.step_time / a.step_lower_bound - 1),
        "mem_gap_pct": 100 * (a.peak_bytes / a.memory_lower_bound - 1),
        "energy_j": a.energy_j,
        "kwh_per_mtok": None if a.energy_j is None else kwh_per_million_tokens(a.energy_j, world, tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[8, 64, 1024])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES + SIMPLE_FSDP, default=list(SCHEDULES + SIMPLE_FSDP))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--profile", default="h100", help="h100, a100, cpu or a .json from `python -m autoshard calibrate`")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32"],
                        help="bf16: gathered and computed in bfloat16, gradients reduced in float32")
    parser.add_argument("--planned", action="store_true", help="also the layout autoshard.plan chooses, per precision")
    parser.add_argument("--quick", action="store_true", help="125M at 64 ranks only")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.world_sizes = ["125M"], [64]
    if (why := simple_fsdp.missing()) and any(s in SIMPLE_FSDP for s in args.schedules):
        print(why)
        args.schedules = [s for s in args.schedules if s not in SIMPLE_FSDP]

    rows = []
    for shape in args.shapes:
        cfg = GPTConfig(block_size=args.seq, **SHAPES[shape])
        for world in args.world_sizes:
            base = None
            for precision in args.precisions:
                runs = [(schedule, None) for schedule in args.schedules if precision == "fp32" or schedule not in SIMPLE_FSDP]
                runs += [("autoshard", "plan")] if args.planned else []
                for schedule, planned in runs:
                    start = time.perf_counter()
                    print(f"{shape} world={world} {precision} {planned or schedule} ...", end=" ", file=sys.stderr, flush=True)
                    plan = None
                    if planned:
                        idx = torch.zeros(args.batch, cfg.block_size, dtype=torch.long)
                        plan = autoshard.plan(lambda: GPT(cfg), idx, idx, world_size=world, profile=args.profile, precisions=(precision,))
                    row = {"shape": shape, "world": world, **measure(cfg, world, args.batch, schedule, args.profile, precision, plan)}
                    print(f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
                    base = base or row
                    row["step_vs_" + base["schedule"]] = row["step_ms"] / base["step_ms"]
                    rows.append(row)
    print(f"GPT, seq {args.seq}, batch {args.batch}/rank, profile {args.profile} (predicted by the simulator); step_vs_ is to the "
          "first row of each shape and world")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
