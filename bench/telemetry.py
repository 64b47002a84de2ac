"""What autoshard.Telemetry costs: the example GPT's step with telemetry on against off, same run.

    python bench/telemetry.py                       # 2 gloo ranks, inductor, about 2 min on 2 cores
    python bench/telemetry.py --compiler aot_eager --rounds 5

In one launch of 2 gloo ranks, two copies of the same sharded model are compiled, one with the
backend option ``telemetry`` (every collective's wait timed, each step recorded and exchanged
every 10 steps) and one without; then ``--rounds`` rounds of ``--steps`` steps run each in
turn (so anything else loading the machine falls on both alike) and the medians of each
step's time, taken by the slowest rank, are printed with their ratio. Target: <= 1.03x.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import autoshard  # noqa: E402
from autoshard.tools.launch import run_ranks  # noqa: E402

from train_gpt import build_model  # noqa: E402

BATCH, SEQ = 16, 64


def _train(compiler: str, rounds: int, steps: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    x = torch.randint(0, 96, (BATCH, SEQ))
    runs = {}
    for name, on in (("off", False), ("on", True)):
        model = autoshard.shard(build_model(n_layer=4, n_embd=256, n_head=8))
        compiled = torch.compile(model, backend="autoshard", options={"compiler": compiler, "telemetry": on})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        recorder = autoshard.Telemetry(model) if on else None
        runs[name] = (compiled, optimizer, recorder)
        for _ in range(2):  # compile and warm up
            _step(compiled, optimizer, recorder, x)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for name, (compiled, optimizer, recorder) in runs.items():
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                _step(compiled, optimizer, recorder, x)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
                times[name].append(elapsed.item())
    return times


def _step(compiled, optimizer, recorder, x) -> None:
    def work() -> None:
        loss = compiled(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    if recorder is None:
        work()
    else:
        with recorder.step(tokens=x.numel()):
            work()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    times = run_ranks(2, _train, args.compiler, args.rounds, args.steps, timeout=1200)[0]
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"torch {torch.__version__}, 2 gloo ranks, {args.compiler}, {args.rounds} rounds x {args.steps} steps each")
    print(f"median step: telemetry off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms: {on / off:.3f}x")


if __name__ == "__main__":
    main()
