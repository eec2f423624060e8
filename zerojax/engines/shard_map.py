"""The `shard_map` engine: the forward and backward run once per device, every collective placed by hand.

stage 3  each layer's fp32 shard is cast to the compute dtype, then all-gathered inside the scanned,
         rematerialised block; the backward pass gathers it again (remat) and reduce-scatters that
         layer's gradient (the gather's transpose) inside the loop, one layer at a time.
stage 2  compute params are replicated, but each layer's gradient is reduce-scattered inside the
         backward loop, so the full gradient never exists at once.
stage 1  the whole local gradient is reduce-scattered once, after the backward pass.
stage 0  the whole local gradient is all-reduced.
The optimizer then updates the shards (`apply_update`, outside the shard_map: it is elementwise), and
the updated compute copy is all-gathered. Gradients cross devices in `precision.reduce_dtype`.

How parameters are gathered: `zerojax.engines.shard_map_routes`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.core import constraints as activations
from zerojax.core.layout import StateLayout
from zerojax.core.leaf_rule import LeafLayout
from zerojax.core.loss import loss_parts
from zerojax.core.mesh import BATCH_AXES, FSDP_AXIS, PIPELINE_AXIS, TENSOR_AXIS, data_parallel_size, pipeline_size
from zerojax.core.stages import Stage
from zerojax.engines import (
    BuiltStep,
    EngineOptions,
    GatherReport,
    accum,
    kept_whole_report,
    pipeline,
    shard_map_pipeline,
)
from zerojax.engines.batch_statistics import check_state_is_global
from zerojax.engines.collectives import Reduce, Resident
from zerojax.engines.pipeline import Schedule, check_options
from zerojax.engines.quantize import Quantizer
from zerojax.engines.shard_map_routes import RunModel, route
from zerojax.engines.unit_plan import is_layout, stack_paths
from zerojax.engines.update import apply_update, compute_params, keep_model_state, step_key
from zerojax.errors import UserError

SUPPORTS = (
    "layer_stacks",
    "prefetch",
    "wrap",
    "reshard_after_forward",
    "quantize_weights",
    "quantize_grads",
    "quantize_block",
    "hierarchical",
    "checked_update",
    "pipeline_gather",
)


def _local_shape(leaf: LeafLayout, mesh) -> tuple[int, ...]:
    """A device's shard of a sharded leaf: split over every mesh axis of its `over`."""
    if leaf.axis is None:
        return leaf.shape
    shape = list(leaf.padded_shape)
    shape[leaf.axis] //= math.prod(mesh.shape[a] for a in leaf.over)
    return tuple(shape)


# ---- the step ------------------------------------------------------------------------------------


def _specs(layout: StateLayout, sharded: bool):
    """The leaves' specs over the manual axes only: `tensor` stays with the partitioner (`_manual`)."""
    return jax.tree.map(lambda l: _without_tensor(l.spec(sharded)), layout.leaves, is_leaf=is_layout)


def _without_tensor(spec):
    return P(*(None if entry == TENSOR_AXIS else entry for entry in spec))


_PER_DEVICE = "under engine='shard_map' each device runs the model on its own rows"


def _manual(fn, layout: StateLayout, in_specs, out_specs):
    """`fn` once per device over the data-parallel axes (and `pipeline`), every collective placed by hand; a `tensor`
    axis is left automatic (shard_map's partial manual axes), so XLA's partitioner splits each
    matmul over it as the parameters' tensor-parallel shardings ask (Megatron's collectives)."""
    axes = (*BATCH_AXES, PIPELINE_AXIS) if pipeline_size(layout.mesh) > 1 else BATCH_AXES
    manual = {} if dict(layout.mesh.shape).get(TENSOR_AXIS, 1) == 1 else {"axis_names": frozenset(axes)}

    def body(*args):
        with activations.rules_active(layout, manual=True):
            return fn(*args)

    return jax.shard_map(body, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **manual)


def _device_leaves(layout: StateLayout):
    """The leaves' layouts as a device inside the region holds them: a stacked leaf's own pipeline
    stage's layers (`LeafLayout.pipeline_stage`), which is what its local gradient covers."""
    return jax.tree.map(LeafLayout.pipeline_stage, layout.leaves, is_leaf=is_layout)


