"""Time to save a sharded checkpoint and to load it at the same and at another world size.

Trains the example GPT one step on --save-world CPU ranks (gloo), saves model + AdamW state,
loads it back on the same ranks, then on --load-world ranks (resharding), and gathers a full
state dict. Times are the slowest rank's, between barriers:

    python bench/checkpoint.py                                  # 4 layers x 256, save at 4, load at 2
    python bench/checkpoint.py --n-layer 8 --n-embd 512 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import autoshard  # noqa: E402
from autoshard.runtime.checkpoint import full_state_dict, load, save  # noqa: E402
from autoshard.tools.launch import run_ranks  # noqa: E402

from train_gpt import build_model  # noqa: E402


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _setup(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = autoshard.shard(build_model(args.n_layer, args.n_embd, block_size=args.seq))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def _save_and_reload(args: argparse.Namespace, path: str) -> list[dict]:
    model, optimizer = _setup(args)
    idx = torch.randint(0, model.cfg.vocab_size, (2, args.seq))
    model(idx, idx).backward()  # one step: AdamW state exists
    optimizer.step()
    optimizer.zero_grad()
    world = dist.get_world_size()
    rows = [{"op": "save", "from_world": world, "to_world": world, "s": _timed(lambda: save(path, model, optimizer))}]
    fresh, fresh_opt = _setup(args)
    rows.append({"op": "load", "from_world": world, "to_world": world, "s": _timed(lambda: load(path, fresh, fresh_opt))})
    rows.append({"op": "full_state_dict", "from_world": world, "to_world": 1, "s": _timed(lambda: full_state_dict(model))})
    return rows


def _reload(args: argparse.Namespace, path: str) -> list[dict]:
    model, optimizer = _setup(args)
    return [{"op": "load (reshard)", "from_world": args.save_world, "to_world": dist.get_world_size(),
             "s": _timed(lambda: load(path, model, optimizer))}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64, help="block size (position embedding rows)")
    parser.add_argument("--save-world", type=int, default=4)
    parser.add_argument("--load-world", type=int, default=2)
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(args.dir or tmp, "ckpt")
        rows = run_ranks(args.save_world, _save_and_reload, args, path, timeout=None)[0]
        rows += run_ranks(args.load_world, _reload, args, path, timeout=None)[0]
        mb = sum(f.stat().st_size for f in Path(path).iterdir()) / 1e6
    for row in rows:
        if row["op"] != "full_state_dict":
            row.update(mb=mb, mb_per_s=mb / row["s"])
    params = sum(p.numel() for p in build_model(args.n_layer, args.n_embd, block_size=args.seq).parameters()) / 1e6
    print(f"GPT {args.n_layer} layers x {args.n_embd}, {params:.2f}M parameters, AdamW; "
          f"checkpoint = model + optimizer state (CPU, gloo, local disk)")
    print(tabulate(rows, headers="keys", floatfmt=".3f"))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
