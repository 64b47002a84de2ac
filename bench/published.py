"""The simulator against published GPU runs: torchtitan's Llama 3.1 8B FSDP runs on H100s.

Replays each run of torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` (Tables 1 and
3: Llama 3.1 8B, FSDP, local batch 2, seq 8192, bf16 parameters and float32 reductions,
selective activation checkpointing, eager and torch.compile, 8 and 128 H100s of Grand Teton
hosts) on the simulator: the model (bench/llama3.py) compiled on fake ranks with FSDP2's
schedule (``schedule="fsdp2"``: prefetch the next block, one reduce-scatter in flight, the
last block kept gathered: torchtitan's settings), played on a device profile, and printed
against the published tokens/s/GPU and memory with their ratios; then autoshard's own
predicted step and memory for the same job (its default schedule, and optionally the layout
``autoshard.plan`` picks):

    python bench/published.py                          # the four runs, h100_grand_teton (~10 min)
    python bench/published.py --profile h100           # on another profile
    python bench/published.py --plan                   # also autoshard.plan's choice (slow)
    python bench/published.py --set nic_per_rank=False # a profile figure replaced
    python bench/published.py --a100                   # the second system: torchtitan's FSDP2 on 64 A100

The simulator plays the unfused graph (eager PyTorch's kernels); a compiled run's step is that
less what fusing each block's memory-bound ops saves (autoshard/cost/fusion.py).

Memory, as torchtitan reports it, is the caching allocator's peak *reserved* bytes: predicted by
replaying three steps' tensor storages through a model of PyTorch's caching allocator
(autoshard/cost/allocator.py, ``autoshard.cost.reserved.reserved_memory``) with expandable segments, as torchtitan's
launcher ran it (``PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"`` in run_llama_train.sh
at 9dec370), AdamW's two float32 states per shard allocated at the first optimizer step and
the foreach AdamW's one temporary per shard each step. The columns also show the simulator's
peak of live tensors plus the AdamW states (``live_gib``: the prediction before the allocator
term) and the default allocator's reserved peak (``default_alloc_gib``, no expandable
segments). Tokens/s/GPU is the local batch's tokens over the predicted step. The optimizer
step's time is not simulated.
"""
from __future__ import annotations

import argparse
import ast
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama3 import LLAMA3_8B, Llama3, LlamaConfig  # noqa: E402

import autoshard  # noqa: E402
from autoshard.cost.cost_model import get_profile  # noqa: E402
from autoshard.cost.fusion import fusion_savings, module_path, unmaterialized  # noqa: E402
from autoshard.cost.reserved import reserved_memory  # noqa: E402

BF16 = autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ADAMW_STATES = 2  # float32 tensors per parameter shard (exp_avg, exp_avg_sq)
HBM_GIB = 96e9 / 2**30  # Grand Teton's H100: 96 GB of HBM2e, the plan's memory budget
FOREACH_TEMPORARIES = 1  # torch's foreach AdamW (torchtitan's default, foreach=True): exp_avg_sq_sqrt per shard
STEPS = 3  # steps replayed through the allocator: the first allocates AdamW's states, then steady state
SOURCE = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3 (commit 9dec370, 2024-12-26)"


@dataclass(frozen=True)
class Published:
    """One published run: its world size, whether torch.compile was on, and what it reported."""

    world: int
    compiled: bool
    tokens_per_s: float  # per GPU
    memory_gib: float | None  # peak reserved, per GPU (None: not published)
    batch: int = 2
    seq: int = 8192


RUNS = (
    Published(8, False, 5762, 82.4),
    Published(8, True, 6667, 77.0),
    Published(128, False, 5605, 67.0),
    Published(128, True, 6514, 62.0),
)


# A second published system: torchtitan's FSDP2 on 64 A100 80GB (docs/performance.md, "Llama 3
# performance numbers", torchtitan commit 0413364): Llama 3 8B, local batch 1 (seq 8192),
# selective op AC, eager, 2,973 tokens/s/GPU (no memory published). Its machine as the `a100`
# profile (DGX A100) with a NIC per GPU: a DGX A100 has eight 200 Gb/s HDR NICs for its
# compute fabric, one per GPU (the DGX A100 user guide, the `a100` profile's own source).
A100_SOURCE = "torchtitan docs/performance.md, Llama 3 table, 8B selective op AC (commit 0413364, 2024)"
A100_RUNS = (Published(64, False, 2973, None, batch=1),)


def a100_profile() -> Any:
    """The `a100` profile with a NIC per GPU, as a DGX A100 has them."""
    return replace(get_profile("a100"), name="a100_nic_per_gpu", nic_per_rank=True)


