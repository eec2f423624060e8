"""Small user-written models for parity tests: uneven shapes no fsdp size divides."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import linen as nn
from flax import nnx

import zerojax as zj
from zerojax.models.gpt import GPT, gpt_config


class UnevenMLP(nnx.Module):
    """37 -> 129 -> 10: no dimension divisible by 8, so the big leaves are padded."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(37, 129, rngs=rngs)
        self.out = nnx.Linear(129, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.hidden(x)))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(96)(x))
        return nn.Dense(10)(nn.gelu(nn.Dense(40)(x)))


class Block(nnx.Module):
    """A residual MLP block, x + fc2(gelu(fc1(x))), with optional BatchNorm and Dropout inside."""

    def __init__(self, width: int, rngs: nnx.Rngs, *, drop: float = 0.0, norm: bool = False):
        self.fc1 = nnx.Linear(width, width, rngs=rngs)
        self.fc2 = nnx.Linear(width, width, rngs=rngs)
        self.drop = nnx.Dropout(drop, rngs=rngs) if drop else None
        self.norm = nnx.BatchNorm(width, rngs=rngs) if norm else None

    def __call__(self, x, scale=1.0):
        h = jax.nn.gelu(self.fc1(x))
        if self.norm is not None:
            h = self.norm(h)
        if self.drop is not None:
            h = self.drop(h)
        return x + scale * self.fc2(h)


def unrolled_blocks(width: int, depth: int):
    """A model class: an input Linear, a plain `nnx.List` of `depth` Blocks, an output Linear (10)."""

    class Deep(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.inp = nnx.Linear(width, width, rngs=rngs)
            self.blocks = nnx.List([Block(width, rngs) for _ in range(depth)])
            self.out = nnx.Linear(width, 10, rngs=rngs)

        def __call__(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    return Deep


def stacked_blocks(width: int, depth: int, **block_kwargs):
    """`unrolled_blocks` with the blocks as one `zj.Stacked` (scanned, gathered a layer at a time)."""

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.inp = nnx.Linear(width, width, rngs=rngs)
            self.blocks = zj.Stacked(Block, depth, width, rngs=rngs, **block_kwargs)
            self.out = nnx.Linear(width, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(self.blocks(self.inp(x)))

    return Model


def classification_batch(seed: int = 0, rows: int = 16, features: int = 37) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.normal(size=(rows, features)).astype(np.float32),
        "targets": rng.integers(0, 10, size=(rows,)).astype(np.int32),
    }


def tiny_gpt(**overrides):
    cfg = gpt_config("tiny", **overrides)
    return functools.partial(GPT, cfg), cfg


@functools.lru_cache(maxsize=1)
def _corpus_stream(rows: int, seq_len: int):
    from zerojax.data.corpus import BatchStream, load_corpus

    return BatchStream(load_corpus(None, max_bytes=2**20), seq_len=seq_len, global_batch=rows, seed=7)


def token_batch(step: int, rows: int = 16, seq_len: int = 32) -> dict:
    """Real text (the standard library's sources), so the loss really falls."""
    return _corpus_stream(rows, seq_len).host_batch(step)


def train_on_stream(trainer, state, stream, steps):
    """Train `state` on `stream`'s batches at `steps`; (the new state, the losses)."""
    losses = []
    for i in steps:
        state, metrics = trainer.step(state, stream.host_batch(i))
        losses.append(float(metrics["loss"]))
    return state, losses
