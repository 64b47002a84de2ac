"""Train a small character-level GPT, fully sharded with autoshard.

    python examples/train_gpt.py                            # starts 2 CPU ranks on gloo itself
    torchrun --nproc-per-node 8 examples/train_gpt.py       # uses the launched group (NCCL on CUDA)
    python examples/train_gpt.py --steps 10 --save ckpt     # save at the end (--save-every N: also every N steps)
    python examples/train_gpt.py --world-size 4 --steps 20 --resume ckpt   # go on from step 10 on 4 ranks
    python examples/train_gpt.py --world-size 4 --strategy hybrid --replicas 2   # HSDP on a 2x2 mesh
    python examples/train_gpt.py --precision bf16 --grad-accum 2 --clip 1.0     # bf16 compute, 2 micro-batches
    python examples/train_gpt.py --meta-init     # build on the meta device, initialise only each rank's shards

Each rank trains on its own slice of every batch and (strategy "full", the default) stores
1/world of the parameters, gradients and optimizer state; the loss printed is the average
over ranks.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
import autoshard  # noqa: E402
from autoshard.tools.launch import exit_without_finalization, run_ranks  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "data" / "tiny.txt"
VOCAB = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII: 96 symbols


def build_model(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, block_size: int = 64) -> GPT:
    """The example's GPT (the factory `autoshard explain` can load)."""
    return GPT(GPTConfig(vocab_size=len(VOCAB), block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd))


def load_corpus() -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([index.get(ch, 0) for ch in CORPUS.read_text()], dtype=torch.long)


def get_batch(data: torch.Tensor, step: int, batch_size: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank (seeded by step)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - block - 1, (batch_size,), generator=g)
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
    return x, y


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    if args.meta_init:  # big-model init: no rank ever holds the whole model
        with torch.device("meta"):
            model = build_model(args.n_layer, args.n_embd)
    else:
        model = build_model(args.n_layer, args.n_embd).to(device)
    full_bytes = sum(p.nbytes for p in model.parameters())
    mesh = None
    if args.strategy == "hybrid":  # sharded within groups of world / replicas ranks, replicated across
        if world % args.replicas:
            raise SystemExit(f"--replicas {args.replicas} does not divide the world size {world}")
        mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas))
    precision = autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.precision == "bf16" else None
    gathers, reductions = args.compress in ("int8", "int8_gathers"), args.compress in ("int8", "int8_reductions")
    compression = autoshard.Compression(gather="int8" if gathers else None, reduce="int8" if reductions else None)  # lossy
    autoshard.shard(model, mesh, strategy=args.strategy, mixed_precision=precision, compression=compression)
    if args.meta_init:  # allocate this rank's shards and run the model's own init on them
        autoshard.materialize(model, device, init=lambda m: m.init_weights())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after shard: it sees the shards
    compiled = model if args.compiler == "none" else torch.compile(model, backend="autoshard", options={"compiler": args.compiler})

    start = 0
    if args.resume:  # any world size: the checkpoint is resharded on load
        start = autoshard.load(args.resume, model, optimizer)["step"]
        if rank == 0:
            print(f"resumed from {args.resume} at step {start}", flush=True)
    data = load_corpus()
    per_rank = args.batch_size // world
    if per_rank % args.grad_accum:
        raise SystemExit(f"--grad-accum {args.grad_accum} does not divide the {per_rank} sequences each rank gets per step")
    for step in range(start, args.steps):
        x, y = get_batch(data, step, per_rank * world, model.cfg.block_size)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        mean_loss = torch.zeros((), device=device)
        for micro, (xm, ym) in enumerate(zip(x[mine].chunk(args.grad_accum), y[mine].chunk(args.grad_accum))):
            # Gradients are reduced across ranks only on the last micro-batch.
            model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            loss = compiled(xm.to(device), ym.to(device)) / args.grad_accum
            loss.backward()
            mean_loss += loss.detach().float()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # the global norm over all shards
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step:3d}  loss {mean_loss.item() / world:.4f}", flush=True)
        if args.save and (step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0):
            autoshard.save(args.save, model, optimizer, extra={"step": step + 1})  # each rank writes its shards
            if rank == 0:
                print(f"saved step {step + 1} to {args.save}", flush=True)

    shard_bytes = sum(p.to_local().nbytes for p in model.parameters())
    state_bytes = sum(t.to_local().nbytes for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    per_rank = [torch.zeros(2, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(per_rank, torch.tensor([shard_bytes, state_bytes], device=device))
    if rank == 0:  # one writer: lines from several processes would interleave
        for r, (shard, state) in enumerate(t.tolist() for t in per_rank):
            print(f"rank {r}: parameter shard {shard / 1e3:.1f} kB of {full_bytes / 1e3:.1f} kB "
                  f"({shard / full_bytes:.3f}), optimizer state {state / 1e3:.1f} kB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--compiler", choices=["inductor", "aot_eager", "eager", "none"],
                        help="autoshard's inner compiler (default: inductor on CUDA, aot_eager on CPU, where "
                        "Inductor spends ~30 s compiling C++); 'none' runs the sharded model uncompiled")
    parser.add_argument("--world-size", type=int, default=2, help="CPU ranks to start when not under torchrun")
    parser.add_argument("--strategy", choices=["full", "grad_op", "replicate", "hybrid"], default="full",
                        help="full: ZeRO-3; grad_op: ZeRO-2 (parameters stay gathered from forward to backward); "
                        "replicate: DDP; hybrid: HSDP, sharded within groups and replicated across --replicas groups")
    parser.add_argument("--replicas", type=int, default=2, help="with --strategy hybrid: how many replicas of the shards")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: gather and compute in bfloat16, reduce gradients and keep parameters and "
                        "optimizer state in float32")
    parser.add_argument("--compress", choices=["none", "int8_gathers", "int8_reductions", "int8"], default="none",
                        help="gather parameters and/or reduce gradients as int8 with block-wise scales (lossy; int8: both)")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N", help="micro-batches per step (gradient accumulation)")
    parser.add_argument("--clip", type=float, default=0.0, metavar="NORM", help="clip gradients to this global norm")
    parser.add_argument("--meta-init", action="store_true",
                        help="build the model on the meta device and initialise only each rank's shards "
                        "(the same values as the default, from the same seed)")
    parser.add_argument("--save", metavar="DIR", help="save a checkpoint (model + optimizer) to DIR after the last step")
    parser.add_argument("--save-every", type=int, default=0, metavar="N", help="with --save: also every N steps")
    parser.add_argument("--resume", metavar="DIR", help="load the checkpoint in DIR and go on from its step")
    args = parser.parse_args()
    args.compiler = args.compiler or ("inductor" if torch.cuda.is_available() else "aot_eager")
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        exit_without_finalization()  # gloo can abort in Python's shutdown otherwise (see its docstring)
    run_ranks(args.world_size, train, args, timeout=None)  # each rank a process, all on this machine


if __name__ == "__main__":
    main()
