"""Checkpoint layouts of tensor-parallel DTensors that DCP cannot store as they are.

DCP stores each rank's local tensor as one block of the global tensor, at the offset DTensor
computes for its placements. That holds for the layouts ``autoshard.shard`` gives a
tensor-parallel parameter (:mod:`autoshard.runtime.tensor_parallel`) except a *strided* one
whose pieces are not one block: a fused projection's columns, ``_StridedShard(0,
split_factor=3)`` over tp (each rank holds its heads of q, of k and of v). DCP would store those
three pieces as one block, overlapping the other ranks' (its save fails validation).

Such a value (a parameter, or optimizer state made like it) is saved in its *stored layout*,
every ``_StridedShard`` read as the plain ``Shard`` of the same dimension (contiguous blocks),
and loaded into that layout, then cut back: each a transient full tensor per value, and a
collective. A ``_StridedShard`` that FSDP2 and ``shard`` put on dp before a tp ``Shard`` of the
same dimension (``split_factor`` = the later mesh dimensions sharding it) is one block already
and is stored as it is. The stored layout is global (offsets into the whole tensor), so a
checkpoint saved on ``dp x tp`` loads on a 1-D mesh, at another world size, or unsharded.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor, Placement, Shard

from autoshard._compat.dtensor import StridedShard, dtensor_local_shape
from autoshard.runtime.errors import UsageError
from autoshard.runtime.layout import local_chunk

__all__ = ["from_stored", "stored_layouts", "stored_like", "stored_placements", "to_stored"]


def _one_block(placements: Sequence[Placement], sizes: Sequence[int]) -> bool:
    """Whether every rank's piece is one block of the global tensor (DCP's chunk)."""
    for i, p in enumerate(placements):
        if isinstance(p, StridedShard):
            later = [q for q in placements[i + 1:] if isinstance(q, (Shard, StridedShard)) and q.dim == p.dim]
            if any(isinstance(q, StridedShard) for q in later):
                return False
            if math.prod(sizes[j] for j in range(i + 1, len(placements)) if placements[j] == Shard(p.dim)) != p.split_factor:
                return False
    return True


def stored_placements(key: str, placements: Sequence[Placement], sizes: Sequence[int]) -> tuple[Placement, ...] | None:
    """The placements a value laid out by ``placements`` (over mesh dimensions of ``sizes``) is
    stored in; None where it is stored as it is. Refused where a dimension is sharded twice, both
    strided: DTensor cannot gather it (``full_tensor`` reads it wrong, torch 2.13)."""
    if _one_block(placements, sizes):
        return None
    strided = [p.dim for p in placements if isinstance(p, StridedShard)]
    if len(strided) != len(set(strided)):
        raise UsageError(f"autoshard checkpoint: {key!r} is laid out {list(placements)}, a dimension sharded twice with "
                         "_StridedShard both times, which DTensor cannot gather (torch 2.13); lay it out with one "
                         "_StridedShard per dimension (autoshard.shard keeps a fused projection replicated over dp).")
    return tuple(Shard(p.dim) if isinstance(p, StridedShard) else p for p in placements)


def stored_layouts(values: dict[str, Any]) -> dict[str, tuple[Placement, ...]]:
    """Of ``values``, the DTensors DCP cannot store as they are, each with its stored placements."""
    found = {}
    for key, value in values.items():
        if isinstance(value, DTensor) and any(isinstance(p, StridedShard) for p in value.placements):
            stored = stored_placements(key, value.placements, value.device_mesh.shape)
            if stored is not None:
                found[key] = stored
    return found


def _rebuilt(value: DTensor, local: torch.Tensor, placements: Sequence[Placement]) -> DTensor:
    return DTensor.from_local(local.detach().clone(), value.device_mesh, placements, run_check=False,
                              shape=value.shape, stride=value.stride())


@torch.no_grad()
def to_stored(value: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``value`` in its stored ``placements``. A collective: one full tensor, transient."""
    return _rebuilt(value, local_chunk(value.full_tensor(), value.device_mesh, placements), placements)


def stored_like(value: DTensor, placements: Sequence[Placement]) -> DTensor:
    """An uninitialised DTensor like ``value`` in its stored ``placements`` (what a load reads into)."""
    shape = dtensor_local_shape(value.shape, value.device_mesh, placements)
    local = torch.empty(shape, dtype=value.dtype, device=value.to_local().device)
    return DTensor.from_local(local, value.device_mesh, placements, run_check=False, shape=value.shape, stride=value.stride())


@torch.no_grad()
def from_stored(value: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``value`` (read in its stored layout) back in ``placements``: the inverse of :func:`to_stored`."""
    return _rebuilt(value, local_chunk(value.full_tensor(), value.device_mesh, placements), placements)
