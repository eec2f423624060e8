"""Loss parity: every ZeRO stage trains the same model to the same losses (fp32, 8 devices)."""

import functools

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.models import LinenMLP, UnevenMLP, classification_batch, tiny_gpt, token_batch

STEPS = 10
RTOL = 1e-5


@functools.cache  # the same run (stage 0, say) serves every test that compares with it
def _losses(model, batches, stage, mesh, engine="gspmd", precision="fp32"):
    trainer = zj.Trainer(model, optax.adamw(3e-3), mesh=mesh, stage=stage, engine=engine, precision=precision)
    state = trainer.init(jax.random.key(0), batches(0))
    losses = []
    for step in range(STEPS):
        state, metrics = trainer.step(state, batches(step))
        losses.append(float(metrics["loss"]))
    return np.array(losses)


MODELS = {
    "gpt": (tiny_gpt(n_layers=2)[0], token_batch),
    "uneven_nnx": (UnevenMLP, lambda step: classification_batch(0)),
    "linen": (LinenMLP(), lambda step: classification_batch(0)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def stage0(request):
    model, batches = MODELS[request.param]
    return request.param, _losses(model, batches, 0, zj.make_mesh(fsdp=8))


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 2, 3])  # 1 is 2 without the scatter
def test_every_stage_matches_stage_0(stage0, stage):
    name, reference = stage0
    model, batches = MODELS[name]
    losses = _losses(model, batches, stage, zj.make_mesh(fsdp=8))
    assert reference[-1] < reference[0]  # it is really training
    np.testing.assert_allclose(losses, reference, rtol=RTOL, atol=0)


def test_stage_0_on_8_devices_matches_1_device():
    model, batches = MODELS["gpt"]
    eight = _losses(model, batches, 0, zj.make_mesh(fsdp=8))
    one = _losses(model, batches, 0, zj.make_mesh(fsdp=1, devices=jax.devices()[:1]))
    np.testing.assert_allclose(eight, one, rtol=RTOL, atol=0)


def test_hybrid_mesh_matches_pure_fsdp():
    model, batches = MODELS["gpt"]
    fsdp = _losses(model, batches, 3, zj.make_mesh(fsdp=8))
    hybrid = _losses(model, batches, 3, zj.make_mesh(data=2, fsdp=4))
    np.testing.assert_allclose(hybrid, fsdp, rtol=RTOL, atol=0)


def test_bf16_stage_3_tracks_fp32_and_stage_0():
    model, batches = MODELS["gpt"]
    mesh = zj.make_mesh(fsdp=8)
    bf16_3 = _losses(model, batches, 3, mesh, precision="bf16")
    bf16_0 = _losses(model, batches, 0, mesh, precision="bf16")
    fp32 = _losses(model, batches, 0, mesh)
    np.testing.assert_allclose(bf16_3, bf16_0, rtol=2e-3)
    np.testing.assert_allclose(bf16_3, fp32, rtol=2e-2)


def test_existing_nnx_module_trains_like_its_factory():
    from flax import nnx

    batch = classification_batch(0)
    factory = _losses(UnevenMLP, lambda step: batch, 3, zj.make_mesh(fsdp=8))
    # The factory is called with nnx.Rngs(key(0)); a module built the same way must match it.
    module = UnevenMLP(nnx.Rngs(jax.random.key(0)))
    existing = _losses(module, lambda step: batch, 3, zj.make_mesh(fsdp=8))
    np.testing.assert_allclose(existing, factory, rtol=RTOL, atol=0)
