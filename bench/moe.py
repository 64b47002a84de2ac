"""Expert parallelism vs gathered experts, measured side by side on gloo CPU ranks.

The example MoE GPT (examples/moe_gpt.py: 8 experts, top-2) is sharded twice in the same
ranks: ``autoshard.shard(model)`` (the default: experts sharded like any parameter and
gathered whole where used) and ``autoshard.shard(model, experts="parallel")`` (each rank keeps
8 / N whole experts; tokens travel by all-to-all). Both are compiled with the autoshard backend
(aot_eager inner compiler) and run eagerly (autoshard's ops run their collectives as called),
warmed up, then timed in alternating turns (one step of each of the four per turn, the order
flipped every turn) so that load from other processes hits both alike. Peak
memory is bench/real.py's: the state kept between steps plus the highest rise during a
profiled step.

    python bench/moe.py                      # 2 and 4 ranks
    python bench/moe.py --worlds 4 --turns 10

Note: the gathered model's experts loop over the experts with data-dependent token counts, run
eagerly (one graph break per layer, as ``transformers``' eager experts would give); expert
parallelism's one op per layer is what removes those breaks, so the compiled rows compare that
too. The eager rows compare the communication alone.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_gpt import MoEConfig, MoEGPT  # noqa: E402
from real_memory import peak_rise, state_bytes  # noqa: E402

import autoshard  # noqa: E402
from autoshard.tools.launch import run_ranks  # noqa: E402

from real import train_step  # noqa: E402

MODES = ("gathered", "parallel")
SYSTEMS = [(mode, compiled) for compiled in (False, True) for mode in MODES]


def _setup(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    cfg = MoEConfig(n_embd=args.width, expert_hidden=args.expert_hidden, n_layer=args.layers, block_size=args.seq)
    base = MoEGPT(cfg)
    systems = {}
    for mode, compiled in SYSTEMS:
        model = autoshard.shard(copy.deepcopy(base), experts=mode)
        run = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"}) if compiled else model
        systems[mode, compiled] = (run, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return systems


def _measure(args: argparse.Namespace) -> dict:
    # The same tokens on every rank: the gathered model's graph breaks at data-dependent sizes,
    # and ranks routing differently would compile different graphs and gather out of step.
    torch.manual_seed(1)
    batches = [(torch.randint(0, 96, (args.batch, args.seq)), torch.randint(0, 96, (args.batch, args.seq))) for _ in range(4)]
    systems = _setup(args)
    for system in SYSTEMS:  # warm up: compile (and the gathered model's recompiles)
        for i in range(3):
            train_step(systems[system][0], systems[system][2], *batches[i % 4])
    times = {s: [] for s in SYSTEMS}
    for turn in range(args.turns):
        for system in SYSTEMS if turn % 2 == 0 else SYSTEMS[::-1]:
            run, _, opt = systems[system]
            times[system].append(train_step(run, opt, *batches[turn % 4])[1])
    result = {}
    for system in SYSTEMS:
        run, model, opt = systems[system]
        persistent = state_bytes(run, model, opt)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            train_step(run, opt, *batches[0])
            with record_function("measured_step"):
                train_step(run, opt, *batches[1])
        result[system] = {"step_s": statistics.median(times[system]), "peak_bytes": persistent + peak_rise(prof, "measured_step")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--expert-hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    args = parser.parse_args()
    print(f"MoE GPT: width {args.width}, 8 experts of {args.expert_hidden}, top-2, {args.layers} layers, "
          f"{args.batch}x{args.seq} tokens per rank; median of {args.turns} alternating turns, AdamW step included")
    print(f"{'ranks':>5} {'run':>8} {'gathered step':>14} {'parallel step':>14} {'step ratio':>10} {'gathered peak':>14} "
          f"{'parallel peak':>14} {'peak ratio':>10}")
    for world in args.worlds:
        per_rank = run_ranks(world, _measure, args, timeout=1800)
        for compiled in (False, True):
            g = {k: max(r["gathered", compiled][k] for r in per_rank) for k in ("step_s", "peak_bytes")}
            p = {k: max(r["parallel", compiled][k] for r in per_rank) for k in ("step_s", "peak_bytes")}
            print(f"{world:>5} {'compiled' if compiled else 'eager':>8} {g['step_s'] * 1e3:>11.1f} ms {p['step_s'] * 1e3:>11.1f} ms "
                  f"{p['step_s'] / g['step_s']:>9.2f}x {g['peak_bytes'] / 2**20:>10.2f} MiB {p['peak_bytes'] / 2**20:>10.2f} MiB "
                  f"{p['peak_bytes'] / g['peak_bytes']:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
