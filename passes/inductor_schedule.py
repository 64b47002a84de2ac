"""Baseline: PyTorch's own FX overlap scheduler and bucketer, run on CPU graphs.

``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing`` is written for
CUDA: its roofline estimate asks Triton for the GPU's DRAM bandwidth and peak FLOPs, its
memory tracker skips CPU tensors, and its default compute estimator benchmarks on the GPU.
:func:`inductor_schedule` swaps exactly those pieces for the duration of one call and
otherwise runs PyTorch's code unchanged, so benchmarks can compare against it.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator
from unittest import mock

from torch import fx

from autoshard._compat import RUNTIME_ESTIMATION, MemoryTracker, c10d, inductor_config, overlap_scheduling


# PyTorch evaluates its roofline for every compute node even when our estimate replaces it;
# these stand in for the GPU figures it would read through Triton. Their values are unused.
CPU_DRAM_GBPS = 20.0
CPU_TFLOPS = 0.1


def _is_collective_start(node: fx.Node) -> bool:
    return getattr(node.target, "namespace", None) == "_c10d_functional" and node.target is not c10d.wait_tensor.default


@contextlib.contextmanager
def _cpu_estimators() -> Iterator[None]:
    """Patch what makes PyTorch's scheduler CUDA-only, for the duration of one call."""
    with contextlib.ExitStack() as stack:
        # estimate_roofline_runtime_ms runs for every compute node even when a custom estimate
        # replaces it; it would import triton for bandwidth and (without CUDA) get 0 FLOPs.
        stack.enter_context(mock.patch(f"{RUNTIME_ESTIMATION}.get_gpu_dram_gbps", lambda: CPU_DRAM_GBPS))
        stack.enter_context(mock.patch(f"{RUNTIME_ESTIMATION}.get_device_tflops", lambda dtype: CPU_TFLOPS))
        # The memory budget (baseline peak + 5%) would see 0 bytes: CPU tensors are skipped.
        cpu_too = functools.partial(MemoryTracker, device_filter=lambda device: True)
        stack.enter_context(mock.patch.object(overlap_scheduling, "MemoryTracker", cpu_too))
        # The bucketer can leave an ordering-only edge that closes a cycle (seen on our backward
        # graphs; PyTorch asks for a report and offers this switch, which drops such edges).
        # Data dependencies are never dropped, so the graph stays valid.
        stack.enter_context(
            inductor_config.patch({"aten_distributed_optimizations.overlap_scheduling_autofix_cycles": True})
        )
        yield


def inductor_schedule(
    gm: fx.GraphModule,
    compute_time: Callable[[fx.Node], float],
    collective_time: Callable[..., float],
    **options: Any,
) -> fx.GraphModule:
    """Reorder and bucket ``gm``'s collectives with PyTorch's overlap scheduler, in place.

    Runs ``schedule_overlap_bucketing`` with its overlap-preserving bucketing of all-gathers
    and reduce-scatters on; ``options`` override its keyword arguments (e.g.
    ``pre_bucketing_fsdp_collectives=True`` for its greedy pre-bucketing, off here because its
    cap comes from an NCCL model and puts a small model's every gather in one bucket).

    ``collective_time(node, nbytes=None)`` (collective starts; ``nbytes`` asks for another
    size, as PyTorch does to price the latency bucketing saves) and ``compute_time(node)``
    (every other node but waits) give seconds, e.g. :func:`autoshard.cost_model.estimators`.

    Guarantees: the result computes the same values: nodes are only reordered, and a bucket
    moves the same bytes through one concatenated buffer (a bucketed reduce-scatter may add the
    ranks' contributions in another order, so it is equal up to float rounding). The graph
    lints; its placeholders are the same and its outputs the same in number and order. Every
    patched PyTorch function and config value is restored on return. A bucketed gather is an
    ``all_gather_into_tensor_out`` that copies the local shard in at offset rank * numel, so
    graphs differ between ranks (as in PyTorch's own use). PyTorch's limits apply: prefetching
    may raise peak memory by max(1 GiB, 5%), a bucket holds at most 2 GiB. Needs the
    process group the collectives name to be initialised; a graph without collectives is
    returned untouched.
    """
    def estimate(node: fx.Node, override_size: int | None) -> float | None:  # in ms, as PyTorch wants
        if _is_collective_start(node):
            return 1e3 * collective_time(node, override_size)
        if node.target is c10d.wait_tensor.default:
            return 0.0
        return 1e3 * compute_time(node)

    kwargs: dict[str, Any] = dict(
        collective_bucketing=True,
        custom_runtime_estimation=estimate,
        compute_estimator="analytical",  # "benchmark" times kernels on the GPU
        collective_estimator="analytical",  # "benchmark" uses CUDA events
        pre_bucketing_fsdp_collectives=False,
    )
    kwargs.update(options)
    try:
        with _cpu_estimators():
            overlap_scheduling.schedule_overlap_bucketing(gm, **kwargs)
    finally:
        # functools.cache keyed on nodes: would keep our graphs alive.
        overlap_scheduling.get_group_name.cache_clear()
    gm.graph.lint()
    gm.recompile()
    return gm
