"""ZeRO++ in the shard_map engine: qwZ (quantized weight gathers) and qgZ (quantized gradient
reduce-scatter), their bytes on the partitioned HLO, their losses, and the refusals."""

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.models import tiny_gpt, token_batch
from zerojax.accounting.hlo import collective_bytes, compile_partitioned
from zerojax.config import load_config
from zerojax.engines.quantize import Quantizer
from zerojax.errors import UserError

STEPS = 4


@pytest.mark.parametrize("kind, rel", [("int8", 0.5 / 127), ("fp8", 2.0**-4)])
def test_block_quantization_round_trip(kind, rel):
    q = Quantizer(kind, block=64)
    x = jax.random.normal(jax.random.key(1), (3, 200)) * jnp.array([[1e-3], [1.0], [50.0]])
    x = x.at[1, 64:128].set(0.0)  # an all-zero block stays zero
    codes, scale = q.quantize(x)
    assert codes.shape == (3, 4, 64) and scale.shape == (3, 4) and scale.dtype == jnp.float32
    back = q.dequantize(codes, scale, 200)
    absmax = jnp.repeat(jnp.abs(jnp.pad(x, ((0, 0), (0, 56)))).reshape(3, 4, 64).max(-1), 64, axis=-1)[:, :200]
    assert bool(jnp.all(jnp.abs(back - x) <= rel * absmax + 1e-12))
    assert bool(jnp.all(back[1, 64:128] == 0))


@functools.lru_cache(maxsize=None)
def _run(data=1, precision="bf16", steps=STEPS, **options):
    """(collective bytes of the step's partitioned HLO, losses over `steps` steps)."""
    model, _ = tiny_gpt()
    mesh = zj.make_mesh(data=data, fsdp=8 // data)
    trainer = zj.Trainer(model, optax.adamw(3e-3), mesh=mesh, stage=3, engine="shard_map", precision=precision,
                         engine_options=options or None)
    state = trainer.init(jax.random.key(0), token_batch(0))
    # one compile serves the byte count and the steps
    step, hlo = compile_partitioned(trainer.lower(state, trainer.shard_batch(token_batch(0))),
                                    tempfile.mkdtemp(prefix="zerojax-hlo-"))
    losses = []
    for i in range(steps):
        state, metrics = step(state, trainer.shard_batch(token_batch(i)))
        losses.append(float(metrics["loss"]))
    return collective_bytes(hlo, mesh=mesh), np.array(losses)


def test_qwz_and_qgz_halve_the_bf16_bytes():
    """Acceptance: parameter-gather bytes <= 0.55x the bf16 stage-3 gather (scales included), and
    gradient-reduction bytes <= 0.55x the bf16 reduce-scatter, on the partitioned HLO."""
    base = _run()[0]["bytes"]
    both = _run(quantize_weights="int8", quantize_grads="int8")[0]["bytes"]
    assert base["all-to-all"] == 0
    assert both["all-gather"] <= 0.55 * base["all-gather"]
    assert both["reduce-scatter"] + both["all-to-all"] <= 0.55 * base["reduce-scatter"]
    # int8 codes plus one fp32 scale per 256: (1 + 4/256) / 2 of bf16, plus the small leaves' bf16
    assert both["all-gather"] / base["all-gather"] == pytest.approx((1 + 4 / 256) / 2, abs=0.01)


def test_quantized_losses_stay_close():
    base = _run()[1]
    for options in ({"quantize_weights": "int8", "quantize_grads": "int8"},):
        losses = _run(**dict(options))[1]
        np.testing.assert_allclose(losses, base, rtol=2e-3)
    assert base[-1] < base[0]


@pytest.mark.slow
def test_fp8_weights_move_the_same_bytes_as_int8():
    fp8, losses = _run(quantize_weights="fp8", steps=2)
    assert fp8["bytes"]["all-gather"] == _run(quantize_weights="int8", quantize_grads="int8")[0]["bytes"]["all-gather"]
    np.testing.assert_allclose(losses, _run()[1][:2], rtol=5e-3)


def test_hybrid_mesh_quantized_collectives_stay_on_fsdp():
    """data=2 x fsdp=4: the quantized gathers and all-to-alls span fsdp only; the replica sum is
    the plain all-reduce over data."""
    traffic, losses = _run(data=2, steps=2, quantize_weights="int8", quantize_grads="int8")
    axes = traffic["by_kind_axis"]
    assert set(axes["all-gather"]) == {"fsdp"} and set(axes["all-to-all"]) == {"fsdp"}
    assert axes["all-reduce"]["data"] > 0
    np.testing.assert_allclose(losses, _run()[1][:2], rtol=5e-3)


def test_refusals():
    model, _ = tiny_gpt()
    mesh = zj.make_mesh(fsdp=8)
    make = lambda stage, engine, **o: zj.Trainer(model, optax.adamw(1e-3), mesh=mesh, stage=stage,  # noqa: E731
                                                  engine=engine, engine_options=o).init(jax.random.key(0),
                                                                                         token_batch(0))
    with pytest.raises(UserError, match="gspmd engine does not support the option quantize_weights"):
        make(3, "gspmd", quantize_weights="int8")
    with pytest.raises(UserError, match="gspmd engine does not support the option quantize_grads"):
        make(3, "gspmd", quantize_grads="int8")
    with pytest.raises(UserError, match="stage 2 has none"):
        make(2, "shard_map", quantize_weights="int8")
    with pytest.raises(UserError, match="stage 0 all-reduces"):
        make(0, "shard_map", quantize_grads="int8")
    with pytest.raises(UserError, match="int4"):
        make(3, "shard_map", quantize_weights="int4")


def test_config_keys():
    c = load_config("configs/tiny.yaml", ["zero.engine=shard_map", "zero.quantize_weights=int8",
                                          "zero.quantize_grads=int8", "zero.quantize_block=128"])
    assert (c.zero.quantize_weights, c.zero.quantize_grads, c.zero.quantize_block) == ("int8", "int8", 128)
    with pytest.raises(UserError, match="zero.quantize_grads"):
        load_config("configs/tiny.yaml", ["zero.quantize_grads=int4"])
    with pytest.raises(UserError, match="zero.quantize_block"):
        load_config("configs/tiny.yaml", ["zero.quantize_block=0"])
