"""Compression: fewer bytes on the wire for the parameter gathers (ZeRO++'s qwZ) and the
gradient reductions (ZeRO++'s qgZ).

``autoshard.shard(model, compression=Compression(gather="int8", block=256))``: every sharded
floating-point parameter is gathered as int8 values with one float32 scale per ``block``
elements of its (padded, flattened) shard, and dequantized to ``param_dtype`` (or the
parameter's dtype) right after the gather's wait (:mod:`autoshard.runtime.quantize`). The
shards, their gradients and the optimizer state keep their dtype; the gradient flows to the
reduce-scatter as if the dequantized weight were the parameter (straight through).

``Compression(reduce="int8")``: every sharded floating-point parameter's gradient is, instead
of a float reduce-scatter, cut into the chunks each rank would receive, each chunk quantized
alike (block-wise int8, float32 scales, one packed tensor), exchanged by one all-to-all, and
dequantized and averaged in float32 on the receiving rank (:mod:`autoshard.runtime.quantize`).
Lossy, so never a default: ``Compression()`` compresses nothing.

``Compression(gather="fp8")``: as ``"int8"``, the values float8 e4m3 (scale: absmax / 448)
moved as their bytes, so the same bytes on the wire; more range per block, less precision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.runtime.errors import UsageError, UsageTypeError

GATHERS = (None, "int8", "fp8")  # what `gather` takes; None: the parameter's (or param_dtype's) bytes
REDUCES = (None, "int8")  # what `reduce` takes; None: reduce_dtype's (or the gradient's) bytes
MIN_BLOCK = 8  # below this, the scales (4 bytes per block) outweigh what int8 saves


@dataclass(frozen=True)
class Compression:
    """``autoshard.shard(model, compression=Compression(gather="int8", reduce="int8", block=256))``.

    gather: ``"int8"``: parameters are gathered as int8 with block-wise absmax scales
        (float32, sent in the same collective), dequantized after the gather; ``"fp8"``: the
        same with float8 e4m3 values (scale absmax / 448; needs ``torch.float8_e4m3fn``);
        None: as today (``param_dtype``, or the parameter's dtype).
    reduce: ``"int8"``: gradients are reduced by an all-to-all of int8 chunks (one per
        destination rank, quantized block-wise like a gather's shard), dequantized and
        averaged in float32 on the receiving rank; None: as today (a reduce-scatter in
        ``reduce_dtype``).
    block: elements per scale, along each rank's flattened shard (the last block of a shard
        may be short; blocks never cross shards). A whole number >= 8; 256 moves
        (1 + 4/256) bytes per element, 0.254x float32. Gathers and reductions share it.
    """

    gather: str | None = None
    block: int = 256
    reduce: str | None = None

    def __post_init__(self) -> None:
        if self.gather not in GATHERS:
            raise UsageError(f"autoshard.Compression: gather must be one of {GATHERS}, got {self.gather!r}; "
                             "pass gather='int8' (or 'fp8') to gather 8-bit weights, or None to gather them uncompressed.")
        if self.gather == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            raise UsageError(f"autoshard.Compression: gather='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} "
                             "does not have; pass gather='int8', or use a torch release with float8 dtypes.")
        if self.reduce not in REDUCES:
            raise UsageError(f"autoshard.Compression: reduce must be one of {REDUCES}, got {self.reduce!r}; "
                             "pass reduce='int8' to reduce int8 gradients, or None to reduce them uncompressed "
                             "(float8 is offered for gathers only: gather='fp8').")
        if isinstance(self.block, bool) or not isinstance(self.block, int):
            raise UsageTypeError(f"autoshard.Compression: block must be a whole number of elements, got {self.block!r}; "
                                 "pass e.g. block=256.")
        if self.block < MIN_BLOCK:
            raise UsageError(f"autoshard.Compression: block must be >= {MIN_BLOCK} elements (each block sends a 4-byte "
                             f"scale), got {self.block}; pass e.g. block=256.")

    @property
    def gather_block(self) -> int:
        """Elements per scale of a quantized gather; 0: gathers are not quantized."""
        return self.block if self.gather is not None else 0

    @property
    def reduce_block(self) -> int:
        """Elements per scale of a quantized reduction; 0: reductions are not quantized."""
        return self.block if self.reduce == "int8" else 0


def gather_block_for(param: torch.Tensor, policy: Compression | None) -> int:
    """The block size one parameter is gathered with (0: not quantized): floating-point
    parameters only, as mixed precision casts only those."""
    if policy is None or not param.is_floating_point():
        return 0
    return policy.gather_block


def reduce_block_for(param: torch.Tensor, policy: Compression | None) -> int:
    """The block size one parameter's gradient is reduced with (0: not quantized):
    floating-point parameters only."""
    if policy is None or not param.is_floating_point():
        return 0
    return policy.reduce_block


def check_compression(compression: object, strategy: str) -> None:
    """Refuse a compression policy that is not one, or that the strategy has no gather or
    reduce-scatter for."""
    if compression is None:
        return
    if not isinstance(compression, Compression):
        raise UsageError(f"autoshard.shard: compression must be an autoshard.Compression, got {type(compression).__name__}; "
                         "pass e.g. compression=autoshard.Compression(gather='int8').")
    if (compression.gather is not None or compression.reduce is not None) and strategy == "replicate":
        raise UsageError(f"autoshard.shard: strategy='replicate' gathers no parameters and reduce-scatters no gradients, so "
                         f"{compression!r} would change nothing; use strategy='full', 'grad_op' or 'hybrid', or drop compression.")
