"""The user's model, loss and batch checked against each other before anything compiles.

Each mistake is one sentence naming shapes (a `UserError`), instead of a traceback from inside the
step or, worse, a silent NaN: a model output that does not fit the targets, a missing batch key, a
loss that is not a scalar or a `WeightedLoss` (a bare tuple is refused), integer targets outside the output's classes.
The model and the loss run once on abstract values (`jax.eval_shape`, global shapes): nothing is
computed, and the check is the same whatever the stage or engine; only a user's loss, where the step
calls it on blocks of rows, is also computed once on the batch (`zerojax.adapt.loss_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.adapt.loss_rows import check_loss_splits
from zerojax.core.loss import WeightedLoss, unread_values
from zerojax.core.trees import abstract, describe, path_str
from zerojax.errors import UserError, first_line


def check_keys(batch: dict, default_loss: bool) -> None:
    """'inputs', and 'targets' for the default loss."""
    if not hasattr(batch, "keys"):
        raise UserError(f"a batch is a dict with an 'inputs' array, got a {type(batch).__name__}.")
    needed = ("inputs", "targets") if default_loss else ("inputs",)
    missing = [k for k in needed if k not in batch]
    if missing:
        why = " (the default loss, softmax cross-entropy, reads 'targets')" if "targets" in missing else ""
        raise UserError(f"the batch has no {' or '.join(repr(k) for k in missing)} key{why}; it has {sorted(batch)}.")


def check_rows(batch: dict) -> int:
    """The global batch rows of `batch['inputs']` (an array or a pytree of arrays): every leaf of it,
    and of every other entry, has them first. The step splits every entry by rows, so a scalar (a
    step number, a mixing weight) or a value shared by the rows cannot ride in the batch."""
    inputs = batch["inputs"]
    leaves = jax.tree.leaves(inputs)
    rows = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(rows) != 1 or -1 in rows:
        raise UserError(
            f"a batch's 'inputs' is an array or a pytree of arrays with the global batch first; got "
            f"{describe(abstract(inputs)) or 'no arrays'}."
        )
    count = rows.pop()
    for name, value in batch.items():
        for x in jax.tree.leaves(value):
            numeric = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).kind in "biufc"
            if not numeric or not np.ndim(x) or np.shape(x)[0] != count:
                got = describe(abstract(value)) if numeric else f"an array of {np.asarray(x).dtype}"
                got = "a string" if isinstance(x, str | bytes) else got
                raise UserError(
                    f"batch[{name!r}] is {got}, but every batch entry is arrays with the inputs' {count} rows "
                    "first (the step splits them by rows); pass a value every row shares through the model "
                    "or the loss function instead."
                )
    return count


def check_given_params(given, want) -> None:
    """`given` (`init`'s params; None where a leaf starts from the key) has `want`'s parameter paths
    and shapes; otherwise one `UserError` naming the first path that differs."""
    given_at = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(given, is_leaf=lambda x: x is None)[0]}
    want_at = {path_str(p): tuple(w.shape) for p, w in jax.tree_util.tree_flatten_with_path(want)[0]}
    missing = [path for path in want_at if path not in given_at]
    extra = [path for path in given_at if path not in want_at]
    shapes = [p for p, w in want_at.items() if given_at.get(p) is not None and tuple(np.shape(given_at[p])) != w]
    if missing:
        why = f"the model's {missing[0]!r} is not among them" + (f" (they have {extra[0]!r})" if extra else "")
    elif extra:
        why = f"they have {extra[0]!r}, which the model has not"
    elif shapes:
        why = f"{shapes[0]!r} is {list(np.shape(given_at[shapes[0]]))} where the model's is {list(want_at[shapes[0]])}"
    elif jax.tree.structure(given, is_leaf=lambda x: x is None) != jax.tree.structure(want):  # type: ignore[operator]
        why = "the same paths, in other containers (a list where the model has a dict?)"
    else:
        return
    raise UserError(f"the given params do not match the model's parameter names and shapes: {why}.")


def check_param_dtypes(param_shapes, trainable, compute_dtype) -> None:
    """Every parameter keeps its values in the state: a trained one is kept as a real floating-point
    master, a frozen one in `compute_dtype`. So a complex parameter (its imaginary part), a trained
    integer one, or a frozen integer one `compute_dtype` does not hold exactly (int32 in fp32, int16
    in bf16) is one `UserError`. `trainable`: a bool per leaf, or None where every leaf trains."""
    flat = jax.tree_util.tree_flatten_with_path(param_shapes)[0]
    trains = jax.tree.leaves(trainable) if trainable is not None else [True] * len(flat)
    exact_bits = jnp.finfo(compute_dtype).nmant + 1  # integers up to 2**exact_bits are exact
    for (path, x), trained in zip(flat, trains, strict=True):
        dtype = np.dtype(x.dtype)
        if jnp.issubdtype(dtype, jnp.floating):
            continue
        if dtype.kind in "biu" and not trained and (dtype.kind == "b" or dtype.itemsize * 8 <= exact_bits):
            continue
        if jnp.issubdtype(dtype, jnp.complexfloating):
            keep = "as two real parameters (its real and imaginary parts)"
        else:
            keep = "frozen in a narrower integer type, or" if not trained else "out of `trainable`, or"
            keep += " as a non-Param variable"
        raise UserError(
            f"param {path_str(path)!r} is {dtype.name}, which zerojax would change: it keeps a trained parameter "
            f"as a real floating-point master and a frozen one in the compute dtype ({np.dtype(compute_dtype).name}); "
            f"keep it {keep} instead."
        )


def check_model_and_loss(
    run_model: Callable,
    model_args: tuple,
    loss_fn: Callable,
    batch: dict,
    default_loss: bool,
    split: tuple[int, int, str] = (1, 1, ""),
) -> int | None:
    """Run `run_model(*model_args, inputs) -> outputs` and `loss_fn(outputs, batch)` on abstract
    values; one sentence for what does not fit. Returns the number of classes the default loss reads
    targets against (the output's last dimension), or None. `split`: the blocks of rows the step
    calls a user's loss on, and why (`zerojax.adapt.loss_rows`: measured where the batch is concrete)."""
    shapes = {k: abstract(v) for k, v in batch.items()}
    out = jax.eval_shape(run_model, *model_args, shapes["inputs"])
    if default_loss:
        _check_for_cross_entropy(out, shapes.get("targets"))
    if default_loss and "targets" not in shapes:  # a batch for shapes only (init): the step checks the rest
        return int(out.shape[-1])
    try:
        value = jax.eval_shape(loss_fn, out, shapes)
    except Exception as e:  # the user's loss: report what it was given, and its own first line
        first = first_line(e)
        raise UserError(
            f"the loss function failed on the model's output {_describe(out)} and the batch "
            f"({', '.join(f'{k} {describe(v)}' for k, v in shapes.items())}): {type(e).__name__}: {first}"
        ) from None
    _check_loss_value(value)
    if not default_loss:
        check_loss_splits(loss_fn, out, batch, split)
    return int(out.shape[-1]) if default_loss else None


def _describe(out: Any) -> str:
    leaves = jax.tree.leaves(out)
    if len(leaves) == 1 and leaves[0] is out:
        return describe(out)
    return str(jax.tree.map(describe, out))


def _check_for_cross_entropy(out, targets) -> None:
    if not hasattr(out, "shape") or not jnp.issubdtype(out.dtype, jnp.floating) or not out.shape:
        raise UserError(
            f"the default loss (softmax cross-entropy) needs the model to return one float array of "
            f"logits; it returned {_describe(out)}."
        )
    if targets is None:
        return
    if not hasattr(targets, "dtype"):
        raise UserError(
            f"the default loss (softmax cross-entropy) needs the batch's 'targets' to be one integer "
            f"array; they are {describe(targets)}."
        )
    if not np.issubdtype(targets.dtype, np.integer):
        raise UserError(
            f"the default loss (softmax cross-entropy) needs integer class targets; the batch's "
            f"'targets' are {describe(targets)}."
        )
    if tuple(out.shape[:-1]) != tuple(targets.shape):
        raise UserError(
            f"the model's output is {describe(out)} but the batch's targets are {describe(targets)}: the "
            f"default loss (softmax cross-entropy) needs logits of shape {list(targets.shape) + ['classes']}."
        )


def _check_loss_value(value) -> None:
    if isinstance(value, WeightedLoss):
        shapes = [list(getattr(v, "shape", [])) for v in value]
        if shapes != [[], []]:
            raise UserError(
                f"the loss function returned a WeightedLoss of shapes {shapes}; its total and weight must "
                f"each be a scalar, summed over the batch."
            )
        return
    if isinstance(value, tuple | list | dict):
        raise unread_values(value)
    if getattr(value, "shape", None) != ():
        raise UserError(
            f"the loss function returned shape {list(getattr(value, 'shape', []))}; it must return a "
            f"scalar (the batch's mean) or zj.WeightedLoss(total, weight) of scalars, summed over the batch."
        )


def check_targets(batch: dict, classes: int) -> None:
    """Integer targets in [0, classes): an out-of-range label would make the default loss NaN (a
    skipped step, not an error). Read on the host: a NumPy batch as it is, a `jax.Array` batch from
    this process's shards (a copy of the labels, small beside the step)."""
    targets = batch.get("targets")
    if targets is None:
        return
    parts = (
        [np.asarray(s.data) for s in targets.addressable_shards]
        if isinstance(targets, jax.Array)
        else [np.asarray(targets)]
    )
    if not parts or not np.issubdtype(parts[0].dtype, np.integer):
        return
    low, high = min(int(p.min()) for p in parts if p.size), max(int(p.max()) for p in parts if p.size)
    if low < 0 or high >= classes:
        raise UserError(
            f"a target is {low if low < 0 else high}, outside the model's {classes} output classes (0..{classes - 1})."
        )
