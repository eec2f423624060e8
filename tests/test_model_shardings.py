"""Models that shard their own activations, the way JAX's and Flax's sharding guides write them, train at
every stage in both engines and equal stage 0: `jax.lax.with_sharding_constraint` with a bare
PartitionSpec, Linen's `nn.with_logical_constraint` under `nn.logical_axis_rules`, and a decoder in the
style of Flax's Gemma example (parameters annotated with PartitionSpecs, `out_sharding=` on its
einsums, constraints through a `shard` helper) on fsdp=4 x tensor=2, under its own axis names."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import zerojax as zj

STEPS = 3


class ConstrainedNNX(nnx.Module):
    """Constrains its hidden activations over the batch axes, as MaxText and JAX's guides do."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        h = jax.lax.with_sharding_constraint(jax.nn.gelu(self.up(x)), P(("data", "fsdp"), None))
        return self.down(h)


class ConstrainedLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.with_logical_constraint(nn.gelu(nn.Dense(64)(x)), ("batch", "hidden"))
        return nn.Dense(4)(h)


LINEN_RULES = (("batch", ("data", "fsdp")), ("hidden", None))


def _classification():
    rng = np.random.default_rng(0)
    return {"inputs": rng.normal(size=(16, 16)).astype(np.float32), "targets": rng.integers(0, 4, 16).astype(np.int32)}


def _losses(trainer, batch, steps=STEPS) -> list[float]:
    state, losses = trainer.init(jax.random.key(0), batch), []
    for _ in range(steps):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


def _constrained(kind: str, stage: int, engine: str):
    """A trainer built the way a user would: the Linen model's Flax rules active while it is built."""
    model = ConstrainedNNX if kind == "nnx" else ConstrainedLinen()
    with nn.logical_axis_rules(LINEN_RULES):
        return zj.Trainer(model, optax.adam(1e-2), mesh=zj.make_mesh(fsdp=8), stage=stage, engine=engine)


@functools.cache
def _reference(kind: str) -> tuple[float, ...]:
    return tuple(_losses(_constrained(kind, 0, "gspmd"), _classification()))


def _slow_unless(*default):
    cases = [(k, s, e) for k in ("nnx", "linen") for s in (0, 1, 2, 3) for e in ("gspmd", "shard_map")]
    return [c if c in default else pytest.param(*c, marks=pytest.mark.slow) for c in cases]


@pytest.mark.parametrize(
    "kind, stage, engine", _slow_unless(("nnx", 3, "shard_map"), ("nnx", 3, "gspmd"), ("linen", 3, "shard_map"))
)
def test_a_model_constraining_its_activations_trains_like_stage_0(kind, stage, engine):
    losses = _losses(_constrained(kind, stage, engine), _classification())  # the step traced outside the rules
    np.testing.assert_allclose(losses, _reference(kind), rtol=1e-6, atol=0)
    assert losses[-1] < losses[0]


def _lowered(model, rules=None) -> str:
    mesh = zj.make_mesh(fsdp=4, tensor=2)
    trainer = zj.Trainer(model, optax.adam(1e-2), mesh=mesh, stage=3, axis_rules=rules)
    state = trainer.init(jax.random.key(0), _classification())
    return trainer.lower(state, trainer.shard_batch(_classification())).as_text()


class Annotated(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, constrain=None):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("embed", "model")), rngs=rngs)
        self.down = nnx.Linear(64, 4, kernel_init=nnx.with_partitioning(init, ("model", "embed")), rngs=rngs)
        self.constrain = constrain

    def __call__(self, x):
        h = jax.nn.gelu(self.up(x))
        if self.constrain is not None:
            h = jax.lax.with_sharding_constraint(h, self.constrain)
        return self.down(h)


def test_the_models_constraint_reaches_the_compiled_program_under_its_own_axis_names():
    """Honoured, not dropped: the user's constraint of the hidden activations over (data, fsdp) and
    "model" (which the rules map to tensor) is in the program, forward and backward (the same model
    without it has two sharding constraints fewer)."""
    rules = {"model": "tensor", "embed": None}
    plain = _lowered(functools.partial(Annotated, constrain=None), rules)
    constrained = _lowered(functools.partial(Annotated, constrain=P(("data", "fsdp"), "model")), rules)
    assert constrained.count("sharding_constraint") == plain.count("sharding_constraint") + 2


def test_an_axis_name_no_rule_maps_is_one_sentence_naming_it_and_the_rule():
    model = functools.partial(Annotated, constrain=P(None, "mp"))
    trainer = zj.Trainer(model, optax.adam(1e-2), mesh=zj.make_mesh(fsdp=8), stage=3)
    with pytest.raises(zj.UserError, match="names mesh axis 'mp'.*axis_rules=\\{'mp': 'tensor'\\}"):
        trainer.init(jax.random.key(0), _classification())


def test_shard_map_notes_the_batch_axes_it_drops_from_a_users_constraint():
    trainer = _constrained("nnx", 3, "shard_map")
    _losses(trainer, _classification(), steps=1)
    assert any("over fsdp: dropped inside the shard_map region" in n for n in trainer.gather_report().notes)


