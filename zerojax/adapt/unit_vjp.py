"""A unit's call as a `custom_vjp` that gathers its weights again in the backward pass.

`jax.checkpoint` would replay the forward gather on the forward's operand; here the backward
re-gathers tied to the incoming cotangent (`zerojax.adapt.ordering`), and the gathered weights are never
among the saved residuals, whatever the remat policy keeps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from zerojax.adapt.ordering import Prefetch, computed_once, held_on_cpu, tie_tree, zero_from
from zerojax.adapt.units import Policy


def rematerialized(
    run, gather, params, *args, policy: Policy = "full", wait_for_grads: bool = False, prefetch: Prefetch | None = None
):
    """`run(gather(params, token), *args)` with the gather tied to `args` (the unit's inputs) in the
    forward pass and, in the backward pass, gathered again tied to the incoming cotangent. With
    `prefetch`, tied one unit ahead instead (see `Prefetch`).

    `policy` says which of the unit's activations the forward keeps for the backward (see
    `zerojax.core.remat.unit_policy`); the gathered weights are never kept, whatever it says. With "full"
    only the inputs are kept and the backward re-runs the whole unit. The backward differentiates the
    params the caller does only: a frozen one (under `stop_gradient`) gets no gradient, no reduction.

    Under a vmap of the user's that binds an axis name (`nn.vmap` / `nnx.vmap` with `axis_name`),
    the unit runs under `jax.checkpoint` instead (`_checkpointed`)."""
    if _vmapped_axis_names():
        return _checkpointed(run, gather, params, *args)
    return _regathered(run, gather, params, args, policy, wait_for_grads, prefetch)


def _regathered(run, gather, params, args, policy: Policy, wait_for_grads: bool, prefetch: Prefetch | None):
    """`rematerialized`'s `custom_vjp`: the backward gathers again, tied to the incoming cotangent."""
    gfn, gconsts, body, rconsts = _converted(run, gather, params, args, policy)
    prev = prefetch.take() if prefetch is not None else None
    followed = [False]  # set when a later unit in this trace takes this unit's token
    # Set by `fwd`, read by `bwd` (every trace of `fwd` for this call sets the same, so the last serves):
    # where the regathered weights go among the forward's residuals, and which params are frozen.
    saved, frozen = [None], [()]

    def forward(params, rest, consts, token):
        return body(gfn(params, token, *consts[0]), *rest, *consts[1])

    @jax.custom_vjp
    def call(args, consts, prev):
        mine = zero_from(args[1:])  # args[0]: the unit's params
        return forward(args[0], args[1:], consts, mine if prev is None else prev), mine

    def fwd(*primals):
        (args, consts, prev), frozen[0] = _unwrapped(primals)
        mine = zero_from(args[1:])
        if policy == "full":
            return call(args, consts, prev), (args, consts, ())
        weights = gfn(args[0], mine if prev is None else prev, *consts[0])
        out, vjp = jax.vjp(lambda w, rest, c: body(w, *rest, *c), weights, args[1:], consts[1])
        kept, saved[0] = _without(weights, vjp)
        return (out, mine), (args, consts, kept)

    def bwd(res, cts):
        args, consts, kept = res
        ct, ct_next = jax.tree.map(_instantiated, cts, is_leaf=_is_symbolic_zero)
        own = zero_from(ct)
        # `followed` is read when the backward pass is traced, after the whole forward: the next
        # unit's backward then hands its incoming cotangent's zero to this one as `ct_next`.
        token = ct_next if followed[0] else own
        if policy == "full":
            _, vjp = _vjp_trainable(lambda p, rest, c: forward(p, rest, c, token), frozen[0], args[0], args[1:], consts)
            d_params, d_rest, d_consts = vjp(ct)
        else:
            weights, vjp_gather = _vjp_trainable(lambda p, c: gfn(p, token, *c), frozen[0], args[0], consts[0])
            d_weights, d_rest, d_rconsts = _with(weights, kept, saved[0])(ct)
            d_params, d_gconsts = vjp_gather(d_weights)
            d_consts = (d_gconsts, d_rconsts)
        if wait_for_grads:
            d_params, d_rest = _waiting_for(d_params, d_rest)
        return (d_params, *d_rest), d_consts, (None if prev is None else own)

    call.defvjp(fwd, bwd, symbolic_zeros=True)  # `fwd` sees which inputs are differentiated
    out, mine = call((params, *args), (gconsts, rconsts), prev)
    if prefetch is not None:
        prefetch.put(mine, followed)
    return out


def _vmapped_axis_names() -> set:
    """The axis names bound here by a vmap (not by the mesh a `shard_map` runs the step on)."""
    from jax._src import core  # no public reader of the bound axis names (jax 0.10-0.12)

    return set(core.get_axis_env().axis_sizes) - set(jax.sharding.get_abstract_mesh().axis_names)


def _checkpointed(run, gather, params, *args):
    """`run(gather(params, token), *args)` under `jax.checkpoint`, recomputed whole in the backward.

    JAX traces a `custom_vjp`'s backward outside the vmaps around the call, where a collective over a
    vmap's axis name (the mean over an ensemble's members) is unbound; `jax.checkpoint` traces the
    backward from a jaxpr taken here, inside them. Its re-gather reads the forward's token, so XLA may
    start it early and hold the unit's weights longer (values are unchanged); no activation is kept,
    whatever the unit's policy, as a policy could keep the gathered weights."""

    def unit(params, *args):
        return run(gather(params, zero_from(args)), *args)

    return jax.checkpoint(unit)(params, *args)


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _unwrapped(primals) -> tuple:
    """(`call`'s primals as `symbolic_zeros` hands them to `fwd`) -> (their values, a flag per leaf
    of the unit's params: not differentiated)."""
    frozen = tuple(not p.perturbed for p in jax.tree.leaves(primals[0][0], is_leaf=_is_primal))
    return jax.tree.map(lambda p: p.value, primals, is_leaf=_is_primal), frozen


def _is_symbolic_zero(x) -> bool:
    return isinstance(x, SymbolicZero)


def _instantiated(ct):
    return jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct


def _vjp_trainable(fn, frozen: tuple[bool, ...], params, *rest):
    """`jax.vjp(fn, params, *rest)` differentiating only the leaves of `params` not `frozen`; the
    frozen ones' cotangents are zeros."""
    if not any(frozen):
        return jax.vjp(fn, params, *rest)
    leaves, treedef = jax.tree.flatten(params)
    train = [i for i, f in enumerate(frozen) if not f]

    def part(trained, *r):
        full = list(leaves)
        for i, x in zip(train, trained):
            full[i] = x
        return fn(treedef.unflatten(full), *r)

    out, vjp = jax.vjp(part, [leaves[i] for i in train], *rest)

    def full_vjp(ct):
        d_trained, *d_rest = vjp(ct)
        d = [jnp.zeros_like(x) if f else None for x, f in zip(leaves, frozen)]
        for i, g in zip(train, d_trained):
            d[i] = g
        return (treedef.unflatten(d), *d_rest)

    return out, full_vjp


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
    if jax.default_backend() == "cpu":  # one conditional writes them all: a zero from one waits for all
        d_params = held_on_cpu(d_params)
        params_done = computed_once(zero_from(d_params))
    else:
        params_done = sum((zero_from(g) for g in jax.tree.leaves(d_params)), jnp.zeros((), jnp.float32))
    return d_params, tie_tree(tuple(d_inputs), params_done)


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
