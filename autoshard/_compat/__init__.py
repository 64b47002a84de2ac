"""Every PyTorch internal autoshard touches, in one place: a new torch release is a change here.

The Inductor overlap scheduler's patches and Inductor's compiler entry points live in
:mod:`autoshard._compat.inductor`, the partitioner's save/recompute tags in
:mod:`autoshard._compat.recompute`; everything is imported from ``autoshard._compat``."""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dispatch.python import no_python_dispatcher
from torch._dynamo import lookup_backend
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.symbolic_convert import InstructionTranslator
from torch._dynamo.utils import counters as dynamo_counters
from torch._dynamo.utils import dynamo_timed
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager, unset_fake_temporarily
from torch.distributed.distributed_c10d import _get_default_store as default_store
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from autoshard._compat.inductor import (
    compile_fx,
    compile_fx_inner,
    overlap_scheduler_state,
    patch_overlap_scheduler,
    remove_noop_ops,
    schedule_overlap_bucketing,
)
from autoshard._compat.recompute import must_recompute, must_save, recompute_region, save_random_ops_in_checkpoints

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:
    # torch 2.11 has no optimization_hint (added by 2.13, where size_hint is gone). Its
    # size_hint(a, fallback) is the same read: the SymInt's recorded hint, or ``fallback`` per
    # unbacked symbol, without adding guards.
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

__all__ = [
    "must_recompute",
    "must_save",
    "recompute_region",
    "save_random_ops_in_checkpoints",
    "patch_overlap_scheduler",
    "overlap_scheduler_state",
    "schedule_overlap_bucketing",
    "default_store",
    "detect_fake_mode",
    "BACKEND_MARK",
    "tracing_for_backend",
    "resolve_process_group",
    "run_and_get_code",
    "aot_autograd",
    "autograd_inside_op",
    "COMPILE_PHASE_FUNCTIONS",
    "all_gather_single",
    "c10d",
    "keep_shape_static",
    "mark_batch_dynamic",
    "dynamo_counters",
    "FakeTensor",
    "fake_from_meta",
    "new_empty",
    "fake_view",
    "compile_fx",
    "copy_graph",
    "compile_fx_inner",
    "functorch_config",
    "inductor_config",
    "lookup_backend",
    "boxed",
    "min_cut_rematerialization_partition",
    "must_recompute",
    "must_save",
    "no_python_dispatcher",
    "optimization_hint",
    "recompute_region",
    "register_backend",
    "remove_noop_ops",
    "OpOverload",
    "schema_arguments",
    "schema_of",
    "save_random_ops_in_checkpoints",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
    "unset_fake_temporarily",
    "unlogged_graph_text",
    "wrap_compile_phases",
    "compile_phase",
    "register_torch_log",
    "structured_trace_on",
    "trace_artifact",
]

