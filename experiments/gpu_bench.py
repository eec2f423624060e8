"""Tokens/s, TFLOP/s and MFU of the shipped ~1B GPT in bf16 on one GPU, at each ZeRO stage.

With one device there is nothing to shard or communicate (p = 1), so this measures the step's compute
efficiency as each stage's program lays it out. FLOPs per step are `flops_per_step` (6 per parameter
per token plus causal attention; full remat's recomputed forward is not counted, as MFU conventions
don't); MFU divides by the GPU's dense bf16 peak from `zerojax.accounting.hardware`.

Runs only where JAX sees a GPU; elsewhere it exits with status 2 and leaves the recorded result as it
is. On a GPU it writes experiments/results/gpu_bench.{md,json}, saying where and when it ran.

    python -m experiments.gpu_bench [--micro-batch 4] [--steps 10] [--stages 0,1,2,3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

from experiments.common import RESULTS

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "tiny.yaml")
KINDS = {"H200": "h200", "H100": "h100", "A100": "a100"}  # device_kind substring -> hardware table


def hardware_for(device_kind: str):
    from zerojax.accounting.hardware import get_hardware

    for needle, name in KINDS.items():
        if needle in device_kind:
            return get_hardware(name)
    return None


def bench(stage: int, micro_batch: int, steps: int, warmup: int, remat: str | None = None) -> dict:
    import jax

    from zerojax.accounting.analytic import flops_per_step
    from zerojax.cli.config import load_config
    from zerojax.cli.experiment import build_experiment

    c = load_config(
        CONFIG,
        [
            "model.preset=1b",
            "precision=bf16",
            f"zero.stage={stage}",
            "mesh.fsdp=1",
            f"train.batch_size={micro_batch}",
            f"train.steps={steps + warmup}",
            "data.eval_fraction=0",
            *([f"model.remat={remat}"] if remat else []),
        ],
    )
    exp = build_experiment(c, devices=jax.devices()[:1])
    trainer, gpt = exp.trainer, exp.model
    sharding = trainer.batch_sharding
    state = trainer.init(jax.random.key(0), exp.train_data.global_batch(0, sharding))
    t = time.perf_counter()
    trainer.compile(state, exp.train_data.global_batch(0, sharding))
    compile_s = time.perf_counter() - t
    times, losses = [], []
    for step in range(steps + warmup):
        batch = exp.train_data.global_batch(step, sharding)
        t = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))  # blocks until the step is done
        if step >= warmup:
            times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    tokens = micro_batch * gpt.seq_len
    flops = flops_per_step(gpt.num_params(), tokens, gpt.n_layers, gpt.d_model, gpt.seq_len)
    del state
    return {
        "stage": stage,
        "params": gpt.num_params(),
        "micro_batch": micro_batch,
        "remat": gpt.remat,
        "seq_len": gpt.seq_len,
        "compile_s": compile_s,
        "median_step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tflops_per_s": flops / step_s / 1e12,
        "losses": losses,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--remat", default=None, help="model.remat policy (default: the preset's)")
    a = p.parse_args()
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        sys.stderr.write(
            f"error: no GPU found (JAX sees {jax.devices()[0].platform} devices); gpu_bench measures one "
            "GPU and does not run here. The recorded result is left as it is.\n"
        )
        return 2
    kind = gpus[0].device_kind
    hw = hardware_for(kind)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    rows = []
    for stage in (int(s) for s in a.stages.split(",")):
        row = bench(stage, a.micro_batch, a.steps, a.warmup, a.remat)
        row["mfu"] = row["tflops_per_s"] * 1e12 / hw.peak_flops if hw else None
        rows.append(row)
        print(
            f"stage {stage}: {row['tokens_per_s']:,.0f} tok/s, {row['tflops_per_s']:.1f} TFLOP/s"
            + (f", MFU {row['mfu']:.1%}" if hw else ""),
            flush=True,
        )
    where = f"{kind} ({hw.name}: {hw.peak_flops / 1e12:.0f} TFLOP/s dense bf16)" if hw else f"{kind} (peak unknown)"
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "gpu_bench.json"), "w") as f:
        json.dump(
            {
                "started": started,
                "host": platform.node(),
                "device_kind": kind,
                "jax": jax.__version__,
                "args": vars(a),
                "rows": rows,
            },
            f,
            indent=2,
        )
    lines = [
        "# GPU benchmark: the ~1B GPT in bf16 on one GPU",
        "",
        f"Ran {started} on {platform.node()}, {where}, jax {jax.__version__}: "
        f"`python -m experiments.gpu_bench {' '.join(sys.argv[1:])}`. p = 1, so every stage measures the step's "
        f"compute efficiency; micro-batch {a.micro_batch} x {rows[0]['seq_len']} tokens, median of {a.steps} steps "
        f"after {a.warmup} warm-up steps.",
        "",
        "| stage | params | remat | tokens/s | TFLOP/s | MFU | median step | compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['stage']} | {r['params'] / 1e9:.2f}B | {r['remat']} | {r['tokens_per_s']:,.0f} | "
            f"{r['tflops_per_s']:.1f} | "
            f"{mfu} | {r['median_step_s'] * 1e3:.0f} ms | {r['compile_s']:.0f} s |"
        )
    with open(os.path.join(RESULTS, "gpu_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
