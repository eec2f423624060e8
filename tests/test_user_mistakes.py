"""A model, loss or batch that do not fit each other: one `UserError` naming shapes, raised by
`Trainer.init` (or `step`, for a later batch's labels) before anything compiles or trains."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zerojax as zj
from tests.user_code import MLP, FlatMLP, linen_mlp, loss_and_accuracy, per_row_loss
from zerojax.adapt import model_rows
from zerojax.errors import UserError

X = np.ones((8, 12), np.float32)
LABELS = np.arange(8, dtype=np.int32) % 4


def _trainer(model=MLP, loss=None, engine="shard_map"):
    return zj.Trainer(model, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=3, engine=engine, loss_fn=loss)


@pytest.mark.parametrize(
    "model, loss, batch, needles",
    [
        (FlatMLP, None, {"inputs": X, "targets": LABELS}, ["output is float32[8]", "targets are int32[8]"]),
        (MLP, None, {"inputs": X, "targets": LABELS[:, None]}, ["output is float32[8, 4]", "int32[8, 1]"]),
        (MLP, None, {"inputs": X, "targets": LABELS.astype(np.float32)}, ["integer class targets"]),
        (MLP, per_row_loss, {"inputs": X, "targets": LABELS}, ["returned shape [8]"]),
        # the has_aux idiom: read as (total, weight) it would train on loss / accuracy
        (MLP, loss_and_accuracy, {"inputs": X, "targets": LABELS}, ["a tuple of 2 values", "zj.WeightedLoss"]),
        # a dict of metrics (a raw TypeError from inside the step before)
        (
            MLP,
            lambda out, batch: {"loss": out.mean(), "top": out.max()},
            {"inputs": X},
            ["a dict of 2 values ('loss', 'top')"],
        ),
        (
            MLP,
            lambda out, batch: zj.WeightedLoss(out.sum(-1), np.float32(8)),
            {"inputs": X, "targets": LABELS},
            ["a WeightedLoss of shapes [[8], []]"],
        ),
        (
            MLP,
            lambda out, batch: out.sum() + batch["weights"].sum(),
            {"inputs": X, "targets": LABELS},
            ["loss function failed", "KeyError: 'weights'"],
        ),
        (MLP, None, {"inputs": X, "targets": LABELS + 1}, ["a target is 4", "4 output classes"]),
        (MLP, None, {"inputs": {"x": X, "y": X[:4]}, "targets": LABELS}, ["x float32[8, 12], y float32[4, 12]"]),
        (MLP, None, {"inputs": X, "targets": {"a": LABELS}}, ["one integer array", "a int32[8]"]),
        (MLP, None, {"inputs": X, "targets": LABELS - 1}, ["a target is -1"]),
        # every entry is split by rows: one without them raised from inside the sharding
        (MLP, None, {"inputs": X, "targets": LABELS[:4]}, ["batch['targets'] is int32[4]", "inputs' 8 rows"]),
        (MLP, None, {"inputs": X, "targets": LABELS, "step": np.int32(3)}, ["batch['step'] is int32[]"]),
        (MLP, None, {"inputs": X, "targets": LABELS, "source": "shard-0"}, ["batch['source'] is a string"]),
        # (the Python API has no train.batch_size: the message names the batch's rows)
        (MLP, None, {"inputs": X[:6], "targets": LABELS[:6]}, ["a batch of 6 rows is not divisible by the data"]),
    ],
)
@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_a_mistake_is_one_sentence_before_compiling(model, loss, batch, needles, engine):
    with pytest.raises(UserError) as e:
        _trainer(model, loss, engine).init(jax.random.key(0), batch)
    assert "\n" not in str(e.value)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x)


class _NoBase:  # a model class that forgot its base class
    def __init__(self, rngs):
        self.rngs = rngs


@pytest.mark.parametrize(
    "model, needle",
    [
        (_LinenNet, "the Linen class _LinenNet; pass an instance of it, _LinenNet(...)"),
        (_NoBase, "the class _NoBase, which is neither an nnx.Module nor a flax.linen.Module"),
        (nnx.Linear, "model Linear is called as model(rngs=...) to build an NNX module, but it also needs in_features"),
        (lambda: _LinenNet(), "but it takes no rngs"),
        (lambda rngs: 3, "model(rngs) returned a value of type int, not an nnx.Module"),
        (3, "got a value of type int"),
    ],
)
def test_a_model_argument_of_another_kind_is_one_sentence(model, needle):
    """Each raised a raw TypeError or IndexError from inside the model's construction before."""
    with pytest.raises(UserError, match=re.escape(needle)):
        zj.Trainer(model, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8)).init(jax.random.key(0), {"inputs": X})


