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
    over the global batch; a scalar means a mean over rows (weight None). Several values (a tuple, a
    list, a dict) are refused (`unread_values`)."""
    if isinstance(value, WeightedLoss):
        return jnp.asarray(value.total, jnp.float32), jax.lax.stop_gradient(jnp.asarray(value.weight, jnp.float32))
    if isinstance(value, tuple | list | dict):
        raise unread_values(value)
    return value, None


def unread_values(value) -> UserError:
    """The error for a loss function that returned several values (a tuple, a list, a dict of
    metrics): which of them is the loss (and what the others mean) is not zerojax's to guess."""
    if isinstance(value, dict):
        what = f"dict of {len(value)} values ({', '.join(repr(k) for k in value)})"
        more = "; evaluate takes one metric per call"
    else:
        shapes = [list(getattr(v, "shape", ())) for v in value]
        what, more = f"{type(value).__name__} of {len(value)} values of shapes {shapes}", ""
    return UserError(
        f"the loss function returned a {what}; it must return the loss alone (a scalar: the batch's mean), or "
        f"zj.WeightedLoss(total, weight) for a loss summed over the batch (auxiliary outputs such as metrics or "
        f"logits are not taken{more})."
    )


def global_loss(value) -> jax.Array:
    """The loss of a whole (global) batch from the loss function's result (see `loss_parts`)."""
    total, weight = loss_parts(value)
    return total if weight is None else total / weight
