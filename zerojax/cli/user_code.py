"""User code named in a config as "package.module:name": the model, the data and the loss.

    model.target  an NNX module class, or a callable taking `rngs` and returning an `nnx.Module`, or a
                  callable (e.g. a Linen module class) returning a `flax.linen.Module`; `model.kwargs`
                  are passed to it
    data.target   called as name(seed=..., batch_size=..., **data.kwargs); returns a batch source
                  (`zerojax.data.sources`)
    loss.target   a callable (outputs, batch) -> scalar loss, replacing the cross entropy

The module is imported with the current directory on `sys.path` (as `python -m` would), so a
project's own packages resolve when `zerojax` runs from its root. Every failure is one `UserError`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from zerojax.errors import UserError


def import_target(text: str, key: str) -> Any:
    """The object "package.module:name" names (attribute paths `a.b` after the colon work too)."""
    module_name, sep, attr = str(text).partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"{key}={text!r} must look like 'package.module:name'.")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise UserError(
            f"{key}={text!r}: module {e.name!r} cannot be imported (not found; run from the folder "
            "that holds it, or install it or add it to PYTHONPATH)."
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise UserError(
            f"{key}={text!r}: importing {module_name!r} failed: {type(e).__name__}: {e}".rstrip().replace("\n", " ")
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{key}={text!r}: {module_name!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{key}={text!r} is a {type(obj).__name__}, not a class or function.")
    return obj


def _takes_rngs(fn: Callable) -> bool:
    try:
        return "rngs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def build_model(text: str, kwargs: dict) -> Any:
    """What `Trainer` accepts: a callable rngs -> nnx.Module, or a Linen module."""
    import functools

    import jax
    from flax import linen as nn
    from flax import nnx

    target = import_target(text, "model.target")
    key = f"model.target={text!r}"
    if isinstance(target, type) and not issubclass(target, nnx.Module | nn.Module):
        raise UserError(f"{key} is a class that is neither an nnx.Module nor a flax.linen.Module.")
    try:
        if (isinstance(target, type) and issubclass(target, nnx.Module)) or _takes_rngs(target):
            make = functools.partial(target, **kwargs)
            made = nnx.eval_shape(lambda: make(rngs=nnx.Rngs(0)))  # abstract: nothing is allocated
            if not isinstance(made, nnx.Module):
                # (traced abstractly, an array or a number comes back as its shape)
                what = "an array or a number" if isinstance(made, jax.ShapeDtypeStruct) else f"a {type(made).__name__}"
                raise UserError(f"{key} returned {what}, not an nnx.Module.")
            return lambda rngs: make(rngs=rngs)
        made = target(**kwargs)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - bad kwargs or a failing constructor
        raise UserError(
            f"{key} with model.kwargs={kwargs!r} failed: {type(e).__name__}: {e}".replace("\n", " ")
        ) from None
    if isinstance(made, (nn.Module, nnx.Module)):
        return made
    raise UserError(
        f"{key} returned a {type(made).__name__}; it must be an NNX module class, a callable taking "
        "rngs, or a callable returning a flax.linen.Module."
    )


def build_source(text: str, kwargs: dict, *, seed: int, batch_size: int) -> Any:
    from zerojax.data.sources import is_source

    target = import_target(text, "data.target")
    key = f"data.target={text!r}"
    try:
        source = target(seed=seed, batch_size=batch_size, **kwargs)
    except Exception as e:  # noqa: BLE001 - bad kwargs or a failing data loader
        raise UserError(
            f"{key} called with seed={seed}, batch_size={batch_size} and data.kwargs={kwargs!r} failed: "
            f"{type(e).__name__}: {e}".replace("\n", " ")
        ) from None
    if not is_source(source):
        raise UserError(
            f"{key} returned a {type(source).__name__}, not a batch source (an object with a "
            "batch(step) method returning a dict of arrays)."
        )
    return source


def build_loss(text: str) -> Callable:
    return import_target(text, "loss.target")