def _factory(cfg: LlamaConfig) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        # Called inside explain's fake world: shard over all of it, in torchtitan's precision.
        return autoshard.shard(Llama3(cfg), mixed_precision=BF16)
    return make


def in_block(node: torch.fx.Node) -> bool:
    """Whether ``node`` comes from a transformer block: what torchtitan's torch.compile
    compiles (each block apart; embedding, final norm, output and loss stay eager)."""
    return ".layers." in module_path(node)


def simulate(cfg: LlamaConfig, run: Published, profile: Any, schedule: str) -> dict[str, float]:
    """Predicted step (s), tokens/s/GPU and memory (GiB, AdamW state included) of ``run``
    with ``schedule``, and the step's compute and exposed communication. A compiled run's
    step is the simulated (unfused, eager) step less what fusing each block's memory-bound
    ops saves (:func:`autoshard.cost.fusion.fusion_savings`); compute runs on one
    stream, so the saving comes off the step whole (the exposed communication held as
    simulated)."""
    return _figures(*_played(cfg, run, profile, schedule), run)


def _played(cfg: LlamaConfig, run: Published, profile: Any, schedule: str) -> tuple[dict[str, Any], float]:
    """The simulator's metrics of ``run``'s step (eager: unfused) and the seconds fusing its
    blocks would save."""
    tokens = torch.zeros(run.batch, run.seq, dtype=torch.long)
    report = autoshard.explain(_factory(cfg), tokens, tokens, world_size=run.world, profile=profile,
                               stages=("captured", "forward", "backward"), schedule=schedule)
    saved = sum(fusion_savings(report.stages[s], get_profile(profile), in_block).saved for s in ("forward", "backward"))
    metrics = dict(report.metrics)
    # Compiled: the blocks' fused intermediates are never allocated (ideal fusion, as the step's saving).
    fused = set().union(*(unmaterialized(report.stages[s], in_block) for s in ("forward", "backward")))
    for prefix, hidden in (("", ()), ("fused_", fused)):
        for key, expandable in (("reserved", True), ("default_reserved", False)):
            reserved = reserved_memory(report.simulation, steps=STEPS, expandable_segments=expandable,
                                       optimizer_states=ADAMW_STATES, optimizer_temporaries=FOREACH_TEMPORARIES,
                                       capacity=int(HBM_GIB * 2**30), unmaterialized=hidden)
            metrics[f"{prefix}{key}_bytes"] = reserved.peak_reserved_bytes
            metrics[f"{prefix}{key}_allocated_bytes"] = reserved.peak_allocated_bytes
    return metrics, saved


def _figures(m: dict[str, Any], saved: float, run: Published) -> dict[str, float]:
    """A run's figures from its job's metrics: a compiled run's step less what fusion ``saved``,
    its memory without the fused intermediates its blocks never allocate."""
    fused, mem = (saved, "fused_") if run.compiled else (0.0, "")
    step = m["step_time"] - fused
    return {"step_s": step, "tokens_per_s": run.batch * run.seq / step,
            "live_gib": (m["peak_bytes"] + ADAMW_STATES * m["shard_bytes"]) / 2**30,
            "memory_gib": m[f"{mem}reserved_bytes"] / 2**30, "default_alloc_gib": m[f"{mem}default_reserved_bytes"] / 2**30,
            "unfused_gib": m["reserved_bytes"] / 2**30, "allocated_gib": m["reserved_allocated_bytes"] / 2**30,
            "compute_s": m["compute_time"] - fused, "exposed_pct": 100 * m["exposed_comm"] / step,
            "fusion_saved_s": fused}


def planned(cfg: LlamaConfig, run: Published, profile: Any) -> dict[str, Any]:
    """``autoshard.plan``'s choice for ``run`` (bf16, within the GPU's memory) and its predicted
    step and memory."""
    tokens = torch.zeros(run.batch, run.seq, dtype=torch.long)
    plan = autoshard.plan(lambda: Llama3(cfg), tokens, tokens, world_size=run.world, profile=profile, precisions=("bf16",),
                          memory_budget_gb=HBM_GIB)
    out = plan.chosen
    return {"layout": plan.candidate.label(plan.ranks_per_node), "step_s": out.step_time,
            "tokens_per_s": run.batch * run.seq / out.step_time, "memory_gib": out.peak_bytes / 2**30}


