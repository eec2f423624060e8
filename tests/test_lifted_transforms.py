"""Lifted transforms at every stage, in both engines: Linen `nn.scan(nn.remat(Block))` over stacked
params and NNX's `nnx.vmap`-built blocks applied by `nnx.scan` (each stack found from the transform
and gathered one layer at a time inside the scan), `nn.remat_scan` and NNX's nested scans (gathered
whole by the params' owner), Linen `nn.vmap` and `nnx.vmap` over an ensemble's params whose heads
read each other through the vmap's axis name, and `nn.remat` around unrolled blocks. Losses equal
stage 0's within 1e-5 for 5 steps; the scanned stack's stage-3 temp memory stays flat in depth."""

from __future__ import annotations

import functools
import tempfile

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zerojax as zj
from tests.programs import lower_abstract
from tests.unit_models import DEEP, OPTIMIZERS, SHALLOW, LinenBlock, LinenScanDeep, unit_allowance, unit_batch
from zerojax.accounting.partitioned import compile_partitioned

WIDTH, STEPS = 16, 5


class _Head(nn.Module):
    """A head that sees the others: its output less half their mean, over the vmap's axis name."""

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(WIDTH)(x)
        return y - 0.5 * jax.lax.pmean(y, "heads")


class Ensemble(nn.Module):
    """Four heads with stacked params (`nn.vmap`, variable_axes params 0, an axis name), averaged."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(WIDTH)(x))
        heads = nn.vmap(
            _Head,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=None,
            out_axes=0,
            axis_size=4,
            axis_name="heads",
        )
        return nn.Dense(10)(heads(name="heads")(x).mean(0))


class Rematted(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH)(x)
        for _ in range(2):
            x = nn.remat(LinenBlock)(WIDTH)(x)
        return nn.Dense(10)(x)


class _NNXBlock(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(width, width, rngs=rngs)
        self.fc2 = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.fc2(jax.nn.gelu(self.fc1(x)))


class NNXScanned(nnx.Module):
    """Flax's NNX "scan over layers": blocks made by `nnx.vmap`, applied by `nnx.scan`."""

    def __init__(self, *, rngs: nnx.Rngs, depth: int = 3, width: int = WIDTH):
        self.inp = nnx.Linear(width, width, rngs=rngs)

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs):
            return _NNXBlock(width, rngs)

        self.layers = make(rngs)
        self.out = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return self.out(body(self.inp(x), self.layers))


