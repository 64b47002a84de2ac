"""Every PyTorch internal autoshard touches, in one place: a new torch release is a one-file change."""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import operator
import os
import sys
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.utils._runtime_estimation as runtime_estimation
from torch._dispatch.python import no_python_dispatcher
from torch._dynamo import lookup_backend
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.symbolic_convert import InstructionTranslator
from torch._dynamo.utils import counters as dynamo_counters
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager, unset_fake_temporarily
from torch.distributed.distributed_c10d import _get_default_store as default_store
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only
from torch.utils.checkpoint import CheckpointPolicy

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:
    # torch 2.11 has no optimization_hint (added by 2.13, where size_hint is gone). Its
    # size_hint(a, fallback) is the same read: the SymInt's recorded hint, or ``fallback`` per
    # unbacked symbol, without adding guards.
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

__all__ = [
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
    "COMPILE_PHASE_FUNCTIONS",
    "all_gather_single",
    "c10d",
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
    "no_python_dispatcher",
    "optimization_hint",
    "recompute_region",
    "register_backend",
    "save_random_ops_in_checkpoints",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
    "unset_fake_temporarily",
    "unlogged_graph_text",
    "wrap_compile_phases",
]

# The traceable functional collectives (explicit wait_tensor) that Inductor lowers.
c10d = torch.ops._c10d_functional

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


# PyTorch's FX overlap scheduler + bucketer (schedule "inductor", a baseline), run on CPU graphs.

# Inductor's compiler and this scheduler take ~1.5 s to import, which a user of aot_eager (and
# every rank a test spawns) never needs: their modules are imported when first used.


def _scheduling() -> Any:
    return importlib.import_module("torch._inductor.fx_passes.overlap_scheduling")


def _bucketer() -> Any:
    return importlib.import_module("torch._inductor.fx_passes.overlap_preserving_bucketer")


def compile_fx(*args: Any, **kwargs: Any) -> Any:
    """``torch._inductor.compile_fx.compile_fx``, imported when first called."""
    return importlib.import_module("torch._inductor.compile_fx").compile_fx(*args, **kwargs)


