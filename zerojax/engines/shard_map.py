"""The `shard_map` engine: the forward and backward run once per device, every collective placed by hand.

stage 3  each layer's fp32 shard is cast to the compute dtype, then all-gathered inside the scanned,
         rematerialised block; the backward pass gathers it again (remat) and reduce-scatters that
         layer's gradient (the gather's transpose) inside the loop, one layer at a time.
stage 2  compute params are replicated, but each layer's gradient is reduce-scattered inside the
         backward loop, so the full gradient never exists at once.
stage 1  the whole local gradient is reduce-scattered once, after the backward pass.
stage 0  the whole local gradient is all-reduced.
The optimizer then updates the shards (`apply_update`, outside the shard_map: it is elementwise), and
the updated compute copy is all-gathered. Gradients cross devices in `precision.reduce_dtype`.

How parameters are gathered at stages 2-3 (`GatherReport.route`):
  "layers"  the model holds `zj.Stacked` stacks or takes a `layer_hook` (the shipped GPT): one layer
            per scan iteration;
  "units"   a wrap rule picks submodules that gather their own params (see `zerojax.wrap`);
  "whole"   no units: the whole model is gathered before it runs (correct, but no memory saving).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from zerojax import wrap as wrap_lib
from zerojax.engines import BuiltStep, EngineOptions, GatherReport, accum
from zerojax.engines.collectives import Reduce, Resident
from zerojax.engines.common import (
    apply_update,
    compute_params,
    describe_stacks,
    keep_model_state,
    loss_parts,
    outside_stacks,
    stack_paths,
    step_key,
    unit_around,
)
from zerojax.engines.quantize import Quantizer
from zerojax.errors import UserError
from zerojax.layout import StateLayout
from zerojax.mesh import BATCH_AXES, data_parallel_size
from zerojax.stacked import at
from zerojax.stages import FSDP_AXIS, LeafLayout

SUPPORTS = (
    "layer_stacks",
    "prefetch",
    "wrap",
    "reshard_after_forward",
    "grad_accum",
    "quantize_weights",
    "quantize_grads",
    "quantize_block",
    "hierarchical",
    "checked_update",
)

_is_layout = lambda x: isinstance(x, LeafLayout)  # noqa: E731


def _local_shape(leaf: LeafLayout, fsdp: int) -> tuple[int, ...]:
    if leaf.axis is None:
        return leaf.shape
    shape = list(leaf.padded_shape)
    shape[leaf.axis] //= fsdp
    return tuple(shape)


class _LayerHook:
    """Called by the model on each layer's stored params inside its scanned, rematerialised body;
    the layer's leaves are materialised together (`Reduce.group_materializer`: one gather a layer)."""

    def __init__(self, layouts, materialize_group):
        self.layouts = layouts  # per-layer LeafLayouts, same dict structure as one layer's params
        self.materialize_group = materialize_group

    def __call__(self, layer_state: nnx.State) -> nnx.State:
        leaves, treedef = jax.tree.flatten(self.layouts, is_leaf=_is_layout)
        values = treedef.flatten_up_to(nnx.to_pure_dict(layer_state))
        return nnx.State(treedef.unflatten(self.materialize_group(leaves, values)))


class _PrefetchLoop:
    """The model's layer loop, carrying layer i+1's gathered weights through the scan: iteration i
    issues that gather beside layer i's compute, with no dependence between them, so they can overlap.

    The carried weights are not differentiated: `run` recomputes the layer in backward from the
    layer's shards (gathering again), so the carry is never saved and the gradient reaches the
    shards through the re-gather's reduce-scatter, as without prefetch.
    """

    def __init__(self, hook: _LayerHook):
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


# ---- routes: how the model runs from stored values, each leaf materialised where the route says ----

# (stored values, model state, inputs, key, train=True) -> (model outputs, new model state); per device, with
# BatchNorm statistics averaged over the batch axes (global-batch statistics, as under GSPMD)
RunModel = Callable[[Any, Any, jax.Array, Any], Any]


def _gather_all(materialize, layouts, raw):
    return jax.tree.map(materialize, layouts, raw, is_leaf=_is_layout)