def _grads_fn(layout: StateLayout, run_model: RunModel, loss_fn, reduce: Reduce):
    """shard_map'd `(params, batch) -> (loss, grads)`, gradients reduced as the stage asks."""
    stage, leaves, mesh = layout.stage, _device_leaves(layout), layout.mesh
    dp = data_parallel_size(mesh)

    def local(params, model_state, key, batch):
        """Per device: loss and gradient of the local batch, reduced as the stage asks."""
        # Each device draws its own masks (its key folded with its index on the batch axes): the same
        # at every stage, since the mesh and the local batch are; they differ from GSPMD's masks.
        key = jax.random.fold_in(jax.random.wrap_key_data(key), jax.lax.axis_index(BATCH_AXES))
        fixed = params if stage.resident_compute else None
        if stage.resident_compute:  # differentiate w.r.t. shard-shaped zeros: see `Resident`
            params = jax.tree.map(
                lambda l: jnp.zeros(_local_shape(l, mesh), reduce.reduce_dtype), leaves, is_leaf=is_layout
            )

        def loss_of(diff):
            raw = jax.tree.map(Resident, fixed, diff) if fixed is not None else diff
            if reduce.hierarchical:  # hpZ: the secondary copy, gathered over data once per step
                raw = jax.tree.map(reduce.secondary, leaves, raw, is_leaf=is_layout)
            out, new_model_state = run_model(raw, model_state, batch["inputs"], key)
            total, weight = loss_parts(loss_fn(out, batch))
            # A scalar is a mean over rows: each device's mean over its equal share, divided by the
            # number of shares, summed across devices. A WeightedLoss is sum(total) / sum(weight): each
            # device's total over the global weight, so a device whose rows all weigh 0 adds 0.
            if weight is None:
                return total / dp, new_model_state
            return total / jax.lax.psum(weight, BATCH_AXES), new_model_state

        (loss, new_model_state), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        if not stage.gradients:  # reduced once, after the backward pass
            grads = _reduced(reduce, stage, leaves, grads)
        return jax.lax.psum(loss, BATCH_AXES), grads, new_model_state

    return _per_device(layout, local)


def _accum_grads_fn(layout: StateLayout, run_model: RunModel, loss_fn, reduce: Reduce, k: int, gather_first: bool):
    """`_grads_fn` over k micro-batches of each device's rows, in one `lax.scan`.

    Stage 3 (`run_model` materialising from shards): every micro-batch gathers each leaf and
    reduce-scatters its gradient (the gather's transpose); the shards are accumulated in fp32.
    Otherwise (`run_model` on whole compute params: stages 0-2, or stage 3 with `gather_first`, its
    leaves gathered once before the scan) each device accumulates its unreduced local gradient in
    fp32 and the step reduces it once, after the scan: an all-reduce at stage 0, a reduce-scatter
    at stages 1-3.
    """
    stage, leaves, mesh = layout.stage, _device_leaves(layout), layout.mesh
    dp = data_parallel_size(mesh)
    psum_weight = lambda w: jax.lax.psum(w, BATCH_AXES)  # noqa: E731

    def local(params, model_state, key, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(key), jax.lax.axis_index(BATCH_AXES))
        if gather_first:
            params = jax.tree.map(lambda l, x: reduce.shard_gather(x, l), leaves, params, is_leaf=is_layout)
        micro = jax.tree.map(lambda x: accum.split(x, k)[:, 0], batch)  # (k, rows / k, ...)

        def micro_grads(acc, model_state, xs):
            i, mb = xs

            def loss_of(p):
                out, new_state = run_model(p, model_state, mb["inputs"], jax.random.fold_in(key, i))
                # a mean over rows: each device's mean over its share, divided by the number of shares
                loss, scale, weight = accum.parts(loss_fn(out, mb), psum_weight, shares=dp)
                return loss, (scale, weight, new_state)

            (loss, (scale, weight, new_state)), g = jax.value_and_grad(loss_of, has_aux=True)(params)
            return accum.add_scaled(acc, g, scale), scale * loss, weight, new_state

        zeros = accum.zeros_f32(params)  # no accumulator for a frozen leaf: its gradient is zero
        loss, acc, weight, new_model_state = accum.accumulate(
            micro_grads, layout.trained(zeros), model_state, (jnp.arange(k), micro)
        )
        grads = layout.frozen_from(zeros, jax.tree.map(lambda a: a / weight, acc))
        if not stage.compute_params or gather_first:  # whole local gradients: reduced once, now
            grads = _reduced(reduce, stage, leaves, grads)
        if stage.compute_params:  # fp32 shard sums, in the master's dtype
            grads = jax.tree.map(lambda g: g.astype(reduce.master_dtype), grads)
        return jax.lax.psum(loss, BATCH_AXES) / weight, grads, new_model_state

    return _per_device(layout, local)


def _reduced(reduce: Reduce, stage, leaves, grads):
    """Whole local gradients reduced once: onto each device's shard where the stage shards the
    master params, else all-reduced."""
    one = (lambda l, g: reduce.to_shard(g, l)) if stage.master_params else (lambda l, g: reduce.to_all(g))
    return jax.tree.map(
        lambda l, g: one(l, g) if l.trainable else _unreduced(one, l, g), leaves, grads, is_leaf=is_layout
    )


