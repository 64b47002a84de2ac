"""Every rank must reach the same plan from the same graph, each in its own process: the plan
hash (``consistency.plan_signature``, which the ranks exchange), the schedule's decisions and
the simulated step must not depend on anything a process draws for itself, such as Python's
string hash seed (``PYTHONHASHSEED``) or where objects land in memory. Two processes with
different seeds compile the same 2-layer GPT at world size 8 (fake process group) and print
what they found."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.planner, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]

_COMPILE = """
import dataclasses, json, sys
sys.path[:0] = [{tests!r}, {examples!r}]
import torch
from autoshard.compiler.consistency import plan_signature
from autoshard.passes.schedule import PLAN
from autoshard.tools.report.report import Report
from autoshard.cost.simulator import analyze
from fake_pg import fake_world, sharded_step, same_tokens
from gpt import GPT, GPTConfig

def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64))

inputs = same_tokens(lambda: torch.zeros(1, 32, dtype=torch.long))
with sharded_step(gpt, inputs, world_size=8, options={{"profile": "cpu"}}) as step:
    fw, bw = step.forward, step.backward
    a = analyze(fw, bw, "cpu")
    summary = Report({{"forward": fw, "backward": bw}}, "cpu").summary()
print(json.dumps({{
    "signatures": [plan_signature(fw), plan_signature(bw)],
    "plans": [repr(fw.meta[PLAN]), repr(bw.meta[PLAN])],
    "code": [fw.code, bw.code],
    "analysis": repr(a) + repr(a.timeline) + repr(a.memory_curve) + repr(a.memory_by_category) + repr(a.memory_peak),
    "summary": summary,
}}))
"""

SEEDS = ("0", "4242")


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """What each process printed, one per seed (run side by side)."""
    code = _COMPILE.format(tests=str(ROOT / "tests"), examples=str(ROOT / "examples"))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": seed}) for seed in SEEDS]
    found = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def test_the_plan_hash_is_the_same_under_any_hash_seed(runs):
    first, second = runs
    assert first["signatures"] == second["signatures"]
    assert first["plans"] == second["plans"]  # the schedule's decisions and predictions
    assert first["code"] == second["code"]  # and the final graphs, node for node


def test_the_simulated_step_is_the_same_under_any_hash_seed(runs):
    first, second = runs
    assert first["analysis"] == second["analysis"]
    assert first["summary"] == second["summary"]
