"""Compile as a large world in one process with the fake process group, and capture the
final forward and backward graphs the backend produced."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist
from torch import fx

from autoshard._compat import fake_process_group
from autoshard.dump import recording


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    fake_process_group(rank, world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _ByStage:
    """``graphs["forward"]``: the copies of that stage recorded so far, in compile order."""

    def __init__(self, compiled: list[dict[str, fx.GraphModule]]) -> None:
        self.compiled = compiled

    def __getitem__(self, stage: str) -> list[fx.GraphModule]:
        return [stages[stage] for stages in self.compiled if stage in stages]


@contextlib.contextmanager
def captured_graphs() -> Iterator[_ByStage]:
    """The graphs the backend compiles meanwhile, by stage (``forward``, ``backward``, ...)."""
    with recording() as compiled:
        yield _ByStage(compiled)


def count(gm: fx.GraphModule, op_name: str) -> int:
    """Number of calls to an op whose name contains ``op_name`` (e.g. "all_gather_into_tensor")."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and op_name in str(n.target))