def _unreduced(reduce_one, leaf, grad):
    """A frozen leaf's zero gradient in the reduced gradient's shape and dtype, reducing nothing."""
    out = jax.eval_shape(lambda g: reduce_one(leaf, g), grad)
    return jnp.zeros(out.shape, out.dtype)


def _per_device(layout: StateLayout, local):
    """`local(params, model_state, key, batch) -> (loss, grads, model_state)` as a shard_map: params in
    as stored (shards where the compute params are sharded), gradients out as the master is."""
    stage = layout.stage
    return _manual(
        local,
        layout,
        in_specs=(_specs(layout, stage.compute_params), P(), P(), P(BATCH_AXES)),
        out_specs=(P(), _specs(layout, stage.master_params), P()),
    )


def _eval_fn(layout: StateLayout, run_model: RunModel, reduce: Reduce):
    """Stage 3: `(state, batch, loss_fn) -> loss` in eval mode, each device gathering the params as
    the step's forward does (one gather of each leaf) and running its share of the batch."""
    dp = data_parallel_size(layout.mesh)

    def evaluate(state, batch, loss_fn):
        def local(params, model_state, batch):
            if reduce.hierarchical:
                params = jax.tree.map(reduce.secondary, layout.leaves, params, is_leaf=is_layout)
            out, _ = run_model(params, model_state, batch["inputs"], None, train=False)
            total, weight = loss_parts(loss_fn(out, batch))
            if weight is None:
                return jax.lax.psum(total / dp, BATCH_AXES)
            return jax.lax.psum(total, BATCH_AXES) / jax.lax.psum(weight, BATCH_AXES)

        return _manual(local, layout, in_specs=(_specs(layout, True), P(), P(BATCH_AXES)), out_specs=P())(
            state.params, state.model_state or {}, batch
        )

    return evaluate


def _hierarchical(options: EngineOptions, stage: Stage, grad_accum: int) -> bool:
    """hpZ's option, checked: stage 3, one micro-batch per step, weights re-gathered in backward."""
    if options.hierarchical and (not stage.compute_params or grad_accum > 1 or not options.reshard_after_forward):
        raise UserError(
            "zero.hierarchical (hpZ) needs zero.stage=3, train.grad_accum=1 and "
            f"zero.reshard_after_forward=true; got stage {stage.index}, grad_accum {grad_accum}, "
            f"reshard_after_forward {options.reshard_after_forward}."
        )
    return options.hierarchical


def _quantizers(options: EngineOptions, stage: Stage):
    """(qwZ, qgZ) quantizers of the options, None where off; UserError where the stage has no such collective."""
    weights = grads = None
    if options.quantize_weights is not None:
        if not stage.compute_params:
            raise UserError(
                f"zero.quantize_weights quantizes stage 3's weight gathers; stage {stage.index} has none "
                "(use zero.stage=3, or leave zero.quantize_weights unset)."
            )
        weights = Quantizer(options.quantize_weights, options.quantize_block)
    if options.quantize_grads is not None:
        if options.quantize_grads != "int8":
            raise UserError(f"zero.quantize_grads must be int8, got {options.quantize_grads!r}.")
        if not stage.master_params:
            raise UserError(
                "zero.quantize_grads quantizes the gradient reduce-scatter of stages 1-3; stage 0 "
                "all-reduces the whole gradient instead (use zero.stage 1, 2 or 3)."
            )
        grads = Quantizer(options.quantize_grads, options.quantize_block)
    return weights, grads


