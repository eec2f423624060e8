"""Models with Dropout, BatchNorm and RNG streams, train/eval mode, weighted losses and optimizers
that are not elementwise: the same losses at every stage, in both engines."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zerojax as zj
from tests.models import UnevenMLP, classification_batch
from tests.user_code import NoisyLinen
from zerojax.core.optim import pads_exactly
from zerojax.interop.params import export_params
from zerojax.train.checkpoint import CheckpointWriter, restore, run_metadata
from zerojax.train.params_file import load_model_state, load_params

KEY = jax.random.key(0)
ENGINES = ("gspmd", "shard_map")


class DropNet(nnx.Module):
    """Uneven widths (37 -> 43 -> 10), BatchNorm and Dropout in a repeated block (an FSDP unit)."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.3):
        self.blocks = nnx.List([_Block(37, rngs, rate) for _ in range(2)])
        self.bn = nnx.BatchNorm(37, rngs=rngs)
        self.out = nnx.Linear(37, 10, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(self.bn(x))


class _Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs, rate: float):
        self.hidden = nnx.Linear(width, 43, rngs=rngs)
        self.bn = nnx.BatchNorm(43, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.back = nnx.Linear(43, width, rngs=rngs)

    def __call__(self, x):
        return x + self.back(self.drop(jax.nn.relu(self.bn(self.hidden(x)))))


class LinenDropNet(nn.Module):
    rate: float = 0.3

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(43)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(self.rate, deterministic=not train)(jax.nn.relu(x))
        return nn.Dense(10)(nn.relu(nn.Dense(29)(x)))


def _bn_net(rngs):
    return DropNet(rngs, rate=0.0)


def _models():
    return {"nnx": DropNet, "linen": LinenDropNet()}


def _run(model, *, stage, engine, steps, batch, tx=None, mesh=None, loss_fn=None):
    trainer = zj.Trainer(
        model, tx or optax.adam(1e-2), stage=stage, engine=engine, mesh=mesh or zj.make_mesh(fsdp=8), loss_fn=loss_fn
    )
    state = trainer.init(KEY, batch)
    losses = []
    for _ in range(steps):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


# One model per engine in the default suite, the other pair under -m slow.
_PAIRS = [
    ("nnx", "shard_map"),
    ("linen", "gspmd"),
    pytest.param("nnx", "gspmd", marks=pytest.mark.slow),
    pytest.param("linen", "shard_map", marks=pytest.mark.slow),
]


# Stage 1 (stage 2 without the in-loop scatter) under -m slow, with the other engine of each model.
@pytest.mark.parametrize(
    "kind,engine,stages",
    [(*p, (2, 3)) for p in _PAIRS[:2]]
    + [pytest.param(*p, (1,), marks=pytest.mark.slow) for p in _PAIRS[:2]]
    + [pytest.param(*p.values, (1, 2, 3), marks=pytest.mark.slow) for p in _PAIRS[2:]],
)
def test_dropout_and_batchnorm_train_with_the_same_losses_at_every_stage(kind, engine, stages):
    batch = classification_batch(0)
    model = _models()[kind]
    trainer, state, base = _run(model, stage=0, engine=engine, steps=10, batch=batch)
    assert base[-1] < base[0]
    assert state.model_state is not None and "batch_stats" in state.model_state
    for stage in stages:
        _, _, losses = _run(model, stage=stage, engine=engine, steps=10, batch=batch)
        np.testing.assert_allclose(losses, base, rtol=1e-5, atol=1e-5, err_msg=f"{kind} {engine} stage {stage}")


@pytest.mark.parametrize("kind,engine", _PAIRS)
def test_dropout_is_active_in_training_and_off_in_evaluation(kind, engine):
    batch = classification_batch(0)
    trainer, state, losses = _run(_models()[kind], stage=3, engine=engine, steps=4, batch=batch, tx=optax.sgd(0.0))
    assert len(set(losses)) == len(losses), losses  # lr 0: only the masks (and BatchNorm) change the loss
    first, second = float(trainer.evaluate(state, batch)), float(trainer.evaluate(state, batch))
    assert first == second
    assert first not in losses


@pytest.fixture(scope="module")
def bn_one_device_losses():
    one = zj.make_mesh(devices=jax.devices()[:1])
    return _run(_bn_net, stage=0, engine="gspmd", steps=3, batch=classification_batch(0), mesh=one)[2]


@pytest.mark.parametrize(
    "stage", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3]
)
def test_batchnorm_statistics_are_over_the_global_batch(stage, bn_one_device_losses):
    """No dropout: both engines at each stage on 8 devices give 1 device's losses."""
    for engine in ENGINES:
        _, _, losses = _run(_bn_net, stage=stage, engine=engine, steps=3, batch=classification_batch(0))
        np.testing.assert_allclose(
            losses, bn_one_device_losses, rtol=1e-5, atol=1e-5, err_msg=f"{engine} stage {stage}"
        )


