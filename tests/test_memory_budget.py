"""``memory_budget_gb`` on real ranks: the measured peak of a training step on 2 gloo ranks
stays within the budget, and near what the schedule predicted for it.

Three budgets between the smallest that fits a 2-layer GPT (gathering at use) and the peak of
its fastest plan, found on the fake process group as ``bench/memory.py`` finds them; then
one launch of 2 gloo ranks compiles and trains the model under each (aot_eager). Each rank
measures as ``bench/real.py`` does: what it keeps between steps (parameter shards, AdamW's
state) plus the highest rise of allocated CPU bytes (torch.profiler's memory events, every
thread) during the forward and backward of a steady step. The prediction is the schedule's,
optimizer state included: the larger of the forward's and the backward's plan peaks.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import autoshard
from autoshard.compiler.dump import recording
from autoshard.passes.schedule import PLAN
from autoshard.tools.launch import run_ranks

from gpt import GPT, GPTConfig

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

CONFIG = dict(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=256)
# Every block resharded after forward: with 2 layers, the default (the last block kept for the
# backward) leaves the schedule one block to place, too few choices for three plans.
RESHARD = {"reshard_after_forward": True}
SHARES = (0.05, 0.5, 0.95)  # of the way from the smallest budget that fits to the fastest plan's peak: three different plans
TOLERANCE = 0.15  # measured against predicted peak


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG))


def _tokens() -> torch.Tensor:
    return torch.zeros(1, CONFIG["block_size"], dtype=torch.long)


def _plans(options: dict) -> list:
    report = autoshard.explain(_gpt, _tokens(), _tokens(), world_size=2, profile="cpu", compiler="aot_eager", **RESHARD, **options)
    return [report.stages[side].meta[PLAN] for side in ("forward", "backward")]


def _budgets() -> list[float]:
    """Three budgets (GiB) that bind: between the smallest that fits and the fastest plan's peak."""
    fastest = _plans({"memory_budget_gb": 1e6})
    low, high = max(p.smallest_bytes for p in fastest), max(p.peak_bytes for p in fastest)
    assert low < high, (low, high)
    return [(low + share * (high - low)) / 2**30 for share in SHARES]


def _rise(prof: profile, window: str) -> int:
    """Highest allocated CPU bytes during the ``window`` record_function, above its start
    (the running sum of the profiler's "[memory]" events, every thread, in time order)."""
    events = list(prof.profiler.kineto_results.events())
    start, end = next((e.start_ns(), e.end_ns()) for e in events if e.name() == window)
    memory = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU), key=lambda e: e.start_ns())
    live = base = peak = 0
    for e in memory:
        if e.start_ns() > end:
            break
        live += e.nbytes()
        if e.start_ns() < start:
            base = live
        else:
            peak = max(peak, live - base)
    return peak


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def _train_under(budgets: list[float]) -> list[dict]:
    """On each rank: per budget, compile, train two steps, then measure a third and a fourth."""
    torch.set_num_threads(1)  # two ranks on a small machine
    found = []
    for gib in budgets:
        torch._dynamo.reset()
        model = autoshard.shard(_gpt())
        compiled = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager", "memory_budget_gb": gib, **RESHARD})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(dist.get_rank())
        x, y = (torch.randint(0, CONFIG["vocab_size"], (1, CONFIG["block_size"]), generator=g) for _ in range(2))

        def step(window: str = "unmeasured") -> None:
            with record_function(window):  # forward and backward: the optimizer's step is not the schedule's
                compiled(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        with recording() as graphs:  # the first step compiles
            step()
        step()
        held = _local_bytes(model.parameters()) + _local_bytes(t for s in optimizer.state.values() for t in s.values())
        # The profiler misses frees of what was allocated before it started: measure the second step.
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
            step("measured")
        plans = [stages[side].meta[PLAN] for stages in graphs for side in ("forward", "backward")]
        found.append({"budget": int(gib * 2**30), "measured": held + _rise(prof, "measured"),
                      "predicted": max(p.peak_bytes for p in plans), "graphs": len(graphs)})
    return found


def test_the_measured_peak_stays_within_the_budget_and_near_the_prediction():
    """Measured here (2 cores, torch 2.13): 17.4 / 20.0 / 21.9 MiB against predictions of 18.9 /
    20.5 / 22.0 MiB and budgets of 19.1 / 21.0 / 22.8 MiB (-8%, -2%, -1%); about 40 s."""
    budgets = _budgets()
    ranks = run_ranks(2, _train_under, budgets, timeout=400)
    rows = []
    for i, gib in enumerate(budgets):
        results = [r[i] for r in ranks]
        assert all(r["graphs"] == 1 for r in results)  # one graph: its plan is the whole step's
        measured, predicted = max(r["measured"] for r in results), results[0]["predicted"]
        rows.append(f"budget {gib * 1024:.2f} MiB: measured {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB "
                    f"({measured / predicted - 1:+.1%})")
    report = "\n".join(rows)
    assert len({r["predicted"] for r in ranks[0]}) == len(budgets), report  # each budget binds: a plan of its own
    for i, gib in enumerate(budgets):
        for r in (ranks[0][i], ranks[1][i]):
            assert r["predicted"] <= r["budget"], report
            assert r["measured"] <= r["budget"], report
            assert abs(r["measured"] / r["predicted"] - 1) <= TOLERANCE, report
    print(report)
