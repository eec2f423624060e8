"""How the `shard_map` engine's model runs from stored values, each leaf materialised where its route says.

"replicated"  stages 0-1: the compute params are whole on every device;
"layers"      the model holds `zj.Stacked` stacks or takes a `layer_hook` (the shipped GPT): one layer
              per scan iteration (`LayerHook`), with prefetch the next layer's gather beside it;
"units"       a wrap rule picks submodules that gather their own params (see `zerojax.adapt.units`);
"whole"       no units: the whole model is gathered before it runs (correct, but no memory saving).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.adapt import units as units_lib
from zerojax.adapt.stacked import at
from zerojax.core.layout import StateLayout
from zerojax.core.leaf_rule import LeafLayout
from zerojax.core.mesh import BATCH_AXES
from zerojax.engines import EngineOptions, GatherReport, replicated_report
from zerojax.engines.collectives import UNIT_BUCKET_BYTES, Reduce
from zerojax.engines.unit_plan import (
    describe_stacks,
    is_layout,
    materialize_tree,
    outside_stacks,
    stack_paths,
    unit_around,
)

# (stored values, model state, inputs, key, train=True) -> (model outputs, new model state); per device, with
# BatchNorm statistics averaged over the batch axes (global-batch statistics, as under GSPMD)
RunModel = Callable[[Any, Any, jax.Array, Any], Any]


class LayerHook:
    """Called by the model on each layer's stored params inside its scanned, rematerialised body;
    the layer's leaves are materialised leaf by leaf (`Reduce.group_materializer` without buckets): a
    layer's leaves are large, and a bucket's rows and held gradients raised stage 3's peak on the 26M
    decoder from 67.4 to 70.2 MiB with no measurable speed in return (docs/engines.md)."""

    def __init__(self, layouts, materialize_group):
        self.layouts = layouts  # per-layer LeafLayouts, same dict structure as one layer's params
        self.materialize_group = materialize_group

    def __call__(self, layer_state: nnx.State) -> nnx.State:
        return nnx.State(materialize_tree(self.layouts, layer_state, self.materialize_group))


class _PrefetchLoop:
    """The model's layer loop, carrying layer i+1's gathered weights through the scan: iteration i
    issues that gather beside layer i's compute, with no dependence between them, so they can overlap.

    The carried weights are not differentiated: `run` recomputes the layer in backward from the
    layer's shards (gathering again), so the carry is never saved and the gradient reaches the
    shards through the re-gather's reduce-scatter, as without prefetch.
    """

    def __init__(self, hook: LayerHook):
        self.hook = hook

    def __call__(self, layer, x, stacked):
        hook = self.hook
        fetch = lambda shards: hook(jax.lax.stop_gradient(shards))  # noqa: E731
        n = jax.tree.leaves(stacked)[0].shape[0]
        take = lambda i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked)  # noqa: E731
        gathered = fetch(take(0))
        # custom_vjp may not close over traced values (the model's rotary tables): make them args.
        layer, consts = jax.closure_convert(layer, x, gathered)

        @jax.custom_vjp
        def run(x, gathered, shards, consts):
            return layer(x, gathered, *consts)

        def run_fwd(x, gathered, shards, consts):
            return layer(x, gathered, *consts), (x, shards, consts)

        def run_bwd(res, ct):
            x, shards, consts = res
            _, vjp = jax.vjp(lambda x, s: layer(x, hook(s), *consts), x, shards)
            dx, dshards = vjp(ct)
            return dx, None, dshards, jax.tree.map(jnp.zeros_like, consts)

        run.defvjp(run_fwd, run_bwd)

        def body(carry, shards):
            x, gathered, i = carry
            # Layer i+1's gather does not depend on layer i's compute; after the last layer, none.
            next_gathered = jax.lax.cond(i + 1 < n, lambda: fetch(take(i + 1)), lambda: gathered)
            return (run(x, gathered, shards, consts), next_gathered, i + 1), None

        (x, _, _), _ = jax.lax.scan(body, (x, gathered, 0), stacked)
        return x


def _gather_all(materialize, layouts, raw):
    return jax.tree.map(materialize, layouts, raw, is_leaf=is_layout)


def route(
    layout: StateLayout, model, static, options: EngineOptions, reduce: Reduce, inputs, model_state
) -> tuple[GatherReport, RunModel]:
    """The report and the model runner of the route this stage, model and options take."""
    stage, leaves = layout.stage, layout.leaves
    materialize = reduce.materializer(stage)
    stacks = stack_paths(model, leaves, options)
    rule = units_lib.as_rule(options.wrap)  # checked even where unused
    prefetch = options.prefetch and stage.compute_params
    if not stage.gradients:  # nothing is gathered and no gradient reduced inside the model
        report = replicated_report(stage)
        return report, lambda raw, ms, x, key, train=True: model.apply(
            raw, ms, static, x, rng=key, train=train, sync=BATCH_AXES
        )
    if stacks and (model.stacks or len(stacks) == 1):
        return _layer_route(layout, model, static, stacks, reduce, prefetch)
    if rule is None:
        report = GatherReport("whole", units_lib.describe([], {}, None))
        return report, lambda raw, ms, x, key, train=True: model.apply(
            _gather_all(materialize, leaves, raw), ms, static, x, rng=key, train=train, sync=BATCH_AXES
        )
    materialize = reduce.group_materializer(stage, UNIT_BUCKET_BYTES)
    return _unit_route(layout, model, static, rule, materialize, inputs, model_state, prefetch)


def _layer_route(layout, model, static, stacks, reduce: Reduce, prefetch: bool):
    """One layer of each stack materialised per scan iteration (a layer hook per stack); the rest at once."""
    leaves, stage = layout.leaves, layout.stage
    prefetch = prefetch and model.accepts_layer_loop
    report = GatherReport(
        "layers",
        f"per layer: {describe_stacks(stacks)} gathered one layer per scan iteration"
        + (", next layer prefetched" if prefetch else ""),
    )
    hooks = {
        s: LayerHook(
            jax.tree.map(LeafLayout.one_layer, at(leaves, s), is_leaf=is_layout), reduce.group_materializer(stage)
        )
        for s in stacks
    }
    loops = {s: _PrefetchLoop(hook) for s, hook in hooks.items()} if prefetch else None

    def run(raw, model_state, inputs, key, train=True):
        params = outside_stacks(reduce.materializer(stage), stacks, leaves, raw)
        return model.apply(
            params,
            model_state,
            static,
            inputs,
            rng=key,
            train=train,
            layer_hook=hooks,
            layer_loop=loops if train else None,
            sync=BATCH_AXES,
        )

    return report, run


def _unit_route(layout, model, static, rule, materialize, inputs, model_state, prefetch=False):
    """Submodules chosen by the wrap rule gather their own params (see `zerojax.adapt.units`), each unit's
    leaves together, in buckets (`materialize`: a `Reduce.group_materializer`); with `prefetch`, one unit ahead
    (`zerojax.adapt.ordering.Prefetch`)."""
    report, around = unit_around(layout, model, static, rule, materialize, inputs, model_state, prefetch=prefetch)
    return report, lambda raw, ms, x, key, train=True: model.apply(
        raw, ms, static, x, rng=key, train=train, around=around, sync=BATCH_AXES
    )
