"""Over gloo, every gather the backend compiles writes into a buffer (gloo's out-of-place gather
corrupts the heap with several in flight: passes/gloo.py; bench/gloo_gathers.py shows it), and
the graph frees its gather buffers itself; bucketed reduce-scatters become all-to-alls and a
mean over the ranks (the bytes of a reduce-scatter, where gloo's own moves an all-reduce's).
The numerics tests train through these graphs: the results stay exact."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.tools.launch import run_ranks

from models import batch, build

pytestmark = pytest.mark.multirank


def _final_stages(folder: str) -> dict[str, str]:
    """Compile the test GPT on this rank with a debug_dir, train one step, return the final
    forward and backward graphs' source."""
    torch._dynamo.reset()
    model = build("gpt")
    autoshard.shard(model)
    compiled = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager", "debug_dir": folder})
    x, y = batch("gpt", 0)
    compiled(x, y).backward()
    (graphs,) = (Path(folder) / f"rank{dist.get_rank()}").iterdir()
    return {side: (graphs / f"{side}.py").read_text() for side in ("forward", "backward")}


def test_compiled_graphs_on_gloo_gather_into_buffers(tmp_path):
    for stages in run_ranks(2, _final_stages, str(tmp_path)):
        for side, source in stages.items():
            assert "all_gather_into_tensor_out" in source, side
            assert "all_gather_into_tensor.default(" not in source, side  # no out-of-place gather is left
            assert "resize_storage_bytes_" in source, side  # the graph frees the gather buffers itself
        backward = stages["backward"]
        assert "all_to_all_single.default(" in backward and "reduce_scatter_tensor.default(" not in backward
