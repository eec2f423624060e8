"""`zj.Stacked`: a user's scanned stack of blocks takes the "layers" route in both engines.

A model of an input layer, L blocks of two Linear layers and an output layer, written once with
`zj.Stacked` and once unrolled (an `nnx.List` of the same blocks with the same weights). At stage 3
the stack is gathered one layer per scan iteration: the step's temp memory does not grow with depth
(between L = 4 and L = 8 it may grow by 0.15 x the 4 extra blocks' fp32 weights plus their saved
activations: each layer keeps only its input, rows/8 x width x 4 bytes = 8 KiB a block here), and
the `shard_map` step moves textbook bytes (each stacked layer gathered twice, forward and
rematerialised backward; the leaves outside the stack once; every gradient reduced once).
"""

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests.models import Block, stacked_blocks, unrolled_blocks
from zerojax.accounting.hlo import collective_bytes
from zerojax.accounting.partitioned import compile_partitioned
from zerojax.adapt.model import functional
from zerojax.core.loss import cross_entropy
from zerojax.errors import UserError

DEVICES = 8
ROWS = 64


class Nested(nnx.Module):
    """Two stacks, neither at the top level nor named "blocks", one passing an extra argument."""

    def __init__(self, rngs: nnx.Rngs, width: int = 32, **block_kwargs):
        self.inp = nnx.Linear(width, width, rngs=rngs)
        self.trunk = nnx.Dict(
            first=zj.Stacked(Block, 3, width, rngs=rngs, **block_kwargs),
            second=zj.Stacked(Block, 2, width, rngs=rngs, **block_kwargs),
        )
        self.out = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(self.trunk["second"](self.trunk["first"](self.inp(x)), 0.5))


def _batch(width: int, seed: int = 0, rows: int = ROWS) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.normal(size=(rows, width)).astype(np.float32),
        "targets": rng.integers(0, 10, size=(rows,)).astype(np.int32),
    }


def _trainer(model, stage, engine, optimizer=None, **kwargs):
    return zj.Trainer(
        model,
        optimizer or optax.sgd(1e-2),
        mesh=zj.make_mesh(fsdp=DEVICES),
        stage=stage,
        engine=engine,
        precision="fp32",
        **kwargs,
    )


def _losses(trainer, width, steps=3, params=None, rows=ROWS):
    state = trainer.init(jax.random.key(0), _batch(width, rows=rows), params=params)
    out = []
    for step in range(steps):
        state, metrics = trainer.step(state, _batch(width, step, rows))
        out.append(float(metrics["loss"]))
    return np.array(out), state


@functools.cache
def _reference(name: str):
    """Stage-0 losses (gspmd, AdamW) of the models below, computed once."""
    model, rows = {"nested": (Nested, 16)}[name]
    return _losses(_trainer(model, 0, "gspmd", optax.adamw(3e-3)), 32, rows=rows)[0]


# ---- training: stage 3 (one layer gathered at a time) trains like stage 0 ------------------------


def test_stack_leaves_keep_the_layer_axis_whole():
    trainer = _trainer(Nested, 3, "shard_map", replicate_below_bytes=0)
    trainer.init(jax.random.key(0), _batch(32))
    leaves = {l.path: l for l in jax.tree.leaves(trainer.layout.leaves, is_leaf=lambda x: hasattr(x, "padded_shape"))}
    assert trainer.model.stacks == (("trunk", "first", "layers"), ("trunk", "second", "layers"))
    assert leaves["trunk/first/layers/fc1/kernel"].shape == (3, 32, 32)
    assert leaves["trunk/first/layers/fc1/kernel"].axis == 1
    assert leaves["trunk/second/layers/fc2/bias"].axis == 1
    assert leaves["inp/kernel"].axis == 0


