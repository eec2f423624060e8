"""The step loop of a config-driven run: init or resume, compile, step, evaluate, write metrics,
save checkpoints, stop after too many non-finite steps."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np

from zerojax import checkpoint
from zerojax.errors import Diverged, Preempted, UserError
from zerojax.experiment import Experiment
from zerojax.log import warn
from zerojax.preempt import Preemption
from zerojax.state import TrainState


def _is_main_process() -> bool:
    return jax.process_index() == 0


def evaluate(exp: Experiment, state, batches: int) -> float | None:
    if exp.eval_data is None:
        return None
    sharding = exp.trainer.batch_sharding
    losses = [float(exp.trainer.evaluate(state, exp.eval_data.global_batch(i, sharding))) for i in range(batches)]
    return float(np.mean(losses))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # metrics.jsonl stays strict JSON


def _continue_metrics(path: str, step: int) -> list[dict]:
    """Keep the records of steps 1..`step` (those the checkpoint includes) and rewrite the file with
    exactly them: steps after the checkpoint are trained again, a torn last line is dropped."""
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                    kept.append(record)
    kept = list({r["step"]: r for r in kept}.values())  # one record per step, the last written wins
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)  # atomic: a crash here leaves the old or the new file, never half
    return kept


def _ckpt_dir(exp: Experiment, out_dir: str) -> str:
    return checkpoint.checkpoint_dir(exp.config.checkpoint.dir, out_dir)


def _start(exp: Experiment, ckpt_dir: str, resume: bool, sharding) -> tuple[TrainState, int]:
    """(state, step): the latest complete checkpoint when resuming, else a fresh init."""
    c, trainer = exp.config, exp.trainer
    key = jax.random.key(c.train.seed)
    steps = checkpoint.complete_steps(ckpt_dir)
    if steps and not resume and c.checkpoint.every:
        raise UserError(f"{ckpt_dir} already holds checkpoints (latest step {steps[-1]}); pass --resume to "
                        "continue from it, or choose another --out or checkpoint.dir.")
    if resume and not c.checkpoint.every:
        warn("checkpoint.every=0: this run writes no checkpoints to resume from later.")
    if not (resume and steps):
        if resume:
            warn(f"no complete checkpoint in {ckpt_dir} yet; starting from scratch.")
        return trainer.init(key, exp.train_data.global_batch(0, sharding)), 0
    step_dir = os.path.join(ckpt_dir, str(steps[-1]))
    meta = checkpoint.read_meta(step_dir)
    if isinstance(meta.get("config"), dict):
        check_resume_config(meta["config"], c.to_dict(), step_dir)
    elif meta.get("seed") != c.train.seed:
        raise UserError(f"train.seed={c.train.seed} differs from the seed {meta.get('seed')} the checkpoint in "
                        f"{ckpt_dir} was trained with; resume with --set train.seed={meta.get('seed')}.")
    # The data stream is a pure function of (seed, step): the data position is the step.
    state, meta = checkpoint.restore(trainer, step_dir, key, exp.train_data.global_batch(steps[-1], sharding))
    return state, int(meta["step"])


# Keys that may change between a run and its resume: where and how the same computation runs, when
# it is saved, and how long it goes on. Every other key changes the trajectory (model, optimizer,
# learning rate and schedule, batch size, data, seed, precision) and stops the resume.
SAFE_ON_RESUME = ("zero.", "mesh.", "checkpoint.", "xla.", "train.steps", "train.eval_every",
                  "train.eval_batches", "train.max_bad_steps")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_ON_RESUME)


def check_resume_config(saved: dict, current: dict, step_dir: str) -> None:
    """Stop a resume that changes the trajectory (naming each key and both values); warn about the
    safe changes it makes. A longer or shorter `train.steps` rebuilds the learning-rate schedule over
    the new total, so with warm-up and cosine decay the rate from the resumed step on follows it."""
    old, new = _flat(saved), _flat(current)
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    fatal = [k for k in changed if not _safe(k)]
    if fatal:
        what = "; ".join(f"{k} is {new.get(k)!r} here but {old.get(k)!r} in the checkpoint" for k in fatal)
        raise UserError(f"cannot resume from {step_dir!r} with a config that changes the training trajectory: "
                        f"{what}. Resume with the checkpoint's values, or start a new run in another --out.")
    if changed:
        note = "; the learning-rate schedule now spans the new train.steps" if "train.steps" in changed else ""
        warn("resuming with changed settings: " + ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
             + note + ".")


@dataclass
class Start:
    """Where a run starts: the state (fresh or restored), its step, and the init + compile time."""

    state: TrainState
    step: int
    compile_s: float


def prepare(exp: Experiment, out_dir: str, *, resume: bool = False) -> Start:
    """Init or restore, then compile: every bad-checkpoint error surfaces here, before any output."""
    c, trainer = exp.config, exp.trainer
    t0 = time.perf_counter()
    state, step = _start(exp, _ckpt_dir(exp, out_dir), resume, trainer.batch_sharding)
    trainer.compile(state, exp.train_data.global_batch(step, trainer.batch_sharding))
    if step >= c.train.steps:
        warn(f"the checkpoint is at step {step}, not before train.steps={c.train.steps}; nothing to train.")
    return Start(state, step, time.perf_counter() - t0)


class _Outputs:
    """metrics.jsonl (process 0 only: continued on resume) and the checkpoint writer."""

    def __init__(self, exp: Experiment, out_dir: str, start: int):
        c = exp.config
        self.history: list[dict] = []
        self.metrics_file = None
        if _is_main_process():
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, "metrics.jsonl")
            self.history = _continue_metrics(path, start) if start else []
            self.metrics_file = open(path, "a" if start else "w")
        self.writer = None
        self._exp, self._out_dir = exp, out_dir
        if c.checkpoint.every:
            self.open_writer()

    def open_writer(self) -> checkpoint.CheckpointWriter:
        """The checkpoint writer (also opened on a termination request when checkpoint.every=0)."""
        if self.writer is None:
            exp, c = self._exp, self._exp.config
            meta = checkpoint.run_metadata(exp.trainer, seed=c.train.seed, config=c.to_dict(), model=_model_dict(exp))
            self.writer = checkpoint.CheckpointWriter(_ckpt_dir(exp, self._out_dir), keep=c.checkpoint.keep,
                                                      run_meta=meta)
        return self.writer

    def write(self, record: dict) -> None:
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()

    def close(self) -> None:
        if self.metrics_file:
            self.metrics_file.close()
        if self.writer:
            self.writer.close()  # waits for the save in flight: it is complete on disk before we return


@dataclass
class _Run:
    """What the step loop accumulates."""

    state: TrainState
    start: int
    records: list[dict]
    times: list[float]
    eval_loss: float | None = None
    bad_run: int = 0  # consecutive non-finite steps
    last_saved: int = 0


def _train_step(exp: Experiment, run: _Run, step: int, batch) -> dict:
    """One step: the state advances, and its metrics.jsonl record is returned."""
    c = exp.config
    t = time.perf_counter()
    run.state, metrics = exp.trainer.step(run.state, batch)
    loss = float(metrics["loss"])  # blocks until the step is done
    dt = time.perf_counter() - t
    run.times.append(dt)
    bad = int(metrics.get("bad_step", 0))
    run.bad_run = run.bad_run + 1 if bad else 0
    tokens_per_step = c.train.batch_size * exp.model.seq_len
    record = {"step": step + 1, "loss": _finite(loss), "grad_norm": _finite(float(metrics["grad_norm"])),
              "bad_step": bad, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt}
    if c.train.eval_every and (step + 1) % c.train.eval_every == 0:
        run.eval_loss = record["eval_loss"] = evaluate(exp, run.state, c.train.eval_batches)
    run.records.append(record)
    return record


def _after_step(exp: Experiment, run: _Run, out: _Outputs, step: int, ckpt_dir: str,
                preemption: Preemption) -> None:
    """Stop after too many non-finite steps in a row; save a checkpoint when one is due; on a
    termination request, save this step, wait until the checkpoint is complete, and stop."""
    c = exp.config
    if run.bad_run >= c.train.max_bad_steps:
        kept = f"the last good checkpoint is step {run.last_saved} in {ckpt_dir}" if run.last_saved \
            else "no checkpoint was written"
        raise Diverged(f"training stopped at step {step + 1}: {run.bad_run} consecutive steps had a non-finite "
                       f"loss, gradient norm or update (train.max_bad_steps={c.train.max_bad_steps}); {kept}.")
    if preemption.reached(step + 1):
        if run.last_saved != step + 1:
            out.open_writer().save(step + 1, run.state)  # a bad step's state is the last good one, step advanced
        out.writer.close()  # waits until the checkpoint is complete on disk
        raise Preempted(f"a termination request arrived; step {step + 1} is saved in {ckpt_dir}; "
                        "run the same command with --resume to continue.")
    # A bad step kept the old state, but its checkpoint would push a good one out: skip it.
    bad = run.records[-1]["bad_step"]
    if out.writer and not bad and ((step + 1) % c.checkpoint.every == 0 or step + 1 == c.train.steps):
        out.writer.save(step + 1, run.state)
        run.last_saved = step + 1


def fit(exp: Experiment, out_dir: str, on_step: Callable[[dict], None] | None = None, *,
        resume: bool = False, start: Start | None = None) -> dict:
    """Train up to `exp.config.train.steps` steps; returns the summary also written to `summary.json`.

    `resume`: continue from the latest complete checkpoint (checkpoint.dir, default OUT/checkpoints)
    and continue metrics.jsonl with it; without one, start from scratch with a warning. `start`: the
    result of `prepare`, when the caller ran it first.
    """
    c, sharding = exp.config, exp.trainer.batch_sharding
    ckpt_dir = _ckpt_dir(exp, out_dir)
    begun = start or prepare(exp, out_dir, resume=resume)
    run = _Run(begun.state, begun.step, [], [], last_saved=begun.step)
    first = exp.train_data.global_batch(run.start, sharding)
    out = _Outputs(exp, out_dir, run.start)
    try:
        with Preemption() as preemption:
            for step in range(run.start, c.train.steps):
                batch = first if step == run.start else exp.train_data.global_batch(step, sharding)
                record = _train_step(exp, run, step, batch)
                out.write(record)
                if on_step:
                    on_step(record)
                _after_step(exp, run, out, step, ckpt_dir, preemption)
    finally:
        out.close()
    if not c.train.eval_every or c.train.steps % c.train.eval_every or not run.records:
        run.eval_loss = evaluate(exp, run.state, c.train.eval_batches)
    summary = _summary(exp, run, out.history + run.records, begun.compile_s)
    if _is_main_process():
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _summary(exp: Experiment, run: _Run, all_records: list[dict], compile_s: float) -> dict:
    c, trainer = exp.config, exp.trainer
    losses = [r["loss"] for r in all_records]
    steady = run.times[1:] or run.times or [float("nan")]
    return {
        "steps": c.train.steps,
        "resumed_from": run.start,
        "stage": trainer.stage.index,
        "engine": trainer.engine,
        "precision": trainer.precision.name,
        "devices": int(trainer.mesh.devices.size),
        "mesh": dict(trainer.mesh.shape),
        "params": exp.model.num_params(),
        "first_loss": _num(losses[0] if losses else None),
        "final_loss": _num(losses[-1] if losses else None),
        "eval_loss": run.eval_loss,
        "bad_steps": sum(int(r.get("bad_step", 0)) for r in all_records),
        "compile_s": compile_s,
        "median_step_time_s": float(np.median(steady)),
        "tokens_per_s": c.train.batch_size * exp.model.seq_len / float(np.median(steady)),
        "persistent_bytes_per_device": trainer.persistent_bytes_per_device(run.state),
    }


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def _model_dict(exp: Experiment) -> dict:
    import dataclasses

    return dataclasses.asdict(exp.model)
