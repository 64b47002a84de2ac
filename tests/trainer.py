"""Training loops shared by the strategy and training-feature tests: a sharded model on this
rank's slice of every batch next to single-process references on the whole batch."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import autoshard
from autoshard._compat import dynamo_counters as counters

from models import GLOBAL_BATCH, batch, build

BF16 = torch.bfloat16
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
}


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    return OPTIMIZERS[kind]([p for p in model.parameters() if p.requires_grad])


def _full(t: torch.Tensor) -> torch.Tensor:
    # autoshard's: DTensor.full_tensor assumes torch.chunk's rows, which state shares change.
    return autoshard.runtime.state_shares.full_tensor(t)


def param_error(model: nn.Module, reference: nn.Module) -> float:
    return max((_full(p) - _full(q)).abs().max().item() for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor, full (gathered), by parameter name and state key."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}.{k}": _full(t) for p, state in optimizer.state.items() for k, t in state.items()}


def _global_mean(value: torch.Tensor, model: nn.Module | None = None) -> float:
    """The whole batch's loss from each rank's ``value``: their mean, weighted by the ranks'
    batch shares when ``model`` has them."""
    value = value.detach().float().clone()
    shares = autoshard.runtime.batch_shares.shares_of(model) if model is not None else None
    if shares is not None:
        value *= float(shares[dist.get_rank()]) * dist.get_world_size()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def _compile(model: nn.Module, compiler: str, schedule: str = "autoshard", options: dict[str, Any] | None = None) -> nn.Module:
    options = {"compiler": compiler, "schedule": schedule, **(options or {})}
    return model if compiler == "uncompiled" else torch.compile(model, backend="autoshard", options=options)


def _mine(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of micro-batch ``micro`` of the global batch ``(x, y)``: its share if
    ``model`` has batch shares, else an equal slice."""
    per_micro = x.shape[0] // micro_batches
    whole = slice(micro * per_micro, (micro + 1) * per_micro)
    if autoshard.runtime.batch_shares.shares_of(model) is not None:
        return autoshard.split_batch((x[whole], y[whole]), model)
    mine = _rank_slice(micro, micro_batches, x.shape[0])
    return x[mine], y[mine]


def _rank_slice(micro: int, micro_batches: int, global_batch: int = GLOBAL_BATCH) -> slice:
    """This rank's rows of micro-batch ``micro`` of the global batch."""
    per_micro = global_batch // micro_batches
    per_rank = per_micro // dist.get_world_size()
    start = micro * per_micro + dist.get_rank() * per_rank
    return slice(start, start + per_rank)