def test_a_mesh_from_jax_make_mesh_trains_and_one_of_other_axes_is_refused():
    """`jax.make_mesh` gives Explicit axes: stage 3's layout constraints raised JAX's ValueError on them;
    the same devices are taken with Auto axes. Other axis names raised a raw KeyError."""
    explicit = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    trainer = zj.Trainer(MLP, optax.sgd(0.1), mesh=explicit, stage=3)
    assert np.isfinite(float(trainer.step(trainer.init(jax.random.key(0), ROWS), ROWS)[1]["loss"]))
    with pytest.raises(UserError, match=re.escape("the mesh's axes are ('batch',)")):
        zj.Trainer(MLP, optax.sgd(0.1), mesh=jax.make_mesh((8,), ("batch",)))
    with pytest.raises(UserError, match="mesh must be a jax.sharding.Mesh .* got a list"):
        zj.Trainer(MLP, optax.sgd(0.1), mesh=list(jax.devices()))


@pytest.mark.parametrize(
    "options, needle",
    [({"prefetch": "no"}, "prefetch is True or False; got 'no'"), ({"quantize_block": 2.5}, "an integer; got 2.5")],
)
def test_an_engine_option_of_another_type_is_refused(options, needle):
    """A string for a switch was taken as its truth value: "no" turned prefetching on."""
    with pytest.raises(UserError, match=re.escape(needle)):
        zj.Trainer(MLP, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), engine_options=options)


def test_params_are_taken_in_the_forms_flax_hands_them_out():
    """`nnx.state(model, nnx.Param)`, the module itself and a Linen `FrozenDict` were refused as not
    matching; a Linen variables dict still is, naming the path that differs."""
    from flax.core import freeze

    built = MLP(rngs=nnx.Rngs(1))
    trainer = zj.Trainer(MLP, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=3)
    want = nnx.to_pure_dict(nnx.state(built, nnx.Param))
    for given in (nnx.state(built, nnx.Param), nnx.state(built), built):
        state = trainer.init(jax.random.key(0), ROWS, params=given)  # leaves under 2 KiB: kept whole
        jax.tree.map(np.testing.assert_array_equal, state.params, want)
    linen = zj.Trainer(linen_mlp(), optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8))
    variables = linen_mlp().init(jax.random.key(1), ROWS["inputs"])
    linen.init(jax.random.key(0), ROWS, params=freeze(variables["params"]))
    with pytest.raises(UserError, match=re.escape("the model's 'Dense_0/bias' is not among them (they have 'params/")):
        linen.init(jax.random.key(0), ROWS, params=variables)


def test_a_mask_built_from_an_nnx_state_says_how_to_build_it():
    """As with nnx.Optimizer, a weight-decay mask made from `nnx.state(model)`: its container is not
    the plain dict the optimizer is handed, which the sentence now says, with the ways that work."""
    mask = jax.tree.map(lambda x: x.ndim > 1, nnx.state(MLP(rngs=nnx.Rngs(0)), nnx.Param))
    trainer = zj.Trainer(MLP, optax.adamw(1e-2, mask=mask), mesh=zj.make_mesh(fsdp=8))
    with pytest.raises(UserError, match=re.escape("build it from nnx.to_pure_dict(...) or a plain dict")):
        trainer.init(jax.random.key(0), ROWS)
    pure = zj.Trainer(MLP, optax.adamw(1e-2, mask=nnx.to_pure_dict(mask)), mesh=zj.make_mesh(fsdp=8))
    pure.init(jax.random.key(0), ROWS)


