"""Stage 3 `shard_map` against `gspmd`, stepped in turn in one process: wall time and CPU time.

    python -m experiments.cpu_time_pairs [--steps 8] [--layers 8]

With 8 simulated devices on a few cores every step keeps all cores busy, so process CPU time per
step says how much work a program does, and wall time adds what waiting there is. Prints each
engine's medians and the paired ratios (shard_map / gspmd); the order alternates every step.
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()

    from zerojax.core.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    import jax
    import optax

    import zerojax as zj
    from zerojax.models import GPT, gpt_config

    cfg = gpt_config("20m", n_layers=args.layers)
    tokens = np.random.default_rng(0).integers(0, 256, size=(8, cfg.seq_len + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    runs = {}
    for engine in ("gspmd", "shard_map"):
        trainer = zj.Trainer(
            functools.partial(GPT, cfg),
            optax.adamw(1e-4),
            mesh=zj.make_mesh(fsdp=8),
            stage=3,
            engine=engine,
            precision="bf16",
        )
        state, sharded = trainer.init(jax.random.key(0), batch), trainer.shard_batch(batch)
        step = trainer.lower(state, sharded).compile()
        state, metrics = step(state, sharded)  # warm-up
        jax.block_until_ready(metrics["loss"])
        runs[engine] = [step, state, sharded]
    wall, cpu = {e: [] for e in runs}, {e: [] for e in runs}
    for i in range(args.steps):
        for engine in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            step, state, sharded = runs[engine]
            w0, c0 = time.perf_counter(), time.process_time()
            state, metrics = step(state, sharded)
            jax.block_until_ready(metrics["loss"])
            wall[engine].append(time.perf_counter() - w0)
            cpu[engine].append(time.process_time() - c0)
            runs[engine][1] = state
    for engine in runs:
        print(f"{engine:10s} wall {np.median(wall[engine]):.3f} s  cpu {np.median(cpu[engine]):.3f} s")
    ratio = lambda t: float(np.median(np.array(t["shard_map"]) / np.array(t["gspmd"])))  # noqa: E731
    print(f"shard_map / gspmd: wall {ratio(wall):.3f}  cpu {ratio(cpu):.3f}")


if __name__ == "__main__":
    main()
