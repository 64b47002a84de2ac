"""What a checkpoint holds of a model and its optimizer: the flat state dict ``autoshard.save``
writes (in DTensor's even layout, whatever the state shares, so a checkpoint loads under any
shares and any world size) and ``full_state_dict``'s gathered one."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

from autoshard.runtime.shard import parameters_as_shards
from autoshard.runtime.state_shares import full_tensor, to_even, uneven_rows
from autoshard.runtime.strided_state import stored_layouts, to_stored

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # optimizer keys by parameter FQN


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The flat state dict that is saved: ``model.<fqn>`` and ``optim.<flattened key>``, with
    tensors cut by state shares in DTensor's even layout (so any shares load it) and strided
    tensor-parallel ones in their stored layout (:mod:`autoshard.runtime.strided_state`).

    With an optimizer whose state is still empty, DCP first initialises it with a zero-lr step.
    """
    state = _local_state_dict(model, optimizer)
    uneven = uneven_rows(state)
    strided = stored_layouts(state)  # tensor parallelism's fused projections: stored as blocks
    return {k: to_even(v, uneven[k]) if k in uneven else to_stored(v, strided[k]) if k in strided else v
            for k, v in state.items()}


def _local_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    # DCP reads parameters by attribute path: as shards, or each read would gather it.
    with parameters_as_shards():
        if optimizer is None:
            return {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
        msd, osd = get_state_dict(model, optimizer, options=_FLAT)
    return {**{f"model.{k}": v for k, v in msd.items()}, **{f"optim.{k}": v for k, v in osd.items()}}


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded model state dict as plain CPU tensors (keys as ``model.state_dict()``).

    A collective: each DTensor is gathered in turn, so a rank holds one full parameter at a
    time plus the result. Loads into the unsharded model with ``load_state_dict(strict=True)``.
    With ``rank0_only`` the other ranks get ``{}``.
    """
    keep = not rank0_only or not (torch.distributed.is_initialized() and torch.distributed.get_rank())
    out: dict[str, torch.Tensor] = {}
    with parameters_as_shards():
        state = get_model_state_dict(model)
    for key, value in state.items():
        full = full_tensor(value)  # all ranks take part; also rows cut by state shares
        if keep:
            out[key] = full.detach().to("cpu", copy=True)
    return out
