"""What `Trainer` takes as a model, checked before anything is built: a Linen module instance, an NNX
module, or a callable that builds one from `rngs` (the NNX class itself, `functools.partial(Class,
...)`, `lambda rngs: ...`). Anything else is one `UserError` saying what was given. And the params
`init` may start from, in the forms Flax hands them out (`given_params`)."""

from __future__ import annotations

import inspect
from typing import Any

from flax import linen as nn
from flax import nnx
from flax.core import FrozenDict, unfreeze

from zerojax.errors import UserError

KINDS = "a flax.linen.Module instance, an nnx.Module, or a callable building one from rngs"


def check_kind(model: Any) -> None:
    """One `UserError` unless `model` is one of the `KINDS`."""
    if isinstance(model, nn.Module | nnx.Module):
        return
    name = getattr(model, "__name__", type(model).__name__)
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise UserError(f"model is the Linen class {name}; pass an instance of it, {name}(...).")
    if isinstance(model, type) and not issubclass(model, nnx.Module):
        raise UserError(f"model is the class {name}, which is neither an nnx.Module nor a flax.linen.Module.")
    if not callable(model):
        raise UserError(f"model must be {KINDS}; got a value of type {type(model).__name__}.")
    if not _binds_rngs(model):
        raise UserError(
            f"model {name} is called as model(rngs=...) to build an NNX module, but {_lacks(model)}; pass "
            f"functools.partial({name}, ...) or lambda rngs: ..., or, for a Linen model, the module instance."
        )


def built(made: Any) -> nnx.Module:
    """What the model's callable built, checked: an NNX module."""
    if isinstance(made, nnx.Module):
        return made
    if isinstance(made, nn.Module):
        raise UserError("model(rngs) returned a flax.linen.Module; pass the Linen module instance as model.")
    raise UserError(f"model(rngs) returned a value of type {type(made).__name__}, not an nnx.Module.")


def given_params(params: Any) -> Any:
    """Params given to `init` as the plain nested dict the model's params are: an NNX module or an
    `nnx.State` (`nnx.state(model)`: its `Param`s), or a Linen `FrozenDict`, taken as their contents."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        return nnx.to_pure_dict(params.filter(nnx.Param))
    if isinstance(params, FrozenDict):
        return unfreeze(params)
    return params


def _binds_rngs(fn) -> bool:
    signature = _signature(fn)
    if signature is None:  # nothing to read: let the call say
        return True
    for args, kwargs in (((), {"rngs": None}), ((None,), {})):  # by keyword, or alone by position
        try:
            signature.bind(*args, **kwargs)
            return True
        except TypeError:
            continue
    return False


def _lacks(fn) -> str:
    """What a callable that cannot be called with rngs alone lacks, in words."""
    parameters = _signature(fn).parameters.values()  # type: ignore[union-attr]  # read: `_binds_rngs`
    needs = [p.name for p in parameters if p.default is p.empty and p.name != "rngs" and p.kind not in _VARIADIC]
    return f"it also needs {', '.join(needs)}" if needs else "it takes no rngs"


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _signature(fn) -> inspect.Signature | None:
    """`fn`'s call signature; a class's is its `__init__`'s past `self` (an NNX class's own reads
    `(*args, **kwargs)`, its metaclass's)."""
    try:
        if isinstance(fn, type):
            signature = inspect.signature(fn.__init__)  # type: ignore[misc]  # the class's own
            return signature.replace(parameters=list(signature.parameters.values())[1:])
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None
