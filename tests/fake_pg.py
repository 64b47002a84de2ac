"""Compile as a large world in one process with the fake process group, and capture the
final forward and backward graphs the backend produced."""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch.distributed as dist
from torch import fx

import autoshard.backend
from autoshard._compat import fake_process_group


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    fake_process_group(rank, world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def captured_graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[fx.GraphModule]]]:
    """Collect each graph the backend hands to its inner compiler, by stage."""
    graphs: dict[str, list[fx.GraphModule]] = {"forward": [], "backward": []}
    finish = autoshard.backend._finish

    def recording_finish(gm, stage, *args):
        graphs[stage].append(finish(gm, stage, *args))
        return gm

    monkeypatch.setattr(autoshard.backend, "_finish", recording_finish)
    yield graphs


def count(gm: fx.GraphModule, op_name: str) -> int:
    """Number of calls to an op whose name contains ``op_name`` (e.g. "all_gather_into_tensor")."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and op_name in str(n.target))
