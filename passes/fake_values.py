"""Fake values for the nodes the passes insert, computed without the fake mode's dispatch.

The partitioner and Inductor read every node's ``meta["val"]``, and the passes insert
thousands of nodes per graph (about 8,000 for a 48-layer GPT). Through the fake mode each
costs 100-400 us, most of it in Python meta kernels (``cat``, the c10d ops, casts): seconds
of compile time. For static shapes an op's result depends only on its target, its tensors'
layouts (shape, strides, offset, dtype) and its other arguments, and the same op on the same
layouts recurs in every block: the meta kernel runs once per such signature, and each later
node gets fresh fake tensors of the remembered layouts.

Views share their input's storage, as fake views do; ops that alias or mutate an input, and
symbolic shapes, go through the fake mode itself.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx

from autoshard._compat import fake_from_meta, fake_view, schema_of, unset_fake_temporarily

# Signature -> layout of the meta kernel's result. Bounded: cleared when full.
_LAYOUTS: dict[tuple, Any] = {}
_MAX_LAYOUTS = 1 << 14


def _static(v: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*v.shape, *v.stride()))


def _to_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.device.type != "meta":
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


@functools.cache
def _how(target: Any) -> str:
    """How :func:`fake_value` computes ``target``'s result: ``"view"`` (a view op returning one
    tensor: on its input's storage), ``"new"`` (returns new tensors: their meta kernel) or
    ``"fake"`` (in-place ops, anything else: the fake mode's own dispatch)."""
    schema = schema_of(target)
    if schema is None:
        return "fake"
    aliased = [r.alias_info is not None for r in schema.returns]
    if getattr(target, "is_view", False) and aliased == [True] and str(schema.returns[0].type) == "Tensor":
        return "view"
    return "fake" if any(aliased) else "new"


def _signature(x: Any) -> Any:
    # What a meta kernel's result can depend on; the type keeps 1, 1.0 and True apart.
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.storage_offset(), x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x), *map(_signature, x))
    return (type(x), x)


def _layout(out: Any) -> Any:
    """``out`` (a meta kernel's result) with each tensor replaced by its layout, or None when
    it holds something else than tensors in lists and tuples, or a tensor at an offset."""
    if isinstance(out, torch.Tensor):
        return (out.shape, out.stride(), out.dtype) if out.storage_offset() == 0 else None
    if isinstance(out, (list, tuple)):
        parts = [_layout(o) for o in out]
        return None if any(p is None for p in parts) else (type(out), parts)
    return None


def _fresh(layout: Any, fake_mode: Any, device: torch.device) -> Any:
    if isinstance(layout[0], torch.Size):
        shape, stride, dtype = layout
        return fake_from_meta(fake_mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device)
    kind, parts = layout
    return kind(_fresh(p, fake_mode, device) for p in parts)


def _new(target: Any, args: tuple, fake_mode: Any, device: torch.device) -> Any:
    key = (target, _signature(args))
    layout = _LAYOUTS.get(key)
    # Without the compile's fake mode, which would turn meta tensors into fake ones.
    with unset_fake_temporarily():
        if layout is None:
            out = target(*fx.node.map_aggregate(args, _to_meta))
            layout = _layout(out)
            if layout is None:  # not a layout to remember: wrap what the kernel made
                wrap = lambda t: fake_from_meta(fake_mode, t, device) if isinstance(t, torch.Tensor) else t  # noqa: E731
                return fx.node.map_aggregate(out, wrap)
            if len(_LAYOUTS) >= _MAX_LAYOUTS:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
        return _fresh(layout, fake_mode, device)


def fake_value(target: Any, args: tuple) -> Any:
    """``target(*args)`` on fake tensors (``args``: the fake values of a node's arguments, at
    least one a fake tensor), as the fake mode computes it: same layouts, same device, views
    on their input's storage, other results on storage of their own."""
    inputs = _tensors(args)
    fake, device, how = inputs[0].fake_mode, inputs[0].device, _how(target)
    if how == "fake" or not all(map(_static, inputs)):
        with fake:
            return target(*args)
    if how == "view":
        return fake_view(fake, target, args, device)
    return _new(target, args, fake, device)


def _tensors(args: Any) -> list[torch.Tensor]:
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (list, tuple)):
        return [t for a in args for t in _tensors(a)]
    return []
