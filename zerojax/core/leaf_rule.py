"""The per-leaf rule: how one parameter leaf is stored when its group is sharded over `fsdp` (which
dimension, how much padding, its tensor split), and the shapes and joins that follow from it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from zerojax.core.mesh import FSDP_AXIS, PIPELINE_AXIS, TENSOR_AXIS


@dataclass(frozen=True)
class LeafLayout:
    """How one parameter leaf is stored when its group is sharded.

    `axis` is the array axis split over `fsdp` (None: the leaf is replicated even in sharded groups);
    `padded_shape` differs from `shape` only on that axis, rounded up to a multiple of the fsdp size,
    so every shard is the same size (XLA and `shard_map` need even shards).
    """

    path: str
    shape: tuple[int, ...]
    padded_shape: tuple[int, ...]
    axis: int | None
    reason: str
    # the mesh axes `axis` is split over, major first: ("fsdp",), ("fsdp", "data") for hpZ's
    # primary partition (`zero.hierarchical`), ("fsdp", "pipeline") beside a pipelined stack (and
    # ("fsdp", "pipeline", "data") for both)
    over: tuple[str, ...] = (FSDP_AXIS,)
    # tensor parallelism: the array axis split over the mesh's `tensor` axis in *every* group (it is
    # model parallelism, not ZeRO: no stage gathers it), and that axis's size
    tensor_axis: int | None = None
    tensor_size: int = 1
    # False for a frozen leaf (`zerojax.core.trainable`): no gradient, so nothing of it is reduced
    trainable: bool = True
    # a stacked leaf's layer axis 0 split over the mesh's `pipeline` axis into this many pipeline
    # stages of consecutive layers, in every group (1: not pipelined)
    pipeline_size: int = 1
    # a frozen integer or boolean leaf's declared dtype: stored in the compute dtype, which holds it
    # exactly, and read by the model in its own ("": read as stored; `zerojax.core.trainable.stop_frozen`)
    read_dtype: str = ""

    @property
    def model_split(self) -> int:
        """The devices every group splits this leaf over, whatever the stage: tensor x pipeline."""
        return (self.tensor_size if self.tensor_axis is not None else 1) * self.pipeline_size

    @property
    def beside_pipeline(self) -> bool:
        """A leaf outside a pipelined stack (`zerojax.core.layout.make_layout`): every pipeline stage
        runs it whole, and a sharded group splits it over fsdp x pipeline."""
        return PIPELINE_AXIS in self.over

    @property
    def padded(self) -> bool:
        return self.padded_shape != self.shape

    def one_layer(self) -> LeafLayout:
        """One layer of a stacked leaf (its layer axis 0 is never sharded): what a scan body sees."""
        axis = None if self.axis is None else self.axis - 1
        tensor_axis = None if self.tensor_axis is None else self.tensor_axis - 1
        return dataclasses.replace(
            self,
            shape=self.shape[1:],
            padded_shape=self.padded_shape[1:],
            axis=axis,
            tensor_axis=tensor_axis,
            pipeline_size=1,
        )

    def pipeline_stage(self) -> LeafLayout:
        """What a device holds of this leaf inside a region manual over `pipeline`: a stacked leaf's
        share of the layers (one pipeline stage's), laid out as a leaf of its own; others as they are."""
        if self.pipeline_size == 1:
            return self
        layers = self.shape[0] // self.pipeline_size
        return dataclasses.replace(
            self, shape=(layers, *self.shape[1:]), padded_shape=(layers, *self.padded_shape[1:]), pipeline_size=1
        )

    def spec(self, sharded: bool):
        """The leaf's `PartitionSpec` in a sharded (or replicated) group: `fsdp` on `axis` only where
        sharded, `tensor` on `tensor_axis` always. Trailing unsplit axes are left out."""
        from jax.sharding import PartitionSpec as P

        entries: list = [None] * len(self.shape)
        if self.pipeline_size > 1:
            entries[0] = PIPELINE_AXIS
        if self.tensor_axis is not None:
            entries[self.tensor_axis] = TENSOR_AXIS
        if sharded and self.axis is not None:
            entries[self.axis] = self.over[0] if len(self.over) == 1 else self.over
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)


