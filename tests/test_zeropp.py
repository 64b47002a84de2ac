"""bench/zeropp.py on a small GPT at 16 fake ranks of 4 per node: ZeRO-3's, int8's and hpZ's
traffic split into what crosses nodes and what stays inside, as the ZeRO++ table reads it."""
from __future__ import annotations

import pytest
from zeropp import run

from gpt import GPTConfig

pytestmark = pytest.mark.planner

SMALL = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    return {v: run(v, world=16, tokens=64, gbps=100, ranks_per_node=4, seq=64, cfg=SMALL) for v in ("zero3", "qwZ+qgZ", "qwZ+hpZ+qgZ")}


def test_zero3_sends_about_three_fp16_models_across_nodes_and_nothing_inside(rows):
    model = 15 / 16 * 2 * rows["zero3"]["parameters"] / 1e9  # GB each rank sends of one fp16 copy
    # Forward gathers and reduce-scatters, one model each; backward gathers of all but what the
    # default keeps gathered (the last block and what follows it: here half the model).
    assert 2.0 < rows["zero3"]["cross_node_gb"] / model < 3.0
    assert rows["zero3"]["in_node_gb"] == 0


def test_int8_halves_the_traffic_and_hpz_moves_the_backward_gathers_into_the_node(rows):
    zero3, int8, hpz = (rows[v] for v in ("zero3", "qwZ+qgZ", "qwZ+hpZ+qgZ"))
    assert 0.45 < int8["cross_node_gb"] / zero3["cross_node_gb"] < 0.6  # int8 values and float32 scales
    assert int8["in_node_gb"] == 0
    # hpZ reshards every parameter (reshard_after_forward=4): the backward gathers each one's
    # node slices in fp16 over 4 ranks (3/4 of it sent), inside the node; only the forward's int8
    # gathers and the int8 reductions cross.
    assert hpz["in_node_gb"] == pytest.approx(3 / 4 * 2 * hpz["parameters"] / 1e9, rel=0.1)
    assert hpz["cross_node_gb"] < int8["cross_node_gb"]
    assert 0.3 < hpz["cross_node_gb"] / zero3["cross_node_gb"] < 0.45
