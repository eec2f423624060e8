"""The step's state handling every engine shares: the compute params from the state, the step's key,
the kept model state, and the sharded optimizer update written over the old state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zerojax.adapt import ordering
from zerojax.core.layout import StateLayout
from zerojax.core.optim import update_args
from zerojax.core.precision import cast_tree
from zerojax.core.state import TrainState


def step_key(state: TrainState):
    """This step's PRNG key: the run's key (`state.rng`, raw key data) folded with the step number,
    so every draw depends on (seed, step) alone and a resumed run draws the same."""
    return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)


def keep_model_state(state: TrainState, model_state, bad_step) -> TrainState:
    """The updated model state (BatchNorm statistics), or the old one after a non-finite step."""
    if state.model_state is None:
        return state
    kept = jax.tree.map(lambda new, old: jnp.where(bad_step > 0, old, new), model_state, state.model_state)
    return state.replace(model_state=kept)


def constrain(tree, shardings):
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def compute_params(layout: StateLayout, state: TrainState):
    """The params the forward pass uses, in the compute dtype and logical shapes.

    Stage 3 keeps no compute copy: it casts its fp32 shard first, so the gather moves bf16.
    """
    if layout.keeps_compute_copy:
        return layout.frozen_from(state.params, state.compute)
    params = cast_tree(state.params, layout.precision.compute_dtype)
    params = constrain(params, layout.param_shardings())
    return layout.to_layout(params, sharded=False)


def all_finite(tree) -> jax.Array:
    """True when every floating-point value in `tree` is finite (integer leaves, e.g. counts, pass)."""
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


def global_norm(layout: StateLayout, grads) -> jax.Array:
    """`optax.tree.norm` of `grads` (on the optimizer's shards, in fp32): each device adds its shards'
    squares first, then one all-reduce per set of mesh axes the leaves are split over. Left to the
    partitioner, each sharded leaf's sum is all-reduced on its own (69 scalar all-reduces a step on a
    4-block decoder at stage 3), each a rendezvous of every device on XLA:CPU, which combines none."""
    specs = jax.tree.map(lambda s: s.spec, layout.opt_shardings())
    values, spec_list = [], []
    for x, spec in zip(*(jax.tree.leaves(t, is_leaf=lambda v: v is None) for t in (grads, specs)), strict=True):
        if x is not None:
            values.append(x)
            spec_list.append(spec)

    def norm(*shards):
        by_axes: dict[tuple, jax.Array] = {}
        for x, spec in zip(shards, spec_list):
            axes = tuple(sorted({a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}))
            by_axes[axes] = by_axes.get(axes, 0) + jnp.sum(jnp.square(x.astype(jnp.float32)))
        total = sum(jax.lax.psum(part, axes) if axes else part for axes, part in by_axes.items())
        return jnp.sqrt(jnp.asarray(total, jnp.float32))

    # Every device ends with the same total, so the result is replicated in value, as out_specs says.
    return jax.shard_map(norm, mesh=layout.mesh, in_specs=tuple(spec_list), out_specs=P(), check_vma=False)(*values)


def apply_update(
    layout: StateLayout,
    tx: optax.GradientTransformation,
    state: TrainState,
    grads,
    loss,
    checked: bool = False,
    check_first: bool = True,
) -> tuple[TrainState, dict]:
    """Optimizer update on the optimizer's layout (shards from stage 1 on), then back to the state's.

    `grads` arrive reduced: replicated (stages 0-1) or already sharded (stages 2-3). A step whose
    loss or gradient norm is not finite keeps the old state (`bad_step` = 1); the step counter still
    advances, so the data position moves past the bad batch. The verdict is known before the update
    runs, so the new state is written over the old one without checking it (`_master_then_moments`):
    for the registry's optimizers finite gradients and state give a finite new state.

    `checked=True` (engine option `checked_update`) also refuses a non-finite *new* state (a custom
    transformation, a schedule gone NaN): the update then runs twice, once to check and once, after
    the verdict, to write in place (see `_checked_update`); it compiles several times slower.
    """
    grads = constrain(layout.to_opt(grads), layout.opt_shardings())  # the update casts them to fp32 itself
    grad_norm = global_norm(layout, grads)
    finite = ordering.computed_once(jnp.isfinite(loss) & jnp.isfinite(grad_norm))

    def kept(new):  # the new state, or the old one after a non-finite step
        return {k: jax.tree.map(lambda n, o: jnp.where(finite, n, o), v, getattr(state, k)) for k, v in new.items()}

    if checked:
        new_state, finite = _checked_update(layout, tx, state, grads, loss, finite, check_first)
        new_state = kept(new_state)
    else:
        new_state = _master_then_moments(layout, tx, state, grads, loss, kept)
    return state.replace(**new_state, step=state.step + 1), {
        "grad_norm": grad_norm,
        "bad_step": (~finite).astype(jnp.int32),
    }


def _master_then_moments(layout, tx, state, grads, loss, kept):
    """The new state, each leaf written over the old one: the master (and compute copy) first, then
    the optimizer state, each optimizer-state leaf shaped like a parameter tied to an exact zero read
    from that parameter's *written* master (`ordering.zeros_after`).

    Elementwise, in place needs every reader of an old value to run before its write. Left
    unordered, the new moments are shared between the master's write and their own, so XLA holds
    every new moment beside the old until the last master is written (12 bytes per parameter shard
    with Adam). Tied, each moment's write reads its old value again after the master's write (XLA
    recomputes the cheap elementwise moment inside each consumer), so nothing new waits beside the
    old. One zero per leaf, all read inside one conditional (a conditional per leaf made compiling
    many times slower: docs/engines.md, "The update"). The update itself is traced once."""
    new = kept(_updated(layout, tx, state, grads, loss)[0])
    zeros = _written_zeros(layout, new["params"])
    treedef = jax.tree.structure(zeros)
    like_params = lambda sub: jax.tree.structure(sub) == treedef  # noqa: E731
    new["opt_state"] = jax.tree.map(
        lambda sub: jax.tree.map(ordering.tie, sub, zeros) if like_params(sub) else sub,
        new["opt_state"],
        is_leaf=like_params,
    )
    return new


def _written_zeros(layout: StateLayout, params):
    """Per leaf of `params` (stored as the master is), an exact zero read from it as written
    (`ordering.zeros_after`), each device reading its own shard: read from the global array, one
    element of a sharded leaf is a scalar collective per leaf."""
    specs = jax.tree.map(lambda s: s.spec, layout.param_shardings())
    out_specs = jax.tree.map(lambda _: P(), specs)
    # Every device's zero is 0, so the result is replicated in value, as out_specs says.
    return jax.shard_map(
        ordering.zeros_after, mesh=layout.mesh, in_specs=(specs,), out_specs=out_specs, check_vma=False
    )(params)


def _checked_update(layout, tx, state, grads, loss, finite, check_first):
    """(new state, verdict) with the new state itself checked for non-finite values.

    The update runs twice: once only to check it, then again, once the verdict is known, to write
    it, so every new shard need not wait beside the old one until the last leaf's check (12 bytes per
    parameter shard with Adam); what waits instead is the gradient shard. That needs the gradient
    shards to be buffers of their own: `check_first=False` runs it once, for an engine whose fp32
    gradient "shards" are slices of the full all-reduced gradient (XLA:CPU's GSPMD), where a second
    reader would keep each full gradient alive. The tie `x + 0` writes -0.0 as +0.0.
    """
    new_state, checked = _updated(layout, tx, state, grads, loss)
    finite = finite & all_finite(checked)
    if check_first:
        # The write's inputs depend on the verdict, so it cannot run before it, and no common
        # subexpression of the two passes can be computed once and held for both.
        new_state, _ = _updated(layout, tx, state, grads, loss, verdict=finite.astype(jnp.float32) * 0)
        new_state["opt_state"] = ordering.tie_tree(new_state["opt_state"], _written(new_state["params"]))
    return new_state, finite


def _written(tree):
    """An exact zero read from every leaf of `tree` (`zerojax.adapt.ordering.zero_from`): what depends on it runs after
    the whole tree is written (why the moments need that order: `_master_then_moments`). Outside
    `shard_map`, reading one value of a sharded leaf is a scalar collective per leaf."""
    return sum((ordering.zero_from(x) for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))


def _updated(layout: StateLayout, tx: optax.GradientTransformation, state: TrainState, grads, loss, verdict=None):
    """(the new params, compute copy and optimizer state; what the finiteness check reads), with
    every input tied to `verdict` (an exact zero) when given, on the shards (see `apply_update`).
    `loss` goes to an update that takes it (`optim.update_args`)."""
    opt_shardings = layout.opt_shardings()
    master = constrain(layout.to_opt(state.params), opt_shardings)
    opt_state = state.opt_state
    if verdict is not None:
        master = constrain(ordering.tie_tree(master, verdict), opt_shardings)
        grads = constrain(ordering.tie_tree(grads, verdict), opt_shardings)
        opt_state = ordering.tie_tree(opt_state, verdict)  # elementwise: stays on its operand's sharding
    updates, opt_state = tx.update(cast_tree(grads, jnp.float32), opt_state, master, **update_args(tx, loss))
    master = optax.apply_updates(master, updates)
    # A frozen leaf's update is zero (`frozen_optimizer`): it is passed through, never rewritten.
    master = layout.frozen_from(state.params, master)
    params = constrain(layout.to_params(master), layout.param_shardings())
    new_state = {"params": params, "opt_state": opt_state}
    checked = {
        "params": layout.trained(master),
        "opt_state": opt_state,
    }  # on the optimizer's shards: checking gathers nothing
    if layout.keeps_compute_copy:
        # Cast the shard before it is gathered, so the all-gather moves compute-dtype bytes; check
        # the cast shards, not the gathered copy, so the check itself gathers nothing (an engine
        # that gathers the copy its own way leaves this gather dead).
        compute = constrain(cast_tree(params, layout.precision.compute_dtype), layout.param_shardings())
        checked["compute"] = layout.trained(compute)
        compute = layout.trained(layout.to_layout(compute, sharded=False))
        new_state["compute"] = constrain(compute, layout.trained(layout.shardings(False)))
    return new_state, checked
