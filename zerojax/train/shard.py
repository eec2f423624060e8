"""Your loop, our shardings: what a ZeRO stage means for one model, as pure functions over pytrees.

    core = zj.shard(model, optax.adamw(3e-4), batch, mesh=zj.make_mesh(fsdp=8), stage=3)
    state = core.init(jax.random.key(0))        # the TrainState, created straight into its shards
    step = jax.jit(core.step, donate_argnums=0, compiler_options=core.compiler_options)  # or nnx.jit
    for batch in batches:
        state, metrics = step(state, core.shard_batch(batch))

`core.step` is `core.update(state, *core.grads(state, batch))`: the gradients materialised and reduced
as the chosen engine does (unit by unit at stage 3, reduce-scattered in backward), then the sharded
optimizer update that keeps the old state where the loss or gradient norm is not finite. Parameters
of any shape work: their padding stays inside the state. `Trainer` is built on the same `prepare`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from zerojax.adapt import checks, model_kind
from zerojax.adapt.model_rows import check_model_splits
from zerojax.core import offload as offload_lib
from zerojax.core import trainable as trainable_lib
from zerojax.core import trees
from zerojax.core.layout import StateLayout, make_layout
from zerojax.core.loss import cross_entropy, global_loss
from zerojax.core.mesh import check_tensor_used
from zerojax.core.optim import pads_exactly
from zerojax.core.state import TrainState, run_key
from zerojax.core.trees import filled
from zerojax.engines import GatherReport
from zerojax.engines.unit_plan import stack_paths
from zerojax.engines.update import compute_params
from zerojax.errors import UserError
from zerojax.train.choices import with_choices
from zerojax.train.setup import Setup

_KEY_SHAPE = (2,)  # the raw data of a threefry key: the state's `rng`


@dataclass(frozen=True)
class Sharded:
    """Everything built for one (input shape and dtype, key): pure functions and their jitted forms."""

    setup: Setup
    inputs: Any  # the model inputs it was built for: a `jax.ShapeDtypeStruct`, or a pytree of them
    layout: StateLayout
    param_shapes: Any  # the model's logical params, abstract
    state_shardings: TrainState  # a NamedSharding per leaf of each group
    abstract: TrainState  # the state as ShapeDtypeStructs with their shardings
    static: Any  # the model's RNG streams (NNX), replicated; rewritten from the step's key each step
    report: GatherReport  # how the step materialises the compute params
    step: Callable  # (state, batch) -> (state, metrics), pure
    grads: Callable | None  # (state, batch) -> (loss, grads, model_state); None with host offload: use step
    update: Callable | None  # (state, loss, grads, model_state) -> (state, metrics)
    evaluate: Callable  # (state, batch, loss_fn) -> loss in eval mode, pure
    make_state: Callable  # (key, inputs, params=None) -> the fresh state, pure (`init` jits it)
    step_fn: Callable  # jitted step, the state donated
    eval_fn: Callable  # jitted evaluate
    classes: int | None = None  # the output's classes, which the default loss's integer targets index
    # the XLA options `step_fn` is compiled with, for a step jitted by hand (the engine's choice)
    compiler_options: dict[str, str] = dataclasses.field(default_factory=dict)
    # (state) -> None: the model on the first batch's blocks of rows against their rows together,
    # where the step splits the rows (`zerojax.adapt.model_rows`); None where it sees them all
    check_rows: Callable | None = None

    def init(self, key, params=None) -> TrainState:
        """The train state, created inside `jit` directly into its shards (`params`: start from these
        logical weights, e.g. `zerojax.load_params`, instead of `key`; a leaf given as None starts
        from `key`'s init)."""
        if params is not None:
            params = model_kind.given_params(params)
            checks.check_given_params(params, self.param_shapes)
        inputs = trees.zeros(self.inputs)
        state = jax.jit(self.make_state, out_shardings=self.state_shardings)(key, inputs, params)
        if self.check_rows is not None:
            self.check_rows(state)
        return state

    def gather_report(self) -> GatherReport:
        """How the step materialises the compute params, with what the model's traces so far dropped
        from its own shardings (`zerojax.core.model_mesh`)."""
        return dataclasses.replace(self.report, notes=tuple(sorted(self.setup.model_mesh.notes)))

    def shard_batch(self, batch: dict) -> dict:
        """A global batch as `jax.Array`s split over the batch axes; device arrays already so are kept.
        Integer targets outside the output's classes are one `UserError` (read on the host)."""
        if self.classes is not None:
            checks.check_targets(batch, self.classes)
        return self.setup.shard_batch(batch)

    def abstract_state(self) -> TrainState:
        """The state `init` builds, as `jax.ShapeDtypeStruct`s with shardings, less the derived compute
        copy (`restore_state` rebuilds it): what `zerojax.train.checkpoint.restore` reads into."""
        return self.abstract.replace(compute=None)

    def restore_state(self, saved: dict) -> TrainState:
        """The full train state from restored groups: the compute copy derived again from the master.
        Groups laid out for another model, stage or device count are one `UserError`."""
        _check_layout(saved, self.abstract_state().saved())
        state = TrainState.from_saved(saved)
        if self.layout.keeps_compute_copy:
            state = state.replace(compute=self._derived_compute(state))
        if self.check_rows is not None:
            self.check_rows(state)
        return state

    def _derived_compute(self, state: TrainState):
        layout, shardings, host = self.layout, self.state_shardings, self.layout.host_groups

        def derive(state):  # the master streamed in from host memory where it is kept there
            state = offload_lib.place(state, shardings, host, offload_lib.DEVICE)
            compute = layout.derive_compute(state.params)
            if "compute" not in host:
                return compute
            return offload_lib.place(state.replace(compute=compute), shardings, ("compute",), offload_lib.HOST).compute

        return jax.jit(derive, out_shardings=shardings.compute)(state)

    # what a checkpoint's metadata records of the run (`zerojax.train.checkpoint.run_metadata`)
    stage = property(lambda self: self.setup.stage)
    precision = property(lambda self: self.setup.precision)
    mesh = property(lambda self: self.setup.mesh)
    engine = property(lambda self: self.setup.engine.name)


@with_choices
def shard(model, optimizer, batch: dict, *, key=None, **setup) -> Sharded:
    """`Sharded` for `model` trained by `optimizer` on batches shaped like `batch` (`setup`: the keyword
    arguments of `Trainer`: mesh, stage, engine, precision, loss_fn, grad_accum, offload, ...)."""
    chosen = Setup.of(model, optimizer, **setup)
    chosen.check_batch(batch)
    return prepare(chosen, jax.random.key(0) if key is None else key, batch)


def prepare(setup: Setup, key, batch: dict) -> Sharded:
    """Layout, shardings, abstract state, the engine's step and their jitted forms, for `batch`'s inputs."""
    inputs = trees.abstract(batch["inputs"])
    setup, model, param_shapes, model_state_shapes, static_shapes = _traced(setup, key, inputs)
    layout = make_layout(
        setup.mesh,
        setup.stage,
        setup.precision,
        param_shapes,
        replicate_below_bytes=setup.replicate_below_bytes,
        optimizer_pads_exactly=lambda logical, padded: pads_exactly(setup.tx, (logical, padded)),
        stack_paths=_stacks(setup, param_shapes, model_state_shapes, static_shapes, inputs),
        offload=setup.offload,
        hierarchical=setup.options.hierarchical,
        axis_names=model.axis_names(key, inputs) if model.axis_names else None,
        axis_rules=setup.axis_rules,
        trainable=setup.trainable,
    )
    check_tensor_used(layout)
    model_state_shapes = model_state_shapes if jax.tree.leaves(model_state_shapes) else None
    shardings, abstract = _state_shardings(setup, layout, model_state_shapes)
    static = _static(setup, key, inputs, static_shapes, layout)
    classes = _check_model(setup, key, batch, (param_shapes, abstract.model_state or {}, static))
    built = setup.engine.build(
        layout,
        model,
        static,
        setup.loss_fn,
        setup.tx,
        setup.options,
        inputs,
        model_state=model_state_shapes,
        grad_accum=setup.grad_accum,
        schedule=setup.schedule,
    )
    # Host-offloaded groups stream into device memory at the step's start and back out at its end.
    host, compiler_options = layout.host_groups, dict(built.compiler_options)
    step = _checked(offload_lib.streamed(built.step, shardings, host), abstract)
    evaluate = offload_lib.streamed(_eval_loss(setup, layout, static, built.evaluate), shardings, host)
    step_fn, eval_fn = _jitted(step, evaluate, (shardings, setup.batch_sharding), layout, compiler_options)
    return Sharded(
        setup,
        inputs,
        layout,
        param_shapes,
        shardings,
        abstract,
        static,
        built.report,
        step=step,
        grads=None if host else _checked(built.grads, abstract),
        update=None if host else built.update,
        evaluate=evaluate,
        make_state=_make_state(setup, layout, shardings),
        step_fn=step_fn,
        eval_fn=eval_fn,
        classes=classes,
        compiler_options=compiler_options,
        check_rows=_rows_check(setup, layout, static, shardings, batch, param_shapes),
    )


def _rows_check(setup: Setup, layout: StateLayout, static, shardings: TrainState, batch: dict, param_shapes):
    """(state) -> None running `zerojax.adapt.model_rows` on `batch`'s rows where the step splits them
    (`Setup.loss_split`), the params gathered whole in the compute dtype, once per preparation (`init`
    and a later `restore_state` would read the same model on the same rows); None where it does not."""
    split = setup.loss_split
    if split[0] <= 1:
        return None
    inputs = batch["inputs"]
    passed: list[bool] = []  # [True] once the model passed
    size = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(param_shapes))
    param_bytes = size * np.dtype(setup.precision.compute_dtype).itemsize
    forward = offload_lib.streamed(_eval_outputs(setup, layout, static), shardings, layout.host_groups)

    def check(state) -> None:
        if not passed:
            check_model_splits(forward, state, inputs, split, param_bytes)
            passed.append(True)

    return check