def replay(profile: Any = "h100_grand_teton", cfg: LlamaConfig = LLAMA3_8B, runs: tuple[Published, ...] = RUNS,
           with_plan: bool = False, progress: Callable[[str], None] | None = None, with_autoshard: bool = True) -> list[dict[str, Any]]:
    """A row per published run: published and predicted tokens/s/GPU and memory with their
    ratios (FSDP2's schedule, the system that ran), then autoshard's default for the same job
    (unless ``with_autoshard`` is False: one compile per job instead of two), and with
    ``with_plan`` the layout ``autoshard.plan`` picks."""
    rows, seen = [], {}
    for run in runs:
        start = time.perf_counter()
        job = replace(cfg, seq_len=max(cfg.seq_len, run.seq))
        # One compile per job: the simulator plays the unfused (eager) graph, and a compiled
        # run's step is the eager one less what fusing its blocks saves.
        key = (run.world, run.batch, run.seq)
        if key not in seen:
            seen[key] = [_played(job, run, profile, s) for s in ("fsdp2", "autoshard")[:1 + with_autoshard]]
        fsdp2, *ours = (_figures(m, saved, run) for m, saved in seen[key])
        row = {"gpus": run.world, "compile": run.compiled,
               "published_tok_s": run.tokens_per_s, "predicted_tok_s": fsdp2["tokens_per_s"],
               "tok_s_ratio": fsdp2["tokens_per_s"] / run.tokens_per_s,
               "published_gib": run.memory_gib, "live_gib": fsdp2["live_gib"],
               "live_ratio": None if run.memory_gib is None else fsdp2["live_gib"] / run.memory_gib,
               "predicted_gib": fsdp2["memory_gib"],
               "gib_ratio": None if run.memory_gib is None else fsdp2["memory_gib"] / run.memory_gib,
               "default_alloc_gib": fsdp2["default_alloc_gib"], "unfused_gib": fsdp2["unfused_gib"],
               "allocated_gib": fsdp2["allocated_gib"],
               "step_s": fsdp2["step_s"], "compute_s": fsdp2["compute_s"], "exposed_pct": fsdp2["exposed_pct"]}
        for o in ours:
            row.update(autoshard_step_s=o["step_s"], autoshard_gib=o["memory_gib"], autoshard_vs_fsdp2=o["step_s"] / fsdp2["step_s"])
        if with_plan:
            p = planned(job, run, profile)
            row.update(plan_layout=p["layout"], plan_step_s=p["step_s"], plan_gib=p["memory_gib"])
        rows.append(row)
        if progress is not None:
            progress(f"{run.world} GPUs, compile={run.compiled}: {time.perf_counter() - start:.0f} s")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100_grand_teton", help="a named profile or a .json profile file")
    parser.add_argument("--worlds", nargs="+", type=int, default=[8, 128])
    parser.add_argument("--a100", action="store_true",
                        help="the second system instead: torchtitan's FSDP2 Llama 3 8B on 64 A100 (profile a100 with a NIC per GPU)")
    parser.add_argument("--plan", action="store_true", help="also autoshard.plan's choice (several compiles per run)")
    parser.add_argument("--set", nargs="+", default=[], metavar="FIGURE=VALUE",
                        help="replace profile figures, e.g. --set matmul_efficiency=1.0 attention_efficiency=None nic_per_rank=False")
    args = parser.parse_args()
    runs = A100_RUNS if args.a100 else tuple(r for r in RUNS if r.world in args.worlds)
    profile = a100_profile() if args.a100 else get_profile(args.profile)
    if args.set:  # one term off at a time: what each contributes (docs/published.md)
        profile = replace(profile, **{k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in args.set)})
    rows = replay(profile, runs=runs, with_plan=args.plan, progress=lambda s: print(s, file=sys.stderr, flush=True))
    changed = f" with {' '.join(args.set)}" if args.set else ""
    if args.a100:
        print(f"Llama 3 8B, FSDP2, local batch 1, seq 8192, selective op AC; profile {profile.name}{changed}; published: {A100_SOURCE}")
    else:
        print(f"Llama 3.1 8B, FSDP, local batch 2, seq 8192, selective AC; profile {args.profile}{changed}; published: {SOURCE}")
    print(tabulate([_formatted(r) for r in rows], headers="keys", disable_numparse=True))


def _formatted(row: dict[str, Any]) -> dict[str, str]:
    """Tokens/s whole, GiB to 0.1, ratios to 0.01, seconds to the ms, percentages to 0.1."""
    def text(key: str, value: Any) -> str:
        if not isinstance(value, float):
            return str(value)
        if key.endswith("tok_s"):
            return f"{value:,.0f}"
        if key.endswith("_s"):
            return f"{value:.3f}"
        return f"{value:.2f}" if "ratio" in key or "_vs_" in key else f"{value:.1f}"
    return {k: text(k, v) for k, v in row.items()}


if __name__ == "__main__":
    main()