def _route(
    layout: StateLayout, model, static, options: EngineOptions, reduce: Reduce, inputs, model_state
) -> tuple[GatherReport, RunModel]:
    """The report and the model runner of the route this stage, model and options take."""
    stage, leaves = layout.stage.index, layout.leaves
    materialize = reduce.materializer(stage)
    stacks = stack_paths(model, leaves, options)
    rule = wrap_lib.as_rule(options.wrap)  # checked even where unused
    if stage < 2:
        report = GatherReport("replicated", f"stage {stage}: compute params are replicated")
        return report, lambda raw, ms, x, key, train=True: model.apply(
            raw, ms, static, x, rng=key, train=train, sync=BATCH_AXES
        )
    if stacks and (model.stacks or len(stacks) == 1):
        return _layer_route(layout, model, static, stacks, reduce, options.prefetch and stage == 3)
    if rule is None:
        report = GatherReport("whole", wrap_lib.describe([], {}, None))
        return report, lambda raw, ms, x, key, train=True: model.apply(
            _gather_all(materialize, leaves, raw), ms, static, x, rng=key, train=train, sync=BATCH_AXES
        )
    return _unit_route(
        layout,
        model,
        static,
        rule,
        reduce.group_materializer(stage),
        inputs,
        model_state,
        options.prefetch and stage == 3,
    )


def _layer_route(layout, model, static, stacks, reduce: Reduce, prefetch: bool):
    """One layer of each stack materialised per scan iteration (a layer hook per stack); the rest at once."""
    leaves, stage = layout.leaves, layout.stage.index
    prefetch = prefetch and model.accepts_layer_loop
    report = GatherReport(
        "layers",
        f"per layer: {describe_stacks(stacks)} gathered one layer per scan iteration"
        + (", next layer prefetched" if prefetch else ""),
    )
    hooks = {
        s: _LayerHook(
            jax.tree.map(LeafLayout.one_layer, at(leaves, s), is_leaf=_is_layout), reduce.group_materializer(stage)
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
    """Submodules chosen by the wrap rule gather their own params (see `zerojax.wrap`), each unit's
    leaves together (`materialize`: a `Reduce.group_materializer`); with `prefetch`, one unit ahead
    (`zerojax.wrap.Prefetch`)."""
    report, around = unit_around(layout, model, static, rule, materialize, inputs, model_state, prefetch=prefetch)
    return report, lambda raw, ms, x, key, train=True: model.apply(
        raw, ms, static, x, rng=key, train=train, around=around, sync=BATCH_AXES
    )


# ---- the step ------------------------------------------------------------------------------------


def _specs(layout: StateLayout, sharded: bool):
    return jax.tree.map(lambda l: l.spec(sharded), layout.leaves, is_leaf=_is_layout)


def _grads_fn(layout: StateLayout, run_model: RunModel, loss_fn, reduce: Reduce):
    """shard_map'd `(params, batch) -> (loss, grads)`, gradients reduced as the stage asks."""
    stage, leaves, mesh = layout.stage.index, layout.leaves, layout.mesh
    dp, fsdp = data_parallel_size(mesh), mesh.shape[FSDP_AXIS]

    def local(params, model_state, key, batch):
        """Per device: loss and gradient of the local batch, reduced as the stage asks."""
        # Each device draws its own masks (its key folded with its index on the batch axes): the same
        # at every stage, since the mesh and the local batch are; they differ from GSPMD's masks.
        key = jax.random.fold_in(jax.random.wrap_key_data(key), jax.lax.axis_index(BATCH_AXES))
        fixed = params if stage == 2 else None
        if stage == 2:  # differentiate w.r.t. shard-shaped zeros: see `Resident`
            params = jax.tree.map(
                lambda l: jnp.zeros(_local_shape(l, fsdp), reduce.reduce_dtype), leaves, is_leaf=_is_layout
            )

        def loss_of(diff):
            raw = jax.tree.map(Resident, fixed, diff) if fixed is not None else diff
            if reduce.hierarchical:  # hpZ: the secondary copy, gathered over data once per step
                raw = jax.tree.map(reduce.secondary, leaves, raw, is_leaf=_is_layout)
            out, new_model_state = run_model(raw, model_state, batch["inputs"], key)
            total, weight = loss_parts(loss_fn(out, batch))
            # A scalar is a mean over rows: each device's mean over its equal share, divided by the
            # number of shares, summed across devices. A pair is sum(total) / sum(weight): each
            # device's total over the global weight, so a device whose rows all weigh 0 adds 0.
            if weight is None:
                return total / dp, new_model_state
            return total / jax.lax.psum(weight, BATCH_AXES), new_model_state

        (loss, new_model_state), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        if stage == 0:
            grads = jax.tree.map(reduce.to_all, grads)
        elif stage == 1:
            grads = jax.tree.map(lambda l, g: reduce.to_shard(g, l), leaves, grads, is_leaf=_is_layout)
        return jax.lax.psum(loss, BATCH_AXES), grads, new_model_state

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(_specs(layout, stage == 3), P(), P(), P(BATCH_AXES)),
        out_specs=(P(), _specs(layout, stage > 0), P()),
        check_vma=False,
    )


def _accum_grads_fn(layout: StateLayout, run_model: RunModel, loss_fn, reduce: Reduce, k: int, gather_first: bool):
    """`_grads_fn` over k micro-batches of each device's rows, in one `lax.scan`.

    Stage 3 (`run_model` materialising from shards): every micro-batch gathers each leaf and
    reduce-scatters its gradient (the gather's transpose); the shards are accumulated in fp32.
    Otherwise (`run_model` on whole compute params: stages 0-2, or stage 3 with `gather_first`, its
    leaves gathered once before the scan) each device accumulates its unreduced local gradient in
    fp32 and the step reduces it once, after the scan: an all-reduce at stage 0, a reduce-scatter
    at stages 1-3.
    """
    stage, leaves, mesh = layout.stage.index, layout.leaves, layout.mesh
    dp = data_parallel_size(mesh)
    psum_weight = lambda w: jax.lax.psum(w, BATCH_AXES)  # noqa: E731

    def local(params, model_state, key, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(key), jax.lax.axis_index(BATCH_AXES))
        if gather_first:
            params = jax.tree.map(lambda l, x: reduce.shard_gather(x, l), leaves, params, is_leaf=_is_layout)
        micro = jax.tree.map(lambda x: accum.split(x, k)[:, 0], batch)  # (k, rows / k, ...)

        def body(carry, xs):
            acc, loss_acc, weight_acc, model_state = carry
            i, mb = xs

            def loss_of(p):
                out, new_state = run_model(p, model_state, mb["inputs"], jax.random.fold_in(key, i))
                # a mean over rows: each device's mean over its share, divided by the number of shares
                loss, scale, weight = accum.parts(loss_fn(out, mb), psum_weight, shares=dp)
                return loss, (scale, weight, new_state)

            (loss, (scale, weight, new_state)), g = jax.value_and_grad(loss_of, has_aux=True)(params)
            return (accum.add_scaled(acc, g, scale), loss_acc + scale * loss, weight_acc + weight, new_state), None

        zero = jnp.zeros((), jnp.float32)
        (acc, loss, weight, new_model_state), _ = jax.lax.scan(
            body, (accum.zeros_f32(params), zero, zero, model_state), (jnp.arange(k), micro)
        )
        grads = jax.tree.map(lambda a: a / weight, acc)
        if stage == 0:
            grads = jax.tree.map(reduce.to_all, grads)
        elif stage < 3 or gather_first:
            grads = jax.tree.map(lambda l, g: reduce.to_shard(g, l), leaves, grads, is_leaf=_is_layout)
        if stage == 3:
            grads = jax.tree.map(lambda g: g.astype(reduce.master_dtype), grads)
        return jax.lax.psum(loss, BATCH_AXES) / weight, grads, new_model_state

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(_specs(layout, stage == 3), P(), P(), P(BATCH_AXES)),
        out_specs=(P(), _specs(layout, stage > 0), P()),
        check_vma=False,
    )


