"""`Trainer`: init straight into shards, compile, step.

    trainer = zj.Trainer(model, optax.adamw(3e-4), mesh=mesh, stage=3, engine="gspmd", precision="bf16")
    state = trainer.init(jax.random.key(0), batch)
    state, metrics = trainer.step(state, batch)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.adapt import functional
from zerojax.engines import ENGINES
from zerojax.engines.common import cross_entropy
from zerojax.errors import UserError
from zerojax.layout import StateLayout, make_layout
from zerojax.mesh import BATCH_AXES, data_parallel_size, make_mesh
from zerojax.precision import cast_tree, get_precision
from zerojax.stages import get_stage


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
        layer_stacks: tuple[str, ...] = ("blocks",),
        replicate_below_bytes: int = 2048,
        engine_options: dict | None = None,
    ):
        if engine not in ENGINES:
            raise UserError(f"zero.engine must be one of {', '.join(ENGINES)}, got {engine!r}.")
        self.model = functional(model)
        self.tx = optimizer
        self.mesh = mesh if mesh is not None else make_mesh()
        self.stage = get_stage(stage)
        self.engine = engine
        self.precision = get_precision(precision, reduce_dtype)
        self.loss_fn = loss_fn or cross_entropy
        self.layer_stacks = tuple(layer_stacks)
        self.replicate_below_bytes = replicate_below_bytes
        self.engine_options = dict(engine_options or {})
        self.layout: StateLayout | None = None
        self.static = None
        self._step_fn = None
        self._eval_fn = None
        self._compiled = None  # the last compiled step, reused by `step` (same shapes)
        self._prepared_for = None  # (input shape, dtype, key) the layout and functions were built for

    # ---- layout and compiled functions -------------------------------------------------------

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(BATCH_AXES))

    def _check_batch(self, batch) -> None:
        rows = batch["inputs"].shape[0]
        dp = data_parallel_size(self.mesh)
        if rows % dp:
            raise UserError(
                f"train.batch_size={rows} is not divisible by the data-parallel size {dp} (mesh data x fsdp)."
            )

    def _build_layout(self, key, batch) -> None:
        shapes = jax.eval_shape(self.model.init, key, batch["inputs"])[0]
        self.layout = make_layout(self.mesh, self.stage, self.precision, shapes, layer_stacks=self.layer_stacks,
                                  replicate_below_bytes=self.replicate_below_bytes)
        opt_params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
                                  self.layout.shapes(self.layout.optimizer_sharded),
                                  is_leaf=lambda x: isinstance(x, tuple))
        self._opt_state_shapes = jax.eval_shape(self.tx.init, opt_params)
        self.state_shardings = self.layout.state_shardings(self.tx, self._opt_state_shapes)

    def _build_functions(self) -> None:
        engine = importlib.import_module(f"zerojax.engines.{self.engine}")
        options = dict(self.engine_options)
        options.setdefault("layer_stacks", self.layer_stacks)  # the stacks gathered layer by layer
        step = engine.build_step(self.layout, self.model, self.static, self.loss_fn, self.tx, **options)
        metrics_sharding = self.layout.replicated
        self._step_fn = jax.jit(
            step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, metrics_sharding),
            donate_argnums=0,
        )

        def eval_loss(state, batch):
            from zerojax.engines.common import compute_params

            params = compute_params(self.layout, state)
            return self.loss_fn(self.model.apply(params, self.static, batch["inputs"]), batch)

        self._eval_fn = jax.jit(eval_loss, in_shardings=(self.state_shardings, self.batch_sharding),
                                out_shardings=metrics_sharding)

    # ---- public API ------------------------------------------------------------------------------

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

    def _init_fn(self):
        """(key, inputs, params=None) -> (state, static); given `params` replace the fresh ones."""
        layout = self.layout

        def init_state(key, inputs, params=None):
            fresh, static = self.model.init(key, inputs)
            params = fresh if params is None else params  # XLA drops the unused fresh init
            params = jax.tree.map(lambda x: x.astype(layout.precision.master_dtype), params)
            state = {
                "step": jnp.zeros((), jnp.int32),
                "params": layout.to_layout(params, layout.master_sharded),
                "opt_state": self.tx.init(layout.to_layout(params, layout.optimizer_sharded)),
            }
            if layout.keeps_compute_copy:
                state["compute"] = jax.tree.map(lambda x: x.astype(layout.precision.compute_dtype), params)
            return state, static

        return init_state

    def _check_params(self, params, key, inputs) -> None:
        expected = jax.eval_shape(self.model.init, key, inputs)[0]
        got = jax.tree.map(lambda x: tuple(np.shape(x)), params)
        want = jax.tree.map(lambda x: tuple(x.shape), expected)
        if jax.tree.structure(got) != jax.tree.structure(want) or got != want:
            raise UserError("the given params do not match the model's parameter names and shapes.")

    def init(self, key, batch: dict, params=None) -> dict:
        """The train state, created inside `jit` directly into its shards.

        `params` (e.g. from `zerojax.load_params`) start the run from those weights instead of `key`.
        """
        self._check_batch(batch)
        inputs = jax.ShapeDtypeStruct(batch["inputs"].shape, batch["inputs"].dtype)
        if params is not None:
            self._check_params(params, key, inputs)
        self._build_layout(key, {"inputs": inputs})
        layout = self.layout
        init_state = self._init_fn()
        inputs = jnp.zeros(inputs.shape, inputs.dtype)
        static_shapes = jax.eval_shape(init_state, key, inputs)[1]
        static_shardings = jax.tree.map(lambda _: layout.replicated, static_shapes)
        state, self.static = jax.jit(init_state, out_shardings=(self.state_shardings, static_shardings))(
            key, inputs, params)
        self._compiled = None
        self._build_functions()
        self._prepared_for = self._preparation_key(key, inputs)
        return state

    @staticmethod
    def _preparation_key(key, inputs) -> tuple:
        return tuple(inputs.shape), str(inputs.dtype), tuple(np.asarray(jax.random.key_data(key)).ravel().tolist())

    def abstract_state(self, key, batch: dict) -> dict:
        """The state `init` would build, as `jax.ShapeDtypeStruct`s with shardings; allocates no params.

        Prepares the trainer as `init` does (layout, static state, step function), so a state restored
        into these shardings can `step`; a trainer already prepared for these inputs is kept as it is
        (no recompilation). The derived compute copy is left out: `restore_state` rebuilds it.
        """
        self._check_batch(batch)
        inputs = jax.ShapeDtypeStruct(batch["inputs"].shape, batch["inputs"].dtype)
        prep = self._preparation_key(key, inputs)
        if self._step_fn is None or self._prepared_for != prep:
            self._build_layout(key, {"inputs": inputs})
            init_state = self._init_fn()
            zeros = jnp.zeros(inputs.shape, inputs.dtype)
            static_shapes = jax.eval_shape(init_state, key, zeros)[1]
            static_shardings = jax.tree.map(lambda _: self.layout.replicated, static_shapes)
            self.static = jax.jit(lambda k, x: init_state(k, x)[1], out_shardings=static_shardings)(key, zeros)
            self._compiled = None
            self._build_functions()
            self._prepared_for = prep
        shapes = jax.eval_shape(self._init_fn(), key, inputs)[0]
        shapes.pop("compute", None)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, {k: self.state_shardings[k] for k in shapes})

    def restore_state(self, saved: dict) -> dict:
        """The full train state from restored `step`, `params` and `opt_state` (placed as
        `abstract_state` says): the compute copy is derived again from the master params."""
        self._require_init()
        state = dict(saved)
        layout = self.layout
        if layout.keeps_compute_copy:
            def derive(params):
                return cast_tree(layout.to_layout(params, sharded=False), layout.precision.compute_dtype)

            state["compute"] = jax.jit(derive, out_shardings=self.state_shardings["compute"])(state["params"])
        return state

    def _require_init(self) -> None:
        if self._step_fn is None:
            raise RuntimeError("call trainer.init(key, batch) before compile, step or evaluate")

    def compile(self, state: dict, batch: dict):
        """The `jax.stages.Compiled` train step for these shapes (for memory and HLO analysis)."""
        self._require_init()
        self._compiled = self._step_fn.lower(state, self.shard_batch(batch)).compile()
        return self._compiled

    def step(self, state: dict, batch: dict) -> tuple[dict, dict[str, Any]]:
        self._require_init()
        batch = self.shard_batch(batch)
        if self._compiled is not None:
            try:
                return self._compiled(state, batch)
            except TypeError:  # other shapes than those compiled for: let jit retrace
                pass
        return self._step_fn(state, batch)

    def evaluate(self, state: dict, batch: dict) -> jax.Array:
        self._require_init()
        return self._eval_fn(state, self.shard_batch(batch))

    def persistent_bytes_per_device(self, state: dict) -> int:
        """Bytes of the state's shards that live on the first local device."""
        device = self.mesh.devices.flat[0]
        total = 0
        for leaf in jax.tree.leaves(state):
            for shard in leaf.addressable_shards:
                if shard.device == device:
                    total += shard.data.nbytes
        return total
