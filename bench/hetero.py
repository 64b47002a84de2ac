"""Mixed clusters, measured: equal batch split vs a speed-proportional split, one rank slowed.

    python bench/hetero.py                      # 2 and 4 gloo ranks, aot_eager, about 2 min on 2 cores
    python bench/hetero.py --worlds 2 --rounds 3 --compiler uncompiled
    python bench/hetero.py --shares 2,1         # a given split (e.g. a plan's) instead of the timed one

Emulating a slower device on a CPU box with one kind of core: every rank is pinned to its own
core (``os.sched_setaffinity``; rank r on the r-th usable core, modulo their number) and runs
one thread; a competing busy process (a Python spin loop) is pinned to the slow rank's core,
so the scheduler gives the slow rank about half that core: it computes at about half speed,
which is the A100-next-to-H100 ratio for dense matmuls. With 2 cores and 4 ranks, two ranks
share each core (ranks 0 and 2 on the first, 1 and 3 on the second): each runs at half a core,
and the busy process on the first core leaves ranks 0 and 2 a third of it each, so two of
the four ranks run at about 2/3 of the others' speed. Waiting in a gloo collective sleeps,
so a rank that waits gives its core to the ranks that share it.

Per world size, in one run and in fresh processes: each rank times the model's forward and
backward on a fixed local batch, alone (no collective), under the same pinning and load: its
speed. Three splits of the same global batch: equal; by speed (samples in proportion to speed,
``autoshard.batch_sizes``); and planned, which also counts the step's fixed work (collectives
and optimizer, which the slow core runs slowly too, see ``_planned``), read off one timed round
of the equal split. Then the sharded, compiled model (``autoshard.shard`` with
``batch_shares``) trains ``--rounds`` rounds of ``--steps`` steps, the three splits in turn
(so load from anything else on the machine falls on all alike), and the median step of each is
printed with the ratio planned / equal. Training under each split is exact (the gradient
reduction weights each rank by its share), so the ratio is the time saved, nothing traded.
Target at 2 ranks, one rank at half speed: planned <= 0.75x equal (ideal 2/3 with no fixed work).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.tools.launch import run_ranks

WIDTH, LAYERS, REPEATS, GLOBAL_BATCH = 512, 2, 8, 384


class _Reused(nn.Module):
    """LAYERS linear layers applied REPEATS times over: compute per step grows with the batch
    and the repeats, communication only with the parameters, so the batch split sets the step
    (a plain MLP this size is gloo-bound on CPU, and shifting samples would change little)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(REPEATS):
            for layer in self.layers:
                x = torch.tanh(layer(x))
        return self.head(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Reused()


def _batch(step: int, samples: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(samples, WIDTH, generator=g), torch.randn(samples, 1, generator=g)


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _pin(rank: int) -> int:
    cores = _cores()
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


def _spin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


def _speed(samples: int, seconds: float = 1.5) -> float:
    """Samples per second of forward and backward on this rank, alone (no collective), the
    median over ``seconds`` of repeats: its speed."""
    model, loss = _model(), nn.MSELoss()
    x, y = _batch(0)
    x, y = x[:samples], y[:samples]
    loss(model(x), y).backward()  # warm up
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        loss(model(x), y).backward()
        times.append(time.perf_counter() - start)
    return samples / statistics.median(times)


def _planned(speeds: list[float], global_batch: int, equal_step: float) -> list[float]:
    """Shares that finish every rank together when each step also holds fixed work (the
    collectives' CPU side and the optimizer, which under this emulation run on the slow core
    too): rank r's step is ``(fixed + b_r) / v_r`` with ``fixed`` in samples' worth of work.
    The equal split's measured step fixes it: the slowest rank sets that step, so
    ``fixed = equal_step * v_min - b_equal``. Equal finish under sum(b) = B then gives
    ``T = (B + n * fixed) / sum(v)`` and ``b_r = T * v_r - fixed``. With no fixed work this
    is the speed-proportional split."""
    world = len(speeds)
    fixed = max(0.0, equal_step * min(speeds) - global_batch / world)
    step = (global_batch + world * fixed) / sum(speeds)
    return [max(step * v - fixed, 1.0) for v in speeds]


def _train(compiler: str, rounds: int, steps: int, given: list[float] | None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    core = _pin(rank)
    speed = _speed(GLOBAL_BATCH // world)  # on the equal split's local batch
    speeds = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(speeds, torch.tensor([speed]))
    speeds = [s.item() for s in speeds]
    splits = {"equal": [GLOBAL_BATCH // world] * world, "speed": autoshard.batch_sizes(speeds, GLOBAL_BATCH)}
    model = autoshard.shard(_model(), batch_shares=splits["equal"])
    run = model if compiler == "uncompiled" else torch.compile(model, backend="autoshard", options={"compiler": compiler},
                                                               dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()

    def step(i: int) -> None:
        x, y = autoshard.split_batch(_batch(i), model)
        loss_fn(run(x), y).backward()  # the plain mean over this rank's samples: weighted by its share
        opt.step()
        opt.zero_grad()

    def timed(sizes: list[int]) -> float:
        autoshard.set_batch_shares(model, sizes)
        step(0)
        dist.barrier()
        start = time.perf_counter()
        for i in range(steps):
            step(i + 1)
        dist.barrier()
        return (time.perf_counter() - start) / steps

    for sizes in splits.values():  # warm up: compile both shapes
        autoshard.set_batch_shares(model, sizes)
        step(0)
    # The planned split: speeds plus the fixed work the equal split's step shows (every rank
    # takes the slowest rank's measure, so all plan the same split).
    equal_step = torch.tensor([timed(splits["equal"])])
    dist.all_reduce(equal_step, op=dist.ReduceOp.MAX)
    shares = given or _planned(speeds, GLOBAL_BATCH, equal_step.item())
    splits["planned"] = autoshard.batch_sizes(shares, GLOBAL_BATCH)
    autoshard.set_batch_shares(model, splits["planned"])
    step(0)  # compile its shape
    found: dict[str, list[float]] = {name: [] for name in splits}
    for r in range(rounds):
        for name, sizes in splits.items():
            found[name].append(timed(sizes))
    return {"core": core, "speed": speed, "speeds": speeds, "splits": splits,
            "step": {name: statistics.median(times) for name, times in found.items()}}


def _measure(world: int, args: argparse.Namespace) -> dict:
    cores = _cores()
    # Forked: spinning at once (a spawned one would still be importing when the ranks time themselves).
    hog = mp.get_context("fork").Process(target=_spin, args=(cores[0],), daemon=True)  # rank 0's core
    if args.slow:
        hog.start()
    try:
        given = [float(s) for s in args.shares.split(",")] if args.shares and len(args.shares.split(",")) == world else None
        return run_ranks(world, _train, args.compiler, args.rounds, args.steps, given, timeout=1800)[0]
    finally:
        if args.slow:
            hog.kill()
            hog.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor", "uncompiled"])
    parser.add_argument("--no-slow", dest="slow", action="store_false", help="no busy process: the control")
    parser.add_argument("--shares", default=None, help="the planned split for the world size with as many entries (default: timed)")
    args = parser.parse_args()
    cores = _cores()
    slow = cores[0] if args.slow else None
    print(f"torch {torch.__version__}, cores {cores}, busy process on core {slow}, {LAYERS} layers x {WIDTH} applied "
          f"{REPEATS} times, global batch {GLOBAL_BATCH}, {args.compiler}, {args.rounds} rounds x {args.steps} steps per split")
    print(f"{'ranks':>5}  {'speed (samples/s per rank)':<28} {'planned split':<20} {'equal ms':>9} {'by speed ms':>12} "
          f"{'planned ms':>11} {'ratio':>6}")
    for world in (int(w) for w in args.worlds.split(",")):
        started = time.perf_counter()
        found = _measure(world, args)
        speeds = ", ".join(f"{s:.0f}" for s in found["speeds"])
        equal, by_speed, planned = (found["step"][name] for name in ("equal", "speed", "planned"))
        print(f"{world:>5}  {speeds:<28} {str(found['splits']['planned']):<20} {equal * 1e3:>9.1f} {by_speed * 1e3:>12.1f} "
              f"{planned * 1e3:>11.1f} {planned / equal:>6.2f}   ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
