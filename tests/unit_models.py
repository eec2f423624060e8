"""The block-stack models the FSDP-unit tests and experiments share: NNX and Linen (compact and
setup-style), L identical blocks of two Linear layers between an input and an output Linear."""

import jax
import numpy as np
import optax
from flax import linen as nn

from tests.models import unrolled_blocks

DEVICES = 8
ROWS = 64
# The two depths whose difference in compiled temp memory the default unit tests read (per added
# block); the slow cases compare 4 and 8 blocks.
SHALLOW, DEEP = 2, 4


class LinenBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(self.width)(jax.nn.gelu(nn.Dense(self.width)(x)))


class LinenDeep(nn.Module):
    """`nn.compact`: the same model as `unrolled_blocks`'s, its blocks created in the call."""

    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        for _ in range(self.depth):
            x = LinenBlock(self.width)(x)
        return nn.Dense(10)(x)


class LinenSetupBlock(nn.Module):
    width: int

    def setup(self):
        self.fc1, self.fc2 = nn.Dense(self.width), nn.Dense(self.width)

    def __call__(self, x):
        return x + self.fc2(jax.nn.gelu(self.fc1(x)))


class LinenSetupDeep(nn.Module):
    """Setup-style: a list of blocks made in `setup`."""

    width: int
    depth: int

    def setup(self):
        self.inp, self.out = nn.Dense(self.width), nn.Dense(10)
        self.blocks = [LinenSetupBlock(self.width) for _ in range(self.depth)]

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class LinenScanBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(self.width)(jax.nn.gelu(nn.Dense(self.width)(x))), None


class LinenScanDeep(nn.Module):
    """The layers as Flax's docs scan them: `nn.scan(nn.remat(Block))` over stacked params."""

    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        stack = nn.scan(
            nn.remat(LinenScanBlock), variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth
        )
        x, _ = stack(self.width, name="layers")(x, None)
        return nn.Dense(10)(x)


MODELS = {"nnx": unrolled_blocks, "linen": LinenDeep, "linen_setup": LinenSetupDeep, "linen_scan": LinenScanDeep}
BLOCK_CLASS = {"nnx": "Block", "linen": "LinenBlock", "linen_setup": "LinenSetupBlock"}


def unit_model(kind: str, width: int, depth: int):
    return MODELS[kind](width, depth)


def unit_batch(width: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.normal(size=(ROWS, width)).astype(np.float32),
        "targets": rng.integers(0, 10, size=(ROWS,)).astype(np.int32),
    }


def block_bytes(width: int, itemsize: int = 4) -> int:
    return itemsize * 2 * (width * width + width)  # two Linear layers


def unit_allowance(width: int, itemsize: int) -> float:
    """What tests/test_units.py's docstring allows each added block: 0.15 of its weights in the
    compute dtype, plus its saved fp32 input."""
    return 0.15 * block_bytes(width, itemsize) + (ROWS // DEVICES) * width * 4


# The optimizers the unit tests and `experiments/unit_depth.py` compile with, by name.
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(1e-2),
    "adamw": lambda: optax.adamw(1e-3),
    "clipped_sgd": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2)),
    "clipped_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
}
