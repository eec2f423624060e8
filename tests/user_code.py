"""A user's own model and data, outside the zerojax package: what configs name with model.target /
data.target and what `zj.fit` trains in tests/test_user_fit.py."""

from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn
from flax import nnx

from zerojax.data.sources import ArraySource


class MLP(nnx.Module):
    def __init__(self, features: int = 12, hidden: int = 24, classes: int = 4, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(features, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.hidden(x)))


class ReadsAKernel(nnx.Module):
    """Three Linear layers (FSDP units at stages 2-3); the head also reads the first one's kernel
    itself, outside that layer's call."""

    def __init__(self, features: int = 12, hidden: int = 64, classes: int = 4, *, rngs: nnx.Rngs):
        self.a = nnx.Linear(features, hidden, rngs=rngs)
        self.b = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.gelu(self.b(jax.nn.gelu(self.a(x))))
        return self.out(h + jax.nn.gelu(x @ self.a.kernel[...]))


class RegularisedMLP(nnx.Module):
    """BatchNorm statistics and dropout masks: model state and an RNG stream the run must carry."""

    def __init__(self, features: int = 12, hidden: int = 24, classes: int = 4, rate: float = 0.3, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(features, hidden, rngs=rngs)
        self.norm = nnx.BatchNorm(hidden, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.gelu(self.norm(self.hidden(x)))))


class LinenMLP(nn.Module):
    classes: int = 4

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes)(nn.gelu(nn.Dense(24)(x)))


def linen_mlp(classes: int = 4) -> nn.Module:
    return LinenMLP(classes=classes)


class NoisyLinen(nn.Module):
    """Gaussian input noise in training, drawn from an RNG stream of its own name."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        if train:
            x = x + 0.1 * jax.random.normal(self.make_rng("noise"), x.shape)
        return nn.Dense(4)(nn.gelu(nn.Dense(24)(x)))


def blobs(seed: int, batch_size: int, rows: int = 256, features: int = 12, classes: int = 4) -> ArraySource:
    """Gaussian blobs, one per class; the data set is fixed, `seed` only shuffles it."""
    rng = np.random.default_rng(1234)
    labels = rng.integers(0, classes, size=rows).astype(np.int32)
    centres = rng.normal(size=(classes, features)).astype(np.float32) * 2
    x = centres[labels] + rng.normal(size=(rows, features)).astype(np.float32)
    return ArraySource({"inputs": x, "targets": labels}, batch_size=batch_size, seed=seed)


class GatedMLP(nnx.Module):
    """Two inputs, as a dict: features and a per-row gate."""

    def __init__(self, features: int = 12, hidden: int = 24, classes: int = 4, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(features, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, inputs):
        return self.out(jax.nn.gelu(self.hidden(inputs["x"])) * inputs["gate"][:, None])


def gated_blobs(seed: int, batch_size: int) -> ArraySource:
    """`blobs` with a gate per row beside the features: inputs that are a dict of arrays."""
    arrays = blobs(seed, batch_size).arrays
    gate = np.linspace(0.5, 1.5, len(arrays["targets"]), dtype=np.float32)
    return ArraySource(
        {"inputs": {"x": arrays["inputs"], "gate": gate}, "targets": arrays["targets"]},
        batch_size=batch_size,
        seed=seed,
    )


def not_a_model(**kwargs):
    return 3


class NotAModule:  # a model class that forgot its base class
    def __init__(self, rngs):
        self.rngs = rngs


def a_number(rngs):  # a factory taking rngs that returns no module
    return 3


def not_a_source(seed, batch_size):
    return [seed, batch_size]


NOT_CALLABLE = 5


# ---- a user's mistakes, each one line from the CLI ------------------------------------------------


class FlatMLP(MLP):
    """Returns one score per row: no class dimension for the cross-entropy."""

    def __call__(self, x):
        return super().__call__(x).sum(-1)


def per_row_loss(outputs, batch):
    """Per-row losses, not their mean."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(outputs, batch["targets"])


def loss_and_accuracy(outputs, batch):
    """JAX's `has_aux` idiom: the loss and a metric beside it."""
    import jax.numpy as jnp
    import optax

    loss = optax.softmax_cross_entropy_with_integer_labels(outputs, batch["targets"]).mean()
    return loss, jnp.mean(jnp.argmax(outputs, -1) == batch["targets"])


def unlabelled(seed: int, batch_size: int) -> ArraySource:
    """Inputs without targets."""
    return ArraySource({"inputs": blobs(seed, batch_size).arrays["inputs"]}, batch_size=batch_size, seed=seed)
