"""FSDP units for user models: which submodules gather their own parameters when they are called.

Like PyTorch FSDP's auto-wrap policy, a `WrapRule` picks submodules by class. A unit's parameters
are gathered right before its call and (with `reshard_after_forward`) dropped after it:
the backward pass recomputes the unit, gathering the weights again, and the gather's transpose
reduce-scatters the gradient. Each gather's operand depends on the unit's input (forward) or its
incoming cotangent (backward), so no scheduler can hoist it and no CSE can merge the two (see
`rematerialized` and docs/engines.md). With prefetch, each is tied one unit ahead instead: to the
previous unit's input and to the next unit's incoming cotangent (`Prefetch`).
Parameters outside every unit belong to the root and are gathered once, before the model runs.

The default rule, `WrapRule()`, needs no configuration: every module class that is used more than
once and holds parameters is a unit, outermost first (a transformer's blocks, an MLP's layers).
NNX units are made here; Linen units in `zerojax.wrap_linen`, through the same `rematerialized`.
"""

from __future__ import annotations

import collections
import contextlib
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.remat import check as check_remat
from zerojax.remat import unit_policy

Path = tuple[str, ...]
# (["a/b/kernel", ...], their stored values) -> the compute-dtype arrays: the leaves a unit uses
# together, so an engine may move them in one collective
Materialize = Callable[[list[str], list[Any]], list[Any]]
Policy = Any  # "full", "none" or a `jax.checkpoint` policy (`zerojax.remat.unit_policy`)


@dataclass(frozen=True)
class WrapRule:
    classes: tuple[type, ...] | None = None  # units by class; None: classes used more than once
    reshard_after_forward: bool = True  # re-gather in backward instead of keeping the weights
    # Which of a unit's activations the backward pass gets without recomputing them: "full" (none:
    # the unit is re-run), "dots" (the weight matmuls' outputs), "none" (all), "offload" (dots', in
    # host memory), or a `jax.checkpoint` policy. None: "full" when resharding (the backward re-runs
    # the unit to gather again anyway), else "none". The gathered weights themselves are never saved;
    # with "none", values the unit computes from them (a cast, a transpose) are, as `jax.vjp` keeps them.
    remat: Any = None

    def __post_init__(self):
        if not callable(self.remat) and self.remat is not None:
            check_remat(self.remat, key="WrapRule.remat")  # a bad name fails here; offload's backend when traced


def as_rule(wrap) -> WrapRule | None:
    """`"auto"` -> the default rule; `None`/`"none"` -> no units (one whole-model gather);
    a class or a tuple of classes -> those classes; a `WrapRule` as is."""
    if isinstance(wrap, WrapRule):
        return wrap
    if wrap is None or wrap is False or wrap == "none":
        return None
    if wrap == "auto":
        return WrapRule()
    classes = (wrap,) if isinstance(wrap, type) else tuple(wrap)
    if not classes or not all(isinstance(c, type) for c in classes):
        raise ValueError(f"wrap must be 'auto', 'none', a module class or a tuple of them, got {wrap!r}")
    return WrapRule(classes)


def choose_units(modules: list[tuple[Path, type, int]], rule: WrapRule) -> list[Path]:
    """Unit paths from `(path, class, parameter leaves in its subtree)` of every non-root module."""
    holding = [(p, c) for p, c, n in modules if p and n > 0]
    if rule.classes is not None:
        return sorted(p for p, c in holding if issubclass(c, rule.classes))
    uses = collections.Counter(c for _, c in holding)
    repeated = [p for p, c in holding if uses[c] > 1]
    return sorted(p for p in repeated if not any(q != p and p[: len(q)] == q for q in repeated))


def owner(leaf: Path, units) -> Path | None:
    """The deepest unit whose subtree holds `leaf`; None: the root's."""
    best = None
    for u in units:
        if leaf[: len(u)] == u and len(leaf) > len(u) and (best is None or len(u) > len(best)):
            best = u
    return best


def describe(units: list[Path], classes: dict[Path, type], rule: WrapRule | None) -> str:
    if not units:
        why = "wrap disabled" if rule is None else "no submodule matched the wrap rule"
        return f"whole model gathered at once ({why})"
    counts = collections.Counter(classes[u].__name__ for u in units)
    kinds = ", ".join(f"{n} x {name}" for name, n in sorted(counts.items()))
    how = "auto: classes used more than once" if rule.classes is None else "by class"
    return f"FSDP units: {kinds} ({how})"