def leaf_layout(
    path: str,
    shape: tuple[int, ...],
    itemsize: int,
    fsdp_size: int,
    *,
    layer_axis: int | None = None,
    replicate_below_bytes: int = 2048,
    over: tuple[str, ...] = (FSDP_AXIS,),
    tensor_axis: int | None = None,
    tensor_size: int = 1,
    fsdp_axis: int | None = None,
    pipeline_size: int = 1,
) -> LeafLayout:
    """Shard the largest dimension divisible by `fsdp_size`; else pad the largest one.

    Only leaves under `replicate_below_bytes` that no dimension divides stay replicated: padding them
    would save nothing worth a collective. The layer axis of a stacked scan is never split, since
    the scan slices it one layer at a time. `fsdp_size` is the number of shards: the product of the
    sizes of the mesh axes in `over`. `tensor_axis` (split over `tensor_size` devices by the axis
    rules) is not free for FSDP; `fsdp_axis`, a dimension the model itself names `fsdp`, is tried first.
    `pipeline_size` > 1 splits a stacked leaf's layer axis over the mesh's `pipeline` axis.
    """
    skip = {layer_axis, tensor_axis}
    leaf = _leaf_layout(path, shape, itemsize, fsdp_size, skip, replicate_below_bytes, fsdp_axis)
    if tensor_axis is not None:
        leaf = dataclasses.replace(
            leaf,
            tensor_axis=tensor_axis,
            tensor_size=tensor_size,
            reason=f"{leaf.reason}; tensor on axis {tensor_axis}",
        )
    if pipeline_size > 1 and layer_axis == 0:  # the layer axis split into pipeline stages
        leaf = dataclasses.replace(leaf, pipeline_size=pipeline_size, reason=f"{leaf.reason}; pipeline on axis 0")
    return leaf if over == (FSDP_AXIS,) else dataclasses.replace(leaf, over=tuple(over))


def _leaf_layout(path, shape, itemsize, fsdp_size, skip, replicate_below_bytes, first) -> LeafLayout:
    shape = tuple(int(d) for d in shape)
    candidates = [i for i in range(len(shape)) if i not in skip and shape[i] > 0]
    if not candidates:
        return LeafLayout(path, shape, shape, None, "replicated: no dimension to shard")
    by_size = sorted(candidates, key=lambda i: (i != first, -shape[i], i))
    for i in by_size:
        if shape[i] % fsdp_size == 0:
            return LeafLayout(path, shape, shape, i, f"sharded on axis {i}")
    nbytes = math.prod(shape) * itemsize
    if nbytes < replicate_below_bytes:
        return LeafLayout(
            path, shape, shape, None, f"replicated: {nbytes} bytes, no dimension divisible by {fsdp_size}"
        )
    i = by_size[0]
    padded = list(shape)
    padded[i] = -(-shape[i] // fsdp_size) * fsdp_size
    return LeafLayout(path, shape, tuple(padded), i, f"padded axis {i} from {shape[i]} to {padded[i]}")


def fit_to(x, shape):
    """Crop or zero-pad `x` at the end of each axis to `shape` (padding zeros stay zero under the
    optimizers, since their gradients are zero)."""
    if tuple(x.shape) == tuple(shape):
        return x
    import jax.numpy as jnp

    x = x[tuple(slice(0, min(s, t)) for s, t in zip(x.shape, shape))]
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


def join_shards(rows, leaf: LeafLayout):
    """(fsdp, n) -> the whole leaf: row i is device i's shard of `leaf` flattened, the shards joined
    on `leaf.axis` and the padding cropped."""
    import jax.numpy as jnp

    shard_shape = list(leaf.padded_shape)
    shard_shape[leaf.axis] //= rows.shape[0]  # type: ignore[index]
    whole = jnp.moveaxis(rows.reshape(rows.shape[0], *shard_shape), 0, leaf.axis)  # type: ignore[arg-type]
    return fit_to(whole.reshape(leaf.padded_shape), leaf.shape)


def describe(layouts) -> list[dict]:
    """Rows for reports: each leaf's path, shape, sharded axis and the reason."""
    import jax

    return [
        {"path": l.path, "shape": l.shape, "padded_shape": l.padded_shape, "axis": l.axis, "reason": l.reason}
        for l in jax.tree.leaves(layouts, is_leaf=lambda x: isinstance(x, LeafLayout))
    ]


def shard_numel(layout: LeafLayout, sharded: bool, fsdp_size: int) -> int:
    """Elements one device holds of this leaf when its group is (or is not) sharded."""
    if not sharded or layout.axis is None:
        return int(np.prod(layout.shape)) // layout.model_split
    return int(np.prod(layout.padded_shape)) // (fsdp_size * layout.model_split)
