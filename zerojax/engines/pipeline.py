"""Pipeline parallelism as an SPMD loop: a model's stack of identical layers split into `p` pipeline
stages of consecutive layers over the mesh's `pipeline` axis, run by GPipe over `m` microbatches.

Each device holds its stage's layers: the stacked params viewed as [p, layers / p, ...], the stage
axis on `pipeline` (`LeafLayout.pipeline_size`). The loop runs `m + p - 1` iterations. In each,
every stage applies its layers to its current input at once (one `vmap` over the stage axis, which
the partitioner splits so each device computes its own stage), the last stage's output is kept as
microbatch `t - (p - 1)`, and the outputs move one stage on (`jnp.roll` over the stage axis: a
collective-permute between neighbouring stages). Stage `s` works on microbatch `t - s`; in the
bubble iterations, where that is outside [0, m), its input is replaced by zeros, so whatever the
buffer held (NaN included) never reaches an output or a gradient. The backward schedule is the
loop's derivative; each layer is rematerialised (its input saved, its internals recomputed).

Microbatch j holds rows j, j + m, j + 2m, ... of the batch, so each microbatch keeps the batch's
split over the data-parallel axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.core.mesh import BATCH_AXES, PIPELINE_AXIS, data_parallel_size, pipeline_size
from zerojax.errors import UserError


def check_microbatches(mesh, batch_rows: int, microbatches: int) -> None:
    """At least one microbatch per stage, and microbatches that split the batch evenly over the
    data-parallel devices."""
    stages, dp = pipeline_size(mesh), data_parallel_size(mesh)
    if microbatches < stages:
        raise UserError(
            f"train.microbatches={microbatches} is fewer than the {stages} pipeline stages: GPipe needs at "
            f"least one microbatch per stage (more shrink the bubble, (p-1)/(m+p-1))."
        )
    if batch_rows % (microbatches * dp):
        raise UserError(
            f"the batch of {batch_rows} rows does not split into train.microbatches={microbatches} microbatches over "
            f"the {dp} data-parallel devices (mesh.data x mesh.fsdp); use a batch divisible by {microbatches * dp}."
        )


def gpipe(layer, x, stacked, *, mesh, microbatches: int, fill: float = 0.0):
    """`layer(x, one layer's params) -> x` applied through every layer of `stacked` (leaves [layers,
    ...]), pipelined over the mesh's `pipeline` axis with GPipe over `microbatches`. The same result
    as scanning `layer` over the layers in order. `fill`: what the stage buffers start as (the
    bubbles compute on zeros whatever it is; tests pass NaN to show it)."""
    p, m = pipeline_size(mesh), microbatches
    check_microbatches(mesh, x.shape[0], m)
    rows = x.shape[0] // m
    rest = x.shape[1:]
    batch = NamedSharding(mesh, P(None, BATCH_AXES))
    per_stage = NamedSharding(mesh, P(PIPELINE_AXIS, BATCH_AXES))
    xs = jax.lax.with_sharding_constraint(x.reshape(rows, m, *rest).swapaxes(0, 1), batch)  # [m, rows, ...]
    stages = jax.tree.map(lambda a: a.reshape(p, a.shape[0] // p, *a.shape[1:]), stacked)

    def stage(params, h):  # one pipeline stage: its layers in order, each rematerialised
        def body(h, one):
            return jax.checkpoint(layer)(h, one), None

        return jax.lax.scan(body, h, params)[0]

    index = jnp.arange(p).reshape(p, *([1] * (1 + len(rest))))

    def iteration(carry, t):
        state, outputs = carry
        first = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, m - 1), 0, keepdims=False)
        inputs = jnp.where(index == 0, first[None], state)
        busy = (t >= index) & (t - index < m)  # stage s works on microbatch t - s
        inputs = jax.lax.with_sharding_constraint(jnp.where(busy, inputs, jnp.zeros_like(inputs)), per_stage)
        out = jax.vmap(stage, spmd_axis_name=PIPELINE_AXIS)(stages, inputs)
        out = jax.lax.with_sharding_constraint(out, per_stage)
        j = jnp.maximum(t - (p - 1), 0)
        done = jnp.where(t >= p - 1, out[p - 1], jax.lax.dynamic_index_in_dim(outputs, j, 0, keepdims=False))
        outputs = jax.lax.with_sharding_constraint(jax.lax.dynamic_update_index_in_dim(outputs, done, j, 0), batch)
        return (jnp.roll(out, 1, axis=0), outputs), None

    state = jax.lax.with_sharding_constraint(jnp.full((p, rows, *rest), fill, x.dtype), per_stage)
    outputs = jnp.zeros((m, rows, *rest), x.dtype)
    (_, outputs), _ = jax.lax.scan(iteration, (state, outputs), jnp.arange(m + p - 1))
    return outputs.swapaxes(0, 1).reshape(x.shape)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a GPipe step's iterations a stage idles: (p - 1) / (v m + p - 1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)
