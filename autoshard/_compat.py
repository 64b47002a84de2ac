"""Every PyTorch internal that autoshard touches, in one place.

Public APIs are imported where they are used; anything private (underscore modules,
config knobs, Inductor entry points) goes through this module, so moving to a new torch
release is a one-file change.
"""
from __future__ import annotations

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch.utils.checkpoint import CheckpointPolicy

__all__ = [
    "aot_autograd",
    "c10d",
    "compile_fx",
    "compile_fx_inner",
    "functorch_config",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
    "must_recompute",
    "register_backend",
    "TESTED_TORCH",
]

TESTED_TORCH = "2.13"

# The traceable functional collectives (explicit wait_tensor) that Inductor lowers.
c10d = torch.ops._c10d_functional

def register_backend(fn, name: str) -> None:
    """Make ``torch.compile(backend=name)`` find ``fn``.

    Installed, the package's ``torch_dynamo_backends`` entry point already does, and Dynamo
    refuses a second registration under the same name when it loads that entry point.
    """
    from importlib.metadata import entry_points

    if not entry_points(group="torch_dynamo_backends", name=name):
        torch._dynamo.register_backend(fn, name=name)


def must_recompute(node: torch.fx.Node, graph_id: int) -> None:
    """Tag a joint-graph node so the partitioner recomputes it in backward, never saves it."""
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["ac_graph_id"] = graph_id


def fake_process_group(rank: int, world_size: int) -> None:
    """Initialise the fake process group: collectives are shape-correct no-ops, so graphs
    can be compiled for any world size in one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
