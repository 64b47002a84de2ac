"""The sharding frontend: layouts, tied and frozen parameters, nested calls, bad input."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import autoshard

from fake_pg import fake_world
from models import build


@pytest.fixture
def world4(request):
    with fake_world(4, rank=getattr(request, "param", 0)):
        yield


@pytest.mark.parametrize("world4, rows", [(0, [3, 1, 1]), (3, [1, 0, 0])], indirect=["world4"])
def test_uneven_shards_follow_dtensor_layout(world4, rows):
    params = dict(autoshard.shard(build("uneven")).named_parameters())  # dim 0: fc1 10, fc2 3, gain 3
    assert [params[n].to_local().shape[0] for n in ("fc1.weight", "fc2.weight", "gain")] == rows
    assert params["fc1.weight"].shape == (10, 16)  # the global shape is kept
    assert params["fc1.weight"].placements == (Shard(0),)
    assert params["temperature"].placements == (Replicate(),)


def test_parameters_become_dtensor_shards_and_state_dict_keys_stay(world4):
    reference = build("gpt")
    model = autoshard.shard(build("gpt"))
    assert list(model.state_dict()) == list(reference.state_dict())
    assert all(isinstance(p, nn.Parameter) and isinstance(p, DTensor) for p in model.parameters())
    assert model.head._parameters["weight"] is model.wte._parameters["weight"]  # still tied: one shard
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    assert isinstance(model.blocks[0].ln1, nn.LayerNorm)  # the subclass keeps the user's class


def test_buffers_stay_replicated_and_frozen_parameters_stay_frozen(world4):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    model[0].requires_grad_(False)
    autoshard.shard(model)
    assert not isinstance(model[1].running_mean, DTensor) and model[1].running_mean.shape == (8,)
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]


def test_nested_shard_calls_keep_each_modules_settings(world4):
    model = build("gpt")
    autoshard.shard(model.wte, reshard_after_forward=False)  # the tied head is sharded later
    autoshard.shard(model)
    assert model.head._parameters["weight"] is model.wte._parameters["weight"]
    assert model.head._autoshard_specs["weight"].reshard is False
    assert model.blocks[0].fc._autoshard_specs["weight"].reshard is None  # decided by the lowering
    # names are relative to the outermost shard() call, each module naming its own use
    assert model.wte._autoshard_specs["weight"].name == "wte.weight"
    assert model.head._autoshard_specs["weight"].name == "head.weight"
    assert model.blocks[1].attn.qkv._autoshard_specs["weight"].name == "blocks.1.attn.qkv.weight"


def _snapshot(model: nn.Module):
    return [type(m) for m in model.modules()], [id(p) for p in model.parameters()]


def test_sharding_twice_is_refused_and_changes_nothing(world4):
    model = autoshard.shard(build("mlp"))
    before = _snapshot(model)
    with pytest.raises(ValueError, match="already sharded"):
        autoshard.shard(model)
    assert _snapshot(model) == before


def test_mesh_not_matching_the_process_group_is_refused_and_changes_nothing(world4):
    model = build("mlp")
    before = _snapshot(model)
    with pytest.raises(ValueError, match="mesh has 2 ranks but the process group has 4"):
        autoshard.shard(model, DeviceMesh("cpu", [0, 1]))
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        autoshard.shard(model, init_device_mesh("cpu", (2, 2)))
    assert _snapshot(model) == before
    autoshard.shard(model, init_device_mesh("cpu", (4,)))  # a matching mesh works


def test_without_a_process_group_the_model_runs_as_is():
    assert not dist.is_initialized()
    model = autoshard.shard(build("mlp"))
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    x = torch.randn(2, 16)
    compiled = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"})
    torch.testing.assert_close(compiled(x, torch.zeros(2, 1)), model(x, torch.zeros(2, 1)))
    with pytest.raises(ValueError, match="already sharded"):
        autoshard.shard(model)


def _blocks_first(model: nn.Module) -> nn.Module:
    for block in model.blocks:
        autoshard.shard(block)
    return model


def test_blocks_sharded_before_the_root_are_bucketed_per_block_as_when_the_root_alone_is():
    """FSDP2's pattern (each block, then the root) names the blocks' parameters from the root
    in the graph (``blocks.0.attn...``), so bucketing finds their blocks: the same buckets as
    sharding the root alone. (The gathers once carried ``attn...``: every block's parameters
    fell into one bucket, and a plan mixing layouts held them all at once.)"""
    from fake_pg import compile_step, same_tokens
    from gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16)
    tokens = same_tokens(lambda: torch.zeros(1, 8, dtype=torch.long))
    gathered = []
    for factory in (lambda: GPT(cfg), lambda: _blocks_first(GPT(cfg))):
        step = compile_step(factory, tokens, world_size=4, options={"schedule": "none"})
        gathers = [n for n in step.forward.graph.nodes if "all_gather" in str(n.target)]
        gathered.append([n.meta["autoshard_params"] for n in gathers])
    root_alone, blocks_first = gathered
    assert blocks_first == root_alone
    assert any(name.startswith("blocks.2.") for names in blocks_first for name in names)