@pytest.mark.parametrize(
    "engine,options,stage",
    [
        ("shard_map", {"prefetch": True}, 3),
        ("gspmd", {}, 3),
        pytest.param("shard_map", {}, 3, marks=pytest.mark.slow),
        pytest.param("shard_map", {}, 2, marks=pytest.mark.slow),
        pytest.param("gspmd", {}, 2, marks=pytest.mark.slow),
    ],
)
def test_trains_like_stage_0_one_layer_at_a_time(engine, options, stage):
    """Two nested stacks (the second given an extra argument), fp32: losses equal stage 0's within 1e-5."""
    trainer = _trainer(Nested, stage, engine, optax.adamw(3e-3), engine_options=options, replicate_below_bytes=0)
    losses, _ = _losses(trainer, 32, rows=16)
    np.testing.assert_allclose(losses, _reference("nested"), rtol=1e-5, atol=0)
    if stage == 3 or engine == "shard_map":
        assert trainer.gather_report().route == "layers"
        assert "trunk/first/layers" in trainer.gather_report().description
    if options.get("prefetch"):
        assert "prefetched" in trainer.gather_report().description


def _unrolled_params(stacked_params: dict, depth: int) -> dict:
    layer = lambda i: jax.tree.map(lambda a: a[i], stacked_params["blocks"]["layers"])  # noqa: E731
    return {**stacked_params, "blocks": {i: layer(i) for i in range(depth)}}