def remove_noop_ops(graph: torch.fx.Graph) -> None:
    """Inductor's removal of ops that change nothing (a pad of no rows, a slice of every row),
    which its partitioner runs on the joint graph: tests check that it leaves every rank's graph alike."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops as remove

    remove(graph)


def compile_fx_inner(*args: Any, **kwargs: Any) -> Any:
    """``torch._inductor.compile_fx.compile_fx_inner``, imported when first called."""
    return importlib.import_module("torch._inductor.compile_fx").compile_fx_inner(*args, **kwargs)


# Where its roofline estimate reads the device's memory bandwidth (it evaluates the roofline for
# every compute node even when a custom estimate replaces it). torch 2.11 and 2.13 call
# get_gpu_dram_gbps(), which asks Triton and so needs CUDA; torch 2.15 renamed it
# get_device_dram_gbps(device=None), which returns None for devices it has no figures for.
_DRAM_GBPS = "get_device_dram_gbps" if hasattr(runtime_estimation, "get_device_dram_gbps") else "get_gpu_dram_gbps"

# torch 2.13 added schedule_overlap_bucketing(compute_estimator=...); torch 2.11 always
# "benchmarks" compute nodes, through a cache on disk (keyed by op and shapes, kept across
# processes) that it reads *before* the custom estimate, so an earlier run's figures would win.
def _has_compute_estimator() -> bool:
    return "compute_estimator" in inspect.signature(_scheduling().schedule_overlap_bucketing).parameters

# torch 2.13 added this switch (the bucketer checks its ordering-only edges for cycles and,
# when on, drops the edges that close one); torch 2.11 has neither the check nor the switch,
# and its topological sort fails on such a cycle (an AssertionError; seen on our backward graphs).
_AUTOFIX_CYCLES = "overlap_scheduling_autofix_cycles"
_HAS_AUTOFIX_CYCLES = hasattr(inductor_config.aten_distributed_optimizations, _AUTOFIX_CYCLES)

# torch 2.11's bucketer groups collectives by bucketing.bucket_key alone, which is
# (group, reduce op, dtype) for reduce-scatters and all-reduces alike, so a 0-d parameter's
# all-reduce could join a reduce-scatter bucket (an AssertionError in merge_reduce_scatter_bucket).
# torch 2.13 groups by (collective type, bucket_key) and no longer imports bucket_key there.
@functools.cache  # first read before any patch: the original
def _untyped_bucket_key() -> Callable | None:
    return getattr(_bucketer(), "bucket_key", None)


def _typed_bucket_key(node: torch.fx.Node, mode: Any = None) -> object | None:
    key = _untyped_bucket_key()(node, mode)
    return None if key is None else (node.target, key)


def _uncached_estimate(node: torch.fx.Node, custom_runtime_estimation: Any = None) -> tuple[float, None]:
    # torch 2.11's benchmark_node_with_cache_key as torch 2.13's compute_estimator="analytical"
    # behaves: the custom estimate, else the analytical one; no cache key, so nothing is cached.
    est = None if custom_runtime_estimation is None else custom_runtime_estimation(node, None)
    return (_scheduling().estimate_runtime_analytical(node) if est is None else est), None


def _roofline_ms(node: torch.fx.Node) -> float:
    # torch 2.11's estimate_runtime_analytical (mm only; run on every compute node, for its log)
    # asserts CUDA before its roofline (RuntimeEstimator._roofline_estimate). The same roofline,
    # from runtime_estimation's figures (patched to the CPU's), without the assertion.
    if node.target is not torch.ops.aten.mm.default:
        return 0.0
    val = lambda n: n.meta["val"] if isinstance(n, torch.fx.Node) else n  # noqa: E731
    args, kwargs, out = tree_map(val, node.args), tree_map(val, node.kwargs), node.meta["val"]
    transfer_ns = runtime_estimation.get_transfer_time(tree_leaves((args, kwargs)), [out])
    compute_ns = runtime_estimation.get_compute_time(node.target.overloadpacket, args, kwargs, out, {out.dtype})
    return max(transfer_ns, compute_ns) / 1e6


def _drop_cyclic_extra_deps(aug_graph: Any) -> int:
    """Remove ordering-only edges (the bucketer's extra deps) that close a cycle with the
    graph's data edges and the other extra deps; returns how many. Data edges are never removed."""
    extra = aug_graph.extra_deps
    nodes = list(aug_graph.graph.nodes)
    present = set(nodes)

    def preds(node: torch.fx.Node) -> set[torch.fx.Node]:
        return {p for p in (*node.all_input_nodes, *extra.get(node, ())) if p in present}

    # Kahn's algorithm: the nodes it cannot order are on a cycle or after one.
    users: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}
    waiting = {}
    for node in nodes:
        waiting[node] = len(ps := preds(node))
        for p in ps:
            users[p].append(node)
    ready = [n for n in nodes if waiting[n] == 0]
    while ready:
        for user in users[ready.pop()]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)
    stuck = {n for n in nodes if waiting[n] > 0}

    def reaches(source: torch.fx.Node, target: torch.fx.Node) -> bool:  # target is an ancestor of source
        seen, todo = {source}, [source]
        while todo:
            for p in preds(todo.pop()):
                if p is target:
                    return True
                if p in stuck and p not in seen:
                    seen.add(p)
                    todo.append(p)
        return False

    dropped = 0
    for node in [n for n in extra if n in stuck]:
        for dep in [d for d in extra[node] if d in stuck]:
            if reaches(dep, node):  # node must follow dep, and dep (through others) follows node
                aug_graph.remove_extra_dep(n=node, dep=dep)
                dropped += 1
    return dropped


