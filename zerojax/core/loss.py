"""The loss a step minimises: the default cross-entropy, and a loss function's result as the global
batch's loss (a mean over rows, or a `WeightedLoss` summed over the whole batch)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from zerojax.errors import UserError


class WeightedLoss(NamedTuple):
    """A loss function's result summed over its rows: the step's loss is sum(total) / sum(weight) over
    the global batch, exactly, whatever the devices' or micro-batches' shares (token masks, padding
    rows, per-row weights). Its own type, not a bare pair: `(loss, accuracy)` is JAX's `has_aux`
    idiom, and read as a pair it would train on loss / accuracy."""

    total: jax.Array
    weight: jax.Array


def cross_entropy(logits, batch) -> jax.Array:
    """Mean softmax cross-entropy of logits against integer targets (the default loss)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"]).mean()


def loss_parts(value):
    """A loss function's result as (total, weight): a `WeightedLoss` means sum(total) / sum(weight)
    over the global batch; a scalar means a mean over rows (weight None). Any other tuple is refused
    (`unread_tuple`)."""
    if isinstance(value, WeightedLoss):
        return jnp.asarray(value.total, jnp.float32), jax.lax.stop_gradient(jnp.asarray(value.weight, jnp.float32))
    if isinstance(value, (tuple, list)):
        raise unread_tuple(value)
    return value, None


def unread_tuple(value) -> UserError:
    """The error for a loss function that returned a plain tuple: which of its values is the loss
    (and what the others mean) is not zerojax's to guess."""
    shapes = [list(getattr(v, "shape", ())) for v in value]
    return UserError(
        f"the loss function returned a {type(value).__name__} of {len(value)} values of shapes {shapes}; it must "
        f"return the loss alone (a scalar: the batch's mean), or zj.WeightedLoss(total, weight) for a loss "
        f"summed over the batch (auxiliary outputs such as metrics or logits are not taken)."
    )


def global_loss(value) -> jax.Array:
    """The loss of a whole (global) batch from the loss function's result (see `loss_parts`)."""
    total, weight = loss_parts(value)
    return total if weight is None else total / weight
