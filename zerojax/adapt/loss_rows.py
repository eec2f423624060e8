"""Whether a user's loss function may be called on blocks of a batch's rows.

A step calls the loss function on the whole global batch only under `gspmd` without accumulation
(and, at stage 3, with `reshard_after_forward`). `shard_map` calls it on each device's rows,
accumulation on each micro-batch, and `gspmd`'s per-group runs on each data-parallel group's share,
then combines the values as the loss's own form says: the mean of the blocks' means for a scalar,
sum(total) / sum(weight) for a `zj.WeightedLoss`. A loss that mixes rows (a contrastive loss, a
statistic of the batch) or divides by a count of the whole batch (a masked mean returned as a
scalar) would train on another loss than the one written, at a value that changes with the device
count. It is measured once, on the first batch's own values with the model's outputs drawn at
random in their shapes (in fp32: the property is the loss's, not its rounding), and refused in one
sentence.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.adapt.row_blocks import Blocks, probed_blocks
from zerojax.core.loss import loss_parts
from zerojax.errors import UserError

RTOL = 1e-4  # fp32 sums in another order differ by ~1e-7; a mixed-up loss by far more
MAX_BLOCKS = 8  # blocks compared (each a copy of the loss in the probe's one program)
MAX_BYTES = 64 * 2**20  # random outputs drawn at most; a probe that needs more is not run


def check_loss_splits(loss_fn: Callable, out, batch: dict, split: tuple[int, int, str]) -> None:
    """One `UserError` if `loss_fn` over the blocks of `batch`'s rows the step calls it on, combined,
    is not its value over their rows together. `out`: the model's abstract outputs; `split`: (blocks,
    groups, why) from `Setup.loss_split` (`zerojax.adapt.row_blocks`: up to `MAX_BLOCKS` blocks of the
    first groups are compared).

    Inconclusive, so passed: several processes, an abstract batch, outputs or values without the rows
    first, outputs too large to draw (`MAX_BYTES`), a loss with side effects (`jax.debug` callbacks
    and prints, not run on made-up outputs), one that fails on a block, or one not finite over the
    rows together."""
    row_bytes = sum(4 * int(np.prod(s.shape[1:])) for s in jax.tree.leaves(out))
    rows = {np.shape(x)[:1] for x in jax.tree.leaves(batch)} | {tuple(s.shape[:1]) for s in jax.tree.leaves(out)}
    blocks = probed_blocks(split, batch, row_bytes, MAX_BLOCKS, MAX_BYTES) if len(rows) == 1 else None
    if blocks is None:
        return
    try:
        got = _measured(loss_fn, out, batch, blocks)
    except Exception:  # noqa: BLE001 - the step traces the loss itself and reports its failure
        return
    if got is None:
        return
    whole, combined = got
    # non-finite over the rows together: inconclusive; over the blocks only (a masked mean over a
    # block masked out): the step would fail where the loss the user wrote does not
    if not np.isfinite(whole) or abs(whole - combined) <= RTOL * max(1.0, abs(whole)):
        return
    raise UserError(
        f"{split[2]}, but the loss function does not add up over rows: on this batch (with random model "
        f"outputs) it is {whole:.6g} over {blocks.used_rows} rows together and {combined:.6g} "
        f"combined over {blocks.used_blocks} blocks of {blocks.used_groups * blocks.size}. A masked mean must be "
        f"returned as zj.WeightedLoss(total, weight); a loss that mixes rows (contrastive, a batch statistic) "
        f"needs zero.engine=gspmd with train.grad_accum=1 (at stage 3 also zero.reshard_after_forward=true)."
    )


def _measured(loss_fn, out, batch, blocks: Blocks):
    """(the loss over the used rows together, combined over their blocks) in fp32, or None for a
    loss with side effects."""
    used = (blocks.used_groups, blocks.used_blocks, blocks.size)

    def rows_of(x):  # the used rows, as (groups, blocks, size, ...), floats in fp32
        x = blocks.take(x)
        return x.astype(np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x

    rng = np.random.default_rng(0)
    outputs = jax.tree.map(
        lambda s: (
            rng.standard_normal((*used, *s.shape[1:]), dtype=np.float32)
            if jnp.issubdtype(s.dtype, jnp.floating)
            else np.zeros((*used, *s.shape[1:]), s.dtype)
        ),
        out,
    )
    values = jax.tree.map(rows_of, batch)

    def together_and_blocks(outputs, values):
        parts = [
            loss_parts(loss_fn(blocks.rows(outputs, i), blocks.rows(values, i))) for i in range(blocks.used_blocks)
        ]
        return loss_parts(loss_fn(blocks.rows(outputs), blocks.rows(values))), parts

    traced = jax.jit(together_and_blocks).trace(outputs, values)
    if traced.jaxpr.effects:  # callbacks or prints: not run on made-up outputs behind the user's back
        return None
    (total, weight), parts = traced.lower().compile()(outputs, values)
    whole = float(total if weight is None else total / weight)
    if weight is None:
        return whole, float(np.mean([float(t) for t, _ in parts]))
    return whole, float(sum(float(t) for t, _ in parts) / sum(float(w) for _, w in parts))
