"""Step time of the shipped GPT at two git revisions, measured in alternating processes.

    python -m experiments.step_time_between_revisions 6cf8294 HEAD --rounds 4

Each revision is checked out into a temporary worktree; one round runs a child process per revision
(in turn, so both see the same machine load), each timing `--steps` train steps of every
(engine, stage) after one warm-up step. A revision's time for a configuration is the median over its
steps; the ratio is the median over rounds of B's time / A's time in the same round. Writes
experiments/results/step_time_between_revisions.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIGS = ["gspmd:0", "gspmd:3", "shard_map:0", "shard_map:3"]

CHILD = r"""
import functools, json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np, optax
import zerojax as zj
from zerojax.models import GPT, gpt_config
preset, layers, rows, steps, precision = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cfg = gpt_config(preset, n_layers=layers)
tokens = np.random.default_rng(0).integers(0, 256, size=(rows, cfg.seq_len + 1)).astype(np.int32)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
out = {}
for engine, stage in (c.split(":") for c in json.loads(sys.argv[6])):
    stage = int(stage)
    trainer = zj.Trainer(functools.partial(GPT, cfg), optax.adamw(1e-4), mesh=zj.make_mesh(fsdp=8), stage=stage,
                         engine=engine, precision=precision)
    state = trainer.init(jax.random.key(0), batch)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    out[f"{engine} {stage}"] = {"median_s": float(np.median(times[1:])), "loss": float(metrics["loss"])}
print("RESULT " + json.dumps(out))
"""


def worktree(rev: str) -> str:
    path = tempfile.mkdtemp(prefix=f"zerojax-{rev}-")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", path, rev], check=True, capture_output=True)
    return path


def run_child(path: str, a) -> dict:
    env = {**os.environ, "PYTHONPATH": path}
    argv = [
        sys.executable,
        "-c",
        CHILD,
        a.preset,
        str(a.layers),
        str(a.rows),
        str(a.steps),
        a.precision,
        json.dumps(a.configs),
    ]
    proc = subprocess.run(argv, cwd=path, env=env, capture_output=True, text=True, check=True)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev_a")
    p.add_argument("rev_b")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--preset", default="20m")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--configs", nargs="+", default=CONFIGS, help="engine:stage pairs")
    a = p.parse_args()
    paths = {rev: worktree(rev) for rev in (a.rev_a, a.rev_b)}
    try:
        rounds = []
        for r in range(a.rounds):
            rounds.append({rev: run_child(path, a) for rev, path in paths.items()})
            print(f"round {r + 1}: " + json.dumps(rounds[-1]), flush=True)
    finally:
        for path in paths.values():
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", path], capture_output=True)
    write(a, rounds)
    return 0


def write(a, rounds: list[dict]) -> None:
    lines = [
        "# Step time of the shipped GPT at two revisions (measured)",
        "",
        f"`python -m experiments.step_time_between_revisions {a.rev_a} {a.rev_b} --rounds {a.rounds}`: GPT "
        f"`{a.preset}` with {a.layers} layers, {a.precision}, global batch {a.rows}, 8 simulated CPU devices; "
        f"{a.rounds} rounds of one process per revision in turn, each the median of {a.steps} steps after a "
        "warm-up. Ratio: the median over rounds of B / A in the same round.",
        "",
        f"| engine, stage | A = `{a.rev_a}` median s | B = `{a.rev_b}` median s | B / A (paired) | loss A | loss B |",
        "|---|---|---|---|---|---|",
    ]
    for name in rounds[0][a.rev_a]:
        ta = np.array([r[a.rev_a][name]["median_s"] for r in rounds])
        tb = np.array([r[a.rev_b][name]["median_s"] for r in rounds])
        lines.append(
            f"| {name} | {np.median(ta):.3f} | {np.median(tb):.3f} | {np.median(tb / ta):.3f} | "
            f"{rounds[-1][a.rev_a][name]['loss']:.5f} | {rounds[-1][a.rev_b][name]['loss']:.5f} |"
        )
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "step_time_between_revisions.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
