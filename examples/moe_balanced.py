"""The example MoE GPT (examples/moe_gpt.py) with experts that compute as if the router were
perfectly balanced: each expert gets ``T * k / E`` rows, one batched matmul over all experts.
A graph with static shapes, so experts sharded like any parameter (``experts="gathered"``)
compile in one graph too, with the FLOPs the expert-parallel op's cost model counts: the
stand-in bench/moe_sim.py and ``autoshard.plan`` compile on fake ranks (fake tensors never run
it on a real routing; ``T * k`` must divide by ``E``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from moe_gpt import Experts, MoEConfig, MoEGPT
from torch import nn


class BalancedExperts(Experts):
    """The example's experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) run on a
    perfectly balanced routing: rows sorted by expert, ``T * k / E`` per expert, one batched
    matmul. Static shapes: the simulator's stand-in for a dropless grouped matmul."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        width = hidden_states.shape[-1]
        order = torch.argsort(top_k_index.reshape(-1), stable=True)
        rows = hidden_states[order // k].reshape(self.gate_up_proj.shape[0], -1, width)
        gate, up = torch.bmm(rows, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2)).reshape(tokens * k, width)
        routed = torch.zeros_like(out).index_copy(0, order, out).view(tokens, k, width)
        return (routed * top_k_weights.unsqueeze(-1).to(routed.dtype)).sum(1)


def build(cfg: MoEConfig) -> nn.Module:
    """The example MoE GPT at ``cfg``, its experts the balanced stand-in."""
    model = MoEGPT(cfg)
    for block in model.blocks:
        block.moe.experts = BalancedExperts(cfg)
    return model
