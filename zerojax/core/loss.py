"""The loss a step minimises: the default cross-entropy, and a loss function's result as the global
batch's loss (a mean over rows, or a `(total, weight)` pair summed over the whole batch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits, batch) -> jax.Array:
    """Mean softmax cross-entropy of logits against integer targets (the default loss)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"]).mean()


def loss_parts(value):
    """A loss function's result as (total, weight): a pair `(total, weight)` means sum(total) /
    sum(weight) over the global batch; a scalar means a mean over rows (weight None)."""
    if isinstance(value, (tuple, list)):
        total, weight = value
        return jnp.asarray(total, jnp.float32), jax.lax.stop_gradient(jnp.asarray(weight, jnp.float32))
    return value, None


def global_loss(value) -> jax.Array:
    """The loss of a whole (global) batch from the loss function's result (see `loss_parts`)."""
    total, weight = loss_parts(value)
    return total if weight is None else total / weight