def _apply_deps_without_cycles(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def apply(self: Any) -> None:
        _drop_cyclic_extra_deps(self.aug_graph)
        original(self)

    return apply


def _patched_attributes() -> list[tuple[Any, str]]:
    points = [
        (runtime_estimation, _DRAM_GBPS),
        (runtime_estimation, "get_device_tflops"),
        (_scheduling(), "MemoryTracker"),
    ]
    if not _has_compute_estimator():
        points += [(_scheduling(), "benchmark_node_with_cache_key"), (_scheduling(), "estimate_runtime_analytical")]
    if not _HAS_AUTOFIX_CYCLES:
        points.append((_bucketer().OverlapPreservingBucketer, "_apply_deps_and_effect_tokens"))
    if _untyped_bucket_key() is not None:
        points.append((_bucketer(), "bucket_key"))
    return points


def overlap_scheduler_state() -> tuple[Any, ...]:
    """Every value :func:`patch_overlap_scheduler` patches, to check they are restored."""
    autofix = getattr(inductor_config.aten_distributed_optimizations, _AUTOFIX_CYCLES, None)
    return (*(getattr(obj, name) for obj, name in _patched_attributes()), autofix)


@contextlib.contextmanager
def patch_overlap_scheduler(dram_gbps: float, tflops: float) -> Iterator[None]:
    """Patch what makes ``schedule_overlap_bucketing`` CUDA-only or wrong on our graphs, for
    the duration of one call: its roofline reads ``dram_gbps`` and ``tflops`` instead of asking
    Triton; its memory tracker counts CPU tensors (it skips them, so the memory budget would see
    0 bytes); compute estimates come from the custom estimate, uncached, on every torch version;
    an ordering-only edge the bucketer leaves that closes a cycle is dropped (seen on our
    backward graphs; torch 2.13+ asks for a report and offers a switch that does this; on 2.11
    we do it; data dependencies are never dropped, so the graph stays valid); a bucket holds one
    kind of collective (torch 2.11 could mix all-reduces into reduce-scatter buckets)."""
    from torch._inductor.fx_passes.memory_estimator import MemoryTracker

    overlap_scheduling, overlap_bucketer = _scheduling(), _bucketer()
    _untyped_bucket_key()  # the original, read before it is patched
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(runtime_estimation, _DRAM_GBPS, lambda *args, **kwargs: dram_gbps))
        stack.enter_context(mock.patch.object(runtime_estimation, "get_device_tflops", lambda *args, **kwargs: tflops))
        cpu_too = functools.partial(MemoryTracker, device_filter=lambda device: True)
        stack.enter_context(mock.patch.object(overlap_scheduling, "MemoryTracker", cpu_too))
        if not _has_compute_estimator():
            stack.enter_context(mock.patch.object(overlap_scheduling, "benchmark_node_with_cache_key", _uncached_estimate))
            stack.enter_context(mock.patch.object(overlap_scheduling, "estimate_runtime_analytical", _roofline_ms))
            # torch 2.11 all-gathers estimates inside the compiler (it hung CI); ours agree by construction.
            scheduler = overlap_scheduling.OverlapScheduler
            align = "_align_compute_nodes_runtime_estimations_across_all_distributed_ranks"
            stack.enter_context(mock.patch.object(scheduler, align, lambda self: None))
        if _HAS_AUTOFIX_CYCLES:
            stack.enter_context(inductor_config.patch({f"aten_distributed_optimizations.{_AUTOFIX_CYCLES}": True}))
        else:
            bucketer = overlap_bucketer.OverlapPreservingBucketer
            apply = _apply_deps_without_cycles(bucketer._apply_deps_and_effect_tokens)
            stack.enter_context(mock.patch.object(bucketer, "_apply_deps_and_effect_tokens", apply))
        if _untyped_bucket_key() is not None:
            stack.enter_context(mock.patch.object(overlap_bucketer, "bucket_key", _typed_bucket_key))
        yield


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


def schedule_overlap_bucketing(gm: torch.fx.GraphModule, **kwargs: Any) -> torch.fx.GraphModule:
    """``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing`` with the
    keyword arguments torch 2.13 takes, on every supported torch."""
    overlap_scheduling = _scheduling()
    params = inspect.signature(overlap_scheduling.schedule_overlap_bucketing).parameters
    if "compute_estimator" not in params:
        # torch 2.11: "analytical" is what patch_overlap_scheduler makes of its benchmarking.
        if kwargs.pop("compute_estimator", "analytical") != "analytical":
            raise ValueError("torch 2.11's overlap scheduler has no compute_estimator: it always benchmarks")
    if "pre_bucketing_fsdp_collectives" not in params:
        # torch 2.11 has no FSDP pre-bucketing (added by 2.13): off is all it does.
        if kwargs.pop("pre_bucketing_fsdp_collectives", False):
            raise ValueError("torch 2.11's overlap scheduler has no pre_bucketing_fsdp_collectives")
    try:
        return overlap_scheduling.schedule_overlap_bucketing(gm, **kwargs)
    finally:
        # torch 2.13+ memoises get_group_name with functools.cache on fx nodes, which would keep
        # our graphs alive; torch 2.11 does not cache it.
        if hasattr(overlap_scheduling.get_group_name, "cache_clear"):
            overlap_scheduling.get_group_name.cache_clear()