def build(
    layout: StateLayout,
    model,
    static,
    loss_fn,
    tx,
    options: EngineOptions,
    inputs,
    model_state=None,
    grad_accum: int = 1,
    schedule=None,
) -> BuiltStep:
    """`step(state, batch) -> (state, metrics)` and how it gathers params (`inputs`: the abstract
    model inputs, for finding a model's submodules before it is traced).

    options.prefetch      stage 3: gather layer i+1 while layer i computes (layers route), or unit i+1's
                          weights while unit i computes, forward and backward (units route).
    options.wrap          FSDP units for models without a layer hook: "auto", "none", classes or a WrapRule.
    options.layer_stacks  top-level param names whose leaves stack layers on axis 0 and go through the hook.
    options.reshard_after_forward  stage 3: False gathers the whole model once per step and keeps it.
    grad_accum            k micro-batches per step (see `_accum_grads_fn`).
    schedule              a `pipeline` mesh axis's microbatches (GPipe: `zerojax.engines.shard_map_pipeline`).
    """
    schedule = schedule or Schedule()
    check_state_is_global(
        layout, model, static, inputs, model_state, _PER_DEVICE, "use engine='gspmd', which runs it on the global batch"
    )
    if pipeline_size(layout.mesh) > 1:
        check_options(options, layout.mesh)
    stage, prec = layout.stage, layout.precision
    replicas = tuple(a for a in BATCH_AXES if a != FSDP_AXIS and layout.mesh.shape[a] > 1)
    quantize_weights, quantize_grads = _quantizers(options, stage)
    hierarchical = _hierarchical(options, stage, grad_accum)
    reduce = Reduce(
        replicas,
        prec.compute_dtype,
        prec.reduce_dtype,
        prec.master_dtype,
        quantize_weights,
        quantize_grads,
        hierarchical=hierarchical,
    )
    if pipeline_size(layout.mesh) > 1:
        stacks = stack_paths(model, layout.leaves, options)
        report, run_model = shard_map_pipeline.route(layout, model, static, stacks, reduce, options, schedule)
        whole_route = shard_map_pipeline.route(layout, model, static, stacks, reduce, options, schedule, whole=True)
    else:
        pipeline.gathers_each_layer(options.pipeline_gather, stage, layout.mesh)  # set without a pipeline
        report, run_model = route(layout, model, static, options, reduce, inputs, model_state or {})
        whole_route = None
    train_report, grads_fn = _train_grads(
        layout, model, static, loss_fn, options, reduce, report, run_model, grad_accum, whole_route
    )
    update = _update(layout, tx, options, reduce)
    evaluate = _eval_fn(layout, run_model, reduce) if stage.compute_params else None
    return BuiltStep(_grads(layout, grads_fn), update, train_report, evaluate)


def _train_grads(layout, model, static, loss_fn, options, reduce, report, run_model, grad_accum, whole_route=None):
    """(the training step's GatherReport, its shard_map'd `(params, model_state, key, batch) -> (loss,
    grads, model_state)`). Micro-batches differentiate the whole compute params (reduced once, after
    the scan) where the stage keeps them resident or stage 3 keeps its gathered weights for the step;
    `whole_route`: a pipeline's (report, run) for such whole params."""
    stage = layout.stage
    keep = stage.compute_params and not options.reshard_after_forward
    if grad_accum == 1 and not keep:
        return report, _grads_fn(layout, run_model, loss_fn, reduce)
    if not (stage.resident_compute or keep):
        return report, _accum_grads_fn(layout, run_model, loss_fn, reduce, grad_accum, False)
    run_whole = whole_route[1] if whole_route else None
    if keep and whole_route:  # a pipeline: its stage's weights, kept across micro-batches
        train_report = whole_route[0]
    elif keep:
        train_report = kept_whole_report(stage)
    else:
        text = "compute params are replicated, the local gradient reduce-scattered once per step"
        piped = f"{report.description}; " if whole_route else ""  # each micro-batch through the pipeline
        train_report = GatherReport("replicated", f"{piped}stage {stage.index} with gradient accumulation: {text}")

    def whole(raw, ms, x, key, train=True):
        return model.apply(raw, ms, static, x, rng=key, train=train, sync=BATCH_AXES)

    return train_report, _accum_grads_fn(layout, run_whole or whole, loss_fn, reduce, grad_accum, keep)


def _grads(layout: StateLayout, grads_fn):
    """The step's gradients: `grads_fn` on the stored params (shards at stage 3) and the step's key."""

    def grads(state, batch):
        params = state.params if layout.stage.compute_params else compute_params(layout, state)
        return grads_fn(params, state.model_state or {}, jax.random.key_data(step_key(state)), batch)

    return grads


def _update(layout: StateLayout, tx, options: EngineOptions, reduce: Reduce):
    """The sharded update and, where the state keeps a replicated compute copy beside a sharded
    master, the new copy gathered from the cast shards."""
    # The frozen leaves have no compute copy (`StateLayout.trained`): None in and out. A stacked
    # leaf on a pipeline is gathered as this device holds it: its own pipeline stage's layers.
    gather_compute = _manual(
        lambda params: jax.tree.map(
            lambda l, x: None if x is None else reduce.cast_gather(x, l),
            _device_leaves(layout),
            params,
            is_leaf=is_layout,
        ),
        layout,
        in_specs=(layout.trained(_specs(layout, True)),),
        out_specs=layout.trained(_specs(layout, False)),
    )

    def update(state, loss, grads, model_state):
        new_state, metrics = apply_update(layout, tx, state, grads, loss, options.checked_update)
        new_state = keep_model_state(new_state, model_state, metrics["bad_step"])
        if layout.keeps_compute_copy and layout.master_sharded:  # params already kept if bad
            new_state = new_state.replace(compute=gather_compute(layout.trained(new_state.params)))
        return new_state, {"loss": loss, **metrics}

    return update
