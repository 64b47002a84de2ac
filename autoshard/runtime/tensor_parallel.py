"""Fully sharded data parallel on top of DTensor tensor parallelism (a 2-D mesh).

The user parallelises first, then shards, as with FSDP2::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)     # parameters: DTensors on mesh["tp"]
    autoshard.shard(model, mesh["dp"])              # parameters: DTensors on the whole mesh

Each tensor-parallel parameter keeps its ``tp`` placement; ``shard`` cuts this rank's
tensor-parallel piece (the *tp-local* tensor) by rows over ``dp`` and stores the result as a
DTensor on the root mesh, whose placements say so: ``dp`` adds ``Shard(0)``, or, where ``tp``
already shards dim 0 and ``dp`` comes first in the mesh, ``_StridedShard(0, split_factor=tp)``
(tp pieces first, each cut over dp: FSDP2's layout, so checkpoints and ``full_tensor`` read it
right). A plain parameter (not parallelised) becomes ``(Shard(0), Replicate())``: every
parameter lives on one mesh, so ``clip_grad_norm_`` and optimizers see one mesh. A fused
projection whose parts tp shards one by one (``_StridedShard``, :func:`autoshard.gpt_tp_plan`'s
``qkv``) stays whole over ``dp`` (``Replicate()``, its gradient all-reduced): DTensor reads a
dimension sharded twice, once strided, wrongly (``full_tensor``, torch 2.13).

A forward gathers a tp-local tensor over ``dp`` only (the usual annotation op, the ``dp``
group) and reads it as the DTensor ``parallelize_module`` made (:func:`as_tensor_parallel`):
the module's own DTensor code then runs the tensor-parallel collectives where DTensor puts
them, and their gradients reach the gather's backward as tp-local tensors (a ``Partial``
gradient of a ``Replicate`` parameter summed over ``tp`` by DTensor first), which
reduce-scatters over ``dp``. Gradients are averaged over ``dp`` only: the ``tp`` ranks of a
``dp`` rank see the same batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from autoshard._compat import unset_fake_temporarily
from autoshard._compat.dtensor import StridedShard, dtensor_local_shape, root_mesh
from autoshard.runtime.errors import UsageError
from autoshard.runtime.experts import MARK as EXPERT_MARK
from autoshard.runtime.layout import local_chunk, piece_as_dtensor

__all__ = ["Composition", "TensorParallel", "as_tensor_parallel", "composition"]


@dataclass(frozen=True)
class TensorParallel:
    """How a gathered tp-local tensor is read: as the DTensor ``parallelize_module`` made."""

    mesh: DeviceMesh  # the tensor-parallel mesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]  # global
    stride: tuple[int, ...]
    local_shape: tuple[int, ...]  # what the data-parallel gather returns on this rank
    # A fused projection's columns sharded part by part (_StridedShard): replicated over dp,
    # because DTensor cannot gather a dim sharded twice when one of the two is strided
    # (full_tensor and checkpoints would read it wrong, torch 2.13).
    strided: bool = False


def as_tensor_parallel(gathered: torch.Tensor, tp: TensorParallel) -> DTensor:
    """The gathered tp-local tensor as its tensor-parallel DTensor (no communication)."""
    return DTensor.from_local(gathered, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride)


def _foreign(module: nn.Module, ours: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters that are DTensors autoshard did not make (``ours``: the attribute its own carry)."""
    return [(n, p) for n, p in module.named_parameters(remove_duplicate=True)
            if isinstance(p, DTensor) and not hasattr(p, ours) and not hasattr(p, EXPERT_MARK)]


@dataclass(frozen=True)
class Composition:
    """The data-parallel mesh ``dp`` inside the root mesh it shares with the tensor-parallel one."""

    root: DeviceMesh
    dp_dims: tuple[int, ...]  # the root's dims that make up dp, in dp's order
    tp_dim: int

    def placements(self, dp_placements: Iterable[Placement], tp_placement: Placement = Replicate()) -> list[Placement]:
        """Placements on the root: ``dp_placements`` (one per dp dim, as ``layout`` gives them
        for a 1-D or 2-D dp mesh) on dp's dims, ``tp_placement`` on tp's. A dp ``Shard(0)`` of a
        dim 0 that tp shards already is ``_StridedShard(0, split_factor=tp)``: tp's pieces
        first, each then cut over dp (FSDP2's layout; see the module docstring)."""
        out: list[Placement] = [Replicate()] * self.root.ndim
        out[self.tp_dim] = tp_placement
        for dim, placement in zip(self.dp_dims, dp_placements, strict=True):
            if isinstance(placement, Shard) and tp_placement == Shard(0):
                placement = StridedShard(0, split_factor=self.root.size(self.tp_dim))
            out[dim] = placement
        return out

    def tensor_parallel(self, fqn: str, param: DTensor) -> TensorParallel:
        """``param``'s tensor-parallel layout, refused where it cannot be sharded over dp."""
        (placement,) = param.placements  # 1-D: checked by composition()
        strided = isinstance(placement, StridedShard)
        if not isinstance(placement, (Shard, StridedShard, Replicate)):
            raise UsageError(f"autoshard.shard: parameter {fqn!r} is laid out {placement} over tp; autoshard composes with "
                             "Shard, Replicate and _StridedShard tensor-parallel parameters (ColwiseParallel, "
                             "RowwiseParallel, SequenceParallel, a fused projection's columns).")
        if param.dim() == 0:
            raise UsageError(f"autoshard.shard: parameter {fqn!r} is a 0-d DTensor over tp; leave it a plain parameter.")
        if placement == Shard(0) and any(d > self.tp_dim for d in self.dp_dims):
            raise UsageError(f"autoshard.shard: parameter {fqn!r} is sharded on dim 0 over tp, which comes before dp in the "
                             f"mesh {self.root.mesh_dim_names}; order the mesh's dimensions with dp first, e.g. ('dp', 'tp').")
        return TensorParallel(param.device_mesh, tuple(param.placements), tuple(param.shape), tuple(param.stride()),
                              tuple(param.to_local().shape), strided)

    def to_dtensor(self, param: nn.Parameter, placements: list[Placement], dp_mesh: DeviceMesh, rows: tuple[int, ...] = ()) -> DTensor:
        """``param`` (a tp DTensor, or plain and the same on every rank) on the root mesh: this
        rank's rows of its tp-local tensor over dp. Refused where DTensor's own layout of
        ``placements`` would not hold as many rows (then a checkpoint would read it wrong)."""
        whole = (param.to_local() if isinstance(param, DTensor) else param).detach()
        dp_placements = [Shard(0) if isinstance(p, (Shard, StridedShard)) else p for d, p in enumerate(placements) if d in self.dp_dims]
        local = local_chunk(whole, dp_mesh, dp_placements, rows)
        expected = dtensor_local_shape(param.shape, self.root, placements)
        if tuple(local.shape) != expected:
            raise UsageError(f"autoshard.shard: a parameter of shape {tuple(param.shape)} laid out {placements} holds "
                             f"{tuple(local.shape)} on this rank where DTensor expects {expected}; make its tensor-parallel "
                             "dimension divide evenly by the tp size.")
        return piece_as_dtensor(local, whole, self.root, placements, param.shape)


