"""Temp memory of the stage-3 step against depth for user models of L identical blocks: an NNX model
(an `nnx.List` of blocks) and a Linen one (`nn.compact`), the models of tests/unit_models.py.

    python -m experiments.unit_depth [--width 256] [--depths 4 8 16] [--models nnx linen]
                                     [--precisions fp32 bf16] [--optimizers adamw sgd clipped_adamw]
                                     [--checked] [--out FILE]

Compiles only (no step runs): temp and peak bytes per device from `memory_analysis()`, 8 simulated
CPU devices, AdamW, plain SGD (whose only sharded temporaries are the gradient shards) and AdamW after
global-norm clipping (the configs' default, which makes every gradient wait for the whole backward
pass). `--checked`: with the engine option `checked_update` (the new state checked before it is
written; docs/engines.md). Writes experiments/results/unit_depth.md.
"""

from __future__ import annotations

import argparse
import os

from experiments.common import MiB, cpu_devices

cpu_devices(8)

import jax

import zerojax as zj
from tests.unit_models import OPTIMIZERS, unit_batch, unit_model


def measure(kind, width, depth, stage, engine, optimizer, precision, checked=False):
    trainer = zj.Trainer(
        unit_model(kind, width, depth),
        OPTIMIZERS[optimizer](),
        mesh=zj.make_mesh(fsdp=8),
        stage=stage,
        engine=engine,
        precision=precision,
        engine_options={"checked_update": checked},
    )
    batch = unit_batch(width)
    state = trainer.init(jax.random.key(0), batch)
    m = trainer.lower(state, trainer.shard_batch(batch)).compile().memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return m.temp_size_in_bytes, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--models", nargs="+", default=["nnx", "linen"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "sgd", "clipped_adamw"])
    ap.add_argument("--engines", nargs="+", default=["shard_map", "gspmd"])
    ap.add_argument("--checked", action="store_true", help="the engine option checked_update=True")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "unit_depth.md"))
    args = ap.parse_args()
    block = 4 * 2 * (args.width**2 + args.width) / MiB  # fp32 bytes of a block's weights
    lines = [
        f"width {args.width}, blocks of 2 Linear ({block:.2f} MiB fp32, {block / 2:.2f} MiB bf16 a block), "
        f"stage 3, 8 devices; temp MiB per device (peak MiB); growth in blocks of the compute dtype"
        + ("; engine option checked_update=True" if args.checked else ""),
        "",
        "| model | precision | engine | optimizer | "
        + " | ".join(f"L = {d}" for d in args.depths)
        + " | temp growth per block |",
        "|---|---|---|---|" + "---|" * (len(args.depths) + 1),
    ]
    for kind in args.models:
        for precision in args.precisions:
            compute_block = block / 2 if precision == "bf16" else block
            for engine in args.engines:
                for optimizer in args.optimizers:
                    rows = [
                        measure(kind, args.width, d, 3, engine, optimizer, precision, args.checked) for d in args.depths
                    ]
                    per_block = (rows[-1][0] - rows[0][0]) / (args.depths[-1] - args.depths[0]) / MiB
                    cells = " | ".join(f"{t / MiB:.3f} ({p / MiB:.3f})" for t, p in rows)
                    lines.append(
                        f"| {kind} | {precision} | {engine} | {optimizer} | {cells} | {per_block:.3f} MiB"
                        f" = {per_block / compute_block:.2f} blocks |"
                    )
                    print(lines[-1], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
