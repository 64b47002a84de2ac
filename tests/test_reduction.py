"""What training frameworks call on a sharded model: ``set_gradient_divide_factor`` (gradients
summed over ranks, or divided by a given factor) for every strategy, under accumulation, batch
shares and experts; ``no_sync()``; ``clip_grad_norm_``; DCP's ``get_state_dict`` /
``set_state_dict``. One launch of 4 gloo ranks computes every case (tests below read it);
each case compares the sharded model's full gradients with a one-process model's on the
whole batch."""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import moe_trainer
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autoshard
from autoshard.tools.launch import run_ranks

from models import GLOBAL_BATCH, batch, build

WORLD, TOL = 4, 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad_error(model: torch.nn.Module, reference: torch.nn.Module, expect: float) -> float:
    """Largest difference of ``model``'s full gradients from ``expect`` times the reference's."""
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return max((_full(p.grad) - expect * q.grad).abs().max().item() for p, q in pairs)


def _case(shard: Callable, *, factor: float | None, loss_weight: Callable[[int, int], float], expect: float,
          compiled: bool = True, micro_batches: int = 1, shares: list[int] | None = None, name: str = "mlp",
          moved: bool = False) -> float:
    """One backward (``micro_batches`` with ``no_sync`` on all but the last) of ``shard(model)``
    on this rank's rows, its loss times ``loss_weight(rows, micro_batches)``; the gradient error against
    ``expect`` times the one-process gradient of the whole batch's mean loss."""
    torch._dynamo.reset()
    reference = build(name)
    model = shard(copy.deepcopy(reference))
    if shares is not None:
        autoshard.set_batch_shares(model, shares)
    model.set_gradient_divide_factor(factor)
    if moved:  # new parameter objects, as .to() and to_empty() (torchtitan's init) make them
        model.to(torch.float64).to(torch.float32)
    run = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"}) if compiled else model
    x, y = batch(name, 0)
    for micro in range(micro_batches):
        whole = slice(micro * GLOBAL_BATCH // micro_batches, (micro + 1) * GLOBAL_BATCH // micro_batches)
        (reference(x[whole], y[whole]) / micro_batches).backward()
        if shares is not None:
            mx, my = autoshard.split_batch((x[whole], y[whole]), model)
        else:
            per = (whole.stop - whole.start) // dist.get_world_size()
            mine = slice(whole.start + dist.get_rank() * per, whole.start + (dist.get_rank() + 1) * per)
            mx, my = x[mine], y[mine]
        loss = run(mx, my) * loss_weight(mx.shape[0], micro_batches)
        if micro < micro_batches - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
    return _grad_error(model, reference, expect)


def _moe_case(factor: float) -> float:
    """The MoE GPT with experts="parallel": its loss divided by the world size (a global
    count's share), gradients summed."""
    torch._dynamo.reset()
    reference = moe_trainer.build("moe_gpt")
    model = autoshard.shard(copy.deepcopy(reference), experts="parallel")
    model.set_gradient_divide_factor(factor)
    run = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"})
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, moe_trainer.VOCAB, (moe_trainer.BATCH, moe_trainer.SEQ), generator=g)
    targets = torch.randint(1, moe_trainer.VOCAB, (moe_trainer.BATCH, moe_trainer.SEQ), generator=g)
    reference(ids, targets).backward()
    per = moe_trainer.BATCH // WORLD
    mine = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
    (run(ids[mine], targets[mine]) / WORLD).backward()
    return _grad_error(model, reference, 1.0)


def _no_sync_nests_and_restores() -> list[bool]:
    model = autoshard.shard(build("mlp"))
    seen = []
    with model.no_sync():
        with model.no_sync():
            seen.append(model.fc1._autoshard_sync)
        seen.append(model.fc1._autoshard_sync)  # still inside the outer one
    seen.append(model.fc1._autoshard_sync)
    return seen


