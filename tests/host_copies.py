"""Host copies of a trainer's state, for tests that compare states across layouts."""

from __future__ import annotations

import jax
import numpy as np


def logical_params(trainer, state) -> dict:
    """The master params on the host in their logical shapes: each leaf gathered, its padding cropped."""
    return jax.tree.map(
        lambda l, x: np.asarray(x)[tuple(slice(0, s) for s in l.shape)],
        trainer.layout.leaves,
        state.params,
        is_leaf=lambda x: hasattr(x, "padded_shape"),
    )


def trained(trainer, batches, steps: int):
    """(losses, logical params before, after) of `steps` steps on `batches(step)` from key 0."""
    state = trainer.init(jax.random.key(0), batches(0))
    initial, losses = logical_params(trainer, state), []
    for step in range(steps):
        state, metrics = trainer.step(state, batches(step))
        losses.append(float(metrics["loss"]))
    return losses, initial, logical_params(trainer, state)
