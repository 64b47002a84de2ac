"""Quantized gathers (autoshard.Compression(gather="int8") and "fp8"): exact against a single
process whose weights are quantized the same way, int8 bytes on the wire, and refused when asked
wrongly."""
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
from autoshard.runtime.errors import UsageError, UsageTypeError
from autoshard.runtime.state_shares import split_rows
from autoshard.tools.launch import run_ranks

from fake_pg import compile_step
from models import GLOBAL_BATCH, batch, build

BLOCK = 24  # blocks that cross rows and end short, so the layout is tested, not only the arithmetic
TOL = 1e-6
STEPS = 3


def even_rows(dim0: int, world: int) -> list[int]:
    """Each rank's rows under ``Shard(0)`` (``torch.chunk``'s: ``ceil(dim0 / world)`` but at the tail)."""
    chunk = -(-dim0 // world)
    return [max(0, min(chunk, dim0 - r * chunk)) for r in range(world)]


def block_qdq(x: torch.Tensor, codec: str) -> torch.Tensor:
    """One block after quantization and dequantization. int8: scale = max |x| / 127 and
    x -> round(x / scale) as int8, times scale. fp8: scale = max |x| / 448 and x -> x / scale
    (within +-448) as float8 e4m3, times scale. A block of zeros stays zeros."""
    scale = x.abs().max() / (448 if codec == "fp8" else 127)
    if scale == 0:
        return torch.zeros_like(x)
    if codec == "fp8":
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8).float() * scale


def reference_qdq(full: torch.Tensor, rows: list[int], block: int, codec: str = "int8") -> torch.Tensor:
    """``full`` as every rank sees it after an int8 (or fp8) gather, written plainly: each rank's
    rows (``rows[r]`` of them, padded with zero rows to ``max(rows)``) flattened and cut into
    blocks of ``block`` elements (the last one short), each as :func:`block_qdq` leaves it."""
    widest, start, ranks = max(rows), 0, []
    for n in rows:
        mine = torch.cat([full[start:start + n], full.new_zeros(widest - n, *full.shape[1:])])
        start += n
        pieces = [block_qdq(x, codec) for x in mine.reshape(-1).split(block)]
        ranks.append(torch.cat(pieces).view(widest, *full.shape[1:])[:n])
    return torch.cat(ranks)


