"""A small ResNet-style CNN (BatchNorm + Dropout) on generated images, trained at ZeRO stages 0 and 3
from the Python API, on 8 simulated CPU devices; writes experiments/results/resnet_shapes.{json,md}.

The data set is generated, never downloaded: 16x16 grey images of four shapes (square outline,
filled disc, cross, diagonal bar) at random positions and sizes, with Gaussian noise; the class is
the shape. A fixed held-out set measures accuracy (eval mode: no dropout, BatchNorm running stats).

    python -m experiments.resnet_shapes [--steps 300] [--engine shard_map]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from experiments.common import RESULTS, cpu_devices

cpu_devices(8)

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax as zj
from experiments.shapes_model import ResNet, shapes


def accuracy(logits, batch):
    return jnp.sum(jnp.argmax(logits, -1) == batch["targets"]), batch["targets"].shape[0]


def train(stage: int, engine: str, steps: int, batch_size: int, train_set: dict, test_set: dict) -> dict:
    trainer = zj.Trainer(
        ResNet, optax.adamw(3e-3, weight_decay=1e-4), mesh=zj.make_mesh(fsdp=8), stage=stage, engine=engine
    )
    n = len(train_set["targets"])
    batch = lambda i: {k: v[(i * batch_size) % n : (i * batch_size) % n + batch_size] for k, v in train_set.items()}  # noqa: E731
    state = trainer.init(jax.random.key(0), batch(0))
    losses, start = [], time.perf_counter()
    for i in range(steps):
        state, metrics = trainer.step(state, batch(i))
        losses.append(float(metrics["loss"]))
    seconds = time.perf_counter() - start
    acc = float(trainer.evaluate(state, test_set, accuracy))
    train_acc = float(trainer.evaluate(state, batch(0), accuracy))
    return {
        "stage": stage,
        "engine": engine,
        "steps": steps,
        "batch_size": batch_size,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "mean_last_20": float(np.mean(losses[-20:])),
        "eval_loss": float(trainer.evaluate(state, test_set)),
        "test_accuracy": acc,
        "train_batch_accuracy": train_acc,
        "seconds": round(seconds, 1),
        "gather": trainer.gather_report().description,
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--engine", default="shard_map")
    args = parser.parse_args()
    train_set, test_set = shapes(args.batch_size * 40, seed=0), shapes(512, seed=1)
    runs = [train(stage, args.engine, args.steps, args.batch_size, train_set, test_set) for stage in (0, 3)]
    diff = float(np.max(np.abs(np.array(runs[0]["losses"]) - np.array(runs[1]["losses"]))))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "resnet_shapes.json"), "w") as f:
        json.dump({"runs": runs, "max_loss_difference_stage3_vs_stage0": diff, "jax": jax.__version__}, f, indent=1)
    lines = [
        "# ResNet-style CNN (BatchNorm + Dropout 0.3) on generated shapes, stages 0 and 3",
        "",
        f"8 simulated CPU devices, engine `{args.engine}`, fp32, AdamW 3e-3, batch {args.batch_size}, "
        f"{args.steps} steps, 4 classes (chance 25%), 512 held-out images; jax {jax.__version__}.",
        "",
        "| stage | first loss | last-20 mean loss | eval loss | test accuracy | seconds | gathers |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['stage']} | {r['first_loss']:.4f} | {r['mean_last_20']:.4f} | {r['eval_loss']:.4f} | "
            f"{r['test_accuracy']:.1%} | {r['seconds']} | {r['gather']} |"
        )
    early = float(np.max(np.abs(np.array(runs[0]["losses"][:10]) - np.array(runs[1]["losses"][:10]))))
    lines += [
        "",
        f"Stage 3 vs stage 0, largest loss difference over the first 10 steps: {early:.1e}; over all "
        f"{args.steps} steps: {diff:.1e}. Both draw the same dropout masks and average BatchNorm "
        "statistics over the global batch; the steps differ only in fp32 summation order (stage 3's "
        "per-unit gathers and reduce-scatters vs stage 0's all-reduce), a difference that training "
        "amplifies step by step.",
    ]
    with open(os.path.join(RESULTS, "resnet_shapes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