def _eval_outputs(setup: Setup, layout: StateLayout, static):
    """`(state, key, inputs, sync) -> outputs` in eval mode on the compute params gathered whole
    (`key`: for a model that draws even in eval mode; `sync`: the axis its BatchNorms average over)."""
    model = setup.model

    def outputs(state, key, inputs, sync):
        params = compute_params(layout, state)
        return model.apply(params, state.model_state or {}, static, inputs, rng=key, train=False, sync=sync)[0]

    return outputs


def _jitted(step, evaluate, in_shardings, layout: StateLayout, compiler_options: dict[str, str]):
    """(step_fn, eval_fn): the step jitted with the state donated and the engine's XLA options, and
    the evaluation."""
    step_fn = jax.jit(
        step,
        in_shardings=in_shardings,
        out_shardings=(in_shardings[0], layout.replicated),
        donate_argnums=0,
        compiler_options=compiler_options or None,
    )
    eval_fn = jax.jit(evaluate, static_argnums=2, in_shardings=in_shardings, out_shardings=layout.replicated)
    return step_fn, eval_fn


def _traced(setup: Setup, key, inputs) -> tuple:
    """The model's init traced once: (the setup trained where `trainable` says, its model, its
    param, model state and static shapes)."""
    shapes = jax.eval_shape(setup.model.init, key, inputs)
    mask = trainable_lib.select(setup.choices.trainable, shapes[0], setup.model.variable_types)
    checks.check_param_dtypes(shapes[0], mask, setup.precision.compute_dtype)
    setup = setup.frozen_where(mask, shapes[0])
    return (setup, setup.model, *shapes)


