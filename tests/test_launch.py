"""The launcher behind the tests, benchmarks, calibration and the example."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from autoshard.launch import run_ranks


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _rank_one_fails() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    dist.barrier()  # rank 0 waits for a rank that is gone: it must fail too, not hang


def test_results_come_back_by_rank_and_a_failing_rank_fails_the_caller(capfd):
    assert run_ranks(2, _rank_and_world) == [(0, 2), (1, 2)]
    with pytest.raises(RuntimeError, match=r"ranks exited with codes \[\d+, 1\]"):
        run_ranks(2, _rank_one_fails, timeout=120)
    assert "ValueError: rank 1 fails" in capfd.readouterr().err