def _key(path) -> str:
    return "/".join(str(p) for p in path)


# ---- a unit's gathers are ordered by data, not by barriers ---------------------------------------------
#
# A unit gathers right before its forward call and again right before its backward, holding the
# gathered weights only in between. Schedulers reorder independent work freely (XLA:CPU runs every
# independent all-gather first) and CSE merges equal computations (XLA:CPU strips optimization
# barriers before CSE, so a remat'd unit's re-gather becomes its forward gather, kept alive for the
# whole step). So each gather's *input* depends on data that exists only at the right time: the
# shard plus an exact zero computed from the unit's input (forward) or from the incoming cotangent
# (backward). No pass may hoist a gather above its operand, and the two gathers read different
# operands, so they are never merged. The backward recomputes the unit (a custom_vjp, since
# `jax.checkpoint` would replay the forward gather on the forward's operand).


def zero_from(tree) -> jax.Array:
    """An fp32 zero that depends on `tree`'s first floating-point value (NaN and inf give 0 too)."""
    for x in jax.tree.leaves(tree):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.size:
            z = x[(0,) * x.ndim].astype(jnp.float32) * 0  # x * 0 is not folded for floats (NaN * 0 = NaN)
            return jnp.where(jnp.isfinite(z), z, 0.0)
    return jnp.zeros((), jnp.float32)


def tie(x, token):
    """`x` plus the exact zero `token`: the same values, computed after `token` exists. hpZ's
    secondary copies tie the part that is gathered (`Secondary.tied`); stage 2's resident copies are
    left alone: they are not gathered."""
    if hasattr(x, "tied"):
        return x.tied(token)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
        return x + token.astype(x.dtype)
    return x


def tie_tree(tree, token):
    return jax.tree.map(lambda x: tie(x, token), tree)


class Prefetch:
    """One-unit-ahead prefetch: a per-trace record of the token of the unit called last.

    With it, unit i's forward gather is tied to the token of the *previous* unit's input (so it may
    start while unit i-1 computes: at most two units' weights gathered at once), and unit i's backward
    re-gather to the token of the incoming cotangent of the unit called after it (so it may start
    while unit i+1's backward runs). The token travels as a scalar: each unit also returns its own
    input's zero, which the next unit takes as an argument; that unit's backward returns its incoming
    cotangent's zero as the argument's cotangent, which is what unit i's backward receives.
    One record per traced model call: a token from another trace (a unit inside a unit, or inside a
    transform of the user's) is not used, and that unit ties its forward gather to its own input.
    A unit whose token no later unit took (the last one) ties its re-gather to its own cotangent. One
    whose token was taken by a unit off the loss's path (whose backward never runs) receives a constant
    zero instead: its re-gather is then free to move, and that unit's weights may be held longer
    (values are unchanged).
    """

    def __init__(self):
        self._last = None  # (trace state, token, followed flag of the unit that made it)

    def take(self):
        """(token of the previous unit in this trace, or None)"""
        if self._last is None:
            return None
        trace, token, followed = self._last
        if trace != _current_trace():
            return None
        followed[0] = True
        return token

    def put(self, token, followed: list) -> None:
        self._last = (_current_trace(), token, followed)


def _current_trace():
    from flax.core.tracers import current_trace

    return current_trace()


