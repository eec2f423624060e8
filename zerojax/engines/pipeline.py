"""Pipeline parallelism as an SPMD loop: a model's stack of identical layers split over the mesh's
`pipeline` axis into `p` pipeline stages, run over `m` microbatches by GPipe or, with `v` repeats,
by the circular (interleaved) schedule.

The loop runs inside a `shard_map` manual over `pipeline` and the data-parallel axes (a `tensor`
axis stays with the partitioner). Each device holds its rows of the batch, split into `m`
microbatches (microbatch j: its rows j, j + m, ...), and its layers: under GPipe (v = 1) its
consecutive `L / p` (a stacked leaf's layer axis is split over `pipeline`,
`LeafLayout.pipeline_size`); under the circular schedule `v` chunks of `c = L / (p v)` layers, chunk
r of stage s being layers `(r p + s) c ...` (`circular_chunks` exchanges them in the step, and the
gradient back). A work item is (repeat r, microbatch j), u = r m + j; stage `s` works on item `t -
s` in iteration t, passing its output to stage s + 1 (a `ppermute` from the stages that worked in
that iteration alone; the last stage's goes round to stage 0, which keeps it until the item's next
repeat). The loop runs `v m + p - 1` iterations, and a stage idles (p - 1) / (v m + p - 1) of them.
In those bubble iterations its input is replaced by zeros, so whatever the buffer held (NaN
included) never reaches an output or a gradient. The last stage's outputs are then summed over
`pipeline` (the others hold zeros), since every stage runs what follows the stack. The backward
schedule is the loop's derivative; each layer is rematerialised. The stage weights enter the region
replicated over the data-parallel axes, so their gradient is summed over them once, after the last
microbatch. At stage 3 (`gather_axes`) they enter as their `fsdp` shards and are gathered inside:
the whole pipeline stage once before the loop, its gradient reduce-scattered once after it; or
(`zero.pipeline_gather: per_microbatch`) each layer as it runs in every iteration, its gradient
reduce-scattered there: a layer's weights whole at a time instead of a pipeline stage's, for (v m +
p - 1) / v times a stage's gathers, twice over (the backward rematerialises them).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax.core.mesh import BATCH_AXES, FSDP_AXIS, PIPELINE_AXIS, TENSOR_AXIS, data_parallel_size, pipeline_size
from zerojax.engines.pipeline_circular import circular_chunks
from zerojax.errors import UserError


def check_schedule(mesh, batch_rows: int, microbatches: int, stack: tuple | None = None) -> None:
    """At least one microbatch per stage, microbatches that split the batch evenly over the devices,
    and `stack` = (the stack's input, the batch's rows as it sees them): one array, batch-first."""
    stages, dp = pipeline_size(mesh), data_parallel_size(mesh)
    if stack is not None and not hasattr(stack[0], "shape"):
        raise UserError(
            f"a pipeline passes one array from stage to stage, and this stack carries a {type(stack[0]).__name__}; "
            "carry one array (concatenate the parts), or train without mesh.pipeline."
        )
    if stack is not None and stack[0].shape[0] != stack[1]:
        raise UserError(
            f"the stack's input has {stack[0].shape[0]} rows on its first axis where the batch has {stack[1]}: a "
            "pipeline splits that axis into microbatches, so it must be the batch's (call the stack batch-first)."
        )
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


@dataclass(frozen=True)
class Schedule:
    """How a pipeline runs its step: `microbatches` per step (None: one a pipeline stage) and
    `repeats`, the layer chunks each device holds (1: GPipe; more: the circular schedule)."""

    microbatches: int | None = None
    repeats: int = 1

    @classmethod
    def of(cls, microbatches, repeats, mesh) -> Schedule:
        """The `Trainer` choices `microbatches` and `pipeline_repeats` (`train.microbatches`,
        `mesh.pipeline_repeats`), checked against `mesh`."""
        for key, value in (("train.microbatches", microbatches), ("mesh.pipeline_repeats", repeats)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UserError(f"{key} must be a positive integer, got {value!r}.")
        if pipeline_size(mesh) == 1 and (microbatches is not None or repeats != 1):
            key = "train.microbatches splits" if microbatches is not None else "mesh.pipeline_repeats splits"
            raise UserError(f"{key} a pipeline's work; this mesh has no pipeline axis (mesh.pipeline).")
        return cls(microbatches, repeats)

    def microbatches_on(self, mesh) -> int:
        """The microbatches a step splits into on `mesh`: the chosen number, else one a stage."""
        return self.microbatches or pipeline_size(mesh)


def check_model(model, stacks, mesh) -> None:
    """A pipeline runs a model's stack through its own loop: the model must hand it over."""
    if not model.accepts_layer_loop or not stacks:
        raise UserError(
            f"mesh.pipeline={pipeline_size(mesh)} needs a model that hands its layer loop to zerojax "
            "(the shipped GPT, or an NNX model's zj.Stacked blocks); this one does not."
        )


