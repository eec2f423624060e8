"""Which parameters train: the `trainable=` choice resolved to one bool per parameter leaf.

`trainable` is one of:
- None: every parameter trains, unless the model holds `nnx.LoRAParam`s, which then train alone
  (as Flax's `nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`);
- a string: a regular expression searched in each parameter's path ("blocks/0/attn/query/kernel");
- a function `(path, leaf) -> bool` of that path and the leaf's abstract value;
- an NNX filter (a `Variable` type, `nnx.Any(...)`, `nnx.PathContains(...)`, a tuple of them), for
  NNX models.

A frozen leaf is left out of differentiation (`stop_frozen`) and its update is zero
(`frozen_optimizer`): it keeps no optimizer state and is never changed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import optax

from zerojax.core.trees import path_str
from zerojax.errors import UserError

TRAIN, FREEZE = "train", "freeze"  # the labels of `frozen_optimizer`'s two groups


def is_nnx_filter(spec) -> bool:
    """A `Variable` type, an `nnx.filterlib` filter, or a tuple of them (not a plain function)."""
    if isinstance(spec, tuple):
        return all(is_nnx_filter(s) for s in spec)
    return isinstance(spec, type) or type(spec).__module__.startswith("flax.nnx")


def select(spec, param_shapes, variable_types: dict[str, type] | None = None):
    """The mask (a bool per leaf of `param_shapes`) of what trains, or None where everything does.

    `variable_types`: {param path: its NNX `Variable` type}, for NNX filters and the LoRA default."""
    if spec is None:
        lora = _lora_type()
        if lora is None or not any(issubclass(t, lora) for t in (variable_types or {}).values()):
            return None
        spec = lora
    if isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as e:
            raise UserError(f"trainable={spec!r} is not a regular expression: {e}.") from None
        keep: Callable[[str, Any], bool] = lambda path, leaf: pattern.search(path) is not None  # noqa: E731
    elif is_nnx_filter(spec):
        if variable_types is None:
            raise UserError(f"trainable={spec!r} is an NNX filter, but this is not an NNX model; give a regex.")
        keep = _nnx_predicate(spec, variable_types)
    elif callable(spec):
        keep = lambda path, leaf: bool(spec(path, leaf))  # noqa: E731
    else:
        raise UserError(
            f"trainable={spec!r}: give a regex over parameter paths, a function (path, leaf) -> bool or an NNX filter."
        )
    mask = jax.tree_util.tree_map_with_path(lambda p, leaf: keep(path_str(p), leaf), param_shapes)
    flags = jax.tree.leaves(mask)
    if not any(flags):
        raise UserError(f"trainable={spec!r} selects none of the model's {len(flags)} parameters.")
    return None if all(flags) else mask


def _lora_type():
    from flax import nnx

    return getattr(nnx, "LoRAParam", None)


def _nnx_predicate(spec, variable_types: dict[str, type]):
    from flax import nnx

    predicate = nnx.filterlib.to_predicate(spec)

    def keep(path: str, leaf) -> bool:
        var_type = variable_types.get(path)
        if var_type is None:
            return False
        parts = tuple(int(p) if p.isdigit() else p for p in path.split("/"))
        return bool(predicate(parts, var_type(leaf)))

    return keep


def labels(mask):
    return jax.tree.map(lambda t: TRAIN if t else FREEZE, mask)


def frozen_optimizer(tx: optax.GradientTransformation, mask) -> optax.GradientTransformation:
    """`tx` over the trainable leaves only; the frozen ones get a zero update and no state (their
    entries in `tx`'s state are `optax.MaskedNode`s). `tx`'s own global-norm clipping then sees the
    trainable leaves only."""
    if mask is None:
        return tx
    return optax.multi_transform({TRAIN: tx, FREEZE: optax.set_to_zero()}, labels(mask))


def stop_frozen(params, mask, dtypes=None):
    """`params` with the frozen leaves' subtrees (stored values of any kind) out of differentiation:
    XLA then never computes their gradients, nor reduces them. `dtypes` (`declared_dtypes`): a frozen
    integer leaf, kept in the compute dtype (which holds it exactly: `check_param_dtypes`), is read
    in its own dtype again, so a model's integer operations on it (unpacking int4 codes) run."""
    if mask is None:
        return params
    dtypes = dtypes if dtypes is not None else jax.tree.map(lambda _: "", mask)

    def frozen(x, dtype: str):
        if dtype and isinstance(x, jax.ShapeDtypeStruct):  # a structure trace's abstract value
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) and dtype:
            return jax.lax.stop_gradient(x).astype(dtype)
        # a stored value of another kind (hpZ's pair of shards) is read as its gather says
        return jax.tree.map(lambda v: jax.lax.stop_gradient(v) if isinstance(v, jax.Array) else v, x)

    return jax.tree.map(lambda t, d, p: p if t else frozen(p, d), mask, dtypes, params)


def declared_dtypes(param_shapes, mask):
    """Per parameter leaf, the dtype name of a frozen leaf the model declares as an integer or
    boolean, else "" (its values are read as stored)."""
    if mask is None:
        return None
    kept = lambda t, x: "" if t or jax.numpy.issubdtype(x.dtype, jax.numpy.inexact) else x.dtype.name  # noqa: E731
    return jax.tree.map(kept, mask, param_shapes)


def frozen_apply(fn, mask, dtypes=None):
    """A model's function of its params first (`apply(params, ...)`, its structure traces) with the
    frozen leaves out of differentiation and in their declared dtypes (`stop_frozen`)."""
    if fn is None:
        return None

    def run(params, *args, **kwargs):
        return fn(stop_frozen(params, mask, dtypes), *args, **kwargs)

    return run
