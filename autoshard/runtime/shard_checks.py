"""What :func:`autoshard.shard` refuses before anything changes: its arguments, the mesh
against the process group, and state shares against the strategy."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard._compat.dtensor import root_mesh
from autoshard.runtime import hpz
from autoshard.runtime.batch_shares import normalize
from autoshard.runtime.errors import UsageError
from autoshard.runtime.mixed_precision import MixedPrecision
from autoshard.runtime.sharded import _SHARDED

STRATEGIES = ("full", "grad_op", "replicate", "hybrid")


def state_fractions(state_shares: Any, strategy: str, experts: str) -> tuple | None:
    """Each rank's exact share of the state (None: even), refused before anything changes."""
    if state_shares is None:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    fractions = normalize(state_shares, world, what="autoshard.shard", attribute="state_shares")
    if strategy not in ("full", "grad_op"):
        raise UsageError(f"autoshard.shard: state_shares need strategy 'full' or 'grad_op', got {strategy!r} (a replicated "
                         "state cannot be cut by rank, and hybrid sharding does not support them yet); drop state_shares "
                         "or shard with strategy='full'.")
    if experts != "gathered":
        raise UsageError("autoshard.shard: state_shares do not cut expert-parallel experts (experts='parallel' splits whole "
                         "experts evenly); use experts='gathered' or drop state_shares.")
    return None if len(set(fractions)) == 1 or world == 1 else fractions


def check_arguments(
    module: nn.Module, mesh: DeviceMesh | None, strategy: str, reshard_after_forward: bool | int | None,
    mixed_precision: MixedPrecision | None
) -> None:
    """Raise UsageError for ``shard``'s arguments that cannot work, naming what to pass instead."""
    if getattr(module, _SHARDED, False):
        raise UsageError(
            f"autoshard.shard: {type(module).__name__} is already sharded; call autoshard.shard once per module "
            "(to shard blocks separately, shard each block first, then the root)."
        )
    if strategy not in STRATEGIES:
        raise UsageError(f"autoshard.shard: strategy must be one of {STRATEGIES}, got {strategy!r}.")
    hpz.check_value(reshard_after_forward, strategy)  # an int: hierarchical backward gathers
    if reshard_after_forward and strategy in ("grad_op", "replicate"):
        raise UsageError(
            f"autoshard.shard: strategy={strategy!r} keeps full parameters from forward to backward, which "
            "reshard_after_forward=True contradicts; use strategy='full' (or 'hybrid') to reshard, or leave reshard_after_forward unset."
        )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise UsageError(f"autoshard.shard: mixed_precision must be an autoshard.MixedPrecision, got {type(mixed_precision).__name__}; "
                         "pass e.g. mixed_precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16).")
    dims = 2 if strategy == "hybrid" else 1
    if strategy == "hybrid" and mesh is None:
        raise UsageError(
            "autoshard.shard: strategy='hybrid' needs a 2-D mesh; pass mesh=init_device_mesh(device_type, (replicas, shard_size)): "
            "parameters are sharded over the second dimension and replicated over the first."
        )
    if mesh is None:
        return
    if mesh.ndim != dims:
        shape = "(replicas, shard_size)" if dims == 2 else "(world_size,)"
        raise UsageError(
            f"autoshard.shard: strategy={strategy!r} needs a {dims}-D DeviceMesh, got {mesh.ndim}-D {mesh}; "
            f"use init_device_mesh(device_type, {shape})."
        )
    if not dist.is_initialized():
        raise UsageError("autoshard.shard: a mesh was given but no process group is initialised; call init_process_group first "
                         "(or pass no mesh to run as one process).")
    if root_mesh(mesh).size() != dist.get_world_size():  # a submesh (tensor parallelism): its whole mesh
        raise UsageError(
            f"autoshard.shard: mesh has {root_mesh(mesh).size()} ranks but the process group has {dist.get_world_size()}; "
            "pass a mesh over all ranks, e.g. init_device_mesh(device_type, (world_size,))."
        )
