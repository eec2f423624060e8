"""Compile time of the zerojax step against a plain `jax.jit` step of the same model and optimizer.

    python -m experiments.compile_time [--blocks 4 8 16] [--stages 0 1 2 3] [--engines gspmd shard_map]
                                       [--optimizers adamw_clip sgd] [--checked] [--phases]
                                       [--repeat N] [--variants] [--by-hand]

The model is a user's unrolled NNX decoder: an `nnx.List` of pre-norm blocks (causal self-attention
and an MLP, LayerNorms), width 128, vocabulary 256, sequence 64, batch 16, on 8 simulated CPU
devices. The plain step is `value_and_grad` and the optax update under one `jax.jit`, the batch
sharded over the devices and everything else replicated: the floor a data-parallel user starts from.
Each figure is trace + lower + compile in one process with no persistent cache. `--repeat N`
compiles each lowered program N times and keeps the fastest compile (XLA's compile varies by a
tenth from one process to the next; repeats within one process agree closely). A one-block plain
step is compiled first, untimed: a process's first trace and compile pay one-off costs (zerojax's own
first-use costs still fall on the first zerojax cell). `--variants` adds
stage-3 cells with public options that leave parts of the stage-3 step out, to show where its
compile time goes. `--by-hand` adds the same plain step with each parameter and its optimizer state
split over the devices (FSDP written by hand under GSPMD: the partitioner's gathers and reductions,
without units, the skipped non-finite step or the update's in-place order). Appends its table to
experiments/results/compile_time.md (`--out`), under a dated heading.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from experiments.common import cpu_devices

cpu_devices(8)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj

WIDTH, VOCAB, SEQ, BATCH, HEADS = 128, 256, 64, 16, 4
OPTIMIZERS = {
    "adamw_clip": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "sgd": lambda: optax.sgd(1e-2),
}


class DecoderBlock(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x_BxLxD):
        mask = nnx.make_causal_mask(x_BxLxD[..., 0])
        x_BxLxD = x_BxLxD + self.attn(self.norm1(x_BxLxD), mask=mask)
        return x_BxLxD + self.down(jax.nn.gelu(self.up(self.norm2(x_BxLxD))))


def decoder(depth: int):
    class Decoder(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            self.blocks = nnx.List([DecoderBlock(WIDTH, rngs=rngs) for _ in range(depth)])
            self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

        def __call__(self, tokens_BxL):
            x = self.embed(tokens_BxL)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return Decoder


def batch() -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def plain_seconds(depth: int, optimizer: str, by_hand_fsdp: bool = False) -> tuple[float, float, float]:
    """Trace, lower and compile a plain data-parallel `jax.jit` step of the same model; with
    `by_hand_fsdp`, each parameter and optimizer-state leaf split over the devices along its first
    dimension they divide (replicated where none does), the step itself unchanged."""
    model = decoder(depth)(rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = OPTIMIZERS[optimizer]()
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def placed(x):
        split = [i for i, size in enumerate(x.shape) if size % len(devices) == 0] if by_hand_fsdp else []
        return NamedSharding(mesh, P(*[None] * split[0], "data")) if split else replicated

    params = jax.device_put(params, jax.tree.map(placed, params))
    opt_state = tx.init(params)
    opt_state = jax.device_put(opt_state, jax.tree.map(placed, opt_state))
    data = jax.device_put(batch(), rows)

    def loss_of(p, b):
        logits = nnx.merge(graphdef, p)(b["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), b["targets"]).mean()

    @jax.jit
    def step(p, o, b):
        loss, grads = jax.value_and_grad(loss_of)(p, b)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    return timed(step, params, opt_state, data)


REPEAT = 1  # compiles of each lowered program; the fastest is reported (`--repeat`)


def timed(jitted, *args) -> tuple[float, float, float]:
    """Seconds to trace, lower and compile `jitted` for `args` (the fastest of `REPEAT` compiles)."""
    start = time.perf_counter()
    traced = jitted.trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiles = []
    for attempt in range(REPEAT):
        began = time.perf_counter()
        # A fresh value of an option that only shapes debug text: JAX would otherwise return the first
        # executable from its in-memory cache instead of compiling again (the persistent cache, which
        # leaves such options out of its key, is off: `main`).
        lowered.compile(compiler_options={"xla_debug_buffer_assignment_show_max": 1_000_000 + attempt})
        compiles.append(time.perf_counter() - began)
    return traced_at - start, lowered_at - traced_at, min(compiles)


# Stage-3 cells with public options that each leave part of the step out (`--variants`).
VARIANTS = {
    "s3 remat none": {"wrap": zj.WrapRule(remat="none")},  # units keep their activations: no recompute
    "s3 keep weights": {"reshard_after_forward": False},  # no re-gather, no recompute
    "s3 no units": {"wrap": "none"},  # the whole model gathered at once
}


def zerojax_seconds(
    depth: int, stage: int, engine: str, optimizer: str, checked: bool = False, options: dict | None = None
) -> tuple[float, float, float]:
    """Trace, lower and compile the zerojax step (state initialised first, outside the timing);
    `checked`: with the engine option `checked_update` (the new state checked before it is written);
    `options`: further engine options."""
    trainer = zj.Trainer(
        decoder(depth),
        OPTIMIZERS[optimizer](),
        mesh=zj.make_mesh(fsdp=8),
        stage=stage,
        engine=engine,
        engine_options={"checked_update": checked, **(options or {})},
    )
    b = batch()
    state = trainer.init(jax.random.key(0), b)
    return timed(trainer.prepared.step_fn, state, trainer.shard_batch(b))


def _phases(phases: tuple[float, float, float]) -> str:
    return " " + " + ".join(f"{x:.1f}" for x in phases)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--engines", nargs="+", default=["gspmd", "shard_map"])
    ap.add_argument("--optimizers", nargs="+", default=["adamw_clip", "sgd"])
    ap.add_argument("--checked", action="store_true", help="the engine option checked_update=True")
    ap.add_argument("--phases", action="store_true", help="each cell's trace + lower + compile seconds too")
    ap.add_argument("--repeat", type=int, default=1, help="compiles per program; the fastest is reported")
    ap.add_argument("--variants", action="store_true", help="stage-3 cells leaving parts of the step out")
    ap.add_argument("--by-hand", action="store_true", help="a column for the plain step with FSDP by hand")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "compile_time.md"))
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    global REPEAT
    REPEAT = args.repeat
    jax.config.update("jax_enable_compilation_cache", False)
    cells_of = [("fsdp by hand", None, None, None)] if args.by_hand else []
    cells_of += [(f"{e} s{s}", e, s, None) for e in args.engines for s in args.stages]
    if args.variants:
        cells_of += [(f"{e} {name}", e, 3, options) for e in args.engines for name, options in VARIANTS.items()]
    plain_seconds(1, args.optimizers[0])  # warm-up: a process's first trace and compile pay one-off costs
    rows = []
    for optimizer in args.optimizers:
        for depth in args.blocks:
            plain_phases = plain_seconds(depth, optimizer)
            plain = sum(plain_phases)
            cells = []
            for name, engine, stage, options in cells_of:
                if engine is None:  # the `--by-hand` column
                    phases = plain_seconds(depth, optimizer, by_hand_fsdp=True)
                else:
                    phases = zerojax_seconds(depth, stage, engine, optimizer, args.checked, options)
                s = sum(phases)
                cells.append(f"{s:.1f} ({s / plain:.1f}x)" + (_phases(phases) if args.phases else ""))
                print(f"{optimizer} blocks={depth} plain={plain:.1f}s {name}: {s:.1f}s", flush=True)
            first = f"{plain:.1f}" + (_phases(plain_phases) if args.phases else "")
            rows.append(f"| {optimizer} | {depth} | {first} | " + " | ".join(cells) + " |")
    head = [name for name, *_ in cells_of]
    lines = [
        f"Compile seconds (trace + lower + compile, cold, one process), jax {jax.__version__}, 8 simulated CPU "
        f"devices; NNX decoder width {WIDTH}, vocabulary {VOCAB}, sequence {SEQ}, batch {BATCH}; "
        "in brackets: over the plain `jax.jit` data-parallel step of the same model and optimizer"
        + (" (engine option checked_update=True)" if args.checked else "")
        + (f"; compile: the fastest of {args.repeat} in the process" if args.repeat > 1 else "")
        + ("; then trace + lower + compile." if args.phases else "."),
        "",
        "| optimizer | blocks | plain | " + " | ".join(head) + " |",
        "|---|---|---|" + "---|" * len(head),
        *rows,
    ]
    # Appended under a dated heading: the file keeps every earlier run's table and what it showed.
    command = " ".join(["python -m experiments.compile_time", *sys.argv[1:]])
    with open(args.out, "a") as f:
        f.write(f"\nRun of {datetime.date.today()} (`{command}`):\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
