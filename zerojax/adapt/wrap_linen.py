"""FSDP units for Linen models: a unit's call runs as a Flax lifted transform around `rematerialized`.

A method interceptor sees every call of a bound module. The root's own params (outside every unit)
are written, gathered, into its scope when it is first entered. A unit's method (not its `setup`)
runs through `_unit_transform`, a lifted transform in the manner of `flax.core.lift.checkpoint`:
the unit's variables and RNG streams are packed into a pure function of arrays, which runs inside
`zerojax.adapt.unit_vjp.rematerialized`, so its gathers are tied to the unit's input (forward) and to the incoming
cotangent (backward, recomputing the unit) exactly as for NNX units. The pure function is traced
once, so the RNG counters advance once (dropout masks are those of a plain call), and the mutable
collections it updates (BatchNorm's `batch_stats`) are written back into the calling scope.

A unit's own `setup` runs only inside its calls, on its gathered params: outside them, what its setup
defines (`nn.Embed`'s `self.embedding`) does not exist, so a parent reading it fails instead of
reading a shard. Modules passed into a unit as arguments or attributes are gathered by their own
owner (the root, or the unit they belong to).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from flax.core import DenyList, lift
from flax.linen.transforms import decorator_lift_transform, get_module_scopes

from zerojax.adapt.ordering import Prefetch, tie
from zerojax.adapt.unit_vjp import kept_weights, rematerialized
from zerojax.adapt.units import Materialize, Path, Policy, UnitPlan, owner, sees_one_layer
from zerojax.core.remat import unit_policy
from zerojax.core.trees import path_str, under
from zerojax.errors import UserError


def linen_structure(module: nn.Module, params, model_state, inputs, **call_kwargs):
    """(every submodule the model calls as `(path, class, parameter leaves)`, its lifted layer stacks),
    found by tracing it once on abstract values.

    A lifted stack (`nn.scan` or `nn.vmap` with `variable_axes={"params": 0}`) is known from the
    transform, not a name: inside it, its modules see their params with the leading layer axis
    sliced off. Its path is the outermost whose calls see such slices. A stack of several layer axes
    (nested scans: `nn.remat_scan`) is no stack and holds no unit: its params are gathered whole by
    their owner, the root or a unit around it."""
    seen: dict[Path, type] = {}
    sliced: set[Path] = set()
    nested: set[Path] = set()
    stored = {tuple(str(k) for k in p): tuple(v.shape) for p, v in nnx.traversals.flatten_mapping(params).items()}

    def record(next_fun, args, kwargs, context):
        scope = context.module.scope
        if scope is not None:
            path = tuple(scope.path)
            seen.setdefault(path, type(context.module))
            layers = _layers_sliced(context.module, path, stored)
            if layers == 1:
                sliced.add(path)
            elif layers > 1:
                nested.add(path)
        return next_fun(*args, **kwargs)

    def run(p, ms, x):
        return module.apply({"params": p, **ms}, x, **call_kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(run, params, model_state, inputs)
    leaves = list(stored)
    modules = [(p, c, sum(q[: len(p)] == p for q in leaves)) for p, c in seen.items() if p and not under(p, nested)]
    stacks = sorted(p for p in sliced if not any(q != p and p[: len(q)] == q for q in sliced))
    return modules, tuple(stacks)


def _layers_sliced(m: nn.Module, path: Path, stored: dict) -> int:
    """How many leading (layer) axes of its params `m`, called at `path`, sees sliced off: 0 outside
    every lifted stack, 1 inside one, more inside nested scans."""
    own = _own_params(m) if m.scope is not None else {}
    for rel, value in own.items():
        full = path + tuple(str(k) for k in rel)
        if full not in stored or not hasattr(value, "shape") or tuple(value.shape) == stored[full]:
            continue
        layers = len(stored[full]) - len(value.shape)
        if layers < 1 or stored[full][layers:] != tuple(value.shape):
            raise UserError(
                f"{'/'.join(full)!r} is stored as {list(stored[full])} but used as {list(value.shape)}: "
                "zerojax shards layer stacks whose layer axes are the params' first (nn.scan or nn.vmap "
                "with variable_axes={'params': 0})."
            )
        return layers
    return 0


def linen_around(plan: UnitPlan):
    """`around(module)` for a Linen model: the root's params are written, gathered, into its scope when
    it is first entered; each call of a unit's method gathers the unit's params inside the call. A
    lifted stack (`plan.stacks`) is a unit only where called inside its transform, on one layer."""
    policy = unit_policy(plan.policy, plan.reshard_after_forward)
    root_leaves, unit_set, stacks, ranks = plan.root_leaves(), set(plan.units), plan.stacks, plan.ranks
    units, materialize, loose = list(plan.units), plan.materialize, plan.loose

    def around(module: nn.Module):
        done, inside = [False], []  # type: ignore[var-annotated]  # inside: the scopes `_unit_transform` runs units in
        record = Prefetch() if plan.prefetch and plan.reshard_after_forward else None  # one per traced call

        def interceptor(next_fun, args, kwargs, context):
            m = context.module
            scope = m.scope
            if scope is None or any(scope is s for s in inside):
                return next_fun(*args, **kwargs)
            path = tuple(scope.path)
            if not path and not done[0]:
                done[0] = True
                _put_gathered(m, path, root_leaves, materialize)
            if path not in unit_set or (path in stacks and not sees_one_layer(path, _own_params(m), ranks)):
                return next_fun(*args, **kwargs)  # a stack's own call: its transform calls it per layer
            if context.method_name == "setup":
                # Not on the stored shards (its `self.param` checks their shape): the unit's setup
                # runs inside each unit call, on the gathered params, where its methods use it.
                return None
            gather = _unit_gather(m, args, kwargs, path, units, materialize, loose)
            lifted = decorator_lift_transform(
                _unit_transform,
                context.orig_method.func,
                gather=gather,
                inside=inside,
                reshard=plan.reshard_after_forward,
                wait_for_grads=plan.wait_for_grads,
                prefetch=record,
                policy=policy,
            )
            return lifted(m, *args, **kwargs)

        return nn.intercept_methods(interceptor)

    return around


def _unit_gather(m: nn.Module, args, kwargs, unit: Path, units: list[Path], materialize: Materialize, loose: frozenset):
    """`gather(params per lifted scope, token)`: the leaves `unit` owns materialised, tied to `token`.
    The lifted scopes are `get_module_scopes`' list without those nested in another of them (the order
    and the deduplication `flax.core.lift.pack` uses)."""
    scopes = get_module_scopes(m, args, kwargs)[0]
    kept = []
    for s in scopes:
        if s not in kept and not any(a in scopes for a in _ancestors(s)):
            kept.append(s)
    roots = [tuple(s.path) for s in kept]

    def gather(groups, token):
        flats = [nnx.traversals.flatten_mapping(_as_dict(group.get("params", {}))) for group in groups]
        owned = [(flat, rel, root + tuple(str(k) for k in rel)) for root, flat in zip(roots, flats) for rel in flat]
        owned = [(flat, rel, leaf) for flat, rel, leaf in owned if owner(leaf, units) == unit and leaf not in loose]
        gathered = materialize(
            [path_str(leaf) for _, _, leaf in owned], [tie(flat[rel], token) for flat, rel, _ in owned]
        )
        for (flat, rel, _), x in zip(owned, gathered):
            flat[rel] = x
        return tuple(
            {**group, "params": nnx.traversals.unflatten_mapping(flat)} if flat else group
            for group, flat in zip(groups, flats)
        )

    return gather


def _ancestors(scope):
    scope = scope.parent
    while scope is not None:
        yield scope
        scope = scope.parent


def _unit_transform(
    fn,
    gather,
    inside: list,
    reshard: bool,
    wait_for_grads: bool,
    prefetch: Prefetch | None = None,
    policy: Policy = "full",
):
    """A lifted transform (see `flax.core.lift.pack`): `fn(scope, *args)` run on the unit's gathered
    params inside `zerojax.adapt.unit_vjp.rematerialized`; returns what it updated in the other mutable collections."""

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
        params, rest = variable_groups  # ("params" per scope, every other collection per scope)
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

        def run(gathered, dynamic_args, rest, rng_groups):
            call = list(leaves)
            for i, x in zip(dynamic, dynamic_args):
                call[i] = x
            a, k = jax.tree.unflatten(treedef, call)
            scope = scope_fn((gathered, rest), rng_groups)
            inside.extend(jax.tree.leaves(scope))
            y = fn(scope, *a, **k)
            return y, repack_fn(scope)

        operands = (params, [leaves[i] for i in dynamic], rest, rng_groups)
        if reshard:  # the gathered weights are not kept for the backward pass: gathered again there
            return rematerialized(
                run, gather, *operands, policy=policy, wait_for_grads=wait_for_grads, prefetch=prefetch
            )
        return kept_weights(run, gather, *operands, policy=policy)

    return lift.pack(
        inner, ("params", True), (False, DenyList("params")), (True,), name="fsdp_unit", enable_kwargs=True
    )


def _put_gathered(m: nn.Module, path: Path, leaves: list[Path], materialize: Materialize) -> None:
    tree = _own_params(m)
    for leaf in leaves:  # each on its own: the root's leaves are used at different times
        rel = leaf[len(path) :]
        tree[rel] = materialize([path_str(leaf)], [tree[rel]])[0]
    nested = nnx.traversals.unflatten_mapping(tree)
    for name in {leaf[len(path)] for leaf in leaves}:
        m.put_variable("params", name, nested[name])


def _own_params(m: nn.Module) -> dict:
    """{relative path: value} of the params `m` sees."""
    return nnx.traversals.flatten_mapping(_as_dict(m.variables.get("params", {})))


def _as_dict(tree: Any):
    if hasattr(tree, "items") and not hasattr(tree, "shape"):
        return {k: _as_dict(v) for k, v in tree.items()}
    return tree
