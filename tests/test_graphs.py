"""Graph shapes after lowering, at world size 8 (fake process group, one process).

These look at the lowered graphs as they are (schedule "none"); test_schedule.py covers
bucketing and scheduling."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import fx

import autoshard
from autoshard._compat import c10d
from autoshard.compiler import backend
from autoshard.passes.graph_utils import PARAMS

from fake_pg import compile_step, count, fake_world
from models import batch, build

WORLD = 8


def _compile_step(name: str, **options) -> tuple[torch.nn.Module, fx.GraphModule, fx.GraphModule]:
    step = compile_step(name, world_size=WORLD, options={"schedule": "none", **options})
    return step.model, step.forward, step.backward


def _saved_gathers(fw: fx.GraphModule) -> list[fx.Node]:
    """Forward outputs (saved for backward, or returned) that are gathered parameters or views of them."""
    found = []
    for out in fw.graph.output_node().args[0]:
        node = out
        while isinstance(node, fx.Node) and node.op == "call_function" and node.target is not c10d.wait_tensor.default:
            if not getattr(node.target, "is_view", False):
                break
            node = node.args[0]
        if isinstance(node, fx.Node) and node.target is c10d.wait_tensor.default:
            found.append(out)
    return found


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_one_gather_per_parameter_and_one_reduce_per_gradient(name):
    model, fw, bw = _compile_step(name)
    params = list(model.parameters())  # tied weights appear once
    assert count(fw, "all_gather_into_tensor") == len(params)
    assert count(bw, "reduce_scatter_tensor") == len(params)
    assert count(fw, "reduce_scatter") == count(bw, "all_reduce") == 0


def test_reshard_after_forward_regathers_in_backward_and_saves_no_full_parameter():
    _, fw, bw = _compile_step("gpt", reshard_after_forward=True)
    assert count(bw, "all_gather_into_tensor") > 0
    assert _saved_gathers(fw) == []


def _gathered(gm: fx.GraphModule) -> set[str]:
    return {name for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default for name in n.meta[PARAMS]}


def test_by_default_the_last_block_and_the_final_norm_stay_gathered_for_backward():
    """``autoshard.shard``'s default: what the backward needs first (the last of 2 blocks, the
    final norm after it) is kept from forward; the rest, the tied embedding/head included
    (first used at the start of forward), is gathered again."""
    model, fw, bw = _compile_step("gpt")
    _, _, bw_always = _compile_step("gpt", reshard_after_forward=True)
    kept = {n for n, _ in model.named_parameters() if n.startswith(("blocks.1.", "ln_f."))}
    assert kept and _gathered(fw) == {n for n, _ in model.named_parameters()}
    assert _gathered(bw) == _gathered(bw_always) - kept  # (the backward gathers only what it reads)
    assert "wte.weight" in _gathered(bw) and kept & _gathered(bw_always)
    assert _saved_gathers(fw)  # the kept ones the backward reads go to it from the forward


def test_without_reshard_the_forward_keeps_gathered_parameters():
    _, fw, bw = _compile_step("gpt", reshard_after_forward=False)
    assert count(bw, "all_gather_into_tensor") == 0
    assert len(_saved_gathers(fw)) > 0


def test_frozen_parameters_are_gathered_never_reduced():
    model, fw, bw = _compile_step("frozen")
    params = list(model.parameters())
    assert count(fw, "all_gather_into_tensor") == len(params)
    assert count(bw, "reduce_scatter_tensor") == sum(p.requires_grad for p in params)


def test_uneven_and_scalar_parameters():
    model, fw, bw = _compile_step("uneven")
    params = list(model.parameters())
    assert count(fw, "all_gather_into_tensor") == sum(p.dim() > 0 for p in params)
    assert count(bw, "reduce_scatter_tensor") == sum(p.dim() > 0 for p in params)
    assert count(bw, "all_reduce") == 1  # the 0-d temperature is replicated
    assert count(fw, "aten.slice") > 0  # 10 rows over 8 ranks: 16 gathered, padding cut off


def _unsharded_warnings(model: torch.nn.Module, world: bool) -> int:
    """How many times compiling and running ``model`` (the "mlp" batch) warns that parameters are not sharded."""
    torch._dynamo.reset()
    x, y = batch("mlp", 0)
    with warnings.catch_warnings(record=True) as caught, fake_world(WORLD) if world else contextlib.nullcontext():
        warnings.simplefilter("always")
        torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"})(x, y).backward()
    return sum("autoshard.shard(model) before torch.compile" in str(w.message) for w in caught)


def test_unsharded_trainable_parameters_warn_once(monkeypatch):
    """Once per process, for the first model compiled with trainable parameters left unsharded in a
    world of several ranks; never for a sharded model, nor for one rank alone."""
    monkeypatch.setattr(backend, "_warned_unsharded", False)  # as in a fresh process, whatever ran before here
    assert _unsharded_warnings(build("mlp"), world=False) == 0  # one rank alone has nothing to warn about
    with fake_world(WORLD):
        sharded = autoshard.shard(build("mlp"))
    assert _unsharded_warnings(sharded, world=True) == 0
    assert _unsharded_warnings(build("mlp"), world=True) == 1
    assert _unsharded_warnings(build("mlp"), world=True) == 0  # once


def test_inference_graph_is_lowered_too():
    step = compile_step("mlp", batch("mlp", 0), world_size=WORLD, train=False, options={"schedule": "none"})
    assert count(step.forward, "all_gather_into_tensor") == len(list(step.model.parameters()))
    assert count(step.forward, "autoshard") == count(step.forward, "autoshard.pad_shard")  # no annotation op is left
