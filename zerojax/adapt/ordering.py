"""A unit's gathers are ordered by data, not by barriers.

A unit gathers right before its forward call and again right before its backward, holding the
gathered weights only in between. Schedulers reorder independent work freely and CSE merges equal
computations (XLA:CPU strips optimization barriers before CSE). So each gather's *input* depends on
data that exists only at the right time: the shard plus an exact zero computed from the unit's input
(forward) or from the incoming cotangent (backward). No pass may hoist a gather above its operand,
and the two gathers read different operands, so they are never merged (docs/engines.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zero_from(tree) -> jax.Array:
    """An fp32 zero that depends on `tree`'s first floating-point value (NaN and inf give 0 too)."""
    for x in jax.tree.leaves(tree):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.size:
            z = x[(0,) * x.ndim].astype(jnp.float32) * 0  # x * 0 is not folded for floats (NaN * 0 = NaN)
            return jnp.where(jnp.isfinite(z), z, 0.0)
    return jnp.zeros((), jnp.float32)


def zeros_after(tree):
    """Per leaf of `tree`, `zero_from(leaf)` read from the leaf as written, not recomputed from its
    inputs.

    XLA fuses an elementwise producer into a consumer that slices it, so a plain `zero_from(new)`
    reads the *old* inputs of `new` again, and whatever waits for it no longer waits for `new`'s
    write. A conditional's operands are never fused into it (see `held_on_cpu`), so on CPU the
    zeros are read inside one whose predicate is always true but only known at run time: one for the
    whole tree (one per leaf made compiling half again slower), whose other branch, never taken,
    reads nothing (a smaller program: an 8-block step's HLO 5% shorter). Elsewhere the plain read
    serves (a conditional would cost a host round trip)."""
    leaves, treedef = jax.tree.flatten(tree)
    if jax.default_backend() != "cpu" or not leaves:
        return jax.tree.map(zero_from, tree)
    read = lambda xs: [zero_from(x) for x in xs]  # noqa: E731
    never = lambda xs: [jnp.ones((), jnp.float32) for _ in xs]  # noqa: E731
    return treedef.unflatten(jax.lax.cond(zero_from(leaves) == 0, read, never, leaves))


def computed_once(scalar):
    """A scalar (the step's verdict, a unit's gradients' zero) read as a value of its own. XLA copies
    a cheap scalar computation into every fusion that reads it: a flag selecting each leaf of the
    state was recomputed hundreds of times, which only lengthened compiling. (Each unit's forward and
    backward tokens are left as they are: read once, they raised shard_map's prefetch temp on jax
    0.12 by a tenth of a block.) On CPU it is passed through a conditional, whose result every
    reader then shares; elsewhere left as it is (a conditional would cost a host round trip).
    Values are unchanged."""
    if jax.default_backend() != "cpu":
        return scalar
    if scalar.dtype == jnp.bool_:
        return jax.lax.cond(scalar, lambda: jnp.bool_(True), lambda: jnp.bool_(False))
    # branches that differ (XLA folds a conditional whose branches are the same); the other, never
    # taken for the exact zero a token is, reads nothing
    return jax.lax.cond(scalar == 0, lambda x: x, lambda x: jnp.ones_like(x), scalar)


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


def held_on_cpu(d_params):
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
    # (a branch of zeros instead of the negation raised shard_map's prefetch temp on jax 0.12 by 0.13
    # of a block)
    kept = jax.lax.cond(zero_from(shards) == 0, lambda s: s, lambda s: [-g for g in s], shards)
    for i, g in zip(floats, kept):
        leaves[i] = g
    return treedef.unflatten(leaves)
