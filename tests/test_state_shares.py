"""Per-rank state shares: a rank holds its share of every parameter's rows (and so of its
gradient and optimizer state), and training still equals one process on the whole batch
(gloo, CPU), compiled and not, with every optimizer, clipping, batch shares, state dicts and
checkpoints that move between uneven and even shares. Bad shares are refused alike on every
rank, changing nothing.

One launch per world size runs every case next to single-process references.
"""
from __future__ import annotations

import copy
import functools
from fractions import Fraction
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autoshard
from autoshard.runtime.errors import UsageError
from autoshard.runtime.state_shares import full_tensor, split_rows
from autoshard.tools.launch import run_ranks

import trainer
from models import batch, build
from trainer import train_pair

pytestmark = pytest.mark.multirank

TOL = 1e-5
MAX_NORM = 0.05  # below the gradients' norm: clipping is active every step
SHARES = {2: [3, 1], 4: [3, 3, 1, 1]}
trainer.OPTIMIZERS.update({
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True),
    "adamw_loop": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=False),
    "sgd_foreach": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True),
})


def _shard(**kwargs: Any) -> functools.partial:
    return functools.partial(autoshard.shard, state_shares=SHARES[dist.get_world_size()], **kwargs)


def _local_rows() -> dict[str, Any]:
    """Each parameter's local rows and this rank's bytes, against split_rows."""
    model = _shard()(build("uneven"))
    shares = [Fraction(s, sum(SHARES[dist.get_world_size()])) for s in SHARES[dist.get_world_size()]]
    found = {}
    for name, p in model.named_parameters():
        expected = split_rows(p.shape[0], shares)[dist.get_rank()] if p.dim() else None
        found[name] = (p.to_local().shape[0] if p.dim() else None, expected, p.to_local().numel())
    return found


