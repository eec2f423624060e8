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

from zerojax.adapt.ordering import held_on_cpu
from zerojax.core.leaf_rule import LeafLayout, fit_to, join_shards
from zerojax.core.mesh import FSDP_AXIS, PIPELINE_AXIS
from zerojax.core.stages import Stage
from zerojax.engines import quantize


def keep_tensor_split(value, leaf: LeafLayout):
    """A whole (over the manual axes) leaf, still split over the automatic `tensor` axis: the
    partitioner then splits the matmuls that read it (Megatron) instead of gathering it."""
    if leaf.tensor_axis is None:
        return value
    sharding = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), leaf.spec(False))
    return jax.lax.with_sharding_constraint(value, sharding)


class Resident(NamedTuple):
    """Stage 2's view of a leaf: the replicated compute copy the forward reads, and a shard-shaped
    zero whose gradient receives this device's reduce-scattered part of the leaf's gradient."""

    full: jax.Array
    shard: jax.Array


class Secondary(NamedTuple):
    """hpZ's view of a sharded leaf: the compute-dtype secondary shard (split over fsdp; its bits
    when narrower than 32) that the layers gather, and the fp32 primary shard (split over
    fsdp x data) that receives the gradient."""

    copy: jax.Array
    primary: jax.Array

    def tied(self, token):
        """The copy plus the exact zero `token` (`zerojax.adapt.ordering.tie`), computed after `token` exists."""
        return self._replace(copy=self.copy + token.astype(self.copy.dtype))


def _narrow_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


def to_bits(x):
    """A sub-32-bit float's bits as unsigned integers (other arrays unchanged)."""
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")) if _narrow_float(x.dtype) else x


def from_bits(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype) if _narrow_float(dtype) else x


def gather_bits(x, axis: int, name: str = FSDP_AXIS):
    """`all_gather(x, name, tiled)` moving a sub-32-bit float's bits as unsigned integers.

    A gather only copies bits, so this is exact on every backend; XLA:CPU runs floating-point
    collectives below 32 bits in f32 (`float-normalization-bf16`), which doubled the bytes it moved
    and left an f32 copy of every gathered leaf in temp memory (stage 1-2's post-update gather was
    stage 2's peak on jax 0.12)."""
    return from_bits(jax.lax.all_gather(to_bits(x), name, axis=axis, tiled=True), x.dtype)


def _transposed(reduce, ct, axis: int):
    """`reduce(ct, axis)`, a 2-D gradient reduced as its transpose and transposed back.

    JAX differentiates `x @ w` into a weight-gradient dot followed by a transpose. With nothing
    between that transpose and the reduction, XLA's algebraic simplifier folds it into the dot
    (`lhs_contracting_dims={0}`), a form jaxlib 0.12's CPU backend keeps out of its YNNPACK fusions
    (several times slower; `gspmd`'s partitioner puts an all-reduce between the two). Reducing the
    transpose cancels JAX's: the dot keeps its canonical form, and the one transpose left runs on the
    reduced result (a shard, from stage 1 on). The same bytes move; the
    sums are the same, and bf16 results move by rounding (XLA computes the dot another way).
    Only on CPU, where it was measured; GPU and TPU compile these dots with their own libraries.
    """
    if not _reduced_transposed(ct.ndim):
        return reduce(ct, axis)
    return reduce(ct.T, 1 - axis).T


def _reduced_transposed(ndim: int) -> bool:
    """Whether a gradient of `ndim` dimensions is reduced as its transpose (`_transposed`)."""
    return ndim == 2 and jax.default_backend() == "cpu"  # measured on CPU only


def _quantizable(leaf: LeafLayout) -> bool:
    """ZeRO++'s quantized collectives run over fsdp alone: a leaf beside a pipeline (sharded over
    fsdp x pipeline, small beside the stack) keeps its plain ones."""
    return not leaf.beside_pipeline