# ---- a decoder in the style of Flax's Gemma example ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """PartitionSpecs for parameters and activations, None without sharding (Gemma's `ShardingConfig`)."""

    emb_vd: P | None = None
    q_dnh: P | None = None
    o_nhd: P | None = None
    ffw_df: P | None = None
    ffw_fd: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_btnh: P | None = None

    @staticmethod
    def fsdp_tp_sharding(fsdp_axis_name: str = "fsdp", tensor_parallel_axis_name: str = "tp"):
        fsdp, tp = fsdp_axis_name, tensor_parallel_axis_name
        return ShardingConfig(
            emb_vd=P(tp, fsdp),
            q_dnh=P(fsdp, tp, None),
            o_nhd=P(tp, None, fsdp),
            ffw_df=P(fsdp, tp),
            ffw_fd=P(tp, fsdp),
            act_btd=P(fsdp, None, tp),
            act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None),
        )


def shard(x, spec):
    """Gemma's helper: a constraint where a mesh is in context, else nothing."""
    if spec is None or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


class Einsum(nnx.Module):
    def __init__(self, equation: str, shape, *, rngs: nnx.Rngs, sharding=None):
        self.equation = equation
        self.w = nnx.Param(nnx.initializers.normal(0.2)(rngs.params(), shape), out_sharding=sharding)

    def __call__(self, x, out_sharding=None):
        return jnp.einsum(self.equation, x, self.w[...], out_sharding=out_sharding)


class DecoderBlock(nnx.Module):
    def __init__(self, shd: ShardingConfig, *, rngs: nnx.Rngs, d=16, f=32, heads=4, head_dim=4):
        self.shd = shd
        self.q = Einsum("BTD,DNH->BTNH", (d, heads, head_dim), rngs=rngs, sharding=shd.q_dnh)
        self.o = Einsum("BTNH,NHD->BTD", (heads, head_dim, d), rngs=rngs, sharding=shd.o_nhd)
        self.up = Einsum("BTD,DF->BTF", (d, f), rngs=rngs, sharding=shd.ffw_df)
        self.down = Einsum("BTF,FD->BTD", (f, d), rngs=rngs, sharding=shd.ffw_fd)

    def __call__(self, x):
        x = x + self.o(jnp.tanh(self.q(x, out_sharding=self.shd.act_btnh)), out_sharding=self.shd.act_btd)
        h = shard(jax.nn.gelu(self.up(x, out_sharding=self.shd.act_btf)), self.shd.act_btf)
        return shard(x + self.down(h), self.shd.act_btd)


class Decoder(nnx.Module):
    def __init__(self, shd: ShardingConfig = ShardingConfig(), *, rngs: nnx.Rngs, vocab=64, d=16, layers=2):
        self.shd = shd
        self.embed = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (vocab, d)), out_sharding=shd.emb_vd)
        self.layers = nnx.List([DecoderBlock(shd, rngs=rngs, d=d) for _ in range(layers)])

    def __call__(self, tokens):
        x = shard(self.embed[...][tokens], self.shd.act_btd)
        for layer in self.layers:
            x = layer(x)
        return jnp.einsum("BTD,VD->BTV", x, self.embed[...])


def _tokens():
    rng = np.random.default_rng(1)
    return {
        "inputs": rng.integers(0, 64, (8, 12)).astype(np.int32),
        "targets": rng.integers(0, 64, (8, 12)).astype(np.int32),
    }


@functools.cache
def _decoder_reference() -> tuple[float, ...]:
    """Stage 0 on fsdp=8 without a sharding config."""
    return tuple(_losses(zj.Trainer(Decoder, optax.adam(1e-2), mesh=zj.make_mesh(fsdp=8)), _tokens()))


NAMES = {  # the model's own axis names, and the rules that map them onto zerojax's mesh
    "fsdp/tensor": (("fsdp", "tensor"), None),
    "fsdp/tp": (("fsdp", "tp"), {"tp": "tensor"}),
    "dp/model": (("dp", "model"), {"dp": ["data", "fsdp"], "model": "tensor"}),
}


@pytest.mark.parametrize(
    "names, stage, engine",
    [
        ("fsdp/tp", 3, "shard_map"),
        ("dp/model", 3, "gspmd"),
        *[
            pytest.param(n, s, e, marks=pytest.mark.slow)
            for n in NAMES
            for s in (0, 3)
            for e in ("gspmd", "shard_map")
            if (n, s, e) not in {("fsdp/tp", 3, "shard_map"), ("dp/model", 3, "gspmd")}
        ],
    ],
)
def test_a_gemma_style_decoder_trains_on_fsdp_x_tensor_like_stage_0_without_shardings(names, stage, engine):
    axis_names, rules = NAMES[names]
    model = functools.partial(Decoder, ShardingConfig.fsdp_tp_sharding(*axis_names))
    mesh = zj.make_mesh(fsdp=4, tensor=2)
    trainer = zj.Trainer(model, optax.adam(1e-2), mesh=mesh, stage=stage, engine=engine, axis_rules=rules)
    losses = _losses(trainer, _tokens())
    np.testing.assert_allclose(losses, _decoder_reference(), rtol=1e-5, atol=0)
    assert losses[-1] < losses[0]
    leaves = {l.path: l for l in jax.tree.leaves(trainer.layout.leaves, is_leaf=lambda x: hasattr(x, "tensor_axis"))}
    assert leaves["layers/0/up/w"].tensor_axis == 1  # ffw_df = P(fsdp, tp): its own annotation, through the rules
    assert any("out_sharding= of einsum" in n for n in trainer.gather_report().notes)
