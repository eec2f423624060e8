"""Gradient accumulation under `gspmd`: k micro-batches in one `lax.scan` (see `zerojax.engines.accum`).

Whole micro-batches (stage 3 with its weights resharded after the forward, a pipeline, or any stage
with `whole_micro_batches`): each micro-batch runs the plain step's forward and backward on all of
its rows, and its gradient is reduced as it is made, to the stage's form (shards at stages 2-3; at
stage 3 the gather's transpose); the reduced gradients are accumulated in fp32.

Otherwise (stages 0-2, and stage 3 keeping the gathered weights, gathered once before the scan): the
partitioner cannot hold a partial sum across loop iterations, so each data-parallel group's gradient
is made separately (`vmap` over the groups, the group axis sharded over the batch axes: every device
computes and accumulates its own unreduced fp32 gradient), and the sum over groups after the scan is
the step's one all-reduce or reduce-scatter. Dropout keys are folded with the group index; BatchNorm
statistics are averaged over the groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.core.mesh import BATCH_AXES, data_parallel_size
from zerojax.engines import accum
from zerojax.engines.update import compute_params, constrain

_GROUPS = "zerojax_groups"  # the vmapped axis of data-parallel groups


def accumulated_grads(layout, model, static, loss_fn, run, k: int, keep_gathered: bool, whole: bool = False):
    """`(state, batch, key) -> (loss, grads, model_state)` over k micro-batches (`whole`: each on
    all of its rows, whatever the stage)."""
    if whole or not runs_in_groups(layout, keep_gathered):
        return _whole_micro(layout, loss_fn, run, k)
    return _grouped(layout, model, static, loss_fn, k)


def runs_in_groups(layout, keep_gathered: bool) -> bool:
    """Whether the micro-batches run the model once per data-parallel group (a `vmap`, `_grouped`) by
    default: wherever the compute params are whole for the step; stage 3 re-gathering per micro-batch
    runs each micro-batch whole instead."""
    return not (layout.compute_sharded and not keep_gathered)


def _scan(micro_grads, acc, model_state, key, micro, k: int, mesh):
    """`accum.accumulate` over the k micro-batches, each with its key; the loss and the accumulated
    grads over the summed weight."""
    rows = NamedSharding(mesh, P(None, BATCH_AXES))
    micro = constrain(micro, jax.tree.map(lambda _: rows, micro))
    keys = jax.vmap(lambda i: accum.micro_key(key, i))(jnp.arange(k))
    loss, grads, weight, model_state = accum.accumulate(micro_grads, acc, model_state, (keys, micro))
    return loss / weight, jax.tree.map(lambda g: g / weight, grads), model_state


def _whole_micro(layout, loss_fn, run, k: int):
    dp = data_parallel_size(layout.mesh)
    sharded = layout.grads_sharded  # each micro-batch's gradient reduced to the stage's form
    shardings = layout.shardings(sharded)

    def grads(state, batch, key):
        params = compute_params(layout, state)
        zeros = constrain(layout.to_layout(accum.zeros_f32(params), sharded), shardings)
        micro = jax.tree.map(lambda x: accum.split(x, k, dp).reshape(k, -1, *x.shape[1:]), batch)
        trained_shardings = layout.trained(shardings)  # no accumulator for a frozen leaf

        def micro_grads(acc, model_state, xs):
            key, mb = xs

            def loss_of(p):
                out, new_state = run(p, model_state, mb, key, train=True)
                loss, scale, weight = accum.parts(loss_fn(out, mb))
                return loss, (scale, weight, new_state)

            (loss, (scale, weight, new_state)), g = jax.value_and_grad(loss_of, has_aux=True)(params)
            model_state = new_state if model_state is not None else None
            g = constrain(layout.to_layout(g, sharded), shardings)
            return constrain(accum.add_scaled(acc, g, scale), trained_shardings), scale * loss, weight, model_state

        loss, grads, model_state = _scan(
            micro_grads, layout.trained(zeros), state.model_state, key, micro, k, layout.mesh
        )
        # in the accumulator's form: else the partitioner gives the loop the update's layout (shards at
        # stage 1) and gathers the accumulator in every micro-batch to add the whole gradient to it
        grads = constrain(grads, trained_shardings)
        return loss, layout.frozen_from(zeros, grads), model_state

    return grads


def _group_grad_fn(model, static, loss_fn):
    """One data-parallel group's `(loss, (scale, weight, model_state)), grads`, vmapped over groups."""

    def group_grad(p, model_state, mb, key, group):
        def loss_of(p):
            out, new_state = model.apply(
                p, model_state or {}, static, mb["inputs"], rng=jax.random.fold_in(key, group), train=True, sync=_GROUPS
            )
            loss, scale, weight = accum.parts(loss_fn(out, mb))
            return loss, (scale, weight, new_state)

        return jax.value_and_grad(loss_of, has_aux=True)(p)

    return jax.vmap(group_grad, in_axes=(None, None, 0, None, 0), axis_name=_GROUPS)


def _grouped(layout, model, static, loss_fn, k: int):
    dp = data_parallel_size(layout.mesh)
    group_sharding = NamedSharding(layout.mesh, P(BATCH_AXES))
    per_group = _group_grad_fn(model, static, loss_fn)

    def grads(state, batch, key):
        params = compute_params(layout, state)
        if layout.compute_sharded:  # stage 3: gathered once, kept for every micro-batch
            params = constrain(params, layout.shardings(False))
        zeros = jax.tree.map(lambda p: jnp.zeros((dp, *p.shape), jnp.promote_types(p.dtype, jnp.float32)), params)
        zeros = layout.trained(constrain(zeros, jax.tree.map(lambda _: group_sharding, zeros)))  # none if frozen
        micro = jax.tree.map(lambda x: accum.split(x, k, dp), batch)  # (k, dp, rows / k, ...)

        def micro_grads(acc, model_state, xs):
            key, mb = xs
            (loss, (scale, weight, new_state)), g = per_group(params, model_state, mb, key, jnp.arange(dp))
            per_group_scale = lambda x: scale.reshape((dp,) + (1,) * (x.ndim - 1))  # noqa: E731
            acc = jax.tree.map(lambda x, a: None if a is None else a + per_group_scale(x) * x.astype(a.dtype), g, acc)
            acc = constrain(acc, jax.tree.map(lambda _: group_sharding, acc))
            if model_state is not None:  # the same in every group: its statistics are averaged over them
                model_state = jax.tree.map(lambda x: x[0], new_state)
            return acc, jnp.sum(scale * loss), jnp.sum(weight), model_state

        loss, acc, model_state = _scan(micro_grads, zeros, state.model_state, key, micro, k, layout.mesh)
        grads = jax.tree.map(lambda a: jnp.sum(a, axis=0), acc)  # the step's one reduction
        grads = layout.frozen_from(accum.zeros_f32(params), grads)
        grads = constrain(layout.to_layout(grads, layout.grads_sharded), layout.shardings(layout.grads_sharded))
        return loss, grads, model_state

    return grads
