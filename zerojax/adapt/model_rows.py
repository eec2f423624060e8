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
from zerojax.adapt.row_mixing import computes_in_half_precision, may_mix_rows
from zerojax.errors import UserError

# apart by over this share of a row's outputs' norm: fp32 rounding in another batch shape moves them
# by ~1e-6; bf16's (or TF32's), compounded over a dozen layers (and a top-k choice it flips), by ~10%
RTOL = {"fp32": 3e-2, "half": 0.5}
MOST = 0.25  # rows that must differ: a top-k choice flipped by rounding moves a few, a batch branch a block
MAX_BYTES = 64 * 2**20  # inputs and outputs of the rows compared, at most; a larger probe is not run
MAX_PARAM_BYTES = 2**30  # params gathered whole for the probe, at most
TRACED_ROWS = 1031  # a prime no other dimension of a model is likely a multiple of
MAX_BLOCKS = 8  # blocks compared, run as one vmap
_BLOCKS = "zerojax_row_blocks"  # the vmapped axis of blocks, which BatchNorms average over


def check_model_splits(forward: Callable, args, inputs, split: tuple[int, int, str], param_bytes: int) -> None:
    """One `UserError` if the model, `forward(args, key, inputs, sync) -> outputs` in eval mode (`sync`:
    the axis name its BatchNorms average over, as the engines set it), gives most rows different
    outputs run on the blocks of a batch's `inputs` the step runs it on than on their rows together.
    `split`: (blocks, groups, why) from `Setup.loss_split`; `param_bytes`: what `forward` gathers.
    Run only where its jaxpr may mix rows (`zerojax.adapt.row_mixing`): most models compile nothing.

    Inconclusive, so passed: whatever `zerojax.adapt.row_blocks.probed_blocks` leaves out, params over
    `MAX_PARAM_BYTES`, outputs over `MAX_BYTES`, outputs without the rows first (not compared), a model
    with side effects (`jax.debug` callbacks), one that cannot be vmapped, non-finite outputs, or
    outputs that are random in eval mode (two keys disagree)."""
    row_bytes = sum(int(np.prod(np.shape(x)[1:])) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(inputs))
    blocks = probed_blocks(split, inputs, row_bytes, MAX_BLOCKS, MAX_BYTES) if param_bytes <= MAX_PARAM_BYTES else None
    read = _rows_first(forward, args, inputs) if blocks is not None else None
    if blocks is None or read is None:
        return
    rows_first, rtol = read
    try:
        differing = _differing_rows(forward, args, jax.tree.map(blocks.take, inputs), blocks, rows_first, rtol)
    except Exception:  # noqa: BLE001 - the step traces the model itself and reports its failure
        return
    if differing is None or not differing > MOST:  # NaN: inconclusive
        return
    raise UserError(
        f"{split[2]}, but the model's output for a row depends on the batch's other rows: in eval mode, on "
        f"this batch, {differing:.0%} of {blocks.used_rows} rows get outputs over {rtol:.0%} apart run together "
        f"and in {blocks.used_blocks} blocks of {blocks.used_groups * blocks.size} (a statistic or a branch the "
        f"model computes over its batch; BatchNorm's are averaged over the blocks). Such a model needs "
        f"zero.engine=gspmd with train.grad_accum=1 (at stage 3 also zero.reshard_after_forward=true)."
    )


def _rows_first(forward: Callable, args, inputs) -> tuple[list[bool], float] | None:
    """(per output leaf, whether it has the rows first; the `RTOL` for its precision), read from the
    model's jaxpr traced for `TRACED_ROWS` rows; None where no operation in it may mix them
    (`zerojax.adapt.row_mixing`). A model that fails to trace so is measured, every output with the
    rows first taken, at bf16's tolerance."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((TRACED_ROWS, *np.shape(x)[1:]), x.dtype), inputs)
    try:
        traced = jax.jit(forward).trace(args, jax.random.key(0), shapes, None)
    except Exception:  # noqa: BLE001 - a model that needs a batch of another size
        return [], RTOL["half"]
    try:
        mixes = may_mix_rows(traced.jaxpr.jaxpr, TRACED_ROWS)
    except Exception:  # noqa: BLE001 - a jaxpr form the read does not know: measured
        mixes = True
    if not mixes:
        return None
    rows_first = [x.shape[:1] == (TRACED_ROWS,) for x in jax.tree.leaves(traced.out_info)]
    # TPUs run fp32 dots in bf16 passes and GPUs in TF32 by default: fp32 keeps its tolerance on CPU only
    half = computes_in_half_precision(traced.jaxpr.jaxpr) or jax.default_backend() != "cpu"
    return rows_first, RTOL["half" if half else "fp32"]


def _differing_rows(forward: Callable, args, inputs, blocks: Blocks, rows_first: list[bool], rtol: float):
    """The share of rows whose outputs (those with the rows first) run on the blocks differ from
    their outputs run together by over `rtol` of their norm; 1 where an output's shape beyond its rows
    depends on how many rows it saw; None where it means nothing (side effects, too large, random)."""

    def together_and_blocks(args, key, inputs):
        parts = jax.vmap(lambda x: forward(args, key, x, _BLOCKS), axis_name=_BLOCKS)(blocks.by_block(inputs))
        return forward(args, key, blocks.rows(inputs), None), parts

    keys = [jax.random.key(0), jax.random.key(1)]
    traced = jax.jit(together_and_blocks).trace(args, keys[0], inputs)
    out = jax.tree.leaves(traced.out_info)
    rows_first = rows_first or [x.shape[:1] == (blocks.used_rows,) for x in jax.tree.leaves(traced.out_info[0])]
    if traced.jaxpr.effects or sum(x.size * x.dtype.itemsize for x in out) > MAX_BYTES or not any(rows_first):
        return None
    program = traced.lower().compile()
    together, parts = (_compared(t, rows_first) for t in program(args, keys[0], inputs))
    if [x.shape[1:] for x in together] != [x.shape[2:] for x in parts]:
        return 1.0  # an output shaped by the rows it saw (rows against rows)
    differing = _apart(together, [blocks.joined(x) for x in parts], rtol)
    if differing > MOST and _apart(together, _compared(program(args, keys[1], inputs)[0], rows_first), rtol) > MOST:
        return None  # random in eval mode (dropout the mode does not reach): not comparable
    return differing


def _compared(tree, rows_first: list[bool]) -> list:
    """The float leaves of `tree` that have the rows first (bfloat16 too, which NumPy does not count)."""
    leaves = jax.tree.leaves(tree)
    return [x for x, r in zip(leaves, rows_first) if r and jnp.issubdtype(x.dtype, jnp.floating)]


def _apart(together: list, joined: list, rtol: float) -> float:
    """The share of finite rows whose outputs differ by over `rtol` of their norm (a floor of a thousandth
    of the rows' mean norm keeps rows of zeros from counting rounding)."""
    if not together:
        return 0.0
    a = np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in together], axis=1)
    b = np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in joined], axis=1)
    finite = np.isfinite(a).all(axis=1) & np.isfinite(b).all(axis=1)  # a row masked to -inf says nothing
    if not finite.any():
        return 0.0
    a, b = a[finite], b[finite]
    norms = np.linalg.norm(a, axis=1)
    floor = 1e-3 * float(norms.mean()) + np.finfo(np.float32).tiny
    return float(np.mean(np.linalg.norm(a - b, axis=1) > rtol * np.maximum(norms, floor)))
