"""What bench/compile_time.py relies on: exclusive phase timing, the compile functions it wraps,
and one small measurement; plus graph_utils.near, which replaced a whole-graph numbering per
collective."""
from __future__ import annotations

import time

import torch
from torch import fx

from autoshard._compat import COMPILE_PHASE_FUNCTIONS, wrap_compile_phases
from autoshard.passes.graph_utils import near

import compile_time


def test_near_returns_members_in_graph_order_on_both_sides_of_the_anchor():
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = [x]
    for _ in range(6):
        nodes.append(graph.call_function(torch.neg, (nodes[-1],)))
    graph.output(nodes[-1])
    anchor = nodes[3]
    assert near(anchor, [nodes[5], x, nodes[2], nodes[6]]) == [x, nodes[2], nodes[5], nodes[6]]
    assert near(anchor, []) == []


def test_a_phase_nested_in_another_counts_only_for_the_inner_one():
    clock = compile_time.PhaseClock()
    with clock.phase("outer"):
        time.sleep(0.01)
        with clock.phase("inner"):
            time.sleep(0.2)
    assert clock.seconds["inner"] >= 0.2
    assert 0.01 <= clock.seconds["outer"] < 0.2  # the inner phase's 0.2 s are not in it


def test_calls_are_counted_in_the_innermost_phase_only():
    def twenty() -> None:
        for _ in range(20):
            abs(-1)  # a built-in call, which the profiler counts too

    clock = compile_time.PhaseClock(count_calls=True)
    with clock.phase("outer"):
        twenty()
        with clock.phase("inner"):
            for _ in range(3):
                twenty()
        twenty()
    calls = clock.calls()
    assert calls["inner"] >= 3 * 21  # three calls of twenty, each with its 20 abs
    assert 2 * 21 <= calls["outer"] < 5 * 21  # its own two, not the inner phase's three


def test_compile_phase_functions_are_wrapped_everywhere_and_restored():
    import torch._dynamo.backends.debugging as debugging  # imports the partitioner by name
    import torch._functorch.partitioners as partitioners

    original = partitioners.min_cut_rematerialization_partition
    seen = []
    with wrap_compile_phases(lambda fn, phase: seen.append(phase) or (lambda *a, **k: fn(*a, **k))):
        assert partitioners.min_cut_rematerialization_partition is not original
        assert debugging.min_cut_rematerialization_partition is partitioners.min_cut_rematerialization_partition
    assert partitioners.min_cut_rematerialization_partition is original
    assert sorted(set(seen)) == sorted({phase for _, phase in COMPILE_PHASE_FUNCTIONS.values()})


def test_one_measurement_accounts_for_every_phase():
    torch._dynamo.reset()
    row = compile_time.measure("autoshard", "aot_eager", 1, world_size=4)
    assert all(row[p] >= 0 for p in compile_time.PHASES)
    # Each wrapped phase was seen: a wrapper that missed its function would leave it at 0.
    assert row["capture"] > 0 and row["autoshard"] > 0 and row["partition"] > 0 and row["passes"]
    assert row["autoshard"] > 0 and row["partition"] > 0 and row["dynamo"] > 0
    assert {"lower_annotations", "bucket_collectives", "schedule_overlap"} <= set(row["passes"])


def test_the_collector_is_off_while_compiling_and_on_again_after(monkeypatch):
    import gc

    from autoshard.compiler import pipeline

    from fake_pg import compile_step

    enabled_while_running = []
    run = pipeline.run
    monkeypatch.setattr(pipeline, "run", lambda *a, **k: enabled_while_running.append(gc.isenabled()) or run(*a, **k))
    assert gc.isenabled()
    compile_step("mlp")
    assert enabled_while_running and not any(enabled_while_running)  # the forward's and the lazily compiled backward's
    assert gc.isenabled()
    # A process that turned the collector off itself keeps it off.
    gc.disable()
    try:
        compile_step("mlp")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_warm_restarts_keep_each_systems_fastest_of_repeat_and_share_one_cache_per_system(monkeypatch):
    """--warm --repeat 3: one cold process per system, then three warm ones taking turns (the
    order alternates), each system's warm processes on its own cold one's cache directory."""
    times = {("plain", "cold"): [10.0], ("plain", "warm"): [3.0, 1.0, 2.0],
             ("autoshard", "cold"): [12.0], ("autoshard", "warm"): [1.5, 2.5, 1.2]}
    seen: list[tuple[str, str]] = []
    caches: dict[str, set[str]] = {}

    def child(system, compiler, layers, world_size, cache, caches_on):
        assert caches_on
        when = "cold" if system not in caches else "warm"
        caches.setdefault(system, set()).add(cache)
        seen.append((system, when))
        return {"total": times[system, when][sum(1 for s in seen if s == (system, when)) - 1]}

    monkeypatch.setattr(compile_time, "_child", child)
    rows = compile_time.run_warm([4], ["aot_eager"], 8, repeat=3)
    assert seen == [("plain", "cold"), ("autoshard", "cold"), ("plain", "warm"), ("autoshard", "warm"),
                    ("autoshard", "warm"), ("plain", "warm"), ("plain", "warm"), ("autoshard", "warm")]
    assert all(len(dirs) == 1 for dirs in caches.values()) and caches["plain"] != caches["autoshard"]
    got = {r["system"]: r for r in rows}
    assert (got["plain"]["cold"], got["plain"]["warm"]) == (10.0, 1.0)
    assert (got["autoshard"]["cold"], got["autoshard"]["warm"]) == (12.0, 1.2)
    assert got["autoshard"]["warm_vs_plain"] == 1.2 and got["autoshard"]["warm_runs"] == [1.5, 2.5, 1.2]
