"""Small models for the tests. Each takes ``(inputs, targets)`` and returns a mean loss, and
comes with a batch maker, so the tests can treat them all alike."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpt import GPT, GPTConfig

GLOBAL_BATCH = 8


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc2(torch.tanh(self.fc1(x))))
        return F.mse_loss(self.out(h), y)


class FrozenEncoder(MLP):
    """A frozen feature extractor (fc1) under a trainable head: fine-tuning."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1.requires_grad_(False)


class Uneven(nn.Module):
    """dim 0 of 10 and 3 over 4 ranks (padding, an empty shard), a 1-d and a 0-d parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 10)
        self.fc2 = nn.Linear(10, 3)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x))) * self.gain / self.temperature
        return F.mse_loss(out.sum(-1, keepdim=True), y)


class GraphBreak(MLP):
    """A forward that Dynamo must split into two graphs."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        torch._dynamo.graph_break()
        return F.mse_loss(self.out(F.gelu(self.fc2(h))), y)


def _regression_batch(step: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 16, generator=g), torch.randn(size, 1, generator=g)


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _token_batch(step: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, 64, (size, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (LoRA)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)  # not 0: A gets gradients at once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _lora_gpt() -> GPT:
    """The GPT frozen but for LoRA adapters in every block: each block's bucket mixes frozen
    and trainable parameters."""
    model = _gpt().requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv, block.fc = LoRALinear(block.attn.qkv), LoRALinear(block.fc)
    return model


class Checkpointed(nn.Module):
    """Runs ``inner`` under activation checkpointing (recomputed in backward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, *args, use_reentrant=False)


def _checkpointed_gpt() -> GPT:
    model = _gpt()
    model.blocks = nn.ModuleList(Checkpointed(block) for block in model.blocks)
    return model


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., tuple[torch.Tensor, torch.Tensor]]]] = {
    "mlp": (MLP, _regression_batch),
    "gpt": (_gpt, _token_batch),
    "frozen": (FrozenEncoder, _regression_batch),
    "uneven": (Uneven, _regression_batch),
    "graph_break": (GraphBreak, _regression_batch),
    "lora": (_lora_gpt, _token_batch),
    "checkpointed": (_checkpointed_gpt, _token_batch),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


def batch(name: str, step: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    return MODELS[name][1](step, size)
