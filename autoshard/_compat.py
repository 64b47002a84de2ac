"""Every PyTorch internal that autoshard touches, in one place.

Public APIs are imported where they are used; anything private (underscore modules,
config knobs, Inductor entry points) goes through this module, so moving to a new torch
release is a one-file change.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters as dynamo_counters
from torch._functorch.aot_autograd import make_boxed_func
import torch._inductor.fx_passes.overlap_scheduling as overlap_scheduling
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.fx_passes.memory_estimator import MemoryTracker
from torch._inductor.utils import run_and_get_code
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch.distributed.distributed_c10d import _get_default_store as default_store
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:
    # torch 2.11 has no optimization_hint (added by 2.13, where size_hint is gone). Its
    # size_hint(a, fallback) is the same read: the SymInt's recorded hint, or ``fallback`` per
    # unbacked symbol, without adding guards.
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

__all__ = [
    "MemoryTracker",
    "RUNTIME_ESTIMATION",
    "overlap_scheduling",
    "default_store",
    "resolve_process_group",
    "run_and_get_code",
    "aot_autograd",
    "c10d",
    "dynamo_counters",
    "compile_fx",
    "compile_fx_inner",
    "functorch_config",
    "inductor_config",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
    "must_recompute",
    "optimization_hint",
    "must_save",
    "recompute_region",
    "register_backend",
    "save_random_ops_in_checkpoints",
    "TESTED_TORCH",
    "to_local_source",
    "tree_leaves",
    "tree_map",
]

TESTED_TORCH = "2.13"

# Where Inductor's roofline estimate reads hardware numbers (patched to run it on CPU).
RUNTIME_ESTIMATION = "torch.utils._runtime_estimation"

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


def to_local_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The DTensor node that a Dynamo-captured ``dtensor.to_local()`` node reads, else None."""
    # torch 2.13 and 2.15 capture ``to_local()`` as call_method "to_local"; torch 2.11 captures a
    # call_function of a closure Dynamo builds per call (its arguments baked in) and names
    # "prim_to_local", so it can only be recognised by that name.
    if node.op == "call_method" and node.target == "to_local":
        return node.args[0]
    if node.op == "call_function" and getattr(node.target, "__name__", None) == "prim_to_local":
        return node.args[0]
    return None


def must_recompute(node: torch.fx.Node, graph_id: int) -> None:
    """Tag a joint-graph node so the partitioner recomputes it in backward, never saves it."""
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["ac_graph_id"] = graph_id


def recompute_region(node: torch.fx.Node) -> int | None:
    """The region id of a node tagged MUST_RECOMPUTE, else None."""
    return node.meta.get("ac_graph_id") if node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE else None


def save_random_ops_in_checkpoints(joint: torch.fx.GraphModule) -> None:
    """Tag random ops (dropout, scaled_dot_product_attention) inside activation-checkpointed
    regions of a joint graph to be saved, not recomputed.

    Recomputing a random op makes the partitioner save its RNG state for backward, and in
    torch 2.13 it appends those states after the opaque objects the forward saves (a DTensor
    parameter's DeviceMesh, which every sharded model has), breaking AOT autograd's calling
    convention: the forward fails at run time with "expected all
    tensors_saved_with_vc_check to be Tensors". Saving the op's outputs needs no RNG replay
    and is exact; it costs their memory (for attention, the output and log-sum-exp of the
    region, as selective activation checkpointing commonly does).
    """
    recompute = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
    for node in joint.graph.nodes:
        random = node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        if random and node.meta.get("recompute") in recompute:
            # A tuple result is saved through its getitems.
            for saved in [node, *(u for u in node.users if u.target is operator.getitem)]:
                saved.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def must_save(node: torch.fx.Node) -> None:
    """Tag a joint-graph node so the partitioner saves it for backward."""
    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def fake_tensor_mode() -> Any:
    """A FakeTensorMode: tensors created inside carry shapes, dtypes and devices but no
    memory, and ops on them only compute output metadata."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_process_group(rank: int, world_size: int) -> None:
    """Initialise the fake process group: collectives are shape-correct no-ops, so graphs
    can be compiled for any world size in one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


# What a DCP checkpoint's .metadata pickle may reference (module -> names): DCP's metadata
# classes and the torch types inside them, private names included, as torch 2.13 writes them.
DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "torch": {"Size"} | {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}
