"""The `gspmd` engine: the step is written for one big device; shardings on the state and sharding
constraints on the gradients let XLA's SPMD partitioner insert every collective."""

from __future__ import annotations

import jax

from zerojax.engines import BuiltStep, EngineOptions, GatherReport
from zerojax.engines.common import apply_update, compute_params, constrain, global_loss, keep_model_state, step_key

SUPPORTS = ("layer_stacks",)


def _replicated(layout, tree):
    return constrain(tree, jax.tree.map(lambda _: layout.replicated, tree))


def _gather_where_used(layout, model, params, layer_stacks):
    """Stage 3: ask for whole weights at the point of use, so XLA all-gathers weights (FSDP).

    Left alone, the partitioner keeps the weights sharded and splits each matmul over them instead,
    moving activations that grow with the batch. Stacked layers are gathered one layer at a time
    inside the scan (through the model's layer hook); the rest, or a model without a hook, at once.
    The gradient still comes back as an all-reduce and a slice on this backend (4 units of traffic
    where FSDP needs 3), which is what the `shard_map` engine is for.
    """
    if not layout.compute_sharded:
        return params, None
    if not model.accepts_layer_hook:
        return _replicated(layout, params), None
    outside = {k: v if k in layer_stacks else _replicated(layout, v) for k, v in params.items()}
    return outside, lambda layer: _replicated(layout, layer)


def _report(layout, model) -> GatherReport:
    if not layout.compute_sharded:
        return GatherReport("replicated", f"stage {layout.stage.index}: compute params are replicated")
    if model.accepts_layer_hook:
        return GatherReport("layers", "per layer, where used: stacked layers inside the scan, the rest at once")
    return GatherReport("whole", "whole model gathered at once (no layer hook)")


def build(layout, model, static, loss_fn, tx, options: EngineOptions, inputs=None, model_state=None) -> BuiltStep:
    del inputs, model_state  # the partitioner needs no abstract trace of the model
    layer_stacks = options.layer_stacks

    def step(state, batch):
        # One draw over the global batch: the masks depend on the global shape and the key, not on
        # the stage or (with jax_threefry_partitionable, the default) on the device count.
        key = step_key(state)

        def loss_of(params):
            params, hook = _gather_where_used(layout, model, params, layer_stacks)
            out, model_state = model.apply(params, state.model_state or {}, static, batch["inputs"], rng=key,
                                           train=True, layer_hook=hook)
            return global_loss(loss_fn(out, batch)), model_state

        (loss, model_state), grads = jax.value_and_grad(loss_of, has_aux=True)(compute_params(layout, state))
        # Stages 2-3 ask for sharded gradients, which XLA can meet with a reduce-scatter;
        # stages 0-1 ask for the full all-reduced gradient.
        grads = layout.to_layout(grads, layout.grads_sharded)
        grads = constrain(grads, layout.shardings(layout.grads_sharded))
        new_state, metrics = apply_update(layout, tx, state, grads, loss)
        return keep_model_state(new_state, model_state, metrics["bad_step"]), {"loss": loss, **metrics}

    return BuiltStep(step, _report(layout, model))
