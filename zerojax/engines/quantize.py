"""ZeRO++'s quantized collectives for the `shard_map` engine, per device (inside the shard_map).

qwZ  `gather`: a stage-3 weight shard is block-quantized (symmetric absmax, one fp32 scale per block
     of `block` elements) and all-gathered as int8 (or fp8) codes plus scales, then dequantized to
     the compute dtype: (1 + 4/block) bytes per element cross the wire instead of 2 (bf16).
qgZ  `reduce_scatter`: a gradient's reduce-scatter becomes quantize -> all-to-all -> dequantize and
     sum in fp32: each device cuts its local gradient into one chunk per fsdp device, quantizes
     every chunk, and the all-to-all hands device j the j-th chunk of every device, which it
     dequantizes and sums in fp32 (its own shard). An all-to-all sends (p-1)/p of its result, as a
     ring reduce-scatter sends (p-1)/p of the whole gradient, so int8 halves the bf16 bytes.

A leaf whose shard (qwZ) or chunk (qgZ) holds fewer elements than one block keeps the plain
collective: its scale would cost more than the codes save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from zerojax.core.leaf_rule import LeafLayout, join_shards
from zerojax.core.mesh import FSDP_AXIS
from zerojax.errors import UserError

# code dtype, largest code, whether the codes are rounded to integers
_KINDS = {"int8": (jnp.int8, 127.0, True), "fp8": (jnp.float8_e4m3fn, 448.0, False)}


@dataclass(frozen=True)
class Quantizer:
    kind: str  # "int8" or "fp8"
    block: int = 256  # elements per scale

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise UserError(f"quantization must be one of {', '.join(_KINDS)}, got {self.kind!r}.")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise UserError(f"zero.quantize_block must be a positive integer, got {self.block!r}.")

    def applies(self, n: int) -> bool:
        """Whether a piece of n elements is quantized (at least one whole block)."""
        return n >= self.block

    def quantize(self, x):
        """(..., n) -> codes (..., n_blocks, block) and fp32 scales (..., n_blocks); the last block
        is zero-padded."""
        dtype, qmax, integer = _KINDS[self.kind]
        n = x.shape[-1]
        blocks = math.ceil(n / self.block)
        x = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, blocks * self.block - n)])
        x = x.reshape(*x.shape[:-1], blocks, self.block)
        scale = jnp.max(jnp.abs(x), axis=-1) / qmax
        y = x / jnp.where(scale > 0, scale, 1.0)[..., None]
        y = jnp.clip(jnp.round(y), -qmax, qmax) if integer else y
        return y.astype(dtype), scale

    def dequantize(self, codes, scale, n: int):
        """codes (..., n_blocks, block), scales (..., n_blocks) -> fp32 (..., n)."""
        x = codes.astype(jnp.float32) * scale[..., None]
        return x.reshape(*x.shape[:-2], -1)[..., :n]


def _all_gather(x):
    """`all_gather(x, fsdp)` stacked on a new axis 0, fp8 codes moved as their bits."""
    if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = jax.lax.all_gather(jax.lax.bitcast_convert_type(x, jnp.uint8), FSDP_AXIS)
        return jax.lax.bitcast_convert_type(bits, x.dtype)
    return jax.lax.all_gather(x, FSDP_AXIS)


def _all_to_all(x):
    """Row j of every device's x (axis 0, one row per fsdp device) to device j, stacked by source."""
    if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = jax.lax.all_to_all(jax.lax.bitcast_convert_type(x, jnp.uint8), FSDP_AXIS, 0, 0)
        return jax.lax.bitcast_convert_type(bits, x.dtype)
    return jax.lax.all_to_all(x, FSDP_AXIS, 0, 0)


def gather(shard, leaf: LeafLayout, quant: Quantizer, dtype):
    """qwZ: this device's shard of `leaf` (split on `leaf.axis`) -> the whole leaf in `dtype`, the
    gather moving block-quantized codes and their scales."""
    codes, scale = quant.quantize(shard.reshape(1, -1))
    codes, scale = _all_gather(codes[0]), _all_gather(scale[0])  # (fsdp, blocks, block), (fsdp, blocks)
    return join_shards(quant.dequantize(codes, scale, shard.size).astype(dtype), leaf)


def reduce_scatter(ct, leaf: LeafLayout, quant: Quantizer):
    """qgZ: this device's local gradient of `leaf` (padded shape) -> its shard of the sum over the
    fsdp devices, in fp32: quantize each device's chunk, all-to-all, dequantize and sum."""
    fsdp = jax.lax.axis_size(FSDP_AXIS)
    chunks = jnp.moveaxis(ct, leaf.axis, 0)  # type: ignore[arg-type]
    shard_shape = (chunks.shape[0] // fsdp, *chunks.shape[1:])
    chunks = chunks.reshape(fsdp, -1)  # row j: the elements of device j's shard
    codes, scale = quant.quantize(chunks)
    codes, scale = _all_to_all(codes), _all_to_all(scale)  # row i: device i's chunk for this device
    total = jnp.sum(quant.dequantize(codes, scale, chunks.shape[1]), axis=0)
    return jnp.moveaxis(total.reshape(shard_shape), 0, leaf.axis)  # type: ignore[arg-type]


def chunk_size(leaf: LeafLayout, fsdp: int) -> int:
    """Elements of one device's shard of a sharded leaf."""
    return math.prod(leaf.padded_shape) // fsdp
