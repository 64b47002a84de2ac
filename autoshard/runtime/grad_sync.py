"""Gradient accumulation without synchronisation: ``model.set_requires_gradient_sync(False)``.

While synchronisation is off, a backward communicates nothing: each trainable parameter's
full, unreduced local gradient goes to a *sink*, a full-shape leaf tensor of no memory
(a broadcast zero) whose ``.grad`` autograd accumulates over micro-batches, in the reduce
dtype. ``set_requires_gradient_sync(True)`` then reduces every accumulated gradient the way
the parameter's strategy reduces gradients (reduce-scatter, all-reduce, or both; averaged
over the data-parallel ranks), adds it to the parameter's sharded ``.grad`` and frees it.
The next backward (synchronised) adds its own reduced gradient, so after it ``.grad`` holds
the average over ranks of the sum over micro-batches, exactly as without sharding. This is
FSDP2's semantics; the memory cost is the same too: one full-size gradient per trainable
parameter while accumulating.

The flag is a plain Python attribute that a traced parameter read depends on (through the
ghost attribute it reads, autoshard.runtime.leaves.show_reads), so Dynamo guards on it: a
compiled model has exactly two variants (synchronised or not) and switching between them
recompiles nothing after each has compiled once.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard.runtime import leaves, ops
from autoshard.runtime.errors import UsageError
from autoshard.runtime.timed_waits import timed_blocking

SYNC = leaves.SYNC  # on each module owning sharded parameters: whether backward reduces
SINKS = "_autoshard_sinks"  # on the same modules: parameter name -> sink tensor


def _sink(param: nn.Parameter, spec: Any, dtype: torch.dtype) -> torch.Tensor:
    """A leaf of the full parameter's shape that autograd can accumulate into, holding one
    element (stride 0): memory is spent only on the gradient it receives."""
    existing = getattr(param, "_autoshard_sink", None)  # shared by every module using param (tied)
    if existing is None or existing.dtype != dtype:
        existing = leaves.one_element(leaves.gathered_shape(param, spec), dtype, param.device).requires_grad_(True)
        param._autoshard_sink = existing
    return existing


FLUSH_BUCKET_BYTES = 64 * 2**20  # one flush collective's buffer at most: bounds the extra memory


def _reduce_bucket(items: list[tuple[nn.Parameter, Any, torch.Tensor]]) -> list[torch.Tensor]:
    """Each accumulated gradient of ``items`` (parameters that reduce alike) reduced to this
    rank's part, averaged over the data-parallel ranks, with one collective for all of them."""
    param, spec, _ = items[0]
    args = (spec.group_name, spec.world_size)
    tail = ("flush", spec.reduce_dtype, param.dtype, spec.replica_group, spec.replicas)
    if spec.dim0 < 0:  # replicated: all-reduce the gradients end to end
        sizes = [g.numel() for _, _, g in items]
        flat = ops.all_reduce_grad(torch.cat([g.reshape(-1) for _, _, g in items]), *args, *tail)
        return [piece.view(g.shape) for piece, (_, _, g) in zip(flat.split(sizes), items)]
    # Sharded: each gradient padded and laid out rank-major, [world, its rows per rank], side by
    # side; row r of the bucket is then rank r's part of every gradient, so a reduce-scatter of
    # the bucket's rows hands every rank its rows of each.
    # Under state shares each gradient is cut by its rows, each rank's part padded to the widest.
    chunks = [max(s.rows) if s.rows else ops.chunk_rows(s.dim0, spec.world_size) for _, s, _ in items]
    cols = [(ops.spread_rows(g, s.rows) if s.rows else ops.pad_rows(g, c * spec.world_size)).reshape(spec.world_size, -1)
            for (_, s, g), c in zip(items, chunks)]
    mine = ops.reduce_grad(torch.cat(cols, dim=1), *args, 1, *tail).view(-1)
    pieces = mine.split([c.shape[1] for c in cols])
    # The gradients' own trailing dims: the gathered shape's (a tp-local piece's under tensor parallelism).
    return [piece.view(c, *g.shape[1:])[: p.to_local().shape[0]] for piece, c, (p, _, g) in zip(pieces, chunks, items)]


def _buckets(items: list[tuple[nn.Parameter, Any, torch.Tensor]]) -> list[list[tuple[nn.Parameter, Any, torch.Tensor]]]:
    """``items`` grouped by how they are reduced, in order, each group cut at FLUSH_BUCKET_BYTES."""
    groups: dict[tuple, list[list]] = {}
    for item in items:
        param, spec, grad = item
        key = (spec.dim0 < 0, spec.group_name, spec.world_size, spec.reduce_dtype, param.dtype, grad.dtype,
               spec.replica_group, spec.replicas)
        runs = groups.setdefault(key, [[]])
        if runs[-1] and sum(g.nbytes for _, _, g in runs[-1]) + grad.nbytes > FLUSH_BUCKET_BYTES:
            runs.append([])
        runs[-1].append(item)
    return [run for runs in groups.values() for run in runs]


def _flush(modules: list[nn.Module]) -> None:
    """Reduce every accumulated sink gradient into its parameter's ``.grad``, a bucket per
    collective; free the sinks' gradients."""
    pending, sinks = [], {}
    for module in modules:
        for name, sink in sorted(getattr(module, SINKS, {}).items()):  # same order on every rank
            if sink.grad is None or id(sink) in sinks:
                continue
            sinks[id(sink)] = sink
            pending.append((module._parameters[name], module._autoshard_specs[name], sink.grad))
    with torch.no_grad():
        for bucket in _buckets(pending):
            kind = "all_reduce" if bucket[0][1].dim0 < 0 else "reduce_scatter"
            with timed_blocking(kind, sum(g.numel() * g.element_size() for _, _, g in bucket)):  # autoshard.Telemetry
                reduced_bucket = _reduce_bucket(bucket)
            for (param, _, _), reduced in zip(bucket, reduced_bucket):
                scale = param.__dict__.get(leaves.GRAD_SCALE)  # a divide factor (grad_scale.py)
                if scale is not None:
                    reduced = reduced * scale
                grad = DTensor.from_local(
                    reduced, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
                )
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
    for sink in sinks.values():
        sink.grad = None


def set_requires_gradient_sync(modules: Iterable[nn.Module], requires_gradient_sync: bool) -> None:
    """Turn gradient synchronisation of the sharded parameters of ``modules`` off or on.

    Off: later backwards accumulate full local gradients in sinks (see the module docstring).
    On: the accumulated gradients are reduced now, one blocking collective per bucket of
    parameters that reduce alike (up to FLUSH_BUCKET_BYTES), so every rank must call it (in
    the same order), as every rank runs the same training loop.
    """
    if not isinstance(requires_gradient_sync, bool):
        raise UsageError(f"set_requires_gradient_sync: requires_gradient_sync must be True or False, got {requires_gradient_sync!r}; "
                         "pass a bool, e.g. set_requires_gradient_sync(i == len(micro_batches) - 1).")
    owners = [m for m in modules if hasattr(m, "_autoshard_specs")]
    if requires_gradient_sync:
        _flush(owners)
    else:
        for module in owners:
            sinks = {}
            for name, spec in module._autoshard_specs.items():
                param = module._parameters[name]
                sinks[name] = _sink(param, spec, spec.reduce_dtype or spec.param_dtype or param.dtype)
            setattr(module, SINKS, sinks)
    for module in owners:
        setattr(module, SYNC, requires_gradient_sync)
        leaves.show_reads(module)
