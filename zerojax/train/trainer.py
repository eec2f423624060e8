"""`Trainer`: init straight into shards, compile, step.

    trainer = zj.Trainer(model, optax.adamw(3e-4), mesh=mesh, stage=3, engine="gspmd", precision="bf16",
                         grad_accum=1,  # k > 1: k micro-batches of batch/k rows per step, one update
                         offload="none")  # "optimizer": fp32 master + optimizer state in host memory
    state = trainer.init(jax.random.key(0), batch)
    state, metrics = trainer.step(state, batch)

Everything built for one (input shape and dtype, key) is one frozen `zerojax.train.shard.Sharded`:
the layout, the shardings, the model's static state and the step and eval functions, pure and
jitted. `prepare` builds it once and reuses it; `init` and `restore_state` make it the one `step`,
`evaluate` and `compile` use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding

from zerojax.adapt import checks
from zerojax.adapt.loss_rows import check_loss_splits
from zerojax.core.layout import StateLayout
from zerojax.core.loss import cross_entropy
from zerojax.core.state import TrainState
from zerojax.core.trees import abstract, describe
from zerojax.engines import GatherReport
from zerojax.errors import UserError
from zerojax.train.choices import with_choices
from zerojax.train.setup import Setup
from zerojax.train.shard import Sharded, prepare

_KEEP_PREPARED = 4  # preparations kept for reuse (one per input shape and key)


class Trainer:
    @with_choices
    def __init__(self, model, optimizer: optax.GradientTransformation, **choices):
        """`model` trained by `optimizer`; `choices`: the keyword `zerojax.train.choices.Choices` (mesh,
        stage, engine, precision, loss_fn, grad_accum, offload, axis_rules, ...)."""
        setup = Setup.of(model, optimizer, **choices)
        self.setup, self.engine = setup, setup.choices.engine
        self._preparations: dict[tuple, Sharded] = {}
        self._active: Sharded | None = None  # the preparation `step` uses: set by init / restore_state
        self._compiled: tuple[Sharded, Any] | None = None  # (preparation, its compiled step), reused by `step`
        self._checked_metrics: dict[int, Callable] = {}  # `evaluate`'s metrics that add up over rows

    # ---- the choices, as checked (`zerojax.train.setup.Setup`) ---------------------------------------

    model = property(lambda self: self.setup.model)
    tx = property(lambda self: self.setup.tx)
    mesh = property(lambda self: self.setup.mesh)
    stage = property(lambda self: self.setup.stage)
    precision = property(lambda self: self.setup.precision)
    options = property(lambda self: self.setup.options)
    grad_accum = property(lambda self: self.setup.grad_accum)
    offload = property(lambda self: self.setup.offload)
    replicate_below_bytes = property(lambda self: self.setup.replicate_below_bytes)

    @property
    def loss_fn(self) -> Callable:
        return self.setup.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: Callable) -> None:
        """A new loss: the steps prepared for the old one are dropped."""
        self.setup = dataclasses.replace(self.setup, loss_fn=fn)
        self._preparations.clear()
        self._active = self._compiled = None

    # ---- preparation -----------------------------------------------------------------------------

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.setup.batch_sharding

    def check_batch(self, batch: dict) -> None:
        """A `UserError` unless `step` can train on `batch`: its keys and labels (its rows are checked
        where it is sharded, `shard_batch`)."""
        checks.check_keys(batch, default_loss=self.loss_fn is cross_entropy)
        if self._active is not None and self._active.classes is not None:
            checks.check_targets(batch, self._active.classes)

    def prepare(self, key, batch: dict) -> Sharded:
        """The preparation for this batch's input shape and `key`: built on first use, then reused.

        Builds no state and changes nothing `step` uses (that is `init`'s and `restore_state`'s job).
        """
        self.setup.check_batch(batch)
        token = (describe(abstract(batch["inputs"])), tuple(np.asarray(jax.random.key_data(key)).ravel().tolist()))
        if token not in self._preparations:
            if len(self._preparations) >= _KEEP_PREPARED:
                self._preparations.pop(next(iter(self._preparations)))
            self._preparations[token] = prepare(self.setup, key, batch)
        prep = self._preparations[token]
        if prep.classes is not None:
            checks.check_targets(batch, prep.classes)
        return prep

    @property
    def prepared(self) -> Sharded:
        """The preparation the last `init` or `restore_state` made current."""
        if self._active is None:
            raise RuntimeError("call trainer.init(key, batch) before compile, step or evaluate")
        return self._active

    @property
    def layout(self) -> StateLayout:
        return self.prepared.layout

    @property
    def static(self):
        return self.prepared.static

    @property
    def state_shardings(self) -> TrainState:
        return self.prepared.state_shardings

    def gather_report(self) -> GatherReport:
        """How the current step materialises the compute params (`notes`: what the model's traces
        dropped from its own shardings, `zerojax.core.model_mesh`)."""
        return self.prepared.gather_report()

    def _activate(self, prep: Sharded) -> None:
        if self._active is not prep:
            self._active, self._compiled = prep, None

    # ---- state -----------------------------------------------------------------------------------

    def shard_batch(self, batch: dict) -> dict:
        """A global batch as `jax.Array`s split over (data, fsdp); device arrays already so are kept."""
        return self.setup.shard_batch(batch)

    def init(self, key, batch: dict, params=None) -> TrainState:
        """The train state, created inside `jit` directly into its shards.

        `params` (e.g. from `zerojax.load_params`) start the run from those weights instead of `key`.
        """
        prep = self.prepare(key, batch)
        state = prep.init(key, params)
        self._activate(prep)
        return state

    def abstract_state(self, key, batch: dict) -> TrainState:
        """The state `init` would build, as `jax.ShapeDtypeStruct`s with shardings; allocates no params
        and changes nothing. The derived compute copy is left out: `restore_state` rebuilds it."""
        return self.prepare(key, batch).abstract_state()

    def restore_state(self, saved: dict, key, batch: dict) -> TrainState:
        """The full train state from restored groups (placed as `abstract_state(key, batch)` says),
        made current for `step`: the compute copy is derived again from the master params."""
        prep = self.prepare(key, batch)
        state = prep.restore_state(saved)
        self._activate(prep)
        return state

    # ---- running ---------------------------------------------------------------------------------

    def lower(self, state: TrainState, batch: dict):
        """The current step lowered for `state` and `batch` (arrays, or ShapeDtypeStructs)."""
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch)):
            batch = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding), batch)
        else:
            batch = self.shard_batch(batch)
        return self.prepared.step_fn.lower(state, batch)  # type: ignore[attr-defined]

    def compile(self, state: TrainState, batch: dict):
        """The `jax.stages.Compiled` train step for these shapes (for memory and HLO analysis)."""
        prep = self.prepared
        self.check_batch(batch)
        compiled = prep.step_fn.lower(state, self.shard_batch(batch)).compile()  # type: ignore[attr-defined]
        self._compiled = (prep, compiled)
        return compiled

    def _check_inputs(self, prep: Sharded, batch: dict) -> None:
        got = abstract(batch["inputs"])
        if got != prep.inputs:  # every step: compared as shapes, written out only to refuse
            raise UserError(
                f"this batch's inputs are {describe(got)}, but the trainer was prepared for "
                f"{describe(prep.inputs)}; call init (or restore) for new shapes."
            )

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict[str, Any]]:
        """One train step; a batch of other input shapes than prepared for raises (no silent retrace)."""
        prep = self.prepared
        self.check_batch(batch)
        batch = self.shard_batch(batch)
        self._check_inputs(prep, batch)
        if self._compiled is not None and self._compiled[0] is prep:
            return self._compiled[1](state, batch)
        return prep.step_fn(state, batch)

    def evaluate(self, state: TrainState, batch: dict, loss_fn: Callable | None = None) -> jax.Array:
        """The loss of `batch` in eval mode (NNX `model.eval()`, Linen `train=False`): no dropout,
        BatchNorm on its running statistics. `loss_fn` (default: the trainer's) may be any metric of
        the same form, e.g. `zj.WeightedLoss(correct, rows)` for accuracy."""
        if loss_fn is not None:
            self._check_metric(loss_fn, batch)
        return self.prepared.eval_fn(state, self.shard_batch(batch), loss_fn or self.loss_fn)

    def _check_metric(self, metric: Callable, batch: dict) -> None:
        """A metric `evaluate` is given, the first time: where the step evaluates it on each device's
        rows (`Setup.metric_split`), it must add up over them as a loss must (`zerojax.adapt.loss_rows`;
        an F1 score does not)."""
        split = self.setup.metric_split
        if split[0] <= 1 or self._checked_metrics.get(id(metric)) is metric:
            return
        prepared = self.prepared

        def outputs(params, model_state, inputs):
            return self.model.apply(params, model_state, prepared.static, inputs, train=False)[0]

        try:
            out = jax.eval_shape(
                outputs, prepared.param_shapes, prepared.abstract.model_state or {}, abstract(batch["inputs"])
            )
        except Exception:  # noqa: BLE001 - the evaluation traces the model itself and reports its failure
            return
        check_loss_splits(metric, out, batch, split)
        if len(self._checked_metrics) > 64:  # a metric written inline is a new function at every call
            self._checked_metrics.clear()
        self._checked_metrics[id(metric)] = metric

    def verify(self, batch, steps: int = 3, key=None, tolerance: tuple[float, float] | None = None):
        """This trainer against the same model at stage 0 (same key, same batches) for `steps` steps:
        a `zerojax.train.verify.Verification` of the largest loss, gradient-norm and per-parameter update
        differences; `.passed` within the precision's tolerance. Run it once on a new model."""
        from zerojax.train.verify import verify

        return verify(self, batch, steps, key=key, tolerance=tolerance)

    def persistent_bytes_per_device(self, state: TrainState) -> int:
        """Bytes of the state's shards of the first local device that live in its device memory
        (host-offloaded groups are counted by `host_persistent_bytes_per_device`)."""
        from zerojax.core.offload import split_bytes

        return split_bytes(state, self.mesh.devices.flat[0])["device"]

    def host_persistent_bytes_per_device(self, state: TrainState) -> int:
        """Bytes of the state's shards of the first local device kept in host memory (`offload`)."""
        from zerojax.core.offload import split_bytes

        return split_bytes(state, self.mesh.devices.flat[0])["host"]
