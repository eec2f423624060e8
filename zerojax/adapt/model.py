"""Turn a user's model into two pure functions: `init(key, inputs) -> (params, static)` and
`apply(params, static, inputs, layer_hook=None, around=None, layer_loop=None) -> outputs`.

Accepted: a callable `rngs -> nnx.Module` (e.g. the module class), an existing `nnx.Module`, or a
`flax.linen.Module`. Params are a pure nested dict of arrays; `static` holds the model's
non-trainable state, which the train step carries unchanged.

`around(module)`, when given, is called on the bound module right before it runs and returns the
context manager the call runs in: the `shard_map` engine uses it to make submodules FSDP units.
Only this module knows Linen from NNX: `modules` lists a model's submodules and `unit_around` makes
the chosen ones FSDP units, the same way for both (see `zerojax.adapt.units`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from zerojax.adapt import batch_axes, model_kind, wrap_linen, wrap_nnx
from zerojax.adapt import stacked as stacked_lib
from zerojax.adapt.mode import CALL_RNGS, keyed_run, linen_streams, mode_arguments, mode_names, takes_by_name
from zerojax.core.trees import path_str, under


@dataclass(frozen=True)
class FunctionalModel:
    init: Callable  # (key, inputs) -> (params, model_state, static)
    # (params, model_state, static, inputs, *, rng, train, layer_hook, around, layer_loop)
    #   -> (outputs, new model_state)
    apply: Callable
    accepts_layer_hook: bool  # the model gathers per layer when given a hook (models/gpt.py, zerojax.adapt.stacked)
    module_type: type | None = None  # the model's class
    accepts_layer_loop: bool = False  # the model hands its layer loop to a `layer_loop` (prefetch)
    # (logical params, model state, abstract inputs) -> [(path, class, parameter leaves)] of its submodules
    modules: Callable[[Any, Any, Any], list] | None = None
    # (`zerojax.adapt.units.UnitPlan`) -> around(module): the plan's units gather their own params
    unit_around: Callable[..., Callable] | None = None
    # param paths of the model's `zj.Stacked` layer stacks (leaves keep axis 0 whole; one hook each)
    stacks: tuple[tuple, ...] = ()
    # a model taking `layer_hook`: its class's `layer_stacks` (the shipped GPT's "blocks"); never a name alone
    declared_stacks: tuple[tuple, ...] = ()
    # (logical params, model state, static, abstract inputs) -> the param paths of its lifted layer
    # stacks: Linen `nn.scan` / `nn.vmap`, NNX `nnx.vmap`-built modules run through `nnx.scan` or
    # `nnx.vmap` (found by tracing: inside the transform, their modules see one layer's params)
    lifted_stacks: Callable[[Any, Any, Any, Any], tuple] | None = None
    # (key, abstract inputs) -> {param path "a/b/kernel": its logical axis names} for the leaves the
    # model annotates (`nnx.with_partitioning`, `nn.with_logical_partitioning`; see `zerojax.core.axis_rules`)
    axis_names: Callable[[Any, Any], dict] | None = None
    # NNX: {param path "a/b/kernel": its `Variable` type} (what `trainable=` filters select by)
    variable_types: dict | None = None

    def on_mesh(self, context: Callable[[], Any]) -> FunctionalModel:
        """This model with every function that traces the user's code run inside `context()` (a
        `zerojax.core.model_mesh.ModelMesh`'s `active`: the mesh the model's own shardings mean)."""
        traced = ("init", "apply", "modules", "lifted_stacks", "axis_names")
        return dataclasses.replace(self, **{n: _within(context, getattr(self, n)) for n in traced})


def _within(context, fn):
    if fn is None:
        return None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    return run


# The metadata key under which each Flax version keeps an NNX variable's axis names.
_NNX_NAME_KEYS = ("out_sharding", "sharding_names", "sharding")


def _nnx_axis_names(abstract: nnx.Module, key=None, inputs=None) -> dict:
    del key, inputs  # an NNX module's variables carry their metadata from construction
    names = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        meta = var.get_metadata()
        found = next((meta[k] for k in _NNX_NAME_KEYS if meta.get(k)), None)
        if found:
            names[path_str(path)] = tuple(found)
    return names


def _linen_axis_names(module, rng_streams, mode, key, inputs) -> dict:
    with batch_axes.linen(None):
        boxed = jax.eval_shape(
            lambda k, x: module.init({"params": k, **{s: k for s in rng_streams}}, x, **mode(False)), key, inputs
        )
    flat = jax.tree_util.tree_flatten_with_path(
        boxed.get("params", {}), is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
    )[0]
    return {
        path_str(path): tuple(leaf.names)
        for path, leaf in flat
        if isinstance(leaf, nn.Partitioned)  # LogicallyPartitioned is one too
    }


# ---- NNX ------------------------------------------------------------------------------------------
#
# A module splits into three groups: `nnx.Param`s (the params), its RNG streams (`RngKey`/`RngCount`,
# the "static" part: never trained, rewritten from the step's key each call) and every other
# variable (BatchStat and user variables: the model state, grouped by collection name, carried and
# updated by the step).

_COLLECTION_NAMES = {"BatchStat": "batch_stats", "Cache": "cache"}


def _collection(var_type: type) -> str:
    return _COLLECTION_NAMES.get(var_type.__name__, var_type.__name__)


def _nnx_split(module: nnx.Module):
    """(graphdef, params dict, rng State, model_state {collection: nested dict})."""
    graphdef, params, rng_state, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)  # type: ignore[misc]
    model_state: dict = {}
    for path, var in nnx.to_flat_state(rest):
        if not isinstance(var, nnx.Intermediate):  # sown or perturbed in a call: read by the caller, not kept
            model_state.setdefault(_collection(type(var)), {})[path] = var.get_value()
    model_state = {k: nnx.traversals.unflatten_mapping(v) for k, v in model_state.items()}
    return graphdef, nnx.to_pure_dict(params), rng_state, model_state


def _merge_state(model_state: dict) -> nnx.State:
    flat = {}
    for tree in model_state.values():
        flat.update(nnx.traversals.flatten_mapping(tree))
    return nnx.State(nnx.traversals.unflatten_mapping(flat))


def _reseed(rng_state: nnx.State, key) -> nnx.State:
    """Every RNG stream keyed from the step's `key` (the i-th `RngKey`, in path order, gets
    `fold_in(key, i)`) with its counter at zero: a call's draws depend on (seed, step) only."""
    flat = dict(nnx.to_flat_state(rng_state))
    out, i = {}, 0
    for path in sorted(flat, key=lambda p: tuple(str(k) for k in p)):
        var = flat[path]
        if isinstance(var, nnx.RngKey):  # a stack of keys (`zj.Stacked`) gets as many keys
            shape = var.get_value().shape
            out[path] = jax.random.fold_in(key, i) if not shape else jax.random.split(jax.random.fold_in(key, i), shape)
            i += 1
        else:
            out[path] = jnp.zeros_like(var.get_value())
    return nnx.State(nnx.traversals.unflatten_mapping(out))


