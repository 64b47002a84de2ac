"""The sharding frontend: ``autoshard.shard(module)`` turns parameters into per-rank shards.

Every parameter becomes an ``nn.Parameter`` holding a DTensor (``Shard(0)`` over a 1-D mesh;
``Replicate()`` for 0-d parameters, which cannot be split), so optimizers, ``clip_grad_norm_``
and ``torch.distributed.checkpoint`` work on the shards. Each module that owns parameters is
moved to a subclass whose parameter names are properties: reading ``module.weight`` returns
the full parameter through :mod:`autoshard.ops`. ``state_dict`` keys stay unchanged because
the parameters still live in ``module._parameters``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from . import ops

_SHARDED = "_autoshard_root"  # set on every module passed to shard()


@dataclass(frozen=True)
class ParamSpec:
    """What a parameter's annotation needs; plain constants so Dynamo guards on them cheaply."""

    group_name: str
    world_size: int
    dim0: int  # full rows; -1 for a replicated (0-d) parameter
    reshard: bool
    name: str  # fully qualified, relative to the outermost module passed to shard()


def _annotate(module: nn.Module, name: str) -> torch.Tensor:
    param = module._parameters[name]
    spec = module._autoshard_specs[name]
    local = param.to_local()
    if spec.dim0 < 0:
        return ops.replicate(local, spec.group_name, spec.world_size, spec.name)
    return ops.unshard(local, spec.group_name, spec.world_size, spec.dim0, spec.reshard, spec.name)


_subclasses: dict[tuple[type, tuple[str, ...]], type] = {}
_base_of: dict[type, type] = {}  # sharded subclass -> the user's class
# Each sharded parameter keeps its spec under this attribute, so a module that shares an
# already sharded parameter (a tied head sharded after its embedding) gets the same annotation.
_SPEC = "_autoshard_spec"
_SHARDED_AS = "_autoshard_sharded_as"  # on a replaced plain parameter: its shard


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    """A subclass of ``cls`` whose ``names`` are properties returning full parameters."""
    cls = _base_of.get(cls, cls)
    key = (cls, names)
    if key not in _subclasses:
        props = {n: property(lambda self, n=n: _annotate(self, n)) for n in names}
        sub = type(f"Sharded{cls.__name__}", (cls,), props)
        _subclasses[key], _base_of[sub] = sub, cls
    return _subclasses[key]


def _default_mesh(module: nn.Module) -> DeviceMesh:
    device = next(iter(module.parameters()), torch.empty(0)).device
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _check(module: nn.Module, mesh: DeviceMesh | None) -> None:
    if getattr(module, _SHARDED, False):
        raise ValueError(
            f"{type(module).__name__} is already sharded: call autoshard.shard once per module "
            "(to shard blocks separately, shard each block first, then the root)."
        )
    if mesh is None:
        return
    if mesh.ndim != 1:
        raise ValueError(f"autoshard.shard needs a 1-D DeviceMesh, got {mesh.ndim}-D {mesh}.")
    if not dist.is_initialized():
        raise ValueError("A mesh was given but no process group is initialised: call init_process_group first.")
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"mesh has {mesh.size()} ranks but the process group has {dist.get_world_size()}: "
            "pass a mesh over all ranks, e.g. init_device_mesh(device_type, (world_size,))."
        )


def shard(module: nn.Module, mesh: DeviceMesh | None = None, *, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``module``'s parameters in place across the ranks of ``mesh`` and return it.

    Args:
        module: any ``nn.Module``. Parameters already sharded by an earlier ``shard`` call on a
            submodule keep their settings; buffers stay replicated.
        mesh: a 1-D DeviceMesh; default: every rank of the default process group, on the
            device type of the module's parameters. Without a process group there is nothing
            to shard (world size 1) and the module is only marked.
        reshard_after_forward: free gathered parameters after forward and gather them again
            in backward (ZeRO-3). ``False`` keeps them from forward to backward.

    Build the optimizer after calling ``shard`` (as with FSDP2): it must see the sharded
    parameters. Parameters shared by several modules (tied weights) are sharded once.
    """
    _check(module, mesh)
    if not dist.is_initialized():
        setattr(module, _SHARDED, True)
        return module
    mesh = mesh if mesh is not None else _default_mesh(module)
    group_name = mesh.get_group().group_name
    world_size = mesh.size()

    # Build every new parameter first, then install them all: nothing is half-applied.
    sharded: dict[int, nn.Parameter] = {}
    owners: list[tuple[nn.Module, dict[str, ParamSpec]]] = []
    for prefix, mod in module.named_modules():
        specs = {}
        for name, param in mod._parameters.items():
            if param is None:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            # Sharded by an earlier call on a submodule: keep its settings, name it from here.
            if name in getattr(mod, "_autoshard_specs", {}):
                specs[name] = replace(mod._autoshard_specs[name], name=fqn)
                continue
            # A parameter shared with a module sharded earlier (a tied head whose embedding
            # was sharded first) is replaced by that shard.
            param = getattr(param, _SHARDED_AS, param)
            if isinstance(param, DTensor):
                if not hasattr(param, _SPEC):
                    raise ValueError(
                        f"parameter {fqn!r} is a DTensor that autoshard did not create; "
                        "autoshard.shard expects plain parameters."
                    )
                specs[name] = replace(getattr(param, _SPEC), name=fqn)
                continue
            if id(param) not in sharded:
                placement = Shard(0) if param.dim() > 0 else Replicate()
                local = distribute_tensor(param.detach(), mesh, [placement])
                sharded[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            dim0 = param.shape[0] if param.dim() > 0 else -1
            specs[name] = ParamSpec(group_name, world_size, dim0, reshard_after_forward, fqn)
        if specs:
            owners.append((mod, specs))

    for mod, specs in owners:
        for name, spec in specs.items():
            old = mod._parameters[name]
            new = sharded[id(old)] if id(old) in sharded else getattr(old, _SHARDED_AS, old)
            if new is not old:
                setattr(old, _SHARDED_AS, new)
            setattr(new, _SPEC, spec)
            mod._parameters[name] = new
        mod._autoshard_specs = {**getattr(mod, "_autoshard_specs", {}), **specs}
        mod.__class__ = _sharded_class(type(mod), tuple(sorted(mod._autoshard_specs)))
    setattr(module, _SHARDED, True)
    return module
