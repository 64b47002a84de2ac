"""bench/published.py: a row per published torchtitan run (a small Llama 3 shape on fake ranks,
no timing asserted), and the h100_grand_teton profile holding the figures docs/published.md
sources, with the cost-model terms it turns on."""
from __future__ import annotations

import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
from llama3 import LlamaConfig
from published import RUNS, replay

from autoshard.cost.cost_model import collective_time, get_profile

pytestmark = pytest.mark.planner

TINY = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=211, seq_len=64)


def test_replay_returns_a_row_per_published_run():
    runs = tuple(dataclasses.replace(r, seq=64) for r in RUNS)
    rows = replay("h100_grand_teton", cfg=TINY, runs=runs)
    assert [(r["gpus"], r["compile"]) for r in rows] == [(8, False), (8, True), (128, False), (128, True)]
    assert [r["published_tok_s"] for r in rows] == [5762, 6667, 5605, 6514]
    assert [r["published_gib"] for r in rows] == [82.4, 77.0, 67.0, 62.0]
    for r in rows:
        assert r["predicted_tok_s"] > 0 and r["predicted_gib"] > 0
        assert r["tok_s_ratio"] == pytest.approx(r["predicted_tok_s"] / r["published_tok_s"])
        assert r["gib_ratio"] == pytest.approx(r["predicted_gib"] / r["published_gib"])
        assert r["autoshard_step_s"] > 0 and r["autoshard_gib"] > 0
    # Sharded state shrinks with the world: less memory per rank at 128 than at 8.
    assert rows[2]["live_gib"] < rows[0]["live_gib"]
    for r in rows:
        # The allocator replay allocates what the liveness counts (plus AdamW's states), up to
        # its 512-byte rounding, and reserves at least that.
        assert r["live_gib"] <= r["allocated_gib"] <= r["live_gib"] * 1.05
        assert r["unfused_gib"] >= r["allocated_gib"] and r["predicted_gib"] <= r["unfused_gib"]
        assert r["live_ratio"] == pytest.approx(r["live_gib"] / r["published_gib"])


def test_grand_teton_profile_holds_the_documented_figures():
    p = get_profile("h100_grand_teton")
    assert p.peak_flops["bfloat16"] == 912e12 and p.peak_flops["float32"] == 456e12  # between SXM and NVL
    assert p.mem_bandwidth == 2.4e12
    assert p.matmul_efficiency == 0.801 and p.attention_efficiency == 0.35 and p.nic_per_rank
    assert p.intra.bandwidth["all_gather"] == 360e9 and p.inter.bandwidth["all_gather"] == 45e9
    assert (p.intra.latency["all_gather"], p.inter.latency["all_gather"]) == (2e-6, 5e-6)
    assert (p.busy_power_w, p.ranks_per_node) == (500.0, 8)


def test_a_ring_across_nodes_crosses_on_every_nic():
    p = get_profile("h100_grand_teton")
    one_nic = dataclasses.replace(p, nic_per_rank=False)
    nbytes = 2**30
    # 16 nodes of 8: each rank's NIC carries 1/8 of the ring's bytes between nodes (8 x 45 GB/s
    # beats forwarding 7/8 over NVLink at 360 GB/s only just: the NICs pace it).
    wire = 127 / 128 * nbytes / (8 * 45e9)
    latency = 112 * 2e-6 + 16 * 5e-6
    assert collective_time("all_gather", nbytes, 128, p) == pytest.approx(latency + wire)
    assert collective_time("all_gather", nbytes, 128, one_nic) == pytest.approx(latency + 8 * wire)
    # One rank per node (a replica group of HSDP): nothing to share, one NIC as before.
    replicas = range(0, 128, 8)
    assert collective_time("all_reduce", nbytes, replicas, p) == collective_time("all_reduce", nbytes, replicas, one_nic)


def test_causal_attention_is_priced_at_half_its_counted_flops():
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.cost.cost_model import node_flops, node_time

    def attend(causal):
        return lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[0]

    q = torch.empty(1, 32, 4096, 128, dtype=torch.bfloat16)
    p = get_profile("h100_grand_teton")
    times = {}
    for causal in (False, True):
        gm = make_fx(attend(causal), tracing_mode="fake")(q, q, q)
        (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and "flash" in str(n.target)]
        flops = node_flops(node)
        times[causal] = node_time(node, p) - p.launch_overhead
        assert times[causal] == pytest.approx(flops * (0.5 if causal else 1.0) / (912e12 * 0.35))
    # Without attention_efficiency: the whole square at the matmul rate, as before the term.
    plain = dataclasses.replace(p, attention_efficiency=None)
    assert node_time(node, plain) - p.launch_overhead == pytest.approx(flops / (912e12 * 0.801))


