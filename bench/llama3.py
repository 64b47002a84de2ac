"""A Llama 3 shaped decoder, as torchtitan trains it, for replaying published runs on the
simulator (bench/published.py): RMSNorm, rotary embeddings, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU feed-forward, an untied output head whose logits
are upcast to float32 before the cross-entropy, and per-block selective activation
checkpointing (torchtitan's "op" policy). Written for this repository from the published
architecture; nothing here is copied from torchtitan.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    vocab_size: int = 128256
    seq_len: int = 8192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    ac: str = "selective"  # "selective" (torchtitan's op policy), "full" or "none"


# Llama 3.1 8B (torchtitan's llama3 "8B" flavour: dim 4096, 32 layers, 32 heads, 8 KV heads,
# ffn_dim_multiplier 1.3 rounded to a multiple of 1024 -> 14336, vocabulary 128256).
LLAMA3_8B = LlamaConfig()

# What torchtitan's selective "op" policy keeps from the forward: matmul outputs (every other
# one, counted per block), attention outputs, and max (of float8 scaling; absent here).
_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.max.default,
         torch.ops.aten._scaled_dot_product_flash_attention.default,
         torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _op_policy(counts: dict[str, int], ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's op-level selective AC: save what ``_SAVE`` names except every second mm."""
    if func is torch.ops.aten.mm.default:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] = counts.get(key, 0) + 1  # a plain dict: torch 2.11's Dynamo read a defaultdict as a dict (KeyError)
        if counts[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotary embedding on interleaved pairs (real arithmetic: the same FLOPs and bytes as
    # torchtitan's complex multiply, which fake tensors handle less well).
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.n_heads // self.n_kv  # GQA: each KV head serves `rep` query heads
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.ac = cfg.ac
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.ac == "none":
            return self._forward(x, cos, sin)
        # A fresh counter per call, as torchtitan builds one per block.
        context = None
        if self.ac == "selective":
            context = partial(create_selective_checkpoint_contexts, partial(_op_policy, {}))
        kwargs = {"context_fn": context} if context else {}
        return checkpoint(self._forward, x, cos, sin, use_reentrant=False, **kwargs)


class Llama3(nn.Module):
    """``forward(tokens, labels)`` -> mean cross-entropy, as torchtitan's training step computes it."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head_dim = cfg.dim // cfg.n_heads
        freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(cfg.seq_len).float(), freqs)[:, None, :]  # (seq, 1, head_dim / 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h)).float()  # torchtitan upcasts the logits for the loss
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
