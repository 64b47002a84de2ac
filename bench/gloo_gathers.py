"""Why autoshard gathers into buffers over gloo (passes/gloo.py): a stress test of both forms.

Two gloo ranks issue N all-gathers of fresh tensors before waiting on any, R rounds, with
allocations in between, once per form, each in fresh processes:

    python bench/gloo_gathers.py                       # 4 in flight, 20000 rounds
    python bench/gloo_gathers.py --in-flight 8 --rounds 5000

Prints, per form, whether it survived (and its time) or how the ranks died. Measured here on
torch 2.11, 2.13 and 2.15: out-of-place (all_gather_into_tensor) aborts in malloc with a
corrupted heap within 20 s at 4 in flight; into a buffer (all_gather_into_tensor_out)
survives 20000 rounds at 4 and at 8. Rerun it on a new torch release before dropping the pass.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from autoshard._compat import c10d
from autoshard.tools.launch import run_ranks


def _stress(form: str, in_flight: int, rounds: int) -> bool:
    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    for i in range(rounds):
        shards = [torch.randn(256 + (i + k) % 7) for k in range(in_flight)]
        if form == "out-of-place":
            issued = [c10d.all_gather_into_tensor(s, world, group) for s in shards]
        else:
            issued = [c10d.all_gather_into_tensor_out(s, world, group, out=s.new_empty(world * s.numel())) for s in shards]
        del shards  # as a compiled graph frees them after the issue
        scratch = [torch.empty(10) + 1 for _ in range(50)]  # the main thread allocates meanwhile
        for g in issued:
            c10d.wait_tensor(g)
        del scratch
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20000)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks, {args.in_flight} gathers in flight, {args.rounds} rounds")
    for form in ("out-of-place", "into a buffer"):
        start = time.perf_counter()
        try:
            run_ranks(2, _stress, form, args.in_flight, args.rounds, timeout=600)
            outcome = "survived"
        except RuntimeError as e:  # a rank died: run_ranks names its exit code first
            outcome = "died: " + str(e).split(";")[0].split(": ", 1)[-1]
        print(f"{form:>14}: {outcome} after {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
