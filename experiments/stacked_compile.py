"""Compile time against depth: a `zj.Stacked` of blocks vs the same blocks unrolled in an `nnx.List`.

    python experiments/stacked_compile.py [--width 256] [--depths 8 16 32] [--engines shard_map gspmd]

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
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from tests.test_stacked import _batch, _stacked, _unrolled  # noqa: E402

MiB = 2**20
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def measure(kind: str, width: int, depth: int, engine: str) -> dict:
    model = (_stacked if kind == "stacked" else _unrolled)(width, depth)
    trainer = zj.Trainer(model, optax.sgd(1e-2), mesh=zj.make_mesh(fsdp=8), stage=3, engine=engine, precision="fp32")
    batch = _batch(width)
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
        "Written by `python experiments/stacked_compile.py`.",
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
