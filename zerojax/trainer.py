"""`Trainer`: init straight into shards, compile, step.

    trainer = zj.Trainer(model, optax.adamw(3e-4), mesh=mesh, stage=3, engine="gspmd", precision="bf16",
                         grad_accum=1,  # k > 1: k micro-batches of batch/k rows per step, one update
                         offload="none")  # "optimizer": fp32 master + optimizer state in host memory
    state = trainer.init(jax.random.key(0), batch)
    state, metrics = trainer.step(state, batch)

Everything built for one (input shape and dtype, key) is one frozen `Prepared`: the layout, the
shardings, the model's static state and the jitted step and eval functions. `prepare` builds it once
and reuses it; `init` and `restore_state` make it the one `step`, `evaluate` and `compile` use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax import checks, offload_modes
from zerojax import offload as offload_lib
from zerojax.adapt import functional
from zerojax.engines import EngineOptions, GatherReport, get_engine
from zerojax.engines.accum import check_accum_batch, check_grad_accum
from zerojax.engines.common import compute_params, cross_entropy, global_loss, stack_paths
from zerojax.errors import UserError
from zerojax.layout import StateLayout, make_layout
from zerojax.mesh import BATCH_AXES, check_batch, data_parallel_size, make_mesh
from zerojax.optim import pads_exactly
from zerojax.precision import get_precision
from zerojax.stages import get_stage
from zerojax.state import TrainState, run_key

_KEEP_PREPARED = 4  # preparations kept for reuse (one per input shape and key)
_KEY_SHAPE = (2,)  # the raw data of a threefry key: the state's `rng`


@dataclass(frozen=True)
class Prepared:
    """What a `Trainer` builds for one (input shape and dtype, key); never changed once built."""

    inputs: jax.ShapeDtypeStruct  # the model inputs it was built for
    layout: StateLayout
    param_shapes: Any  # the model's logical params, abstract
    state_shardings: TrainState  # a NamedSharding per leaf of each group
    abstract: TrainState  # the state as ShapeDtypeStructs with their shardings
    static: Any  # the model's RNG streams (NNX), replicated; rewritten from the step's key each step
    step_fn: Callable  # jitted (state, batch) -> (state, metrics)
    eval_fn: Callable  # jitted (state, batch, loss_fn) -> loss, in eval mode
    report: GatherReport  # how the step materialises the compute params
    classes: int | None = None  # the output's classes, which the default loss's integer targets index


class Trainer:
    def __init__(
        self,
        model,
        optimizer: optax.GradientTransformation,
        *,
        mesh=None,
        stage: int = 0,
        engine: str = "gspmd",
        precision: str = "fp32",
        loss_fn: Callable | None = None,
        reduce_dtype: str | None = None,
        replicate_below_bytes: int = 2048,
        engine_options: EngineOptions | dict | None = None,
        rng_streams: tuple[str, ...] = ("dropout",),
        grad_accum: int = 1,
        offload: str = "none",
    ):
        # what `verify` builds its stage-0 reference from
        self.arguments = {
            "model": model,
            "precision": precision,
            "loss_fn": loss_fn,
            "reduce_dtype": reduce_dtype,
            "replicate_below_bytes": replicate_below_bytes,
            "rng_streams": tuple(rng_streams),
        }
        self._engine = get_engine(engine)
        self.engine = engine
        self.options = EngineOptions.of(engine_options)
        self._engine.check(self.options)
        self.grad_accum = check_grad_accum(grad_accum)
        if self.grad_accum > 1 and "grad_accum" not in self._engine.supports:
            raise UserError(f"the {engine} engine does not support gradient accumulation (train.grad_accum).")
        self.offload = offload_modes.check_mode(offload)
        self.model = functional(model, rng_streams)
        self.tx = optimizer
        self.mesh = mesh if mesh is not None else make_mesh()
        self.stage = get_stage(stage)
        offload_lib.check_backend(self.offload, self.mesh.devices.flat)
        self.precision = get_precision(precision, reduce_dtype)
        self.loss_fn = loss_fn or cross_entropy
        self.replicate_below_bytes = replicate_below_bytes
        # An optimizer whose update is not elementwise keeps padded leaves whole (see `make_layout`).
        self._pads_exactly = pads_exactly(optimizer)
        self._preparations: dict[tuple, Prepared] = {}
        self._active: Prepared | None = None  # the preparation `step` uses: set by init / restore_state
        self._compiled = None  # (preparation, its compiled step), reused by `step`

    # ---- preparation -----------------------------------------------------------------------------

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(BATCH_AXES))

    def check_batch(self, batch: dict) -> None:
        """A `UserError` unless `step` can train on `batch`: its keys and labels (its rows are checked
        where it is sharded, `shard_batch`)."""
        checks.check_keys(batch, default_loss=self.loss_fn is cross_entropy)
        if self._active is not None and self._active.classes is not None:
            checks.check_targets(batch, self._active.classes)

    def _check_batch(self, batch) -> None:
        """What any use of `batch` needs (init and evaluation too): inputs, rows the mesh divides."""
        checks.check_keys(batch, default_loss=False)
        check_batch(batch["inputs"].shape[0], data_parallel_size(self.mesh))
        check_accum_batch(batch["inputs"].shape[0], data_parallel_size(self.mesh), self.grad_accum)

    def prepare(self, key, batch: dict) -> Prepared:
        """The preparation for this batch's input shape and `key`: built on first use, then reused.

        Builds no state and changes nothing `step` uses (that is `init`'s and `restore_state`'s job).
        """
        self._check_batch(batch)
        inputs = jax.ShapeDtypeStruct(batch["inputs"].shape, batch["inputs"].dtype)
        token = (tuple(inputs.shape), str(inputs.dtype), tuple(np.asarray(jax.random.key_data(key)).ravel().tolist()))
        if token not in self._preparations:
            if len(self._preparations) >= _KEEP_PREPARED:
                self._preparations.pop(next(iter(self._preparations)))
            prep = self._build(key, inputs)
            self._preparations[token] = dataclasses.replace(prep, classes=self._check_model(prep, key, batch))
        prep = self._preparations[token]
        if prep.classes is not None:
            checks.check_targets(batch, prep.classes)
        return prep

    def _check_model(self, prep: Prepared, key, batch: dict) -> int | None:
        """The model and the loss on this batch's shapes, abstractly (`zerojax.checks`)."""

        def run_model(params, model_state, static, inputs):
            return self.model.apply(params, model_state, static, inputs, rng=key, train=True)[0]

        args = (prep.param_shapes, prep.abstract.model_state or {}, prep.static)
        return checks.check_model_and_loss(run_model, args, self.loss_fn, batch, self.loss_fn is cross_entropy)

    def _build(self, key, inputs: jax.ShapeDtypeStruct) -> Prepared:
        param_shapes, model_state_shapes, static_shapes = jax.eval_shape(self.model.init, key, inputs)  # one trace
        layout = make_layout(
            self.mesh,
            self.stage,
            self.precision,
            param_shapes,
            replicate_below_bytes=self.replicate_below_bytes,
            pad_free_optimizer=not self._pads_exactly,
            stack_paths=self._stacks(param_shapes, model_state_shapes, static_shapes, inputs),
            offload=self.offload,
            hierarchical=self.options.hierarchical,
        )
        opt_state_shapes = layout.opt_state_shapes(self.tx)
        has_model_state = bool(jax.tree.leaves(model_state_shapes))
        model_state_shapes = model_state_shapes if has_model_state else None
        shardings = layout.state_shardings(self.tx, opt_state_shapes).replace(
            rng=layout.replicated, model_state=jax.tree.map(lambda _: layout.replicated, model_state_shapes)
        )
        abstract = layout.abstract_state(self.tx, opt_state_shapes).replace(
            rng=jax.ShapeDtypeStruct(_KEY_SHAPE, np.uint32, sharding=layout.replicated),
            model_state=jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=layout.replicated), model_state_shapes
            ),
        )
        static = self._static(key, inputs, static_shapes, layout)
        accumulate = {"grad_accum": self.grad_accum} if self.grad_accum > 1 else {}
        built = self._engine.build(
            layout,
            self.model,
            static,
            self.loss_fn,
            self.tx,
            self.options,
            inputs,
            model_state=model_state_shapes,
            **accumulate,
        )
        # Host-offloaded groups stream into device memory at the step's start and back out at its end.
        step = offload_lib.streamed(built.step, shardings, layout.host_groups)
        step_fn = jax.jit(
            step,
            in_shardings=(shardings, self.batch_sharding),
            out_shardings=(shardings, layout.replicated),
            donate_argnums=0,
        )
        eval_fn = self._eval_fn(layout, shardings, static, built.evaluate)
        return Prepared(inputs, layout, param_shapes, shardings, abstract, static, step_fn, eval_fn, built.report)

    def _eval_fn(self, layout, shardings, static, evaluate):
        """The jitted `(state, batch, loss_fn) -> loss` in eval mode (no dropout, BatchNorm's running
        statistics), gathered as the train step's forward gathers where the engine says how."""
        model = self.model

        def eval_loss(state, batch, loss_fn):
            if evaluate is not None:
                return evaluate(state, batch, loss_fn)
            params = compute_params(layout, state)
            out, _ = model.apply(params, state.model_state or {}, static, batch["inputs"], train=False)
            return global_loss(loss_fn(out, batch))

        return jax.jit(
            offload_lib.streamed(eval_loss, shardings, layout.host_groups),
            static_argnums=2,
            in_shardings=(shardings, self.batch_sharding),
            out_shardings=layout.replicated,
        )

    def _stacks(self, param_shapes, model_state_shapes, static_shapes, inputs) -> tuple:
        """The param paths whose leaves stack layers on axis 0: the model's declared or `zj.Stacked`
        stacks, or the lifted ones its transforms make (`FunctionalModel.lifted_stacks`)."""
        declared = stack_paths(self.model, param_shapes, self.options)
        if declared or self.model.lifted_stacks is None:
            return declared
        return self.model.lifted_stacks(param_shapes, model_state_shapes or {}, static_shapes, inputs)

    def _static(self, key, inputs, static_shapes, layout: StateLayout):
        """The model's RNG streams, replicated (computed only where it has leaves)."""
        if not jax.tree.leaves(static_shapes):
            return static_shapes
        shardings = jax.tree.map(lambda _: layout.replicated, static_shapes)
        init_static = jax.jit(lambda k, x: self.model.init(k, x)[2], out_shardings=shardings)
        return init_static(key, jnp.zeros(inputs.shape, inputs.dtype))

    @property
    def prepared(self) -> Prepared:
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
        """How the current step materialises the compute params."""
        return self.prepared.report

    def _activate(self, prep: Prepared) -> None:
        if self._active is not prep:
            self._active, self._compiled = prep, None

    # ---- state -----------------------------------------------------------------------------------

    def shard_batch(self, batch: dict) -> dict:
        """A global batch as `jax.Array`s split over (data, fsdp); device arrays already so are kept."""
        self._check_batch(batch)
        out = {}
        for name, value in batch.items():
            if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(self.batch_sharding, value.ndim):
                out[name] = value
            else:
                host = np.asarray(value)
                out[name] = jax.make_array_from_callback(host.shape, self.batch_sharding, lambda idx, h=host: h[idx])
        return out

    def init(self, key, batch: dict, params=None) -> TrainState:
        """The train state, created inside `jit` directly into its shards.

        `params` (e.g. from `zerojax.load_params`) start the run from those weights instead of `key`.
        """
        prep = self.prepare(key, batch)
        if params is not None:
            got = jax.tree.map(lambda x: tuple(np.shape(x)), params)
            want = jax.tree.map(lambda x: tuple(x.shape), prep.param_shapes)
            if jax.tree.structure(got) != jax.tree.structure(want) or got != want:
                raise UserError("the given params do not match the model's parameter names and shapes.")
        model, layout, tx = self.model, prep.layout, self.tx

        has_model_state = prep.state_shardings.model_state is not None

        def init_state(key, inputs, params=None):
            fresh, model_state, _ = model.init(key, inputs)
            state = layout.fresh_state(tx, fresh if params is None else params)  # XLA drops an unused init
            state = state.replace(rng=run_key(key), model_state=model_state if has_model_state else None)
            return offload_lib.place(state, prep.state_shardings, layout.host_groups, offload_modes.HOST)

        inputs = jnp.zeros(prep.inputs.shape, prep.inputs.dtype)
        state = jax.jit(init_state, out_shardings=prep.state_shardings)(key, inputs, params)
        self._activate(prep)
        return state

    def abstract_state(self, key, batch: dict) -> TrainState:
        """The state `init` would build, as `jax.ShapeDtypeStruct`s with shardings; allocates no params
        and changes nothing. The derived compute copy is left out: `restore_state` rebuilds it."""
        return self.prepare(key, batch).abstract.replace(compute=None)

    def restore_state(self, saved: dict, key, batch: dict) -> TrainState:
        """The full train state from restored groups (placed as `abstract_state(key, batch)` says),
        made current for `step`: the compute copy is derived again from the master params."""
        prep = self.prepare(key, batch)
        state = TrainState.from_saved(saved)
        layout = prep.layout
        if layout.keeps_compute_copy:
            shardings, host = prep.state_shardings, layout.host_groups

            def derive(state):  # the master streamed in from host memory where it is kept there
                state = offload_lib.place(state, shardings, host, offload_modes.DEVICE)
                compute = layout.derive_compute(state.params)
                return (
                    compute
                    if "compute" not in host
                    else offload_lib.place(
                        state.replace(compute=compute), shardings, ("compute",), offload_modes.HOST
                    ).compute
                )

            state = state.replace(compute=jax.jit(derive, out_shardings=shardings.compute)(state))
        self._activate(prep)
        return state

    # ---- running ---------------------------------------------------------------------------------

    def lower(self, state: TrainState, batch: dict):
        """The current step lowered for `state` and `batch` (arrays, or ShapeDtypeStructs)."""
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch)):
            batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding) for k, v in batch.items()}
        else:
            batch = self.shard_batch(batch)
        return self.prepared.step_fn.lower(state, batch)

    def compile(self, state: TrainState, batch: dict):
        """The `jax.stages.Compiled` train step for these shapes (for memory and HLO analysis)."""
        prep = self.prepared
        self.check_batch(batch)
        compiled = prep.step_fn.lower(state, self.shard_batch(batch)).compile()
        self._compiled = (prep, compiled)
        return compiled

    def _check_inputs(self, prep: Prepared, batch: dict) -> None:
        x = batch["inputs"]
        if tuple(x.shape) != tuple(prep.inputs.shape) or x.dtype != prep.inputs.dtype:
            raise UserError(
                f"this batch's inputs are {x.dtype}{list(x.shape)}, but the trainer was prepared for "
                f"{prep.inputs.dtype}{list(prep.inputs.shape)}; call init (or restore) for new shapes."
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
        the same form, e.g. `(correct, rows)` for accuracy."""
        return self.prepared.eval_fn(state, self.shard_batch(batch), loss_fn or self.loss_fn)

    def verify(self, batch, steps: int = 3, key=None, tolerance: tuple[float, float] | None = None):
        """This trainer against the same model at stage 0 (same key, same batches) for `steps` steps:
        a `zerojax.verify.Verification` of the largest loss, gradient-norm and per-parameter update
        differences; `.passed` within the precision's tolerance. Run it once on a new model."""
        from zerojax.verify import verify

        return verify(self, batch, steps, key=key, tolerance=tolerance)

    def persistent_bytes_per_device(self, state: TrainState) -> int:
        """Bytes of the state's shards of the first local device that live in its device memory
        (host-offloaded groups are counted by `host_persistent_bytes_per_device`)."""
        from zerojax.accounting.placed_bytes import split_bytes

        return split_bytes(state, self.mesh.devices.flat[0])["device"]

    def host_persistent_bytes_per_device(self, state: TrainState) -> int:
        """Bytes of the state's shards of the first local device kept in host memory (`offload`)."""
        from zerojax.accounting.placed_bytes import split_bytes

        return split_bytes(state, self.mesh.devices.flat[0])["host"]