def _rngs_by_keyword(make) -> bool:
    """Whether `make` (a Module class or a factory) takes `rngs` only by keyword, Flax-style
    (`__init__(self, ..., *, rngs)`); otherwise it is passed positionally."""
    while isinstance(make, functools.partial):  # functools.partial(MyModel, depth=4)
        make = make.func
    fn = make.__init__ if isinstance(make, type) else make  # type: ignore[misc]
    try:
        param = inspect.signature(fn).parameters.get("rngs")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


def _nnx_functions(make: Callable[[Any], nnx.Module] | None, concrete: nnx.Module | None) -> FunctionalModel:
    if make is not None and _rngs_by_keyword(make):
        make = (lambda build: lambda rngs: build(rngs=rngs))(make)  # type: ignore[call-arg]
    abstract = concrete if concrete is not None else nnx.eval_shape(lambda: _built(make, nnx.Rngs(0)))
    graphdef = nnx.split(abstract, nnx.Param, nnx.RngState, ...)[0]
    call = type(abstract).__call__
    hooked = takes_by_name(call, "layer_hook")
    looped = hooked and takes_by_name(call, "layer_loop")
    stacks = () if hooked else stacked_lib.stack_paths(abstract)
    declared = tuple((name,) for name in getattr(type(abstract), "layer_stacks", ())) if hooked else ()
    apply = functools.partial(
        _nnx_apply, graphdef, hooked, looped, stacks, mode_names(call), takes_by_name(call, CALL_RNGS)
    )
    return FunctionalModel(
        functools.partial(_nnx_init, make, concrete),
        apply,
        hooked or bool(stacks),
        type(abstract),
        looped or bool(stacks),
        modules=functools.partial(_nnx_modules, apply, abstract),
        unit_around=wrap_nnx.nnx_around,
        stacks=stacks,
        declared_stacks=declared,
        lifted_stacks=None if hooked or stacks else functools.partial(_nnx_lifted_stacks, apply),
        axis_names=functools.partial(_nnx_axis_names, abstract),
        variable_types={path_str(p): type(v) for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))},
    )


