"""Whether a user's loss function may be called on blocks of a batch's rows.

A step calls the loss function on the whole global batch only under `gspmd` without accumulation.
`shard_map` calls it on each device's rows, and accumulation on each micro-batch (`gspmd`'s per-group
accumulation on each group's share of one), then combines the values as the loss's own form says:
the mean of the blocks' means for a scalar, sum(total) / sum(weight) for a `zj.WeightedLoss`. A loss
that mixes rows (a contrastive loss, a statistic of the batch) or divides by a count of the whole
batch (a masked mean returned as a scalar) would train on another loss than the one written, at a
value that changes with the device count. It is measured once, on the first batch's own values with
the model's outputs drawn at random in their shapes, and refused in one sentence.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core.loss import loss_parts
from zerojax.errors import UserError

RTOL = 1e-4  # float32 sums in another order differ by ~1e-7; a mixed-up loss by far more


def check_loss_splits(loss_fn: Callable, out, batch: dict, blocks: int, split_by: str) -> None:
    """One `UserError` if `loss_fn` over `blocks` equal blocks of `batch`'s rows, combined, is not
    its value over the whole batch (`out`: the model's abstract outputs; `split_by`: what calls the
    loss per block). Inconclusive, so passed: several processes, an abstract batch, outputs or
    values without the rows first, a loss with side effects (`jax.debug` callbacks and prints, not
    run on made-up outputs), one that fails on a block, or one not finite on the whole batch."""
    # one process only: each of several would judge its own rows, and one refusing alone would leave
    # the others waiting for it
    if blocks <= 1 or jax.process_count() > 1 or not all(_concrete(x) for x in jax.tree.leaves(batch)):
        return
    rows = int(np.shape(jax.tree.leaves(batch["inputs"])[0])[0])
    leaves = jax.tree.leaves(out) + jax.tree.leaves(batch)
    if rows % blocks or any(np.shape(x)[:1] != (rows,) for x in leaves):
        return
    rng = np.random.default_rng(0)
    outputs = jax.tree.map(lambda s: _drawn(rng, s), out)
    values = jax.tree.map(np.asarray, batch)
    size = rows // blocks

    def whole_and_blocks(outputs, values):
        block = lambda tree, i: jax.tree.map(lambda x: x[i * size : (i + 1) * size], tree)  # noqa: E731
        parts = [loss_parts(loss_fn(block(outputs, i), block(values, i))) for i in range(blocks)]
        return loss_parts(loss_fn(outputs, values)), parts

    try:
        traced = jax.jit(whole_and_blocks).trace(outputs, values)
        if traced.jaxpr.effects:  # callbacks or prints: not run on made-up outputs behind the user's back
            return
        (total, weight), parts = traced.lower().compile()(outputs, values)
    except Exception:  # noqa: BLE001 - the step traces the loss itself and reports its failure
        return
    whole = float(total if weight is None else total / weight)
    if weight is None:
        combined = float(np.mean([float(t) for t, _ in parts]))
    else:
        combined = float(sum(float(t) for t, _ in parts) / sum(float(w) for _, w in parts))
    # non-finite over the whole batch: inconclusive; over the blocks only (a masked mean over a block
    # masked out): the step would fail where the loss the user wrote does not
    if not np.isfinite(whole) or abs(whole - combined) <= RTOL * max(1.0, abs(whole)):
        return
    raise UserError(
        f"{split_by}, but the loss function does not add up over rows: on this batch (with random model "
        f"outputs) it is {whole:.6g} over all {rows} rows and {combined:.6g} combined over {blocks} blocks of "
        f"{size}. A masked mean must be returned as zj.WeightedLoss(total, weight); a loss that mixes rows "
        f"(contrastive, a batch statistic) needs zero.engine=gspmd with train.grad_accum=1."
    )


def _concrete(x) -> bool:
    if isinstance(x, jax.Array):
        return x.is_fully_addressable and not isinstance(x, jax.core.Tracer)
    return isinstance(x, (np.ndarray, np.generic, int, float))


def _drawn(rng, shape):
    if jnp.issubdtype(shape.dtype, jnp.floating):
        return rng.standard_normal(shape.shape).astype(shape.dtype)
    return np.zeros(shape.shape, shape.dtype)
