"""Per-rank state shares: a rank with less memory holds fewer rows of every parameter.

``autoshard.shard(model, state_shares=[3, 1])`` cuts each splittable parameter's rows by the
shares: rank r holds rows ``[sum(n[:r]), sum(n[:r+1]))`` where ``n = split_rows(dim0, shares)``,
rounded the same on every rank. Its gradient and optimizer state (created by the optimizer
from the parameter) have the same rows, so parameters, gradients and optimizer state all
shrink on the smaller rank: memory is saved for real.

Representation. The parameter stays a DTensor with ``Shard(0)`` whose local tensor holds this
rank's ``n[r]`` rows (``DTensor.from_local`` with the global shape given). Pointwise and
reduction ops on it (every optimizer, foreach or not, ``clip_grad_norm_``, ``zero_grad``,
``state_dict`` / ``load_state_dict`` between the same layouts) only touch local rows or sum over
ranks, so they are exact with any row counts. What is not: DTensor's own ``full_tensor``,
``redistribute`` and DCP assume torch.chunk's offsets. autoshard's paths that need offsets go
through this module: :func:`full_tensor`, ``autoshard.full_state_dict`` and
``autoshard.save`` / ``load`` (which store the even layout, :func:`to_even` and
:func:`from_even`, so a checkpoint saved with any shares loads under any other). The
collectives pad every shard to ``max(n)`` rows (gloo and NCCL have no all-gather-v) inside
``autoshard.ops`` and the lowered graph; the padding is priced by the cost model.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor, Shard

from autoshard._compat import all_gather_single
from autoshard.runtime import ops
from autoshard.runtime.layout import local_chunk

__all__ = ["even_like", "from_even", "full_tensor", "split_rows", "to_even", "uneven_rows"]


def split_rows(dim0: int, shares: Sequence[Fraction]) -> tuple[int, ...]:
    """Each rank's rows of a ``dim0``-row parameter under ``shares`` (exact fractions summing
    to 1): ``dim0 * share`` rounded down, the rows left over going to the largest remainders
    (ties: the lower rank). Exact arithmetic, so every rank computes the same tuple."""
    exact = [s * dim0 for s in shares]
    rows = [math.floor(e) for e in exact]
    order = sorted(range(len(exact)), key=lambda r: (-(exact[r] - rows[r]), r))
    for r in order[: dim0 - sum(rows)]:
        rows[r] += 1
    return tuple(rows)


def _sharded_on_rows(value: Any) -> bool:
    return (isinstance(value, DTensor) and value.device_mesh.ndim == 1 and value.dim() > 0
            and isinstance(value.placements[0], Shard) and value.placements[0].dim == 0)


def uneven_rows(values: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Of ``values``, the DTensors sharded on dim 0 of a 1-D mesh whose ranks hold other row
    counts than torch.chunk's (state shares), each with every rank's rows. A collective: one
    small all-gather per mesh; every rank passes the same keys and gets the same answer."""
    by_group: dict[str, list[str]] = {}
    for key, value in values.items():
        if _sharded_on_rows(value):
            by_group.setdefault(value.device_mesh.get_group().group_name, []).append(key)
    found: dict[str, tuple[int, ...]] = {}
    for keys in by_group.values():
        first = values[keys[0]]
        mesh, local = first.device_mesh, first.to_local()
        mine = torch.tensor([values[k].to_local().shape[0] for k in keys], dtype=torch.int64, device=local.device)
        every = torch.empty(mesh.size() * len(keys), dtype=torch.int64, device=local.device)
        all_gather_single(every, mine, group=mesh.get_group())
        table = every.view(mesh.size(), len(keys)).tolist()
        for i, key in enumerate(keys):
            rows = tuple(table[r][i] for r in range(mesh.size()))
            dim0 = values[key].shape[0]
            if rows != tuple(ops.local_rows(dim0, mesh.size(), r) for r in range(mesh.size())):
                found[key] = rows
    return found


@torch.no_grad()
def gather_rows(value: DTensor, rows: Sequence[int]) -> torch.Tensor:
    """The full tensor of ``value``, whose ranks hold ``rows`` rows each: one all-gather of the
    shards padded to ``max(rows)``, then each rank's real rows. A collective."""
    local = value.to_local().detach()
    padded = ops.pad_rows(local, max(rows)).contiguous()
    gathered = torch.empty((len(rows) * max(rows), *local.shape[1:]), dtype=local.dtype, device=local.device)
    all_gather_single(gathered, padded, group=value.device_mesh.get_group())
    return ops.join_rows(gathered, list(rows))


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` whole on every rank: a plain tensor as it is, a DTensor gathered, also one cut
    by state shares (where ``DTensor.full_tensor`` would assume torch.chunk's rows). A
    collective when ``value`` is a DTensor: call it on every rank."""
    if not isinstance(value, DTensor):
        return value
    rows = uneven_rows({"": value}).get("")
    return value.full_tensor() if rows is None else gather_rows(value, rows)


def _rebuilt(value: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(local.detach().clone(), value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def to_even(value: DTensor, rows: Sequence[int]) -> DTensor:
    """``value`` (ranks holding ``rows`` rows each) in DTensor's even ``Shard(0)`` layout, as
    DCP and other processes expect it. Transient: one full tensor per call. A collective."""
    full = gather_rows(value, rows)
    return _rebuilt(value, local_chunk(full, value.device_mesh, value.placements))


def even_like(value: DTensor) -> DTensor:
    """An uninitialised DTensor like ``value`` in the even layout (what a load reads into)."""
    local = local_chunk(torch.empty(value.shape, dtype=value.dtype, device="meta"), value.device_mesh, value.placements)
    return _rebuilt(value, torch.empty(local.shape, dtype=value.dtype, device=value.to_local().device))


@torch.no_grad()
def from_even(value: DTensor, rows: Sequence[int]) -> DTensor:
    """``value`` (DTensor's even layout) cut by ``rows`` again: the inverse of :func:`to_even`."""
    full = value.full_tensor()
    return _rebuilt(value, local_chunk(full, value.device_mesh, value.placements, tuple(rows)))
