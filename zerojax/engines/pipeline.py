"""Pipeline parallelism as an SPMD loop: a model's stack of identical layers split into `p` pipeline
stages of consecutive layers over the mesh's `pipeline` axis, run by GPipe over `m` microbatches.

The loop runs inside a `shard_map` manual over `pipeline` and the data-parallel axes (a `tensor`
axis stays with the partitioner). Each device holds its stage's layers (a stacked leaf's layer axis
is split over `pipeline`, `LeafLayout.pipeline_size`) and its rows of the batch, split into `m`
microbatches (microbatch j: its rows j, j + m, ...). The loop runs `m + p - 1` iterations; in each,
every stage applies its layers to its current input and sends the result to the next stage (a
`ppermute`), and the last stage keeps its output as microbatch `t - (p - 1)`. Stage `s` works on
microbatch `t - s`; in the bubble iterations, where that is outside [0, m), its input is replaced by
zeros, so whatever the buffer held (NaN included) never reaches an output or a gradient. The last
stage's outputs are then summed over `pipeline` (the others hold zeros), since every stage runs what
follows the stack. The backward schedule is the loop's derivative; each layer is rematerialised. The
stage weights enter the region replicated over the data-parallel axes, so their gradient is summed
over them once, after the last microbatch.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.core.mesh import BATCH_AXES, PIPELINE_AXIS, TENSOR_AXIS, data_parallel_size, pipeline_size
from zerojax.errors import UserError


def check_schedule(mesh, batch_rows: int, microbatches: int) -> None:
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


def gpipe(layer, x, stacked, *, mesh, microbatches: int, fill: float = 0.0, inside=contextlib.nullcontext):
    """`layer(x, one layer's params) -> x` applied through every layer of `stacked` (leaves [layers,
    ...], split over `pipeline` on axis 0), pipelined with GPipe over `microbatches`: the same result
    as scanning `layer` over the layers in order. `fill`: what the stage buffers start as (bubbles
    compute on zeros whatever it is; tests pass NaN to show it). `inside()`: a context the layers
    run in (the engine's activation rules for a manual region)."""
    p, m = pipeline_size(mesh), microbatches
    check_schedule(mesh, x.shape[0], m)
    manual = (PIPELINE_AXIS, *BATCH_AXES)
    partial = {"axis_names": frozenset(manual)} if dict(mesh.shape).get(TENSOR_AXIS, 1) > 1 else {}

    def stage(params, h):  # this device's pipeline stage: its layers in order, each rematerialised
        return jax.lax.scan(lambda h, one: (jax.checkpoint(layer)(h, one), None), h, params)[0]

    def body(x, params):  # x: this device's rows; params: its stage's layers
        rows, rest = x.shape[0] // m, x.shape[1:]
        xs = x.reshape(rows, m, *rest).swapaxes(0, 1)  # microbatch j: local rows j, j + m, ...
        me = jax.lax.axis_index(PIPELINE_AXIS)

        def iteration(carry, t):
            state, outputs = carry
            first = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, m - 1), 0, keepdims=False)
            busy = (t >= me) & (t - me < m)  # stage `me` works on microbatch t - me
            out = stage(params, jnp.where(busy, jnp.where(me == 0, first, state), jnp.zeros_like(state)))
            j = jnp.maximum(t - (p - 1), 0)
            kept = jax.lax.dynamic_index_in_dim(outputs, j, 0, keepdims=False)
            done = jnp.where((me == p - 1) & (t >= p - 1), out, kept)
            outputs = jax.lax.dynamic_update_index_in_dim(outputs, done, j, 0)
            return (jax.lax.ppermute(out, PIPELINE_AXIS, [(i, i + 1) for i in range(p - 1)]), outputs), None

        with inside():
            carry = (jnp.full((rows, *rest), fill, x.dtype), jnp.zeros((m, rows, *rest), x.dtype))
            (_, outputs), _ = jax.lax.scan(iteration, carry, jnp.arange(m + p - 1))
        # the last stage holds the outputs; every stage runs what follows the stack
        outputs = jax.lax.psum(jnp.where(me == p - 1, outputs, jnp.zeros_like(outputs)), PIPELINE_AXIS)
        return outputs.swapaxes(0, 1).reshape(x.shape)

    specs = (P(BATCH_AXES), jax.tree.map(lambda _: P(PIPELINE_AXIS), stacked))
    run = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(BATCH_AXES), check_vma=False, **partial)
    return run(x, stacked)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a GPipe step's iterations a stage idles: (p - 1) / (v m + p - 1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)