def _built(make, rngs: nnx.Rngs) -> nnx.Module:
    """The model, its variables created unsharded: zerojax lays them out itself, and a model annotated
    for Flax's eager sharding (`nnx.with_partitioning`) would otherwise need a mesh context to build."""
    with nnx.use_eager_sharding(False):
        return model_kind.built(make(rngs))


def _nnx_init(make, concrete, key, inputs):
    del inputs  # NNX modules know their shapes from their constructor
    module = concrete if concrete is not None else _built(make, nnx.Rngs(key))
    _, params, rng_state, model_state = _nnx_split(module)
    return params, model_state, rng_state


def _nnx_apply(
    graphdef,
    hooked: bool,
    looped: bool,
    stacks,
    modes: tuple[str, ...],
    call_rngs: bool,
    params,
    model_state,
    static,
    inputs,
    *,
    rng=None,
    train=True,
    layer_hook=None,
    around=None,
    layer_loop=None,
    sync=None,
):
    # Without a key: the stored streams, copied, so units may update them in any trace.
    rng_state = jax.tree.map(lambda x: x, static) if rng is None else _reseed(static, rng)
    module = nnx.merge(graphdef, nnx.State(params), rng_state, _merge_state(model_state))
    module.train() if train else module.eval()
    kwargs = mode_arguments(modes, train)
    if call_rngs:
        kwargs[CALL_RNGS] = _call_rngs(rng)
    if layer_hook is not None and hooked:
        kwargs["layer_hook"] = _single(layer_hook)
    if layer_loop is not None and looped:
        kwargs["layer_loop"] = _single(layer_loop)
    batch_axes.nnx_sync(module, sync)
    contexts = contextlib.ExitStack()
    contexts.enter_context(batch_axes.unbound_refused())
    if stacks and (layer_hook or layer_loop):
        contexts.enter_context(stacked_lib.hooks_installed(module, layer_hook, layer_loop))
    if around:
        contexts.enter_context(around(module))
    with contexts:
        out = module(inputs, **kwargs)
    return out, _nnx_split(module)[3] if model_state else model_state


# The salt of a call-time stream's key ("rngs" in ASCII): no stored stream's index (`_reseed`) reaches it.
_CALL_RNGS_SALT = 0x726E6773


def _call_rngs(rng) -> nnx.Rngs:
    """The `nnx.Rngs` a model taking `rngs` at call time gets: keyed from the step's key as the stored
    streams are (per step, device and micro-batch alike); without a key (evaluation), a fixed one."""
    return nnx.Rngs(jax.random.fold_in(rng, _CALL_RNGS_SALT) if rng is not None else jax.random.key(0))


def _nnx_lifted_stacks(apply, params, model_state, static, inputs) -> tuple:
    """The paths of the model's lifted layer stacks, found by one abstract trace (`nnx_slice_recorder`)."""
    sliced = _nnx_sliced(apply, params, model_state, static, inputs)[0]
    return tuple(sorted(p for p in sliced if not any(q != p and p[: len(q)] == q for q in sliced)))


def _nnx_modules(apply, abstract: nnx.Module, params, model_state, inputs) -> list:
    """`wrap_nnx.nnx_modules`, less those called inside nested scans (stacks of several layer axes):
    their params are gathered whole by their owner. Found by a trace only where a leaf could stack
    layers twice (three axes or more)."""
    modules = wrap_nnx.nnx_modules(abstract)
    if all(len(x.shape) < 3 for x in jax.tree.leaves(params)):
        return modules
    nested = _nnx_sliced(apply, params, model_state, _nnx_split(abstract)[2], inputs)[1]
    return [m for m in modules if not under(m[0], nested)]


def _nnx_sliced(apply, params, model_state, static, inputs) -> tuple[set, set]:
    """(the paths of modules called on one layer of a stack, those called inside nested scans)."""
    ranks = {tuple(str(k) for k in p): len(v.shape) for p, v in nnx.traversals.flatten_mapping(params).items()}
    sliced: set = set()
    nested: set = set()
    recorder = wrap_nnx.nnx_slice_recorder(ranks, sliced, nested)
    jax.eval_shape(lambda *a: apply(*a, rng=jax.random.key(0), around=recorder)[0], params, model_state, static, inputs)
    return sliced, nested