def _check_model(setup: Setup, key, batch: dict, args) -> int | None:
    """The model and the loss on this batch's shapes, abstractly (`zerojax.adapt.checks`): the output's
    classes where the default loss indexes them with integer targets."""

    def run_model(params, model_state, static, inputs):
        return setup.model.apply(params, model_state, static, inputs, rng=key, train=True)[0]

    default = setup.loss_fn is cross_entropy
    return checks.check_model_and_loss(run_model, args, setup.loss_fn, batch, default, setup.loss_split)


def _checked(fn, abstract: TrainState):
    """`fn(state, ...)` that first checks, when traced, that `state` is laid out as this preparation
    stores it (another model, stage or device count, or logical params in place of stored ones, is one
    `UserError` naming the first leaf that differs)."""

    def run(state, *rest):
        if not isinstance(state, TrainState):
            raise UserError("this state was not made for this model and optimizer: init it from the same zj.shard.")
        _check_layout(state, abstract.replace(compute=state.compute if abstract.compute is None else abstract.compute))
        return fn(state, *rest)

    return run


def _check_layout(state, want) -> None:
    """`state` (a TrainState or its saved groups) has `want`'s structure and stored shapes."""
    if jax.tree.structure(state) != jax.tree.structure(want):  # type: ignore[operator]
        raise UserError("this state was not made for this model and optimizer: init it from the same zj.shard.")
    for (path, got), need in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(want)):
        if tuple(got.shape) != tuple(need.shape):
            raise UserError(
                f"state leaf {jax.tree_util.keystr(path)} is {list(got.shape)}, but this step stores it as "
                f"{list(need.shape)}: the state was made for another model, stage or device count."
            )


