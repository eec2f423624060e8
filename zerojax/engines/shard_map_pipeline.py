"""The `shard_map` engine's route for a `pipeline` mesh axis: GPipe or the circular schedule inside
the engine's own manual region (`zerojax.engines.pipeline.on_device`).

The region is manual over `pipeline` too, so each device holds its pipeline stage's layers of every
stacked leaf (axis 0 split over `pipeline`) and the rest of the model whole over `pipeline`. Each
device differentiates the same loss: the stack's gradient enters at the last stage once and the
gradient of its input is summed over the stages (`own_grads`), so every leaf outside the stack has
its whole gradient on every stage, and the engine reduces each leaf over fsdp (and data) as it
does without a pipeline. The stage's layers are materialised once per step before the loop (stage
3: gathered, their gradient reduce-scattered once after the last microbatch; stage 2: the resident
copy, reduced once), or at stage 3 with `pipeline_gather="per_microbatch"` each layer as it runs.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from zerojax.adapt.stacked import at
from zerojax.core.leaf_rule import LeafLayout
from zerojax.core.mesh import BATCH_AXES, data_parallel_size, pipeline_size
from zerojax.core.trees import batch_rows
from zerojax.engines import EngineOptions, GatherReport, pipeline
from zerojax.engines.collectives import Reduce, keep_tensor_split
from zerojax.engines.pipeline_circular import circular_chunks
from zerojax.engines.unit_plan import describe_stacks, is_layout, materialize_tree, outside_stacks


class _Loop:
    """The model's layer loop for one stack: its pipeline stage's layers (under the circular schedule
    exchanged for its chunks, as stored: shards at stage 3) materialised at once or each as it runs,
    then the schedule on this device."""

    def __init__(self, layouts, materialize_group, each_layer: bool, mesh, schedule: pipeline.Schedule):
        layouts = jax.tree.map(LeafLayout.pipeline_stage, layouts, is_leaf=is_layout)  # this device's layers
        self.layouts, self.materialize_group, self.each_layer = layouts, materialize_group, each_layer
        self.one_layer = jax.tree.map(LeafLayout.one_layer, layouts, is_leaf=is_layout)
        self.mesh, self.microbatches = mesh, schedule.microbatches_on(mesh)
        self.repeats = schedule.repeats

    def _materialized(self, layouts, values):
        out = materialize_tree(layouts, values, self.materialize_group)
        return nnx.State(out) if isinstance(values, nnx.State) else out

    def __call__(self, layer, x, stacked, *, rows: int):  # `rows`: the batch's, this device's
        p, dp = pipeline_size(self.mesh), data_parallel_size(self.mesh)
        pipeline.check_schedule(self.mesh, rows * dp, self.microbatches, (x, rows))
        pipeline.check_layers(stacked, p, self.repeats, p)
        stacked = circular_chunks(stacked, p, self.repeats)
        if self.each_layer:
            run_layer, weights = (lambda h, one: layer(h, self._materialized(self.one_layer, one))), stacked
        else:
            run_layer, weights = layer, self._materialized(self.layouts, stacked)
        return pipeline.on_device(
            run_layer, x, weights, stages=p, microbatches=self.microbatches, repeats=self.repeats, own_grads=True
        )


def route(layout, model, static, stacks, reduce: Reduce, options: EngineOptions, schedule, whole: bool = False):
    """(report, run_model) of a pipelined step: the leaves outside the stacks materialised at once,
    each stack through `_Loop`. `whole`: the values arrive as whole compute params already (a step
    that accumulates whole local gradients), so nothing is materialised but the tensor split."""
    pipeline.check_model(model, stacks, layout.mesh)
    stage, leaves, mesh = layout.stage, layout.leaves, layout.mesh
    each_layer = pipeline.gathers_each_layer(options.pipeline_gather, stage, mesh)
    if whole:
        one, group = (lambda l, x: keep_tensor_split(x, l)), (lambda ls, vs: list(map(keep_tensor_split, vs, ls)))
    else:
        one, group = reduce.materializer(stage), reduce.group_materializer(stage)
    loops = {s: _Loop(at(leaves, s), group, each_layer and not whole, mesh, schedule) for s in stacks}
    gathers = None
    if stage.compute_params:  # whole: gathered once before the accumulation loop
        gathers = pipeline.KEPT if whole else pipeline.PER_MICROBATCH if each_layer else pipeline.ONCE_PER_PASS
    report = GatherReport("layers", pipeline.describe(describe_stacks(stacks), mesh, schedule, gathers))

    def run(raw, model_state, inputs, key, train=True):
        params = outside_stacks(one, stacks, leaves, raw)
        rows = batch_rows(inputs)  # this device's
        with_rows = {s: functools.partial(loop, rows=rows) for s, loop in loops.items()}
        return model.apply(
            params, model_state, static, inputs, rng=key, train=train, layer_loop=with_rows, sync=BATCH_AXES
        )

    return report, run