def gathers_each_layer(pipeline_gather: str, stage, mesh) -> bool:
    """`zero.pipeline_gather`, checked: "per_microbatch" gathers weights split over fsdp (stage 3)."""
    if pipeline_gather not in ("per_step", "per_microbatch"):
        raise UserError(f"zero.pipeline_gather must be per_step or per_microbatch, got {pipeline_gather!r}.")
    if pipeline_gather != "per_step" and pipeline_size(mesh) == 1:
        raise UserError(
            "zero.pipeline_gather chooses how a pipeline gathers; this mesh has no pipeline axis (mesh.pipeline)."
        )
    if pipeline_gather == "per_microbatch" and not (stage.compute_params and dict(mesh.shape).get("fsdp", 1) > 1):
        raise UserError(
            "zero.pipeline_gather=per_microbatch gathers weights split over fsdp, which only stage 3 does "
            f"(this is stage {stage.index}, fsdp={dict(mesh.shape).get('fsdp', 1)})."
        )
    return pipeline_gather == "per_microbatch"


def check_options(options, mesh) -> None:
    """Engine options a pipeline cannot honour, one sentence each (both engines): a pipeline stage's
    layers are gathered by the loop itself (`zero.pipeline_gather`), so there is nothing to prefetch,
    and keeping the gathered weights (`reshard_after_forward=false`) contradicts gathering each layer
    per microbatch."""
    if options.prefetch:
        raise UserError(
            f"zero.prefetch does not combine with mesh.pipeline={pipeline_size(mesh)}: the pipeline loop gathers "
            "a stage's layers itself (zero.pipeline_gather); set zero.prefetch=false."
        )
    if not options.reshard_after_forward and options.pipeline_gather == "per_microbatch":
        raise UserError(
            "zero.reshard_after_forward=false keeps the gathered weights for the step, which contradicts "
            "zero.pipeline_gather=per_microbatch (each layer gathered as it runs); choose one."
        )


# How stage 3 gathers a pipeline stage's weights, for the gather report (`describe`).
ONCE_PER_PASS = "every weight gathered once per pass over the microbatches"
PER_MICROBATCH = "each layer gathered per microbatch"
KEPT = "every weight gathered once per step, kept for every micro-batch"  # reshard_after_forward=false


def describe(stacks: str, mesh, schedule: Schedule, gathers: str | None) -> str:
    """The gather report's sentence for a pipelined step (`gathers`: how stage 3 gathers, if it does)."""
    m, v = schedule.microbatches_on(mesh), schedule.repeats
    how = "GPipe" if v == 1 else f"the circular schedule ({v} chunks a device)"
    return f"pipelined: {stacks} split into {pipeline_size(mesh)} pipeline stages, {how} over {m} microbatches" + (
        f", {gathers}" if gathers else ""
    )


