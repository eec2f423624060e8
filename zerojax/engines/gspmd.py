"""The `gspmd` engine: the step is written for one big device; shardings on the state and sharding
constraints on the gradients let XLA's SPMD partitioner insert every collective."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from zerojax.adapt import units as units_lib
from zerojax.adapt.stacked import at
from zerojax.core import constraints as activations
from zerojax.core.leaf_rule import LeafLayout
from zerojax.core.loss import global_loss
from zerojax.core.mesh import pipeline_size
from zerojax.core.trees import batch_rows
from zerojax.engines import BuiltStep, EngineOptions, GatherReport, kept_whole_report, pipeline, replicated_report
from zerojax.engines.batch_statistics import check_state_is_global
from zerojax.engines.gspmd_accum import accumulated_grads, runs_in_groups
from zerojax.engines.unit_plan import (
    describe_stacks,
    is_layout,
    materialize_tree,
    outside_stacks,
    stack_paths,
    unit_around,
)
from zerojax.engines.update import apply_update, compute_params, constrain, keep_model_state, step_key
from zerojax.errors import UserError

SUPPORTS = (
    "layer_stacks",
    "prefetch",
    "wrap",
    "reshard_after_forward",
    "checked_update",
    "pipeline_gather",
    "whole_micro_batches",
)  # `EngineOptions` fields


def _whole(layout, layouts, tree):
    """`tree` (params laid out as `layouts`, or one layer's `nnx.State`) gathered over FSDP: each leaf
    whole but for its tensor-parallel split, which every stage keeps."""
    out = materialize_tree(
        layouts, tree, lambda leaves, values: list(map(functools.partial(_whole_leaf, layout), leaves, values))
    )
    return nnx.State(out) if isinstance(tree, nnx.State) else out


def _whole_leaf(layout, leaf: LeafLayout, value):
    return jax.lax.with_sharding_constraint(value, NamedSharding(layout.mesh, leaf.spec(False)))


def _gather_where_used(layout, model, params, options):
    """Stage 3: ask for whole weights at the point of use, so XLA all-gathers weights (FSDP).

    Left alone, the partitioner keeps the weights sharded and splits each matmul over them instead,
    moving activations that grow with the batch. Stacked layers (`zj.Stacked`, or the GPT's blocks)
    are gathered one layer at a time inside the scan (a layer hook per stack); the rest, or a model
    without stacks, at once. The gradient still comes back as an all-reduce and a slice on this
    backend (4 units of traffic where FSDP needs 3), which is what the `shard_map` engine is for.
    """
    if not layout.compute_sharded:
        return params, None
    stacks = stack_paths(model, params, options)
    if not stacks:
        return _whole(layout, layout.leaves, params), None
    outside = outside_stacks(functools.partial(_whole_leaf, layout), stacks, layout.leaves, params)
    layers = {s: jax.tree.map(LeafLayout.one_layer, at(layout.leaves, s), is_leaf=is_layout) for s in stacks}
    if not model.stacks:  # a model's own layer hook
        return outside, {s: functools.partial(_whole, layout, layers[s]) for s in stacks}
    # `zj.Stacked`: a barrier between the layer's slice and its gather keeps XLA:CPU's layout
    # assignment from re-laying out the whole stacked shard for the gather (a copy of 1/fsdp of the
    # stack's weights held for the whole step; docs/engines.md). Values are unchanged; elsewhere it
    # only orders the slice before the gather.
    return outside, {
        s: (lambda layer, s=s: _whole(layout, layers[s], jax.lax.optimization_barrier(layer))) for s in stacks
    }


def _report(layout, model) -> GatherReport:
    if not layout.compute_sharded:
        return replicated_report(layout.stage)
    if model.accepts_layer_hook:
        return GatherReport(
            "layers",
            "per layer, where used: stacked layers inside the scan, the rest at once"
            + (f" (stacks {describe_stacks(model.stacks)})" if model.stacks else ""),
        )
    return GatherReport("whole", "whole model gathered at once (no layer hook)")


def _units(layout, model, static, options, inputs, model_state):
    """Stage 3, a model without a layer hook: (report, around) making the wrap rule's submodules FSDP
    units, each asking for its whole weights inside its own rematerialised call (see `zerojax.adapt.units`),
    or None where no unit matches (the whole model is then gathered at once)."""
    rule = units_lib.as_rule(options.wrap)
    if not layout.compute_sharded or model.accepts_layer_hook or rule is None or model.unit_around is None:
        return None

    def materialize(leaves, values):
        # Sharded first, then whole: the partitioner gathers this (tied) value, not the untied param
        # it could otherwise propagate the whole sharding back to (and merge with the other pass's gather).
        # The gradient's transpose is the same pair, so each unit's gradient is reduced inside its backward.
        return [
            jax.lax.with_sharding_constraint(
                jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, leaf.spec(True))),
                NamedSharding(layout.mesh, leaf.spec(False)),
            )
            for leaf, x in zip(leaves, values)
        ]

    report, around = unit_around(
        layout, model, static, rule, materialize, inputs, model_state, wait_for_grads=True, prefetch=options.prefetch
    )
    return (report, around) if report.route == "units" else None


def _pipelined(layout, model, static, options: EngineOptions, schedule: pipeline.Schedule):
    """A `run` for a `pipeline` mesh axis: the model's stack of layers through GPipe or the circular
    schedule (`zerojax.engines.pipeline`). At stage 3 every weight is gathered over FSDP once per
    step (each pipeline stage's layers on its own devices) and the gradient reduced once after the
    last microbatch; or, with `pipeline_gather="per_microbatch"`, each stacked layer is gathered as
    it runs for every microbatch."""
    stacks = stack_paths(model, layout.leaves, options)
    pipeline.check_model(model, stacks, layout.mesh)
    pipeline.check_options(options, layout.mesh)
    per_microbatch = pipeline.gathers_each_layer(options.pipeline_gather, layout.stage, layout.mesh)
    microbatches, repeats = schedule.microbatches_on(layout.mesh), schedule.repeats

    def loop(stack, rows, layer, x, stacked):
        pipeline.check_schedule(layout.mesh, rows, microbatches, (x, rows))
        inside = functools.partial(activations.rules_active, layout, manual=True)
        run = functools.partial(
            pipeline.gpipe, mesh=layout.mesh, microbatches=microbatches, repeats=repeats, inside=inside
        )
        if not layout.compute_sharded:
            return run(layer, x, stacked)
        return _split_loop(layout, stack, functools.partial(run, gather_each_layer=per_microbatch), layer, x, stacked)

    def run(params, model_state, batch, key, train):
        if layout.compute_sharded:
            params = outside_stacks(functools.partial(_whole_leaf, layout), stacks, layout.leaves, params)
        with activations.rules_active(layout, manual=False):
            return model.apply(
                params,
                model_state or {},
                static,
                batch["inputs"],
                rng=key,
                train=train,
                layer_loop={s: functools.partial(loop, s, batch_rows(batch["inputs"])) for s in stacks},
            )

    gathers = None
    if layout.compute_sharded:
        gathers = pipeline.PER_MICROBATCH if per_microbatch else pipeline.ONCE_PER_PASS
    report = GatherReport("layers", pipeline.describe(describe_stacks(stacks), layout.mesh, schedule, gathers))
    return run, report


def _split_loop(layout, stack, gpipe, layer, x, stacked):
    """`gpipe` over a stage-3 stack: the leaves fsdp splits evenly enter the loop split
    (`gather_axes`, gathered inside it, so their gradient is reduce-scattered), the rest whole;
    `layer` still gets its params as the model built them (an `nnx.State`, or a dict)."""
    leaves, tree = jax.tree.flatten(at(layout.leaves, stack), is_leaf=is_layout)
    values = tree.flatten_up_to(nnx.to_pure_dict(stacked) if isinstance(stacked, nnx.State) else stacked)
    axes = [_split_axis(layout, leaf, value) for leaf, value in zip(leaves, values)]
    values = [v if a is not None else _whole_leaf(layout, leaf, v) for leaf, v, a in zip(leaves, values, axes)]

    def one_layer(h, layer_values):
        params = tree.unflatten(layer_values)
        return layer(h, nnx.State(params) if isinstance(stacked, nnx.State) else params)

    return gpipe(one_layer, x, values, gather_axes=axes)


def _split_axis(layout, leaf: LeafLayout, value) -> int | None:
    """The axis a stacked leaf's layers gather over fsdp inside the pipeline loop: its fsdp axis where
    its logical size splits evenly (a padded leaf is gathered whole before the loop instead)."""
    fsdp = dict(layout.mesh.shape).get("fsdp", 1)
    return leaf.axis if leaf.axis is not None and value.shape[leaf.axis] % fsdp == 0 else None


def _pipelined_step(layout, model, static, loss_fn, tx, options, inputs, model_state, grad_accum, schedule):
    piped, report = _pipelined(layout, model, static, options, schedule or pipeline.Schedule())
    if grad_accum > 1 and layout.compute_sharded and not options.reshard_after_forward:
        raise UserError(
            "zero.reshard_after_forward=false with train.grad_accum > 1 on a pipeline keeps a stage's gathered "
            "weights across micro-batches on the shard_map engine only; the gspmd engine gathers them per "
            "micro-batch (set zero.reshard_after_forward=true, or use zero.engine=shard_map)."
        )
    if grad_accum > 1:  # each micro-batch through the pipeline: a per-group vmap would leave it out
        grads = _accumulated(accumulated_grads(layout, model, static, loss_fn, piped, grad_accum, False, whole=True))
    else:
        grads = _grads(layout, loss_fn, piped)
    return BuiltStep(grads, _update(layout, tx, options), report, _evaluate(layout, piped))


def _check_group_statistics(layout, model, static, inputs, model_state, keep: bool) -> None:
    """Accumulating in data-parallel groups (`runs_in_groups`), a model's own statistic would be a group's."""
    if runs_in_groups(layout, keep):
        check_state_is_global(layout, model, static, inputs, model_state, _IN_GROUPS, _global_instead(keep))


_IN_GROUPS = (
    "accumulating over whole compute params (train.grad_accum > 1 at stages 0-2, or stage 3 keeping its "
    "gathered weights), the gspmd engine runs the model once per data-parallel group, on the group's rows"
)


def _global_instead(keep: bool) -> str:
    instead = "run it on whole micro-batches instead: "
    if keep:
        return instead + "zero.reshard_after_forward=true"
    return instead + "zero.whole_micro_batches=true, or train.grad_accum=1"


def build(
    layout,
    model,
    static,
    loss_fn,
    tx,
    options: EngineOptions,
    inputs=None,
    model_state=None,
    grad_accum: int = 1,
    schedule: pipeline.Schedule | None = None,
) -> BuiltStep:
    """The step; `schedule`: a `pipeline` mesh axis's microbatches and repeats (None: GPipe, one
    microbatch a pipeline stage)."""
    if pipeline_size(layout.mesh) > 1:
        return _pipelined_step(layout, model, static, loss_fn, tx, options, inputs, model_state, grad_accum, schedule)
    pipeline.gathers_each_layer(options.pipeline_gather, layout.stage, layout.mesh)  # set without a pipeline
    units = _units(layout, model, static, options, inputs, model_state or {})
    around = units[1] if units else None
    if options.prefetch and layout.compute_sharded and model.accepts_layer_hook:
        raise UserError(
            "the gspmd engine prefetches FSDP units only (user models without zj.Stacked or a layer "
            "hook); for a model's layer stack, prefetch=True needs engine shard_map."
        )

    def run(params, model_state, batch, key, train):
        hook = None
        if around is None:
            params, hook = _gather_where_used(layout, model, params, options)
        with activations.rules_active(layout, manual=False):
            return model.apply(
                params, model_state or {}, static, batch["inputs"], rng=key, train=train, layer_hook=hook, around=around
            )

    evaluate = _evaluate(layout, run)
    keep = layout.compute_sharded and not options.reshard_after_forward
    if keep and options.whole_micro_batches:
        raise UserError(
            "zero.whole_micro_batches=true reduces each micro-batch's gradient, and "
            "zero.reshard_after_forward=false keeps the gathered weights to reduce once a step: choose one."
        )
    if grad_accum > 1 or keep:
        whole = options.whole_micro_batches
        if not whole:
            _check_group_statistics(layout, model, static, inputs, model_state, keep)
        accumulated = accumulated_grads(layout, model, static, loss_fn, run, grad_accum, keep, whole)
        grads, update = _accumulated(accumulated), _update(layout, tx, options)
    else:
        # The update may read the gradient shards twice (check, then write in place) where they are
        # buffers of their own: casts' outputs in the compute dtype, or held by each FSDP unit's
        # backward (`zerojax.adapt.ordering.held_on_cpu`). An fp32 "shard" outside units is a slice of the
        # full all-reduced gradient on XLA:CPU, which a second reader would keep alive.
        shards_are_buffers = layout.precision.compute_dtype != jnp.float32 or around is not None
        grads, update = _grads(layout, loss_fn, run), _update(layout, tx, options, shards_are_buffers)
    report = units[0] if units else _report(layout, model)
    report = kept_whole_report(layout.stage) if keep else report
    return BuiltStep(grads, update, report, evaluate, _compiler_options(layout))


def _compiler_options(layout) -> tuple[tuple[str, str], ...]:
    """Stage 3 on XLA:CPU: without a reduce-scatter there, each leaf's gradient is all-reduced whole
    and then sliced to its shard, and XLA:CPU's all-reduce combiner joins a layer's reductions into
    one, whose operands and results all live together: a layer's fp32 gradient twice. Left leaf by
    leaf, the 26M-parameter decoder's bf16 peak falls from 75.9 to 70.4 MiB (jax 0.12), and the step
    runs as fast (1.24 s against 1.28 s); the other stages and the shard_map engine (which
    reduce-scatters) gain nothing from it (docs/engines.md)."""
    if layout.compute_sharded and layout.mesh.devices.flat[0].platform == "cpu":
        return (("xla_disable_hlo_passes", "cpu-all-reduce-combiner"),)
    return ()


def _evaluate(layout, run):
    def evaluate(state, batch, loss_fn):  # eval mode, gathered as the step's forward gathers
        return global_loss(loss_fn(run(compute_params(layout, state), state.model_state, batch, None, False)[0], batch))

    return evaluate


def _accumulated(accumulated):
    def grads(state, batch):
        return accumulated(state, batch, step_key(state))

    return grads


def _update(layout, tx, options: EngineOptions, check_first: bool = True):
    def update(state, loss, grads, model_state):
        new_state, metrics = apply_update(
            layout, tx, state, grads, loss, options.checked_update, check_first=check_first
        )
        return keep_model_state(new_state, model_state, metrics["bad_step"]), {"loss": loss, **metrics}

    return update


def _grads(layout, loss_fn, run):
    def grads(state, batch):
        # One draw over the global batch: the masks depend on the global shape and the key, not on
        # the stage or (with jax_threefry_partitionable, the default) on the device count.
        key = step_key(state)

        def loss_of(params):
            out, model_state = run(params, state.model_state, batch, key, train=True)
            return global_loss(loss_fn(out, batch)), model_state

        (loss, model_state), grads = jax.value_and_grad(loss_of, has_aux=True)(compute_params(layout, state))
        # Stages 2-3 ask for sharded gradients, which XLA can meet with a reduce-scatter;
        # stages 0-1 ask for the full all-reduced gradient.
        grads = layout.to_layout(grads, layout.grads_sharded)
        return loss, constrain(grads, layout.shardings(layout.grads_sharded)), model_state

    return grads