def _clip_and_dcp() -> dict[str, Any]:
    """clip_grad_norm_ on summed gradients, then DCP's state dicts: sharded keys as the model's,
    the full ones equal to the reference, and a round trip through set_state_dict."""
    torch._dynamo.reset()
    reference = build("gpt")
    model = autoshard.shard(copy.deepcopy(reference))
    model.set_gradient_divide_factor(1.0)
    run = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"})
    ref_opt, opt = torch.optim.AdamW(reference.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch("gpt", 0)
    reference(x, y).backward()
    per = GLOBAL_BATCH // WORLD
    mine = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
    (run(x[mine], y[mine]) / WORLD).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    ref_opt.step()
    opt.step()
    sharded_model, sharded_optim = get_state_dict(model, opt)
    full_model, full_optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    ref_state = reference.state_dict()
    ref_optim = ref_opt.state_dict()["state"]
    param_names = [n for n, _ in reference.named_parameters()]
    optim_error = max((_full(full_optim["state"][n][k]) - ref_optim[i][k]).abs().max().item()
                      for i, n in enumerate(param_names) for k in ("exp_avg", "exp_avg_sq"))
    # Round trip: zero the model, load the sharded state back.
    saved = {k: _full(v).clone() for k, v in sharded_model.items()}
    sharded_model = {k: v.detach().clone() for k, v in sharded_model.items()}  # DCP's values are the parameters
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    set_state_dict(model, opt, model_state_dict=sharded_model, optim_state_dict=sharded_optim)
    return {
        "norm": abs(_full(norm).item() - ref_norm.item()),
        "keys": sorted(sharded_model) == sorted(ref_state),
        "sharded": all(isinstance(v, DTensor) for k, v in sharded_model.items() if k in dict(reference.named_parameters())),
        "full_model": max((_full(full_model[k]) - v).abs().max().item() for k, v in ref_state.items()),
        "optim": optim_error,
        "round_trip": max((_full(v) - saved[k]).abs().max().item() for k, v in model.state_dict().items()),
    }


def _all() -> dict[str, Any]:
    per_rank = lambda rows, micro: rows / GLOBAL_BATCH  # noqa: E731  (the rank's sum over the step's global count)
    one = lambda rows, micro: 1.0 / micro  # noqa: E731  (the usual mean, averaged over micro-batches)
    hybrid = init_device_mesh("cpu", (2, WORLD // 2))
    strategies = {"full": autoshard.shard, "grad_op": functools.partial(autoshard.shard, strategy="grad_op"),
                  "replicate": functools.partial(autoshard.shard, strategy="replicate"),
                  "hybrid": functools.partial(autoshard.shard, mesh=hybrid, strategy="hybrid")}
    found: dict[str, Any] = {f"sum_{s}": _case(fn, factor=1.0, loss_weight=per_rank, expect=1.0) for s, fn in strategies.items()}
    found["average_uncompiled"] = _case(autoshard.shard, factor=None, loss_weight=one, expect=1.0, compiled=False)
    found["divide_2n_uncompiled"] = _case(autoshard.shard, factor=2.0 * WORLD, loss_weight=one, expect=0.5, compiled=False)
    found["divide_2n_hybrid"] = _case(strategies["hybrid"], factor=2.0 * WORLD, loss_weight=one, expect=0.5)
    found["sum_moved"] = _case(autoshard.shard, factor=1.0, loss_weight=per_rank, expect=1.0, moved=True)
    found["sum_no_sync"] = _case(autoshard.shard, factor=1.0, loss_weight=per_rank, expect=1.0, micro_batches=2)
    found["sum_no_sync_replicate"] = _case(strategies["replicate"], factor=1.0, loss_weight=per_rank, expect=1.0,
                                           micro_batches=2)
    found["average_no_sync"] = _case(autoshard.shard, factor=None, loss_weight=one, expect=1.0, micro_batches=2)
    found["sum_shares"] = _case(autoshard.shard, factor=1.0, loss_weight=per_rank, expect=1.0, shares=[3, 2, 2, 1])
    found["average_shares"] = _case(autoshard.shard, factor=None, loss_weight=one, expect=1.0, shares=[3, 2, 2, 1])
    found["sum_experts"] = _moe_case(1.0)
    found["no_sync_flags"] = _no_sync_nests_and_restores()
    found["clip_dcp"] = _clip_and_dcp()
    return found


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return run_ranks(WORLD, _all, timeout=900)[0]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("case", ["sum_full", "sum_grad_op", "sum_replicate", "sum_hybrid", "average_uncompiled",
                                  "divide_2n_uncompiled", "divide_2n_hybrid", "sum_moved", "sum_no_sync", "sum_no_sync_replicate",
                                  "average_no_sync", "sum_shares", "average_shares", "sum_experts"])
def test_gradients_are_the_sum_divided_by_the_factor(results: dict[str, Any], case: str) -> None:
    assert results[case] <= TOL, results[case]


@pytest.mark.slow
@pytest.mark.multirank
def test_no_sync_nests_and_restores_the_setting(results: dict[str, Any]) -> None:
    assert results["no_sync_flags"] == [False, False, True]


@pytest.mark.slow
@pytest.mark.multirank
def test_clip_grad_norm_and_dcp_state_dicts(results: dict[str, Any]) -> None:
    found = results["clip_dcp"]
    assert found["norm"] <= TOL, found
    assert found["keys"] and found["sharded"], found
    assert found["full_model"] <= TOL and found["optim"] <= TOL, found
    assert found["round_trip"] == 0.0, found


def test_bad_divide_factor_is_refused() -> None:
    model = autoshard.shard(build("mlp"))
    for bad in (0, -1.0, float("nan"), True, "sum"):
        with pytest.raises(autoshard.UsageError, match="pass 1.0 to sum gradients"):
            model.set_gradient_divide_factor(bad)
