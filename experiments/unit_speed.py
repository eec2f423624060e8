"""Stage-3 step time of `shard_map` against `gspmd` on user models of FSDP units (tests/unit_models.py).

    python -m experiments.unit_speed [--width 1024] [--depth 8] [--models nnx linen] [--steps 20]

Each model's two programs are stepped in turn in one process (the order alternating every step), so
a noisy, shared machine slows both alike; the ratio is the median of the paired step times. Also
counts the all-gathers of the partitioned HLO (a unit's sharded leaves move in one). bf16, AdamW, 8
simulated CPU devices. Writes experiments/results/unit_speed_jax<version>.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

from experiments.common import cpu_devices

cpu_devices(8)

import jax
import numpy as np

import zerojax as zj
from tests.unit_models import OPTIMIZERS, unit_batch, unit_model
from zerojax.accounting.hlo import collective_bytes
from zerojax.accounting.partitioned import compile_partitioned

ENGINES = ("gspmd", "shard_map")


def build(kind: str, width: int, depth: int, engine: str):
    trainer = zj.Trainer(
        unit_model(kind, width, depth),
        OPTIMIZERS["adamw"](),
        mesh=zj.make_mesh(fsdp=8),
        stage=3,
        engine=engine,
        precision="bf16",
    )
    batch = unit_batch(width)
    state, sharded = trainer.init(jax.random.key(0), batch), trainer.shard_batch(batch)
    compiled, hlo = compile_partitioned(trainer.lower(state, sharded), tempfile.mkdtemp(prefix="zerojax-hlo-"))
    state, metrics = compiled(state, sharded)  # warm-up
    jax.block_until_ready(metrics["loss"])
    row = {
        "model": kind,
        "engine": engine,
        "route": trainer.gather_report().route,
        "gathers": collective_bytes(hlo)["counts"]["all-gather"],
        "temp_mb": compiled.memory_analysis().temp_size_in_bytes / 1e6,
        "times": [],
    }
    return row, [compiled, state, sharded]


def time_pairs(rows: list[dict], runs: list, steps: int) -> None:
    for i in range(steps):
        for row, run in list(zip(rows, runs)) if i % 2 == 0 else list(zip(rows, runs))[::-1]:
            compiled, state, sharded = run
            t0 = time.perf_counter()
            state, metrics = compiled(state, sharded)
            jax.block_until_ready(metrics["loss"])
            row["times"].append(time.perf_counter() - t0)
            run[1] = state
    base = np.array(rows[0]["times"])
    for row in rows:
        row["median_s"] = float(np.median(row["times"]))
        row["paired"] = float(np.median(np.array(row["times"]) / base))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=["nnx", "linen"])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    lines = [
        "# shard_map vs gspmd on FSDP units (measured)",
        "",
        f"Written by `python -m experiments.unit_speed --width {args.width} --depth {args.depth} --steps "
        f"{args.steps}` on {time.strftime('%Y-%m-%d')}: tests/unit_models.py's block stacks ({args.depth} blocks of "
        f"two {args.width}-wide Linear layers), stage 3, bf16, AdamW, 8 simulated CPU devices; jax "
        f"{jax.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores. Step time: median of "
        f"{args.steps} steps, the two engines stepped in turn; all-gathers counted on the partitioned HLO.",
        "",
        "| model | engine | route | all-gathers | temp MB | median step s | step / gspmd's (paired median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in args.models:
        built = [build(kind, args.width, args.depth, engine) for engine in ENGINES]
        rows, runs = [b[0] for b in built], [b[1] for b in built]
        time_pairs(rows, runs, args.steps)
        for r in rows:
            lines.append(
                f"| {r['model']} | {r['engine']} | {r['route']} | {r['gathers']} | {r['temp_mb']:.1f} | "
                f"{r['median_s']:.3f} | {r['paired']:.3f} |"
            )
            print(lines[-1], file=sys.stderr)
    out = os.path.join(os.path.dirname(__file__), "results", f"unit_speed_jax{jax.__version__}.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