def test_equals_the_unrolled_list_of_the_same_blocks():
    """Same weights, same outputs, same loss and gradients as an `nnx.List` of the blocks, run in order."""
    width, depth = 32, 4
    stacked_fm, unrolled_fm = functional(stacked_blocks(width, depth)), functional(unrolled_blocks(width, depth))
    params, _, static = stacked_fm.init(jax.random.key(1), None)
    unrolled = _unrolled_params(params, depth)
    unrolled_static = unrolled_fm.init(jax.random.key(1), None)[2]
    batch = _batch(width)

    def loss(fm, static):
        return lambda p: cross_entropy(fm.apply(p, {}, static, batch["inputs"])[0], batch)

    value, grads = jax.jit(jax.value_and_grad(loss(stacked_fm, static)))(params)
    plain_value, plain_grads = jax.jit(jax.value_and_grad(loss(unrolled_fm, unrolled_static)))(unrolled)
    np.testing.assert_allclose(value, plain_value, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(_unrolled_params(grads, depth)), jax.tree.leaves(plain_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_trains_like_the_unrolled_list_at_stage_3(engine):
    width, depth = 32, 4
    params = functional(stacked_blocks(width, depth)).init(jax.random.key(1), None)[0]
    stacked, _ = _losses(_trainer(stacked_blocks(width, depth), 3, engine, optax.adamw(3e-3)), width, params=params)
    plain, _ = _losses(
        _trainer(unrolled_blocks(width, depth), 3, engine, optax.adamw(3e-3)),
        width,
        params=_unrolled_params(params, depth),
    )
    np.testing.assert_allclose(stacked, plain, rtol=1e-5, atol=0)


# ---- RNG and model state inside the blocks ---------------------------------------------------------


def test_each_layer_draws_its_own_dropout_mask():
    class Drop(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(x)

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.blocks = zj.Stacked(Drop, 4, rngs=rngs)

        def __call__(self, x):
            return self.blocks(x)

    fm = functional(Model)
    params, model_state, static = fm.init(jax.random.key(0), None)
    out, _ = fm.apply(params, model_state, static, jnp.ones((64, 64)), rng=jax.random.key(3), train=True)
    kept = float(jnp.mean(out != 0))
    assert abs(kept - 0.5**4) < 0.03, kept  # one shared mask would keep half
    again, _ = fm.apply(params, model_state, static, jnp.ones((64, 64)), rng=jax.random.key(4), train=True)
    assert not np.array_equal(np.asarray(out), np.asarray(again))  # masks follow the step's key
    evaluated, _ = fm.apply(params, model_state, static, jnp.ones((64, 64)), train=False)
    np.testing.assert_array_equal(evaluated, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_dropout_in_blocks_trains_alike_at_every_stage(engine):
    reference, _ = _losses(_trainer(lambda rngs: Nested(rngs, drop=0.3), 0, engine), 32, rows=16)
    trainer = _trainer(lambda rngs: Nested(rngs, drop=0.3), 3, engine, replicate_below_bytes=0)
    losses, _ = _losses(trainer, 32, rows=16)
    assert trainer.gather_report().route == "layers"
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=0)


def test_batch_norm_statistics_are_per_layer():
    fm = functional(lambda rngs: Nested(rngs, norm=True))
    params, model_state, static = fm.init(jax.random.key(0), None)
    assert model_state["batch_stats"]["trunk"]["first"]["layers"]["norm"]["mean"].shape == (3, 32)
    _, updated = jax.jit(lambda p, m, x: fm.apply(p, m, static, x, train=True))(
        params, model_state, _batch(32)["inputs"]
    )
    mean = updated["batch_stats"]["trunk"]["first"]["layers"]["norm"]["mean"]
    assert not np.allclose(mean, 0) and not np.allclose(mean[0], mean[1])  # each layer its own statistics
    _, kept = jax.jit(lambda p, m, x: fm.apply(p, m, static, x, train=False))(params, updated, _batch(32)["inputs"])
    np.testing.assert_array_equal(kept["batch_stats"]["trunk"]["first"]["layers"]["norm"]["mean"], mean)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_batch_norm_in_blocks_updates_each_layer(engine):
    model = lambda rngs: Nested(rngs, norm=True)  # noqa: E731
    reference, ref_state = _losses(_trainer(model, 0, "gspmd"), 32, steps=2, rows=16)
    trainer = _trainer(model, 3, engine, replicate_below_bytes=0)
    losses, state = _losses(trainer, 32, steps=2, rows=16)
    assert trainer.gather_report().route == "layers"
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=0)
    mean = state.model_state["batch_stats"]["trunk"]["first"]["layers"]["norm"]["mean"]
    assert mean.shape == (3, 32) and not np.allclose(mean[0], mean[1])  # each layer its own statistics
    np.testing.assert_allclose(
        mean, ref_state.model_state["batch_stats"]["trunk"]["first"]["layers"]["norm"]["mean"], rtol=1e-5, atol=1e-6
    )


def test_bad_arguments_are_user_errors():
    with pytest.raises(UserError, match="positive"):
        zj.Stacked(Block, 0, 8, rngs=nnx.Rngs(0))
    with pytest.raises(UserError, match="remat"):
        zj.Stacked(Block, 2, 8, rngs=nnx.Rngs(0), remat="some")
    widen = zj.Stacked(lambda rngs: nnx.Linear(8, 16, rngs=rngs), 2, rngs=nnx.Rngs(0))
    with pytest.raises(UserError, match="same structure, shape and dtype"):
        widen(jnp.ones((4, 8)))


# ---- compiled: temp memory flat in depth, textbook traffic ------------------------------------------


@functools.cache
def _compiled(width, depth, stage, engine):
    trainer = _trainer(stacked_blocks(width, depth), stage, engine)
    batch = _batch(width)
    state = trainer.init(jax.random.key(0), batch)
    compiled, hlo = compile_partitioned(trainer.lower(state, batch), tempfile.mkdtemp(prefix="zerojax-hlo-"))
    m = compiled.memory_analysis()
    return {"temp": m.temp_size_in_bytes, "traffic": collective_bytes(hlo)["bytes"], "report": trainer.gather_report()}


def _block_bytes(width: int) -> int:
    return 4 * 2 * (width * width + width)  # fp32, two Linear layers


@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_stage_3_temp_memory_does_not_grow_with_depth(engine):
    width = 256
    shallow, deep = _compiled(width, 4, 3, engine), _compiled(width, 8, 3, engine)
    assert deep["report"].route == "layers"
    activations = 4 * (ROWS // DEVICES) * width * 4
    allowance = 0.15 * 4 * _block_bytes(width) + activations
    grown = deep["temp"] - shallow["temp"]
    assert grown <= allowance, (grown, allowance)


def test_shard_map_traffic_is_textbook():
    """All-gathers: each stacked layer twice (forward, rematerialised backward), the leaves outside
    the stack once; reduce-scatters and all-reduces: one gradient; within 2%, on the partitioned HLO."""
    width, depth = 256, 8
    traffic = _compiled(width, depth, 3, "shard_map")["traffic"]
    per_byte = 4 * (DEVICES - 1) / DEVICES
    stack = depth * _block_bytes(width) // 4
    rest = (width * width + width) + (width * 10 + 10)
    gathers = per_byte * (2 * stack + rest)
    assert abs(traffic["all-gather"] - gathers) <= 0.02 * gathers, (traffic, gathers)
    grads = per_byte * (stack + rest)
    assert abs(traffic["reduce-scatter"] + traffic["all-reduce"] - grads) <= 0.02 * grads, (traffic, grads)
