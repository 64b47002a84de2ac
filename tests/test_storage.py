"""Each rank stores 1/world of the parameters, gradients and optimizer state."""
from __future__ import annotations

import torch
import torch.distributed as dist

import autoshard
from models import GLOBAL_BATCH, batch, build
from spawn import run_ranks

WORLD = 4


def _nbytes(tensors) -> int:
    return sum(t.to_local().nbytes for t in tensors)


def _stored_bytes() -> dict[str, int]:
    """Local bytes of parameters, gradients and AdamW state after one compiled step."""
    rank = dist.get_rank()
    model = autoshard.shard(build("gpt"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch("gpt", 0)
    mine = slice(rank * GLOBAL_BATCH // WORLD, (rank + 1) * GLOBAL_BATCH // WORLD)
    torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"})(x[mine], y[mine]).backward()
    opt.step()
    params = list(model.parameters())
    states = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    return {
        "params": _nbytes(params),
        "grads": _nbytes(p.grad for p in params),
        "optimizer": _nbytes(states),
    }


def test_per_rank_storage_is_one_over_world():
    full = build("gpt")
    full_bytes = sum(p.nbytes for p in full.parameters())
    per_rank = run_ranks(WORLD, _stored_bytes)
    # Worst-case padding: each parameter's shard rounds dim 0 up to ceil(dim0 / world) rows.
    padded = sum(-(-p.shape[0] // WORLD) * p[0].nbytes for p in full.parameters())
    for kind, factor in (("params", 1), ("grads", 1), ("optimizer", 2)):  # AdamW: exp_avg, exp_avg_sq
        stored = [r[kind] for r in per_rank]
        assert sum(stored) == factor * full_bytes, kind  # nothing lost, nothing duplicated
        assert max(stored) <= factor * padded, kind
        ratio = max(stored) / (factor * full_bytes)
        print(f"{kind}: largest rank holds {ratio:.4f} of the full model (1/{WORLD} = {1 / WORLD:.4f})")
        assert ratio < 1 / WORLD + 0.01
