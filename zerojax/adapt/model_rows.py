"""Whether a user's model may be called on blocks of a batch's rows.

Where a step splits the batch's rows (`zerojax.adapt.row_blocks`: each device's under `shard_map`,
each micro-batch's when accumulating), the model runs on each block alone. A model whose output for
a row depends on other rows (it normalises by a statistic of the batch it computes itself, or picks
a branch by one) then computes another function than the one written, at a value that changes with
the device count, silently. BatchNorm is the exception the engines handle (its statistics are
averaged over the blocks), and it reads no other row in eval mode, so the model is measured in eval
mode: once, on the first batch's own rows, over a few blocks and over their rows together, and
refused in one sentence where they differ beyond rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.adapt.row_blocks import Blocks, probed_blocks
from zerojax.adapt.row_mixing import may_mix_rows
from zerojax.errors import UserError

RTOL = 3e-2  # of the outputs' norm: bf16 rounding in another batch shape differs by ~1e-3
MAX_BYTES = 64 * 2**20  # inputs and outputs of the rows compared, at most; a larger probe is not run
MAX_PARAM_BYTES = 2**30  # params gathered whole for the probe, at most
TRACED_ROWS = 1031  # a prime no other dimension of a model is likely a multiple of


def check_model_splits(forward: Callable, args, batch: dict, split: tuple[int, int, str], param_bytes: int) -> None:
    """One `UserError` if the model, `forward(args, key, inputs) -> outputs` in eval mode, gives rows
    different outputs run on the blocks of `batch`'s rows the step runs it on than on their rows
    together. `split`: (blocks, groups, why) from `Setup.loss_split`; `param_bytes`: what `forward`
    gathers. Run only where its jaxpr may mix rows (`zerojax.adapt.row_mixing`): most models compile
    nothing here.

    Inconclusive, so passed: whatever `zerojax.adapt.row_blocks.probed_blocks` leaves out, params over
    `MAX_PARAM_BYTES`, outputs over `MAX_BYTES` or without the rows first, a model with side effects
    (`jax.debug` callbacks), non-finite outputs, or outputs that are random in eval mode (two keys
    disagree)."""
    inputs = batch["inputs"]
    row_bytes = sum(int(np.prod(np.shape(x)[1:])) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(inputs))
    blocks = probed_blocks(split, inputs, row_bytes, 2, MAX_BYTES) if param_bytes <= MAX_PARAM_BYTES else None
    if blocks is None or not _may_mix(forward, args, inputs):
        return
    try:
        difference = _difference(forward, args, jax.tree.map(blocks.take, inputs), blocks)
    except Exception:  # noqa: BLE001 - the step traces the model itself and reports its failure
        return
    if difference is None or not difference > RTOL:  # NaN: inconclusive
        return
    raise UserError(
        f"{split[2]}, but the model's output for a row depends on the batch's other rows: in eval mode, on "
        f"this batch, its outputs for {blocks.used_rows} rows run together and in {blocks.used_blocks} blocks "
        f"of {blocks.used_groups * blocks.size} differ by {difference:.3g} of their norm (a statistic or a "
        f"branch the model computes over its batch; BatchNorm's are averaged over the blocks). Such a model "
        f"needs zero.engine=gspmd with train.grad_accum=1 (at stage 3 also zero.reshard_after_forward=true)."
    )


def _may_mix(forward: Callable, args, inputs) -> bool:
    """Whether the model's jaxpr, traced for `TRACED_ROWS` rows, has an operation that may mix them
    (`zerojax.adapt.row_mixing`); a model that fails to trace so is measured."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((TRACED_ROWS, *np.shape(x)[1:]), x.dtype), inputs)
    try:
        traced = jax.jit(forward).trace(args, jax.random.key(0), shapes)
    except Exception:  # noqa: BLE001 - a model that needs a batch of another size
        return True
    return may_mix_rows(traced.jaxpr.jaxpr, TRACED_ROWS)


def _difference(forward: Callable, args, inputs, blocks: Blocks) -> float | None:
    """|outputs of the blocks - outputs of the rows together| / |outputs of the rows together|, over
    every float output; inf where an output's shape beyond its rows depends on how many rows it saw;
    None where it means nothing (side effects, too large, no rows first, random in eval mode)."""

    def together_and_blocks(args, key, inputs):
        parts = [forward(args, key, blocks.rows(inputs, i)) for i in range(blocks.used_blocks)]
        return forward(args, key, blocks.rows(inputs)), parts

    keys = [jax.random.key(0), jax.random.key(1)]
    traced = jax.jit(together_and_blocks).trace(args, keys[0], inputs)
    out = jax.tree.leaves(traced.out_info[0])
    if traced.jaxpr.effects or 2 * sum(x.size * x.dtype.itemsize for x in out) > MAX_BYTES:
        return None
    if any(x.shape[:1] != (blocks.used_rows,) for x in out):
        return None
    program = traced.lower().compile()
    together, parts = program(args, keys[0], inputs)
    if not _same_rows(together, parts, blocks):
        return np.inf
    difference = _relative(together, _joined(parts, blocks))
    if difference > RTOL and _relative(together, program(args, keys[1], inputs)[0]) > RTOL:
        return None  # random in eval mode (dropout the mode does not reach): not comparable
    return difference


def _same_rows(together, parts, blocks: Blocks) -> bool:
    """Each block's outputs shaped as the rows together's, but for their rows (leaves in order)."""
    want = [(blocks.used_groups * blocks.size, *x.shape[1:]) for x in jax.tree.leaves(together)]
    return all([tuple(x.shape) for x in jax.tree.leaves(p)] == want for p in parts)


def _joined(parts, blocks: Blocks):
    """The blocks' outputs in the order of the rows together: (groups, blocks, size) flattened."""
    g, s = blocks.used_groups, blocks.size

    def join(*xs):
        stacked = np.stack([np.asarray(x).reshape(g, s, *x.shape[1:]) for x in xs], axis=1)
        return stacked.reshape(-1, *stacked.shape[3:])

    return jax.tree.map(join, *parts)


def _relative(a, b) -> float:
    pairs = [
        (np.asarray(x, np.float64), np.asarray(y, np.float64))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
        if jnp.issubdtype(x.dtype, jnp.floating)  # bfloat16 too, which NumPy does not count as floating
    ]
    if not pairs:
        return 0.0
    norm = np.sqrt(sum(np.sum(x**2) for x, _ in pairs))
    error = np.sqrt(sum(np.sum((x - y) ** 2) for x, y in pairs))
    return float(error / norm) if norm > 0 else float(error > 0) * np.inf