def test_gspmd_dropout_masks_do_not_depend_on_the_device_count():
    """gspmd draws over the global batch (threefry partitionable): 1 and 8 devices agree with dropout
    on; shard_map draws per device, so its masks depend on the device count (documented)."""
    batch = classification_batch(0)
    _, _, one = _run(
        DropNet, stage=0, engine="gspmd", steps=3, batch=batch, mesh=zj.make_mesh(devices=jax.devices()[:1])
    )
    _, _, eight = _run(DropNet, stage=3, engine="gspmd", steps=3, batch=batch)
    np.testing.assert_allclose(eight, one, rtol=1e-5, atol=1e-5)


def test_linen_batchnorm_statistics_are_over_the_global_batch():
    """Linen's nn.BatchNorm gets the batch axes as its axis_name inside shard_map."""
    batch, model = classification_batch(0), LinenDropNet(rate=0.0)
    one = zj.make_mesh(devices=jax.devices()[:1])
    _, _, base = _run(model, stage=0, engine="gspmd", steps=3, batch=batch, mesh=one)
    for engine in ENGINES:
        for stage in (0, 3):
            _, _, losses = _run(model, stage=stage, engine=engine, steps=3, batch=batch)
            np.testing.assert_allclose(losses, base, rtol=1e-5, atol=1e-5, err_msg=f"{engine} stage {stage}")


class PmapStyleNet(nn.Module):
    """Flax's ImageNet example's BatchNorm: `axis_name='batch'`, the axis of its data-parallel `pmap`;
    `axis_name=None`: the same model as zerojax wants it."""

    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(nn.Dense(43)(x))
        return nn.Dense(10)(nn.relu(x))


class EnsembleNet(nn.Module):
    """BatchNorm statistics shared across an ensemble axis the model's own `nn.vmap` binds."""

    @nn.compact
    def __call__(self, x, train: bool):
        member = nn.vmap(
            PmapStyleNet,
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs={"params": True},
            in_axes=(None, None),
            axis_size=2,
            axis_name="batch",
        )
        return member(name="members")(x, train).mean(0)


def test_a_pmap_style_batchnorm_axis_means_the_global_batch():
    """The unbound 'batch' raised JAX's NameError at init; it is the data-parallel batch, as in
    zerojax's BatchNorms without an axis: the same losses as the model without it, in both engines.
    A name the model's own vmap binds is kept (shard_map stage 0: its rows, averaged over the batch axes
    and the ensemble); an NNX BatchNorm's own axis is one sentence."""
    batch = classification_batch(0)
    for engine, stage in (("gspmd", 0), ("shard_map", 3)):
        _, _, want = _run(PmapStyleNet(axis_name=None), stage=stage, engine=engine, steps=2, batch=batch)
        _, _, losses = _run(PmapStyleNet(), stage=stage, engine=engine, steps=2, batch=batch)
        np.testing.assert_allclose(losses, want, rtol=1e-6, err_msg=engine)
    _, _, base = _run(EnsembleNet(), stage=0, engine="gspmd", steps=2, batch=batch)
    _, _, losses = _run(EnsembleNet(), stage=0, engine="shard_map", steps=2, batch=batch)
    np.testing.assert_allclose(losses, base, rtol=1e-5, atol=1e-5)
    nnx_model = lambda rngs: nnx.Sequential(
        nnx.Linear(37, 8, rngs=rngs), nnx.BatchNorm(8, axis_name="batch", rngs=rngs)
    )  # noqa: E731
    with pytest.raises(zj.UserError, match="reduces over the axis 'batch', which nothing binds here"):
        _run(nnx_model, stage=0, engine="gspmd", steps=1, batch=batch, loss_fn=lambda out, b: out.mean())


