"""The example trains end to end on 2 self-started CPU ranks."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def test_train_gpt_runs_and_learns():
    # Its own session, so a hang kills the ranks it spawned too, not only the launcher.
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", "12"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 12
    assert losses[-1] < losses[0] - 0.5  # it learns
    shards = re.findall(r"rank (\d): parameter shard .* \((\d\.\d+)\)", out)
    assert sorted(r for r, _ in shards) == ["0", "1"]
    assert all(float(ratio) == 0.5 for _, ratio in shards)
