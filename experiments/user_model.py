"""An example of user code trained from a config (configs/user-mlp.yaml): a small NNX classifier and
a memory-mapped-style array source, named as `experiments.user_model:Classifier` and
`experiments.user_model:blobs`. Run from the repository root (the current directory is on the import
path), e.g.

    zerojax train configs/user-mlp.yaml --devices 8 --out runs/user-mlp
    zerojax train configs/user-mlp.yaml --devices 8 --out runs/user-mlp --resume --set train.steps=60
    zerojax launch --processes 2 --devices-per-process 4 -- train configs/user-mlp.yaml --out runs/user-mlp-2p
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from zerojax.data.sources import ArraySource


class Classifier(nnx.Module):
    """features -> hidden -> hidden -> classes, GELU between."""

    def __init__(self, features: int = 32, hidden: int = 128, classes: int = 8, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(features, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x_BxF):
        return self.out(jax.nn.gelu(self.l2(jax.nn.gelu(self.l1(x_BxF)))))


class Block(nnx.Module):
    """A pre-norm residual MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.fc1 = nnx.Linear(width, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, width, rngs=rngs)

    def __call__(self, x):
        return x + self.fc2(jax.nn.gelu(self.fc1(self.norm(x))))


class DeepClassifier(nnx.Module):
    """features -> width, `depth` Blocks in a plain Python list (unscanned), -> classes."""

    def __init__(
        self,
        features: int = 32,
        width: int = 256,
        hidden: int = 1024,
        depth: int = 4,
        classes: int = 8,
        *,
        rngs: nnx.Rngs,
    ):
        self.inp = nnx.Linear(features, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, hidden, rngs=rngs) for _ in range(depth)])
        self.out = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x_BxF):
        x = self.inp(x_BxF)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    @staticmethod
    def num_params(features: int = 32, width: int = 256, hidden: int = 1024, depth: int = 4, classes: int = 8) -> int:
        block = 2 * width + width * hidden + hidden + hidden * width + width
        return features * width + width + depth * block + width * classes + classes


def blobs(
    seed: int, batch_size: int, rows: int = 4096, features: int = 32, classes: int = 8, split: str = "train"
) -> ArraySource:
    """Noisy Gaussian blobs, one per class. The data set is fixed by `split`; `seed` shuffles it.
    For files, use `ArraySource.from_npy({"inputs": "x.npy", "targets": "y.npy"}, ...)` instead."""
    rng = np.random.default_rng(0 if split == "train" else 1)
    centres = np.random.default_rng(42).normal(size=(classes, features)).astype(np.float32)
    labels = rng.integers(0, classes, size=rows).astype(np.int32)
    x = centres[labels] + 1.5 * rng.normal(size=(rows, features)).astype(np.float32)
    return ArraySource({"inputs": x, "targets": labels}, batch_size=batch_size, seed=seed)
