"""DTensor internals tensor-parallel composition needs: the strided placement FSDP2 and
SimpleFSDP use for a dimension sharded twice, a submesh's root mesh, and DTensor's own local
shape of a placement (what a layout must agree with to be a valid DTensor)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["StridedShard", "dtensor_local_shape", "root_mesh"]

StridedShard = _StridedShard  # _StridedShard(dim, split_factor=k): the dim cut in k pieces first, each then sharded


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``mesh`` itself when it is a root)."""
    return mesh._get_root_mesh()


def dtensor_local_shape(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, ...]:
    """The local shape DTensor gives this rank of a ``shape`` tensor laid out by ``placements``."""
    local, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, list(placements))
    return tuple(local)
