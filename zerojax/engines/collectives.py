"""How the `shard_map` engine moves one leaf between its shard and its whole form, per device.

`Reduce` gathers a leaf (cast first, so the gather moves compute-dtype bytes), reduce-scatters or
all-reduces its gradient in the reduce dtype, summing over the pure-replica batch axes too
(hybrid sharding); `Resident` is stage 2's view of a leaf. With ZeRO++'s qwZ / qgZ the stage-3
gathers and the reduce-scatters over fsdp move block-quantized values (`zerojax.engines.quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zerojax.engines import quantize
from zerojax.stages import FSDP_AXIS, LeafLayout, fit_to


class Resident(NamedTuple):
    """Stage 2's view of a leaf: the replicated compute copy the forward reads, and a shard-shaped
    zero whose gradient receives this device's reduce-scattered part of the leaf's gradient."""

    full: jax.Array
    shard: jax.Array


def gather_bits(x, axis: int, name: str = FSDP_AXIS):
    """`all_gather(x, name, tiled)` moving a sub-32-bit float's bits as unsigned integers.

    A gather only copies bits, so this is exact on every backend; XLA:CPU runs floating-point
    collectives below 32 bits in f32 (`float-normalization-bf16`), which doubled the bytes it moved
    and left an f32 copy of every gathered leaf in temp memory (stage 1-2's post-update gather was
    stage 2's peak on jax 0.12)."""
    if not (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4):
        return jax.lax.all_gather(x, name, axis=axis, tiled=True)
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return jax.lax.bitcast_convert_type(jax.lax.all_gather(bits, name, axis=axis, tiled=True), x.dtype)


@dataclass(frozen=True)
class Reduce:
    replicas: tuple[str, ...]  # batch axes besides fsdp with size > 1: pure replicas (hybrid sharding)
    compute_dtype: Any
    reduce_dtype: Any
    master_dtype: Any
    weights: quantize.Quantizer | None = None  # qwZ: stage-3 gathers move block-quantized weights
    grads: quantize.Quantizer | None = None  # qgZ: reduce-scatters become quantized all-to-alls
    # hpZ: stage-3 shards are split over fsdp x data; `refresh` gathers them over data into the
    # secondary copy the layers gather over fsdp, and reduce-scatters its gradient over data
    hierarchical: bool = False

    def to_shard(self, ct, leaf: LeafLayout):
        """A leaf's local gradient -> this device's shard of the sum over all devices."""
        if leaf.axis is None:  # replicated in every group: every device keeps the whole sum
            return jax.lax.psum(ct.astype(self.reduce_dtype), (FSDP_AXIS, *self.replicas))
        ct = fit_to(ct, leaf.padded_shape)
        if self.grads is not None and self.grads.applies(quantize.chunk_size(leaf, jax.lax.axis_size(FSDP_AXIS))):
            ct = quantize.reduce_scatter(ct, leaf, self.grads).astype(self.reduce_dtype)  # summed in fp32
        else:
            ct = jax.lax.psum_scatter(ct.astype(self.reduce_dtype), FSDP_AXIS, scatter_dimension=leaf.axis,
                                      tiled=True)
        return jax.lax.psum(ct, self.replicas) if self.replicas and not self.hierarchical else ct

    def to_all(self, ct):
        return jax.lax.psum(ct.astype(self.reduce_dtype), (FSDP_AXIS, *self.replicas))

    def cast_gather(self, shard, leaf: LeafLayout):
        x = shard.astype(self.compute_dtype)  # cast first, so the gather moves compute-dtype bytes
        if leaf.axis is not None:
            x = gather_bits(x, leaf.axis)
        return fit_to(x, leaf.shape)

    def shard_gather(self, shard, leaf: LeafLayout):
        """Stage 3's gather of a leaf: block-quantized with qwZ (where its shard fills a block)."""
        if self.weights is not None and leaf.axis is not None and self.weights.applies(shard.size):
            return quantize.gather(shard, leaf, self.weights, self.compute_dtype)
        return self.cast_gather(shard, leaf)

    def gather(self, leaf: LeafLayout, dtype=None):
        """Stage 3: fp32 shard (hpZ: the compute-dtype secondary shard) -> whole compute-dtype leaf;
        backward: reduce-scatter of its gradient, in `dtype` (the shard's; default the master
        dtype), straight through qwZ's quantization."""
        gather = lambda shard: self.shard_gather(shard, leaf)  # noqa: E731
        dtype = self.master_dtype if dtype is None else dtype
        # The transpose JAX derives for a tiled all_gather is this psum_scatter; it is written out
        # so that it runs in the reduce dtype and also sums over the replica axes.
        f = jax.custom_vjp(gather)
        f.defvjp(lambda s: (gather(s), None), lambda _, ct: (self.to_shard(ct, leaf).astype(dtype),))
        return f

    def refresh(self, leaf: LeafLayout, shard):
        """hpZ, once per step: this device's fp32 primary shard (split over fsdp x data) -> its
        compute-dtype secondary shard (split over fsdp only), gathered over data; backward: the
        gradient reduce-scattered over data in the reduce dtype, into the primary shard."""
        if leaf.axis is None:
            return shard

        def fwd(s):
            return gather_bits(s.astype(self.compute_dtype), leaf.axis, "data")

        def bwd(_, ct):
            ct = jax.lax.psum_scatter(ct.astype(self.reduce_dtype), "data", scatter_dimension=leaf.axis, tiled=True)
            return (ct.astype(self.master_dtype),)

        f = jax.custom_vjp(fwd)
        f.defvjp(lambda s: (fwd(s), None), bwd)
        return f(shard)

    def resident(self, leaf: LeafLayout):
        """Stage 2: the forward reads the resident copy; backward: reduce-scatter into the shard."""
        f = jax.custom_vjp(lambda full, shard: full)
        f.defvjp(lambda full, shard: (full, None), lambda _, ct: (None, self.to_shard(ct, leaf)))
        return f

    def materializer(self, stage: int):
        if stage == 3:
            return lambda leaf, x: self.gather(leaf, x.dtype)(x)
        if stage == 2:
            return lambda leaf, x: self.resident(leaf)(x.full, x.shard)
        return lambda leaf, x: x
