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

The flag is a plain Python attribute that the parameter access reads, so Dynamo guards on it:
a compiled model has exactly two variants (synchronised or not) and switching between them
recompiles nothing after each has compiled once.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import ops

SYNC = "_autoshard_sync"  # on each module owning sharded parameters: whether backward reduces
SINKS = "_autoshard_sinks"  # on the same modules: parameter name -> sink tensor


def _sink(param: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
    """A leaf of the full parameter's shape that autograd can accumulate into, holding one
    element (stride 0): memory is spent only on the gradient it receives."""
    existing = getattr(param, "_autoshard_sink", None)  # shared by every module using param (tied)
    if existing is None or existing.dtype != dtype:
        existing = torch.zeros((), dtype=dtype, device=param.device).expand(param.shape).detach().requires_grad_(True)
        param._autoshard_sink = existing
    return existing


def _reduce(param: nn.Parameter, spec, grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``grad`` averaged over the data-parallel ranks, in the parameter's dtype."""
    if spec.dim0 < 0:
        return ops.all_reduce_grad(
            grad, spec.group_name, spec.world_size, spec.name, spec.reduce_dtype, param.dtype, spec.replica_group, spec.replicas
        )
    rows = param.to_local().shape[0]
    return ops.reduce_grad(
        grad, spec.group_name, spec.world_size, rows, spec.name, spec.reduce_dtype, param.dtype, spec.replica_group, spec.replicas
    )


def _flush(modules: list[nn.Module]) -> None:
    """Reduce every accumulated sink gradient into its parameter's ``.grad``; free the sinks'."""
    seen: set[int] = set()
    with torch.no_grad():
        for module in modules:
            for name, sink in sorted(getattr(module, SINKS, {}).items()):  # same order on every rank
                if sink.grad is None or id(sink) in seen:
                    continue
                seen.add(id(sink))
                param = module._parameters[name]
                reduced = _reduce(param, module._autoshard_specs[name], sink.grad)
                grad = DTensor.from_local(reduced, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
                sink.grad = None


def set_requires_gradient_sync(modules: Iterable[nn.Module], requires_gradient_sync: bool) -> None:
    """Turn gradient synchronisation of the sharded parameters of ``modules`` off or on.

    Off: later backwards accumulate full local gradients in sinks (see the module docstring).
    On: the accumulated gradients are reduced now, with blocking collectives, so every rank
    must call it (in the same order), as every rank runs the same training loop.
    """
    if not isinstance(requires_gradient_sync, bool):
        raise ValueError(f"set_requires_gradient_sync takes True or False, got {requires_gradient_sync!r}.")
    owners = [m for m in modules if hasattr(m, "_autoshard_specs")]
    if requires_gradient_sync:
        _flush(owners)
    else:
        for module in owners:
            sinks = {}
            for name, spec in module._autoshard_specs.items():
                param = module._parameters[name]
                sinks[name] = _sink(param, spec.reduce_dtype or spec.param_dtype or param.dtype)
            setattr(module, SINKS, sinks)
    for module in owners:
        setattr(module, SYNC, requires_gradient_sync)
