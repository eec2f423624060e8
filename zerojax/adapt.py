"""Turn a user's model into two pure functions: `init(key, inputs) -> (params, static)` and
`apply(params, static, inputs, layer_hook=None, around=None, layer_loop=None) -> outputs`.

Accepted: a callable `rngs -> nnx.Module` (e.g. the module class), an existing `nnx.Module`, or a
`flax.linen.Module`. Params are a pure nested dict of arrays; `static` holds the model's
non-trainable state, which the train step carries unchanged.

`around(module)`, when given, is called on the bound module right before it runs and returns the
context manager the call runs in: the `shard_map` engine uses it to make submodules FSDP units.
Only this module knows Linen from NNX: `modules` lists a model's submodules and `unit_around` makes
the chosen ones FSDP units, the same way for both (see `zerojax.wrap`).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import jax
from flax import linen as nn
from flax import nnx

from zerojax import wrap


@dataclass(frozen=True)
class FunctionalModel:
    init: Callable  # (key, inputs) -> (params, static)
    apply: Callable  # (params, static, inputs, layer_hook, around, layer_loop) -> outputs
    accepts_layer_hook: bool  # the model gathers per layer when given a hook (see models/gpt.py)
    module_type: type | None = None  # the model's class
    accepts_layer_loop: bool = False  # the model hands its layer loop to a `layer_loop` (prefetch)
    # (logical params, static, abstract inputs) -> [(path, class, parameter leaves)] of its submodules
    modules: Callable[[Any, Any, Any], list] | None = None
    # (unit paths, materialize, param paths, reshard_after_forward) -> around(module)
    unit_around: Callable[..., Callable] | None = None


def _takes(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _nnx_functions(make: Callable[[Any], nnx.Module], concrete: nnx.Module | None) -> FunctionalModel:
    abstract = concrete if concrete is not None else nnx.eval_shape(lambda: make(nnx.Rngs(0)))
    graphdef, _, _ = nnx.split(abstract, nnx.Param, ...)

    def init(key, inputs):
        del inputs  # NNX modules know their shapes from their constructor
        module = concrete if concrete is not None else make(nnx.Rngs(key))
        _, params, static = nnx.split(module, nnx.Param, ...)
        return nnx.to_pure_dict(params), static

    hooked = _takes(type(abstract).__call__, "layer_hook")
    looped = hooked and _takes(type(abstract).__call__, "layer_loop")

    def apply(params, static, inputs, layer_hook=None, around=None, layer_loop=None):
        module = nnx.merge(graphdef, nnx.State(params), static)
        kwargs = {}
        if layer_hook is not None and hooked:
            kwargs["layer_hook"] = layer_hook
        if layer_loop is not None and looped:
            kwargs["layer_loop"] = layer_loop
        with around(module) if around else contextlib.nullcontext():
            return module(inputs, **kwargs)

    def unit_around(units, materialize, param_paths, reshard_after_forward=True):
        del param_paths  # an NNX module finds its params itself
        return wrap.nnx_around(units, materialize, reshard_after_forward)

    return FunctionalModel(init, apply, hooked, type(abstract), looped,
                           modules=lambda params, static, inputs: wrap.nnx_modules(abstract),
                           unit_around=unit_around)


def _linen_functions(module: nn.Module) -> FunctionalModel:
    def init(key, inputs):
        variables = module.init(key, inputs)
        static = {k: v for k, v in variables.items() if k != "params"}
        return dict(variables["params"]), static

    def apply(params, static, inputs, layer_hook=None, around=None, layer_loop=None):
        if around is None:
            return module.apply({"params": params, **static}, inputs)
        # Units write their gathered params into the scope, so "params" must be mutable here.
        with around(module):
            return module.apply({"params": params, **static}, inputs, mutable=["params"])[0]

    def unit_around(units, materialize, param_paths, reshard_after_forward=True):
        del reshard_after_forward  # a Linen unit's gathered params stay in its scope for the backward
        return wrap.linen_around(units, materialize, param_paths)

    return FunctionalModel(init, apply, False, type(module),
                           modules=lambda params, static, inputs: wrap.linen_modules(module, params, static, inputs),
                           unit_around=unit_around)


def functional(model) -> FunctionalModel:
    if isinstance(model, nn.Module):
        return _linen_functions(model)
    if isinstance(model, nnx.Module):
        return _nnx_functions(None, model)
    if callable(model):
        return _nnx_functions(model, None)
    raise TypeError(f"model must be an nnx.Module, a callable rngs -> nnx.Module, or a linen Module, got {type(model)}")


def param_shapes(fm: FunctionalModel, key, inputs):
    """Abstract params (ShapeDtypeStruct leaves) without allocating anything."""
    return jax.eval_shape(fm.init, key, inputs)[0]