def _state_shardings(setup: Setup, layout: StateLayout, model_state_shapes):
    opt_state_shapes = layout.opt_state_shapes(setup.tx)
    shardings = layout.state_shardings(setup.tx, opt_state_shapes).replace(
        rng=layout.replicated, model_state=jax.tree.map(lambda _: layout.replicated, model_state_shapes)
    )
    abstract = layout.abstract_state(setup.tx, opt_state_shapes).replace(
        rng=jax.ShapeDtypeStruct(_KEY_SHAPE, np.uint32, sharding=layout.replicated),
        model_state=jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=layout.replicated), model_state_shapes
        ),
    )
    return shardings, abstract


def _make_state(setup: Setup, layout: StateLayout, shardings: TrainState):
    model, tx, has_model_state = setup.model, setup.tx, shardings.model_state is not None

    def make_state(key, inputs, params=None):
        fresh, model_state, _ = model.init(key, inputs)
        fresh = fresh if params is None else filled(params, fresh)  # a None leaf starts from the init
        state = layout.fresh_state(tx, fresh)  # XLA drops an unused init
        state = state.replace(rng=run_key(key), model_state=model_state if has_model_state else None)
        return offload_lib.place(state, shardings, layout.host_groups, offload_lib.HOST)

    return make_state


def _eval_loss(setup: Setup, layout: StateLayout, static, evaluate):
    """`(state, batch, loss_fn) -> loss` in eval mode (no dropout, BatchNorm's running statistics),
    gathered as the train step's forward gathers where the engine says how."""
    outputs = _eval_outputs(setup, layout, static)

    def eval_loss(state, batch, loss_fn):
        if evaluate is not None:
            return evaluate(state, batch, loss_fn)
        return global_loss(loss_fn(outputs(state, None, batch["inputs"], None), batch))

    return eval_loss


def _stacks(setup: Setup, param_shapes, model_state_shapes, static_shapes, inputs) -> tuple:
    """The param paths whose leaves stack layers on axis 0: the model's declared or `zj.Stacked`
    stacks, or the lifted ones its transforms make (`FunctionalModel.lifted_stacks`)."""
    declared = stack_paths(setup.model, param_shapes, setup.options)
    if declared or setup.model.lifted_stacks is None:
        return declared
    return setup.model.lifted_stacks(param_shapes, model_state_shapes or {}, static_shapes, inputs)


def _static(setup: Setup, key, inputs, static_shapes, layout: StateLayout):
    """The model's RNG streams, replicated (computed only where it has leaves)."""
    if not jax.tree.leaves(static_shapes):
        return static_shapes
    shardings = jax.tree.map(lambda _: layout.replicated, static_shapes)
    init_static = jax.jit(lambda k, x: setup.model.init(k, x)[2], out_shardings=shardings)
    return init_static(key, trees.zeros(inputs))