SHARES = (Fraction(3, 4), Fraction(1, 4))
# How each layout shards, and each parameter's rows per rank of the group it is gathered in.
LAYOUTS = {
    "even": (lambda world: {}, lambda dim0, world: even_rows(dim0, world)),
    "hybrid": (lambda world: {"mesh": init_device_mesh("cpu", (2, world // 2)), "strategy": "hybrid"},
               lambda dim0, world: even_rows(dim0, world // 2)),
    "shares": (lambda world: {"state_shares": [3, 1]}, lambda dim0, world: list(split_rows(dim0, SHARES))),
}


def _parity(name: str, mode: str, layout: str, codec: str = "int8") -> tuple[float, float]:
    """On each rank: train ``name`` sharded (``LAYOUTS[layout]``) with ``codec`` gathers on this
    rank's slice, and, each step, a single-process copy on the whole batch whose weights are
    the sharded model's, quantized by :func:`reference_qdq`; the largest loss and gradient
    differences."""
    # Each case compiles afresh: Dynamo would otherwise recompile the earlier case's code for this
    # one's shapes, marking dimensions dynamic on the ranks whose shapes changed only (torch 2.11).
    torch._dynamo.reset()
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build(name)
    reference = copy.deepcopy(model)
    shard_kwargs, rows_of = LAYOUTS[layout]
    autoshard.shard(model, compression=autoshard.Compression(gather=codec, block=BLOCK), **shard_kwargs(world))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = model if mode == "uncompiled" else torch.compile(model, backend="autoshard", options={"compiler": mode})
    per_rank = GLOBAL_BATCH // world
    loss_error = grad_error = 0.0
    for step in range(STEPS):
        x, y = batch(name, step)
        loss = run(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        with torch.no_grad():  # the weights every rank computed with
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                full = autoshard.full_tensor(p)
                q.copy_(reference_qdq(full, rows_of(full.shape[0], world), BLOCK, codec) if full.dim() > 0 else full)
        reference.zero_grad()
        expected = reference(x, y)
        expected.backward()
        loss_error = max(loss_error, abs(total.item() / world - expected.item()))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            grad_error = max(grad_error, (autoshard.full_tensor(p.grad) - q.grad).abs().max().item())
        optimizer.step()
        optimizer.zero_grad()
    return loss_error, grad_error


def _all(configs: list[tuple]) -> dict[tuple, tuple[float, float]]:
    return {config: _parity(*config) for config in configs}


# Padded shards (uneven), 1-d and 0-d parameters, a tied weight (gpt), uneven state shares, and
# hybrid sharding, whose gathers run in a group of half the ranks; fp8 gathers (a 4th element).
PARITY = {2: [(m, mode, "even") for m in ("gpt", "uneven") for mode in ("uncompiled", "aot_eager")]
          + [("uneven", "aot_eager", "shares"), ("gpt", "aot_eager", "even", "fp8")],
          4: [("gpt", "aot_eager", "even"), ("uneven", "aot_eager", "even"), ("gpt", "aot_eager", "hybrid")]}


@functools.cache
def _errors(world_size: int) -> list[dict]:
    return run_ranks(world_size, _all, PARITY[world_size])


@pytest.mark.multirank
# 4 ranks (hybrid's compile included) take ~40 s on 2 cores: the slow tier, as the repo's other 4-rank launches.
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_int8_gathers_match_one_process_with_the_same_quantized_weights(world_size):
    for errors in _errors(world_size):
        bad = {config: e for config, e in errors.items() if max(e) > TOL}
        assert not bad, f"(loss error, gradient error) above {TOL}: {bad}"


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.inductor
def test_int8_gathers_match_under_inductor():
    for errors in run_ranks(2, _all, [("mlp", "inductor", "even"), ("mlp", "inductor", "even", "fp8")]):
        bad = {config: e for config, e in errors.items() if max(e) > TOL}
        assert not bad, f"(loss error, gradient error) above {TOL}: {bad}"


def test_the_packed_shard_round_trips_as_the_reference_quantizes():
    """The one function behind every quantized gather, against the plain reference on one rank."""
    from autoshard.runtime.quantize import packed_numel, quantize, quantize_dequantize

    torch.manual_seed(0)
    x = torch.randn(7, 5) * torch.tensor([1.0, 10.0, 0.0, 1e-3, 3.0])  # a zero column: some blocks all zero
    x[3] = 0.0
    assert quantize(x, 8).dtype == torch.int8 and quantize(x, 8).numel() == packed_numel(35, 8) == 35 + 4 * 5
    assert torch.equal(quantize_dequantize(x, 8), reference_qdq(x, [7], 8))
    assert (quantize_dequantize(x, 8) - x).abs().max() <= x.abs().max() / 127 / 2 * 1.0001


def test_the_packed_fp8_shard_round_trips_as_the_reference_quantizes():
    """fp8: the same bytes as int8, the reference's values exactly, NaN-free on a block of zeros
    and values far beyond 448, and each element within e4m3's rounding: 2^-4 relative (3
    mantissa bits), or 2^-10 of its block's scale where x / scale is subnormal (< 2^-6)."""
    from autoshard.runtime.quantize import packed_numel, quantize, quantize_dequantize

    torch.manual_seed(0)
    x = torch.randn(7, 5) * torch.tensor([1.0, 1e4, 0.0, 1e-3, 3.0])  # |x| up to ~3e4: beyond 448 before scaling
    x.view(-1)[16:24] = 0.0  # the third block all zeros
    x[5, 2] = 1e-6  # a subnormal after scaling, next to large values
    packed = quantize(x, 8, "fp8")
    assert packed.dtype == torch.int8 and packed.numel() == packed_numel(35, 8) == quantize(x, 8).numel()
    out = quantize_dequantize(x, 8, codec="fp8")
    assert torch.equal(out, reference_qdq(x, [7], 8, "fp8")) and not out.isnan().any()
    assert torch.equal(out.view(-1)[16:24], torch.zeros(8))
    scales = torch.stack([b.abs().max() / 448 for b in x.reshape(-1).split(8)]).repeat_interleave(8)[:35].view(7, 5)
    bound = torch.maximum(x.abs() * 2 ** -4, scales * 2 ** -10) * (1 + 1e-6)
    assert ((out - x).abs() <= bound).all(), ((out - x).abs() - bound).max()


# On the wire (fake process group, 4 ranks) -----------------------------------------------------

def _gathers(step) -> list[torch.Tensor]:
    gathers = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default)
    return [n.meta["val"] for side in ("forward", "backward") for gm in step.graphs[side]
            for n in gm.graph.nodes if n.op == "call_function" and n.target in gathers]


def _bytes(values: list[torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in values)


@pytest.mark.parametrize("mixed_precision", [None, autoshard.MixedPrecision(param_dtype=torch.bfloat16)])
def test_lowered_gathers_move_int8_and_at_most_0_3x_the_bytes(mixed_precision):
    """Every gather of the compiled step moves int8 (values and scales in one collective per
    bucket) and the step gathers at most 0.3x the float32 bytes; the model still computes in
    ``param_dtype``."""
    plain = _gathers(compile_step("gpt", world_size=4))
    step = compile_step("gpt", world_size=4, mixed_precision=mixed_precision, compression=autoshard.Compression(gather="int8"))
    quantized = _gathers(step)
    assert quantized and all(v.dtype == torch.int8 for v in quantized)
    assert _bytes(quantized) <= 0.3 * _bytes(plain), (_bytes(quantized), _bytes(plain))
    dequantized = [n for n in step.forward.graph.nodes if n.target is torch.ops.autoshard.dequantize_blocks.default]
    assert dequantized and {n.meta["val"].dtype for n in dequantized} == {mixed_precision.param_dtype if mixed_precision
                                                                          else torch.float32}


def test_fp8_gathers_move_the_same_bytes_as_int8_and_int8_graphs_are_unchanged():
    """fp8 gathers move int8 bytes, as many as int8's; only their quantize and dequantize ops
    name the codec (int8's calls carry no codec argument: their graphs as before fp8)."""
    ops = (torch.ops.autoshard.quantize_blocks.default, torch.ops.autoshard.dequantize_blocks.default)

    def codec_args(step) -> set:
        return {n.args[-1] if isinstance(n.args[-1], str) else None for side in ("forward", "backward")
                for gm in step.graphs[side] for n in gm.graph.nodes if n.target in ops}

    int8 = compile_step("gpt", world_size=4, compression=autoshard.Compression(gather="int8"))
    fp8 = compile_step("gpt", world_size=4, compression=autoshard.Compression(gather="fp8"))
    assert all(v.dtype == torch.int8 for v in _gathers(fp8)) and _bytes(_gathers(fp8)) == _bytes(_gathers(int8)) > 0
    assert codec_args(int8) == {None} and codec_args(fp8) == {"fp8"}


def test_compression_is_off_by_default_and_a_group_of_one_gathers_as_it_is():
    assert autoshard.Compression().gather is None
    step = compile_step("mlp", world_size=1, compression=autoshard.Compression(gather="int8"))
    assert not [n for n in step.forward.graph.nodes if "quantize_blocks" in str(n.target)]


# Refused, with nothing changed -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error", [
    ({"gather": "int4"}, UsageError), ({"gather": "fp4"}, UsageError), ({"gather": torch.int8}, UsageError),
    ({"reduce": "fp8"}, UsageError), ({"gather": "fp8", "reduce": "fp8"}, UsageError),
    ({"gather": "int8", "block": 4}, UsageError), ({"gather": "int8", "block": 0}, UsageError),
    ({"gather": "int8", "block": 256.0}, UsageTypeError), ({"gather": "int8", "block": True}, UsageTypeError),
])
def test_bad_policies_raise_typed_errors(kwargs, error):
    with pytest.raises(error, match="autoshard.Compression"):
        autoshard.Compression(**kwargs)


def test_fp8_gathers_are_refused_where_torch_has_no_float8(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(UsageError, match=r"autoshard.Compression: gather='fp8' needs torch.float8_e4m3fn"):
        autoshard.Compression(gather="fp8")
    assert autoshard.Compression(gather="int8").gather_block == 256


@pytest.mark.parametrize("shard_kwargs, message", [
    ({"compression": "int8"}, "must be an autoshard.Compression"),
    ({"compression": {"gather": "int8"}}, "must be an autoshard.Compression"),
    ({"compression": autoshard.Compression(gather="int8"), "strategy": "replicate"}, "gathers no parameters"),
])
def test_shard_refuses_a_bad_compression_and_changes_nothing(shard_kwargs, message):
    model = nn.Linear(4, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UsageError, match=message):
        autoshard.shard(model, **shard_kwargs)
    assert not autoshard.is_sharded(model) and type(model) is nn.Linear
    assert all(torch.equal(p, before[n]) and type(p) is nn.Parameter for n, p in model.named_parameters())
