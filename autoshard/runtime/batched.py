"""Every parameter of a compiled graph through one op: what AOT autograd traces.

AOT autograd traces a custom op three times per call (metadata, joint forward, and its
backward), each through Python autograd, functionalization and the fake kernel; at one call
per parameter that was most of what sharding added to capturing the joint graph. So the
backend gathers all of a graph's parameters with one :func:`unshard_all` call (one for the
trainable ones, one for the frozen ones, which get no backward), whose backward is one
:func:`reduce_all` call. The first pass on the joint graph (``passes/unbatch.py``) splits both
back into the per-parameter ops of :mod:`autoshard.runtime.ops`, each at its own place.

Both ops apply, to the i-th tensor, the i-th *call* of a table entry named by ``key``: a
per-parameter op and its arguments after the tensor (:func:`key_for`). Arguments are plain
constants, so the key is a hash of the calls' text: the same model gives the same graph text
in any process, whatever it compiled before, which the compile caches key on
(docs/caching.md). The table holds one entry per distinct batch, however often graphs are
compiled.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from autoshard._compat import OpOverload
from autoshard.runtime import ops

Call = tuple[OpOverload, tuple]  # a per-parameter op, its arguments after the tensor

_TABLE: dict[str, tuple[Call, ...]] = {}


def key_for(calls: Sequence[Call]) -> str:
    """The key of the table entry holding ``calls`` (made if new): a hash of their text, so
    it names the same calls in every process."""
    calls = tuple(calls)
    text = repr([(str(op), rest) for op, rest in calls])
    key = "batch_" + hashlib.sha256(text.encode()).hexdigest()[:20]
    found = _TABLE.setdefault(key, calls)
    if found != calls:  # a collision of 80 bits: never expected, but never silently wrong
        raise RuntimeError(f"autoshard: two batches hash to {key}; please report this as an autoshard bug")
    return key


def calls_of(key: str) -> tuple[Call, ...]:
    """The calls ``key`` names."""
    return _TABLE[key]


def _apply(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return [op(t, *rest) for t, (op, rest) in zip(tensors, calls_of(key), strict=True)]


def _fake(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return [ops.FAKE[op](t, *rest) for t, (op, rest) in zip(tensors, calls_of(key), strict=True)]


@torch.library.custom_op("autoshard::unshard_all", mutates_args=())
def unshard_all(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """The full parameter of each tensor (a shard, or a replicated parameter), by
    ``unshard`` or ``replicate`` as entry ``key`` says. Backward: :func:`reduce_all`."""
    return _apply(tensors, key)


@torch.library.custom_op("autoshard::reduce_all", mutates_args=())
def reduce_all(grads: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """Each full gradient reduced to this rank's part, by ``reduce_grad`` or
    ``all_reduce_grad`` as entry ``key`` says."""
    return _apply(grads, key)


unshard_all.register_fake(_fake)
reduce_all.register_fake(_fake)


def _static(call: Call) -> Call:
    # Parameters have static shapes; AOT autograd may still hand their sizes over as SymInts.
    op, rest = call
    return op, tuple(int(a) if isinstance(a, torch.SymInt) else a for a in rest)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    tensors, key = inputs
    ctx.backward = [_static(ops.backward_call(op, (t, *rest))) for t, (op, rest) in zip(tensors, calls_of(key), strict=True)]


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
    # Only the parameters that got a gradient and want one: the others get None, as they
    # would from their own op.
    wanted = [i for i, (g, needs) in enumerate(zip(grads, ctx.needs_input_grad[0])) if g is not None and needs]
    reduced = reduce_all([grads[i].contiguous() for i in wanted], key_for([ctx.backward[i] for i in wanted])) if wanted else []
    out: list[torch.Tensor | None] = [None] * len(grads)
    for i, r in zip(wanted, reduced):
        out[i] = r
    return out, None


unshard_all.register_autograd(_backward, setup_context=_setup)
