"""How gradients are combined over ranks: averaged (the default), or summed and divided by a
given factor, as FSDP2's ``set_gradient_divide_factor``: ``model.set_gradient_divide_factor(f)``.

Every reduction (reduce-scatter, all-reduce, hybrid's replica all-reduce, the expert
all-to-all's, the accumulation flush) averages over the N data-parallel ranks that hold a
parameter's gradient. A divide factor ``f`` turns that average into ``sum / f`` by multiplying
the reduced gradient by ``N / f`` where it reaches ``.grad``: in the leaf's gradient hook
(autoshard/runtime/leaves.py, ``_GradLink.before``), which every reduced gradient passes,
compiled or not, and in the flush of accumulated gradients (grad_sync.py), which adds to
``.grad`` directly. The compiled graphs stay the same (no recompile when the factor changes),
and the extra cost is one multiplication over this rank's gradient shards.

Batch shares weight each rank's gradient by N times its share so that the *average* of
per-rank mean losses is exact; a loss divided by a global count (torchtitan's convention, the
reason to sum) needs no weighting, so under a divide factor batch_shares.py's hook weights
nothing (it reads :data:`leaves.DIVIDE_FACTOR`).
"""
from __future__ import annotations

import math
from typing import Iterable

from torch import nn
from torch.distributed.tensor import DTensor

from autoshard.runtime import leaves
from autoshard.runtime.errors import UsageError


def data_parallel_ranks(spec: object) -> int:
    """Ranks a parameter's gradient is averaged over: its group's, times hybrid's replicas."""
    return getattr(spec, "world_size", 1) * getattr(spec, "replicas", 1)


def _check(factor: float | None) -> float | None:
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise UsageError(f"set_gradient_divide_factor: factor must be a positive number or None, got {factor!r}; "
                         "pass 1.0 to sum gradients over ranks, the world size to average, None for the default (average).")
    return float(factor)


def set_gradient_divide_factor(modules: Iterable[nn.Module], factor: float | None) -> None:
    """Reduce the gradients of the sharded parameters of ``modules`` as their sum over the
    data-parallel ranks divided by ``factor`` (1.0: the plain sum); None: averaged (default).
    A plain setting on every rank, no collective; it takes effect at the next backward or
    flush and recompiles nothing."""
    factor = _check(factor)
    modules = list(modules)
    for module in modules:
        module.__dict__[leaves.DIVIDE_FACTOR] = factor
        specs = getattr(module, "_autoshard_specs", {})
        for name, param in module._parameters.items():
            if not isinstance(param, DTensor):
                continue
            # Experts' parameters have no spec here: averaged over their 1-D mesh (experts.py).
            ranks = data_parallel_ranks(specs[name]) if name in specs else param.device_mesh.size()
            if factor is None:
                param.__dict__.pop(leaves.GRAD_SCALE, None)
            else:
                param.__dict__[leaves.GRAD_SCALE] = ranks / factor


def reapply(module: nn.Module) -> None:
    """Set the divide factor of ``module`` again on its own parameters: ``.to()`` and
    ``to_empty()`` give a module new parameter objects (torch.utils.swap_tensors), without the
    scale the old ones carried; the factor itself stays on the module."""
    if leaves.DIVIDE_FACTOR in module.__dict__:
        set_gradient_divide_factor([module], module.__dict__[leaves.DIVIDE_FACTOR])


def scale_of(param: nn.Parameter) -> float:
    """What ``param``'s averaged gradient is multiplied by (1 without a divide factor)."""
    return param.__dict__.get(leaves.GRAD_SCALE, 1.0)
