"""The simulator and the planner against torchtitan's published Llama 3.1 70B FSDP x TP run.

torchtitan's ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (June 2025, torchtitan
820504e, torch 38410cf9): Llama 3 70B on 256 H100s of Grand Teton hosts (96 GB HBM2e, 500 W, 400
Gb/s per GPU), FSDP 32 x TP 8, torch.compile, full activation checkpointing, local batch 16 (per
data-parallel rank: a global batch of 512 sequences), bf16: 597.3 tokens/s/GPU with vanilla TP,
652.4 with async TP. Sequence length: torchtitan's default for the 70B config, 8192.

This script, on the simulator (the ``h100_grand_teton`` profile of docs/published.md):

1. **replay**: that exact layout (full shard over dp 32, TP 8, bf16 parameters and float32
   reductions, FSDP2's schedule) compiled on 256 fake ranks, the step less what fusing each
   block's memory-bound ops saves (the run was compiled; autoshard/cost/fusion.py), tokens/s/GPU
   = local batch x 8192 / TP / step (the TP ranks of a data-parallel rank share its sequences);
2. **plans**: ``autoshard.plan(..., tensor_parallel=(1, 2, 4, 8))`` at 256, 1024 and 4096 ranks
   for the same global batch within the GPU's 96 GB, and the layout it picks and why.

80 blocks do not compile in minutes on a small machine: every compile here is of 2 and 4 blocks,
each figure extrapolated linearly to 80 (:class:`autoshard.tools.plan.tensor_parallel.Depth`).
The TP plan is torchtitan's (:func:`torchtitan_tp_plan`: Megatron's with sequence parallelism,
its loss parallelism priced), or with ``--tp-plan megatron`` Megatron's alone (norms, embedding and
output replicated over tp; docs/tensor_parallel_planning.md shows what that changes)::

    python bench/tensor_parallel.py                       # replay + plans at 256, 1024, 4096 (~3 min on 2 cores)
    python bench/tensor_parallel.py --worlds 1024 --global-batch 256
    python bench/tensor_parallel.py --no-plan             # the replay only
    python bench/tensor_parallel.py --tp-plan megatron    # without sequence parallelism
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama3 import Attention, Llama3, LlamaConfig, _rotate  # noqa: E402
from published import HBM_GIB, in_block  # noqa: E402

import autoshard  # noqa: E402
from autoshard.cost.cost_model import get_profile  # noqa: E402
from autoshard.cost.fusion import fusion_savings  # noqa: E402
from autoshard.tools.plan.layouts import Candidate  # noqa: E402
from autoshard.tools.plan.tensor_parallel import Depth, builder, local_inputs  # noqa: E402

# Llama 3.1 70B: dim 8192, 80 layers, 64 heads, 8 KV heads, FFN 28672, vocabulary 128256.
LLAMA3_70B = LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, seq_len=8192, ac="full")
SOURCE = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (torchtitan 820504e)"
PUBLISHED = {"vanilla TP": 597.3, "async TP": 652.4}  # tokens/s/GPU, bf16
WORLD, TP, LOCAL_BATCH, SEQ = 256, 8, 16, 8192
DEPTHS = (2, 4)  # blocks compiled; figures extrapolated to 80


class TPAttention(Attention):
    """bench/llama3.py's attention with its head counts read from the projections' widths: under
    tensor parallelism wq, wk and wv return this rank's heads."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = q.shape[2] // k.shape[2]  # GQA: each KV head serves rep query heads (the same ratio on every tp rank)
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


def llama(layers: int, cfg: LlamaConfig = LLAMA3_70B) -> nn.Module:
    model = Llama3(replace(cfg, n_layers=layers))
    for layer in model.layers:
        layer.attention.__class__ = TPAttention  # same parameters, width-read heads
    return model


def megatron_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Megatron's plan for bench/llama3.py's blocks: column-parallel wq, wk, wv, w1, w3,
    row-parallel wo, w2; norms, embedding and output replicated over tp."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        plan.update({f"{p}.attention.wq": ColwiseParallel(), f"{p}.attention.wk": ColwiseParallel(),
                     f"{p}.attention.wv": ColwiseParallel(), f"{p}.attention.wo": RowwiseParallel(),
                     f"{p}.feed_forward.w1": ColwiseParallel(), f"{p}.feed_forward.w3": ColwiseParallel(),
                     f"{p}.feed_forward.w2": RowwiseParallel()})
    return plan


