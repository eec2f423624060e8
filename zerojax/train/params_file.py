"""The consolidated params file (.npz) that `zerojax export` and `zerojax import` write: reading it
(`zj.load_params`, `zj.load_model_state`), and a fresh run started from it instead of a random init
(`train.init_from`); a file that does not fit the model is one sentence naming a parameter."""

from __future__ import annotations

import os

import jax
import numpy as np

from zerojax.core.trees import path_str
from zerojax.errors import UserError

MODEL_STATE_ENTRY = "__model_state__"  # the .npz entry naming the model-state collections


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, last = [int(p) if p.isdigit() else p for p in name.split("/")]
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def _drop_model_state(flat: dict) -> dict:
    collections = {str(c) for c in flat.pop(MODEL_STATE_ENTRY, ())}
    return {k: v for k, v in flat.items() if k.split("/")[0] not in collections}


def load_model_state(path: str) -> dict:
    """The model-state collections of a file written by `zerojax export`: {"batch_stats": {...}}."""
    with np.load(path, allow_pickle=False) as npz:
        if MODEL_STATE_ENTRY not in npz.files:
            return {}
        collections = {str(c) for c in npz[MODEL_STATE_ENTRY]}
        return _unflatten({k: npz[k] for k in npz.files if k.split("/")[0] in collections})


def load_params(path: str, model=None):
    """Parameters written by `zerojax export`.

    Without `model`: a nested dict of fp32 arrays shaped like the model's params (pass it to
    `Trainer.init(..., params=...)` to fine-tune). With an `nnx.Module`: that module, its
    parameters replaced in place, after checking every name and shape. Model-state collections
    (BatchNorm statistics) are left out of both; `load_model_state(path)` reads them.
    """
    if not os.path.isfile(path):
        raise UserError(f"parameter file {path!r} does not exist.")
    try:
        with np.load(path, allow_pickle=False) as npz:
            flat = {name: npz[name] for name in npz.files}
        flat = _drop_model_state(flat)
    except Exception:  # noqa: BLE001
        raise UserError(f"parameter file {path!r} is not a readable .npz written by `zerojax export`.") from None
    if model is None:
        return _unflatten(flat)
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    wanted = {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(pure)[0]}
    for name in sorted(set(wanted) | set(flat)):
        if name not in flat or name not in wanted or tuple(flat[name].shape) != wanted[name]:
            raise UserError(f"parameter file {path!r} does not fit this model: parameter {name!r} differs.")
    new = jax.tree_util.tree_map_with_path(lambda p, x: jax.numpy.asarray(flat[path_str(p)], x.dtype), pure)
    nnx.replace_by_pure_dict(state, new)
    nnx.update(model, state)
    return model


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    return {path_str(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_fits(params, param_shapes, path: str, may_lack: frozenset = frozenset()) -> None:
    """Every parameter of the model is in `params` with its shape, and nothing else is (but for those
    named in `may_lack`, which it may lack)."""
    got, want = _shapes(params), _shapes(param_shapes)
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name) and not (name in may_lack and name not in got):
            there = f"has shape {got[name]}" if name in got else "is missing"
            model = f"the model's is {want[name]}" if name in want else "the model has no such parameter"
            raise UserError(
                f"train.init_from {path!r} does not fit the configured model: parameter {name!r} {there}; {model}."
            )


def initial_params(path: str, trainer, key, batch: dict):
    """The params of `path`, checked against the model `trainer` trains on `batch`. Where part of the
    model is frozen (`trainable=`), the file may lack trainable leaves (a base model without the
    adapters): those are None, and start from the model's init."""
    params = load_params(path)
    prep = trainer.prepare(key, batch)
    layout = prep.layout
    trainable = {l.path for l in layout.trained_leaves()} if layout.frozen_leaves() else set()
    check_fits(params, prep.param_shapes, path, may_lack=frozenset(trainable))
    given = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    return jax.tree_util.tree_map_with_path(lambda p, _: given.get(path_str(p)), prep.param_shapes)