def test_fusing_a_pointwise_chain_prices_it_as_one_kernel():
    """Eager runs each op of x.float() * w -> .sin() -> .to(bf16) as a kernel reading and writing
    device memory; a fusing compiler runs one kernel reading x and w and writing the result."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.cost.cost_model import node_time
    from autoshard.cost.fusion import fusion_savings, unmaterialized

    def chain(x, w):
        return torch.mm((x.float() * w).sin().to(torch.bfloat16), x.t())

    x = torch.empty(4096, 4096, dtype=torch.bfloat16)
    w = torch.empty(4096, dtype=torch.float32)
    gm = make_fx(chain, tracing_mode="fake")(x, w)
    p = get_profile("h100_grand_teton")
    fusion = fusion_savings(gm, p)
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and "mm" not in str(n.target) and "t.default" not in str(n.target)]
    assert fusion.kernels == 1 and fusion.unfused == pytest.approx(sum(node_time(n, p) for n in ops))
    # One kernel: x (bf16) and w in, the bf16 result out; the matmul is not fused.
    assert fusion.fused == pytest.approx(p.launch_overhead + (2 * 4096 * 4096 * 2 + 4096 * 4) / p.mem_bandwidth)
    assert fusion.saved > 0
    # Nothing the predicate leaves out is fused.
    assert fusion_savings(gm, p, lambda node: False) == (0.0, 0.0, 0, 0)
    # In memory: the cast, the product and the sine stay in the kernel; only the bf16 result the matmul reads is written.
    to_bf16 = next(n for n in ops if n.meta["val"].dtype == torch.bfloat16)
    assert len(ops) == 4 and unmaterialized(gm) == set(ops) - {to_bf16}
    assert unmaterialized(gm, lambda node: False) == set()


def test_a_compiled_run_is_its_eager_twin_less_the_fusion():
    runs = tuple(dataclasses.replace(r, seq=64) for r in RUNS[:2])
    eager, compiled = replay("h100_grand_teton", cfg=TINY, runs=runs)
    assert compiled["step_s"] < eager["step_s"]
    # Memory: the same replay, less the blocks' fused intermediates (never allocated; at this size
    # within the same 2 MiB pages: the full-size test sees them go).
    assert compiled["unfused_gib"] == eager["predicted_gib"]
    assert compiled["predicted_gib"] <= eager["predicted_gib"]


@pytest.mark.slow
def test_the_published_targets_at_full_size():
    """Issue 52's targets on the real jobs (about 1 minute on 2 cores): the second system
    (torchtitan's FSDP2 on 64 A100) within 20% of its published tokens/s/GPU, eager
    faster-than-compiled by fusion alone, by no more than the fusion saves, and the H100 rows'
    memory (the caching allocator's peak reserved, expandable segments) within 10% of the
    published. Their tokens/s (within 15%) is not met yet (docs/published.md says why):
    test_the_unmet_h100_targets fails as soon as it is, to be promoted here."""
    from published import A100_RUNS, a100_profile

    # Three compiles of the 8B, each single-threaded: two processes (CI time, 83 s -> about 50 s).
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = [pool.submit(replay, a100_profile(), runs=A100_RUNS, with_autoshard=False)]
        jobs += [pool.submit(replay, "h100_grand_teton", runs=RUNS[i:i + 2], with_autoshard=False) for i in (0, 2)]
        (a100,), *h100 = [job.result() for job in jobs]
    assert 0.8 <= a100["tok_s_ratio"] <= 1.2
    rows = h100[0] + h100[1]
    assert [(r["gpus"], r["compile"]) for r in rows] == [(8, False), (8, True), (128, False), (128, True)]
    for eager, compiled in (rows[0:2], rows[2:4]):
        assert compiled["step_s"] < eager["step_s"]
        assert compiled["predicted_gib"] < eager["predicted_gib"]  # fused intermediates never allocated
        # The published eager/compiled gap (1.16x at 8 GPUs) is within the ideal fusion's.
        assert 1.1 < eager["step_s"] / compiled["step_s"] < 1.35
    for r in rows:
        assert abs(r["gib_ratio"] - 1) <= 0.10, r
        # The allocated peak is the live peak plus AdamW's states, up to the 512-byte rounding.
        assert r["allocated_gib"] == pytest.approx(r["live_gib"], rel=1e-3)
    _unmet.extend(rows)


_unmet: list = []


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="issue 52: the H100 rows are 1.19-1.32x too fast (docs/published.md)")
def test_the_unmet_h100_targets():
    rows = _unmet or replay("h100_grand_teton", with_autoshard=False)
    assert all(abs(r["tok_s_ratio"] - 1) <= 0.15 for r in rows)
