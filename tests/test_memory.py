"""Per-device persistent state equals the textbook ZeRO figure at each stage (20M-parameter GPT)."""

import functools

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax.models.gpt import GPT, gpt_config

P = 8
CFG = gpt_config("20m")
PSI = CFG.num_params()
# Textbook bytes per device for Adam, excluding gradients (not kept between steps).
EXPECTED = {
    "fp32": [12 * PSI, 4 * PSI + 8 * PSI / P, 4 * PSI + 8 * PSI / P, 12 * PSI / P],
    "bf16": [14 * PSI, 2 * PSI + 12 * PSI / P, 2 * PSI + 12 * PSI / P, 12 * PSI / P],
}


@functools.lru_cache(maxsize=None)
def _persistent_bytes(stage: int, precision: str) -> int:
    trainer = zj.Trainer(functools.partial(GPT, CFG), optax.adam(1e-3), mesh=zj.make_mesh(fsdp=P),
                         stage=stage, precision=precision)
    batch = {"inputs": np.zeros((P, 16), np.int32), "targets": np.zeros((P, 16), np.int32)}
    state = trainer.init(jax.random.key(0), batch)
    measured = trainer.persistent_bytes_per_device(state)
    del state
    return measured


def test_model_is_at_least_20m_parameters():
    assert PSI >= 20e6


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_persistent_bytes_match_textbook(stage, precision):
    measured = _persistent_bytes(stage, precision)
    assert measured == pytest.approx(EXPECTED[precision][stage], rel=0.01)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_3_holds_at_least_7_5x_less_than_stage_0(precision):
    assert _persistent_bytes(0, precision) / _persistent_bytes(3, precision) >= 7.5
