"""How a parameter is laid out over a mesh by each strategy: the groups its annotation names,
its DTensor placements, and this rank's rows cut from the full value."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from autoshard.runtime.compression import Compression
from autoshard.runtime.errors import UsageError
from autoshard.runtime.mixed_precision import MixedPrecision


@dataclass(frozen=True)
class ShardLayout:
    """A whole model's layout, as ``autoshard.shard(model, plan=...)`` applies it: the root's
    strategy on a mesh of ``mesh_shape``, and ``blocks`` (submodule names) sharded first with
    ``block_strategy`` on ``block_mesh_shape``. ``autoshard.plan`` produces it (``Plan.layout``)."""

    strategy: str
    mesh_shape: tuple[int, ...]
    world_size: int
    mixed_precision: MixedPrecision | None = None
    blocks: tuple[str, ...] = ()
    block_strategy: str = ""
    block_mesh_shape: tuple[int, ...] = ()
    experts: str = "gathered"  # the root's experts modules: "parallel" splits them over every rank (shard's experts=)
    compression: Compression | None = None  # shard's compression=, for the blocks and the root


def local_chunk(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...] | list[Placement],
                rows: tuple[int, ...] = ()) -> torch.Tensor:
    """This rank's piece of ``full`` under ``placements``: all of it when nothing is sharded.

    One ``Shard(0)`` (the rest ``Replicate()``): a view of this rank's rows, DTensor's layout,
    torch.chunk's sizes, empty past the end; ``rows``: every rank's row count under state shares
    (a 1-D mesh), instead of torch.chunk's. Any other layout (several sharded mesh dimensions,
    ``Shard`` of another dim, ``_StridedShard``: tensor parallelism's 2-D parameters) is
    DTensor's own cut, with no communication (every rank holds ``full``)."""
    sharded = [(dim, p) for dim, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not sharded:
        return full
    (dim, placement), *more = sharded
    if more or placement != Shard(0):
        if rows:
            raise UsageError(f"local_chunk: state shares' rows cut one Shard(0) over a 1-D mesh, not {list(placements)}.")
        return distribute_tensor(full.detach(), mesh, list(placements), src_data_rank=None).to_local()
    me = mesh.get_local_rank(dim)
    if rows:
        start = sum(rows[:me])
        return full[start : start + rows[me]]
    size = -(-full.shape[0] // mesh.size(dim))  # ceil
    start = min(me * size, full.shape[0])
    return full[start : start + size]


def to_dtensor(param: nn.Parameter, mesh: DeviceMesh, placements: list[Placement], rows: tuple[int, ...] = ()) -> DTensor:
    """``param`` laid out on ``mesh``, cut locally: every rank holds the same values (the same
    seed, as FSDP2 assumes, or the meta device), so nothing is sent. ``rows``: state shares'
    row counts (see :func:`local_chunk`)."""
    full = param.detach()
    return piece_as_dtensor(local_chunk(full, mesh, placements, rows), full, mesh, placements, full.shape)


def piece_as_dtensor(local: torch.Tensor, whole: torch.Tensor, mesh: DeviceMesh, placements: list[Placement],
                     shape: torch.Size) -> DTensor:
    """``local``, this rank's piece of ``whole``, as the DTensor of global ``shape``: in its own
    storage where it is smaller, so ``whole`` is freed once the parameter is replaced."""
    if local.numel() != whole.numel():
        local = local.clone()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def layout(mesh: DeviceMesh, strategy: str) -> tuple[dict, list[Placement], list[Placement]]:
    """(ParamSpec fields for the communication groups, placements of a splittable parameter,
    placements of a replicated one)."""
    if strategy == "hybrid":
        replica, shard_group = mesh.get_group(0), mesh.get_group(1)
        groups = dict(
            group_name=shard_group.group_name,
            world_size=mesh.size(1),
            replica_group=replica.group_name if mesh.size(0) > 1 else "",
            replicas=mesh.size(0),
        )
        return groups, [Replicate(), Shard(0)], [Replicate(), Replicate()]
    groups = dict(group_name=mesh.get_group().group_name, world_size=mesh.size())
    split = [Replicate()] if strategy == "replicate" else [Shard(0)]
    return groups, split, [Replicate()]
