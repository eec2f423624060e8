"""The Trainer's structure: one typed state, one preparation per (input shape, key), no hidden
retrace, engine options checked against the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.models import UnevenMLP, classification_batch, tiny_gpt, token_batch
from zerojax.core.state import TrainState
from zerojax.engines import EngineOptions, get_engine


def _trainer(model=UnevenMLP, **kwargs):
    kwargs.setdefault("mesh", zj.make_mesh(fsdp=8))
    return zj.Trainer(model, optax.adamw(1e-3), **kwargs)


def test_state_is_a_typed_pytree_with_saved_groups():
    trainer = _trainer(stage=1, precision="bf16")
    state = trainer.init(jax.random.key(0), classification_batch(0))
    assert isinstance(state, TrainState) and state.compute is not None  # bf16 below stage 3 keeps a copy
    assert state.rng.shape == (2,) and state.rng.dtype == jnp.uint32  # the run's key, as raw key data
    assert state.model_state is None  # an MLP has no BatchNorm statistics: no group
    assert list(state.saved()) == ["step", "params", "opt_state", "rng"]  # compute is derived, not saved
    assert jax.tree.structure(state) == jax.tree.structure(trainer.state_shardings)
    stage3 = _trainer(stage=3, precision="bf16").init(jax.random.key(0), classification_batch(0))
    assert stage3.compute is None  # stage 3 casts its shard before gathering: no persistent copy


def test_model_init_is_traced_once_per_preparation():
    trainer = _trainer()
    traced = []
    init = trainer.model.init
    object.__setattr__(trainer.model, "init", lambda k, x: traced.append(x.shape) or init(k, x))
    batch = classification_batch(0)
    abstract = trainer.abstract_state(jax.random.key(0), batch)
    assert len(traced) == 1  # one abstract trace: layout, shardings and state shapes from it
    assert trainer.abstract_state(jax.random.key(0), batch) is not None and len(traced) == 1
    with pytest.raises(RuntimeError, match="init"):  # abstract_state made nothing current
        trainer.step(abstract, batch)
    state = trainer.init(jax.random.key(0), batch)
    assert len(traced) == 2  # the real init, inside jit; the preparation is reused
    assert jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), abstract) == jax.tree.map(
        lambda a: (a.shape, a.dtype, a.sharding), state.replace(compute=None)
    )


def test_step_refuses_other_shapes_instead_of_retracing():
    trainer = _trainer()
    state = trainer.init(jax.random.key(0), classification_batch(0))
    state, _ = trainer.step(state, classification_batch(1))
    with pytest.raises(zj.UserError, match="prepared for"):
        trainer.step(state, classification_batch(1, rows=32))


def test_options_an_engine_does_not_support_are_refused():
    from zerojax import engines

    engines.register("plain", lambda *a, **k: None, supports=("wrap",))
    try:
        with pytest.raises(
            zj.UserError,
            match="plain engine does not support the option prefetch=True; engines that do: gspmd, shard_map",
        ):
            _trainer(engine="plain", engine_options={"prefetch": True})
    finally:
        engines.unregister("plain")
    gpt, _ = tiny_gpt()
    with pytest.raises(zj.UserError, match="gspmd engine prefetches FSDP units only.*shard_map"):
        _trainer(gpt, engine="gspmd", stage=3, engine_options={"prefetch": True}).init(
            jax.random.key(0), token_batch(0)
        )
    with pytest.raises(zj.UserError, match="unknown engine option 'prefech'"):
        _trainer(engine="shard_map", engine_options={"prefech": True})
    with pytest.raises(zj.UserError, match="zero.engine must be one of gspmd, shard_map"):
        get_engine("pipeline")
    assert EngineOptions.of({"layer_stacks": ["blocks"]}).layer_stacks == ("blocks",)


@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
def test_report_and_lowering_are_public(engine):
    model, _ = tiny_gpt()
    trainer = _trainer(model, stage=3, engine=engine)
    batch = token_batch(0)
    state = trainer.init(jax.random.key(0), batch)
    assert trainer.gather_report().route == "layers"
    assert "func.func public @main" in trainer.lower(state, batch).as_text()
    abstract = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in batch.items()}
    assert trainer.lower(trainer.abstract_state(jax.random.key(0), batch), abstract).as_text()


def _poisoned_step(checked: bool, engine: str):
    """One step of a transformation that turns finite gradients into a NaN update (a schedule gone
    NaN): (bad_step, whether the new params are finite, the params unchanged, the next step's
    bad_step)."""
    tx = optax.chain(optax.sgd(1e-2), optax.scale(jnp.nan))
    trainer = zj.Trainer(
        UnevenMLP, tx, mesh=zj.make_mesh(fsdp=8), stage=1, engine=engine, engine_options={"checked_update": checked}
    )
    state = trainer.init(jax.random.key(0), classification_batch(0))
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    state, metrics = trainer.step(state, classification_batch(0))
    after = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    _, following = trainer.step(state, classification_batch(1))
    return (
        int(metrics["bad_step"]),
        all(np.isfinite(x).all() for x in after),
        all((a == b).all() for a, b in zip(after, before)),
        int(following["bad_step"]),
    )


@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
def test_checked_update_refuses_a_non_finite_new_state_the_default_does_not_check(engine):
    """The one-pass default judges the step by its loss and gradient norm, both finite here, so it
    writes the NaN update (the next step's loss is then non-finite and refused); `checked_update`
    also checks the new state and keeps the old one."""
    assert _poisoned_step(True, engine) == (1, True, True, 1)
    assert _poisoned_step(False, engine) == (0, False, False, 1)


def test_a_model_takes_rngs_by_keyword_or_position_as_flax_writes_it():
    """A class or factory with `*, rngs` (Flax's style), a positional `rngs`, a `functools.partial` of
    either, and an instance: each builds the same params."""
    import functools

    from flax import nnx

    from zerojax.adapt.model import functional

    class ByKeyword(nnx.Module):
        def __init__(self, width: int = 8, *, rngs: nnx.Rngs):
            self.fc = nnx.Linear(4, width, rngs=rngs)

    class ByPosition(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, width: int = 8):
            self.fc = nnx.Linear(4, width, rngs=rngs)

    def factory(*, rngs):
        return ByKeyword(rngs=rngs)

    shapes = []
    for model in (
        ByKeyword,
        ByPosition,
        factory,
        functools.partial(ByKeyword, width=8),
        functools.partial(ByPosition, width=8),
        ByKeyword(rngs=nnx.Rngs(0)),
    ):
        params = jax.eval_shape(functional(model).init, jax.random.key(0), None)[0]
        shapes.append(jax.tree.map(lambda x: x.shape, params))
    assert all(s == {"fc": {"kernel": (4, 8), "bias": (8,)}} for s in shapes), shapes