class SowingNet(nnx.Module):
    """Flax's intermediates idioms beside BatchNorm: `sow` after its block (an FSDP unit), `perturb`."""

    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([_Block(37, rngs, 0.0)])
        self.out = nnx.Linear(37, 10, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
            self.sow(nnx.Intermediate, "features", x)
        return self.out(self.perturb("last", x))


class LinenSowingNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(43)(x))
        self.sow("intermediates", "features", x)
        return nn.Dense(10)(self.perturb("last", nn.relu(x)))


@pytest.mark.parametrize("model", [SowingNet, LinenSowingNet()], ids=["nnx", "linen"])
@pytest.mark.filterwarnings("ignore:Using 'Module:DeprecationWarning")  # Flax's: sow outside nnx.capture
def test_sown_and_perturbed_values_are_not_kept_as_model_state(model):
    """Flax applies a model with only its state, so `sow` and `perturb` do nothing: kept as state
    they changed its structure each call (a raw pytree error) or, shaped like the init batch, met
    each device's rows under shard_map (a raw shape error)."""
    batch = classification_batch(0)
    _, state, base = _run(model, stage=0, engine="gspmd", steps=2, batch=batch)
    assert list(state.model_state) == ["batch_stats"]
    _, state, losses = _run(model, stage=3, engine="shard_map", steps=2, batch=batch)
    assert list(state.model_state) == ["batch_stats"]
    np.testing.assert_allclose(losses, base, rtol=1e-5, atol=1e-5)


def test_batchnorm_statistics_checkpoint_reshard_and_export(tmp_path):
    batch = classification_batch(0)
    trainer, state, _ = _run(DropNet, stage=3, engine="shard_map", steps=3, batch=batch)
    fresh = trainer.init(KEY, batch)
    stats = jax.tree.map(np.asarray, state.model_state)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), stats, jax.tree.map(np.asarray, fresh.model_state))
    assert all(jax.tree.leaves(changed))  # every running mean and variance moved

    # Save, keep training; a restored copy (same stage, then another stage on 4 devices) continues alike.
    state, _ = _run_on(trainer, state, batch, 0)
    writer = CheckpointWriter(str(tmp_path / "ckpt"), keep=1, run_meta=run_metadata(trainer, seed=0))
    writer.save(3, state)
    writer.wait()
    saved = jax.tree.map(np.asarray, state.saved())
    state, after = _run_on(trainer, state, batch, 3)
    writer.close()
    step_dir = str(tmp_path / "ckpt" / "3")
    restored, _ = restore(trainer, step_dir, KEY, batch)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.saved()), saved)
    _, again = _run_on(trainer, restored, batch, 3)
    assert again == after  # dropout keys come from (seed, step): the resumed run is bit-exact

    other = zj.Trainer(
        DropNet, optax.adam(1e-2), stage=1, engine="shard_map", mesh=zj.make_mesh(fsdp=4, devices=jax.devices()[:4])
    )
    moved, _ = restore(other, step_dir, KEY, batch)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, moved.model_state), saved["model_state"])

    out = export_params(step_dir, str(tmp_path / "params.npz"))
    assert out["model_state"] == 6  # 3 BatchNorms x (mean, var)
    with np.load(tmp_path / "params.npz") as npz:
        assert "batch_stats/blocks/0/bn/mean" in npz.files
        np.testing.assert_array_equal(npz["batch_stats/bn/var"], saved["model_state"]["batch_stats"]["bn"]["var"])
    assert "batch_stats" not in load_params(str(tmp_path / "params.npz"))
    np.testing.assert_array_equal(
        load_model_state(str(tmp_path / "params.npz"))["batch_stats"]["bn"]["mean"],
        saved["model_state"]["batch_stats"]["bn"]["mean"],
    )


