"""PyTorch's FX overlap scheduler and bucketer (schedule "inductor", a baseline) and Inductor's
compiler entry points, made to run on CPU graphs and on every supported torch: the Inductor
half of :mod:`autoshard._compat`, which re-exports what the rest of autoshard uses."""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch._inductor.config as inductor_config
import torch.utils._runtime_estimation as runtime_estimation
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "compile_fx",
    "compile_fx_inner",
    "overlap_scheduler_state",
    "patch_overlap_scheduler",
    "remove_noop_ops",
    "schedule_overlap_bucketing",
]

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
