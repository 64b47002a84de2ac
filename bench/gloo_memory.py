"""What gloo's collectives allocate, as the ``cpu`` profile's memory figures assume
(``GLOO_WORKSPACE``, ``GLOO_INPUT_COPIED`` in autoshard/cost/profiles.py; docs/design.md).

Two gloo ranks, a 16 MiB float32 full buffer (the gathered output of an all-gather, the input
of a reduce-scatter), torch.profiler's memory events:

    python bench/gloo_memory.py              # 16 MiB
    python bench/gloo_memory.py --mib 64

Prints per collective, on rank 0: ``workspace``, the highest rise of allocated bytes between
the issue and the end of the wait, less the output (the input is allocated before); ``input held
until the wait``, whether an input dropped right after the issue is still alive before the wait
(no: the collective works on a copy, the input is free from the issue on; yes: it reads the
input until it ends).
"""
from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_memory import peak_rise  # noqa: E402

from autoshard.tools.launch import run_ranks  # noqa: E402


def _issue(kind: str, full: int, world: int, given: torch.Tensor | None = None) -> tuple[object, torch.Tensor]:
    """Issue ``kind`` on a ``full``-element buffer; the work and the output it writes."""
    shard = full // world
    if kind == "all_gather":
        inp, out = (given if given is not None else torch.randn(shard)), torch.empty(full)
        return dist.all_gather_into_tensor(out, inp, async_op=True), out
    if kind == "reduce_scatter":
        inp, out = (given if given is not None else torch.randn(full)), torch.empty(shard)
        return dist.reduce_scatter_tensor(out, inp, async_op=True), out
    if kind == "all_to_all":  # how autoshard's graphs run a reduce-scatter over gloo (passes/gloo.py)
        inp, out = (given if given is not None else torch.randn(full)), torch.empty(full)
        return dist.all_to_all_single(out, inp, async_op=True), out
    inp = given if given is not None else torch.randn(full)
    return dist.all_reduce(inp, async_op=True), inp  # in place


def _measure(mib: int) -> dict:
    world, full = dist.get_world_size(), mib * 2**20 // 4
    rows = {}
    for kind in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce"):
        _issue(kind, full, world)[0].wait()  # warm up: gloo's first call sets up its buffers
        inputs = torch.randn(full // world if kind == "all_gather" else full)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("workspace"):
                work, out = _issue(kind, full, world, inputs)
                work.wait()
        dropped = torch.randn(inputs.numel())
        alive = weakref.ref(dropped)
        work, out = _issue(kind, full, world, dropped)
        del dropped  # only the collective may hold it now
        held = alive() is not None  # before the wait
        work.wait()
        output = 0 if kind == "all_reduce" else out.nbytes  # allocated in the window: not workspace
        rows[kind] = (peak_rise(prof, "workspace") - output, held)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=16, help="the full buffer's size (default: 16)")
    args = parser.parse_args()
    rows = run_ranks(2, _measure, args.mib)[0]
    print(f"2 gloo ranks, a {args.mib} MiB full buffer, torch {torch.__version__}")
    print(f"{'collective':16s} {'workspace MiB':>14s} {'input held until the wait':>26s}")
    for kind, (workspace, held) in rows.items():
        print(f"{kind:16s} {workspace / 2**20:14.1f} {'yes' if held else 'no':>26s}")


if __name__ == "__main__":
    main()
