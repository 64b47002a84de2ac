"""What the backend decides, in PyTorch's own tools: loggers under ``autoshard.compiler``
(``TORCH_LOGS=autoshard``), artifacts in the structured trace (``TORCH_TRACE``, tlparse) and
phases in ``torch._dynamo.utils.compile_times()`` (autoshard/compiler/logs.py)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard._compat import structured_trace_on
from autoshard.compiler import logs
from autoshard.compiler.consistency import plan_signature
from autoshard.passes.graph_utils import collective_kind

from fake_pg import compile_step, sharded_step


@pytest.fixture
def autoshard_logs(caplog):
    """caplog's records of the ``autoshard`` loggers at INFO. Its handler is put on the logger
    itself: once torch's logging set-up ran (``set_logs``), the logger no longer propagates."""
    logger = logging.getLogger("autoshard")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False  # each record once
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _collectives(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and collective_kind(n) is not None)


def test_info_logs_the_plan_signature_buckets_and_schedule_of_forward_and_backward(autoshard_logs):
    with sharded_step("mlp", world_size=4) as step:  # group shapes resolve inside the world
        signatures = {"forward": plan_signature(step.forward), "backward": plan_signature(step.backward)}
    records = [r for r in autoshard_logs.records if r.name.startswith("autoshard.compiler")]
    summary = {side: [r.getMessage() for r in records if r.name == "autoshard.compiler" and f" {side}: " in r.getMessage()]
               for side in ("forward", "backward")}
    for side, gm in (("forward", step.forward), ("backward", step.backward)):
        (line,) = summary[side]
        assert f"-> {_collectives(gm)} after bucketing" in line, line
        assert f"plan signature {signatures[side]}" in line, line
    # Bucketing merged the backward's per-parameter reductions (the MLP has several parameters).
    before = int(summary["backward"][0].split(": ")[1].split(" collectives")[0])
    assert before > _collectives(step.backward)
    assert any(r.name == "autoshard.compiler.buckets" and " backward: " in r.getMessage() for r in records)
    schedule = [r.getMessage() for r in records if r.name == "autoshard.compiler.schedule"]
    assert len(schedule) == 2 and all("prefetch distances" in m and "predicted peak" in m for m in schedule), schedule


def test_with_the_loggers_off_and_no_trace_nothing_is_described(monkeypatch):
    assert not structured_trace_on()
    assert not logging.getLogger("autoshard.compiler").isEnabledFor(logging.INFO)
    described = []
    monkeypatch.setattr(logs, "describe", lambda *args: described.append(args))
    compile_step("mlp", world_size=2)
    assert described == []


def test_compile_times_holds_autoshards_phases():
    compile_step("mlp", world_size=2)
    times = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
    for key in ("capture", "joint_passes", "forward_passes", "backward_passes", "bucket_collectives", "schedule_overlap"):
        assert logs.PHASE.format(key) in times, times


SCRIPT = """
import torch, autoshard
from fake_pg import compile_step
compile_step("mlp", world_size=2)
"""


def _trace_records(folder: Path) -> list[tuple[dict, str]]:
    """(metadata, payload) of every record of the trace files in ``folder``: a record is a
    line ``<glog prefix> <json>``, its payload the lines after it that start with a tab."""
    records: list[tuple[dict, list[str]]] = []
    for path in folder.glob("*.log"):
        for line in path.read_text().splitlines():
            if line.startswith("\t"):
                records[-1][1].append(line[1:])
            else:
                records.append((json.loads(line[line.index("{"):]), []))
    return [(meta, "\n".join(payload)) for meta, payload in records]


def test_torch_trace_holds_each_stage_the_plan_and_the_timeline_and_torch_logs_prints_the_decisions(tmp_path):
    tests = Path(__file__).parent
    env = {"TORCH_TRACE": str(tmp_path), "TORCH_LOGS": "autoshard",
           "PYTHONPATH": os.pathsep.join(map(str, (tests, tests.parent / "examples")))}
    run = subprocess.run([sys.executable, "-c", SCRIPT], check=True, timeout=300, cwd=tests, env={**os.environ, **env},
                         capture_output=True, text=True)
    printed = [line for line in run.stderr.splitlines() if "autoshard/compiler/logs.py" in line]  # torch's log format
    assert sum("plan signature" in line for line in printed) == 2, run.stderr[-3000:]
    assert sum("prefetch distances" in line for line in printed) == 2, run.stderr[-3000:]
    artifacts: dict[str, list[str]] = {}
    for meta, payload in _trace_records(tmp_path):
        if "artifact" in meta:
            artifacts.setdefault(meta["artifact"]["name"], []).append(payload)
    for stage in ("captured", "joint", "lowered", "forward_bucketed", "forward", "backward_bucketed", "backward"):
        assert f"autoshard_{stage}" in artifacts, sorted(artifacts)
    assert "def forward" in artifacts["autoshard_forward"][0]
    plans = [json.loads(p) for p in artifacts["autoshard_plan"]]
    assert [p["side"] for p in plans] == ["forward", "backward"]
    assert all(len(p["signature"]) == 16 and p["schedule"]["distances"] is not None for p in plans)
    (timeline,) = artifacts["autoshard_timeline"]
    assert any(e.get("cat") == "collective" for e in json.loads(timeline)["traceEvents"])