def _state_dict_round_trip() -> dict[str, Any]:
    """model.state_dict() -> a step changes the parameters -> load_state_dict brings them back."""
    model = _shard()(build("uneven"))
    saved = {k: v.to_local().clone() if isinstance(v, DTensor) else v.clone() for k, v in model.state_dict().items()}
    kept = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(*[t[: 8 // dist.get_world_size()] for t in batch("uneven", 0)]).backward()
    opt.step()
    changed = any(not torch.equal(v.to_local() if isinstance(v, DTensor) else v, saved[k]) for k, v in model.state_dict().items())
    model.load_state_dict(kept)
    back = all(torch.equal(v.to_local() if isinstance(v, DTensor) else v, saved[k]) for k, v in model.state_dict().items())
    return {"changed": changed, "back": back}


def _trained(state_shares: Any, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = autoshard.shard(build("uneven"), state_shares=state_shares)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    per = 8 // dist.get_world_size()
    for step in range(steps):
        x, y = batch("uneven", step)
        mine = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
        model(x[mine], y[mine]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _everything(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    full = {n: full_tensor(p.detach()) for n, p in model.named_parameters()}
    full.update(trainer.full_optimizer_state(model, opt))
    return full


def _checkpoints(path: str) -> dict[str, Any]:
    """Save with uneven shares, load into even shares, save again, load into uneven shares:
    parameters and optimizer state equal all the way; and the locals really are uneven."""
    shares = SHARES[dist.get_world_size()]
    uneven, opt = _trained(shares)
    before = _everything(uneven, opt)
    autoshard.save(f"{path}/uneven", uneven, opt)
    even, even_opt = _trained(None, steps=1)  # other values, and state to overwrite
    autoshard.load(f"{path}/uneven", even, even_opt)
    in_even = _everything(even, even_opt)
    autoshard.save(f"{path}/even", even, even_opt)
    again, again_opt = _trained([1] * (len(shares) - 1) + [2], steps=1)  # yet other uneven shares
    autoshard.load(f"{path}/even", again, again_opt)
    back = _everything(again, again_opt)
    direct, direct_opt = _trained(shares, steps=1)
    autoshard.load(f"{path}/uneven", direct, direct_opt)
    full = autoshard.full_state_dict(uneven, rank0_only=False)
    return {
        "keys": sorted(before) == sorted(in_even) == sorted(back),
        "even": max((before[k] - in_even[k]).abs().max().item() for k in before),
        "back": max((before[k] - back[k]).abs().max().item() for k in before),
        "direct": max((before[k] - v).abs().max().item() for k, v in _everything(direct, direct_opt).items()),
        "full_state_dict": max((full[k] - before[k]).abs().max().item() for k in full),
        "rows": tuple(dict(m.named_parameters())["fc1.weight"].to_local().shape[0] for m in (uneven, even, again)),
    }


def _materialized() -> float:
    """A meta model sharded with state shares, materialized: the same full values as one
    sharded evenly under the same seed (each rank cut its own rows of the same draws)."""
    fulls = []
    for shares in (SHARES[dist.get_world_size()], None):
        with torch.device("meta"):
            model = build("uneven")
        autoshard.shard(model, state_shares=shares)
        torch.manual_seed(1)
        autoshard.materialize(model, "cpu")
        fulls.append({n: full_tensor(p.detach()) for n, p in model.named_parameters()})
    # fc1 and fc2 (reset_parameters); gain and temperature have no init: left uninitialised.
    return max((fulls[0][k] - fulls[1][k]).abs().max().item() for k in fulls[0] if k.startswith("fc"))


def _refusals() -> dict[str, str]:
    """The error each rank raised for bad state shares, and whether the model was left plain."""
    world = dist.get_world_size()
    found = {}
    bad = {
        "length": dict(state_shares=[1] * (world + 1)),
        "zero": dict(state_shares=[0] + [1] * (world - 1)),
        "differ": dict(state_shares=[1 + dist.get_rank()] + [1] * (world - 1)),
        "replicate": dict(state_shares=SHARES[world], strategy="replicate"),
        "hybrid": dict(state_shares=SHARES[world], strategy="hybrid", mesh=init_device_mesh("cpu", (2, world // 2))),
    }
    for case, kwargs in bad.items():
        model = build("uneven")
        try:
            autoshard.shard(model, **kwargs)
            found[case] = "none"
        except UsageError as e:
            plain = not autoshard.is_sharded(model) and not any(isinstance(p, DTensor) for p in model.parameters())
            found[case] = f"{e} plain={plain}"
    return found


def _cases(path: str) -> dict[str, Any]:
    world = dist.get_world_size()
    found: dict[str, Any] = {"rank": dist.get_rank(), "rows": _local_rows(), "refused": _refusals()}
    found["full"] = train_pair("uneven", _shard(), max_norm=MAX_NORM)
    found["gpt"] = train_pair("gpt", _shard(), optimizer="sgd")
    found["batch_shares"] = train_pair("uneven", _shard(), shares=SHARES[world], max_norm=MAX_NORM, optimizer="adamw_foreach")
    found["accumulation"] = train_pair("uneven", _shard(), micro_batches=2, global_batch=16, optimizer="sgd_foreach")
    if world == 2:
        found["grad_op"] = train_pair("uneven", _shard(strategy="grad_op"), optimizer="adamw_loop", max_norm=MAX_NORM)
        found["uncompiled"] = train_pair("uneven", _shard(), compiler="uncompiled", max_norm=MAX_NORM, optimizer="adamw_loop")
        found["uncompiled_batch_shares"] = train_pair("uneven", _shard(), compiler="uncompiled", shares=[1, 3])
        found["state_dict"] = _state_dict_round_trip()
        found["inductor"] = train_pair("mlp", _shard(), compiler="inductor", optimizer="sgd")
    found["materialized"] = _materialized()
    found["checkpoints"] = _checkpoints(path)
    return found


@functools.cache
def _results(world: int, path: str) -> list[dict[str, Any]]:
    return run_ranks(world, _cases, path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return lambda world: _results(world, str(tmp_path_factory.getbasetemp() / f"state_shares_{world}"))


PARITY = [(2, c) for c in ("full", "gpt", "batch_shares", "accumulation", "grad_op", "uncompiled", "uncompiled_batch_shares",
                           "inductor")]
PARITY += [(4, c) for c in ("full", "gpt", "batch_shares", "accumulation")]


@pytest.mark.slow
@pytest.mark.parametrize("world,case", PARITY)
def test_state_shares_train_like_one_process_on_the_whole_batch(results, world, case):
    for rank in results(world):
        found = rank[case]
        assert found["loss"] <= TOL and found["params"] <= TOL, (rank["rank"], found)
        if found["clip_ratio"] != float("inf"):
            assert found["clip_ratio"] > 1 and found["norm"] <= TOL, (rank["rank"], found)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_its_share_of_parameters_gradients_and_optimizer_state(results, world):
    ranks = results(world)
    for rank in ranks:
        for name, (have, expected, _) in rank["rows"].items():
            assert have == expected, (rank["rank"], name, have, expected)
    # fc1.weight: 10 rows cut [3, 1] -> 8 and 2 rows; [3, 3, 1, 1] -> 4, 4, 1, 1 (the largest remainders).
    assert [r["rows"]["fc1.weight"][0] for r in ranks] == {2: [8, 2], 4: [4, 4, 1, 1]}[world]
    stored = [r["full"]["stored"] for r in ranks]
    small, large = stored[-1], stored[0]
    for kind in ("params", "grads", "optimizer"):
        assert small[kind] * 2 < large[kind], (kind, stored)  # the small rank really holds less


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_meta_model_materializes_its_uneven_rows(results, world):
    for rank in results(world):
        assert rank["materialized"] == 0.0, rank["materialized"]


@pytest.mark.slow
def test_a_state_dict_loads_back_into_the_same_uneven_layout(results):
    for rank in results(2):
        assert rank["state_dict"] == {"changed": True, "back": True}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_checkpoints_move_between_uneven_and_even_shares(results, world):
    for rank in results(world):
        found = rank["checkpoints"]
        assert found["keys"], found
        for key in ("even", "back", "direct", "full_state_dict"):
            assert found[key] == 0.0, (rank["rank"], key, found)
    # The ranks really held other rows: uneven, then even (torch.chunk's), then other shares.
    rows = [r["checkpoints"]["rows"] for r in results(world)]
    assert [r[0] for r in rows] == {2: [8, 2], 4: [4, 4, 1, 1]}[world]
    assert [r[1] for r in rows] == {2: [5, 5], 4: [3, 3, 3, 1]}[world]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_bad_state_shares_raise_the_same_typed_error_on_every_rank_and_change_nothing(results, world):
    ranks = results(world)
    words = {"length": "state shares given for", "zero": "every share must be a positive", "differ": "state_shares",
             "replicate": "need strategy 'full' or 'grad_op'", "hybrid": "need strategy 'full' or 'grad_op'"}
    for case, word in words.items():
        messages = {rank["refused"][case] for rank in ranks}
        assert len(messages) == 1, (case, messages)
        message = messages.pop()
        assert message.startswith("autoshard.shard: ") and word in message and message.endswith("plain=True"), (case, message)


def test_rows_are_split_by_largest_remainders_identically_everywhere():
    thirds = [Fraction(1, 3)] * 3
    assert split_rows(10, thirds) == (4, 3, 3)
    assert split_rows(10, [Fraction(3, 4), Fraction(1, 4)]) == (8, 2)  # 7.5 and 2.5: the tie to the lower rank
    assert split_rows(3, [Fraction(3, 8), Fraction(3, 8), Fraction(1, 8), Fraction(1, 8)]) == (1, 1, 1, 0)
    assert sum(split_rows(1001, [Fraction(1, 7)] * 7)) == 1001


def test_without_a_process_group_state_shares_are_checked_and_change_nothing():
    with pytest.raises(UsageError, match="state shares given for 1 ranks"):
        autoshard.shard(build("uneven"), state_shares=[1, 1])
    model = autoshard.shard(build("uneven"), state_shares=[1])
    assert not any(isinstance(p, DTensor) for p in model.parameters())
