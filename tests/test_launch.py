"""The launcher behind the tests, benchmarks, calibration and the example."""
from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from autoshard.tools.launch import run_ranks

pytestmark = pytest.mark.multirank


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _rank_one_fails() -> None:
    if dist.get_rank() == 1:
        time.sleep(0.5)
        raise ValueError("rank 1 fails")
    time.sleep(300)  # rank 0 would run on for minutes: the launcher must not wait for it


def _rank_zero_hangs() -> None:
    if dist.get_rank() == 0:
        time.sleep(300)


def test_results_come_back_by_rank() -> None:
    assert run_ranks(2, _rank_and_world) == [(0, 2), (1, 2)]


def test_a_failing_rank_fails_the_caller_at_once_with_its_traceback_first() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed") as info:
        run_ranks(2, _rank_one_fails, timeout=120)
    assert time.monotonic() - start < 60  # not the 300 s rank 0 would have slept
    message = str(info.value)
    assert message.index("--- rank 1 (exit code 1) ---") < message.index("--- rank 0 (killed) ---")
    assert "ValueError: rank 1 fails" in message


def test_a_hang_is_a_timeout_that_shows_where_each_rank_waits() -> None:
    with pytest.raises(TimeoutError, match=r"2 of 2 ranks still running after 8s") as info:
        run_ranks(2, _rank_zero_hangs, timeout=8)
    rank0, rank1 = str(info.value).split("--- rank 1")
    assert "in _rank_zero_hangs" in rank0 and "in barrier" in rank1  # where each rank waits