def train_pair(
    name: str,
    shard: Callable[[nn.Module], nn.Module] = autoshard.shard,
    *,
    compiler: str = "aot_eager",
    schedule: str = "autoshard",
    optimizer: str = "adamw",
    steps: int = 3,
    micro_batches: int = 1,
    max_norm: float | None = None,
    trainable: Callable[[int, nn.Module], None] | None = None,
    shares: list[float] | None = None,
    global_batch: int = GLOBAL_BATCH,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``shard(copy of model name)`` next to the model itself for ``steps`` steps
    (``options``: more backend options).

    ``trainable(step, model)``: called on both models before each step, to freeze or unfreeze
    parameters (the optimizers then hold every parameter; AdamW skips those without a gradient).
    ``micro_batches`` > 1: gradient accumulation, synchronised on the last micro-batch only
    (``set_requires_gradient_sync``); ``max_norm``: both clip with ``clip_grad_norm_``;
    ``shares``: each rank's share of the (``global_batch``-sample) batch
    (``autoshard.set_batch_shares``), each rank fed ``autoshard.split_batch``'s slice.
    Returns the largest loss, parameter and gradient-norm differences seen, the smallest
    reference norm over ``max_norm`` (clipping was active if above 1), the number of graphs
    Dynamo compiled and what this rank stores (:func:`stored_bytes`, after the last step).
    """
    torch._dynamo.reset()
    counters.clear()
    reference = build(name)
    sharded = shard(copy.deepcopy(reference))
    if shares is not None:
        autoshard.set_batch_shares(sharded, shares)
    run = _compile(sharded, compiler, schedule, options)
    if trainable is None:
        ref_opt, opt = _optimizer(optimizer, reference), _optimizer(optimizer, sharded)
    else:
        ref_opt, opt = OPTIMIZERS[optimizer](list(reference.parameters())), OPTIMIZERS[optimizer](list(sharded.parameters()))
    found = {"loss": 0.0, "params": 0.0, "norm": 0.0, "clip_ratio": float("inf")}
    for step in range(steps):
        if trainable is not None:
            trainable(step, reference)
            trainable(step, sharded)
        x, y = batch(name, step, global_batch)
        ref_loss = loss = 0.0
        for micro in range(micro_batches):
            whole = slice(micro * global_batch // micro_batches, (micro + 1) * global_batch // micro_batches)
            part = reference(x[whole], y[whole]) / micro_batches
            part.backward()
            ref_loss += part.item()
            if micro_batches > 1:
                sharded.set_requires_gradient_sync(micro == micro_batches - 1)
            part = run(*_mine(sharded, x, y, micro, micro_batches)) / micro_batches
            part.backward()
            loss += _global_mean(part, sharded)
        if max_norm is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), max_norm)
            found["norm"] = max(found["norm"], abs(_full(norm).item() - ref_norm.item()))
            found["clip_ratio"] = min(found["clip_ratio"], ref_norm.item() / max_norm)
        ref_opt.step()
        opt.step()
        found["stored"] = stored_bytes(sharded, opt)  # with gradients, before they are zeroed
        ref_opt.zero_grad()
        opt.zero_grad()
        found["loss"] = max(found["loss"], abs(loss - ref_loss))
        found["params"] = max(found["params"], param_error(sharded, reference))
    found["graphs"] = counters["stats"]["unique_graphs"]
    return found


def _in_bf16(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's loss computed in bfloat16 from its float32 parameters (and float inputs):
    gradients flow back to the float32 parameters through the casts."""
    params = {n: p.to(BF16) for n, p in model.named_parameters()}
    cast = [t.to(BF16) if t.is_floating_point() else t for t in (x, y)]
    return torch.func.functional_call(model, params, tuple(cast))


def train_mixed_precision(
    name: str, shard: Callable[[nn.Module], nn.Module], *, optimizer: str = "adamw", steps: int = 3,
    shares: list[float] | None = None,
) -> dict[str, Any]:
    """Train ``shard(copy of model name)`` (sharded with bfloat16 compute, float32 reduce)
    next to three single-process references: bfloat16 on the whole batch, float32 on the
    whole batch, and bfloat16 per rank slice with float32 gradients averaged over the
    slices, which is what the sharded run computes, operation for operation.

    Returns the largest differences: to the per-rank emulation (``emulated``), to the bf16
    reference (``loss``, ``params``), between the bf16 and fp32 references (``bf16_loss``,
    ``bf16_params``), the loss's bf16 spacing (``loss_ulp``), and the dtypes seen. With
    ``shares``, each rank's slice is its share and the emulation weights slice r's loss by
    world size times its share (then averages, as the reductions do).
    """
    torch._dynamo.reset()
    low, full, emulated = build(name), build(name), build(name)
    sharded = shard(build(name))
    world = dist.get_world_size()
    sizes = [GLOBAL_BATCH // world] * world
    if shares is not None:
        autoshard.set_batch_shares(sharded, shares)
        sizes = autoshard.batch_sizes(shares, GLOBAL_BATCH)
    starts = [sum(sizes[:r]) for r in range(world)]
    run = _compile(sharded, "aot_eager")
    opts = [_optimizer(optimizer, m) for m in (low, full, emulated, sharded)]
    found = {k: 0.0 for k in ("emulated", "loss", "params", "bf16_loss", "bf16_params", "loss_ulp")}
    for step in range(steps):
        x, y = batch(name, step)
        low_loss = _in_bf16(low, x, y)
        low_loss.backward()
        full_loss = full(x, y)
        full_loss.backward()
        for r in range(world):
            rows = slice(starts[r], starts[r] + sizes[r])
            weight = world * sizes[r] / GLOBAL_BATCH  # 1 without shares
            (_in_bf16(emulated, x[rows], y[rows]) * weight / world).backward()  # / world: exact in bf16
        loss = run(*_mine(sharded, x, y, 0, 1))
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        found["loss"] = max(found["loss"], abs(_global_mean(loss, sharded) - low_loss.item()))
        found["loss_ulp"] = max(found["loss_ulp"], torch.finfo(BF16).eps * 2.0 ** torch.frexp(low_loss.float()).exponent.item() / 2)
        found["bf16_loss"] = max(found["bf16_loss"], abs(low_loss.item() - full_loss.item()))
        found["params"] = max(found["params"], param_error(sharded, low))
        found["emulated"] = max(found["emulated"], param_error(sharded, emulated))
        found["bf16_params"] = max(found["bf16_params"], param_error(low, full))
    found["loss_dtype"] = loss.dtype
    found["param_dtypes"] = {p.dtype for p in sharded.parameters()}
    found["state_dtypes"] = {t.dtype for s in opts[-1].state.values() for t in s.values() if t.dim() > 0}
    return found


def stored_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank stores for parameters, gradients and optimizer state."""
    params = list(model.parameters())
    local = lambda ts: sum(_local(t).nbytes for t in ts)  # noqa: E731
    return {
        "params": local(params),
        "grads": local(p.grad for p in params if p.grad is not None),
        "optimizer": local(t for s in optimizer.state.values() for k, t in s.items() if k != "step"),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
