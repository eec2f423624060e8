"""The `gspmd` engine: the step is written for one big device; shardings on the state and sharding
constraints on the gradients let XLA's SPMD partitioner insert every collective."""

from __future__ import annotations

import jax

from zerojax.engines.common import apply_update, compute_params, constrain


def build_step(layout, model, static, loss_fn, tx):
    def step(state, batch):
        def loss_of(params):
            return loss_fn(model.apply(params, static, batch["inputs"]), batch)

        loss, grads = jax.value_and_grad(loss_of)(compute_params(layout, state))
        # Stages 2-3 ask for sharded gradients, which XLA can meet with a reduce-scatter;
        # stages 0-1 ask for the full all-reduced gradient.
        grads = layout.to_layout(grads, layout.grads_sharded)
        grads = constrain(grads, layout.shardings(layout.grads_sharded))
        state, metrics = apply_update(layout, tx, state, grads, loss)
        return state, {"loss": loss, **metrics}

    return step
