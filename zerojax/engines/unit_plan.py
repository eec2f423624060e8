"""What both engines ask of a model's structure: its FSDP units and how they gather (`unit_around`),
its layer stacks, and materialising a group of leaves over a params tree or one layer's state."""

from __future__ import annotations

import dataclasses

import jax

from zerojax.adapt import units as units_lib
from zerojax.core.layout import StateLayout
from zerojax.core.leaf_rule import LeafLayout
from zerojax.core.trees import under


def unit_around(
    layout: StateLayout, model, static, rule, materialize, inputs, model_state, wait_for_grads=False, prefetch=False
):
    """(GatherReport, around) for a model whose submodules the wrap `rule` makes FSDP units:
    `materialize(leaf layouts, stored values)` turns leaves used together into whole compute-dtype
    weights; `wait_for_grads`: a unit's input gradient waits for its reduced parameter gradients;
    `prefetch`: each unit gathers one unit ahead (`zerojax.adapt.ordering.Prefetch`). A unit's leaf the model
    also reads outside the unit (`zerojax.adapt.unit_reads`) is gathered by the root instead.

    A lifted layer stack (Linen `nn.scan` / `nn.vmap` over the params, `layout.stacks`) is a unit
    itself, called inside the transform on one layer's params: each leaf it reads there has lost its
    layer axis, and is gathered as that one layer (`LeafLayout.one_layer`)."""
    leaves = jax.tree.leaves(layout.leaves, is_leaf=is_layout)
    logical = layout.compute_shapes()
    modules = model.modules(logical, model_state, inputs)
    module_paths = {p for p, _, n in modules if n}
    units = sorted(set(units_lib.choose_units(modules, rule)) | {s for s in layout.stacks if s in module_paths})
    paths = [tuple(l.path.split("/")) for l in leaves]
    ranks = {p: len(l.shape) for p, l in zip(paths, leaves)}
    stacks = tuple(s for s in layout.stacks if s in module_paths)
    by_path = {l.path: l for l in leaves}

    def per_layer(keys, values):  # a stacked leaf read inside its stack's transform: one layer
        chosen = [
            by_path[k].one_layer()
            if under(tuple(k.split("/")), stacks) and jax.tree.leaves(v)[0].ndim == len(by_path[k].shape) - 1
            else by_path[k]
            for k, v in zip(keys, values)
        ]
        return materialize(chosen, values)

    plan = units_lib.UnitPlan(
        tuple(units),
        per_layer,
        tuple(paths),
        rule.reshard_after_forward,
        wait_for_grads,
        False,
        rule.remat,
        stacks=stacks,
        ranks=ranks,
    )
    loose = _read_outside_units(model, static, plan, logical, model_state, inputs) if units else ()
    prefetch = prefetch and bool(units) and rule.reshard_after_forward
    report = _units_report(units_lib.describe(units, {p: c for p, c, _ in modules}, rule), stacks, loose, prefetch)
    return report, model.unit_around(dataclasses.replace(plan, prefetch=prefetch, loose=frozenset(loose)))


def _units_report(text: str, stacks, loose, prefetch: bool):
    from zerojax.engines import GatherReport

    if stacks:
        text += "; " + ", ".join(f"'{'/'.join(s)}'" for s in stacks)
        text += " gathered one layer at a time inside its transform"
    if loose:
        text += f"; read outside their units, so gathered by the root: {', '.join('/'.join(p) for p in loose)}"
    return GatherReport(
        "whole" if text.startswith("whole") else "units", text + (", next unit prefetched" if prefetch else "")
    )


def _read_outside_units(model, static, plan: units_lib.UnitPlan, logical, model_state, inputs) -> list[tuple]:
    """The unit-owned leaves (by path) that the model's outputs depend on other than through their
    unit's gather: traced once with marked gathers (`zerojax.adapt.unit_reads`)."""
    from zerojax.adapt import unit_reads

    probe = model.unit_around(
        dataclasses.replace(
            plan, materialize=unit_reads.marked, reshard_after_forward=False, wait_for_grads=False, policy="none"
        )
    )

    def run(params, model_state, inputs):
        return model.apply(params, model_state, static, inputs, rng=jax.random.key(0), train=True, around=probe)

    raw = unit_reads.raw_reads(run, logical, model_state, inputs)
    return [p for p, r in zip(plan.param_paths, raw) if r and units_lib.owner(p, plan.units) is not None]


def stack_paths(model, leaves, options) -> tuple[tuple, ...]:
    """The param paths whose leaves stack layers on axis 0, which the "layers" route gathers one layer
    at a time: the model's `zj.Stacked` stacks; for a model taking `layer_hook`, the stack its class
    declares (`layer_stacks`, the shipped GPT's "blocks") or, opted into, `options.layer_stacks`."""
    if model.stacks:
        return tuple(model.stacks)
    if model.accepts_layer_hook and isinstance(leaves, dict):
        named = model.declared_stacks or tuple((k,) for k in options.layer_stacks)
        return tuple(s for s in named if s[0] in leaves)
    return ()


def outside_stacks(fn, stacks, layouts, values):
    """`fn(leaf layout, value)` on every leaf outside the `stacks` paths; stacked leaves unchanged."""

    def one(path, leaf, value):
        return value if under(tuple(getattr(k, "key", k) for k in path), stacks) else fn(leaf, value)

    return jax.tree_util.tree_map_with_path(one, layouts, values, is_leaf=is_layout)


def is_layout(x) -> bool:
    return isinstance(x, LeafLayout)


def materialize_tree(layouts, tree, materialize_group):
    """`materialize_group(leaf layouts, stored values)` over the leaves of `tree`, laid out as `layouts`
    (a params dict, or one layer's `nnx.State`, read as its pure dict); the result as a nested dict."""
    from flax import nnx

    leaves, treedef = jax.tree.flatten(layouts, is_leaf=is_layout)
    values = treedef.flatten_up_to(nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree)
    return treedef.unflatten(materialize_group(leaves, values))


def describe_stacks(stacks) -> str:
    return ", ".join("'" + "/".join(map(str, s)) + "'" for s in stacks)
