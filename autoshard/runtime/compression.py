"""Compression: fewer bytes on the wire for the parameter gathers (ZeRO++'s qwZ).

``autoshard.shard(model, compression=Compression(gather="int8", block=256))``: every sharded
floating-point parameter is gathered as int8 values with one float32 scale per ``block``
elements of its (padded, flattened) shard, and dequantized to ``param_dtype`` (or the
parameter's dtype) right after the gather's wait (:mod:`autoshard.runtime.quantize`). The
shards, their gradients and the optimizer state keep their dtype; the gradient flows to the
reduce-scatter as if the dequantized weight were the parameter (straight through). Lossy, so
never a default: ``Compression()`` compresses nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.runtime.errors import UsageError, UsageTypeError

GATHERS = (None, "int8")  # what `gather` takes; None: the parameter's (or param_dtype's) bytes
MIN_BLOCK = 8  # below this, the scales (4 bytes per block) outweigh what int8 saves


@dataclass(frozen=True)
class Compression:
    """``autoshard.shard(model, compression=Compression(gather="int8", block=256))``.

    gather: ``"int8"``: parameters are gathered as int8 with block-wise absmax scales
        (float32, sent in the same collective), dequantized after the gather; None: as today
        (``param_dtype``, or the parameter's dtype).
    block: elements per scale, along each rank's flattened shard (the last block of a shard
        may be short; blocks never cross shards). A whole number >= 8; 256 moves
        (1 + 4/256) bytes per element, 0.254x float32.
    """

    gather: str | None = None
    block: int = 256

    def __post_init__(self) -> None:
        if self.gather not in GATHERS:
            raise UsageError(f"autoshard.Compression: gather must be one of {GATHERS}, got {self.gather!r}; "
                             "pass gather='int8' to gather int8 weights, or None to gather them uncompressed.")
        if isinstance(self.block, bool) or not isinstance(self.block, int):
            raise UsageTypeError(f"autoshard.Compression: block must be a whole number of elements, got {self.block!r}; "
                                 "pass e.g. block=256.")
        if self.block < MIN_BLOCK:
            raise UsageError(f"autoshard.Compression: block must be >= {MIN_BLOCK} elements (each block sends a 4-byte "
                             f"scale), got {self.block}; pass e.g. block=256.")

    @property
    def gather_block(self) -> int:
        """Elements per scale of a quantized gather; 0: gathers are not quantized."""
        return self.block if self.gather == "int8" else 0


def gather_block_for(param: torch.Tensor, policy: Compression | None) -> int:
    """The block size one parameter is gathered with (0: not quantized): floating-point
    parameters only, as mixed precision casts only those."""
    if policy is None or not param.is_floating_point():
        return 0
    return policy.gather_block
