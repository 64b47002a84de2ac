"""Quantized reductions (autoshard.Compression(reduce="int8"), ZeRO++'s qgZ): exact against one
process that quantizes every rank's gradient chunk by chunk as laid out, int8 all-to-alls on the
wire, and refused when asked wrongly."""
from __future__ import annotations

import copy
import functools
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard._compat import c10d
from autoshard.runtime.errors import UsageError
from autoshard.runtime.state_shares import split_rows
from autoshard.tools.launch import run_ranks

from fake_pg import compile_step
from models import GLOBAL_BATCH, batch, build

BLOCK = 24  # blocks that cross rows and end short, so the layout is tested, not only the arithmetic
TOL = 1e-6
STEPS = 3


def torch_chunk_rows(dim0: int, world: int) -> list[int]:
    """Each rank's rows under ``Shard(0)``: ``ceil(dim0 / world)``, fewer (or none) at the tail."""
    chunk = -(-dim0 // world)
    return [max(0, min(chunk, dim0 - r * chunk)) for r in range(world)]


def reference_chunk_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    """One destination chunk as its receiver dequantizes it, written plainly: flattened, cut into
    blocks of ``block`` elements (the last one short); per block, scale = max |x| / 127 (float32),
    x -> round(x / scale) as int8, times scale."""
    pieces = []
    for b in x.float().reshape(-1).split(block):
        scale = b.abs().max() / 127
        q = torch.round(b / scale).clamp(-127, 127) if scale > 0 else torch.zeros_like(b)
        pieces.append(q.to(torch.int8).float() * scale)
    return torch.cat(pieces).view(x.shape)


def reference_reduce(grads: list[torch.Tensor], rows: list[int], block: int) -> torch.Tensor:
    """The full gradient a group of ranks ends with, ``grads[s]`` the full gradient of source
    rank s and ``rows[d]`` destination d's rows: each source's rows of destination d, padded with
    zero rows to ``max(rows)``, quantized and dequantized on their own; summed over the sources in
    float32, divided by their number, cut back to ``rows[d]`` rows."""
    widest, start, out = max(rows), 0, []
    for n in rows:
        total = None
        for g in grads:
            mine = torch.cat([g[start:start + n], g.new_zeros(widest - n, *g.shape[1:])])
            received = reference_chunk_qdq(mine, block)
            total = received if total is None else total + received
        out.append((total / len(grads))[:n])
        start += n
    return torch.cat(out)


def reference_gathered(full: torch.Tensor, rows: list[int], block: int) -> torch.Tensor:
    """``full`` as every rank computes with it after an int8 gather: each rank's rows, padded to
    ``max(rows)``, quantized and dequantized on their own (test_compression checks this layout)."""
    widest, start, out = max(rows), 0, []
    for n in rows:
        mine = torch.cat([full[start:start + n], full.new_zeros(widest - n, *full.shape[1:])])
        out.append(reference_chunk_qdq(mine, block)[:n])
        start += n
    return torch.cat(out)


SHARES = (Fraction(3, 4), Fraction(1, 4))
# How each layout shards: autoshard.shard's arguments, each parameter's rows per rank of its
# group, and the groups of ranks a gradient is reduce-scattered in (the rest: replicas, averaged in float).
LAYOUTS = {
    "even": (lambda world: {}, torch_chunk_rows, lambda world: [list(range(world))]),
    "hybrid": (lambda world: {"mesh": init_device_mesh("cpu", (2, world // 2)), "strategy": "hybrid"},
               lambda dim0, world: torch_chunk_rows(dim0, world // 2),
               lambda world: [list(range(i, i + world // 2)) for i in range(0, world, world // 2)]),
    "shares": (lambda world: {"state_shares": [3, 1]}, lambda dim0, world: list(split_rows(dim0, SHARES)),
               lambda world: [list(range(world))]),
    # int8 gathers too: the reference computes with the weights quantized per shard.
    "gather": (lambda world: {}, torch_chunk_rows, lambda world: [list(range(world))]),
    # A gradient divide factor: the average times N / DIVIDE, applied where it reaches .grad.
    "divide": (lambda world: {}, torch_chunk_rows, lambda world: [list(range(world))]),
}
DIVIDE = 0.5


def _parity(name: str, mode: str, layout: str) -> tuple[float, float]:
    """On each rank: train ``name`` sharded (``LAYOUTS[layout]``) with int8 reductions on this
    rank's slice of the batch, and, each step, a single-process copy holding the same weights
    that computes every rank's gradient on that rank's slice and reduces them by
    :func:`reference_reduce`; the largest gradient and parameter (after an SGD step) differences."""
    # Each case compiles afresh: Dynamo would otherwise recompile the earlier case's code for this
    # one's shapes, marking dimensions dynamic on the ranks whose shapes changed only (torch 2.11).
    torch._dynamo.reset()
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build(name)
    reference = copy.deepcopy(model)
    shard_kwargs, rows_of, groups_of = LAYOUTS[layout]
    gather = "int8" if layout == "gather" else None
    autoshard.shard(model, compression=autoshard.Compression(gather=gather, reduce="int8", block=BLOCK), **shard_kwargs(world))
    scale = 1.0
    if layout == "divide":
        model.set_gradient_divide_factor(DIVIDE)
        scale = world / DIVIDE
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run = model if mode == "uncompiled" else torch.compile(model, backend="autoshard", options={"compiler": mode})
    per_rank = GLOBAL_BATCH // world
    grad_error = param_error = 0.0
    for step in range(STEPS):
        x, y = batch(name, step)
        run(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]).backward()
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                full = autoshard.full_tensor(p)
                q.copy_(reference_gathered(full, rows_of(full.shape[0], world), BLOCK) if gather and full.dim() > 0 else full)
        per_source = []  # every rank's full gradients, computed here
        for r in range(world):
            reference.zero_grad()
            reference(x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]).backward()
            per_source.append([q.grad.clone() for q in reference.parameters()])
        for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters(), strict=True)):
            grads = [g[i] for g in per_source]
            if q.dim() == 0:  # replicated: a float all-reduce, averaged
                expected = sum(grads) / world
            else:
                rows = rows_of(q.shape[0], world)
                reduced = [reference_reduce([grads[s] for s in group], rows, BLOCK) for group in groups_of(world)]
                expected = sum(reduced) / len(reduced)  # hybrid's replicas: a float average
            expected = expected * scale
            grad_error = max(grad_error, (autoshard.full_tensor(p.grad) - expected).abs().max().item())
            with torch.no_grad():
                q.copy_(autoshard.full_tensor(p).detach() - 0.05 * expected)
        optimizer.step()
        optimizer.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            param_error = max(param_error, (autoshard.full_tensor(p).detach() - q).abs().max().item())
    return grad_error, param_error


def _all(configs: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], tuple[float, float]]:
    return {config: _parity(*config) for config in configs}


# Padded shards (uneven), 1-d and 0-d parameters, a tied weight (gpt), uneven state shares, int8
# gathers as well, a gradient divide factor, and,
# at 4 ranks, hybrid sharding, whose reductions run in half the ranks before a float all-reduce.
PARITY = {2: [("gpt", "aot_eager", "even"), ("uneven", "aot_eager", "even"), ("uneven", "uncompiled", "even"),
              ("uneven", "aot_eager", "shares"), ("uneven", "aot_eager", "gather"), ("uneven", "aot_eager", "divide")],
          4: [("gpt", "aot_eager", "even"), ("gpt", "aot_eager", "hybrid")]}


@functools.cache
def _errors(world_size: int) -> list[dict]:
    return run_ranks(world_size, _all, PARITY[world_size])


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_int8_reductions_match_one_process_quantizing_each_chunk(world_size):
    for errors in _errors(world_size):
        bad = {config: e for config, e in errors.items() if max(e) > TOL}
        assert not bad, f"(gradient error, parameter error) above {TOL}: {bad}"


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.inductor
def test_int8_reductions_match_under_inductor():
    for errors in run_ranks(2, _all, [("mlp", "inductor", "even")]):
        assert max(errors[("mlp", "inductor", "even")]) <= TOL, errors


def test_the_packed_chunks_are_each_quantized_as_the_reference_does():
    """The two functions behind every quantized reduction, against the plain reference on one rank."""
    from autoshard.runtime.quantize import dequantize_mean, packed_numel, quantize_chunks

    torch.manual_seed(0)
    grads = [torch.randn(6, 5) * torch.tensor([1.0, 10.0, 0.0, 1e-3, 3.0]) for _ in range(3)]
    packed = [quantize_chunks(g, 3, 8) for g in grads]  # what each of 3 sources sends
    assert all(p.dtype == torch.int8 and p.numel() == 3 * packed_numel(10, 8) for p in packed)
    for d in range(3):  # what destination d receives: its chunk of every source, source after source
        received = torch.cat([p.view(3, -1)[d] for p in packed])
        assert torch.allclose(dequantize_mean(received, 3, 8, [2, 5]), reference_reduce(grads, [2, 2, 2], 8)[2 * d:2 * d + 2],
                              rtol=0, atol=1e-7)


# On the wire (fake process group, 4 ranks) -----------------------------------------------------

def _reductions(step) -> list[torch.Tensor]:
    """What every reduction of the backward sends (its input)."""
    ops = (c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default)
    return [n.args[0].meta["val"] for gm in step.graphs["backward"] for n in gm.graph.nodes
            if n.op == "call_function" and n.target in ops]


def _bytes(values: list[torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in values)


@pytest.mark.parametrize("gather", [None, "int8"])
def test_lowered_reductions_are_int8_all_to_alls_of_at_most_0_3x_the_bytes(gather):
    """The backward reduces by int8 all-to-alls only (no float reduce-scatter left), as many as
    the float reduce-scatters' buckets, at most 0.3x their bytes; the gathers are untouched, or
    int8 when asked too."""
    plain = _reductions(compile_step("gpt", world_size=4))
    step = compile_step("gpt", world_size=4, compression=autoshard.Compression(gather=gather, reduce="int8"))
    quantized = _reductions(step)
    assert quantized and all(v.dtype == torch.int8 for v in quantized)
    assert plain and all(v.dtype == torch.float32 for v in plain)
    assert _bytes(quantized) <= 0.3 * _bytes(plain), (_bytes(quantized), _bytes(plain))
    assert len(quantized) == len(plain)  # bucketed as the reduce-scatters are: one all-to-all per bucket
    gathers = [n.meta["val"].dtype for gm in step.graphs["forward"] for n in gm.graph.nodes
               if n.op == "call_function" and n.target in (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default)]
    assert gathers and set(gathers) == {torch.int8 if gather else torch.float32}


def test_a_group_of_one_reduces_nothing_and_compresses_nothing():
    step = compile_step("mlp", world_size=1, compression=autoshard.Compression(reduce="int8"))
    assert not [n for gm in step.graphs["backward"] for n in gm.graph.nodes if "quantize" in str(n.target)]


# Refused, with nothing changed -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"reduce": "int4"}, {"reduce": "fp8"}, {"reduce": torch.int8}, {"reduce": True},
                                    {"reduce": "int8", "block": 4}])
def test_bad_reduce_policies_raise_typed_errors(kwargs):
    with pytest.raises(UsageError, match="autoshard.Compression"):
        autoshard.Compression(**kwargs)


def test_replicate_refuses_int8_reductions_and_changes_nothing():
    model = nn.Linear(4, 4)
    with pytest.raises(UsageError, match="reduce-scatters no gradients"):
        autoshard.shard(model, strategy="replicate", compression=autoshard.Compression(reduce="int8"))
    assert not autoshard.is_sharded(model) and type(model) is nn.Linear
