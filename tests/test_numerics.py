"""Sharded training matches single-process training on the whole global batch (gloo, CPU)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import autoshard
from models import GLOBAL_BATCH, batch, build
from spawn import run_ranks

STEPS = 5
TOL = 1e-5
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
}


def _train_and_compare(configs: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], tuple[float, float]]:
    """On each rank: for each (model, mode, optimizer), train a sharded copy on this rank's
    slice of every batch next to a reference on the whole batch; return the largest loss and
    parameter differences seen over all steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    errors = {}
    for name, mode, opt_name in configs:
        torch._dynamo.reset()
        reference = build(name)
        model = autoshard.shard(copy.deepcopy(reference))
        run = model if mode == "uncompiled" else torch.compile(model, backend="autoshard", options={"compiler": mode})
        ref_opt = OPTIMIZERS[opt_name]([p for p in reference.parameters() if p.requires_grad])
        opt = OPTIMIZERS[opt_name]([p for p in model.parameters() if p.requires_grad])
        loss_err = param_err = 0.0
        for step in range(STEPS):
            x, y = batch(name, step)
            ref_loss = reference(x, y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()

            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            loss = run(x[mine], y[mine])
            loss.backward()
            opt.step()
            opt.zero_grad()

            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            loss_err = max(loss_err, abs(global_loss.item() / world - ref_loss.item()))
            for (pname, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                param_err = max(param_err, (p.full_tensor() - q).abs().max().item())
        errors[(name, mode, opt_name)] = (loss_err, param_err)
    return errors


def _configs(modes: list[str], models: list[str]) -> list[tuple[str, str, str]]:
    return [(m, mode, o) for mode in modes for m in models for o in OPTIMIZERS]


ALL_MODELS = ["mlp", "gpt", "frozen", "uneven", "graph_break"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_single_process(world_size: int) -> None:
    configs = (
        _configs(["uncompiled", "aot_eager"], ALL_MODELS)
        + _configs(["eager"], ["graph_break"])  # the backend's "eager" compiler: captured graph as is
        + _configs(["inductor"], ["mlp"])
    )
    for rank_errors in run_ranks(world_size, _train_and_compare, configs):
        bad = {cfg: err for cfg, err in rank_errors.items() if max(err) > TOL}
        assert not bad, f"(loss error, parameter error) above {TOL}: {bad}"
        assert set(rank_errors) == set(configs)