def test_a_batch_the_step_cannot_train_on_is_refused_at_its_step():
    """`init` needs only the inputs' shapes; a step needs targets, and labels within the classes."""
    trainer = _trainer()
    state = trainer.init(jax.random.key(0), {"inputs": X})
    with pytest.raises(UserError, match=r"the batch has no 'targets' key .* it has \['inputs'\]"):
        trainer.step(state, {"inputs": X})
    with pytest.raises(UserError, match="a target is 7, outside the model's 4 output classes"):
        trainer.step(state, {"inputs": X, "targets": LABELS + 4})
    sharded = trainer.shard_batch({"inputs": X, "targets": LABELS + 4})  # device arrays: read from the shards
    with pytest.raises(UserError, match="a target is 7"):
        trainer.step(state, sharded)


@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_evaluate_refuses_a_bare_tuple_and_takes_a_weighted_loss(engine):
    """`evaluate`'s metric is read as the step's loss is: a bare pair is refused, not divided; a
    `WeightedLoss` is sum(total) / sum(weight) over the global batch, one row per device here."""
    trainer = _trainer(engine=engine)
    w = np.arange(8, dtype=np.float32)
    batch = {"inputs": X * np.linspace(-1, 1, 8, dtype=np.float32)[:, None], "targets": LABELS, "w": w}
    state = trainer.init(jax.random.key(0), batch)
    with pytest.raises(UserError, match="a tuple of 2 values"):
        trainer.evaluate(state, batch, loss_fn=loss_and_accuracy)
    weighted = trainer.evaluate(state, batch, loss_fn=lambda o, b: zj.WeightedLoss(o[:, 0] @ b["w"], b["w"].sum()))
    mean_of_products = trainer.evaluate(state, batch, loss_fn=lambda o, b: (o[:, 0] * b["w"]).mean())
    assert float(weighted) == pytest.approx(float(mean_of_products) * 8 / w.sum(), rel=1e-5)
    assert float(weighted) != pytest.approx(float(mean_of_products), rel=1e-3)  # the weights mattered


def test_streams_named_for_an_nnx_model_are_refused():
    """`rng_streams` keys a Linen model's `make_rng` streams; an NNX model keys all of its own, so a
    name given for one would do nothing."""
    with pytest.raises(UserError, match=r"rng_streams \('noise',\) names a Linen model's make_rng streams"):
        zj.Trainer(MLP, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), rng_streams=("noise",))


def _contrastive(out, batch):  # each row's positive is itself, every other row of the batch a negative
    return optax.softmax_cross_entropy_with_integer_labels(out @ out.T, np.arange(out.shape[0])).mean()


def _masked_mean(out, batch):  # a mean over the unmasked rows of the whole batch, returned as a scalar
    ce = optax.softmax_cross_entropy_with_integer_labels(out, batch["targets"])
    return (ce * batch["mask"]).sum() / batch["mask"].sum()


ROWS = {  # 16 rows: two micro-batches of one row per device
    "inputs": np.random.default_rng(0).normal(size=(16, 12)).astype(np.float32),
    "targets": np.arange(16, dtype=np.int32) % 4,
    "mask": np.array([1, 1, 0, 1, 1, 1, 1, 0] * 2, np.float32),
}


@pytest.mark.parametrize(
    "loss, engine, accumulate, needles",
    [
        (
            _contrastive,
            "shard_map",
            1,
            ["shard_map engine runs the model and the loss on each device's rows", "over 8 blocks of 2"],
        ),
        (_masked_mean, "shard_map", 1, ["does not add up over rows", "zj.WeightedLoss(total, weight)"]),
        (_contrastive, "gspmd", 2, ["gradient accumulation runs the model and the loss on each micro-batch"]),
        (
            _contrastive,
            "gspmd",
            1,
            ["keeping the gathered weights, gspmd runs the model and the loss on each data-parallel"],
        ),
    ],
)
def test_a_loss_that_does_not_add_up_over_rows_is_refused_where_the_step_splits_them(loss, engine, accumulate, needles):
    """Called on each device's rows, each micro-batch's, or (stage 3 keeping its gathered weights)
    each data-parallel group's, such a loss would train on another loss, whose value changes with
    the device count; gspmd without accumulation calls it on the whole batch and takes it."""

    def trainer(engine, k, **options):
        return zj.Trainer(
            MLP,
            optax.sgd(0.1),
            mesh=zj.make_mesh(fsdp=8),
            stage=3,
            engine=engine,
            loss_fn=loss,
            grad_accum=k,
            engine_options=options,
        )

    keep = engine == "gspmd" and accumulate == 1  # stage 3 keeping its weights runs once per group
    with pytest.raises(UserError) as e:
        trainer(engine, accumulate, reshard_after_forward=not keep).init(jax.random.key(0), ROWS)
    assert "\n" not in str(e.value)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
    trainer("gspmd", 1).init(jax.random.key(0), ROWS)


