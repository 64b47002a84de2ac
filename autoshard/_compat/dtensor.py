"""DTensor internals tensor-parallel composition needs: the strided placement FSDP2 and
SimpleFSDP use for a dimension sharded twice, a submesh's root mesh, and DTensor's own local
shape of a placement (what a layout must agree with to be a valid DTensor)."""
from __future__ import annotations

import types
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_tensor
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
    ``nn.Linear``): each rank computes its share of every part (its heads of q, k and v) and
    returns them as a local tensor ``[..., out / tp]``. The weight stays whole over tp
    (``Replicate()``; sharded over dp by ``autoshard.shard``), each rank multiplying by its rows
    of each part, and its gradient is summed over tp. (Sharding it by part over tp,
    ``_StridedShard(0, split_factor=parts)``, is what DTensor cannot yet compute with or gather
    on every supported torch.)"""
    return _FusedColwise(parts)


class _FusedColwise(ColwiseParallel):
    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for key, param in module.named_parameters():
            whole = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(key, nn.Parameter(whole, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        # Plain ints, constants to Dynamo: which rows of each part this rank multiplies by.
        module._tp_parts, module._tp_rank, module._tp_size = self.parts, device_mesh.get_local_rank(), device_mesh.size()
        module.forward = types.MethodType(_local_linear, module)
        return module

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        return outputs  # already this rank's share of every part, local


def _mine(module: nn.Module, t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's rows of each part of ``t`` (a whole weight or bias over tp), concatenated; its
    gradient is this rank's term of a sum over tp, which DTensor all-reduces."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        t = t.to_local(grad_placements=[Partial()])
    parts = t.view(module._tp_parts, -1, *t.shape[1:])  # [parts, out / parts, ...]
    return parts.chunk(module._tp_size, dim=1)[module._tp_rank].reshape(-1, *t.shape[1:])


def _local_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """[..., in] (replicated over tp) -> [..., out / tp]: this rank's share of every part."""
    if isinstance(x, DTensor):  # its gradient is this rank's term of a sum over tp: DTensor all-reduces it
        x = x.to_local(grad_placements=[Partial()])
    return F.linear(x, _mine(module, module.weight), _mine(module, module.bias))
