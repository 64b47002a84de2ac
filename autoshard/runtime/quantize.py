"""Block-wise int8 quantization of a shard for its all-gather, and dequantization after it.

A shard of ``n`` elements (flattened, padded rows included) is cut into ``nb = ceil(n / block)``
blocks of ``block`` elements (the last one may be short); each block's scale is its absolute
maximum / 127 (float32) and its values ``round(x / scale)`` (half to even) as int8 in
[-127, 127]. The packed shard is one int8 tensor, the ``n`` values then the scales' bytes,
``n + 4 * nb`` bytes, so a bucket gathers values and scales in one collective. After the
gather, each rank's row is dequantized as ``int8 -> float32 * scale`` and cast to the dtype the
model computes in. A block of zeros has scale 0 and dequantizes to zeros.

Both are opaque ops (``autoshard::quantize_blocks``, ``autoshard::dequantize_blocks``): the
lowering puts them around the gather, and every inner compiler runs these very kernels, so a
compiled step dequantizes exactly as the eager op and :func:`quantize_dequantize` do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard._compat import new_empty

QMAX = 127
SCALE_BYTES = 4  # float32


def blocks_of(numel: int, block: int) -> int:
    return -(-numel // block)


def packed_numel(numel: int, block: int) -> int:
    """Bytes of the packed form of ``numel`` elements: int8 values, then one float32 scale per block."""
    return numel + SCALE_BYTES * blocks_of(numel, block)


def quantize(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (any shape, ``n`` elements) packed as int8 ``[n + 4 * nb]``."""
    flat = x.reshape(-1).float()  # [n]
    n = flat.numel()
    nb = blocks_of(n, block)
    blocks = F.pad(flat, [0, nb * block - n]).view(nb, block)  # [nb, block], the last zero-filled
    scale = blocks.abs().amax(dim=1) / QMAX  # [nb]
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    values = torch.round(blocks / safe[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)  # [nb, block]
    return torch.cat([values.view(-1)[:n], scale.view(torch.int8)])  # [n + 4 * nb]


def dequantize(packed: torch.Tensor, numel: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of packed shards, int8 ``[rows, numel + 4 * nb]``, as ``[rows, numel]`` in ``dtype``."""
    rows, nb = packed.shape[0], blocks_of(numel, block)
    values = F.pad(packed[:, :numel].float(), [0, nb * block - numel]).view(rows, nb, block)  # [rows, nb, block]
    scale = packed[:, numel:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # [rows, nb]
    full = (values * scale[..., None]).view(rows, nb * block)  # [rows, nb * block]
    return full[:, :numel].to(dtype).contiguous()


def quantize_dequantize(x: torch.Tensor, block: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What one rank's shard ``x`` looks like after a quantized gather: same shape, ``dtype``
    (default ``x``'s)."""
    out = dequantize(quantize(x, block).view(1, -1), x.numel(), block, dtype or x.dtype)  # [1, n]
    return out.view(x.shape)


@torch.library.custom_op("autoshard::quantize_blocks", mutates_args=())
def quantize_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """:func:`quantize`: a shard packed for its gather (1-D int8)."""
    return quantize(x, block)


@quantize_blocks.register_fake
def _(x, block):
    return new_empty(x, (packed_numel(x.numel(), block),), torch.int8)


@torch.library.custom_op("autoshard::dequantize_blocks", mutates_args=())
def dequantize_blocks(gathered: torch.Tensor, world_size: int, block: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The gathered packed shards (1-D int8, ``world_size`` of them, rank after rank) as the
    gathered padded shards, ``[world_size * shape[0], *shape[1:]]`` in ``dtype``."""
    numel = 1
    for s in shape:
        numel *= s
    out = dequantize(gathered.view(world_size, -1), numel, block, dtype)  # [world, numel]
    return out.view(world_size * shape[0], *shape[1:])


@dequantize_blocks.register_fake
def _(gathered, world_size, block, shape, dtype):
    return new_empty(gathered, (world_size * shape[0], *shape[1:]), dtype)


QUANTIZE, DEQUANTIZE = torch.ops.autoshard.quantize_blocks.default, torch.ops.autoshard.dequantize_blocks.default