class _Centred(nnx.Module):
    """Subtracts its batch's mean: an output row depends on every row it is run with."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(12, 16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x - x.mean(0, keepdims=True))))


class _LinenCentred(nn.Module):
    """Dropout on when given a key (`has_rng`): the probe runs it as evaluation does, without one."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dropout(0.1, deterministic=not self.has_rng("dropout"))(x - x.mean(0, keepdims=True))
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


@pytest.mark.parametrize(
    "model, engine, accumulate, needles",
    [
        (
            _Centred,
            "shard_map",
            1,
            ["shard_map engine runs the model and the loss on each device's rows, but", "in 8 blocks of 2"],
        ),
        (_LinenCentred(), "gspmd", 2, ["gradient accumulation runs the model", "100% of 8 rows", "in 8 blocks of 1"]),
        (_LinenCentred(), "shard_map", 1, ["100% of 16 rows"]),
    ],
)
def test_a_model_that_mixes_rows_is_refused_where_the_step_splits_them(model, engine, accumulate, needles):
    """Run on each device's rows, or each data-parallel group's when accumulating, a model that
    subtracts its batch's mean computes another function, silently; gspmd without accumulation runs
    it on the whole batch and takes it (losses equal to stage 0's: test_real_models)."""
    with pytest.raises(UserError) as e:
        zj.Trainer(
            model, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=1, engine=engine, grad_accum=accumulate
        ).init(jax.random.key(0), ROWS)
    assert "\n" not in str(e.value)
    for needle in [*needles, "output for a row depends on the batch's other rows", "zero.engine=gspmd"]:
        assert needle in str(e.value), (needle, str(e.value))
    zj.Trainer(model, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=1).init(jax.random.key(0), ROWS)


class _BatchStatistics(nnx.Module):
    """BatchNorm on its batch's statistics in every mode, which the engines average over devices."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(12, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.norm(self.hidden(x), use_running_average=False)))


class _Routed(nnx.Module):
    """Top-2 gates over 16 experts, and their load over the batch beside the logits: per-row outputs
    the jaxpr read flags (a gather from activations, a mean over rows) and a load as long as the rows."""

    def __init__(self, rngs: nnx.Rngs):
        self.router = nnx.Linear(12, 16, rngs=rngs)
        self.out = nnx.Linear(12, 4, rngs=rngs)

    def __call__(self, x):
        probs = jax.nn.softmax(self.router(x), -1)
        gates = jnp.take_along_axis(probs, jax.lax.top_k(probs, 2)[1], -1).sum(-1, keepdims=True)
        return self.out(x) * gates, probs.mean(0)


@pytest.mark.parametrize("model", [_BatchStatistics, _Routed])
def test_row_separable_models_the_jaxpr_read_flags_are_measured_and_taken(model, monkeypatch):
    """Blocks run one by one refused the first (52% apart: its BatchNorm was not averaged over them);
    comparing every output, the second (its load, as long as the 16 rows compared)."""
    flagged: list = []
    read = model_rows.may_mix_rows
    monkeypatch.setattr(model_rows, "may_mix_rows", lambda *a: flagged.append(read(*a)) or flagged[-1])
    loss = (
        (lambda out, batch: optax.softmax_cross_entropy_with_integer_labels(out[0], batch["targets"]).mean())
        if (model is _Routed)
        else None
    )
    trainer = zj.Trainer(model, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=3, engine="shard_map", loss_fn=loss)
    trainer.init(jax.random.key(0), ROWS)
    assert flagged == [True]  # so measured, and taken


class _Half(nnx.Module):
    """Computes in bf16, as Flax's `dtype=` asks: its outputs (logits) are bf16."""

    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(12, 4, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def test_a_bf16_models_mean_loss_adds_up_over_rows():
    """Measured in fp32: a bf16 output's rounding is not a loss that mixes rows (drawn in bf16, this
    mean of squares is 0.9727 over the 64 rows and 0.9717 combined over 8 blocks)."""
    trainer = zj.Trainer(
        _Half, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), engine="shard_map", loss_fn=lambda o, b: jnp.mean(o**2)
    )
    trainer.init(jax.random.key(0), {"inputs": np.random.default_rng(1).normal(size=(64, 12)).astype(np.float32)})


