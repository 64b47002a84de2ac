"""autoshard.explain, the Report (summary, HTML, Chrome trace), the debug_dir report and the
``autoshard explain`` command, on a 2-layer x 64 GPT at world size 8."""
from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autoshard
from autoshard.cost.liveness import CATEGORIES
from autoshard.cost.simulator import analyze
from autoshard.runtime.errors import UsageError
from autoshard.tools.cli import main
from autoshard.tools.explain import add_arguments
from autoshard.tools.report.code import page_code
from autoshard.tools.report.report import STAGES, Report
from autoshard.tools.units import fmt_bytes, fmt_energy, fmt_time

from fake_pg import fake_world, same_tokens, sharded_step
from models import build
from train_gpt import build_model

pytestmark = pytest.mark.planner

ROOT = Path(__file__).resolve().parents[1]
FACTORY = f"{ROOT / 'examples' / 'train_gpt.py'}:build_model"


@pytest.fixture(scope="module")
def report() -> Report:
    tokens = torch.zeros(1, 64, dtype=torch.long)
    return autoshard.explain(build_model, tokens, tokens, world_size=8, profile="h100")


def test_the_report_lists_every_stage_as_python(report):
    assert tuple(report.stages) == STAGES
    for stage in STAGES:
        ast.parse(report.code(stage))  # readable code that parses
    assert [(p.before, p.after) for p in report.passes] == [
        ("captured", "joint"), ("joint", "lowered"), ("lowered", "forward_bucketed"), ("forward_bucketed", "forward"),
        ("lowered", "backward_bucketed"), ("backward_bucketed", "backward"),
    ]
    lower, fw_bucket, fw_schedule = report.passes[1], report.passes[2], report.passes[3]
    # Tied weights: one ghost, so one gather (merging had nothing to merge).
    assert lower.added["_c10d_functional.all_gather_into_tensor.default"] == lower.removed["autoshard.unshard.default"]
    n, params = fw_bucket.collectives["all_gather"]
    assert n < params == report.metrics["sharded_tensors"]  # buckets formed
    assert fw_schedule.added == fw_schedule.removed == {} and fw_schedule.moved > 0  # the schedule only reorders
    assert "buckets" not in fw_schedule.text() and "bucketed" in fw_bucket.text()


# The summary's units, read back by this test's own parser (not the report's formatters).
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_JOULES = {"J": 1.0, "kJ": 1e3, "MJ": 1e6, "GJ": 1e9}
_QUANTITY = r"(-?[\d.]+(?:e[-+]?\d+)?) ([a-zA-Z]+)"


def _read(text: str, units: dict[str, float]) -> list[float]:
    """Every "<number> <unit>" in ``text`` whose unit is one of ``units``, as a plain number."""
    return [float(n) * units[u] for n, u in re.findall(_QUANTITY, text) if u in units]


def _summary_table(text: str) -> dict[str, str]:
    """The summary's rows, quantity -> value, read from the plain-text table (continuation rows joined)."""
    lines = text.splitlines()
    width = lines[2].index(" ")  # the dashes under "quantity"
    rows: dict[str, str] = {}
    key = ""
    for line in lines[3:]:
        key = line[:width].strip() or key
        rows[key] = (rows.get(key, "") + " " + line[width:].strip()).strip()
    return rows


