"""Every optax optimizer a user writes: the state's layout comes from whatever pytree `tx.init` returns
(`MaskedNode`s of `masked` / `multi_transform`, `EmptyState`, scalars, Adafactor's factored statistics,
`inject_hyperparams`' hyperparameters, `MultiSteps`' accumulators), and each trains at every stage in
both engines as it does at stage 0."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.host_copies import trained
from tests.models import UnevenMLP, classification_batch

STEPS = 3


def _path(path) -> str:
    return jax.tree_util.keystr(path)


def _kernels(params):  # optax.masked's mask: only the weight matrices train with Adam
    return jax.tree_util.tree_map_with_path(lambda p, _: "kernel" in _path(p), params)


def _labels(params):  # optax.multi_transform's labels: the output layer is frozen
    return jax.tree_util.tree_map_with_path(lambda p, _: "frozen" if "out" in _path(p) else "train", params)


OPTIMIZERS = {
    "masked": lambda: optax.masked(optax.adam(1e-2), _kernels),
    "multi_transform": lambda: optax.multi_transform(
        {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, _labels
    ),
    "adafactor": lambda: optax.adafactor(1e-2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(), optax.scale(-1e-2)),
    "nested": lambda: optax.chain(
        optax.masked(
            optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, _labels), _kernels
        ),
        optax.add_decayed_weights(1e-4),
    ),
}


@functools.cache
def _run(name: str, stage: int, engine: str):
    trainer = zj.Trainer(UnevenMLP, OPTIMIZERS[name](), mesh=zj.make_mesh(fsdp=8), stage=stage, engine=engine)
    return trained(trainer, classification_batch, STEPS)


def _reference(name: str):
    return _run(name, 0, "gspmd")


# Default: the optimizers whose state is not one array per parameter at stage 3 in the explicit engine,
# and the deepest nesting at stage 2 in gspmd; the rest of the matrix under -m slow.
DEFAULT = {(n, 3, "shard_map") for n in ("masked", "multi_transform", "adafactor", "MultiSteps", "nested")}
DEFAULT |= {("nested", 2, "gspmd")}


@pytest.mark.parametrize(
    "name, stage, engine",
    [
        (n, s, e) if (n, s, e) in DEFAULT else pytest.param(n, s, e, marks=pytest.mark.slow)
        for n in OPTIMIZERS
        for s in (0, 1, 2, 3)
        for e in ("gspmd", "shard_map")
        if (s, e) != (0, "gspmd")
    ],
)
def test_an_optax_optimizer_trains_at_every_stage_like_stage_0(name, stage, engine):
    losses, _, final = _run(name, stage, engine)
    want_losses, _, want_final = _reference(name)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), final, want_final)


def test_multi_transform_set_to_zero_keeps_the_frozen_leaves_bit_for_bit():
    losses, initial, final = _run("multi_transform", 3, "shard_map")
    np.testing.assert_array_equal(final["out"]["kernel"], initial["out"]["kernel"])
    np.testing.assert_array_equal(final["out"]["bias"], initial["out"]["bias"])
    assert not np.array_equal(final["hidden"]["kernel"], initial["hidden"]["kernel"])
    assert losses[-1] < losses[0]


def test_masked_moments_shard_like_their_parameters_and_masked_leaves_hold_nothing():
    trainer = zj.Trainer(UnevenMLP, OPTIMIZERS["masked"](), mesh=zj.make_mesh(fsdp=8), stage=3)
    state = trainer.abstract_state(jax.random.key(0), classification_batch())
    adam = state.opt_state.inner_state[0]
    assert adam.mu["hidden"]["kernel"].sharding.spec == state.params["hidden"]["kernel"].sharding.spec
    assert adam.mu["hidden"]["kernel"].shape == state.params["hidden"]["kernel"].shape == (37, 136)
    assert isinstance(adam.mu["hidden"]["bias"], optax.MaskedNode)  # a masked-out leaf: no bytes at all
    assert adam.count.sharding.spec == jax.sharding.PartitionSpec()


def test_an_optimizer_whose_init_fails_is_one_sentence():
    def bad_labels(params):
        return {"hidden": "train"}  # not the params' structure

    tx = optax.multi_transform({"train": optax.adam(1e-2)}, bad_labels)
    trainer = zj.Trainer(UnevenMLP, tx, mesh=zj.make_mesh(fsdp=8), stage=3)
    with pytest.raises(zj.UserError, match="the optimizer's init failed on the model's parameters"):
        trainer.init(jax.random.key(0), classification_batch())
    with pytest.raises(zj.UserError, match="must be an optax GradientTransformation.*call the factory"):
        zj.Trainer(UnevenMLP, optax.adam, mesh=zj.make_mesh(fsdp=8))


def _plateau():  # gradient ascent: the loss rises every step, so the rate must come down
    return optax.chain(optax.sgd(-1.0), optax.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=1))


@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
def test_reduce_on_plateau_reads_each_steps_loss(engine):
    """`reduce_on_plateau` takes the loss as `value=`, as a user's own loop passes it: at stage 3 its
    state is the one the step's global losses give it, fed by hand, and it lowered the rate (before,
    the update was called without `value`: a TypeError)."""
    trainer = zj.Trainer(UnevenMLP, _plateau(), mesh=zj.make_mesh(fsdp=8), stage=3, engine=engine)
    batch = classification_batch()
    state = trainer.init(jax.random.key(0), batch)
    losses = []
    for _ in range(6):
        state, metrics = trainer.step(state, batch)
        losses.append(metrics["loss"])
    by_hand = optax.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=1)
    want = by_hand.init(None)
    for loss in losses:
        _, want = by_hand.update(None, want, value=loss)
    got = state.opt_state[1]
    for field in ("scale", "best_value", "plateau_count", "count"):
        assert float(getattr(got, field)) == float(getattr(want, field)), field
    assert float(got.scale) < 1.0  # the rate did come down


def test_an_optimizer_whose_update_fails_is_one_sentence():
    """`optax.lookahead` wants its own params type: one sentence before anything compiles."""
    trainer = zj.Trainer(UnevenMLP, optax.lookahead(optax.adam(1e-2), 2, 0.5), mesh=zj.make_mesh(fsdp=8), stage=3)
    with pytest.raises(zj.UserError, match=r"the optimizer's update failed .*AttributeError.*'fast'"):
        trainer.init(jax.random.key(0), classification_batch())
