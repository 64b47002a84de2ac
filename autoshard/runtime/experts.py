"""Expert parallelism: ``autoshard.shard(model, experts="parallel")``.

An *experts module* (:func:`is_experts`) holds every expert of a mixture-of-experts layer as
parameters sharing a leading expert dimension ``E`` (``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``, as ``transformers`` 5.x and torchtitan lay them out) and is called as
``experts(hidden_states, top_k_index, top_k_weights)``. With ``experts="parallel"`` its
parameters become DTensors ``Shard(0)`` over the mesh: each rank owns ``E / world_size``
whole experts, which are never gathered; optimizers, ``state_dict`` and checkpoints see them as
any other shard. Its forward becomes one ``autoshard::expert_parallel`` call
(autoshard/runtime/expert_ops.py) that sends each token to the rank owning its expert and
back, then weights and sums the outputs; a rank runs its experts with the module's own forward
on its local shard. The forward reads each local shard through a plain leaf
(autoshard/runtime/leaves.py), so Dynamo never traces a DTensor and the backend gathers nothing.
Everything else is sharded by the strategy as before.
"""
from __future__ import annotations

import copy
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autoshard.runtime import expert_ops, leaves
from autoshard.runtime.errors import UsageError

EXPERTS = ("gathered", "parallel")
MARK = "_autoshard_expert"  # on each expert-parallel DTensor parameter: shard() leaves it alone
_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
_keys = itertools.count()  # one per experts module sharded: every rank shards the same sequence


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds a mixture's experts: its own parameters all share a leading
    expert dimension, at least one is 3-D, and its forward takes (hidden_states, top_k_index,
    top_k_weights)."""
    params = [p for p in module._parameters.values() if p is not None]
    if not params or not any(p.dim() == 3 for p in params) or len({p.shape[0] if p.dim() else None for p in params}) != 1:
        return False
    try:
        names = list(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return tuple(names) == _ARGS


@dataclass(frozen=True)
class ExpertSpec:
    """What leaves.py needs of an expert parameter's spec, and the op's arguments."""

    name: str
    group_name: str
    world_size: int
    param_dtype: torch.dtype | None = None


def plan(module: nn.Module, mesh: DeviceMesh) -> list[tuple[str, nn.Module]]:
    """Every experts module under ``module`` (with its name), checked to split over ``mesh``;
    changes nothing."""
    if mesh.ndim != 1:
        raise UsageError(f"autoshard.shard: experts='parallel' needs a 1-D mesh (experts split over every rank), got {mesh.ndim}-D "
                         f"{tuple(mesh.shape)}; pass a 1-D mesh or experts='gathered'.")
    every = [(name, m) for name, m in module.named_modules() if is_experts(m) or getattr(m, MARK, False)]
    found = [(name, m) for name, m in every if not getattr(m, MARK, False)]  # not split by an earlier call on a block
    if not every:
        raise UsageError(f"autoshard.shard: experts='parallel' but {type(module).__name__} has no experts module (parameters "
                         f"sharing a leading expert dimension, at least one 3-D, forward{_ARGS}); use experts='gathered'.")
    world = mesh.size()
    for name, m in found:
        count = next(iter(m.parameters())).shape[0]
        if count % world:
            raise UsageError(f"autoshard.shard: experts module {name or type(m).__name__!r} has {count} experts, which "
                             f"{world} ranks cannot split evenly; use a world size dividing {count} or experts='gathered'.")
        if any(isinstance(p, DTensor) for p in m.parameters(recurse=False)):
            raise UsageError(f"autoshard.shard: experts module {name!r} is already sharded; shard it once, with experts='parallel'.")
    return found


def describe(found: list[tuple[str, nn.Module]]) -> list[tuple]:
    """What must be equal on every rank."""
    return [("experts", name, tuple((n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters(recurse=False)))
            for name, m in found]


def install(found: list[tuple[str, nn.Module]], mesh: DeviceMesh) -> None:
    """Split each experts module's parameters over ``mesh`` and give it the expert-parallel
    forward."""
    if not found:  # experts="gathered", or all split by earlier calls: any mesh
        return
    group_name, world = mesh.get_group().group_name, mesh.size()
    for name, m in found:
        local_module = copy.copy(m)  # runs this rank's experts: the module's own forward, local shards
        local_module.__dict__ = dict(m.__dict__)
        local_module._parameters = dict(m._parameters)
        if hasattr(m, "num_experts"):
            local_module.num_experts = m.num_experts // world
        names = []
        for pname, param in list(m._parameters.items()):
            if param is None:
                continue
            stride = param.stride()
            rows = param.shape[0] // world
            local = param.detach()[mesh.get_local_rank() * rows:(mesh.get_local_rank() + 1) * rows].clone()
            new = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=stride),
                               requires_grad=param.requires_grad)
            setattr(new, MARK, True)
            m._parameters[pname] = new
            built = leaves._build(new, ExpertSpec(f"{name}.{pname}" if name else pname, group_name, world))
            m.__dict__[leaves.leaf_attribute(pname)] = built.leaf
            names.append(pname)
        local_module._parameters = {n: m.__dict__[leaves.leaf_attribute(n)] for n in names}  # not the full weights
        key = f"{name}#{next(_keys)}"
        expert_ops.register(key, _runner(local_module, tuple(names)))
        m.__dict__["_autoshard_expert_args"] = (tuple(leaves.leaf_attribute(n) for n in names), key, group_name, world)
        setattr(m, MARK, True)
        m.__class__ = _parallel_class(type(m))


def _runner(local_module: nn.Module, names: tuple[str, ...]) -> expert_ops.LocalExperts:
    forward = type(local_module).forward

    def run(tokens: torch.Tensor, expert: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        # In the tokens' dtype (a mixed-precision model's compute dtype); gradients flow back to the shard's.
        local_module._parameters.update(zip(names, (w.to(tokens.dtype) if w.is_floating_point() else w for w in weights)))
        ones = torch.ones(tokens.shape[0], 1, dtype=tokens.dtype)
        return forward(local_module, tokens, expert[:, None], ones)

    return run


def _parallel_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      *args: Any, **kwargs: Any) -> torch.Tensor:
    attrs, key, group_name, world = self._autoshard_expert_args
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    weights = [getattr(self, a) for a in attrs]
    outs = expert_ops.expert_parallel(flat, top_k_index.reshape(flat.shape[0], -1), weights, key, group_name, world)
    # The router's weighting outside the op: autograd gives the router its gradient.
    mixed = (outs * top_k_weights.reshape(outs.shape[:2]).unsqueeze(-1).to(outs.dtype)).sum(1)
    return mixed.to(hidden_states.dtype).reshape(hidden_states.shape)


_classes: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _parallel_forward})
    return _classes[cls]
