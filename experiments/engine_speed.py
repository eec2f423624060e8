"""gspmd vs shard_map on simulated CPU devices: traffic, memory and step time for every stage.

    python -m experiments.engine_speed     # 20m GPT, bf16, 8 devices, batch 16 and 8 -> experiments/results/engines.md

Traffic is counted on the HLO right after SPMD partitioning, in units of 2·Ψ·(p-1)/p bytes (b = 2 for
bf16); "CPU-executed" is the final CPU program, where XLA upcasts bf16 collectives to f32. Step times
are medians over `--steps` timed steps (after one warm-up), taken round-robin over all trainers in
one process so that a noisy, shared machine slows every configuration alike.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import tempfile
import time

import numpy as np

from zerojax.accounting.analytic import peak_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="20m")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's n_layers")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 8], help="global batches (rows of seq_len tokens)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per configuration (after 1 warm-up)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "engines.md"))
    args = ap.parse_args()

    from zerojax.core.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)
    from zerojax.models import gpt_config

    overrides = {"n_layers": args.layers} if args.layers else {}
    cfg = gpt_config(args.preset, **overrides)
    sections = [measure(args, cfg, batch) for batch in args.batches]
    write_table(args, cfg, sections)


def measure(args, cfg, rows_per_batch: int) -> tuple[int, list[dict]]:
    import jax
    import optax

    import zerojax as zj
    from zerojax.accounting.hlo import collective_bytes
    from zerojax.accounting.partitioned import partitioned_hlo_text
    from zerojax.models import GPT

    mesh = zj.make_mesh(fsdp=args.devices)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(rows_per_batch, cfg.seq_len + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    b = 2 if args.precision == "bf16" else 4
    unit = b * cfg.num_params() * (args.devices - 1) / args.devices

    configs = [(engine, stage, False) for stage in args.stages for engine in ("gspmd", "shard_map")]
    if 3 in args.stages:
        configs.append(("shard_map", 3, True))
    rows, runs = [], []
    for engine, stage, prefetch in configs:
        options = {"prefetch": True} if prefetch else None
        trainer = zj.Trainer(
            functools.partial(GPT, cfg),
            optax.adamw(1e-4),
            mesh=mesh,
            stage=stage,
            engine=engine,
            precision=args.precision,
            engine_options=options,
        )
        state = trainer.init(jax.random.key(0), batch)
        sharded = trainer.shard_batch(batch)
        lowered = trainer.lower(state, sharded)
        t0 = time.perf_counter()
        hlo = partitioned_hlo_text(lowered, tempfile.mkdtemp(prefix="zerojax-hlo-"))
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        traffic = collective_bytes(hlo)
        cpu = collective_bytes(compiled.as_text())
        state, metrics = compiled(state, sharded)  # warm-up
        jax.block_until_ready(metrics["loss"])
        row = {
            "engine": engine + (" +prefetch" if prefetch else ""),
            "stage": stage,
            "units": traffic["total"] / unit,
            "traffic_mb": traffic["total"] / 1e6,
            "cpu_mb": cpu["total"] / 1e6,
            "peak_mb": peak_bytes(
                mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes, mem.temp_size_in_bytes
            )
            / 1e6,
            "temp_mb": mem.temp_size_in_bytes / 1e6,
            "compile_s": compile_s,
            "times": [],
            "losses": [float(metrics["loss"])],
        }
        print(
            f"batch {rows_per_batch}: built {row['engine']} stage {stage}: {row['units']:.3f} units, "
            f"compile {compile_s:.1f}s",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
        runs.append([compiled, state, sharded])
        del trainer

    _time_round_robin(args.steps, rows, runs)
    return rows_per_batch, rows


def _time_round_robin(steps: int, rows: list[dict], runs: list) -> None:
    """Step every configuration in turn, `steps` rounds; then each row's median and paired ratio."""
    import jax

    for _ in range(steps):  # round-robin: every configuration sees the same machine noise
        for row, run in zip(rows, runs):
            compiled, state, sharded = run
            t0 = time.perf_counter()
            state, metrics = compiled(state, sharded)
            jax.block_until_ready(metrics["loss"])
            row["times"].append(time.perf_counter() - t0)
            row["losses"].append(float(metrics["loss"]))
            run[1] = state
    for row in rows:
        row["median_s"] = float(np.median(row["times"]))
        # Paired with gspmd's step at the same stage in the same round (run just before it): robust
        # to the load of other jobs drifting during the measurement.
        base = next(r for r in rows if r["stage"] == row["stage"] and r["engine"] == "gspmd")
        row["paired"] = float(np.median(np.array(row["times"]) / np.array(base["times"])))
        print(f"{row['engine']:>20} stage {row['stage']}: {row['median_s']:.3f}s", file=sys.stderr)


def write_table(args, cfg, sections) -> None:
    import jax

    unit_mb = 2 * cfg.num_params() * (args.devices - 1) / args.devices / 1e6
    lines = [
        "# gspmd vs shard_map engine (measured)",
        "",
        f"Written by `python -m experiments.engine_speed` on {time.strftime('%Y-%m-%d')}: GPT `{args.preset}`"
        f" ({cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.num_params() / 1e6:.1f}M params), "
        f"{args.precision}, {args.devices} simulated CPU devices (mesh fsdp={args.devices}), sequences of "
        f"{cfg.seq_len} tokens, AdamW; jax {jax.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores "
        "shared with other jobs.",
        "",
        "Traffic per device per step, counted on the HLO right after SPMD partitioning; one unit is "
        f"2·Ψ·(p−1)/p bytes = {unit_mb:.1f} MB (textbook: 2 units at stages 0–2, 3 at stage 3). "
        "*CPU-executed* counts the final CPU program, where XLA upcasts bf16 collectives to f32: it is not the "
        "traffic. Peak = argument + output − alias + temp from `memory_analysis()` (on CPU, bf16 buffers "
        f"around collectives and matmuls are held in f32). Step time: median of {args.steps} steps after a "
        "warm-up, all configurations of a table interleaved step by step in one process.",
        "",
        "With prefetch the next layer's gather sits in a `cond` that is false after the last layer; the "
        "counter counts a conditional's branches on every iteration, so that row shows one layer's "
        "forward gather more than really moves.",
    ]
    for rows_per_batch, rows in sections:
        lines += [
            "",
            f"## global batch {rows_per_batch} x {cfg.seq_len} tokens "
            f"({rows_per_batch * cfg.seq_len // args.devices} per device)",
            "",
            "| stage | engine | traffic (units) | traffic MB | CPU-executed MB | peak MB | temp MB | median step s "
            "| fastest step s | step / gspmd's (paired median) | loss after |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['stage']} | {r['engine']} | {r['units']:.3f} | {r['traffic_mb']:.1f} | "
                f"{r['cpu_mb']:.1f} | {r['peak_mb']:.1f} | {r['temp_mb']:.1f} | {r['median_s']:.3f} | "
                f"{min(r['times']):.3f} | {r['paired']:.3f} | {r['losses'][-1]:.4f} |"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