def check_layers(stacked, split: int, repeats: int, stages: int) -> None:
    """The stack's layers (`stacked`'s leading axis times `split`: what share of them it holds)
    divide into `stages` x `repeats` chunks of equal size."""
    layers = jax.tree.leaves(stacked)[0].shape[0] * split
    if layers % (stages * repeats):
        raise UserError(
            f"{layers} layers do not divide into mesh.pipeline={stages} x mesh.pipeline_repeats={repeats} "
            "chunks of equal size; choose sizes whose product divides the layers."
        )


def gpipe(
    layer,
    x,
    stacked,
    *,
    mesh,
    microbatches: int,
    repeats: int = 1,
    fill=0.0,
    inside=contextlib.nullcontext,
    gather_axes=None,
    gather_each_layer: bool = False,
):
    """`layer(x, one layer's params) -> x` applied through every layer of `stacked` (leaves [layers,
    ...], split over `pipeline` on axis 0), pipelined over `microbatches` (GPipe; the circular
    schedule with `repeats` > 1): the same result as scanning `layer` over the layers in order.
    `fill`: what the stage buffers start as (bubbles compute on zeros whatever it is; tests pass NaN
    to show it). `inside()`: a context the layers run in (the engine's activation rules for a
    manual region). `gather_axes` (stage 3): for each leaf of `stacked` in order, the axis it is
    split over `fsdp` on (None: whole); such a leaf enters the region split and is gathered there,
    its gradient reduce-scattered: the whole pipeline stage once before the loop (and reduced once
    after it), or with `gather_each_layer` (`zero.pipeline_gather: per_microbatch`) each layer as
    it runs, for every microbatch, forward and again in the rematerialised backward."""
    p, m, v = pipeline_size(mesh), microbatches, repeats
    check_schedule(mesh, x.shape[0], m)
    check_layers(stacked, 1, v, p)
    manual = (PIPELINE_AXIS, *BATCH_AXES)
    partial = {"axis_names": frozenset(manual)} if dict(mesh.shape).get(TENSOR_AXIS, 1) > 1 else {}
    h = jnp.zeros((x.shape[0] // (data_parallel_size(mesh) * m), *x.shape[1:]), x.dtype)
    if _hoisted(layer, h, jax.tree.map(lambda w: jnp.zeros(w.shape[1:], w.dtype), stacked))[1]:
        raise UserError(
            "on a pipeline the gspmd engine's region cannot read values computed from parameters outside the "
            "stack (a shared gate or module); set zero.engine=shard_map, or keep such parameters inside the blocks."
        )
    per_layer = gather_axes is not None and gather_each_layer
    run_layer = functools.partial(_gathered, layer, gather_axes, 1) if per_layer else layer
    loop = functools.partial(on_device, run_layer, stages=p, microbatches=m, repeats=v, fill=fill, inside=inside)
    body = loop
    if gather_axes is not None and not per_layer:  # the whole stage gathered once, before the loop
        body = functools.partial(_gathered, loop, gather_axes, 0)
    reordered = lambda x, params: body(x, circular_chunks(params, p, v))  # noqa: E731  (shards, before any gather)
    leaves, tree = jax.tree.flatten(stacked)
    axes = gather_axes if gather_axes is not None else [None] * len(leaves)
    specs = (P(BATCH_AXES), jax.tree.unflatten(tree, [_stage_spec(w.ndim, a) for w, a in zip(leaves, axes)]))
    run = jax.shard_map(reordered, mesh=mesh, in_specs=specs, out_specs=P(BATCH_AXES), check_vma=False, **partial)
    return run(x, stacked)


def _outside_summed(layer, h, one):
    """`layer`, what it reads from outside parameters getting its gradient summed over the stages."""
    converted, consts = _hoisted(layer, h, one)
    if converted is None:
        return layer
    summed = [_summed_cotangent(c) for c in consts]
    return lambda h, one: converted(h, one, *summed)


def _hoisted(layer, h, one):
    """(`layer` of its closed-over values too, those values) where one is differentiated (a tracer of
    the differentiation, not the jit's: the GPT's rotary tables are not), else (None, [])."""
    converted, consts = jax.closure_convert(layer, h, one)
    differentiated = any(type(c).__name__ in ("JVPTracer", "LinearizeTracer") for c in consts)
    return (converted, consts) if differentiated else (None, [])


def _gathered(layer, gather_axes, sliced: int, h, params):
    """`layer(h, params)` with `params`' split leaves gathered over fsdp here (their axes counted on
    the stack, of which `sliced` leading axes are gone: 1 for one layer); inside a remat, the
    backward gathers them again. The gather's transpose reduce-scatters the gradient."""
    leaves, tree = jax.tree.flatten(params)
    leaves = [
        w if a is None else jax.lax.all_gather(w, FSDP_AXIS, axis=a - sliced, tiled=True)
        for w, a in zip(leaves, gather_axes)
    ]
    return layer(h, jax.tree.unflatten(tree, leaves))


def on_device(
    layer,
    x,
    params,
    *,
    stages: int,
    microbatches: int,
    repeats: int = 1,
    fill=0.0,
    inside=contextlib.nullcontext,
    own_grads: bool = False,
):
    """The SPMD loop on one device, inside a region manual over `pipeline` and the data-parallel axes:
    `x` its rows, `params` its pipeline stage's layers (in circular order where `repeats` > 1).
    `own_grads`: the region differentiates itself (the shard_map engine), so what enters and leaves
    the stack carries its gradient explicitly: the stack's outputs are every stage's (the last
    stage's, broadcast) while their gradient enters the last stage once; the gradient of `x`, which
    only stage 0 reads, is summed over the stages so that each holds the whole of it."""
    p, m, v = stages, microbatches, repeats
    rows, rest = x.shape[0] // m, x.shape[1:]
    if own_grads:
        x = _summed_cotangent(x)
        layer = _outside_summed(layer, jnp.zeros((rows, *rest), x.dtype), jax.tree.map(lambda w: w[0], params))
    send = _send(p, m, v)
    xs = x.reshape(rows, m, *rest).swapaxes(0, 1)  # microbatch j: local rows j, j + m, ...
    chunks = jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), params)
    me = jax.lax.axis_index(PIPELINE_AXIS)

    def stage(weights, h):  # one chunk: its layers in order, each rematerialised
        return jax.lax.scan(lambda h, one: (jax.checkpoint(layer)(h, one), None), h, weights)[0]

    def iteration(carry, t):
        state, held, outputs = carry
        u = t - me  # this stage's work item: repeat u // m of microbatch u % m
        busy = (u >= 0) & (u < v * m)
        r, j = jnp.clip(u, 0, v * m - 1) // m, jnp.clip(u, 0, v * m - 1) % m
        fresh = jax.lax.dynamic_index_in_dim(xs, j, 0, keepdims=False)
        if v > 1:  # stage 0 keeps what the last stage sent (item t - p) for its next repeat
            back = t - p
            kept = jax.lax.dynamic_update_index_in_dim(held, state, jnp.clip(back, 0, v * m - 1) % m, 0)
            held = jnp.where((me == 0) & (back >= 0), kept, held)
            fresh = jnp.where(r == 0, fresh, jax.lax.dynamic_index_in_dim(held, j, 0, keepdims=False))
        weights = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, r, 0, keepdims=False), chunks)
        out = stage(weights, jnp.where(busy, jnp.where(me == 0, fresh, state), jnp.zeros_like(state)))
        last = jax.lax.dynamic_index_in_dim(outputs, j, 0, keepdims=False)
        done = jnp.where((me == p - 1) & busy & (r == v - 1), out, last)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, done, j, 0)
        return (send(out, t), held, outputs), None

    with inside():
        held = jnp.zeros((m if v > 1 else 0, rows, *rest), x.dtype)
        carry = (jnp.full((rows, *rest), fill, x.dtype), held, jnp.zeros((m, rows, *rest), x.dtype))
        (_, _, outputs), _ = jax.lax.scan(iteration, carry, jnp.arange(v * m + p - 1))
    # the last stage holds the outputs; every stage runs what follows the stack
    outputs = (_from_last_stage if own_grads else _sum_from_last)(outputs, p)
    return outputs.swapaxes(0, 1).reshape(x.shape)


