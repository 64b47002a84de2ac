"""DTensor internals tensor-parallel composition needs: the strided placement FSDP2 and
SimpleFSDP use for a dimension sharded twice, a submesh's root mesh, and DTensor's own local
shape of a placement (what a layout must agree with to be a valid DTensor)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["StridedShard", "dtensor_local_shape", "fused_colwise", "root_mesh"]

StridedShard = _StridedShard  # _StridedShard(dim, split_factor=k): the dim cut in k pieces first, each then sharded


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``mesh`` itself when it is a root)."""
    return mesh._get_root_mesh()


def dtensor_local_shape(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, ...]:
    """The local shape DTensor gives this rank of a ``shape`` tensor laid out by ``placements``."""
    with unset_fake_temporarily():  # reads the mesh's coordinates: real ints, also while a model is built fake
        local, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, list(placements))
    return tuple(local)


def fused_colwise(parts: int) -> ParallelStyle:
    """``ColwiseParallel`` for a fused projection of ``parts`` outputs (q, k and v in one
    ``nn.Linear``): each part's output features are sharded over tp
    (``_StridedShard(0, split_factor=parts)``), so each rank computes its heads of every part
    and the module returns them as a local tensor ``[..., parts * out / (parts * tp)]``."""
    return _FusedColwise(parts)


class _FusedColwise(ColwiseParallel):
    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for key, param in module.named_parameters():
            spread = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.parts)], src_data_rank=self.src_data_rank)
            module.register_parameter(key, nn.Parameter(spread, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        return outputs.to_local() if use_local_output else outputs  # already each rank's columns of every part