def _single(hooks):
    """A model's own `layer_hook` argument: engines pass {stack path: hook}; the model has one stack."""
    if not isinstance(hooks, dict):
        return hooks
    if len(hooks) != 1:
        raise ValueError(f"a model taking layer_hook has one layer stack, got hooks for {sorted(hooks)}")
    return next(iter(hooks.values()))


# ---- Linen ----------------------------------------------------------------------------------------
#
# Every collection besides "params" (batch_stats, any user collection) is model state, mutable in
# the train step. `__call__` gets its mode arguments by name (`mode_names`: `train=True/False`,
# `deterministic=False/True`, ...); each name in `rng_streams` gets a key folded from the step's key.


def _linen_functions(module: nn.Module, rng_streams: tuple[str, ...]) -> FunctionalModel:
    mode = functools.partial(mode_arguments, mode_names(type(module).__call__, hooks=()))
    structure = functools.partial(_linen_structure, module, rng_streams, mode)
    return FunctionalModel(
        functools.partial(_linen_init, module, rng_streams, mode),
        functools.partial(_linen_apply, module, rng_streams, mode),
        False,
        type(module),
        modules=lambda params, model_state, inputs: structure(params, model_state, inputs)[0],
        unit_around=wrap_linen.linen_around,
        lifted_stacks=lambda params, model_state, static, inputs: structure(params, model_state, inputs)[1],
        axis_names=functools.partial(_linen_axis_names, module, rng_streams, mode),
    )


def _linen_structure(module, rng_streams, mode, params, model_state, inputs):
    structure = functools.partial(wrap_linen.linen_structure, module, params, model_state, inputs, **mode(False))
    with batch_axes.linen(None):
        return keyed_run(structure, None, rng_streams, train=False)


_CALL_COLLECTIONS = ("intermediates", "perturbations")


def _linen_init(module, rng_streams, mode, key, inputs):
    with batch_axes.linen(None), batch_axes.unbound_refused():
        variables = module.init({"params": key, **{s: key for s in rng_streams}}, inputs, **mode(False))
    variables = nn.meta.unbox(variables)  # `nn.with_logical_partitioning` boxes: zerojax lays the arrays out itself
    # Flax's own idiom: applied with only its state, `sow` and `perturb` are no-ops (their
    # collections, whose shapes are the init batch's, are read by a caller, not trained).
    model_state = {k: v for k, v in variables.items() if k not in ("params", *_CALL_COLLECTIONS)}
    return dict(variables["params"]), model_state, None


def _linen_apply(
    module,
    rng_streams,
    mode,
    params,
    model_state,
    static,
    inputs,
    *,
    rng=None,
    train=True,
    layer_hook=None,
    around=None,
    layer_loop=None,
    sync=None,
):
    del static, layer_hook, layer_loop
    mutable = list(model_state) if train else []
    contexts = contextlib.ExitStack()
    contexts.enter_context(batch_axes.linen(sync))
    contexts.enter_context(batch_axes.unbound_refused())
    if around is not None:
        contexts.enter_context(around(module))
        mutable = [*mutable, "params"]  # the root writes its gathered params into its scope
    with contexts:
        run = functools.partial(module.apply, {"params": params, **model_state}, inputs, mutable=mutable or False)
        out = keyed_run(functools.partial(run, **mode(train)), rng, rng_streams, train)
    if not mutable:
        return out, model_state
    out, updates = out
    return out, {**model_state, **{k: v for k, v in updates.items() if k in model_state}}


def functional(model, rng_streams: tuple[str, ...] | None = None) -> FunctionalModel:
    """The model as pure functions; `rng_streams`: a Linen model's `make_rng` streams (None: dropout)."""
    model_kind.check_kind(model)
    if isinstance(model, nn.Module):
        return _linen_functions(model, linen_streams(rng_streams, linen=True))
    linen_streams(rng_streams, linen=False)
    if isinstance(model, nnx.Module):
        return _nnx_functions(None, model)
    return _nnx_functions(model, None)


def param_shapes(fm: FunctionalModel, key, inputs):
    """Abstract params (ShapeDtypeStruct leaves) without allocating anything."""
    return jax.eval_shape(fm.init, key, inputs)[0]