def test_the_summary_holds_the_simulators_numbers(report):
    """Each number of the summary, read back from its text with units, is the simulator's for
    the final graphs, or what follows from it (gaps, shares, per parameter), to the digits shown."""
    a = analyze(report.stages["forward"], report.stages["backward"], "h100")
    assert a == report.analysis
    rows = _summary_table(report.summary())
    time_of = lambda key: _read(rows[key], _SECONDS)[0]  # noqa: E731
    bytes_of = lambda key: _read(rows[key], _BYTES)[0]  # noqa: E731
    percents = lambda key: [float(p) for p in re.findall(r"([\d.]+)%", rows[key])]  # noqa: E731
    four, three = dict(rel=5e-4), dict(rel=5e-3)  # significant digits shown: time 4, bytes 3

    model = build_model()
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    assert int(rows["parameters"].replace(",", "")) == sum(p.numel() for p in params)
    tensors, shard = re.fullmatch(r"(\d+) tensors, (.*)", rows["shards (this rank)"]).groups()
    assert int(tensors) == len(params)
    rows_on_rank0 = lambda p: -(-p.shape[0] // 8) * p[0].numel() if p.dim() else 1  # noqa: E731  dim 0 split in 8, rank 0's
    assert _read(shard, _BYTES)[0] == pytest.approx(sum(rows_on_rank0(p) * p.element_size() for p in params), **three)

    nodes = [n for stage in ("forward", "backward") for n in report.stages[stage].graph.nodes]
    by_kind = {k: sum(1 for n in nodes if k in str(n.target)) for k in ("all_gather", "reduce_scatter")}
    total, kinds = re.fullmatch(r"(\d+) \((.*)\)", rows["collectives per step"]).groups()
    assert int(total) == sum(by_kind.values()) and kinds == ", ".join(f"{k} {v}" for k, v in by_kind.items())
    moved = _read(rows["bytes per step"], _BYTES)
    assert moved == pytest.approx([sum(a.comm_bytes.values()), a.comm_bytes["all_gather"], a.comm_bytes["reduce_scatter"]], **three)

    assert time_of("step time (predicted)") == pytest.approx(a.step_time, **four)
    assert time_of("compute time") == pytest.approx(a.compute_time, **four)
    assert time_of("communication time") == pytest.approx(a.comm_time, **four)
    exposed = a.step_time - a.compute_time  # what compute did not hide
    assert time_of("exposed communication") == pytest.approx(exposed, **four)
    assert percents("exposed communication") == pytest.approx([100 * exposed / a.step_time], abs=0.05)
    assert float(rows["overlap ratio"]) == pytest.approx((a.comm_time - exposed) / a.comm_time, abs=5e-4)
    assert _read(rows["energy per step"], _JOULES) == pytest.approx([a.energy_j, 8 * a.energy_j], **three)

    assert bytes_of("peak memory per rank") == pytest.approx(a.peak_bytes, **three)
    peak_time = _read(rows["peak memory per rank"], _SECONDS)[0]
    assert peak_time == pytest.approx(next(t for t, live in a.memory_curve if live == a.peak_bytes), **four)
    assert bytes_of("peak gathered parameters") == pytest.approx(a.peak_gathered_bytes, **three)
    assert float(rows["bytes per parameter (GB per billion)"]) == pytest.approx(a.peak_bytes / sum(p.numel() for p in params), **three)
    assert time_of("step lower bound") == pytest.approx(a.step_lower_bound, **four)
    assert percents("step lower bound") == pytest.approx([100 * (a.step_time / a.step_lower_bound - 1)], abs=0.05)
    assert bytes_of("memory lower bound") == pytest.approx(a.memory_lower_bound, **three)
    assert percents("memory lower bound") == pytest.approx([100 * (a.peak_bytes / a.memory_lower_bound - 1)], abs=0.05)


def test_the_summary_gives_the_energy_per_step_per_rank_and_over_the_world(report):
    m, energy = report.metrics, report.analysis.energy_j
    assert report.world_size == 8 and energy > 0
    assert m["energy_j"] == energy and m["energy_j_all_ranks"] == pytest.approx(8 * energy)
    assert ("energy per step", f"{fmt_energy(energy)} per rank, {fmt_energy(8 * energy)} over 8 ranks") in report.summary_rows()
    # Outside a process group the world is unknown: this rank's energy only; without power figures, no row.
    alone = Report(report.stages, "h100")
    assert alone.world_size is None and alone.metrics["energy_j_all_ranks"] is None
    assert ("energy per step", f"{fmt_energy(alone.metrics['energy_j'])} per rank") in alone.summary_rows()
    cpu = Report(report.stages, "cpu")
    assert cpu.metrics["energy_j"] is None and "energy" not in cpu.summary()
    assert (fmt_energy(63.2), fmt_energy(64_700.0), fmt_energy(0.5)) == ("63.2 J", "64.7 kJ", "0.5 J")


def test_the_html_page_has_one_item_per_collective_and_the_memory_curve(report, tmp_path):
    report.save_html(tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    collectives = report.collectives()
    assert len(collectives) == 5  # 2 forward gathers, 1 backward re-gather (the last block is kept by default), 2 reduce-scatters
    assert page.count('<g class="collective ') == len(collectives)
    for e in collectives:  # linked to its bucket row, which names its parameters
        assert f'href="#c-{e.stage}-{e.name}"' in page and f'id="c-{e.stage}-{e.name}"' in page
        assert ", ".join(e.params) in page
    assert page.count('<polyline class="memory"') == 1 and page.count('class="peak"') == 1
    assert not re.search(r"<script|<link|src=|url\(|href=\"http", page)  # self-contained


def test_the_summary_says_what_is_alive_at_the_peak_and_what_is_exposed(report):
    a, text = report.analysis, report.summary()
    peak = a.memory_peak
    for category, nbytes in peak.by_category.items():
        if nbytes:
            assert f"at the peak: {CATEGORIES[category]}" in text and fmt_bytes(nbytes) in text
    assert f"{fmt_bytes(a.peak_bytes)} ({peak.stage}, at {fmt_time(peak.time)})" in text
    assert all(t.node in text for t in peak.largest[:3])
    worst = sorted((e for e in report.collectives() if e.exposed), key=lambda e: -e.exposed)[:3]
    rows = report.summary_rows()
    first = [k for k, _ in rows].index("most exposed collectives")
    assert [k for k, _ in rows[first:first + len(worst)]] == ["most exposed collectives"] + [""] * (len(worst) - 1)
    for (_, value), e in zip(rows[first:], worst):  # worst first
        assert value.startswith(f"{fmt_time(e.exposed)} ({100 * e.exposed / a.step_time:.1f}% of step): {e.stage} {e.kind} of ")


def test_the_page_draws_memory_by_category_on_a_labelled_axis_and_shades_exposed_time(report):
    page, a = report.html(), report.analysis
    present = [c for c, curve in a.memory_by_category.items() if any(curve)]
    assert page.count('<polygon class="area m-') == len(present) >= 4
    unit = fmt_bytes(a.peak_bytes).split()[1]
    assert f"live memory per rank ({unit})" in page and f">0 {unit}</text>" in page
    assert page.count('class="exposed"') == len(a.stalls) > 0
    # The bucket table: the most exposed collective first.
    rows = re.findall(r'<tr id="c-(\w+)-(\w+)">', page)
    by_exposed = sorted(report.collectives(), key=lambda e: -e.exposed)
    assert [report_event.exposed for report_event in by_exposed] == [
        next(e for e in report.collectives() if (e.stage, e.name) == row).exposed for row in rows]
    assert "Memory at the peak" in page and all(t.node in page for t in a.memory_peak.largest)


def test_backward_compute_is_named_by_module(report):
    labels = {g.stage: set() for g in report.compute_groups()}
    for g in report.compute_groups():
        labels[g.stage].add(g.label)
    assert {"blocks.0", "blocks.1"} <= labels["backward"] and "blocks.0" in labels["forward"]


def test_the_page_carries_the_final_stages_compact_with_repeated_blocks_folded():
    tokens = torch.zeros(1, 64, dtype=torch.long)
    deep = autoshard.explain(lambda: build_model(n_layer=6), tokens, tokens, world_size=8, profile="h100")
    page = deep.html()
    final = len(deep.code("forward")) + len(deep.code("backward"))
    assert len(page) < final  # the final stages folded, and the rest (it once held every stage's code)
    for stage in ("captured", "joint", "lowered"):
        assert f"{stage} ({len(deep.stages[stage].graph.nodes)} nodes)" in page  # named, not printed
    assert "torch.ops.autoshard.unshard" not in page  # the captured graph's annotations
    code = page_code(deep.stages["forward"], "forward")
    folded = re.findall(r"# (blocks\.\d): (\d+) nodes, the same code as (blocks\.\d)", code)
    assert len(folded) >= 3 and all(int(n) > 20 for _, n, _ in folded)
    assert "= None" not in code and "[64, 1]" not in code.split("\n", 2)[1]  # no frees, no strides in the signature
    ast.parse(code)  # still Python


def test_the_chrome_trace_has_an_event_per_collective_and_compute_group(report, tmp_path):
    report.save_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    by_cat = lambda cat: [e for e in events if e["ph"] == "X" and e.get("cat") == cat]  # noqa: E731
    assert len(by_cat("collective")) == len(report.collectives())
    assert len(by_cat("compute")) == len(report.compute_groups()) > 0
    assert sum(e["args"]["nodes"] for e in by_cat("compute")) == sum(1 for e in report.analysis.timeline if e.lane == "compute")
    assert {e["args"]["kind"] for e in by_cat("collective")} == {"all_gather", "reduce_scatter"}
    assert all(e["args"]["params"] for e in by_cat("collective"))
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in events if e["ph"] == "X")
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {"stage", "compute", "comm:0"}
    assert max(e["args"]["live MiB"] for e in events if e["ph"] == "C" and e["name"] == "memory") == report.analysis.peak_bytes / 2**20
    # The stacked counter splits the same bytes by category, and the exposed intervals sit on the compute lane.
    stacked = [sum(e["args"].values()) for e in events if e["ph"] == "C" and e["name"] == "memory by category"]
    assert max(stacked) == pytest.approx(report.analysis.peak_bytes / 2**20)
    assert len(by_cat("exposed")) == len(report.analysis.stalls) > 0


def test_explain_leaves_no_process_group_and_refuses_a_live_one(report):
    assert not dist.is_initialized()
    with fake_world(2), pytest.raises(UsageError, match="own fake process group"):
        autoshard.explain(build_model, torch.zeros(1, 8, dtype=torch.long))


def test_inductor_is_refused_before_anything_runs():
    """Inductor's C++ kernels would read the fake tensors' data (none): the process crashed."""
    with pytest.raises(UsageError, match="aot_eager"):
        autoshard.explain(build("mlp"), torch.randn(2, 16), torch.randn(2, 1), world_size=2, compiler="inductor")
    assert not dist.is_initialized()


def test_a_module_is_copied_graph_breaks_give_a_report_each_and_inference_has_no_backward():
    model = build("graph_break")
    x, y = torch.randn(2, 16), torch.randn(2, 1)
    reports = autoshard.explain_graphs(model, x, y, world_size=4)
    assert len(reports) == 2 and all("backward" in r.stages for r in reports)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # the caller's module is untouched
    with torch.no_grad():
        inference = autoshard.explain(build("mlp"), x, y, world_size=4)
    assert tuple(inference.stages) == ("captured", "forward_bucketed", "forward")
    assert inference.backward_start() is None and inference.collectives()


def test_a_debug_dir_compile_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_DEBUG_DIR", str(tmp_path))  # the default of the debug_dir option
    with sharded_step("gpt", same_tokens(lambda: torch.randint(0, 64, (1, 16))), world_size=8, options={"profile": "h100"}) as step:
        expected = Report(step.graphs.compiled[0], "h100").summary().split("\n", 1)[1]
    (folder,) = (tmp_path / "rank0").iterdir()
    assert {"report.html", "trace.json", "summary.txt", "forward.py", "backward.py"} <= {p.name for p in folder.iterdir()}
    assert expected in (folder / "summary.txt").read_text()
    assert 'href="lowered.py"' in (folder / "report.html").read_text()  # the stages beside the page are linked
    json.loads((folder / "trace.json").read_text())


def test_the_cli_explains_the_example(tmp_path, capsys):
    html, trace = tmp_path / "out.html", tmp_path / "out.json"
    assert main(["explain", FACTORY, "--world-size", "64", "--html", str(html), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "world size 64" in out and "step time (predicted)" in out and f"wrote {html}" in out
    assert html.read_text().startswith("<!DOCTYPE html>") and json.loads(trace.read_text())["traceEvents"]


def test_the_cli_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["explain", "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    flags = ["--world-size", "--profile", "--batch", "--seq", "--input-shape", "--input-dtype", "--schedule", "--bucket-mb",
             "--max-inflight-mb", "--no-reshard-after-forward", "--html", "--trace", "--dump-dir", "--passes"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    documented = {o for a in parser._actions if a.help for o in a.option_strings}
    assert set(flags) <= documented and all(a.help for a in parser._actions)
    assert all(flag in text for flag in flags)


@pytest.mark.parametrize("spec", ["examples/nope.py:build_model", "examples/train_gpt.py:nope", "examples/train_gpt.py"])
def test_a_bad_factory_is_a_one_line_error(spec):
    with pytest.raises(SystemExit) as exit:
        main(["explain", spec])
    message = exit.value.code
    assert isinstance(message, str) and "\n" not in message and message.startswith("autoshard explain: ")


def test_the_console_command_exits_nonzero_on_a_bad_factory():
    proc = subprocess.run([sys.executable, "-m", "autoshard", "explain", "examples/train_gpt.py:nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip() == "autoshard explain: cannot load nope from examples/train_gpt.py: AttributeError: " \
        "module '_autoshard_explain_train_gpt' has no attribute 'nope'; fix the path, the name or the file"


def _sharding_factory(strategy: str | None, mesh_shape: tuple[int, ...] | None = None):
    """A factory that shards the tiny GPT itself, building any mesh inside explain's fake mode."""
    def make():
        model = build("gpt")
        if strategy is None:
            return autoshard.shard(model)  # the default mesh
        mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape else None
        return autoshard.shard(model, mesh, strategy=strategy)

    return make


def _gather_sizes(report: Report) -> set[int]:
    """The group sizes of the all-gathers in the compiled forward and backward."""
    return {n.args[1] for stage in ("forward", "backward") for n in report.stages[stage].graph.nodes
            if n.op == "call_function" and "all_gather_into_tensor" in str(n.target)}


def _kinds(report: Report, stage: str) -> set[str]:
    return {e.kind for e in report.collectives() if e.stage == stage}


TOKENS = torch.zeros(1, 16, dtype=torch.long)


@pytest.mark.parametrize("strategy, mesh_shape, world", [
    (None, None, 64), ("full", None, 8), ("grad_op", None, 8), ("replicate", None, 8), ("hybrid", (2, 4), 8),
])
def test_explain_a_factory_that_shards_with_each_strategy(strategy, mesh_shape, world):
    report = autoshard.explain(_sharding_factory(strategy, mesh_shape), TOKENS, TOKENS, world_size=world)
    m = report.metrics
    full_bytes = 4 * m["parameters"]  # float32; every dim 0 of this GPT divides 4 and 8
    if strategy in (None, "full"):  # ZeRO-3: gathered again in backward, gradients reduce-scattered
        assert _kinds(report, "forward") == {"all_gather"} and _kinds(report, "backward") == {"all_gather", "reduce_scatter"}
        assert _gather_sizes(report) == {world}
        if world == 8:
            assert m["shard_bytes"] == full_bytes // 8
    elif strategy == "grad_op":  # ZeRO-2: kept gathered from forward to backward
        assert _kinds(report, "forward") == {"all_gather"} and _kinds(report, "backward") == {"reduce_scatter"}
        assert m["shard_bytes"] == full_bytes // 8
    elif strategy == "replicate":  # DDP: nothing gathered, gradients all-reduced
        assert _kinds(report, "forward") == set() and _kinds(report, "backward") == {"all_reduce"}
        assert m["shard_bytes"] == full_bytes
    else:  # HSDP: gathered within a row of 4, the shards' gradients then all-reduced across the 2 rows
        assert _kinds(report, "backward") == {"all_gather", "reduce_scatter", "all_reduce"}
        assert _gather_sizes(report) == {4} and m["shard_bytes"] == full_bytes // 4
        all_reduces = [e for e in report.collectives() if e.kind == "all_reduce"]
        assert sum(e.nbytes for e in all_reduces) == m["shard_bytes"]
        assert {e.lane for e in all_reduces}.isdisjoint(e.lane for e in report.collectives() if e.kind != "all_reduce")
    assert not dist.is_initialized()


def test_explain_can_keep_only_the_stages_its_metrics_read(report):
    """The planner copies three stages of each graph, not seven: the step it predicts is the same."""
    tokens = torch.zeros(1, 64, dtype=torch.long)
    lean = autoshard.explain(build_model, tokens, tokens, world_size=8, profile="h100", stages=("captured", "forward", "backward"))
    assert set(lean.stages) == {"captured", "forward", "backward"} < set(report.stages)
    for key in ("step_time", "exposed_comm", "peak_bytes", "shard_bytes", "energy_j"):
        assert lean.metrics[key] == report.metrics[key], key


def test_the_summary_counts_the_8_bit_collectives_and_their_bytes(report):
    """With ``Compression(gather="int8", reduce="int8")`` the summary says how many gathers and
    reductions move 8-bit values and their bytes, which add up to the step's bytes; without, no
    row. fp8 gathers move the same bytes and are counted alike."""
    assert not [row for row in report.summary_rows() if row[0].startswith("compressed")]
    ids = torch.zeros(2, 32, dtype=torch.long)
    int8 = autoshard.Compression(gather="int8", reduce="int8")
    compressed = autoshard.explain(lambda: autoshard.shard(build_model(), compression=int8), ids, ids, world_size=8, profile="h100")
    rows = dict(compressed.summary_rows())
    found = re.fullmatch(r"8-bit gathers (\d+) \((.+)\), 8-bit reductions (\d+) \((.+)\)", rows["compressed collectives per step"])
    assert found, rows["compressed collectives per step"]
    metrics = compressed.metrics
    assert int(found[1]) == metrics["collectives"]["all_gather"] and int(found[3]) >= 1
    assert found[2] == fmt_bytes(metrics["comm_bytes"]["all_gather"])
    assert metrics["comm_bytes"]["all_gather"] < 0.3 * report.metrics["comm_bytes"]["all_gather"]
    fp8 = autoshard.Compression(gather="fp8", reduce="int8")
    as_fp8 = autoshard.explain(lambda: autoshard.shard(build_model(), compression=fp8), ids, ids, world_size=8, profile="h100")
    assert as_fp8.metrics["comm_bytes"]["all_gather"] == metrics["comm_bytes"]["all_gather"]
    assert dict(as_fp8.summary_rows())["compressed collectives per step"] == rows["compressed collectives per step"]
