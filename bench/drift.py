"""A cluster that drifts: the slow rank changes halfway; adaptive batch shares against an equal
split and a split planned once at the start.

    python bench/drift.py                      # 2 gloo ranks, aot_eager, about 2 min on 2 cores
    python bench/drift.py --steps 40 --compiler inductor

hetero.py's emulation (each rank pinned to its own core, one thread; a busy process on a rank's
core gives that rank about half of it), but the busy process moves: on rank 0's core for the
first half of the steps, on rank 1's for the second. Three policies run in turn, each both
halves: "equal" (the global batch split evenly), "planned" (split once at the start by the
speeds timed then, ``autoshard.batch_sizes``; right for the first half, wrong for the second)
and "adaptive" (``autoshard.Telemetry(adapt_shares=True)``: re-split every 2 steps from each
rank's measured busy time). Each step is timed by the slowest rank; printed: each policy's
median step per half, and the ratios. Targets (issue 50): adaptive <= 0.8x equal in each half,
<= 0.85x planned in the second half.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.distributed as dist
from hetero import GLOBAL_BATCH, _batch, _cores, _model, _pin, _speed
from torch import nn

import autoshard
from autoshard.tools.launch import run_ranks


def _spin(core: int, parent: int) -> None:
    """Spin on ``core`` until killed, or until the rank that started it is gone."""
    os.sched_setaffinity(0, {core})
    while os.getppid() == parent:
        for _ in range(100_000):
            pass


def _hog(core: int) -> mp.Process:
    """A busy process on ``core`` (forked: it spins at once)."""
    hog = mp.get_context("fork").Process(target=_spin, args=(core, os.getpid()), daemon=True)
    hog.start()
    return hog


def _drift(compiler: str, steps: int, every: int, damping: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cores = _cores()
    _pin(rank)
    model = autoshard.shard(_model(), batch_shares=[GLOBAL_BATCH // world] * world)
    run = torch.compile(model, backend="autoshard", options={"compiler": compiler, "telemetry": True})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()

    def step(i: int, recorder: autoshard.Telemetry | None) -> float:
        x, y = autoshard.split_batch(_batch(i), model)
        dist.barrier()
        start = time.perf_counter()
        with recorder.step(tokens=x.shape[0]) if recorder is not None else contextlib.nullcontext():
            loss_fn(run(x), y).backward()
            opt.step()
            opt.zero_grad()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends with the slowest rank
        return took.item()

    hog = _hog(cores[0]) if rank == 0 else None  # the first half's slow rank: 0
    dist.barrier()
    speeds = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(speeds, torch.tensor([_speed(GLOBAL_BATCH // world)]))
    planned = autoshard.batch_sizes([s.item() for s in speeds], GLOBAL_BATCH)
    # Marks the model adaptive before its first step: one graph with a dynamic batch dimension serves every split.
    autoshard.Telemetry(model, adapt_shares=True, global_batch=GLOBAL_BATCH)
    step(0, None)  # compile
    found: dict[str, list[list[float]]] = {}
    splits: dict[str, list[list[int]]] = {}
    for policy in ("equal", "planned", "adaptive"):
        fixed = planned if policy == "planned" else [GLOBAL_BATCH // world] * world  # (adaptive: where it starts)
        autoshard.set_batch_shares(model, fixed)
        recorder = autoshard.Telemetry(model, every=every, adapt_shares=True, global_batch=GLOBAL_BATCH, damping=damping) \
            if policy == "adaptive" else None
        found[policy], splits[policy] = [[], []], []
        for half in (0, 1):
            if rank == 0:
                if hog is not None:
                    hog.kill()
                    hog.join()
                hog = _hog(cores[half % len(cores)])
            dist.barrier()
            for i in range(steps):
                found[policy][half].append(step(1 + half * steps + i, recorder))
                splits[policy].append(list(recorder.sizes if recorder is not None else fixed))
        if recorder is not None:
            recorder.close()
        # The next policy starts where the drift starts: the busy process back on rank 0's core.
        if rank == 0:
            hog.kill()
            hog.join()
            hog = _hog(cores[0])
        dist.barrier()
    if hog is not None:
        hog.kill()
        hog.join()
    return {"planned": planned, "median": {p: [statistics.median(h) for h in halves] for p, halves in found.items()},
            "splits": splits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per half")
    parser.add_argument("--every", type=int, default=2, help="adaptive: steps between re-splits")
    parser.add_argument("--damping", type=float, default=0.5, help="adaptive: the part of the way to the measured split taken")
    parser.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor"])
    args = parser.parse_args()
    out = run_ranks(2, _drift, args.compiler, args.steps, args.every, args.damping, timeout=1800)[0]
    m = out["median"]
    print(f"torch {torch.__version__}, 2 gloo ranks, cores {_cores()}, {args.compiler}, global batch {GLOBAL_BATCH}, "
          f"{args.steps} steps per half, adaptive every {args.every} steps, damping {args.damping}; slow rank 0 then 1; "
          f"planned split {out['planned']}")
    print(f"{'policy':<9} {'half 1 ms':>10} {'half 2 ms':>10}")
    for policy, (first, second) in m.items():
        print(f"{policy:<9} {first * 1e3:>10.1f} {second * 1e3:>10.1f}")
    print(f"adaptive / equal: {m['adaptive'][0] / m['equal'][0]:.2f}x, {m['adaptive'][1] / m['equal'][1]:.2f}x; "
          f"adaptive / planned (half 2): {m['adaptive'][1] / m['planned'][1]:.2f}x")
    print(f"adaptive splits (rank 0's samples, per step): {[s[0] for s in out['splits']['adaptive']]}")


if __name__ == "__main__":
    main()
