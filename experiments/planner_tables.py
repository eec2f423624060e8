"""The planner's tables for three set-ups, with the commands that make them:

  7B on 8 x H100          the ZeRO paper's example, by parameter count and from the shipped 7b preset
  70B on 64 x H100        a Llama-2-70B-sized GPT (d_model 8192, 80 layers, d_ff 24576) from the 64-GPU
                          pod config: sharded over all 64, and over its hybrid mesh (fsdp 8 x 8 replicas)
  7B on a TPU v5p-128     the shipped TPU pod config (64 chips)

Plans from a config count the parameters with jax.eval_shape (nothing allocated) and include the
activation estimate for the config's per-device micro-batch. Writes experiments/results/planner.md.

    python -m experiments.planner_tables      # seconds
"""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
import time

from experiments.common import RESULTS

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SEVENTY_B = [
    "--set",
    "model.preset=7b",
    "--set",
    "model.d_model=8192",
    "--set",
    "model.n_layers=80",
    "--set",
    "model.n_heads=64",
    "--set",
    "model.d_ff=24576",
]
CASES = [
    (
        "7B on 8 x H100 (by parameter count: the ZeRO paper's example)",
        ["--params", "7e9", "--devices", "8", "--hardware", "h100"],
    ),
    (
        "The shipped 7b preset on 8 x H100 (from a config; 4 sequences of 2048 tokens per GPU)",
        [
            "configs/gpu-7b-64xh100.yaml",
            "--set",
            "mesh.data=1",
            "--set",
            "train.batch_size=32",
            "--devices",
            "8",
            "--hardware",
            "h100",
        ],
    ),
    (
        "70B on 64 x H100, sharded over all 64 (from the 64-GPU config, model made 70B)",
        ["configs/gpu-7b-64xh100.yaml", *SEVENTY_B, "--set", "mesh.data=1", "--devices", "64", "--hardware", "h100"],
    ),
    (
        "70B on 64 x H100 as the config's hybrid mesh shards it: fsdp 8 within a host, 8 replicas across hosts",
        ["configs/gpu-7b-64xh100.yaml", *SEVENTY_B, "--devices", "64", "--hardware", "h100"],
    ),
    (
        "7B on a TPU v5p-128 (64 chips; the shipped pod config)",
        ["configs/tpu-7b-v5p-128.yaml", "--hardware", "tpu-v5p"],
    ),
]


def main() -> int:
    started = datetime.datetime.now().isoformat(timespec="seconds")
    out = [
        "# Planner tables",
        "",
        f"Made by `python -m experiments.planner_tables` on {started}. Each section is the output of the "
        "command above it (`zerojax plan`; GB = 1e9 bytes per device). *model state* is the textbook ZeRO "
        "accounting (bf16 params and gradients, fp32 master and Adam moments: 16 bytes per parameter over the "
        "stage's sharding); *kept* is what zerojax itself keeps between steps (no gradients; stage 3 casts each "
        "fp32 shard when it gathers it, so 12 bytes per parameter over p). Compute and communication times are "
        "lower bounds: peak FLOP/s and the per-direction link rate, no overlap assumed.",
        "",
    ]
    env = {**os.environ, "COLUMNS": "150"}
    for title, args in CASES:
        t = time.time()
        r = subprocess.run(
            [sys.executable, "-m", "zerojax.cli.main", "plan", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        if r.returncode:
            sys.stderr.write(r.stderr)
            return r.returncode
        out += [
            f"## {title}",
            "",
            "```",
            shlex.join(["zerojax", "plan", *args]),
            "```",
            "",
            f"({time.time() - t:.1f} s, including Python start-up)",
            "",
            "```",
            r.stdout.rstrip(),
            "```",
            "",
        ]
        print(f"{title}: {time.time() - t:.1f} s", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "planner.md"), "w") as f:
        f.write("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