def _ranks_along(root: DeviceMesh, dims: tuple[int, ...]) -> list[int]:
    """The ranks of ``root`` that share this rank's coordinates on every dim but ``dims``."""
    with unset_fake_temporarily():  # the rank map is a real tensor, also while a model is built fake (explain)
        grid = root.mesh.movedim(dims, tuple(range(-len(dims), 0)))
        rows = grid.reshape(-1, *[root.size(d) for d in dims]).flatten(1).tolist()
    me = torch.distributed.get_rank()
    return next(row for row in rows if me in row)


def composition(module: nn.Module, mesh: DeviceMesh, strategy: str, ours: str, state_shares: Any = None, node_size: int = 0,
                compression: Any = None, experts: Any = ()) -> Composition | None:
    """The composition of ``mesh`` (dp) with the tensor-parallel mesh of ``module``'s DTensor
    parameters; None when it has none. Every refusal comes before anything changes."""
    found = _foreign(module, ours)
    if not found:
        return None
    unsupported = {"state_shares": state_shares, "reshard_after_forward=<int>": node_size, "experts='parallel'": experts,
                   "compression": compression is not None and (compression.gather or compression.reduce)}
    for name, given in unsupported.items():
        if given:
            raise UsageError(f"autoshard.shard: {name} does not compose with tensor parallelism yet; drop it, or shard "
                             "without parallelize_module.")
    meshes = {p.device_mesh for _, p in found}
    fqn, param = found[0]
    if len(meshes) > 1 or param.device_mesh.ndim != 1:
        raise UsageError(f"autoshard.shard: parameter {fqn!r} is a DTensor on {param.device_mesh}; autoshard composes with "
                         "tensor parallelism on one 1-D mesh (parallelize_module(model, mesh['tp'], plan)), every "
                         "parallelised parameter on it.")
    tp = param.device_mesh
    root = root_mesh(mesh)  # the dp mesh's: a submesh's cached root may be an older, equal-looking mesh
    names = root.mesh_dim_names or ()
    if root == mesh or not set(mesh.mesh_dim_names or ()) | set(tp.mesh_dim_names or ()) <= set(names):
        raise UsageError(f"autoshard.shard: parameter {fqn!r} is a DTensor on {tp}, which is not a named dimension of the "
                         f"mesh that {mesh} was sliced from; make one mesh with init_device_mesh(..., mesh_dim_names=('dp', 'tp')), "
                         "parallelise on mesh['tp'], then shard with mesh=mesh['dp'].")
    dp_dims = tuple(names.index(n) for n in mesh.mesh_dim_names)
    (tp_dim,) = (names.index(n) for n in tp.mesh_dim_names)
    if tp_dim in dp_dims or len(dp_dims) + 1 != root.ndim:
        raise UsageError(f"autoshard.shard: the mesh {mesh.mesh_dim_names} and the tensor-parallel mesh "
                         f"{tp.mesh_dim_names} must make up the whole mesh {names}, without sharing a dimension.")
    with unset_fake_temporarily():
        tp_ranks = tp.mesh.flatten().tolist()
    if _ranks_along(root, (tp_dim,)) != tp_ranks:
        raise UsageError(f"autoshard.shard: the tensor-parallel mesh {tp} holds other ranks than dimension {names[tp_dim]!r} "
                         f"of {root}; parallelise and shard with slices of one mesh.")
    if strategy not in ("full", "grad_op", "hybrid"):
        raise UsageError(f"autoshard.shard: strategy={strategy!r} with tensor parallelism; use 'full', 'grad_op' or 'hybrid'.")
    return Composition(root, dp_dims, tp_dim)