def _run_on(trainer, state, batch, steps):
    losses = []
    for _ in range(steps):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def _masked_ce(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return zj.WeightedLoss(jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"]))


def test_masked_mean_loss_is_exact_in_both_engines():
    batch = classification_batch(0)
    rng = np.random.default_rng(1)
    batch["mask"] = (rng.random(16) < 0.6).astype(np.float32)
    batch["mask"][:2] = 0  # the first device's two rows are all masked out
    batch["mask"][2] = 1
    model = UnevenMLP(nnx.Rngs(0))
    logits = np.asarray(model(jnp.asarray(batch["inputs"])))
    want = float(_masked_ce(logits, batch)[0] / batch["mask"].sum())
    runs = {}
    for engine in ENGINES:
        for stage in (0, 3):
            _, _, runs[engine, stage] = _run(
                UnevenMLP, stage=stage, engine=engine, steps=5, batch=batch, loss_fn=_masked_ce
            )
            assert abs(runs[engine, stage][0] - want) < 1e-5, (engine, stage, runs[engine, stage][0], want)
    for key, losses in runs.items():
        np.testing.assert_allclose(losses, runs["gspmd", 0], rtol=1e-5, atol=1e-5, err_msg=str(key))


class WideMLP(nnx.Module):
    """A 130 x 131 leaf (factored by Adafactor) and others no fsdp size of 8 divides: all padded."""

    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(37, 130, rngs=rngs)
        self.b = nnx.Linear(130, 131, rngs=rngs)
        self.c = nnx.Linear(131, 10, rngs=rngs)

    def __call__(self, x):
        return self.c(jax.nn.gelu(self.b(jax.nn.gelu(self.a(x)))))


OPTIMIZERS = {
    "adafactor": lambda: optax.adafactor(1e-2),
    "sgd": lambda: optax.sgd(1e-1),
    "momentum": lambda: optax.sgd(1e-1, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize(
    "name",
    [
        "adafactor",
        "adamw",
        pytest.param("sgd", marks=pytest.mark.slow),
        pytest.param("momentum", marks=pytest.mark.slow),
    ],
)
def test_optimizers_are_exact_on_padded_leaves(name):
    batch = classification_batch(0)
    assert pads_exactly(OPTIMIZERS[name]()) == (name != "adafactor")
    engines = ENGINES if name == "adafactor" else ("shard_map",)
    for engine in engines:
        _, _, base = _run(WideMLP, stage=0, engine=engine, steps=8, batch=batch, tx=OPTIMIZERS[name]())
        trainer, _, losses = _run(WideMLP, stage=3, engine=engine, steps=8, batch=batch, tx=OPTIMIZERS[name]())
        assert trainer.layout.leaves["b"]["kernel"].padded  # stored padded; the optimizer sees it whole
        np.testing.assert_allclose(losses, base, rtol=1e-5, atol=1e-5, err_msg=f"{name} {engine}")


def _by_shape(shape_of_the_fast_one):
    """Adam for one leaf, picked by its shape (as a vocabulary-sized embedding is), SGD for the rest."""
    labels = lambda params: jax.tree.map(lambda x: "fast" if x.shape == shape_of_the_fast_one else "slow", params)  # noqa: E731
    return optax.multi_transform({"fast": optax.adam(5e-2), "slow": optax.sgd(1e-3)}, labels)


def test_an_optimizer_choosing_by_leaf_shape_sees_the_logical_shapes():
    """The optimizer saw `b/kernel` padded (130 x 136 for 130 x 131), so a label read from its shape
    picked SGD where Adam was asked for: 96% off stage 0 after three steps, silently. An optimizer
    whose choices move with the padding now sees padded leaves whole; one choosing by `ndim` keeps them padded."""
    batch = classification_batch(0)
    _, _, base = _run(WideMLP, stage=0, engine="gspmd", steps=3, batch=batch, tx=_by_shape((130, 131)))
    trainer, _, losses = _run(WideMLP, stage=3, engine="shard_map", steps=3, batch=batch, tx=_by_shape((130, 131)))
    np.testing.assert_allclose(losses, base, rtol=1e-5, atol=1e-5)
    assert not trainer.layout.opt_leaves["b"]["kernel"].padded
    by_ndim = optax.adamw(1e-2, mask=lambda params: jax.tree.map(lambda x: x.ndim > 1, params))
    trainer = zj.Trainer(WideMLP, by_ndim, mesh=zj.make_mesh(fsdp=8), stage=3)
    assert trainer.prepare(KEY, batch).layout.opt_leaves is None  # the optimizer sees the padded leaves


def test_a_state_laid_out_by_the_padding_resumes_on_another_device_count(tmp_path):
    """`optax.flatten(adam)` updates a padded leaf exactly, but its one flat moment holds every leaf's
    padding (136 columns on 8 devices, 132 on 4): resumed on 4 devices it was read misaligned, the
    losses off by half a percent, silently. Its optimizer now sees the leaves whole."""
    tx = lambda: optax.flatten(optax.adam(1e-2))  # noqa: E731
    assert not pads_exactly(tx())
    batches = [classification_batch(i) for i in range(4)]
    eight = zj.Trainer(UnevenMLP, tx(), mesh=zj.make_mesh(fsdp=8), stage=3)
    state = eight.init(KEY, batches[0])
    for batch in batches[:2]:
        state, _ = eight.step(state, batch)
    writer = CheckpointWriter(str(tmp_path), keep=1, run_meta=run_metadata(eight, seed=0))
    writer.save(2, state)
    writer.wait()
    losses = {}
    four = zj.Trainer(UnevenMLP, tx(), mesh=zj.make_mesh(fsdp=4, devices=jax.devices()[:4]), stage=1)
    for trainer, start in ((eight, state), (four, restore(four, str(tmp_path / "2"), KEY, batches[2])[0])):
        for batch in batches[2:]:
            start, metrics = trainer.step(start, batch)
            losses.setdefault(trainer, []).append(float(metrics["loss"]))
    writer.close()
    np.testing.assert_allclose(losses[four], losses[eight], rtol=1e-6)


class NoisyMLP(nnx.Module):
    """Draws from a user-named stream ("noise") and the "params" stream in its forward pass."""

    def __init__(self, rngs: nnx.Rngs):
        self.rngs = nnx.Rngs(params=rngs.params(), noise=rngs.params())
        self.mlp = UnevenMLP(rngs)

    def __call__(self, x):
        x = (
            x
            + 0.1 * jax.random.normal(self.rngs.noise(), x.shape)
            + 0.01 * jax.random.normal(self.rngs.params(), x.shape)
        )
        return self.mlp(x)


def test_user_named_nnx_streams_are_keyed_per_step_and_equal_across_stages():
    batch = classification_batch(0)
    runs = {
        stage: _run(NoisyMLP, stage=stage, engine="shard_map", steps=3, batch=batch, tx=optax.sgd(0.0))[2]
        for stage in (0, 3)
    }
    assert len(set(runs[0])) == 3  # new noise every step
    np.testing.assert_allclose(runs[3], runs[0], rtol=1e-5, atol=1e-5)


class _MaskedBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x, mask):
        return x + self.dense(x) * mask[:, None]


class TwoInputs(nnx.Module):
    """Two inputs, as a dict; each block (an FSDP unit) takes the activations and the mask."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(12, 16, rngs=rngs)
        self.blocks = nnx.List([_MaskedBlock(rngs) for _ in range(2)])
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, inputs):
        x = self.embed(inputs["x"])
        for block in self.blocks:
            x = block(x, inputs["mask"])
        return self.out(x)


class LinenTwoInputs(nn.Module):
    """The same, in Linen, the inputs a tuple."""

    @nn.compact
    def __call__(self, inputs):
        x, mask = inputs
        x = nn.Dense(16)(x)
        for _ in range(2):
            x = x + nn.Dense(16)(nn.LayerNorm()(x)) * mask[:, None]
        return nn.Dense(4)(x)


def _two_inputs(kind: str) -> dict:
    rng = np.random.default_rng(0)
    x, mask = rng.normal(size=(16, 12)).astype(np.float32), (rng.random(16) < 0.7).astype(np.float32)
    return {
        "inputs": {"x": x, "mask": mask} if kind == "nnx" else (x, mask),
        "targets": np.arange(16, dtype=np.int32) % 4,
    }


@pytest.mark.parametrize("kind, engine", [("nnx", "shard_map"), ("linen", "gspmd")])
def test_a_model_of_several_inputs_trains_like_stage_0(kind, engine):
    """`batch["inputs"]` a pytree of arrays (a dict, a tuple), each with the global batch first: at
    stage 3 with accumulation on data=2 x fsdp=4, the losses and the eval loss are stage 0's."""
    model, batch = (TwoInputs if kind == "nnx" else LinenTwoInputs()), _two_inputs(kind)

    def run(stage, mesh, engine, grad_accum):
        trainer = zj.Trainer(model, optax.adam(1e-2), mesh=mesh, stage=stage, engine=engine, grad_accum=grad_accum)
        state, losses = trainer.init(KEY, batch), []
        for _ in range(3):
            state, metrics = trainer.step(state, batch)
            losses.append(float(metrics["loss"]))
        return losses + [float(trainer.evaluate(state, batch))]

    want = run(0, zj.make_mesh(fsdp=8), "gspmd", 1)
    np.testing.assert_allclose(run(3, zj.make_mesh(data=2, fsdp=4), engine, 2), want, rtol=1e-6)
    assert want[2] < want[0]


def test_a_step_for_several_inputs_lowers_from_shapes_alone():
    """`Trainer.lower` on abstract values (what `zerojax inspect` and the measurements use)."""
    batch = _two_inputs("nnx")
    trainer = zj.Trainer(TwoInputs, optax.adam(1e-2), mesh=zj.make_mesh(fsdp=8), stage=3)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    trainer.init(KEY, batch)
    lowered = trainer.lower(trainer.abstract_state(KEY, shapes), shapes)
    text = lowered.as_text()
    assert "tensor<16x12xf32>" in text and "tensor<16xf32>" in text  # both inputs, whole


def test_an_array_source_of_several_inputs_draws_each_leafs_rows():
    """`ArraySource` takes a pytree of arrays as a value: each leaf's rows are drawn together, and
    leaves of different lengths are one sentence naming them."""
    batch = _two_inputs("nnx")
    source = zj.ArraySource(batch, batch_size=4, seed=3)
    drawn = source.batch(1)
    idx = source.indices(1)
    np.testing.assert_array_equal(drawn["inputs"]["x"], batch["inputs"]["x"][idx])
    np.testing.assert_array_equal(drawn["inputs"]["mask"], batch["inputs"]["mask"][idx])
    np.testing.assert_array_equal(drawn["targets"], batch["targets"][idx])
    short = {**batch, "inputs": {**batch["inputs"], "mask": batch["inputs"]["mask"][:5]}}
    with pytest.raises(zj.UserError, match=r"same number of rows.*inputs\['mask'\]\": 5"):
        zj.ArraySource(short, batch_size=4)


class _Counted(nn.Module):
    """Counts, in its state, the calls made in training mode."""

    @nn.compact
    def __call__(self, x, training: bool):
        calls = self.variable("counts", "training_calls", jnp.zeros, (), jnp.int32)
        if training and not self.is_initializing():
            calls.value += 1
        return nn.Dense(4)(x)


class DropoutGuide(nn.Module):  # Flax's dropout guide spells it `training`
    @nn.compact
    def __call__(self, x, training: bool = False):
        return _Counted()(x, training)


class Deterministic(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        return _Counted()(x, not deterministic)


class IsTraining(nn.Module):
    @nn.compact
    def __call__(self, x, is_training: bool = False):
        return _Counted()(x, is_training)


class Train(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return _Counted()(x, train)


class TrainCalls(nnx.Variable):
    pass


class NnxTrain(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense, self.calls = nnx.Linear(12, 4, rngs=rngs), TrainCalls(jnp.zeros((), jnp.int32))

    def __call__(self, x, train: bool = False):
        if train:
            self.calls[...] += 1
        return self.dense(x)


@pytest.mark.parametrize(
    "model",
    [DropoutGuide(), Deterministic(), IsTraining(), Train(), NnxTrain],
    ids=["training", "deterministic", "is_training", "train", "nnx-train"],
)
def test_a_models_own_mode_argument_is_set_by_name(model):
    """`__call__(self, x, training=False)` (Flax's dropout guide), `deterministic=True`, ...: the step
    calls it in training mode, `evaluate` in evaluation mode. Before, only Linen's `train` was passed,
    and a model with a default trained in evaluation mode, its dropout off, silently."""
    trainer = zj.Trainer(model, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=3)
    batch = {"inputs": np.ones((8, 12), np.float32), "targets": np.arange(8, dtype=np.int32) % 4}
    state = trainer.init(KEY, batch)
    for _ in range(2):
        state, _ = trainer.step(state, batch)
    trainer.evaluate(state, batch)
    assert [int(x) for x in jax.tree.leaves(state.model_state)] == [2]


class CallTimeRngs(nnx.Module):
    """Dropout keyed at call time, as Flax's NNX guides also write it: `self.drop(x, rngs=rngs)`."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden, self.out = nnx.Linear(37, 64, rngs=rngs), nnx.Linear(64, 10, rngs=rngs)
        self.drop = nnx.Dropout(0.5)  # no stream of its own

    def __call__(self, x, *, rngs: nnx.Rngs | None = None):
        return self.out(self.drop(jax.nn.gelu(self.hidden(x)), rngs=rngs))


@pytest.mark.parametrize("engine", ENGINES)
def test_an_nnx_model_taking_rngs_at_call_time_gets_them(engine):
    """zerojax hands it an `nnx.Rngs` keyed from the step's key (before: Flax's raw ValueError, no
    `rngs` for Dropout). With lr 0 only the masks move the loss; stage 3 draws the masks stage 0 does;
    evaluation is deterministic."""
    batch = classification_batch(0)
    trainer, state, losses = _run(CallTimeRngs, stage=3, engine=engine, steps=3, batch=batch, tx=optax.sgd(0.0))
    assert len(set(losses)) == len(losses), losses
    assert _run(CallTimeRngs, stage=0, engine=engine, steps=3, batch=batch, tx=optax.sgd(0.0))[2] == losses
    first = float(trainer.evaluate(state, batch))
    assert first == float(trainer.evaluate(state, batch)) and first not in losses


@pytest.mark.parametrize("engine", ENGINES)
def test_a_linen_stream_the_step_does_not_key_is_one_sentence_and_named_it_trains(engine):
    """`self.make_rng("noise")` without "noise" in `rng_streams`: one `UserError` saying how (before:
    Flax's raw InvalidRngError); named, stage 3 draws stage 0's noise."""
    batch = {"inputs": classification_batch(0)["inputs"][:, :12], "targets": classification_batch(0)["targets"] % 4}
    with pytest.raises(zj.UserError, match=r"stream 'noise'.*rng_streams=\('dropout', 'noise'\)"):
        zj.Trainer(NoisyLinen(), optax.sgd(0.0), mesh=zj.make_mesh(fsdp=8), stage=3, engine=engine).init(KEY, batch)
    losses = {}
    for stage in (0, 3):
        trainer = zj.Trainer(
            NoisyLinen(),
            optax.sgd(0.0),
            mesh=zj.make_mesh(fsdp=8),
            stage=stage,
            engine=engine,
            rng_streams=("dropout", "noise"),
        )
        state, losses[stage] = trainer.init(KEY, batch), []
        for _ in range(2):
            state, metrics = trainer.step(state, batch)
            losses[stage].append(float(metrics["loss"]))
    assert losses[0] == losses[3] and losses[3][0] != losses[3][1], losses  # lr 0: only the noise moves it


class MonteCarloDropout(nn.Module):
    """Dropout in every mode (Monte Carlo dropout): it has no mode argument and always draws."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.Dropout(0.5, deterministic=False)(nn.relu(nn.Dense(16)(x))))


class KeyedDropout(nn.Module):
    """Dropout on exactly when a key is given (`has_rng`), a Linen idiom for a model with no mode argument."""

    rate: float = 0.5

    @nn.compact
    def __call__(self, x):
        hidden = nn.Dropout(self.rate, deterministic=not self.has_rng("dropout"))(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(4)(hidden)


def test_a_linen_model_dropping_out_when_given_a_key_evaluates_without_one():
    """Evaluation passes no key, so such a model evaluates as with no dropout at all."""
    batch = {"inputs": classification_batch(0)["inputs"][:, :12], "targets": classification_batch(0)["targets"] % 4}
    values = []
    for rate in (0.5, 0.0):
        trainer = zj.Trainer(KeyedDropout(rate), optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=3)
        values.append(float(trainer.evaluate(trainer.init(KEY, batch), batch)))
    assert values[0] == values[1], values


def test_a_linen_model_drawing_in_every_mode_trains_and_evaluates():
    """Traced for its structure and evaluated without a key, it raised Flax's raw InvalidRngError;
    each now draws from a key."""
    batch = {"inputs": classification_batch(0)["inputs"][:, :12], "targets": classification_batch(0)["targets"] % 4}
    trainer = zj.Trainer(MonteCarloDropout(), optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=3, engine="shard_map")
    state = trainer.init(KEY, batch)
    state, metrics = trainer.step(state, batch)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(trainer.evaluate(state, batch)))


class NeedsAMask(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        return nn.Dense(4)(x) * mask[:, None]


class PositionalTrain(nn.Module):
    @nn.compact
    def __call__(self, x, train, /):  # positional only: it cannot be passed by name
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(4)(x))


class LinenLayerHook(nn.Module):  # zerojax hands a layer hook to NNX models only
    @nn.compact
    def __call__(self, x, layer_hook):
        return nn.Dense(4)(x)


@pytest.mark.parametrize(
    "model, name", [(NeedsAMask(), "mask"), (PositionalTrain(), "train"), (LinenLayerHook(), "layer_hook")]
)
def test_a_model_argument_zerojax_cannot_fill_is_one_sentence(model, name):
    with pytest.raises(zj.UserError, match=rf"requires {name}, which zerojax cannot fill.*give it a default"):
        zj.Trainer(model, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8)).init(KEY, {"inputs": np.ones((8, 12))})


class InputStats(nnx.Variable):
    pass


class Normalised(nnx.Module):
    """Its own running mean of its inputs (not a BatchNorm), updated in training."""

    def __init__(self, rngs: nnx.Rngs):
        self.mean, self.dense = InputStats(jnp.zeros(12)), nnx.Linear(12, 4, rngs=rngs)

    def __call__(self, x, train: bool = False):
        if train:
            self.mean[...] = 0.9 * self.mean[...] + 0.1 * x.mean(0)
        return self.dense(x - self.mean[...])


def _normalised_run(**kwargs):
    trainer = zj.Trainer(Normalised, optax.adam(1e-2), mesh=zj.make_mesh(fsdp=8), **kwargs)
    batch = classification_batch(features=12)
    batch["targets"] %= 4
    state, losses = trainer.init(KEY, batch), []
    for _ in range(2):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, np.asarray(state.model_state["InputStats"]["mean"])


@pytest.mark.parametrize(
    "kwargs, words, instead",
    [
        ({"engine": "shard_map", "stage": 1}, "engine='shard_map' each device runs the model on its own rows", "gspmd"),
        ({"engine": "gspmd", "stage": 0, "grad_accum": 2}, "once per data-parallel group", "whole_micro_batches=true"),
    ],
)
def test_a_statistic_of_a_devices_rows_alone_is_refused(kwargs, words, instead):
    """A model's own statistic over its rows (not a BatchNorm, whose statistics the engines average)
    would be each device's or group's own under these: one sentence naming it, before compiling.
    Before, `shard_map` kept one device's mean, and its losses differed from stage 0's from step 1."""
    with pytest.raises(zj.UserError, match=rf"{words}.*updates InputStats/mean from them.*{instead}"):
        _normalised_run(**kwargs)


def test_a_statistic_on_one_data_parallel_device_is_the_batchs():
    """With one data-parallel device its rows are the whole batch: nothing to refuse."""
    one = zj.make_mesh(fsdp=1, devices=jax.devices()[:1])
    trainer = zj.Trainer(Normalised, optax.adam(1e-2), mesh=one, engine="shard_map", stage=1)
    batch = classification_batch(features=12)
    batch["targets"] %= 4
    state, _ = trainer.step(trainer.init(KEY, batch), batch)
    assert np.abs(np.asarray(state.model_state["InputStats"]["mean"])).max() > 0


def test_a_statistic_of_whole_micro_batches_accumulates_at_stage_0_like_stage_3():
    """The refusal's other way out: `whole_micro_batches` runs each micro-batch on all of its rows,
    as stage 3 does, so the statistic is each micro-batch's over the global rows."""
    accumulate = {"engine": "gspmd", "grad_accum": 2}
    losses, mean = _normalised_run(stage=0, engine_options={"whole_micro_batches": True}, **accumulate)
    want_losses, want_mean = _normalised_run(stage=3, **accumulate)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-6)
    assert np.abs(mean).max() > 0


def test_a_statistic_of_the_global_batch_trains_at_stage_3_like_stage_0():
    """What the refusal offers instead: `gspmd` runs the model on the global batch at every stage."""
    losses, mean = _normalised_run(engine="gspmd", stage=3)
    want_losses, want_mean = _normalised_run(engine="gspmd", stage=0)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-6)
    assert np.abs(mean).max() > 0