class _NNXHead(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        y = self.fc(x)
        return y - 0.5 * jax.lax.pmean(y, "heads")


class NNXEnsemble(nnx.Module):
    """Four heads made by `nnx.vmap`, applied by an `nnx.vmap` that names their axis, averaged."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs):
            return _NNXHead(rngs)

        self.heads = make(rngs)
        self.out = nnx.Linear(WIDTH, 10, rngs=rngs)

    def __call__(self, x):
        @nnx.vmap(in_axes=(0, None), out_axes=0, axis_name="heads")
        def heads(head, x):
            return head(x)

        return self.out(heads(self.heads, jax.nn.gelu(self.inp(x))).mean(0))


class RematScanned(nn.Module):
    """`nn.remat_scan`: nested scans, each of its params with two layer axes."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH)(x)
        x = nn.remat_scan(LinenBlock, lengths=(2, 2))(WIDTH)(x)
        return nn.Dense(10)(x)


class NNXNestedScans(nnx.Module):
    """Blocks made by two nested `nnx.vmap`s (2 x 2), applied by two nested `nnx.scan`s."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def groups(rngs: nnx.Rngs):
            @nnx.split_rngs(splits=2)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs: nnx.Rngs):
                return _NNXBlock(WIDTH, rngs)

            return blocks(rngs)

        self.layers = groups(rngs)
        self.out = nnx.Linear(WIDTH, 10, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def over_groups(x, group):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def over_blocks(x, block):
                return block(x)

            return over_blocks(x, group)

        return self.out(over_groups(self.inp(x), self.layers))


MODELS = {
    "scan": LinenScanDeep(WIDTH, 3),
    "remat_scan": RematScanned(),
    "vmap": Ensemble(),
    "remat": Rematted(),
    "nnx_scan": NNXScanned,
    "nnx_vmap": NNXEnsemble,
    "nnx_nested": NNXNestedScans,
}


@functools.cache
def _run(kind: str, engine: str, stage: int):
    trainer = zj.Trainer(
        MODELS[kind], optax.adamw(1e-2), mesh=zj.make_mesh(fsdp=8), stage=stage, engine=engine, replicate_below_bytes=0
    )
    state = trainer.init(jax.random.key(0), unit_batch(WIDTH))
    losses = []
    for step in range(STEPS):
        state, metrics = trainer.step(state, unit_batch(WIDTH, step))
        losses.append(float(metrics["loss"]))
    return np.array(losses), trainer.gather_report().description


_DEFAULT = [("scan", e, s) for e in ("shard_map", "gspmd") for s in (2, 3)] + [
    (k, "shard_map", 3) for k in ("vmap", "remat", "nnx_scan", "nnx_vmap", "remat_scan", "nnx_nested")
]
_CASES = _DEFAULT + [
    pytest.param(k, e, s, marks=pytest.mark.slow)
    for k in MODELS
    for e in ("shard_map", "gspmd")
    for s in range(4)
    if (k, e, s) not in _DEFAULT
]


@pytest.mark.parametrize("kind, engine, stage", _CASES)
def test_trains_like_stage_0(kind, engine, stage):
    losses, _ = _run(kind, engine, stage)
    assert np.isfinite(losses).all(), losses
    np.testing.assert_allclose(losses, _run(kind, "gspmd", 0)[0], rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "kind, stack", [("scan", "layers"), ("vmap", "heads"), ("nnx_scan", "layers"), ("nnx_vmap", "heads")]
)
def test_the_stack_is_found_from_the_transform_and_gathered_per_layer(kind, stack):
    description = _run(kind, "shard_map", 3)[1]
    assert f"'{stack}' gathered one layer at a time inside its transform" in description, description


_DEEP_MODELS = {
    "scan": LinenScanDeep,
    "nnx_scan": lambda width, depth: functools.partial(NNXScanned, depth=depth, width=width),
}


@functools.cache
def _temp(kind: str, engine: str, depth: int, width: int = 256) -> int:
    trainer = zj.Trainer(
        _DEEP_MODELS[kind](width, depth), OPTIMIZERS["sgd"](), mesh=zj.make_mesh(fsdp=8), stage=3, engine=engine
    )
    compiled, _ = compile_partitioned(lower_abstract(trainer, unit_batch(width)), tempfile.mkdtemp(prefix="zerojax-"))
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "kind, engine",
    [("scan", "shard_map")]
    + [
        pytest.param(k, e, marks=pytest.mark.slow)
        for k, e in [("scan", "gspmd"), ("nnx_scan", "shard_map"), ("nnx_scan", "gspmd")]
    ],
)
def test_scanned_stack_temp_memory_does_not_grow_with_depth(kind, engine):
    """Between SHALLOW and DEEP layers, temp may grow by tests/test_units.py's allowance per layer
    (0.15 of a layer's fp32 weights plus its saved input): a stack gathered whole would add a layer."""
    grown = _temp(kind, engine, DEEP) - _temp(kind, engine, SHALLOW)
    assert grown <= (DEEP - SHALLOW) * unit_allowance(256, 4), (grown, unit_allowance(256, 4))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_verify_passes(kind, engine):
    trainer = zj.Trainer(
        MODELS[kind], optax.adamw(1e-2), mesh=zj.make_mesh(fsdp=8), stage=3, engine=engine, replicate_below_bytes=0
    )
    result = trainer.verify([unit_batch(WIDTH, step) for step in range(3)])
    assert result.passed, result.lines()
