"""ZeRO++'s setting on the simulator: an 18B GPT on 384 V100s, compressed against uncompressed.

ZeRO++ (DeepSpeed, arXiv 2306.10209; its blog, blogs/zeropp in deepspeedai/DeepSpeed) reports on
384 V100s: with 4 InfiniBand links of 100 Gb/s per node (400 Gb/s), +28-36% throughput over
ZeRO-3 at 1k tokens per GPU and +24-29% at 2k; at 100 Gb/s between nodes up to 2.2x (about 2x
on average). This compiles a GPT of about 18B (40 layers of width 6144: 18.4B parameters) on
fake ranks in that setting (fp16 parameters and reductions, as ZeRO-3 on V100s) and plays each
variant's step on a V100 profile whose inter-node link is ``--gbps`` per node:

    python bench/zeropp.py                        # 100 and 400 Gb/s, 1k and 2k tokens per GPU
    python bench/zeropp.py --gbps 100 --tokens 1024 --world 384 --ranks-per-node 8

Variants (autoshard's default schedule for each):
- ``zero3``: full sharding, fp16 gathers and fp16 reduce-scatters (ZeRO-3's traffic: 3M);
- ``qwZ+qgZ``: int8 gathers and int8 reductions (``autoshard.Compression(gather="int8",
  reduce="int8")``; autoshard's reductions are int8 where ZeRO++'s are int4);
- ``qwZ+hpZ+qgZ``: the same with the backward gathers inside each node
  (``reshard_after_forward=ranks_per_node``), ZeRO++'s three together.

Cross-node bytes are what one rank sends per step over collectives whose group spans nodes
((n-1)/n of each one's full buffer), against ZeRO-3's: ZeRO++ states 3M -> 0.75M with int4
reductions (int8: 1M). The V100 profile (:func:`v100_profile`) comes from the stated hardware,
not from the published speedups; the speedup is ZeRO-3's predicted step over the variant's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import autoshard  # noqa: E402
from autoshard.cost.profiles import DeviceProfile, uniform_link  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402

GPT_18B = GPTConfig(vocab_size=50304, block_size=2048, n_layer=40, n_head=48, n_embd=6144)
FP16 = autoshard.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)
INT8 = autoshard.Compression(gather="int8", reduce="int8", block=256)
VARIANTS = ("zero3", "qwZ+qgZ", "qwZ+hpZ+qgZ")
PUBLISHED = {400: "+28-36% (1k), +24-29% (2k)", 100: "up to 2.2x, ~2x on average"}


def v100_profile(gbps_per_node: float, ranks_per_node: int) -> DeviceProfile:
    """A V100 SXM node whose nodes talk over ``gbps_per_node`` Gb/s in all.

    NVIDIA V100 SXM2 datasheet: fp16 tensor cores 125 TFLOP/s, fp32 15.7, HBM2 900 GB/s, NVLink
    2 at 300 GB/s bidirectional per GPU (150 per direction); ~80% of it as nccl-tests bus
    bandwidth, as the h100/a100 profiles take. Matmuls at 0.8 of the peak (the H100's measured
    fraction, none published for the V100 beside it). Between nodes: ZeRO++'s links (4 x 100 Gb/s
    per node, or one), ~90% reached, one ring paced by the node's links together (not a NIC per
    GPU: 8 or 16 GPUs share them).
    """
    return DeviceProfile(
        name=f"v100_{gbps_per_node:g}gbps", peak_flops={"float16": 125e12, "bfloat16": 125e12 / 8, "float32": 15.7e12},
        mem_bandwidth=900e9, launch_overhead=5e-6, ranks_per_node=ranks_per_node,
        intra=uniform_link("nvlink2", latency=2e-6, bandwidth=120e9),
        inter=uniform_link(f"infiniband-{gbps_per_node:g}g", latency=5e-6, bandwidth=0.9 * gbps_per_node * 1e9 / 8),
        source="NVIDIA V100 SXM2 datasheet; ZeRO++ (arXiv 2306.10209) inter-node links", matmul_efficiency=0.8,
    )


def _factory(variant: str, ranks_per_node: int, cfg: GPTConfig):
    def make() -> torch.nn.Module:
        hpz = {"reshard_after_forward": ranks_per_node} if "hpZ" in variant else {}
        return autoshard.shard(GPT(cfg), mixed_precision=FP16, compression=None if variant == "zero3" else INT8, **hpz)
    return make


def cross_node_bytes(report: Any, ranks_per_node: int) -> tuple[float, float]:
    """(cross-node, in-node) bytes one rank sends per step: (n-1)/n of each collective's full
    buffer, by whether its group spans nodes."""
    groups = report.simulation.group_ranks
    across = within = 0.0
    for e in report.collectives():
        ranks = groups.get(e.lane.removeprefix("comm:"), ())
        n = max(len(ranks), 1)
        sent = (n - 1) / n * e.nbytes
        if len({r // ranks_per_node for r in ranks}) > 1:
            across += sent
        else:
            within += sent
    return across, within


def run(variant: str, world: int, tokens: int, gbps: float, ranks_per_node: int, seq: int = 1024,
        cfg: GPTConfig = GPT_18B) -> dict[str, Any]:
    """The predicted step of one variant: seconds, tokens/s/GPU, cross-node and in-node GB, memory."""
    profile = v100_profile(gbps, ranks_per_node)
    batch = max(tokens // seq, 1)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    report = autoshard.explain(_factory(variant, ranks_per_node, cfg), ids, ids, world_size=world, profile=profile,
                               stages=("captured", "forward", "backward"))
    m = report.metrics
    across, within = cross_node_bytes(report, ranks_per_node)
    return {"step_s": m["step_time"], "tokens_per_s": batch * seq / m["step_time"], "exposed_pct": 100 * m["exposed_comm"] / m["step_time"],
            "cross_node_gb": across / 1e9, "in_node_gb": within / 1e9, "peak_gib": m["peak_bytes"] / 2**30,
            "parameters": m["parameters"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=384)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--gbps", type=float, nargs="+", default=[100, 400], help="Gb/s between nodes, per node")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048], help="tokens per GPU per step (sequences of 1024)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    rows = []
    for gbps in args.gbps:
        for tokens in args.tokens:
            base = None
            for variant in args.variants:
                start = time.perf_counter()
                r = run(variant, args.world, tokens, gbps, args.ranks_per_node)
                base = base or r
                rows.append({"Gb/s": f"{gbps:g}", "tokens/GPU": tokens, "variant": variant, "step s": f"{r['step_s']:.3f}",
                             "tok/s/GPU": f"{r['tokens_per_s']:,.0f}", "speedup": f"{base['step_s'] / r['step_s']:.2f}x",
                             "exposed": f"{r['exposed_pct']:.0f}%", "cross-node GB": f"{r['cross_node_gb']:.1f}",
                             "x zero3": f"{r['cross_node_gb'] / base['cross_node_gb']:.2f}", "in-node GB": f"{r['in_node_gb']:.1f}",
                             "peak GiB": f"{r['peak_gib']:.1f}", "published": PUBLISHED.get(int(gbps), "")})
                print(f"{gbps:g} Gb/s, {tokens} tokens, {variant}: {time.perf_counter() - start:.0f} s "
                      f"({r['parameters'] / 1e9:.1f}B parameters)", file=sys.stderr, flush=True)
    print(f"GPT {GPT_18B.n_layer} x {GPT_18B.n_embd} on {args.world} V100s, {args.ranks_per_node} per node, fp16; "
          f"published: ZeRO++ (arXiv 2306.10209) over ZeRO-3 on 384 V100s")
    print(tabulate(rows, headers="keys", disable_numparse=True))


if __name__ == "__main__":
    main()