def torchtitan_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """torchtitan's Llama plan (torchtitan/models/llama3/infra/parallelize.py, apply_tp): Megatron's
    plus sequence parallelism (the residual stream and the norms sharded by sequence over tp: the
    block's all-reduces become a gather before and a reduce-scatter after) and the embedding
    row-parallel. Its loss parallelism is priced, not built: the output projection returns this
    rank's vocabulary slice and the cross-entropy runs on it (the FLOPs, bytes and memory of
    torchtitan's loss_parallel, less its three all-reduces of batch x sequence floats). The loss
    value is then not the model's: a pricing plan for the simulator only."""
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=True),
    }
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        plan.update({f"{p}.attention_norm": SequenceParallel(), f"{p}.ffn_norm": SequenceParallel(),
                     f"{p}.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                          desired_input_layouts=(Replicate(), None, None)),
                     f"{p}.attention.wq": ColwiseParallel(), f"{p}.attention.wk": ColwiseParallel(),
                     f"{p}.attention.wv": ColwiseParallel(), f"{p}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                     f"{p}.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     f"{p}.feed_forward.w1": ColwiseParallel(), f"{p}.feed_forward.w3": ColwiseParallel(),
                     f"{p}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    return plan


TP_PLANS = {"torchtitan": torchtitan_tp_plan, "megatron": megatron_tp_plan}


def replay(tp_plan: Any = torchtitan_tp_plan, profile: str = "h100_grand_teton") -> dict[str, Any]:
    """torchtitan's layout on the simulator: step, tokens/s/GPU, memory (AdamW's two float32
    states per shard), each extrapolated from 2 and 4 blocks to 80."""
    c = Candidate("full", (WORLD // TP,), "bf16", tensor_parallel=TP)
    tokens = local_inputs((torch.zeros(1, SEQ, dtype=torch.long),), LOCAL_BATCH)[0]
    figures = []
    for n in DEPTHS:
        report = autoshard.explain(builder(lambda n=n: llama(n), c, tp_plan), tokens, tokens, world_size=WORLD, profile=profile,
                                   stages=("captured", "forward", "backward"), schedule="fsdp2")
        m = report.metrics
        saved = sum(fusion_savings(report.stages[s], get_profile(profile), in_block).saved for s in ("forward", "backward"))
        tp_comm = sum(t for g, t in report.simulation.analysis.comm_by_group.items()
                      if len(report.simulation.group_ranks.get(g, ())) == TP)
        figures.append((m["step_time"] - saved, m["exposed_comm"], m["peak_bytes"] + 2 * m["shard_bytes"], saved, tp_comm))
    (a, b), n = DEPTHS, LLAMA3_70B.n_layers
    step, exposed, memory, saved, tp_comm = (x + (y - x) * (n - a) / (b - a) for x, y in zip(*figures))
    # The TP ranks of a data-parallel rank share its local batch: tokens/s/GPU counts each once.
    return {"step_s": step, "tokens_per_s": LOCAL_BATCH * SEQ / TP / step, "memory_gib": memory / 2**30,
            "exposed_pct": 100 * exposed / step, "fusion_saved_s": saved, "tp_comm_s": tp_comm}


def planned(world: int, global_batch: int, tp_plan: Any = torchtitan_tp_plan, profile: str = "h100_grand_teton",
            degrees: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[Any, str]:
    """autoshard.plan's choice at ``world`` ranks for ``global_batch`` sequences, within 96 GB,
    among the tensor-parallel ``degrees``."""
    tokens = torch.zeros(1, SEQ, dtype=torch.long)
    try:
        plan = autoshard.plan(lambda: llama(LLAMA3_70B.n_layers), tokens, tokens, world_size=world, ranks_per_node=8, profile=profile,
                              memory_budget_gb=HBM_GIB, precisions=("bf16",), tensor_parallel=degrees, tp_plan=tp_plan,
                              global_batch=global_batch, depth=Depth(llama, LLAMA3_70B.n_layers, DEPTHS),
                              progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:  # no degree can run the batch (or fits): that is the answer
        return None, str(e)
    return plan, plan.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--global-batch", type=int, default=LOCAL_BATCH * WORLD // TP, help="sequences per step (512: torchtitan's)")
    parser.add_argument("--tp-plan", choices=sorted(TP_PLANS), default="torchtitan",
                        help="torchtitan's (sequence parallel, loss parallel priced; default) or Megatron's (no sequence parallelism)")
    parser.add_argument("--no-plan", action="store_true", help="the replay only")
    parser.add_argument("--no-replay", action="store_true", help="the plans only")
    args = parser.parse_args()
    if not args.no_replay:
        start = time.perf_counter()
        r = replay(TP_PLANS[args.tp_plan])
        print(f"Llama 3.1 70B, FSDP {WORLD // TP} x TP {TP} ({args.tp_plan} TP plan), local batch {LOCAL_BATCH} x {SEQ}, bf16, "
              "full AC, compiled; "
              f"h100_grand_teton; published: {SOURCE} ({time.perf_counter() - start:.0f} s)")
        rows = [{"run": name, "published tok/s/GPU": f"{v:,.1f}", "predicted": f"{r['tokens_per_s']:,.0f}",
                 "ratio": f"{r['tokens_per_s'] / v:.2f}"} for name, v in PUBLISHED.items()]
        print(tabulate(rows, headers="keys", disable_numparse=True))
        print(f"predicted step {r['step_s']:.2f} s (fusion saved {r['fusion_saved_s']:.2f} s), TP collectives {r['tp_comm_s']:.2f} s, "
              f"exposed communication {r['exposed_pct']:.1f}%, memory {r['memory_gib']:.1f} GiB (AdamW state included)\n")
    if args.no_plan:
        return
    table = []
    for world in args.worlds:
        start = time.perf_counter()
        plan, text = planned(world, args.global_batch, TP_PLANS[args.tp_plan])
        print(f"== {world} ranks, global batch {args.global_batch} x {SEQ} ({time.perf_counter() - start:.0f} s)\n{text}\n", flush=True)
        if plan is None:
            table.append({"ranks": world, "plan": "none", "why": text})
            continue
        o = plan.chosen
        table.append({"ranks": world, "plan": plan.candidate.label(8), "dp x tp": f"{plan.mesh_shape[0]} x {plan.tensor_parallel}",
                      "step s": f"{o.step_time:.2f}", "tok/s/GPU": f"{args.global_batch * SEQ / o.step_time / world:,.0f}",
                      "GiB": f"{o.peak_bytes / 2**30:.1f}"})
    print(tabulate(table, headers="keys", disable_numparse=True))


if __name__ == "__main__":
    main()
