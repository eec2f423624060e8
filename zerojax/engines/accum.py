"""Gradient accumulation: k micro-batches per step inside one compiled step (a `lax.scan`).

Shared by the engines: how a batch splits into micro-batches, and how the micro-batches' losses and
gradients combine so the result is the whole batch's exactly.

Each micro-batch takes the same share of every data-parallel device's rows, so splitting moves no
data: the rows a device holds, (rows,) -> (k, rows / k), micro-batch i being the i-th slice.

Combining: a micro-batch reports `(loss, scale, weight)`. A scalar loss (a mean over rows) has
scale 1 and weight 1; a `WeightedLoss(total, weight)` has loss total / W_i and scale W_i, W_i being the
micro-batch's global weight (1 where it is 0, so an all-zero micro-batch adds its total, not NaN).
The step accumulates scale x loss and scale x gradient and divides both by the summed weights at
the end: a mean of k equal-sized means, or sum(total) / sum(weight) over the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.core.loss import loss_parts
from zerojax.errors import UserError


def check_grad_accum(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserError(f"train.grad_accum must be a positive integer, got {k!r}.")
    return k


def check_accum_batch(batch_size: int, data_parallel: int, k: int, subject: str | None = None) -> None:
    """Every data-parallel device's rows split into k equal micro-batches (`subject`: as `check_batch`'s)."""
    if k > 1 and (batch_size % data_parallel or (batch_size // data_parallel) % k):
        raise UserError(
            f"{subject or f'train.batch_size={batch_size}'} does not split into train.grad_accum={k} micro-batches "
            f"of equal rows on each of the {data_parallel} data-parallel devices; the batch size must "
            f"be a multiple of {data_parallel * k}."
        )


def split(x: jax.Array, k: int, groups: int = 1) -> jax.Array:
    """(groups x rows, ...) -> (k, groups, rows / k, ...): micro-batch i is the i-th slice of every
    group's rows (a group: one data-parallel device's share)."""
    rows = x.shape[0] // groups
    x = x.reshape(groups, k, rows // k, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def micro_key(key, i):
    """Micro-batch i's key: the step's key folded with i (a typed key or raw key data, kept as given)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.fold_in(key, i)
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), i))


def parts(value, global_weight=lambda w: w, shares: int = 1):
    """A loss function's result as (loss to differentiate, scale, weight), see the module docstring.
    `global_weight` sums a local weight over the devices that share the micro-batch; a scalar loss
    (a local mean) is divided by `shares`, the number of devices whose means make the global one."""
    total, weight = loss_parts(value)
    if weight is None:
        one = jnp.ones((), jnp.float32)
        return total / shares, one, one
    weight = global_weight(weight)
    scale = jnp.where(weight > 0, weight, 1.0)
    return total / scale, scale, weight


def accumulate(micro_grads, acc, model_state, xs):
    """The step's k micro-batches in one `lax.scan`, the one loop every engine's accumulation runs.

    `micro_grads(acc, model_state, x) -> (acc, scaled loss, weight, model_state)` adds one
    micro-batch's scaled gradient into `acc` (x: its slice of `xs`). Returns (the summed scaled
    losses, the accumulated gradients, the summed weights, the last model state): dividing the first
    two by the third gives the whole batch's loss and gradient."""

    def body(carry, x):
        acc, loss, weight, model_state = carry
        acc, scaled_loss, micro_weight, model_state = micro_grads(acc, model_state, x)
        return (acc, loss + scaled_loss, weight + micro_weight, model_state), None

    zero = jnp.zeros((), jnp.float32)
    (acc, loss, weight, model_state), _ = jax.lax.scan(body, (acc, zero, zero, model_state), xs)
    return loss, acc, weight, model_state


def zeros_f32(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), tree)


def add_scaled(acc, tree, scale):
    """`acc + scale * tree`; a leaf with no accumulator (None: a frozen one, whose gradient is zero) stays None."""
    return jax.tree.map(lambda g, a: None if a is None else a + scale * g.astype(a.dtype), tree, acc)