def test_bf16_logits_take_the_default_loss():
    """The default loss's check took bfloat16, which NumPy does not count as floating, for no float
    at all, and refused the model ("needs one float array of logits; it returned bfloat16[16, 4])."""
    trainer = zj.Trainer(_Half, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), engine="shard_map")
    state = trainer.init(jax.random.key(0), ROWS)
    assert np.isfinite(float(trainer.step(state, ROWS)[1]["loss"]))


class _Held(nnx.Module):
    """A parameter of the given dtype beside a Linear: a Fourier layer's complex weights, a frozen
    quantized (integer) table."""

    def __init__(self, dtype, rngs: nnx.Rngs):
        self.held = nnx.Param(jnp.arange(12 * 4).reshape(12, 4).astype(dtype))
        self.out = nnx.Linear(12, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(x) + jnp.real(x @ self.held[...].astype(jnp.result_type(self.held[...], jnp.float32)))


@pytest.mark.parametrize(
    "dtype, frozen, needle",
    [
        (jnp.complex64, False, "'held' is complex64"),  # its imaginary part was dropped, silently
        (jnp.int8, False, "'held' is int8.*out of `trainable`"),
        (jnp.int32, True, "'held' is int32.*narrower integer type"),  # values past 2**24 round in fp32
    ],
)
def test_a_parameter_the_state_cannot_hold_exactly_is_refused(dtype, frozen, needle):
    trainable = (lambda path, leaf: path != "held") if frozen else None
    trainer = zj.Trainer(
        lambda rngs: _Held(dtype, rngs), optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), trainable=trainable
    )
    with pytest.raises(UserError, match=needle):
        trainer.init(jax.random.key(0), ROWS)


def test_a_frozen_int8_table_is_held_exactly():
    trainer = zj.Trainer(
        lambda rngs: _Held(jnp.int8, rngs),
        optax.sgd(0.1),
        mesh=zj.make_mesh(fsdp=8),
        precision="bf16",
        trainable=lambda path, leaf: path != "held",
    )
    state = trainer.init(jax.random.key(0), ROWS)
    np.testing.assert_array_equal(np.asarray(state.params["held"], np.float32), np.arange(48).reshape(12, 4))


def _f1(out, batch):  # class 0's F1 over the batch: a ratio of counts, not a mean over rows
    predicted, actual = out.argmax(-1) == 0, batch["targets"] == 0
    hits = (predicted & actual).sum()
    return 2 * hits / (predicted.sum() + actual.sum() + 1e-9)


@pytest.mark.parametrize("engine, stage", [("shard_map", 3), ("shard_map", 0), ("gspmd", 3)])
def test_evaluate_refuses_a_metric_that_does_not_add_up_over_the_devices_rows(engine, stage):
    """`shard_map` at stage 3 evaluates a metric on each device's rows: an F1 averaged over devices is
    not the batch's F1. Every other step evaluates the whole batch and takes it; a `WeightedLoss`
    accuracy adds up everywhere."""
    trainer = zj.Trainer(MLP, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=stage, engine=engine)
    state = trainer.init(jax.random.key(0), ROWS)
    accuracy = trainer.evaluate(
        state, ROWS, loss_fn=lambda o, b: zj.WeightedLoss((o.argmax(-1) == b["targets"]).sum(), b["targets"].size)
    )
    assert 0 <= float(accuracy) <= 1
    if (engine, stage) != ("shard_map", 3):
        assert 0 <= float(trainer.evaluate(state, ROWS, loss_fn=_f1)) <= 1
        return
    with pytest.raises(UserError, match="at stage 3 the shard_map engine evaluates on each device's rows, but"):
        trainer.evaluate(state, ROWS, loss_fn=_f1)