def rematerialized(
    run, gather, params, *args, policy: Policy = "full", wait_for_grads: bool = False, prefetch: Prefetch | None = None
):
    """`run(gather(params, token), *args)` with the gather tied to `args` (the unit's inputs) in the
    forward pass and, in the backward pass, gathered again tied to the incoming cotangent. With
    `prefetch`, tied one unit ahead instead (see `Prefetch`).

    `policy` says which of the unit's activations the forward keeps for the backward (see
    `zerojax.remat.unit_policy`); the gathered weights are never kept, whatever it says. With "full"
    only the inputs are kept and the backward re-runs the whole unit."""
    gfn, gconsts, body, rconsts = _converted(run, gather, params, args, policy)
    prev = prefetch.take() if prefetch is not None else None
    followed = [False]  # set when a later unit in this trace takes this unit's token
    # Where the regathered weights go among the forward's residuals: set by `fwd`, read by `bwd`.
    # Every trace of `fwd` for this call makes the same residual structure, so the last one serves.
    saved = [None]

    def forward(params, rest, consts, token):
        return body(gfn(params, token, *consts[0]), *rest, *consts[1])

    @jax.custom_vjp
    def call(args, consts, prev):
        mine = zero_from(args[1:])  # args[0]: the unit's params
        return forward(args[0], args[1:], consts, mine if prev is None else prev), mine

    def fwd(args, consts, prev):
        mine = zero_from(args[1:])
        if policy == "full":
            return call(args, consts, prev), (args, consts, ())
        weights = gfn(args[0], mine if prev is None else prev, *consts[0])
        out, vjp = jax.vjp(lambda w, rest, c: body(w, *rest, *c), weights, args[1:], consts[1])
        kept, saved[0] = _without(weights, vjp)
        return (out, mine), (args, consts, kept)

    def bwd(res, cts):
        args, consts, kept = res
        ct, ct_next = cts
        own = zero_from(ct)
        # `followed` is read when the backward pass is traced, after the whole forward: the next
        # unit's backward then hands its incoming cotangent's zero to this one as `ct_next`.
        token = ct_next if followed[0] else own
        if policy == "full":
            _, vjp = jax.vjp(lambda p, rest, c: forward(p, rest, c, token), args[0], args[1:], consts)
            d_params, d_rest, d_consts = vjp(ct)
        else:
            weights, vjp_gather = jax.vjp(lambda p, c: gfn(p, token, *c), args[0], consts[0])
            d_weights, d_rest, d_rconsts = _with(weights, kept, saved[0])(ct)
            d_params, d_gconsts = vjp_gather(d_weights)
            d_consts = (d_gconsts, d_rconsts)
        if wait_for_grads:
            d_params, d_rest = _waiting_for(d_params, d_rest)
        return (d_params, *d_rest), d_consts, (None if prev is None else own)

    call.defvjp(fwd, bwd)
    out, mine = call((params, *args), (gconsts, rconsts), prev)
    if prefetch is not None:
        prefetch.put(mine, followed)
    return out


def _converted(run, gather, params, args, policy):
    """`gather` and `run` as functions of arrays only (their closed-over arrays returned as consts, as
    a `custom_vjp` needs), `run` under `jax.checkpoint(policy)` unless the policy is "full" or "none"."""
    _check_resolved(policy)
    token0 = jnp.zeros((), jnp.float32)
    gfn, gconsts = jax.closure_convert(gather, params, token0)
    rfn, rconsts = jax.closure_convert(run, jax.eval_shape(gather, params, token0), *args)
    return gfn, gconsts, (rfn if isinstance(policy, str) else jax.checkpoint(rfn, policy=policy)), rconsts


def _check_resolved(policy) -> None:
    assert policy in ("full", "none") or callable(policy), policy  # resolved by `remat.unit_policy`


def _waiting_for(d_params, d_inputs):
    """(the unit's reduced parameter gradients, its input gradients made to wait for them): the next
    unit's backward cannot start while this unit's full-size gradients are alive (GSPMD's gradient
    all-reduces are otherwise combined into one at the end of the backward pass)."""
    d_params = _held(d_params)
    params_done = sum((zero_from(g) for g in jax.tree.leaves(d_params)), jnp.zeros((), jnp.float32))
    return d_params, tie_tree(tuple(d_inputs), params_done)


def _held(d_params):
    """On CPU, the gradient shards as buffers of their own, taken from the all-reduced gradient now.

    XLA:CPU's GSPMD reduces a gradient with an all-reduce and a slice (it has no reduce-scatter), and
    its fusion moves the slice into the slice's consumers: the optimizer update, which with
    global-norm clipping runs only after the whole backward pass. Every unit's full-size gradient
    then lived until the update (temp grew by a full block per block). A conditional's operands are
    never fused, so passing the shards through one (its predicate is always true, but only known at
    run time) materialises them here and frees the full gradient. GPU and TPU turn the pair into a
    reduce-scatter, whose output is already a buffer of its own (and a conditional would cost them a
    host round trip), so they skip it. Values are unchanged.
    """
    if jax.default_backend() != "cpu":
        return d_params
    leaves, treedef = jax.tree.flatten(d_params)
    floats = [i for i, g in enumerate(leaves) if jnp.issubdtype(g.dtype, jnp.floating)]
    if not floats:
        return d_params
    shards = [leaves[i] for i in floats]
    kept = jax.lax.cond(zero_from(shards) == 0, lambda s: s, lambda s: [-g for g in s], shards)
    for i, g in zip(floats, kept):
        leaves[i] = g
    return treedef.unflatten(leaves)


