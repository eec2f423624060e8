"""A parameter is whole wherever the model reads it: in a unit's `__call__`, in another of its methods
(`Embed.attend` as a tied output head), in a block called twice, or reached into from outside its unit
(then the root gathers it, and the report says so). User-written NNX and Linen decoders, every leaf
sharded (`replicate_below_bytes=0`), losses equal to stage 0's for 5 steps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zerojax as zj

VOCAB, WIDTH, SEQ, ROWS, STEPS = 50, 16, 8, 8, 5  # a 50-token vocabulary: no fsdp size divides it


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.gelu(self.fc(self.norm(x)))

    def mix(self, x):  # a method other than __call__, called by the parent
        return self.fc(x) * 0.5


class TiedDecoder(nnx.Module):
    """GPT-2's idioms: token and position tables (two `Embed`s: each an FSDP unit), the output head
    reading the token table (`attend`), a block shared by two positions in the stack, a custom method,
    and one kernel the parent reads itself."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.wte = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.wpe = nnx.Embed(SEQ, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.shared = Block(rngs)

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        x = self.shared(self.blocks[0](x))
        x = self.shared(self.blocks[1](x)) + self.shared.mix(x)
        # a raw read: this kernel belongs to blocks[1]'s unit, but is used here, outside it
        x = x + jnp.tanh(x @ self.blocks[1].fc.kernel[...])
        return self.wte.attend(x)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.gelu(nn.Dense(WIDTH)(nn.LayerNorm()(x)))


class LinenTiedDecoder(nn.Module):
    def setup(self):
        self.wte = nn.Embed(VOCAB, WIDTH)
        self.wpe = nn.Embed(SEQ, WIDTH)
        self.blocks = [LinenBlock() for _ in range(2)]
        self.shared = LinenBlock()

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = self.shared(block(x))
        return self.wte.attend(x)


MODELS = {"nnx": TiedDecoder, "linen": LinenTiedDecoder()}


def _batch(step: int) -> dict:
    tokens = np.random.default_rng(step).integers(0, VOCAB, size=(ROWS, SEQ + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@functools.cache
def _run(kind: str, engine: str, stage: int, precision: str = "fp32"):
    trainer = zj.Trainer(
        MODELS[kind],
        optax.adamw(1e-2),
        mesh=zj.make_mesh(fsdp=8),
        stage=stage,
        engine=engine,
        precision=precision,
        replicate_below_bytes=0,
    )
    state = trainer.init(jax.random.key(0), _batch(0))
    losses = []
    for step in range(STEPS):
        state, metrics = trainer.step(state, _batch(step))
        losses.append(float(metrics["loss"]))
    return np.array(losses), trainer.gather_report().description


# Stages 2 and 3 (where units gather), NNX in both engines and Linen with shard_map, by default;
# every stage, engine and model under -m slow.
_DEFAULT = [("nnx", e, s) for e in ("shard_map", "gspmd") for s in (2, 3)] + [("linen", "shard_map", 3)]
_CASES = _DEFAULT + [
    pytest.param(k, e, s, marks=pytest.mark.slow)
    for k in ("nnx", "linen")
    for e in ("shard_map", "gspmd")
    for s in range(4)
    if (k, e, s) not in _DEFAULT
]


@pytest.mark.parametrize("kind, engine, stage", _CASES)
def test_every_read_sees_the_whole_parameter(kind, engine, stage):
    losses, _ = _run(kind, engine, stage)
    assert np.isfinite(losses).all(), losses
    np.testing.assert_allclose(losses, _run(kind, "gspmd", 0)[0], rtol=1e-5, atol=0)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_only_the_leaf_read_outside_its_unit_is_gathered_by_the_root(engine):
    """`attend` and `mix` are unit calls: only the kernel the parent reads itself leaves its unit."""
    description = _run("nnx", engine, 3)[1]
    assert description.startswith("FSDP units: 3 x Block, 2 x Embed"), description
    assert description.endswith("read outside their units, so gathered by the root: blocks/1/fc/kernel"), description


def test_linen_attend_is_a_unit_call():
    description = _run("linen", "shard_map", 3)[1]
    assert description.startswith("FSDP units: 2 x Embed, 3 x LinenBlock"), description
    assert "read outside" not in description


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_bf16_stage_3_tracks_stage_0(engine):
    """bf16 rounds differently when a gather moves; the losses stay within 2% of stage 0's, bf16."""
    np.testing.assert_allclose(_run("nnx", engine, 3, "bf16")[0], _run("nnx", "gspmd", 0, "bf16")[0], rtol=2e-2)


def _listed(name: str):
    """A decoder whose list of blocks is the attribute `name`."""

    class Listed(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            setattr(self, name, nnx.List([Block(rngs) for _ in range(2)]))

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in getattr(self, name):
                x = block(x)
            return self.embed.attend(x)

    return Listed


def _layout(name: str) -> dict:
    trainer = zj.Trainer(_listed(name), optax.sgd(0.1), mesh=zj.make_mesh(fsdp=8), stage=3, replicate_below_bytes=0)
    leaves = jax.tree.leaves(
        trainer.prepare(jax.random.key(0), _batch(0)).layout.leaves, is_leaf=lambda x: hasattr(x, "padded_shape")
    )
    return {l.path.replace(f"{name}/", "list/"): (l.axis, l.reason) for l in leaves}


def test_a_list_named_blocks_is_sharded_like_any_other_list():
    """Only a declared stack keeps a layer axis whole: an `nnx.List` called `blocks` is not one."""
    named_blocks = _layout("blocks")
    assert named_blocks == _layout("layers")
    assert named_blocks["list/0/fc/bias"] == (0, "sharded on axis 0")  # not "no dimension to shard"
    assert named_blocks["list/0/fc/kernel"][0] == 0  # its largest (first) dimension, not a layer axis
