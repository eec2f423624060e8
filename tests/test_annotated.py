"""Models annotated the way Flax's sharding guides write them (`nnx.with_partitioning`,
`nn.with_logical_partitioning`) train at every stage: the names are metadata zerojax lays out itself,
so the model needs no mesh context to be built (tensor parallelism over the same names:
tests/test_tensor_parallel.py)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zerojax as zj

STEPS = 2


class AnnotatedNNX(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(64, 4, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class AnnotatedLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        return nn.Dense(4, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(nn.gelu(h))


def _model(kind: str):
    return AnnotatedNNX if kind == "nnx" else AnnotatedLinen()


def _batch():
    rng = np.random.default_rng(0)
    return {"inputs": rng.normal(size=(16, 16)).astype(np.float32), "targets": rng.integers(0, 4, 16).astype(np.int32)}


def _losses(kind: str, stage: int, engine: str) -> list[float]:
    trainer = zj.Trainer(_model(kind), optax.adamw(1e-2), mesh=zj.make_mesh(fsdp=8), stage=stage, engine=engine)
    state, batch, losses = trainer.init(jax.random.key(0), _batch()), _batch(), []
    for _ in range(STEPS):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize(
    "kind, engine",
    [
        ("nnx", "shard_map"),
        ("linen", "gspmd"),
        pytest.param("nnx", "gspmd", marks=pytest.mark.slow),
        pytest.param("linen", "shard_map", marks=pytest.mark.slow),
    ],
)
def test_an_annotated_model_trains_at_stage_3_like_stage_0(kind, engine):
    reference = _losses(kind, 0, "gspmd")
    np.testing.assert_allclose(_losses(kind, 3, engine), reference, rtol=1e-5, atol=0)
    assert reference[1] < reference[0]
