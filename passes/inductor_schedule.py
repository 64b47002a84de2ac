"""Baseline: PyTorch's own FX overlap scheduler and bucketer, run on CPU graphs.

``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing`` is written for
CUDA: its roofline estimate asks Triton for the GPU's DRAM bandwidth and peak FLOPs, its
memory tracker skips CPU tensors, and its default compute estimator benchmarks on the GPU.
:func:`inductor_schedule` swaps exactly those pieces (and works around older releases' bugs)
for the duration of one call, through ``autoshard._compat.patch_overlap_scheduler``, which knows
how each torch version names them, and otherwise runs PyTorch's code unchanged, so benchmarks
can compare against it.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import fx

from autoshard._compat import patch_overlap_scheduler, schedule_overlap_bucketing

from .graph_utils import collective_kind, is_wait

# PyTorch evaluates its roofline for every compute node even when our estimate replaces it;
# these stand in for the GPU figures it would read through Triton. Their values are unused.
CPU_DRAM_GBPS = 20.0
CPU_TFLOPS = 0.1


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
    (every other node but waits) give seconds, e.g. :func:`autoshard.cost.cost_model.estimators`.

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
        if collective_kind(node) is not None:
            return 1e3 * collective_time(node, override_size)
        if is_wait(node):
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
    # What makes PyTorch's scheduler CUDA-only or wrong on our graphs is patched for the duration
    # of the call (see patch_overlap_scheduler); its caches keyed on our nodes are cleared after it.
    with patch_overlap_scheduler(CPU_DRAM_GBPS, CPU_TFLOPS):
        schedule_overlap_bucketing(gm, **kwargs)
    gm.graph.lint()
    gm.recompile()
    return gm
