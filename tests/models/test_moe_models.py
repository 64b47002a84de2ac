"""Expert parallelism on a ``transformers`` Mixtral (tiny config, its experts one module with
3-D weights): it trains exactly as one process on the whole batch with its experts split over
every rank, in one graph whatever the routing (the MoE GPT's tests: tests/test_moe.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the real-model tier needs the models extra: pip install -e '.[models]'")

import moe_trainer  # noqa: E402

from autoshard.launch import run_ranks  # noqa: E402

TOL = 1e-5


@pytest.mark.parametrize("world, compiler", [(2, "aot_eager"), (4, "aot_eager"), (2, "inductor")])
def test_transformers_mixtral_trains_like_one_process(world: int, compiler: str) -> None:
    for found in run_ranks(world, moe_trainer.train, "mixtral", compiler, 3, timeout=900):
        assert found["loss"] <= TOL and found["params"] <= TOL, (found["loss"], found["params"])
        local, full = found["expert_bytes"]
        assert local * world == full  # each rank holds 1/world of the experts
        assert found["graphs"] == 1, found["graphs"]
