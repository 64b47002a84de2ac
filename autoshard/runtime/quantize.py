"""Block-wise int8 quantization of a shard for its all-gather, and dequantization after it;
the same packing for the chunks of a gradient's quantized reduction (all-to-all).

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

With ``codec="fp8"`` (``Compression(gather="fp8")``) the same layout holds float8 e4m3 values:
each block's scale is its absolute maximum / 448 (e4m3fn's largest finite value) and its values
``(x / scale)`` rounded to ``torch.float8_e4m3fn`` (clamped to +-448), stored as their bytes
(``.view(torch.int8)``), so packing, gathering and bucketing are byte for byte the int8 codec's;
dequantization views the bytes back as e4m3, then ``float32 * scale``. The ops take the codec
as a last argument, ``"int8"`` by default and then left out of the graphs.

A quantized reduction (ZeRO++'s qgZ) packs each of the ``world`` chunks of a padded gradient
(``[world * chunk, ...]``, chunk r: what rank r receives) as above, each on its own
(``autoshard::quantize_chunks``: ``world`` packed chunks, rank after rank), exchanges them with
one all-to-all, and ``autoshard::dequantize_mean`` dequantizes the ``world`` received chunks to
float32, sums them over the source ranks in float32 (rank 0 first) and divides by ``world``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard._compat import new_empty

QMAX = 127
FP8_MAX = 448.0  # torch.float8_e4m3fn's largest finite value
SCALE_BYTES = 4  # float32


def blocks_of(numel: int, block: int) -> int:
    return -(-numel // block)


def packed_numel(numel: int, block: int) -> int:
    """Bytes of the packed form of ``numel`` elements: int8 values, then one float32 scale per block."""
    return numel + SCALE_BYTES * blocks_of(numel, block)


def quantize_rows(x: torch.Tensor, block: int, codec: str = "int8") -> torch.Tensor:
    """Each row of ``x`` (``[rows, n]``) packed on its own as int8 ``[rows, n + 4 * nb]``
    (``codec="fp8"``: the values' bytes are float8 e4m3's)."""
    flat = x.float()  # [rows, n]
    rows, n = flat.shape
    nb = blocks_of(n, block)
    blocks = F.pad(flat, [0, nb * block - n]).view(rows, nb, block)  # [rows, nb, block], the last zero-filled
    scale = blocks.abs().amax(dim=2) / (FP8_MAX if codec == "fp8" else QMAX)  # [rows, nb]
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    if codec == "fp8":  # a block of zeros: scale 0, values 0
        values = (blocks / safe[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.int8)
    else:
        values = torch.round(blocks / safe[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)  # [rows, nb, block]
    return torch.cat([values.view(rows, -1)[:, :n], scale.view(torch.int8)], dim=1)  # [rows, n + 4 * nb]


def quantize(x: torch.Tensor, block: int, codec: str = "int8") -> torch.Tensor:
    """``x`` (any shape, ``n`` elements) packed as int8 ``[n + 4 * nb]``."""
    return quantize_rows(x.reshape(1, -1), block, codec).view(-1)


def dequantize(packed: torch.Tensor, numel: int, block: int, dtype: torch.dtype, codec: str = "int8") -> torch.Tensor:
    """Rows of packed shards, int8 ``[rows, numel + 4 * nb]``, as ``[rows, numel]`` in ``dtype``."""
    rows, nb = packed.shape[0], blocks_of(numel, block)
    raw = packed[:, :numel]
    raw = raw.view(torch.float8_e4m3fn) if codec == "fp8" else raw
    values = F.pad(raw.float(), [0, nb * block - numel]).view(rows, nb, block)  # [rows, nb, block]
    scale = packed[:, numel:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # [rows, nb]
    full = (values * scale[..., None]).view(rows, nb * block)  # [rows, nb * block]
    return full[:, :numel].to(dtype).contiguous()


def quantize_dequantize(x: torch.Tensor, block: int, dtype: torch.dtype | None = None, codec: str = "int8") -> torch.Tensor:
    """What one rank's shard ``x`` looks like after a quantized gather: same shape, ``dtype``
    (default ``x``'s)."""
    out = dequantize(quantize(x, block, codec).view(1, -1), x.numel(), block, dtype or x.dtype, codec)  # [1, n]
    return out.view(x.shape)


@torch.library.custom_op("autoshard::quantize_blocks", mutates_args=())
def quantize_blocks(x: torch.Tensor, block: int, codec: str = "int8") -> torch.Tensor:
    """:func:`quantize`: a shard packed for its gather (1-D int8)."""
    return quantize(x, block, codec)


@quantize_blocks.register_fake
def _(x, block, codec="int8"):
    return new_empty(x, (packed_numel(x.numel(), block),), torch.int8)


@torch.library.custom_op("autoshard::dequantize_blocks", mutates_args=())
def dequantize_blocks(gathered: torch.Tensor, world_size: int, block: int, shape: list[int], dtype: torch.dtype,
                      codec: str = "int8") -> torch.Tensor:
    """The gathered packed shards (1-D int8, ``world_size`` of them, rank after rank) as the
    gathered padded shards, ``[world_size * shape[0], *shape[1:]]`` in ``dtype``."""
    numel = 1
    for s in shape:
        numel *= s
    out = dequantize(gathered.view(world_size, -1), numel, block, dtype, codec)  # [world, numel]
    return out.view(world_size * shape[0], *shape[1:])


@dequantize_blocks.register_fake
def _(gathered, world_size, block, shape, dtype, codec="int8"):
    return new_empty(gathered, (world_size * shape[0], *shape[1:]), dtype)


def quantize_chunks(x: torch.Tensor, world_size: int, block: int) -> torch.Tensor:
    """A padded gradient ``[world_size * chunk, ...]`` as ``world_size`` packed chunks, rank
    after rank (1-D int8, each chunk ``packed_numel(x.numel() // world_size, block)``)."""
    return quantize_rows(x.reshape(world_size, -1), block).view(-1)


def dequantize_mean(received: torch.Tensor, world_size: int, block: int, shape: list[int]) -> torch.Tensor:
    """The ``world_size`` packed chunks one rank received (1-D int8, rank after rank),
    dequantized to float32, summed over the ranks in float32 and divided by ``world_size``:
    this rank's averaged chunk, float32 ``shape``."""
    numel = 1
    for s in shape:
        numel *= s
    chunks = dequantize(received.view(world_size, -1), numel, block, torch.float32)  # [world, numel]
    total = chunks[0].clone()
    for r in range(1, world_size):
        total += chunks[r]
    return total.div_(world_size).view(shape)


@torch.library.custom_op("autoshard::quantize_chunks", mutates_args=())
def quantize_chunks_op(x: torch.Tensor, world_size: int, block: int) -> torch.Tensor:
    """:func:`quantize_chunks`: a padded gradient packed for its all-to-all (1-D int8)."""
    return quantize_chunks(x, world_size, block)


@quantize_chunks_op.register_fake
def _(x, world_size, block):
    return new_empty(x, (world_size * packed_numel(x.numel() // world_size, block),), torch.int8)


@torch.library.custom_op("autoshard::dequantize_mean", mutates_args=())
def dequantize_mean_op(received: torch.Tensor, world_size: int, block: int, shape: list[int]) -> torch.Tensor:
    """:func:`dequantize_mean`: the received chunks as this rank's averaged float32 chunk."""
    return dequantize_mean(received, world_size, block, shape)


@dequantize_mean_op.register_fake
def _(received, world_size, block, shape):
    return new_empty(received, tuple(shape), torch.float32)


QUANTIZE_CHUNKS, DEQUANTIZE_MEAN = torch.ops.autoshard.quantize_chunks.default, torch.ops.autoshard.dequantize_mean.default
QUANTIZE, DEQUANTIZE = torch.ops.autoshard.quantize_blocks.default, torch.ops.autoshard.dequantize_blocks.default
