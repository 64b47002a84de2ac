"""Per-rank batch shares: each rank trains on its own number of samples of the global batch.

On a mixed cluster a fast rank should take more of the batch than a slow one. Every gradient
reduction averages over the N ranks, which is exact only when every rank holds the same number
of samples. With rank r holding b_r of the global batch's B samples (its share w_r = b_r / B)
and a loss that is the mean over the rank's own samples, the gradient of the mean over the
whole batch is

    sum_r w_r * grad_r  =  avg_r (N * w_r * grad_r)

so scaling rank r's gradient by N * w_r before the (unchanged) averaging reductions is exact,
for every strategy, with gradient accumulation, checkpointing, mixed precision and clipping
alike. The scale is applied where no user code can forget it: ``set_batch_shares`` (or
``autoshard.shard(..., batch_shares=...)``) installs a forward hook on the sharded root that
passes every floating-point output through unchanged and multiplies its gradient by
N * w_r. The user writes the usual mean loss over the rank's own samples and nothing else.

Why a hook on the outputs and a buffer: the weight differs between ranks, so it must not be a
Python constant in the compiled graph (ranks would compile different graphs, which
``compiler/consistency.py`` refuses); it is read from a non-persistent 0-d buffer, a graph
input like any buffer, and changing the shares later refills it without recompiling.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autoshard._compat import mark_batch_dynamic, tree_map_only
from autoshard.runtime import leaves
from autoshard.runtime.errors import UsageError
from autoshard.runtime.fail_together import check_same_on_all_ranks
from autoshard.runtime.sharded import _SHARDED

_uneven = False  # set once any model trains with unequal shares: the same on every rank (checked)
WEIGHT = "_autoshard_batch_weight"  # buffer on the root: N * this rank's share
SHARES = "_autoshard_batch_shares"  # on the root: the shares as given, normalised to fractions
_HOOK = "_autoshard_batch_hook"
ADAPTIVE = "_autoshard_adaptive_shares"  # on the root: autoshard.Telemetry re-splits (split_batch marks dim 0 dynamic)


def _world_and_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def normalize(shares: Any, world_size: int | None = None, what: str = "batch_shares",
              attribute: str = "batch_shares") -> tuple[Fraction, ...]:
    """Each rank's fraction of the global batch, exactly, from ``shares``: a sequence of
    positive numbers (sample counts such as ``[3, 1]`` or fractions such as ``[0.75, 0.25]``)
    or anything with a ``batch_shares`` attribute (an ``autoshard.Plan``), one per rank of
    ``world_size`` (None: any number). ``attribute="state_shares"``: the same for state shares
    (a plan's ``state_shares``; messages then say "state shares")."""
    label = "shares" if attribute == "batch_shares" else "state shares"
    given = getattr(shares, attribute, shares)
    if given is None:
        raise UsageError(f"{what}: {type(shares).__name__} has no {label} ({attribute} is None); "
                         "pass one positive number per rank, e.g. [3, 1].")
    try:
        values = list(given)
    except TypeError:
        raise UsageError(f"{what}: expected one positive number per rank for {attribute}, e.g. [3, 1], got {given!r}.") from None
    world = len(values) if world_size is None else world_size
    if len(values) != world:
        raise UsageError(f"{what}: {len(values)} {label} given for {world} ranks; pass one per rank (indexed by global rank).")
    bad = [(r, v) for r, v in enumerate(values)
           if isinstance(v, bool) or not isinstance(v, (int, float, Fraction)) or not math.isfinite(v) or v <= 0]
    if bad:
        rank, value = bad[0]
        raise UsageError(f"{what}: rank {rank}'s {label[:-1]} is {value!r}; every share must be a positive finite number.")
    exact = [Fraction(v).limit_denominator(10**9) if isinstance(v, float) else Fraction(v) for v in values]
    total = sum(exact)
    return tuple(v / total for v in exact)


def batch_sizes(shares: Any, global_batch: int) -> list[int]:
    """The number of samples each rank takes of a global batch of ``global_batch`` samples:
    ``global_batch * share`` when that is whole for every rank; otherwise rounded (largest
    remainders, so they sum to ``global_batch``). Use the result as the shares when the plan's
    fractions do not split your batch exactly: ``batch_shares=autoshard.batch_sizes(plan, B)``."""
    fractions = normalize(shares, what="autoshard.batch_sizes")
    sizes = round_to_total([f * global_batch for f in fractions], global_batch)
    if min(sizes) < 1:
        rank = sizes.index(min(sizes))
        raise UsageError(f"autoshard.batch_sizes: a global batch of {global_batch} leaves rank {rank} no sample under shares "
                         f"{[float(f) for f in fractions]}; use a larger global batch.")
    return sizes


def round_to_total(exact: Sequence[Any], total: int) -> list[int]:
    """Whole numbers summing to ``total`` (what ``exact`` sums to): each ``exact`` rounded down,
    then up where the remainders are largest (ties to the lower rank)."""
    sizes = [math.floor(e) for e in exact]
    order = sorted(range(len(exact)), key=lambda r: (-(exact[r] - sizes[r]), r))
    for r in order[: total - sum(sizes)]:
        sizes[r] += 1
    return sizes


def _leading(batch: Any) -> list[int]:
    sizes: list[int] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            raise UsageError("autoshard.split_batch: a 0-d tensor in the batch cannot be cut; every tensor must have the "
                             "batch on dim 0.")
        sizes.append(t.shape[0])
        return t

    tree_map_only(torch.Tensor, note, batch)
    return sizes


def split_batch(batch: Any, shares: Any, rank: int | None = None) -> Any:
    """This rank's slice of the global ``batch`` (a tensor, or tuples, lists and dicts of
    tensors, all cut on dim 0): rank r takes rows ``[sum(b[:r]), sum(b[:r+1]))`` where
    ``b[r] = global batch * share[r]``, which must be a whole number for every rank.

    ``shares``: a sharded model given ``batch_shares`` (its shares), a sequence of positive
    numbers, one per rank, or anything with ``batch_shares`` (an ``autoshard.Plan``). Every
    rank passes the same global batch and shares, so every rank raises the same error when
    they do not fit.
    """
    adaptive = isinstance(shares, nn.Module) and getattr(shares, ADAPTIVE, False)
    if isinstance(shares, nn.Module):
        registered = getattr(shares, SHARES, None)
        if registered is None:
            raise UsageError("autoshard.split_batch: this model has no batch shares; pass them to autoshard.shard(..., "
                             "batch_shares=...) or autoshard.set_batch_shares(model, shares), or pass the shares here.")
        shares = registered
    world, me = _world_and_rank()
    if rank is not None:  # a caller naming the rank (a data-loading process) may have no process group
        me, world = rank, world if dist.is_available() and dist.is_initialized() else None
    fractions = normalize(shares, world, what="autoshard.split_batch")
    if not 0 <= me < len(fractions):
        raise UsageError(f"autoshard.split_batch: rank {me} has no share among the {len(fractions)} given.")
    sizes = set(_leading(batch))
    if not sizes:
        raise UsageError("autoshard.split_batch: the batch holds no tensor to cut.")
    if len(sizes) > 1:
        raise UsageError(f"autoshard.split_batch: the batch's tensors disagree on dim 0 (sizes {sorted(sizes)}); every tensor "
                         "must hold the whole global batch on dim 0.")
    total = sizes.pop()
    exact = [f * total for f in fractions]
    for r, e in enumerate(exact):
        if e.denominator != 1 or e < 1:
            fixed = batch_sizes(fractions, total) if total >= len(fractions) else None
            raise UsageError(
                f"autoshard.split_batch: rank {r}'s share {float(fractions[r]):.6g} of the global batch of {total} samples is "
                f"{float(e):.6g} samples, not a whole number (>= 1), so its gradient weight would not match its data; "
                f"pass whole sample counts as the shares (autoshard.batch_sizes(shares, {total}) gives {fixed}) "
                "to autoshard.shard / set_batch_shares and here, or use a global batch they divide.")
    start = sum(int(e) for e in exact[:me])
    rows = slice(start, start + int(exact[me]))
    mine = tree_map_only(torch.Tensor, lambda t: t[rows], batch)
    if adaptive:  # the split changes as the run goes: one dynamic batch dimension on every rank from the start
        tree_map_only(torch.Tensor, mark_batch_dynamic, mine)
    return mine


def _weighted(weight: torch.Tensor):
    def apply(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_floating_point() and t.requires_grad):
            return t
        # The value stays exactly t (t - t.detach() is exactly zero); the gradient is scaled.
        return t.detach() + (t - t.detach()) * weight.to(t.dtype)  # keeps t's dtype, even 0-d

    return apply


def _hook(module: nn.Module, args: Any, output: Any) -> Any:
    if module.__dict__.get(leaves.DIVIDE_FACTOR) is not None:
        # Summed gradients (a divide factor, grad_scale.py) come from a loss already divided by a
        # global count: nothing to weight. A constant Dynamo guards on: changing it recompiles.
        return output
    return tree_map_only(torch.Tensor, _weighted(getattr(module, WEIGHT)), output)


def set_batch_shares(module: nn.Module, shares: Any) -> None:
    """Train ``module`` (sharded by ``autoshard.shard``) with each rank on its own share of the
    global batch; ``None`` goes back to equal shares.

    Feed each rank its slice (:func:`split_batch`) and compute the loss as usual, as the mean
    over the rank's own samples: this rank's gradients are weighted by world size times its
    share before the averaging reductions, so training equals one process on the whole batch.
    Every rank must call it with the same shares (checked: one small all-gather).
    """
    if not getattr(module, _SHARDED, False):
        raise UsageError(f"autoshard.set_batch_shares: {type(module).__name__} is not sharded; call autoshard.shard first.")
    fractions = None if shares is None else normalize(shares, _world_and_rank()[0], what="autoshard.set_batch_shares")
    check_same_on_all_ranks("autoshard.set_batch_shares", [None if fractions is None else [str(f) for f in fractions]],
                            _device_type(module))
    setattr(module, SHARES, fractions)
    global _uneven
    _uneven = _uneven or (fractions is not None and len(set(fractions)) > 1)
    if module._buffers.get(WEIGHT) is not None:
        refill_weight(module)  # a graph input: new shares recompile nothing
    else:
        device = next((b.device for b in module.buffers()), None) or _local_device(module)
        module.register_buffer(WEIGHT, torch.tensor(_weight(module), dtype=torch.float32, device=device), persistent=False)
    if getattr(module, _HOOK, None) is None:
        setattr(module, _HOOK, module.register_forward_hook(_hook))


def refill_weight(module: nn.Module) -> None:
    """Write this rank's gradient weight into ``module``'s buffer again (after ``to_empty``
    allocated it uninitialised); nothing without batch shares."""
    weight = module._buffers.get(WEIGHT)
    if weight is not None and weight.device.type != "meta":
        with torch.no_grad():
            weight.fill_(_weight(module))


def _weight(module: nn.Module) -> float:
    """World size times this rank's share (1 with equal shares)."""
    fractions = getattr(module, SHARES, None)
    world, rank = _world_and_rank()
    return 1.0 if fractions is None else float(fractions[rank] * world)


def _local_device(module: nn.Module) -> torch.device:
    param = next(iter(module.parameters()), None)
    if param is None:
        return torch.device("cpu")
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.device


def _device_type(module: nn.Module) -> str:
    device = _local_device(module).type
    return "cpu" if device == "meta" else device


def uneven_shares_in_use() -> bool:
    """Whether a model in this process was given unequal batch or state shares (then ranks see
    other activation or shard shapes, and the compiler makes each rank take rank 0's
    decisions). Every rank gives the same shares, so every rank answers the same."""
    return _uneven


def note_uneven_shares() -> None:
    """Record that unequal shares are in use (``autoshard.shard(..., state_shares=)``, after
    every rank agreed on them)."""
    global _uneven
    _uneven = True


def shares_of(module: nn.Module) -> tuple[Fraction, ...] | None:
    """The batch shares ``module`` trains with (None: equal)."""
    return getattr(module, SHARES, None)


__all__ = ["batch_sizes", "normalize", "set_batch_shares", "shares_of", "split_batch", "uneven_shares_in_use"]
