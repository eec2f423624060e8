"""The step loop of a config-driven run: init, compile, step, evaluate, write metrics."""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import jax
import numpy as np

from zerojax.experiment import Experiment


def _is_main_process() -> bool:
    return jax.process_index() == 0


def evaluate(exp: Experiment, state, batches: int) -> float | None:
    if exp.eval_data is None:
        return None
    sharding = exp.trainer.batch_sharding
    losses = [float(exp.trainer.evaluate(state, exp.eval_data.global_batch(i, sharding))) for i in range(batches)]
    return float(np.mean(losses))


def fit(exp: Experiment, out_dir: str, on_step: Callable[[dict], None] | None = None) -> dict:
    """Train `exp.config.train.steps` steps; returns the summary also written to `summary.json`."""
    c, trainer = exp.config, exp.trainer
    sharding = trainer.batch_sharding
    tokens_per_step = c.train.batch_size * exp.model.seq_len

    first = exp.train_data.global_batch(0, sharding)
    t0 = time.perf_counter()
    state = trainer.init(jax.random.key(c.train.seed), first)
    trainer.compile(state, first)
    compile_s = time.perf_counter() - t0

    main = _is_main_process()
    if main:
        os.makedirs(out_dir, exist_ok=True)
    metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "w") if main else None
    losses, times, eval_loss = [], [], None
    try:
        for step in range(c.train.steps):
            batch = first if step == 0 else exp.train_data.global_batch(step, sharding)
            t = time.perf_counter()
            state, metrics = trainer.step(state, batch)
            loss = float(metrics["loss"])  # blocks until the step is done
            dt = time.perf_counter() - t
            losses.append(loss)
            times.append(dt)
            record = {"step": step + 1, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                      "step_time_s": dt, "tokens_per_s": tokens_per_step / dt}
            if c.train.eval_every and (step + 1) % c.train.eval_every == 0:
                eval_loss = record["eval_loss"] = evaluate(exp, state, c.train.eval_batches)
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if on_step:
                on_step(record)
    finally:
        if metrics_file:
            metrics_file.close()
    if not c.train.eval_every or c.train.steps % c.train.eval_every:
        eval_loss = evaluate(exp, state, c.train.eval_batches)

    steady = times[1:] or times
    summary = {
        "steps": c.train.steps,
        "stage": trainer.stage.index,
        "engine": trainer.engine,
        "precision": trainer.precision.name,
        "devices": int(trainer.mesh.devices.size),
        "mesh": dict(trainer.mesh.shape),
        "params": exp.model.num_params(),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "eval_loss": eval_loss,
        "compile_s": compile_s,
        "median_step_time_s": float(np.median(steady)),
        "tokens_per_s": tokens_per_step / float(np.median(steady)),
        "persistent_bytes_per_device": trainer.persistent_bytes_per_device(state),
    }
    if main:
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary
