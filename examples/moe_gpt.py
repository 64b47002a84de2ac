"""A small mixture-of-experts GPT: examples/gpt.py's attention, and in each block's MLP a router
choosing the top 2 of 8 experts per token, the experts held as one module with 3-D weights
called as ``experts(hidden_states, top_k_index, top_k_weights)``, as ``transformers`` 5.x lays
them out. Dropless: every token reaches its experts."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpt import CausalSelfAttention, GPTConfig


@dataclass
class MoEConfig(GPTConfig):
    """examples/gpt.py's sizes, and each block's experts."""

    n_expert: int = 8
    top_k: int = 2
    expert_hidden: int = 128


class Experts(nn.Module):
    """Every expert's SwiGLU MLP: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts = cfg.n_expert
        self.gate_up_proj = nn.Parameter(torch.randn(cfg.n_expert, 2 * cfg.expert_hidden, cfg.n_embd) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(cfg.n_expert, cfg.n_embd, cfg.expert_hidden) * 0.02)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return _run_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


# Each expert's token count depends on the routing: compiled, this loop would break the graph at
# every expert and recompile as the counts change. Run eagerly instead, it is one break per layer,
# after the weights are read (and, with experts sharded as any parameter, gathered) in the graph.
# With autoshard.shard(model, experts="parallel") the layer is one op and nothing breaks.
@torch.compiler.disable
def _run_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(hidden_states)
    for e in range(gate_up_proj.shape[0]):  # one matmul pair per expert, on its tokens only
        token, slot = torch.where(top_k_index == e)
        gate, up = F.linear(hidden_states[token], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[e])
        out.index_add_(0, token, y * top_k_weights[token, slot, None])
    return out


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(flat, index, weights).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy loss of predicting ``targets`` from ``idx`` (both ``[B, T]``)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())