def _without(weights, vjp):
    """A `jax.vjp` function's residuals less the gathered `weights`, and where those went. They are
    found by identity: `jax.vjp` keeps a primal input it needs as that very array."""
    leaves, treedef = jax.tree.flatten(vjp)
    ids = {id(w): i for i, w in enumerate(jax.tree.leaves(weights))}
    slots = [ids.get(id(x)) for x in leaves]
    return [x for x, s in zip(leaves, slots) if s is None], (treedef, slots)


def _with(weights, kept, where):
    """The `jax.vjp` function `_without` took apart, with freshly gathered `weights` put back."""
    treedef, slots = where
    fresh, kept = jax.tree.leaves(weights), iter(kept)
    return treedef.unflatten([next(kept) if s is None else fresh[s] for s in slots])


def kept_weights(run, gather, params, *args, policy: Policy = "none"):
    """`run(gather(params), *args)` keeping the gathered weights for the backward pass (no reshard);
    `policy` says which activations are kept beside them ("full": none, the unit is recomputed)."""
    _check_resolved(policy)
    weights = gather(params, jnp.zeros((), jnp.float32))
    if policy == "none":
        return run(weights, *args)
    return jax.checkpoint(run, policy=None if policy == "full" else policy)(weights, *args)


# ---- NNX: a unit is the same module object with a subclass whose __call__ gathers first ------------


def nnx_modules(module: nnx.Module) -> list[tuple[Path, type, int]]:
    """`(path, class, parameter leaves in its subtree)` of every non-root submodule."""
    nodes = [(tuple(str(k) for k in p), n) for p, n in nnx.iter_graph(module)]
    params = [p for p, n in nodes if isinstance(n, nnx.Param)]
    return [(p, type(n), sum(q[: len(p)] == p for q in params)) for p, n in nodes if isinstance(n, nnx.Module) and p]


def nnx_around(
    units: list[Path],
    materialize: Materialize,
    reshard_after_forward: bool = True,
    wait_for_grads: bool = False,
    prefetch: bool = False,
    policy: Policy = None,
    loose: frozenset = frozenset(),
):
    """`around(module)` for `FunctionalModel.apply`: makes the submodules at `units` FSDP units;
    `prefetch`: each unit's gathers one unit ahead (see `Prefetch`); `policy`: what a unit saves for
    its backward (`zerojax.remat.unit_policy`); `loose`: leaves the root gathers though a unit holds
    them (the model reads them outside it, `zerojax.unit_reads`)."""
    policy = unit_policy(policy, reshard_after_forward)

    def around(module: nnx.Module):
        record = Prefetch() if prefetch and reshard_after_forward else None  # one per traced call
        nodes = [(tuple(str(k) for k in p), n) for p, n in nnx.iter_graph(module)]
        by_path = dict(nodes)
        for p, n in nodes:  # the root's own params: gathered once, now
            if isinstance(n, nnx.Param) and (owner(p, units) is None or p in loose):
                n.set_value(materialize([_key(p)], [n.get_value()])[0])
        for u in units:
            sub = by_path[u]
            sub.__class__ = _unit_class(type(sub), materialize, reshard_after_forward, wait_for_grads, policy, loose)
            sub._fsdp_path = u
            sub._fsdp_prefetch = record
        return contextlib.nullcontext()

    return around


def nnx_slice_recorder(stored: dict[Path, int], sliced: set):
    """`around(module)` for one abstract trace that finds lifted layer stacks (`nnx.vmap`-built
    modules applied through `nnx.scan` or `nnx.vmap`): every module holding params records, when a
    compute method is called, whether it sees its params with one axis fewer than `stored` (their
    rank by path): then it runs inside a transform that slices a layer stack, and `sliced` gets its path."""

    def around(module: nnx.Module):
        for p, n in nnx.iter_graph(module):
            path = tuple(str(k) for k in p)
            if path and isinstance(n, nnx.Module) and any(q[: len(path)] == path for q in stored):
                n.__class__ = _recording_class(type(n))
                n._fsdp_path = path
        return contextlib.nullcontext()

    def _recording_class(cls: type) -> type:
        def entry(name: str):
            method = getattr(cls, name)

            def call(self, *args, **kwargs):
                for rel, value in nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(self, nnx.Param))).items():
                    full = self._fsdp_path + tuple(str(k) for k in rel)
                    if full in stored and getattr(value, "ndim", stored[full]) == stored[full] - 1:
                        sliced.add(self._fsdp_path)
                    break
                return method(self, *args, **kwargs)

            return call

        return type(f"Recording_{cls.__name__}", (cls,), {name: entry(name) for name in _compute_methods(cls)})

    return around


