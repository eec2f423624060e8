"""The choices a sharded step is built from, checked once: the engine, stage, precision, mesh,
accumulation, pipeline schedule, offload and axis rules the `Trainer` and `zj.shard` were given,
and how a global batch is checked and laid out on the mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.adapt import checks
from zerojax.adapt.model import FunctionalModel, functional
from zerojax.core import axis_rules as axis_rules_lib
from zerojax.core import offload as offload_lib
from zerojax.core import trainable as trainable_lib
from zerojax.core.loss import cross_entropy
from zerojax.core.mesh import BATCH_AXES, check_batch, checked_mesh, data_parallel_size, make_mesh, pipeline_size
from zerojax.core.model_mesh import ModelMesh
from zerojax.core.optim import check_transformation
from zerojax.core.precision import Precision, get_precision
from zerojax.core.stages import Stage, get_stage
from zerojax.engines import Engine, EngineOptions, get_engine
from zerojax.engines.accum import check_accum_batch, check_grad_accum
from zerojax.engines.pipeline import Schedule, check_schedule
from zerojax.train.choices import Choices


@dataclass(frozen=True)
class Setup:
    """The choices a sharded step is built from, each checked once (`Setup.of`)."""

    model: FunctionalModel
    tx: optax.GradientTransformation
    mesh: Any
    stage: Stage
    engine: Engine
    precision: Precision
    loss_fn: Callable
    options: EngineOptions
    grad_accum: int
    schedule: Schedule  # a `pipeline` mesh axis's microbatches and repeats (`zerojax.engines.pipeline`)
    offload: str
    replicate_below_bytes: int
    axis_rules: dict  # logical axis name -> mesh axis (`zerojax.core.axis_rules`)
    model_mesh: ModelMesh  # the mesh the model's own shardings mean while it is traced

    source: Any = None  # the model as given (what `reference` rebuilds from)
    choices: Choices = Choices()  # the keyword choices as given
    # a bool per param leaf: what trains (`zerojax.core.trainable`); None: everything. Set by
    # `frozen_where`, which also wraps `model` and `tx`; `optimizer` is the optimizer as given.
    trainable: Any = None
    optimizer: Any = None

    @classmethod
    def of(cls, model, optimizer, **given) -> Setup:
        """The checked setup for `model` trained by `optimizer`; `given`: the keyword `Choices`."""
        c = Choices.of(**given)
        check_transformation(optimizer)
        built, options = get_engine(c.engine), EngineOptions.of(c.engine_options)
        built.check(options)
        grad_accum = check_grad_accum(c.grad_accum)
        offload = offload_lib.check_mode(c.offload)
        mesh = checked_mesh(c.mesh) if c.mesh is not None else make_mesh()
        offload_lib.check_backend(offload, mesh.devices.flat)
        rules = axis_rules_lib.as_rules(c.axis_rules)
        model_mesh = ModelMesh.of(mesh, rules)
        return cls(
            functional(model, c.rng_streams).on_mesh(model_mesh.active),
            optimizer,
            mesh,
            get_stage(c.stage),
            built,
            get_precision(c.precision, c.reduce_dtype),
            c.loss_fn or cross_entropy,
            options,
            grad_accum,
            Schedule.of(c.microbatches, c.pipeline_repeats, mesh),
            offload,
            c.replicate_below_bytes,
            rules,
            model_mesh,
            model,
            c,
        )

    @property
    def whole_micro_batches(self) -> bool:
        """Accumulating, each micro-batch runs on all of its rows (`zerojax.engines.gspmd_accum`):
        stage 3 re-gathering per micro-batch, a pipeline, or the engine option; else `gspmd` runs
        it once per data-parallel group."""
        return self.grad_accum > 1 and (
            self.options.whole_micro_batches
            or pipeline_size(self.mesh) > 1
            or (self.stage.compute_params and self.options.reshard_after_forward)
        )

    @property
    def runs_per_group(self) -> bool:
        """`gspmd` running the model once per data-parallel group (`zerojax.engines.gspmd_accum`):
        accumulating without whole micro-batches, or stage 3 keeping its gathered weights."""
        keep = self.stage.compute_params and not self.options.reshard_after_forward
        return self.choices.engine == "gspmd" and not self.whole_micro_batches and (self.grad_accum > 1 or keep)

    @property
    def loss_split(self) -> tuple[int, int, str]:
        """How the step runs the model and the loss on a batch's rows: (blocks, groups, what splits them),
        the rows as (groups, blocks, rows per block) and block i slice i of every group
        (`zerojax.adapt.row_blocks`); (1, 1, ...) where it sees the whole batch."""
        dp, k = data_parallel_size(self.mesh), self.grad_accum
        if self.choices.engine == "shard_map":
            per = " and micro-batch" if k > 1 else ""
            return dp * k, 1, f"the shard_map engine runs the model and the loss on each device's rows{per}"
        if self.whole_micro_batches:  # micro-batch i: slice i of every data-parallel group's rows
            return k, dp, "gradient accumulation runs the model and the loss on each micro-batch"
        if self.runs_per_group:
            what = "gradient accumulation" if k > 1 else "keeping the gathered weights, gspmd"
            return dp * k, 1, f"{what} runs the model and the loss on each data-parallel group's rows"
        return 1, 1, "gspmd runs the model and the loss on the whole batch"

    @property
    def metric_split(self) -> tuple[int, int, str]:
        """As `loss_split`, for `evaluate`: only `shard_map` at stage 3 evaluates on each device's
        rows (it gathers the weights per device); every other step evaluates the whole batch."""
        if self.choices.engine == "shard_map" and self.stage.compute_params:
            return data_parallel_size(self.mesh), 1, "at stage 3 the shard_map engine evaluates on each device's rows"
        return 1, 1, "evaluate sees the whole batch"

    def reference(self, same_engine: bool = False) -> Setup:
        """The same model, optimizer, loss, precision, rules and mesh at stage 0 under `gspmd` (or,
        `same_engine`, under this setup's engine): what `verify` compares against. Accumulating, it
        runs the micro-batches as this setup does, whole or per data-parallel group, so it draws the
        same random numbers (`zerojax.engines.gspmd_accum`); the engine option `layer_stacks` is kept."""
        engine = self.choices.engine if same_engine else "gspmd"
        whole = self.whole_micro_batches
        # the layer stacks a model is opted into are part of the model (a pipeline splits them)
        options = EngineOptions(layer_stacks=self.options.layer_stacks, whole_micro_batches=whole and engine == "gspmd")
        plain = dataclasses.replace(self.choices, stage=0, engine=engine, engine_options=options, offload="none")
        return Setup.of(self.source, self.optimizer or self.tx, **plain.given())

    def frozen_where(self, mask, param_shapes) -> Setup:
        """This setup training only where `mask` is True: the model differentiates the trainable
        leaves only, and the optimizer updates and keeps state for them only. The model reads a
        frozen integer leaf in the dtype `param_shapes` declares (`trainable.stop_frozen`)."""
        if mask is None:
            return self
        dtypes = trainable_lib.declared_dtypes(param_shapes, mask)
        traced = ("apply", "modules", "lifted_stacks")  # the model's functions of its params
        return dataclasses.replace(
            self,
            model=dataclasses.replace(
                self.model, **{n: trainable_lib.frozen_apply(getattr(self.model, n), mask, dtypes) for n in traced}
            ),
            tx=trainable_lib.frozen_optimizer(self.tx, mask),
            trainable=mask,
            optimizer=self.tx,
        )

    batch_sharding = property(lambda self: NamedSharding(self.mesh, P(BATCH_AXES)))

    def check_batch(self, batch: dict) -> None:
        """What any use of `batch` needs: inputs, and rows the data-parallel devices (and micro-batches) divide."""
        checks.check_keys(batch, default_loss=False)
        rows = checks.check_rows(batch)
        subject = f"a batch of {rows} rows"
        check_batch(rows, data_parallel_size(self.mesh), subject)
        check_accum_batch(rows, data_parallel_size(self.mesh), self.grad_accum, subject)
        if pipeline_size(self.mesh) > 1:  # each accumulation step's rows go through the pipeline
            check_schedule(self.mesh, rows // self.grad_accum, self.schedule.microbatches_on(self.mesh))

    def shard_batch(self, batch: dict) -> dict:
        """A global batch as `jax.Array`s split over the batch axes (each value an array or a pytree of
        them); device arrays already so are kept."""
        self.check_batch(batch)
        sharding = self.batch_sharding

        def placed(value):
            if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim):
                return value
            host = np.asarray(value)
            return jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx])

        return {name: jax.tree.map(placed, value) for name, value in batch.items()}