def _eval_fn(layout: StateLayout, run_model: RunModel, reduce: Reduce):
    """Stage 3: `(state, batch, loss_fn) -> loss` in eval mode, each device gathering the params as
    the step's forward does (one gather of each leaf) and running its share of the batch."""
    dp = data_parallel_size(layout.mesh)

    def evaluate(state, batch, loss_fn):
        def local(params, model_state, batch):
            if reduce.hierarchical:
                params = jax.tree.map(reduce.secondary, layout.leaves, params, is_leaf=_is_layout)
            out, _ = run_model(params, model_state, batch["inputs"], None, train=False)
            total, weight = loss_parts(loss_fn(out, batch))
            if weight is None:
                return jax.lax.psum(total / dp, BATCH_AXES)
            return jax.lax.psum(total, BATCH_AXES) / jax.lax.psum(weight, BATCH_AXES)

        return jax.shard_map(
            local, mesh=layout.mesh, in_specs=(_specs(layout, True), P(), P(BATCH_AXES)), out_specs=P(), check_vma=False
        )(state.params, state.model_state or {}, batch)

    return evaluate


def _hierarchical(options: EngineOptions, stage: int, grad_accum: int) -> bool:
    """hpZ's option, checked: stage 3, one micro-batch per step, weights re-gathered in backward."""
    if options.hierarchical and (stage != 3 or grad_accum > 1 or not options.reshard_after_forward):
        raise UserError(
            "zero.hierarchical (hpZ) needs zero.stage=3, train.grad_accum=1 and "
            f"zero.reshard_after_forward=true; got stage {stage}, grad_accum {grad_accum}, "
            f"reshard_after_forward {options.reshard_after_forward}."
        )
    return options.hierarchical


