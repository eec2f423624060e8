"""`train.init_from`: a fresh run starts from the params of a file `zerojax export` or `zerojax import`
wrote instead of a random init; a file that does not fit the model is one sentence naming a parameter."""

from __future__ import annotations

import jax
import numpy as np

from zerojax.errors import UserError
from zerojax.export import load_params
from zerojax.stages import path_str


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    return {path_str(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_fits(params, param_shapes, path: str) -> None:
    """Every parameter of the model is in `params` with its shape, and nothing else is."""
    got, want = _shapes(params), _shapes(param_shapes)
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            there = f"has shape {got[name]}" if name in got else "is missing"
            model = f"the model's is {want[name]}" if name in want else "the model has no such parameter"
            raise UserError(
                f"train.init_from {path!r} does not fit the configured model: parameter {name!r} {there}; {model}."
            )


def initial_params(path: str, trainer, key, batch: dict):
    """The params of `path`, checked against the model `trainer` trains on `batch`."""
    params = load_params(path)
    check_fits(params, trainer.prepare(key, batch).param_shapes, path)
    return params
