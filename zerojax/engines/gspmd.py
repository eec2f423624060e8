"""The `gspmd` engine: the step is written for one big device; shardings on the state and sharding
constraints on the gradients let XLA's SPMD partitioner insert every collective."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.stages import LeafLayout
from zerojax.engines import BuiltStep, EngineOptions, GatherReport
from zerojax import wrap as wrap_lib
from zerojax.engines.common import (apply_update, compute_params, constrain, describe_stacks, global_loss,
                                     keep_model_state, outside_stacks, stack_paths, step_key, unit_around)
from zerojax.engines import accum
from zerojax.mesh import BATCH_AXES, data_parallel_size

SUPPORTS = ("layer_stacks", "wrap", "reshard_after_forward", "grad_accum")
_GROUPS = "zerojax_groups"  # the vmapped axis of data-parallel groups (see `_accumulated_grads`)


def _replicated(layout, tree):
    return constrain(tree, jax.tree.map(lambda _: layout.replicated, tree))


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
        return _replicated(layout, params), None
    outside = outside_stacks(lambda _, v: jax.lax.with_sharding_constraint(v, layout.replicated), stacks,
                             layout.leaves, params)
    if not model.stacks:  # the GPT's hook, as it always was
        return outside, {s: (lambda layer: _replicated(layout, layer)) for s in stacks}
    # `zj.Stacked`: a barrier between the layer's slice and its gather keeps XLA:CPU's layout
    # assignment from re-laying out the whole stacked shard for the gather (a copy of 1/fsdp of the
    # stack's weights for the whole step: temp then grew by 0.25 of a block per block, now 0.125,
    # the gradient's shard). Values are unchanged; elsewhere it only orders the slice before the gather.
    return outside, {s: (lambda layer: _replicated(layout, jax.lax.optimization_barrier(layer))) for s in stacks}


def _report(layout, model) -> GatherReport:
    if not layout.compute_sharded:
        return GatherReport("replicated", f"stage {layout.stage.index}: compute params are replicated")
    if model.accepts_layer_hook:
        return GatherReport("layers", "per layer, where used: stacked layers inside the scan, the rest at once"
                            + (f" (stacks {describe_stacks(model.stacks)})" if model.stacks else ""))
    return GatherReport("whole", "whole model gathered at once (no layer hook)")


def _units(layout, model, options, inputs, model_state):
    """Stage 3, a model without a layer hook: (report, around) making the wrap rule's submodules FSDP
    units, each asking for its whole weights inside its own rematerialised call (see `zerojax.wrap`),
    or None where no unit matches (the whole model is then gathered at once)."""
    rule = wrap_lib.as_rule(options.wrap)
    if not layout.compute_sharded or model.accepts_layer_hook or rule is None or model.unit_around is None:
        return None
    sharded = {l.path: NamedSharding(layout.mesh, l.spec(True))
               for l in jax.tree.leaves(layout.leaves, is_leaf=lambda x: isinstance(x, LeafLayout))}

    def materialize(path, x):
        # Sharded first, then whole: the partitioner gathers this (tied) value, not the untied param
        # it could otherwise propagate the whole sharding back to (and merge with the other pass's gather).
        # The gradient's transpose is the same pair, so each unit's gradient is reduced inside its backward.
        return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, sharded[path]), layout.replicated)

    report, around = unit_around(layout, model, rule, materialize, inputs, model_state, wait_for_grads=True)
    return (report, around) if report.route == "units" else None


def _accumulated_grads(layout, model, static, loss_fn, run, k: int, keep_gathered: bool):
    """`(state, batch, key) -> (loss, grads, model_state)` over k micro-batches in one `lax.scan`.

    Stage 3 (weights resharded after the forward): each micro-batch runs the plain step's forward
    and backward, gathering where used, and its gradient is reduced to shards as it is made (the
    gather's transpose); the shards are accumulated in fp32.

    Stages 0-2, and stage 3 keeping the gathered weights (`keep_gathered`, gathered once before the
    scan): the partitioner cannot hold a partial sum across loop iterations, so each data-parallel
    group's gradient is made separately (`vmap` over the groups, the group axis sharded over the
    batch axes: every device computes and accumulates its own unreduced fp32 gradient), and the sum
    over groups after the scan is the step's one all-reduce or reduce-scatter. Dropout keys are
    folded with the group index; BatchNorm statistics are averaged over the groups.
    """
    mesh = layout.mesh
    dp = data_parallel_size(mesh)
    rows_sharding = NamedSharding(mesh, P(None, BATCH_AXES))
    per_micro = layout.compute_sharded and not keep_gathered

    def scan(body, init, key, micro):
        micro = constrain(micro, jax.tree.map(lambda _: rows_sharding, micro))
        keys = jax.vmap(lambda i: accum.micro_key(key, i))(jnp.arange(k))
        (grads, loss, weight, model_state), _ = jax.lax.scan(body, init, (keys, micro))
        return loss / weight, jax.tree.map(lambda g: g / weight, grads), model_state

    def sharded_micro(state, batch, key):
        params = compute_params(layout, state)
        shardings = layout.shardings(True)
        zeros = constrain(layout.to_layout(accum.zeros_f32(params), True), shardings)
        micro = jax.tree.map(lambda x: accum.split(x, k, dp).reshape(k, -1, *x.shape[1:]), batch)

        def body(carry, xs):
            acc, loss_acc, weight_acc, model_state = carry
            key, mb = xs

            def loss_of(p):
                out, new_state = run(p, model_state, mb, key, train=True)
                loss, scale, weight = accum.parts(loss_fn(out, mb))
                return loss, (scale, weight, new_state)

            (loss, (scale, weight, new_state)), g = jax.value_and_grad(loss_of, has_aux=True)(params)
            model_state = new_state if model_state is not None else None
            g = constrain(layout.to_layout(g, True), shardings)
            acc = constrain(accum.add_scaled(acc, g, scale), shardings)
            return (acc, loss_acc + scale * loss, weight_acc + weight, model_state), None

        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), state.model_state)
        return scan(body, init, key, micro)

    def grouped(state, batch, key):
        params = compute_params(layout, state)
        if layout.compute_sharded:  # stage 3: gathered once, kept for every micro-batch
            params = _replicated(layout, params)
        group_sharding = NamedSharding(mesh, P(BATCH_AXES))
        zeros = jax.tree.map(lambda p: jnp.zeros((dp, *p.shape), jnp.promote_types(p.dtype, jnp.float32)), params)
        zeros = constrain(zeros, jax.tree.map(lambda _: group_sharding, zeros))
        micro = jax.tree.map(lambda x: accum.split(x, k, dp), batch)  # (k, dp, rows / k, ...)

        def group_grad(p, model_state, mb, key, group):
            def loss_of(p):
                out, new_state = model.apply(p, model_state or {}, static, mb["inputs"], rng=jax.random.fold_in(key, group),
                                             train=True, sync=_GROUPS)
                loss, scale, weight = accum.parts(loss_fn(out, mb))
                return loss, (scale, weight, new_state)

            return jax.value_and_grad(loss_of, has_aux=True)(p)

        per_group = jax.vmap(group_grad, in_axes=(None, None, 0, None, 0), axis_name=_GROUPS)

        def body(carry, xs):
            acc, loss_acc, weight_acc, model_state = carry
            key, mb = xs
            (loss, (scale, weight, new_state)), g = per_group(params, model_state, mb, key, jnp.arange(dp))
            acc = jax.tree.map(lambda a, x: a + scale.reshape((dp,) + (1,) * (x.ndim - 1)) * x.astype(a.dtype), acc, g)
            acc = constrain(acc, jax.tree.map(lambda _: group_sharding, acc))
            if model_state is not None:  # the same in every group: its statistics are averaged over them
                model_state = jax.tree.map(lambda x: x[0], new_state)
            return (acc, loss_acc + jnp.sum(scale * loss), weight_acc + jnp.sum(weight), model_state), None

        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), state.model_state)
        loss, acc, model_state = scan(body, init, key, micro)
        grads = jax.tree.map(lambda a: jnp.sum(a, axis=0), acc)  # the step's one reduction
        grads = constrain(layout.to_layout(grads, layout.grads_sharded), layout.shardings(layout.grads_sharded))
        return loss, grads, model_state

    return sharded_micro if per_micro else grouped


def build(layout, model, static, loss_fn, tx, options: EngineOptions, inputs=None, model_state=None,
          grad_accum: int = 1) -> BuiltStep:
    units = _units(layout, model, options, inputs, model_state or {})
    around = units[1] if units else None

    def run(params, model_state, batch, key, train):
        hook = None
        if around is None:
            params, hook = _gather_where_used(layout, model, params, options)
        return model.apply(params, model_state or {}, static, batch["inputs"], rng=key, train=train,
                           layer_hook=hook, around=around)

    def evaluate(state, batch, loss_fn):  # eval mode, gathered as the step's forward gathers
        return global_loss(loss_fn(run(compute_params(layout, state), state.model_state, batch, None, False)[0], batch))

    accumulate = grad_accum > 1 or (layout.compute_sharded and not options.reshard_after_forward)
    accumulated = _accumulated_grads(layout, model, static, loss_fn, run, grad_accum,
                                     not options.reshard_after_forward) if accumulate else None

    def step(state, batch):
        if accumulated is not None:
            loss, grads, model_state = accumulated(state, batch, step_key(state))
            new_state, metrics = apply_update(layout, tx, state, grads, loss)
            return keep_model_state(new_state, model_state, metrics["bad_step"]), {"loss": loss, **metrics}
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
        grads = constrain(grads, layout.shardings(layout.grads_sharded))
        new_state, metrics = apply_update(layout, tx, state, grads, loss)
        return keep_model_state(new_state, model_state, metrics["bad_step"]), {"loss": loss, **metrics}

    report = units[0] if units else _report(layout, model)
    if layout.compute_sharded and not options.reshard_after_forward:
        report = GatherReport("whole", "stage 3, reshard_after_forward=False: the whole model gathered once per "
                              "step and kept for every micro-batch")
    return BuiltStep(step, report, evaluate)