def _quantizers(options: EngineOptions, stage: int):
    """(qwZ, qgZ) quantizers of the options, None where off; UserError where the stage has no such collective."""
    weights = grads = None
    if options.quantize_weights is not None:
        if stage != 3:
            raise UserError(
                f"zero.quantize_weights quantizes stage 3's weight gathers; stage {stage} has none "
                "(use zero.stage=3, or leave zero.quantize_weights unset)."
            )
        weights = Quantizer(options.quantize_weights, options.quantize_block)
    if options.quantize_grads is not None:
        if options.quantize_grads != "int8":
            raise UserError(f"zero.quantize_grads must be int8, got {options.quantize_grads!r}.")
        if stage == 0:
            raise UserError(
                "zero.quantize_grads quantizes the gradient reduce-scatter of stages 1-3; stage 0 "
                "all-reduces the whole gradient instead (use zero.stage >= 1)."
            )
        grads = Quantizer(options.quantize_grads, options.quantize_block)
    return weights, grads


def build(
    layout: StateLayout,
    model,
    static,
    loss_fn,
    tx,
    options: EngineOptions,
    inputs,
    model_state=None,
    grad_accum: int = 1,
) -> BuiltStep:
    """`step(state, batch) -> (state, metrics)` and how it gathers params (`inputs`: the abstract
    model inputs, for finding a model's submodules before it is traced).

    options.prefetch      stage 3: gather layer i+1 while layer i computes (layers route), or unit i+1's
                          weights while unit i computes, forward and backward (units route).
    options.wrap          FSDP units for models without a layer hook: "auto", "none", classes or a WrapRule.
    options.layer_stacks  top-level param names whose leaves stack layers on axis 0 and go through the hook.
    options.reshard_after_forward  stage 3: False gathers the whole model once per step and keeps it.
    grad_accum            k micro-batches per step (see `_accum_grads_fn`).
    """
    stage, mesh, prec = layout.stage.index, layout.mesh, layout.precision
    replicas = tuple(a for a in BATCH_AXES if a != FSDP_AXIS and mesh.shape[a] > 1)
    reduce = Reduce(
        replicas,
        prec.compute_dtype,
        prec.reduce_dtype,
        prec.master_dtype,
        *_quantizers(options, stage),
        hierarchical=_hierarchical(options, stage, grad_accum),
    )
    report, run_model = _route(layout, model, static, options, reduce, inputs, model_state or {})
    train_report = report
    keep = stage == 3 and not options.reshard_after_forward
    if grad_accum > 1 or keep:
        if stage == 2 or keep:  # differentiate the whole compute params; reduce once after the scan
            train_report = (
                GatherReport(
                    "whole",
                    "stage 3, reshard_after_forward=False: the whole model gathered "
                    "once per step and kept for every micro-batch",
                )
                if keep
                else GatherReport(
                    "replicated",
                    "stage 2 with gradient accumulation: compute params are "
                    "replicated, the local gradient reduce-scattered once per step",
                )
            )
            run_train = lambda raw, ms, x, key, train=True: model.apply(
                raw,
                ms,
                static,
                x,
                rng=key,  # noqa: E731
                train=train,
                sync=BATCH_AXES,
            )
        else:
            run_train = run_model
        grads_fn = _accum_grads_fn(layout, run_train, loss_fn, reduce, grad_accum, keep)
    else:
        grads_fn = _grads_fn(layout, run_model, loss_fn, reduce)

    # Stages 1-2 in bf16: the new compute copy is the cast master shards, all-gathered here. The
    # gather apply_update leaves to XLA moves the same bytes, but the step then holds 32-41 MB more
    # at its peak (20m GPT, 8 devices).
    gather_compute = jax.shard_map(
        lambda params: jax.tree.map(lambda l, x: reduce.cast_gather(x, l), layout.leaves, params, is_leaf=_is_layout),
        mesh=mesh,
        in_specs=(_specs(layout, True),),
        out_specs=_specs(layout, False),
        check_vma=False,
    )

    def step(state, batch):
        params = state.params if stage == 3 else compute_params(layout, state)
        key = jax.random.key_data(step_key(state))
        loss, grads, model_state = grads_fn(params, state.model_state or {}, key, batch)
        new_state, metrics = apply_update(
            layout, tx, state, grads, loss, options.checked_update, order_moments=report.route != "units"
        )
        new_state = keep_model_state(new_state, model_state, metrics["bad_step"])
        if layout.keeps_compute_copy and layout.master_sharded:
            new_state = new_state.replace(compute=gather_compute(new_state.params))  # params already kept if bad
        return new_state, {"loss": loss, **metrics}

    return BuiltStep(step, train_report, _eval_fn(layout, run_model, reduce) if stage == 3 else None)