def senders(stages: int, microbatches: int, repeats: int) -> list[tuple[int, ...]]:
    """For each iteration of the loop, the stages that send their output on: those that worked on
    an item that has a next stage (GPipe's last stage has none; under the circular schedule the last
    stage sends each item's output round to stage 0 but for its last repeat)."""
    p, m, v = stages, microbatches, repeats
    last = (v - 1) * m  # the first item of the last repeat

    def sends(s: int, u: int) -> bool:
        return 0 <= u < v * m and (s < p - 1 or u < last)

    return [tuple(s for s in range(p) if sends(s, t - s)) for t in range(v * m + p - 1)]


def _send(p: int, m: int, v: int):
    """`send(out, t)`: iteration t's stage-to-stage shift, from the stages that send in it alone, so
    a stage that idled sends nothing: 2 v m microbatches cross a stage boundary a step (forward and
    backward), not 2 (v m + p - 1). Each set of sending stages the loop meets (those filling the
    pipeline, all of them, those draining it) is one `ppermute`, chosen by a `lax.switch` on the
    iteration: every device takes the same branch, and the backward transposes each into its
    reverse shift. Compile time, peak and step time measured the same as one `ppermute` from
    every stage (a 16-layer GPT, p = 4, m = 4 and v = 4, m = 8, jax 0.10, CPU)."""
    each = senders(p, m, v)
    sets = sorted(set(each), key=each.index)
    index = np.array([sets.index(s) for s in each], np.int32)

    def shift(sources):
        if not sources:
            return jnp.zeros_like
        return functools.partial(jax.lax.ppermute, axis_name=PIPELINE_AXIS, perm=[(s, (s + 1) % p) for s in sources])

    return lambda out, t: jax.lax.switch(jnp.asarray(index)[t], [shift(s) for s in sets], out)


