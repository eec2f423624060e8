"""NNX FSDP units: a unit's compute methods gather its parameters first.

`apply` merges the model afresh for every call (`zerojax.adapt.model`); on that copy, never on the user's
object, each unit's class is replaced by a subclass whose compute methods (`__call__` and the public
methods its own classes define) run on the gathered parameters (`zerojax.adapt.unit_vjp`). The unit's path
and prefetch record live in the subclass, so no attribute is set on a module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import jax
from flax import nnx

from zerojax.adapt.ordering import Prefetch, tie
from zerojax.adapt.unit_vjp import kept_weights, rematerialized
from zerojax.adapt.units import Path, UnitPlan, layers_sliced, owner
from zerojax.core.remat import unit_policy
from zerojax.core.trees import path_str


def nnx_modules(module: nnx.Module) -> list[tuple[Path, type, int]]:
    """`(path, class, parameter leaves in its subtree)` of every non-root submodule."""
    nodes = [(tuple(str(k) for k in p), n) for p, n in nnx.iter_graph(module)]
    params = [p for p, n in nodes if isinstance(n, nnx.Param)]
    return [(p, type(n), sum(q[: len(p)] == p for q in params)) for p, n in nodes if isinstance(n, nnx.Module) and p]


def nnx_around(plan: UnitPlan):
    """`around(module)` for `FunctionalModel.apply`: makes the submodules at `plan.units` FSDP units
    and gathers the root's own params once, now."""
    plan = dataclasses.replace(plan, policy=unit_policy(plan.policy, plan.reshard_after_forward))

    def around(module: nnx.Module):
        record = Prefetch() if plan.prefetch and plan.reshard_after_forward else None  # one per traced call
        nodes = [(tuple(str(k) for k in p), n) for p, n in nnx.iter_graph(module)]
        by_path = dict(nodes)
        # a module or parameter the model shares is reached once, at the path the plan and layout key it by
        canonical = {id(n): p for p, n in nodes}
        for p, n in nodes:
            if isinstance(n, nnx.Param) and (owner(p, plan.units) is None or p in plan.loose):
                n.set_value(plan.materialize([path_str(p)], [n.get_value()])[0])
        for u in plan.units:
            by_path[u].__class__ = _unit_class(type(by_path[u]), u, plan, record, canonical)
        return contextlib.nullcontext()

    return around


def nnx_slice_recorder(ranks: dict[Path, int], sliced: set, nested: set):
    """`around(module)` for one abstract trace that finds lifted layer stacks (`nnx.vmap`-built
    modules applied through `nnx.scan` or `nnx.vmap`): every module holding params records, when a
    compute method is called, whether it sees its params with one axis fewer than stored (`ranks`, by
    path): then it runs inside a transform that slices a layer stack, and `sliced` gets its path;
    with several axes fewer (nested scans), `nested` gets it."""

    def around(module: nnx.Module):
        for p, n in nnx.iter_graph(module):
            path = tuple(str(k) for k in p)
            if path and isinstance(n, nnx.Module) and any(q[: len(path)] == path for q in ranks):
                n.__class__ = _recording_class(type(n), path)
        return contextlib.nullcontext()

    def _recording_class(cls: type, path: Path) -> type:
        def entry(name: str):
            method = getattr(cls, name)

            def call(self, *args, **kwargs):
                own = nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(self, nnx.Param)))
                layers = layers_sliced(path, own, ranks)
                if layers == 1:
                    sliced.add(path)
                elif layers > 1:
                    nested.add(path)
                return method(self, *args, **kwargs)

            return call

        return type(f"Recording_{cls.__name__}", (cls,), {name: entry(name) for name in _compute_methods(cls)})

    return around


def _unit_class(cls: type, path: Path, plan: UnitPlan, record: Prefetch | None, canonical: dict) -> type:
    """`cls` with each compute method a unit call: `__call__` and every public method its own classes
    define (not `nnx.Module`'s), when called with an array (`Embed.attend(x)`); one called with none
    (`set_view(deterministic=True)`) runs as it is."""

    def entry(name: str):
        method = getattr(cls, name)

        def call(self, *args, **kwargs):
            if not any(isinstance(x, jax.Array) for x in jax.tree.leaves((args, kwargs))):
                return method(self, *args, **kwargs)
            return _unit_call(self, method, cls, path, plan, record, canonical, args, kwargs)

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


def _canonical_paths(unit: nnx.Module, path: Path, canonical: dict) -> dict[Path, Path]:
    """{each node under a unit, by relative path: its path in the model (`canonical`, by identity)}. A
    module or parameter shared with another (the same `nnx.Linear` in several blocks) is keyed where
    the model first reaches it; a unit holding a shared parameter gathers it from there."""
    return {
        tuple(str(k) for k in rel): canonical.get(id(n), path + tuple(str(k) for k in rel))
        for rel, n in nnx.iter_graph(unit)
    }


def _owned(flat: dict, plan: UnitPlan, canon: dict[Path, Path]) -> set:
    """The unit's own leaves (relative paths): not an inner unit's (a shared unit's too), nor one the
    root gathers (read outside its unit, or shared with a module outside every unit)."""
    inner = [r for r, c in canon.items() if r and c in plan.units]
    rel = {p: tuple(str(k) for k in p) for p in flat}
    return {
        p
        for p in flat
        if owner(rel[p], inner) is None
        and owner(canon[rel[p]], plan.units) is not None
        and canon[rel[p]] not in plan.loose
    }


def _unit_call(self, method, cls: type, path: Path, plan: UnitPlan, record, canonical: dict, args, kwargs):
    """`method(self, *args, **kwargs)` on the unit's gathered params (see `rematerialized`)."""
    graphdef, params, rest = nnx.split(self, nnx.Param, ...)  # type: ignore[misc]
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(params))
    canon = _canonical_paths(self, path, canonical)
    names, owned_set = list(flat), _owned(flat, plan, canon)
    owned = [i for i, p in enumerate(names) if p in owned_set]
    keys = [path_str(canon[tuple(str(k) for k in names[i])]) for i in owned]  # as the layout knows them
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    rest_leaves, rest_def = jax.tree.flatten(rest)  # passed in, so the unit may update it inside
    outputs: list = []  # (treedef, leaves, which are arrays) of the method's result: only arrays cross the unit

    def gather(values_raw, token):
        values = list(values_raw)
        for i, x in zip(owned, plan.materialize(keys, [tie(values[i], token) for i in owned])):
            values[i] = x
        return values

    def run(values, dynamic_args, rest_leaves):
        state = nnx.State(nnx.traversals.unflatten_mapping(dict(zip(names, values))))
        unit = nnx.merge(graphdef, state, jax.tree.unflatten(rest_def, rest_leaves))
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
    if plan.reshard_after_forward:  # the gathered weights are not kept for the backward: gathered again there
        arrays, updated = rematerialized(
            run, gather, *operands, policy=plan.policy, wait_for_grads=plan.wait_for_grads, prefetch=record
        )
    else:
        arrays, updated = kept_weights(run, gather, *operands, policy=plan.policy)
    nnx.update(self, updated)
    out_def, out_leaves, where = outputs[0]
    out_leaves = list(out_leaves)
    for i, x in zip(where, arrays):
        out_leaves[i] = x
    return jax.tree.unflatten(out_def, out_leaves)
