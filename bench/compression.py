"""Quantized gathers and reductions on gloo ranks (CPU): bytes on the wire per step and step
time of float32, bfloat16 and int8 parameter gathers and of int8 gradient reductions, side by
side in one run.

On each world size it starts the ranks once and sets up the same GPT (same seed, same batches)
once per policy: ``fp32`` (no policy), ``bf16`` (``MixedPrecision(param_dtype=bfloat16,
reduce_dtype=float32)``: gathers and compute in bfloat16, reductions as fp32's) and ``int8``
(``Compression(gather="int8", block=256)``: int8 gathers with one float32 scale per 256
elements, dequantized to float32 after the gather), ``fp8`` (``Compression(gather="fp8",
block=256)``: the same with float8 e4m3 values, scale absmax / 448, the same bytes) and
``int8-reduce``
(``Compression(reduce="int8", block=256)``: float32 gathers, gradients reduced by an all-to-all
of int8 chunks, averaged in float32 on the receiver). Their timed steps take turns, one step of
each per round, so load that comes and goes slows them all alike. Bytes are read off the
compiled forward and backward graphs (the cost model's ``collective_of``: a gather's output,
a reduction's input, per rank); a step's time is the slowest rank's, the median over the steps.

    python bench/compression.py                       # GPT 4 x 512, seq 128, worlds 2 and 4
    python bench/compression.py --world-sizes 2 --steps 4 --policies fp32 int8-reduce
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import autoshard  # noqa: E402
from autoshard.compiler.dump import recording  # noqa: E402
from autoshard.cost.cost_model import collective_of  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402

POLICIES = {
    "fp32": {},
    "bf16": {"mixed_precision": autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
    "int8": {"compression": autoshard.Compression(gather="int8", block=256)},
    "fp8": {"compression": autoshard.Compression(gather="fp8", block=256)},
    "int8-reduce": {"compression": autoshard.Compression(reduce="int8", block=256)},
}


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)


class Variant:
    """One policy's model, set up and warmed up on this rank."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model = autoshard.shard(GPT(_config(args)), **POLICIES[name])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.compiled = torch.compile(self.model, backend="autoshard", options={"compiler": "aot_eager"})
        self.losses: list[float] = []
        self.times: list[float] = []
        with recording(stages=("forward", "backward")) as graphs:
            for step in range(args.warmup):
                self.step(args, step)
        self.bytes = Counter()  # kind -> bytes per step, as the compiled graphs move them
        for stages in graphs:
            for gm in stages.values():
                for node in gm.graph.nodes:
                    if (found := collective_of(node)) is not None:
                        self.bytes[found.kind] += found.nbytes

    def step(self, args: argparse.Namespace, step: int) -> float:
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # each rank its own slice
        x, y = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(2))
        dist.barrier()
        start = time.perf_counter()
        loss = self.compiled(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, dist.ReduceOp.MAX)  # the step takes as long as its slowest rank
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        self.losses.append(total.item() / dist.get_world_size())
        return elapsed.item()


def run_variants(args: argparse.Namespace) -> dict[str, dict]:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))  # ranks share the cores
    variants = [Variant(name, args) for name in args.policies]
    gc.collect()
    gc.freeze()
    for step in range(args.warmup, args.warmup + args.steps):
        for v in variants:  # one step of each per round
            v.times.append(v.step(args, step))
    gc.unfreeze()
    return {v.name: {"gather": v.bytes["all_gather"], "reduce": v.bytes["reduce_scatter"] + v.bytes["all_reduce"],
                     "step_s": statistics.median(v.times), "loss": v.losses[-1]} for v in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=96)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles in the first)")
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES),
                        help="which variants to run (the first is the baseline of the x columns)")
    args = parser.parse_args()
    params = sum(p.numel() for p in GPT(_config(args)).parameters())
    print(f"GPT {args.layers} layers x {args.embd}, {params / 1e6:.2f}M parameters, seq {args.seq}, batch {args.batch}/rank; "
          f"gloo on CPU, aot_eager, {args.steps} timed steps after {args.warmup}; bytes per rank per step (MiB)")
    print(f"{'world':>5} {'policy':>11} {'gather MiB':>10} {'x base':>7} {'reduce MiB':>10} {'x base':>7} {'step ms':>8} "
          f"{'x base':>7} {'loss':>7}")
    for world in args.world_sizes:
        rows = autoshard.launch.run_ranks(world, run_variants, args, timeout=None)[0]
        base = rows[args.policies[0]]
        for name, r in rows.items():
            print(f"{world:>5} {name:>11} {r['gather'] / 2**20:>10.2f} {r['gather'] / base['gather']:>7.3f} "
                  f"{r['reduce'] / 2**20:>10.2f} {r['reduce'] / base['reduce']:>7.3f} {r['step_s'] * 1e3:>8.1f} "
                  f"{r['step_s'] / base['step_s']:>7.3f} {r['loss']:>7.4f}")


if __name__ == "__main__":
    main()
