"""Compile-only helpers: lower a trainer's step without allocating or initialising any state."""

from __future__ import annotations

import jax
import numpy as np

KEY = jax.random.key(0)


def abstract_batch(trainer, batch: dict) -> dict:
    """`batch` as ShapeDtypeStructs placed as the trainer places a global batch."""
    return {
        k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=trainer.batch_sharding)
        for k, v in batch.items()
    }


def lower_abstract(trainer, batch: dict, key=KEY):
    """The trainer's jitted step lowered from the abstract state `init(key, batch)` would build (its
    shapes, dtypes and shardings): the same program `step` compiles, with no init run."""
    prepared = trainer.prepare(key, batch)
    return prepared.step_fn.lower(prepared.abstract, abstract_batch(trainer, batch))
