"""Your own `jax.jit` (or `nnx.jit`) loop at ZeRO stage 3, with zerojax's shardings: `zj.shard`.

    python -m experiments.own_loop [--steps 5] [--stage 3] [--engine gspmd]

A model of uneven shapes (no dimension divisible by the 8 simulated devices) trained three ways on
the same data: a hand-written `jax.jit` step, the same under `nnx.jit`, and `zj.Trainer`. Prints each
loop's losses and the largest difference from `Trainer`'s.
"""

from __future__ import annotations

import argparse

from experiments.common import cpu_devices

cpu_devices(8)

import jax
import numpy as np
import optax
from flax import nnx

import zerojax as zj


class Uneven(nnx.Module):
    """13 features -> 61 -> 11 classes: no dimension the 8 devices divide; the kernels are padded and sharded."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(13, 61, rngs=rngs)
        self.out = nnx.Linear(61, 11, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.hidden(x)))


def batches(steps: int, rows: int = 16) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "inputs": rng.normal(size=(rows, 13)).astype(np.float32),
            "targets": rng.integers(0, 11, rows).astype(np.int32),
        }
        for _ in range(steps)
    ]


def own_loop(jit, data: list[dict], stage: int, engine: str) -> list[float]:
    """The zerojax calls a hand-written loop needs: `zj.shard`, `init`, `step`, `shard_batch`."""
    mesh = zj.make_mesh(fsdp=8)
    core = zj.shard(Uneven, optax.adamw(1e-2), data[0], mesh=mesh, stage=stage, engine=engine)
    state = core.init(jax.random.key(0))
    # nnx.jit takes no compiler options; they change how XLA groups collectives, not the values
    options = {"compiler_options": core.compiler_options} if jit is jax.jit else {}
    step = jit(core.step, donate_argnums=0, **options)
    losses = []
    for batch in data:
        state, metrics = step(state, core.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses


def trainer_loop(data: list[dict], stage: int, engine: str) -> list[float]:
    trainer = zj.Trainer(Uneven, optax.adamw(1e-2), mesh=zj.make_mesh(fsdp=8), stage=stage, engine=engine)
    state = trainer.init(jax.random.key(0), data[0])
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


def main(steps: int = 5, stage: int = 3, engine: str = "gspmd") -> dict[str, float]:
    data = batches(steps)
    reference = trainer_loop(data, stage, engine)
    diffs = {}
    for name, jit in (("jax.jit", jax.jit), ("nnx.jit", nnx.jit)):
        losses = own_loop(jit, data, stage, engine)
        diffs[name] = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"{name}: losses {[round(x, 6) for x in losses]}; largest difference from Trainer's {diffs[name]:.2e}")
    print(f"Trainer: losses {[round(x, 6) for x in reference]}")
    return diffs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--engine", default="gspmd", choices=("gspmd", "shard_map"))
    args = parser.parse_args()
    main(args.steps, args.stage, args.engine)