def _sum_from_last(outputs, p: int):
    me = jax.lax.axis_index(PIPELINE_AXIS)
    return jax.lax.psum(jnp.where(me == p - 1, outputs, jnp.zeros_like(outputs)), PIPELINE_AXIS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _from_last_stage(outputs, p: int):
    return _sum_from_last(outputs, p)


def _from_last_stage_fwd(outputs, p: int):
    return _sum_from_last(outputs, p), None


def _from_last_stage_bwd(p: int, _, ct):
    # every stage's loss is the same one: its gradient enters the stack once, at the last stage
    return (jnp.where(jax.lax.axis_index(PIPELINE_AXIS) == p - 1, ct, jnp.zeros_like(ct)),)


_from_last_stage.defvjp(_from_last_stage_fwd, _from_last_stage_bwd)


@jax.custom_vjp
def _summed_cotangent(x):
    return x


_summed_cotangent.defvjp(lambda x: (x, None), lambda _, ct: (jax.lax.psum(ct, PIPELINE_AXIS),))


def _stage_spec(ndim: int, fsdp_axis: int | None):
    """A stacked leaf inside the loop: its layers split over `pipeline`, and over `fsdp` on
    `fsdp_axis` where the layers gather it per microbatch."""
    entries: list = [PIPELINE_AXIS] + [None] * (ndim - 1)
    if fsdp_axis is not None:
        entries[fsdp_axis] = FSDP_AXIS
    return P(*entries)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a GPipe step's iterations a stage idles: (p - 1) / (v m + p - 1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)
