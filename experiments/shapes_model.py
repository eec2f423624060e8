"""The ResNet-style CNN (BatchNorm + Dropout) and generated shape images of experiments/resnet_shapes.py,
importable without side effects, so a config can name them (configs/resnet-shapes.yaml):

    zerojax train configs/resnet-shapes.yaml --devices 8 --out runs/resnet-shapes
    zerojax train configs/resnet-shapes.yaml --devices 8 --out runs/resnet-shapes --resume --set train.steps=120
    zerojax launch --processes 2 --devices-per-process 4 -- train configs/resnet-shapes.yaml --out runs/resnet-2p
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from zerojax.data.sources import ArraySource

SIZE, CLASSES = 16, 4


def shapes(n: int, seed: int) -> dict:
    """`n` noisy 16x16 images of one of four shapes, NHWC float32, and their labels."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:SIZE, :SIZE]
    images = np.zeros((n, SIZE, SIZE), np.float32)
    labels = rng.integers(0, CLASSES, n).astype(np.int32)
    for i, label in enumerate(labels):
        r = rng.integers(3, 6)
        cy, cx = rng.integers(r, SIZE - r, size=2)
        dy, dx = np.abs(yy - cy), np.abs(xx - cx)
        if label == 0:  # square outline
            img = np.maximum(dy, dx) == r
        elif label == 1:  # filled disc
            img = dy**2 + dx**2 <= r**2
        elif label == 2:  # cross
            img = ((dy == 0) & (dx <= r)) | ((dx == 0) & (dy <= r))
        else:  # diagonal bar
            img = (np.abs((yy - cy) - (xx - cx)) <= 0) & (dy <= r)
        images[i] = img
    images += rng.normal(0, 0.9, images.shape).astype(np.float32)
    return {"inputs": images[..., None], "targets": labels}


class ResBlock(nnx.Module):
    def __init__(self, ch: int, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(ch, ch, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(ch, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(ch, ch, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(ch, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        return jax.nn.relu(x + self.bn2(self.conv2(y)))


class ResNet(nnx.Module):
    """stem conv -> 2 residual blocks -> pool -> 2 residual blocks -> global pool -> dropout -> dense."""

    def __init__(self, rngs: nnx.Rngs, ch: int = 24):
        self.stem = nnx.Conv(1, ch, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(ch, momentum=0.9, rngs=rngs)
        self.blocks = nnx.List([ResBlock(ch, rngs) for _ in range(4)])
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(ch, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.bn(self.stem(x)))
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        return self.head(self.drop(x.mean(axis=(1, 2))))


def shapes_source(seed: int, batch_size: int, split: str = "train", images: int = 2560) -> ArraySource:
    """A batch source of generated shapes: the training set (drawn with seed 0) shuffled by `seed`,
    or the fixed held-out set (`split="eval"`, 512 images drawn with seed 1)."""
    data = shapes(images, seed=0) if split == "train" else shapes(512, seed=1)
    return ArraySource(data, batch_size=batch_size, seed=seed)