def _gathered_over(leaf: LeafLayout):
    """The axes a stage-3 gather of `leaf` spans (hpZ's secondary copy is split over fsdp only)."""
    return (FSDP_AXIS, PIPELINE_AXIS) if leaf.beside_pipeline else FSDP_AXIS


def _pipeline_part(reduced, leaf: LeafLayout, axis: int):
    """A leaf's gradient reduce-scattered over fsdp -> this device's shard of it. Beside a pipeline
    every stage holds the same whole gradient, so its part over `pipeline` is cut, not summed (fsdp
    is the major axis of the pair, as in the leaf's spec)."""
    if not leaf.beside_pipeline:
        return reduced
    size = reduced.shape[axis] // jax.lax.axis_size(PIPELINE_AXIS)
    return jax.lax.dynamic_slice_in_dim(reduced, jax.lax.axis_index(PIPELINE_AXIS) * size, size, axis)


def _from_row(row, leaf: LeafLayout):
    """This device's part of a reduced row (`Reduce._grad_rows`) -> its shard of the leaf."""
    shard = list(leaf.padded_shape)
    shard[leaf.axis] //= jax.lax.axis_size(FSDP_AXIS)  # type: ignore[index]
    if _reduced_transposed(len(shard)):  # cut from the transposed gradient
        return row.reshape(shard[::-1]).T
    return row.reshape(shard)


# An FSDP unit's bucket: gathered bytes (compute dtype) at most; a larger leaf keeps its own
# collectives. Sized for users' units of small leaves; a bucket's rows cost temp memory.
UNIT_BUCKET_BYTES = 1 << 20


def buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of `sizes` in consecutive groups of at most `limit` bytes; a larger one alone."""
    out: list[list[int]] = []
    total = limit + 1
    for i, size in enumerate(sizes):
        if size > limit or total + size > limit:
            out.append([i])
            total = size
        else:
            out[-1].append(i)
            total += size
    return out


@dataclass(frozen=True)
class Reduce:
    replicas: tuple[str, ...]  # batch axes besides fsdp with size > 1: pure replicas (hybrid sharding)
    compute_dtype: Any
    reduce_dtype: Any
    master_dtype: Any
    weights: quantize.Quantizer | None = None  # qwZ: stage-3 gathers move block-quantized weights
    grads: quantize.Quantizer | None = None  # qgZ: reduce-scatters become quantized all-to-alls
    # hpZ: stage-3 shards are split over fsdp x data; `secondary` gathers them over data into the
    # copy the layers gather over fsdp; each layer's gradient goes back over fsdp, then over data
    hierarchical: bool = False

    def to_shard(self, ct, leaf: LeafLayout):
        """A leaf's local gradient -> this device's shard of the sum over all devices."""
        if leaf.axis is None:  # replicated in every group: every device keeps the whole sum
            return jax.lax.psum(ct.astype(self.reduce_dtype), (FSDP_AXIS, *self.replicas))
        ct = fit_to(ct, leaf.padded_shape)
        if (
            self.grads is not None
            and _quantizable(leaf)
            and self.grads.applies(quantize.chunk_size(leaf, jax.lax.axis_size(FSDP_AXIS)))
        ):
            ct = quantize.reduce_scatter(ct, leaf, self.grads).astype(self.reduce_dtype)  # summed in fp32
        else:
            ct = _transposed(
                lambda c, axis: _pipeline_part(
                    jax.lax.psum_scatter(c.astype(self.reduce_dtype), FSDP_AXIS, scatter_dimension=axis, tiled=True),
                    leaf,
                    axis,
                ),
                ct,
                leaf.axis,
            )
        return jax.lax.psum(ct, self.replicas) if self.replicas and not self.hierarchical else ct

    def to_all(self, ct):
        return _transposed(lambda c, _: jax.lax.psum(c.astype(self.reduce_dtype), (FSDP_AXIS, *self.replicas)), ct, 0)

    def cast_gather(self, shard, leaf: LeafLayout):
        x = keep_tensor_split(shard, leaf).astype(self.compute_dtype)  # cast first: the gather moves compute bytes
        if leaf.axis is not None:
            x = keep_tensor_split(gather_bits(x, leaf.axis, _gathered_over(leaf)), leaf)
        return fit_to(x, leaf.shape)

    def shard_gather(self, shard, leaf: LeafLayout):
        """Stage 3's gather of a leaf: block-quantized with qwZ (where its shard fills a block)."""
        if (
            self.weights is not None
            and leaf.axis is not None
            and _quantizable(leaf)
            and self.weights.applies(shard.size)
            and not leaf.read_dtype  # integer codes: not block-quantized
        ):
            return quantize.gather(shard, leaf, self.weights, self.compute_dtype)
        return self.cast_gather(shard, leaf)

    def gather(self, leaf: LeafLayout, dtype=None):
        """Stage 3: fp32 shard -> whole compute-dtype leaf; backward: reduce-scatter of its gradient,
        returned in `dtype` (the shard's; default the master dtype), straight through qwZ's
        quantization. hpZ's copies go through `hierarchical_gather`."""
        gather = lambda shard: self.shard_gather(shard, leaf)  # noqa: E731
        dtype = self.master_dtype if dtype is None else dtype
        # The transpose JAX derives for a tiled all_gather is this psum_scatter; it is written out
        # so that it runs in the reduce dtype and also sums over the replica axes.
        f = jax.custom_vjp(gather)
        f.defvjp(lambda s: (gather(s), None), lambda _, ct: (self.to_shard(ct, leaf).astype(dtype),))
        return f

    def secondary(self, leaf: LeafLayout, shard):
        """hpZ, once per step: this device's fp32 primary shard (split over fsdp x data) -> the
        compute-dtype secondary shard (split over fsdp only), gathered over data, beside the primary.
        Not differentiated: `hierarchical_gather`'s backward sends the gradient to the primary."""
        if leaf.axis is None:
            return shard
        # Kept as bits until each layer's gather: XLA:CPU held a bf16 copy passed into the scanned
        # layers' loops in f32, twice its bytes.
        bits = to_bits(jax.lax.stop_gradient(shard).astype(self.compute_dtype))
        return Secondary(jax.lax.all_gather(bits, "data", axis=leaf.axis, tiled=True), shard)

    def hierarchical_gather(self, leaf: LeafLayout, dtype):
        """hpZ's stage-3 gather: the secondary shard gathered over fsdp (forward and the backward's
        re-gather, so neither crosses data); the gradient reduce-scattered over fsdp, then over data,
        in the reduce dtype, into the primary shard. Reduced in each layer's backward, as the other
        stages' gradients are: the secondary copy carries no gradient."""

        gather = lambda bits: self.shard_gather(from_bits(bits, self.compute_dtype), leaf)  # noqa: E731
        f = jax.custom_vjp(lambda copy, primary: gather(copy))
        f.defvjp(
            lambda copy, primary: (gather(copy), None), lambda _, ct: (None, self._to_primary(ct, leaf).astype(dtype))
        )
        return f

    def _to_primary(self, ct, leaf: LeafLayout):
        """hpZ: a leaf's local gradient -> this device's primary shard (over fsdp, then data)."""
        return jax.lax.psum_scatter(self.to_shard(ct, leaf), "data", scatter_dimension=leaf.axis, tiled=True)

    def gather_group(self, leaves: list[LeafLayout], values: list, bucket_bytes: int = 0) -> list:
        """Stage 3: several leaves' stored values (one layer's or unit's) -> the whole compute-dtype
        leaves, the plain sharded leaves gathered in buckets of at most `bucket_bytes` (`buckets`): each
        bucket's bits in one all-gather, and its gradients reduce-scattered in one `psum_scatter`
        (`_received_bucket`). 0: every leaf its own collectives.

        XLA:CPU combines neither all-gathers nor reduce-scatters, and every collective is a
        rendezvous of all device threads, so one collective per bucket is faster than one per leaf
        (docs/engines.md). A bucket costs memory a leaf's own collective does not: the gathered rows
        beside the leaves cut out of them, and the gradients held until the bucket's last one exists;
        a leaf larger than `bucket_bytes` keeps its own. qwZ's quantized and replicated leaves keep
        their own collectives, and hpZ's their own reductions."""
        one = self.gathered
        out = [None if self._joinable(l, x) else one(l, x) for l, x in zip(leaves, values)]
        gathered = jax.lax.axis_size(FSDP_AXIS) * jnp.dtype(self.compute_dtype).itemsize
        # Frozen leaves never share a bucket with trainable ones: their gathers have no backward.
        for trains in (True, False):
            joinable = [i for i, o in enumerate(out) if o is None and leaves[i].trainable == trains]
            for bucket in buckets([self._bits(values[i]).size * gathered for i in joinable], bucket_bytes):
                self._gather_bucket([joinable[j] for j in bucket], leaves, values, out)
        return out

    def _gather_bucket(self, members: list[int], leaves: list[LeafLayout], values: list, out: list) -> None:
        """`out[i]` for each of the bucket's `members`: gathered in one all-gather (alone: its own)."""
        one = self.gathered
        if len(members) == 1:
            out[members[0]] = one(leaves[members[0]], values[members[0]])
            return
        bits = [self._bits(values[i]) for i in members]
        rows = jax.lax.all_gather(jnp.concatenate([b.ravel() for b in bits]), FSDP_AXIS, axis=0, tiled=False)
        rows = from_bits(rows, self.compute_dtype)  # (fsdp, elements of this device's shards)
        wholes, start = [], 0
        for i, b in zip(members, bits):
            wholes.append(join_shards(rows[:, start : start + b.size], leaves[i]))
            start += b.size
        if self.grads is None and not any(isinstance(values[i], Secondary) for i in members):
            received = self._received_bucket([leaves[i] for i in members], [values[i] for i in members], wholes)
        else:  # qgZ's quantized reductions and hpZ's two-level ones stay per leaf
            received = [self._received(leaves[i], values[i], w) for i, w in zip(members, wholes)]
        for i, whole in zip(members, received):
            out[i] = _read_as(leaves[i], whole)

    def _received_bucket(self, leaves: list[LeafLayout], shards: list, wholes: list) -> list:
        """`wholes` (gathered from `shards` together), with a backward that reduce-scatters all their
        gradients in one `psum_scatter` into the shards (summed over the replica axes too).

        The shards are received in the reduce dtype: the cast to the master dtype is the cast's own
        transpose, outside this rule, which XLA fuses into the update, so the reduced shards wait for
        the update in the reduce dtype. They wait as buffers of their own (`held_on_cpu`): XLA cut
        some out of the reduced row and read others from it in place, so the row stayed alive beside
        its pieces (a bf16 unit's reduced gradient twice)."""

        def reduce(cts):
            rows = [self._grad_rows(ct, leaf) for ct, leaf in zip(cts, leaves)]
            mine = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), FSDP_AXIS, scatter_dimension=0, tiled=False)
            if self.replicas:
                mine = jax.lax.psum(mine, self.replicas)
            out, start = [], 0
            for leaf, r in zip(leaves, rows):
                out.append(_from_row(mine[start : start + r.shape[1]], leaf))
                start += r.shape[1]
            return held_on_cpu(out)

        f = jax.custom_vjp(lambda shards, wholes: wholes)
        f.defvjp(lambda shards, wholes: (wholes, None), lambda _, cts: (reduce(cts), None))
        return f([s.astype(self.reduce_dtype) for s in shards], list(wholes))

    def _grad_rows(self, ct, leaf: LeafLayout):
        """A leaf's whole local gradient as (fsdp, shard elements) in the reduce dtype: row i is
        device i's shard (`_from_row` reads it back). 2-D gradients are cut from their transpose on CPU
        (`_transposed`)."""
        ct = fit_to(ct, leaf.padded_shape).astype(self.reduce_dtype)
        axis = leaf.axis
        assert axis is not None  # only sharded leaves are bucketed (`_joinable`)
        if _reduced_transposed(ct.ndim):
            ct, axis = ct.T, 1 - axis
        n = jax.lax.axis_size(FSDP_AXIS)
        split = ct.reshape(*ct.shape[:axis], n, ct.shape[axis] // n, *ct.shape[axis + 1 :])
        return jnp.moveaxis(split, axis, 0).reshape(n, -1)

    def _joinable(self, leaf: LeafLayout, x) -> bool:
        # A tensor-parallel leaf keeps its own gather: flattening it into the joined one would make
        # the partitioner gather its tensor split as well.
        shard = x.copy if isinstance(x, Secondary) else x
        weights = self.weights is not None and self.weights.applies(shard.size)
        return leaf.axis is not None and leaf.tensor_axis is None and not weights and not leaf.beside_pipeline

    def _bits(self, x):
        """The compute-dtype bits a stage-3 gather moves for this stored value (not differentiated)."""
        if isinstance(x, Secondary):
            return jax.lax.stop_gradient(x.copy)
        return to_bits(jax.lax.stop_gradient(x).astype(self.compute_dtype))

    def _received(self, leaf: LeafLayout, x, whole):
        """`whole` (gathered from `x` elsewhere), with a backward that reduces its gradient into the
        stored value `x` as `gather` (or hpZ's `hierarchical_gather`) does."""
        if isinstance(x, Secondary):
            f = jax.custom_vjp(lambda copy, primary, whole: whole)
            f.defvjp(
                lambda copy, primary, whole: (whole, None),
                lambda _, ct: (None, self._to_primary(ct, leaf).astype(x.primary.dtype), None),
            )
            return f(*x, whole)
        f = jax.custom_vjp(lambda shard, whole: whole)
        f.defvjp(lambda shard, whole: (whole, None), lambda _, ct: (self.to_shard(ct, leaf).astype(x.dtype), None))
        return f(x, whole)

    def resident(self, leaf: LeafLayout):
        """Stage 2: the forward reads the resident copy; backward: reduce-scatter into the shard."""
        f = jax.custom_vjp(lambda full, shard: full)
        f.defvjp(lambda full, shard: (full, None), lambda _, ct: (None, self.to_shard(ct, leaf)))
        return f

    def gathered(self, leaf: LeafLayout, x):
        """One leaf's stored shard (or hpZ's pair) -> the whole compute-dtype leaf."""
        if isinstance(x, Secondary):
            return _read_as(leaf, self.hierarchical_gather(leaf, x.primary.dtype)(*x))
        return _read_as(leaf, self.gather(leaf, x.dtype)(x))

    def materializer(self, stage: Stage):
        """`(leaf, stored value) -> whole compute value`: gathered from the shard where the stage shards
        the compute params, the resident copy where it keeps one, else the value as stored."""
        if stage.compute_params:
            return lambda leaf, x: keep_tensor_split(self.gathered(leaf, x), leaf)
        if stage.resident_compute:
            return lambda leaf, x: _read_as(leaf, keep_tensor_split(self.resident(leaf)(x.full, x.shard), leaf))
        return lambda leaf, x: _read_as(leaf, keep_tensor_split(x, leaf))

    def group_materializer(self, stage: Stage, bucket_bytes: int = 0):
        """`(leaves, stored values) -> whole values` of a group used together (one layer's or unit's
        leaves): `gather_group` in buckets of `bucket_bytes` at stage 3, else each leaf as
        `materializer` says."""
        if stage.compute_params:
            return lambda leaves, values: list(
                map(keep_tensor_split, self.gather_group(leaves, values, bucket_bytes), leaves)
            )
        one = self.materializer(stage)
        return lambda leaves, values: [one(l, x) for l, x in zip(leaves, values)]


def _read_as(leaf: LeafLayout, whole):
    """A frozen integer leaf is gathered in the compute dtype, which holds it exactly, and read in its
    declared one (`LeafLayout.read_dtype`)."""
    return whole.astype(leaf.read_dtype) if leaf.read_dtype else whole
