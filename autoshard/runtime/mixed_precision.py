"""Mixed precision: gather and compute parameters in a low precision, reduce gradients in another.

The sharded parameters (the master copy the optimizer updates) and the optimizer state keep
the parameters' own dtype; only what a forward reads is cast. Like FSDP2's
``MixedPrecisionPolicy``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from autoshard._compat import tree_map_only
from autoshard.runtime.errors import UsageError


@dataclass(frozen=True)
class MixedPrecision:
    """``autoshard.shard(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32))``.

    param_dtype: dtype floating-point parameters are cast to (on the shard, before the
        all-gather, so gathers move the low precision) and computed in; None: their own.
    reduce_dtype: dtype gradients are cast to before they are reduced (reduce-scatter,
        all-reduce); None: the gradient's dtype (``param_dtype``). Reduced gradients are cast
        back to the parameter's dtype.
    cast_forward_inputs: cast the floating-point tensors passed to the sharded module's
        forward to ``param_dtype`` (as FSDP2 does), so a float32 batch meets bfloat16 weights.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise UsageError(f"autoshard.MixedPrecision: {field} must be a floating-point torch.dtype or None, got {dtype!r}; "
                                 "pass e.g. torch.bfloat16, or None to keep the dtype as it is.")


def dtypes_for(param: torch.Tensor, policy: MixedPrecision | None) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) for one parameter: None where nothing changes. Integer
    parameters are never cast."""
    if policy is None or not param.is_floating_point():
        return None, None
    param_dtype = policy.param_dtype if policy.param_dtype not in (None, param.dtype) else None
    return param_dtype, policy.reduce_dtype


def cast_inputs_hook(dtype: torch.dtype) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    """A forward pre-hook (``with_kwargs=True``) casting floating-point tensor inputs to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        return tree_map_only(torch.Tensor, cast, (args, kwargs))

    return hook