@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Autograd on again inside a custom op's implementation, which runs below autograd
    (``_AutoDispatchBelowAutograd`` excludes its keys): for an op whose backward recomputes a
    function and differentiates it (expert parallelism's backward)."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set().remove(C.DispatchKey.AutogradFunctionality)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def keep_shape_static(t: torch.Tensor) -> None:
    """Dynamo never makes ``t``'s sizes dynamic (automatic dynamic shapes would, for a plain
    tensor read in a frame recompiled for another shape); nn.Parameters are static already."""
    torch._dynamo.mark_static(t)


# The traceable functional collectives (explicit wait_tensor) that Inductor lowers.
c10d = torch.ops._c10d_functional

# An op's overload (``torch.ops.aten.mm.default``): what FX nodes call and custom ops define.
OpOverload = torch._ops.OpOverload


def mark_batch_dynamic(t: torch.Tensor) -> None:
    """Dim 0 a symbol from the first compile (adaptive batch shares: every rank compiles once, alike)."""
    torch._dynamo.mark_dynamic(t, 0)


def schema_of(target: Any) -> torch.FunctionSchema | None:
    """The schema of an FX node's target when it is an op overload, else None."""
    return getattr(target, "_schema", None)


def schema_arguments(op: OpOverload) -> list[torch.Argument]:
    """The arguments of ``op``'s schema (each with ``name``, ``kwarg_only``, ``default_value``), in order."""
    return op._schema.arguments

# The blocking all-gather into one tensor. torch 2.13 renamed dist.all_gather_into_tensor to
# all_gather_single (the old name stays, documented as deprecated, and calls the new one);
# torch 2.11 has only the old name.
all_gather_single = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor

def new_empty(like: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``like.new_empty(shape, dtype=dtype)``. For a fake tensor of static shape, made as the fake
    mode makes a meta kernel's output, without its dispatch: a fake kernel that runs for every
    parameter while AOT autograd traces costs a tenth."""
    if not isinstance(like, FakeTensor) or not all(isinstance(n, int) for n in shape):
        return like.new_empty(shape, dtype=dtype)
    with unset_fake_temporarily():
        meta = torch.empty(shape, dtype=dtype, device="meta")
    return FakeTensor(like.fake_mode, meta, like.device)


def fake_from_meta(fake_mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> FakeTensor:
    """A fake tensor of ``fake_mode`` on ``device`` with ``meta``'s shape, strides and dtype:
    what the fake mode itself makes of a meta kernel's output, without its dispatch. ``meta``
    must be fresh (made for this value alone): it is not memoised as a converted tensor."""
    return FakeTensor(fake_mode, meta, device)


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph``: new nodes with the same targets, arguments and (shallow-copied)
    meta, so they share their fake values; the same code generator (how the graph's inputs
    and outputs are laid out) and the output's meta."""
    new = torch.fx.Graph()
    out = new.output(new.graph_copy(graph, {}))
    out.meta = dict(graph.output_node().meta)
    new._codegen = graph._codegen
    return new


def fake_view(fake_mode: FakeTensorMode, target: Any, args: tuple, device: torch.device) -> FakeTensor:
    """``target(*args)`` for a view op of fake tensors (static shapes), on their own storage:
    the view's meta kernel run as the fake mode runs kernels, then wrapped as it wraps their
    outputs (its dispatch, cache lookups included, costs ten times as much)."""
    with in_kernel_invocation_manager(fake_mode):
        out = target(*args)
    return FakeTensor(fake_mode, out, device)


BACKEND_MARK = "_autoshard_backend"  # an attribute set on autoshard's backend function

# Where Dynamo's wrappers of a backend (torch.compile's, its debug wrapper, functools.partial,
# functools.wraps) keep what they wrap.
_WRAPPED = ("_torchdynamo_orig_backend", "compiler_fn", "__wrapped__", "func")


def tracing_for_backend() -> bool:
    """Called for real while Dynamo traces (from an ``assume_constant_result`` function):
    whether the graph will be handed to the backend marked with :data:`BACKEND_MARK`."""
    tx = getattr(InstructionTranslator, "current_tx", lambda: None)()
    fn = getattr(getattr(tx, "output", None), "compiler_fn", None)
    for _ in range(16):
        if fn is None or getattr(fn, BACKEND_MARK, False):
            return fn is not None
        fn = next((w for w in (getattr(fn, a, None) for a in _WRAPPED) if w is not None and w is not fn), None)
    return False


def register_backend(fn, name: str) -> None:
    """Make ``torch.compile(backend=name)`` find ``fn``.

    Installed, the package's ``torch_dynamo_backends`` entry point already does, and Dynamo
    refuses a second registration under the same name when it loads that entry point.
    """
    from importlib.metadata import entry_points

    if not entry_points(group="torch_dynamo_backends", name=name):
        torch._dynamo.register_backend(fn, name=name)


def boxed(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` in the boxed calling convention: called with one list of inputs, which it empties,
    so each input dies at its last use (``make_boxed_func`` keeps the list, and with it every
    saved activation of a backward, alive until the graph returns)."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()
    return gm


_DEVICE_MESH_MODULE = "torch.distributed.device_mesh"


def _called_from_device_mesh() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == _DEVICE_MESH_MODULE:
            return True
        frame = frame.f_back
    return False


class _FakeTensorModeRealMeshes(FakeTensorMode):
    """A FakeTensorMode under which DeviceMesh code computes on real tensors.

    Building a DeviceMesh (``init_device_mesh``, submeshes) makes its rank map with tensor
    ops and then reads the values (``tolist``), which a fake tensor lacks: under a plain fake
    mode that raises DataDependentOutputException. A rank map is a few ints of metadata,
    never a model tensor, so ops run on behalf of ``torch.distributed.device_mesh`` on no fake
    input are run for real; everything else stays fake.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # The fake check first: the frame walk is only paid by ops on real inputs (factories).
        if not any(isinstance(t, FakeTensor) for t in tree_leaves((args, kwargs))) and _called_from_device_mesh():
            return func(*args, **kwargs)  # this mode is unset while it dispatches: the real kernel
        return super().__torch_dispatch__(func, types, args, kwargs)


def fake_tensor_mode() -> Any:
    """A FakeTensorMode: tensors created inside carry shapes, dtypes and devices but no
    memory, and ops on them only compute output metadata. DeviceMeshes built inside (a
    factory's ``init_device_mesh``, ``autoshard.shard``'s default mesh) hold real rank maps."""
    return _FakeTensorModeRealMeshes(allow_non_fake_inputs=True)


def fake_process_group(rank: int, world_size: int) -> None:
    """Initialise the fake process group: collectives are shape-correct no-ops, so graphs
    can be compiled for any world size in one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


# What a DCP checkpoint's .metadata pickle may reference (module -> names): DCP's metadata
# classes and the torch types inside them, private names included, as torch 2.11 to 2.15 write
# them (the same set: tests/test_checkpoint.py loads through this list on each).
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


# Where a compile spends its time (bench/compile_time.py): PyTorch function -> phase. The
# partitioner is imported by name into several modules; each copy is wrapped.
COMPILE_PHASE_FUNCTIONS = {
    "min_cut_rematerialization_partition": ("torch._functorch.partitioners", "partition"),
    "_recursive_joint_graph_passes": ("torch._inductor.compile_fx", "inner"),  # Inductor's own joint passes
    "_compile_fx_inner": ("torch._inductor.compile_fx", "inner"),
}


@contextlib.contextmanager
def wrap_compile_phases(wrap: Callable[[Callable, str], Callable]) -> Iterator[None]:
    """Replace each :data:`COMPILE_PHASE_FUNCTIONS` entry, in every loaded module holding it,
    by ``wrap(function, phase)`` for the duration of the block."""
    with contextlib.ExitStack() as stack:
        for name, (home, phase) in COMPILE_PHASE_FUNCTIONS.items():
            original = getattr(importlib.import_module(home), name)
            wrapped = wrap(original, phase)
            for module in list(sys.modules.values()):
                if getattr(module, name, None) is original:
                    stack.enter_context(mock.patch.object(module, name, wrapped))
        yield


# AOT autograd's functions that print its joint, forward and backward graphs as text, for its
# logs and its cache entry, whether or not anything will read them (torch 2.11-2.15).
_GRAPH_TEXT = {"_log_joint_graph": None, "_log_fw_bw_graphs": (None, None)}
_GRAPH_LOGS = ("aot_joint_log", "aot_graphs_log")  # the loggers they print to


def _traces(handler: logging.Handler) -> bool:
    # A structured trace (TORCH_TRACE, tlparse) is written unless this is torch's lazy handler
    # without a directory: outside Meta's cluster it removes itself at its first record.
    lazy = type(handler).__name__ == "LazyTraceHandler" and getattr(handler, "stream", None) is None
    return not (lazy and getattr(handler, "root_dir", None) is None and os.getenv("MAST_HPC_JOB_NAME") is None)


def structured_trace_on() -> bool:
    """Whether torch's structured trace is being written (``TORCH_TRACE``, read by tlparse).
    Only torch's own trace handler counts: pytest's log capture hangs handlers on every logger."""
    lazy = torch._logging._internal.LazyTraceHandler
    return any(isinstance(h, lazy) and _traces(h) for h in torch._logging._internal.trace_log.handlers)


def trace_artifact(name: str, encoding: str, payload: Callable[[], Any]) -> None:
    """One artifact in the structured trace (tlparse lists it under the compile that made it):
    ``payload()`` as text (``encoding="string"``) or as JSON (``"json"``), called only if a
    trace is written."""
    torch._logging.trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload)


def compile_phase(key: str) -> contextlib.AbstractContextManager:
    """Time the block as Dynamo times its own phases: under ``key`` in
    ``torch._dynamo.utils.compile_times()`` and as a chromium event of the structured trace."""
    return dynamo_timed(key)


def register_torch_log(alias: str, qname: str) -> None:
    """Let ``TORCH_LOGS=alias`` (``+alias``: DEBUG) and ``torch._logging.set_logs(modules={alias: level})``
    set the level of the logger ``qname`` and its children, and give it torch's handler."""
    torch._logging._internal.register_log(alias, qname)


def _graph_logs_wanted(module: Any) -> bool:
    structured = any(map(_traces, torch._logging._internal.trace_log.handlers))
    return structured or any(getattr(module, log).isEnabledFor(logging.INFO) for log in _GRAPH_LOGS)


@contextlib.contextmanager
def unlogged_graph_text() -> Iterator[None]:
    """Inside, AOT autograd prints its graphs as text only when a log will show them
    (``TORCH_LOGS=aot_graphs``, ``aot_joint_graph``, or a structured trace). Otherwise the text
    went nowhere: autoshard turns the AOT autograd cache off, the one other reader. Printing
    the three graphs (code generation for each) was 0.88M of the 10.04M Python calls a
    16-layer GPT's backend call made outside autoshard's passes."""
    module = importlib.import_module("torch._functorch._aot_autograd.graph_compile")
    if not all(hasattr(module, name) for name in (*_GRAPH_TEXT, *_GRAPH_LOGS)) or _graph_logs_wanted(module):
        yield
        return
    with contextlib.ExitStack() as stack:
        for name, nothing in _GRAPH_TEXT.items():
            stack.enter_context(mock.patch.object(module, name, lambda *args, _nothing=nothing, **kwargs: _nothing))
        yield
