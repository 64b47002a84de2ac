"""Mixture-of-experts models trained with ``autoshard.shard(model, experts="parallel")`` on
this rank's slice of every batch, next to one process on the whole batch (tests/test_moe.py).

Every step draws a new batch, so the routing (how many tokens each expert gets, on which
rank) changes from step to step: the compiled graphs must not."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from moe_gpt import MoEConfig, MoEGPT
from torch import nn
from torch.distributed.tensor import DTensor

import autoshard
from autoshard._compat import dynamo_counters
from autoshard.runtime.experts import is_experts

BATCH, SEQ, VOCAB = 4, 12, 96  # BATCH: the global batch, divisible by 2 and 4 ranks


def _mixtral() -> nn.Module:
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                           router_aux_loss_coef=0.0)
    model = tf.MixtralForCausalLM(cfg)
    model.config.use_cache = False
    return model


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MoEGPT(MoEConfig(vocab_size=VOCAB)) if name == "moe_gpt" else _mixtral()


def _loss(name: str, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(ids, targets) if name == "moe_gpt" else model(input_ids=ids, labels=ids).loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def expert_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the experts' parameters this rank holds, bytes of all of them)."""
    local = full = 0
    for module in model.modules():
        if is_experts(module):
            for p in module.parameters(recurse=False):
                local += p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else p.numel() * p.element_size()
                full += p.numel() * p.element_size()
    return local, full


def train(name: str, compiler: str, steps: int = 3, debug_dir: str | None = None, experts: str = "parallel") -> dict[str, Any]:
    """Parity of ``steps`` SGD-with-momentum steps; what the compiled graphs were. ``experts``:
    ``autoshard.shard``'s, or "per_block" (the MoE GPT's blocks sharded first)."""
    torch._dynamo.reset()
    dynamo_counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = build(name)
    sharded = copy.deepcopy(reference)
    if experts == "per_block":  # FSDP2's usual pattern: each block first (experts split there), then the root
        for block in sharded.blocks:
            autoshard.shard(block, experts="parallel")
        autoshard.shard(sharded)
    else:
        autoshard.shard(sharded, experts=experts)
    options = {"compiler": compiler} | ({"debug_dir": debug_dir} if debug_dir else {})
    run = torch.compile(sharded, backend="autoshard", options=options)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.05, momentum=0.9)
    found: dict[str, Any] = {"loss": 0.0, "params": 0.0}
    per = BATCH // world
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        ids, targets = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g), torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        ref_loss = _loss(name, reference, ids, targets)
        ref_loss.backward()
        mine = slice(rank * per, (rank + 1) * per)
        loss = _loss(name, run, ids[mine], targets[mine])
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        found["loss"] = max(found["loss"], abs(mean.item() / world - ref_loss.item()))
        found["params"] = max(found["params"], max(
            (_full(p) - q).abs().max().item() for p, q in zip(sharded.parameters(), reference.parameters(), strict=True)))
    found["graphs"] = dynamo_counters["stats"]["unique_graphs"]
    found["expert_bytes"] = expert_bytes(sharded)
    found["state_dict_shapes"] = {k: tuple(v.to_local().shape) for k, v in sharded.state_dict().items()
                                  if isinstance(v, DTensor) and "expert" in k}
    return found