def _unit_class(
    cls: type, materialize: Materialize, reshard: bool, wait_for_grads: bool, policy: Policy, loose: frozenset
) -> type:
    """`cls` with each compute method a unit call: `__call__` and every public method its own classes
    define (not `nnx.Module`'s), when called with an array (`Embed.attend(x)`); one called with none
    (`set_view(deterministic=True)`) runs as it is."""

    def entry(name: str):
        method = getattr(cls, name)

        def call(self, *args, **kwargs):
            leaves = jax.tree.leaves((args, kwargs))
            if not any(isinstance(x, jax.Array) for x in leaves):
                return method(self, *args, **kwargs)
            return _unit_call(self, method, cls, args, kwargs, materialize, reshard, wait_for_grads, policy, loose)

        call.__name__ = name
        return call

    return type(f"FSDPUnit_{cls.__name__}", (cls,), {name: entry(name) for name in _compute_methods(cls)})


def _compute_methods(cls: type) -> list[str]:
    names = {"__call__"} if any("__call__" in vars(k) for k in cls.__mro__[:-1]) else set()
    for klass in cls.__mro__:
        if klass is nnx.Module or not issubclass(klass, nnx.Module):
            break
        names |= {n for n, a in vars(klass).items() if not n.startswith("_") and isinstance(a, types.FunctionType)}
    return sorted(names)


def _unit_call(
    self,
    method,
    cls: type,
    args,
    kwargs,
    materialize: Materialize,
    reshard: bool,
    wait_for_grads: bool,
    policy: Policy,
    loose: frozenset,
):
    """`method(self, *args, **kwargs)` on the unit's gathered params (see `rematerialized`)."""
    prefix = self._fsdp_path
    graphdef, params, rest = nnx.split(self, nnx.Param, ...)
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(params))
    inner = [
        tuple(str(k) for k in p)
        for p, n in nnx.iter_graph(self)
        if p and isinstance(n, nnx.Module) and hasattr(n, "_fsdp_path")
    ]
    owned_set = {
        p
        for p in flat
        if owner(tuple(str(k) for k in p), inner) is None and prefix + tuple(str(k) for k in p) not in loose
    }
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    rest_leaves, rest_def = jax.tree.flatten(rest)  # passed in, so the unit may update it inside
    names = list(flat)
    outputs = []  # (treedef, leaves, which are arrays) of the method's result: only arrays cross the unit

    def gather(values_raw, token):
        values = list(values_raw)
        owned = [i for i, p in enumerate(names) if p in owned_set]
        gathered = materialize([_key(prefix + names[i]) for i in owned], [tie(values[i], token) for i in owned])
        for i, x in zip(owned, gathered):
            values[i] = x
        return values

    def run(values, dynamic_args, rest_leaves):
        unit = nnx.merge(
            graphdef,
            nnx.State(nnx.traversals.unflatten_mapping(dict(zip(names, values)))),
            jax.tree.unflatten(rest_def, rest_leaves),
        )
        unit.__class__ = cls  # its own methods, called from inside, run on the gathered params as they are
        call_leaves = list(leaves)
        for i, x in zip(dynamic, dynamic_args):
            call_leaves[i] = x
        a, k = jax.tree.unflatten(treedef, call_leaves)
        out_leaves, out_def = jax.tree.flatten(method(unit, *a, **k))
        arrays = [i for i, x in enumerate(out_leaves) if isinstance(x, jax.Array)]
        outputs[:] = [(out_def, out_leaves, arrays)]
        return [out_leaves[i] for i in arrays], nnx.split(unit, nnx.Param, ...)[2]  # BatchStats, RNG counters

    operands = ([flat[p] for p in names], [leaves[i] for i in dynamic], rest_leaves)
    if reshard:  # the gathered weights are not kept for the backward pass: gathered again there
        arrays, updated = rematerialized(
            run, gather, *operands, policy=policy, wait_for_grads=wait_for_grads, prefetch=self._fsdp_prefetch
        )
    else:
        arrays, updated = kept_weights(run, gather, *operands, policy=policy)
    nnx.update(self, updated)
    out_def, out_leaves, where = outputs[0]
    out_leaves = list(out_leaves)
    for i, x in zip(where, arrays):
        out_leaves[i] = x
    return jax.tree.unflatten(out_def, out_leaves)
