"""Stage 3 gathers a user's model unit by unit in both engines: temp memory stops growing with depth.

A model of L identical blocks (an `nnx.List`), compiled only: between L = 4 and L = 8 the step's temp
memory may grow by 0.15 x the 4 extra blocks' full weights (fp32 at 8 devices, the 4 blocks' fp32
gradient shards alone are 0.125 of that) plus the 4 extra blocks' saved activations (each unit keeps
only its input, rows/8 x width x 4 bytes = 8 KiB a block here). Before units gathered by data
dependence, it grew by one to two blocks' full weights per block. Plain SGD, so the optimizer's
own sharded temporaries do not blur what the gathers hold.
"""

import functools
import tempfile

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests.models import tiny_gpt, token_batch
from zerojax.accounting.hlo import collective_bytes, compile_partitioned

DEVICES = 8
ROWS = 64


def _deep(width: int, depth: int):
    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.fc1 = nnx.Linear(width, width, rngs=rngs)
            self.fc2 = nnx.Linear(width, width, rngs=rngs)

        def __call__(self, x):
            return x + self.fc2(jax.nn.gelu(self.fc1(x)))

    class Deep(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.inp = nnx.Linear(width, width, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
            self.out = nnx.Linear(width, 10, rngs=rngs)

        def __call__(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    return Deep


def _batch(width: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"inputs": rng.normal(size=(ROWS, width)).astype(np.float32),
            "targets": rng.integers(0, 10, size=(ROWS,)).astype(np.int32)}


def _trainer(width, depth, stage, engine, optimizer=None):
    return zj.Trainer(_deep(width, depth), optimizer or optax.sgd(1e-2), mesh=zj.make_mesh(fsdp=DEVICES),
                      stage=stage, engine=engine, precision="fp32")


@functools.lru_cache(maxsize=None)
def _compiled(width, depth, stage, engine):
    trainer = _trainer(width, depth, stage, engine)
    batch = _batch(width)
    state = trainer.init(jax.random.key(0), batch)
    compiled, hlo = compile_partitioned(trainer.lower(state, trainer.shard_batch(batch)),
                                        tempfile.mkdtemp(prefix="zerojax-hlo-"))
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"temp": m.temp_size_in_bytes, "peak": peak, "traffic": collective_bytes(hlo)["bytes"],
            "report": trainer.gather_report()}


def _block_bytes(width: int) -> int:
    return 4 * 2 * (width * width + width)  # fp32, two Linear layers


@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_stage_3_temp_memory_does_not_grow_with_depth(engine):
    width = 256
    shallow, deep = _compiled(width, 4, 3, engine), _compiled(width, 8, 3, engine)
    assert deep["report"].route == "units" and deep["report"].description.startswith("FSDP units: 8 x Block")
    activations = 4 * (ROWS // DEVICES) * width * 4
    allowance = 0.15 * 4 * _block_bytes(width) + activations
    grown = deep["temp"] - shallow["temp"]
    assert grown <= allowance, (grown, allowance)


@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_stage_3_peak_below_stage_2(engine):
    for depth in (4, 8):
        assert _compiled(256, depth, 3, engine)["peak"] < _compiled(256, depth, 2, engine)["peak"]


def test_shard_map_traffic_is_textbook():
    """All-gathers: at most two per unit (forward, backward; the first layer's backward needs no
    weights); reduce-scatters and all-reduces: one gradient; within 2%, on the partitioned HLO."""
    width, depth = 256, 8
    traffic = _compiled(width, depth, 3, "shard_map")["traffic"]
    params = depth * 2 * (width * width + width) + (width * width + width) + (width * 10 + 10)
    unit = 4 * params * (DEVICES - 1) / DEVICES
    assert traffic["all-gather"] <= 2 * unit * 1.02
    assert traffic["all-gather"] >= 2 * unit * 0.9  # forward and backward, not once
    assert abs(traffic["reduce-scatter"] + traffic["all-reduce"] - unit) <= 0.02 * unit


@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_units_train_like_stage_0(engine):
    width, depth, steps = 64, 4, 4

    def losses(stage, engine):
        trainer = _trainer(width, depth, stage, engine, optax.adamw(3e-3))
        state = trainer.init(jax.random.key(0), _batch(width))
        out = []
        for step in range(steps):
            state, metrics = trainer.step(state, _batch(width, step))
            out.append(float(metrics["loss"]))
        return np.array(out)

    np.testing.assert_allclose(losses(3, engine), losses(0, "gspmd"), rtol=1e-5, atol=0)


# ---- evaluation goes through the engine: one gather of the parameters, no partitioned matmuls -------


def _eval_traffic_and_loss(trainer, batch):
    state = trainer.init(jax.random.key(0), batch)
    lowered = trainer.prepared.eval_fn.lower(state, trainer.shard_batch(batch), trainer.loss_fn)
    _, hlo = compile_partitioned(lowered, tempfile.mkdtemp(prefix="zerojax-hlo-"))
    traffic = collective_bytes(hlo)["bytes"]
    return sum(traffic.values()), float(trainer.evaluate(state, batch)), trainer


def _sharded_bytes(trainer, itemsize: int) -> int:
    leaves = jax.tree.leaves(trainer.layout.leaves, is_leaf=lambda x: hasattr(x, "padded_shape"))
    return sum(itemsize * int(np.prod(l.padded_shape)) for l in leaves if l.axis is not None)


@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_stage_3_eval_gathers_the_parameters_once(engine):
    width, depth = 64, 4
    batch = _batch(width)
    moved, loss, trainer = _eval_traffic_and_loss(_trainer(width, depth, 3, engine), batch)
    sharded = _sharded_bytes(trainer, 4)
    assert moved <= sharded * (DEVICES - 1) / DEVICES * 1.02 + 64  # + the scalar loss's all-reduce
    assert moved >= sharded * (DEVICES - 1) / DEVICES * 0.98
    np.testing.assert_allclose(loss, _eval_traffic_and_loss(_trainer(width, depth, 0, "gspmd"), batch)[1],
                               rtol=1e-5)


def test_gpt_stage_3_bf16_eval_gathers_each_layer_once():
    """The shipped GPT's eval moved 1.5x the whole train step's bytes before it went through the engine."""
    model, _ = tiny_gpt()
    trainer = zj.Trainer(model, optax.adamw(1e-3), mesh=zj.make_mesh(fsdp=DEVICES), stage=3, engine="shard_map",
                         precision="bf16")
    moved, loss, trainer = _eval_traffic_and_loss(trainer, token_batch(0))
    assert moved <= _sharded_bytes(trainer, 2) * (DEVICES - 1) / DEVICES * 1.02 + 64
    assert np.isfinite(loss)
