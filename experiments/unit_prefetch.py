"""What one-unit-ahead prefetch (`prefetch=True`) costs a user model at stage 3: compiled temp bytes per
device at L blocks with prefetch on and off, and the step time with it over without, paired.

    python -m experiments.unit_prefetch [--width 256] [--depths 4 8 16] [--models nnx linen]
                                        [--engines shard_map gspmd] [--precision fp32] [--steps 20]

The models of tests/unit_models.py (an input Linear, L blocks of two Linear, an output Linear; NNX
`nnx.List` or Linen `nn.compact`), plain SGD, stage 3, 8 simulated CPU devices, global batch 64.
Step times: both programs of a row run alternately, one step each per round, after one warm-up
step; the ratio is the median over rounds of (time with prefetch) / (time without), so a noisy,
shared machine slows both alike. Writes experiments/results/unit_prefetch.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from experiments.common import MiB, cpu_devices

cpu_devices(8)

import jax
import numpy as np
import optax

import zerojax as zj
from tests.unit_models import unit_batch, unit_model


def prepared(kind, width, depth, engine, precision, prefetch):
    trainer = zj.Trainer(
        unit_model(kind, width, depth),
        optax.sgd(1e-2),
        mesh=zj.make_mesh(fsdp=8),
        stage=3,
        engine=engine,
        precision=precision,
        engine_options={"prefetch": prefetch},
    )
    batch = unit_batch(width)
    state = trainer.init(jax.random.key(0), batch)
    temp = trainer.compile(state, batch).memory_analysis().temp_size_in_bytes  # `step` reuses this program
    assert trainer.gather_report().description.endswith("next unit prefetched") == prefetch
    return trainer, state, trainer.shard_batch(batch), temp


def paired_ratio(runs, steps: int) -> tuple[float, list[float]]:
    """Median over rounds of t(prefetch) / t(without); `runs`: [without, with], each (trainer, state, batch)."""
    states = [state for _, state, _ in runs]
    times = [[], []]
    for round_ in range(steps + 1):
        for i, (trainer, _, batch) in enumerate(runs):
            t0 = time.perf_counter()
            states[i], metrics = trainer.step(states[i], batch)
            jax.block_until_ready(metrics["loss"])
            if round_:  # the first round warms up
                times[i].append(time.perf_counter() - t0)
    ratios = np.array(times[1]) / np.array(times[0])
    return float(np.median(ratios)), [float(np.median(t)) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--models", nargs="+", default=["nnx"])
    ap.add_argument("--engines", nargs="+", default=["shard_map", "gspmd"])
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "unit_prefetch.md"))
    args = ap.parse_args()
    itemsize = 2 if args.precision == "bf16" else 4
    block = itemsize * 2 * (args.width**2 + args.width) / MiB  # a block's weights in the compute dtype
    lines = [
        f"width {args.width}, blocks of 2 Linear ({block:.2f} MiB a block in {args.precision}), stage 3, SGD, "
        f"8 simulated CPU devices, jax {jax.__version__}, {platform.machine()}; temp MiB per device; step time: "
        f"median over {args.steps} paired rounds",
        "",
        "| model | engine | L | temp, prefetch off | temp, prefetch on | on − off | step ms off / on "
        "| step time on / off (paired median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in args.models:
        for engine in args.engines:
            for depth in args.depths:
                runs = [prepared(kind, args.width, depth, engine, args.precision, p) for p in (False, True)]
                ratio, medians = paired_ratio([r[:3] for r in runs], args.steps)
                off, on = runs[0][3] / MiB, runs[1][3] / MiB
                lines.append(
                    f"| {kind} | {engine} | {depth} | {off:.3f} | {on:.3f} | {on - off:.3f} "
                    f"({(on - off) / block:.2f} blocks) | {1e3 * medians[0]:.1f} / {1e3 * medians[1]:.1f} "
                    f"| {ratio:.3f} |"
                )
                print(lines[-1], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
