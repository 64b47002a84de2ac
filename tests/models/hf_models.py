"""Tiny models from the ``transformers`` library, none written here, and a parity run for each:
``autoshard.shard`` + ``torch.compile(backend="autoshard")`` on this rank's slice of every batch,
next to one process on the whole batch (as FSDP2 or DDP users would check it).

Vocabularies of 211 tokens and odd widths, so that no world size divides every first dimension:
short and empty shards are the normal case here, not a corner.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
import transformers as tf
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import autoshard

VOCAB, SEQ, BATCH = 211, 12, 4  # BATCH: the global batch, divisible by 2 and 4 ranks
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, max_position_embeddings=64)


def _llama() -> nn.Module:
    # grouped-query attention (2 key/value heads for 4), rotary embeddings
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_DECODER, intermediate_size=176, num_hidden_layers=3, num_key_value_heads=2))


def _llama_checkpointed() -> nn.Module:
    model = _llama()  # the library's own activation checkpointing switch
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _gpt2() -> nn.Module:
    # the LM head is the token embedding (tied)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return tf.GPT2LMHeadModel(cfg)


def _qwen2_moe() -> nn.Module:
    # top-2 of 4 experts next to a shared expert whose gate is a [1, 64] weight (empty shards)
    cfg = tf.Qwen2MoeConfig(**_DECODER, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                            num_hidden_layers=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                            router_aux_loss_coef=0.0)
    return tf.Qwen2MoeForCausalLM(cfg)


def _t5() -> nn.Module:
    # encoder-decoder, relative position buckets, embeddings shared by encoder and decoder
    cfg = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return tf.T5ForConditionalGeneration(cfg)


def _resnet() -> nn.Module:
    # convolutions with BatchNorm
    cfg = tf.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10)
    return tf.ResNetForImageClassification(cfg)


def _vit() -> nn.Module:
    # patch embedding (a convolution), a class token and position embeddings as bare parameters
    cfg = tf.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                       intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return tf.ViTForImageClassification(cfg)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _gpt2, "llama": _llama, "llama_checkpointed": _llama_checkpointed, "qwen2_moe": _qwen2_moe, "t5": _t5,
    "resnet": _resnet, "vit": _vit,
}
# Resolved here, not at first use: the launcher's fork server imports this module once for every
# launch (tests/models/conftest.py), its ranks then find the classes imported.
CLASSES = (tf.LlamaForCausalLM, tf.GPT2LMHeadModel, tf.Qwen2MoeForCausalLM, tf.T5ForConditionalGeneration,
           tf.ResNetForImageClassification, tf.ViTForImageClassification, tf.MixtralForCausalLM)
PER_RANK_STATISTICS = {"resnet"}  # BatchNorm normalises each rank's slice, as under DDP
IMAGES = {"resnet": 16, "vit": 32}  # image models: the side of their square inputs


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    model.config.use_cache = False
    return model


def batch(name: str, step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    if name in IMAGES:
        side = IMAGES[name]
        return {"pixel_values": torch.randn(BATCH, 3, side, side, generator=g), "labels": torch.randint(0, 10, (BATCH,), generator=g)}
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids}


def _rows(data: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    per = BATCH // world
    return {k: v[rank * per:(rank + 1) * per] for k, v in data.items()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_per_layer(model: nn.Module) -> nn.Module:
    """FSDP2's usual pattern: each decoder layer first, then the root."""
    for layer in model.model.layers:
        autoshard.shard(layer)
    return autoshard.shard(model)


def shard_tensor_parallel(model: nn.Module, tp: int = 2) -> nn.Module:
    """FSDP2 + TP's pattern: the library's own tensor-parallel plan on ``mesh["tp"]``, then
    sharded over ``mesh["dp"]`` (ranks ``dp * tp + t``)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], autoshard.transformers_tp_plan(model))
    return autoshard.shard(model, mesh["dp"])


def parity(name: str, compiler: str, *, steps: int = 2, shard: Callable[[nn.Module], nn.Module] = autoshard.shard,
           dtype: torch.dtype = torch.float32, tp: int = 1) -> dict[str, Any]:
    """Train the sharded model on this rank's rows next to one process on the whole batch
    (for BatchNorm models: the mean of per-rank-slice losses, as DDP computes it); SGD with
    momentum on both. Returns the largest loss and parameter differences over ``steps``, the
    parameters compared after every step. ``tp``: the tensor-parallel ranks of each
    data-parallel rank, which share its rows."""
    torch._dynamo.reset()
    rank, world = dist.get_rank() // tp, dist.get_world_size() // tp
    reference = build(name).to(dtype)
    sharded = shard(copy.deepcopy(reference))
    run = torch.compile(sharded, backend="autoshard", options={"compiler": compiler})
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.05, momentum=0.9)
    found = {"loss": 0.0, "params": 0.0, "losses": []}
    for step in range(steps):
        data = batch(name, step)
        if name in PER_RANK_STATISTICS:
            ref_loss = sum(reference(**_rows(data, r, world)).loss for r in range(world)) / world
        else:
            ref_loss = reference(**data).loss
        ref_loss.backward()
        loss = run(**_rows(data, rank, world)).loss
        loss.backward()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        mean = mean.item() / dist.get_world_size()
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        found["losses"].append(mean)
        found["loss"] = max(found["loss"], abs(mean - ref_loss.item()))
        found["params"] = max(found["params"], max(
            (_full(p).float() - q.float()).abs().max().item() for p, q in zip(sharded.parameters(), reference.parameters(), strict=True)))
    return found


HOW: dict[str, dict[str, Any]] = {
    "whole": {},  # the model sharded at its root, with shard's defaults
    "per_layer": {"shard": shard_per_layer},
    "bf16": {"dtype": torch.bfloat16},  # the model held in bfloat16
    # Every parameter gathered again in the backward, or every one kept from the forward: with
    # the defaults (the last block kept), the three ways a gathered parameter reaches the backward.
    "reshard": {"shard": functools.partial(autoshard.shard, reshard_after_forward=True)},
    "keep": {"shard": functools.partial(autoshard.shard, reshard_after_forward=False)},
    # hpZ: the backward gathers again within nodes of 2 ranks (run at 4 ranks).
    "hpz": {"shard": functools.partial(autoshard.shard, reshard_after_forward=2)},
    # dp x tp = 2 x 2 (run at 4 ranks): the library's tensor-parallel plan, then sharded over dp.
    "tp": {"shard": shard_tensor_parallel, "tp": 2},
}


def parity_many(cases: list[tuple[str, str]], how: str = "whole") -> dict[tuple[str, str], dict[str, Any]]:
    """:func:`parity` for several (model, compiler) cases in one launch (spawning ranks costs
    seconds), each sharded and held as :data:`HOW` says."""
    return {case: parity(*case, **HOW[how]) for case in cases}
