"""Compile time against depth: a `zj.Stacked` of blocks vs the same blocks unrolled in an `nnx.List`.

    python -m experiments.stacked_compile [--width 256] [--depths 8 16 32] [--engines shard_map gspmd]

For each engine and depth, one stage-3 train step (fp32, plain SGD, 8 simulated CPU devices) is
lowered and compiled for each model, the two side by side in the same run; the time is the wall
seconds of `trainer.lower(...)` (tracing the model included) plus `.compile()`. Also reports each
program's temp bytes per device and the gather route. Writes experiments/results/stacked_compile.json
and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from experiments.common import RESULTS, MiB, cpu_devices

cpu_devices(8)

import jax
import optax

import zerojax as zj
from tests.models import classification_batch, stacked_blocks, unrolled_blocks


def measure(kind: str, width: int, depth: int, engine: str) -> dict:
    model = (stacked_blocks if kind == "stacked" else unrolled_blocks)(width, depth)
    trainer = zj.Trainer(model, optax.sgd(1e-2), mesh=zj.make_mesh(fsdp=8), stage=3, engine=engine, precision="fp32")
    batch = classification_batch(rows=64, features=width)
    state = trainer.init(jax.random.key(0), batch)
    batch = trainer.shard_batch(batch)
    start = time.perf_counter()
    lowered = trainer.lower(state, batch)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    return {
        "model": kind,
        "engine": engine,
        "depth": depth,
        "width": width,
        "lower_s": traced - start,
        "compile_s": done - traced,
        "total_s": done - start,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "route": trainer.gather_report().route,
    }


def table(rows: list[dict], depths: list[int]) -> list[str]:
    lines = [
        "| engine | model | route | " + " | ".join(f"L = {d}" for d in depths) + " |",
        "|---|---|---|" + "---|" * len(depths),
    ]
    for engine in dict.fromkeys(r["engine"] for r in rows):
        for kind, name in (("stacked", "`zj.Stacked`"), ("unrolled", "`nnx.List`")):
            cells = {r["depth"]: r for r in rows if r["engine"] == engine and r["model"] == kind}
            route = next(iter(cells.values()))["route"]
            lines.append(
                f"| {engine} | {name} | {route} | "
                + " | ".join(f"{cells[d]['total_s']:.2f} s ({cells[d]['temp_bytes'] / MiB:.2f} MiB)" for d in depths)
                + " |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--engines", nargs="+", default=["shard_map", "gspmd"])
    ap.add_argument("--out", default=os.path.join(RESULTS, "stacked_compile"))
    args = ap.parse_args()
    rows = []
    for engine in args.engines:
        for depth in args.depths:
            for kind in ("stacked", "unrolled"):
                rows.append(measure(kind, args.width, depth, engine))
                print(json.dumps(rows[-1]), flush=True)
    env = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    lines = [
        f"Stage-3 train step, lower + compile wall seconds (temp MiB per device): width {args.width}, "
        f"blocks of 2 Linear, fp32, SGD, 8 simulated CPU devices; jax {env['jax']}, {env['cpus']} CPUs, "
        f"load average {env['load_average']:.1f} at the end (a shared machine: compare within a column).",
        "",
        *table(rows, args.depths),
        "",
        "Written by `python -m experiments.stacked_compile`.",
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
