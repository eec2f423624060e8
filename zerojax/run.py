"""The run loop for any `Trainer` and batch source: init or resume, compile, step, evaluate, write
metrics.jsonl and summary.json, save async sharded checkpoints, stop cleanly on SIGTERM and after
too many non-finite steps in a row. `zerojax train` is this loop with a config's pieces.

    summary = zj.fit(trainer, source, "runs/mine", steps=1000, checkpoint_every=100, resume=True)

`source` is a batch source (`zerojax.sources`): batch(step) is a pure function of (seed, step), so
the data position of a resumed run is its step and `resume` is exact.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from zerojax import checkpoint, sources
from zerojax.errors import Diverged, Preempted, UserError
from zerojax.log import warn
from zerojax.preempt import Preemption
from zerojax.state import TrainState


def _is_main_process() -> bool:
    return jax.process_index() == 0


@dataclass(frozen=True)
class FitOptions:
    """How a run goes on, saves and stops (a config's train.* and checkpoint.* keys)."""

    steps: int
    seed: int = 0  # the init key; the source owns its own data seed
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 2
    max_bad_steps: int = 3  # consecutive non-finite steps before stopping (Diverged)
    checkpoint_every: int = 0  # 0: no periodic checkpoints (SIGTERM still saves one)
    checkpoint_keep: int = 2
    checkpoint_dir: str | None = None  # default OUT/checkpoints
    config: dict | None = None  # recorded in checkpoints; a resume that changes the trajectory is refused
    model: dict | None = field(default=None, compare=False)  # the model's description, for checkpoints

    @classmethod
    def from_config(cls, c, model: dict | None = None) -> FitOptions:
        t, k = c.train, c.checkpoint
        return cls(
            steps=t.steps,
            seed=t.seed,
            eval_every=t.eval_every,
            eval_batches=t.eval_batches,
            max_bad_steps=t.max_bad_steps,
            checkpoint_every=k.every,
            checkpoint_keep=k.keep,
            checkpoint_dir=k.dir,
            config=c.to_dict(),
            model=model,
        )


def evaluate(trainer, source, state, batches: int) -> float | None:
    """Mean loss over `batches` batches of `source` (None without one)."""
    if source is None:
        return None
    sharding = trainer.batch_sharding
    losses = [float(trainer.evaluate(state, sources.global_batch(source, i, sharding))) for i in range(batches)]
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


def _ckpt_dir(o: FitOptions, out_dir: str) -> str:
    return checkpoint.checkpoint_dir(o.checkpoint_dir, out_dir)


def _start(trainer, source, o: FitOptions, ckpt_dir: str, resume: bool) -> tuple[TrainState, int]:
    """(state, step): the latest complete checkpoint when resuming, else a fresh init."""
    sharding = trainer.batch_sharding
    key = jax.random.key(o.seed)
    steps = checkpoint.complete_steps(ckpt_dir)
    if steps and not resume and o.checkpoint_every:
        raise UserError(
            f"{ckpt_dir} already holds checkpoints (latest step {steps[-1]}); pass --resume to "
            "continue from it, or choose another --out or checkpoint.dir."
        )
    if resume and not o.checkpoint_every:
        warn("checkpoint.every=0: this run writes no checkpoints to resume from later.")
    if not (resume and steps):
        if resume:
            warn(f"no complete checkpoint in {ckpt_dir} yet; starting from scratch.")
        return trainer.init(key, sources.global_batch(source, 0, sharding)), 0
    step_dir = os.path.join(ckpt_dir, str(steps[-1]))
    meta = checkpoint.read_meta(step_dir)
    if isinstance(meta.get("config"), dict) and o.config is not None:
        check_resume_config(meta["config"], o.config, step_dir, meta.get("mesh"), dict(trainer.mesh.shape))
    elif meta.get("seed") != o.seed:
        raise UserError(
            f"train.seed={o.seed} differs from the seed {meta.get('seed')} the checkpoint in "
            f"{ckpt_dir} was trained with; resume with --set train.seed={meta.get('seed')}."
        )
    # The data source is a pure function of (seed, step): the data position is the step.
    state, meta = checkpoint.restore(trainer, step_dir, key, sources.global_batch(source, steps[-1], sharding))
    return state, int(meta["step"])


# Keys that may change between a run and its resume: where and how the same computation runs, when
# it is saved, and how long it goes on. Every other key changes the trajectory (model, optimizer,
# learning rate and schedule, batch size, data, seed, precision) and stops the resume.
SAFE_ON_RESUME = (
    "zero.",
    "mesh.",
    "checkpoint.",
    "xla.",
    "train.steps",
    "train.eval_every",
    "train.eval_batches",
    "train.max_bad_steps",
)


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


def check_resume_config(
    saved: dict, current: dict, step_dir: str, saved_mesh: dict | None = None, mesh: dict | None = None
) -> None:
    """Stop a resume that changes the trajectory (naming each key and both values); warn about the
    safe changes it makes, a new device count or mesh among them. A longer or shorter `train.steps`
    rebuilds the learning-rate schedule over the new total, so with warm-up and cosine decay the rate
    from the resumed step on follows it."""
    from zerojax.config import Config

    # A key the checkpoint's config predates (e.g. train.grad_accum) held its default there.
    old, new = {**_flat(Config().to_dict()), **_flat(saved)}, _flat(current)
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    fatal = [k for k in changed if not _safe(k)]
    if fatal:
        what = "; ".join(f"{k} is {new.get(k)!r} here but {old.get(k)!r} in the checkpoint" for k in fatal)
        raise UserError(
            f"cannot resume from {step_dir!r} with a config that changes the training trajectory: "
            f"{what}. Resume with the checkpoint's values, or start a new run in another --out."
        )
    changes = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in changed]
    if saved_mesh and mesh and {k: int(v) for k, v in saved_mesh.items()} != {k: int(v) for k, v in mesh.items()}:
        changes.insert(0, f"devices {_describe_mesh(saved_mesh)} -> {_describe_mesh(mesh)}")
    if changes:
        note = "; the learning-rate schedule now spans the new train.steps" if "train.steps" in changed else ""
        warn("resuming with changed settings: " + ", ".join(changes) + note + ".")


def _describe_mesh(mesh: dict) -> str:
    sizes = [f"{axis} {int(n)}" for axis, n in mesh.items() if int(n) > 1]
    return f"{math.prod(int(n) for n in mesh.values())} ({' x '.join(sizes) or 'one device'})"


@dataclass
class Start:
    """Where a run starts: the state (fresh or restored), its step, and the init + compile time."""

    state: TrainState
    step: int
    compile_s: float


def prepare(trainer, source, out_dir: str, options: FitOptions, *, resume: bool = False) -> Start:
    """Init or restore, then compile: every bad-checkpoint error surfaces here, before any output."""
    t0 = time.perf_counter()
    state, step = _start(trainer, source, options, _ckpt_dir(options, out_dir), resume)
    trainer.compile(state, sources.global_batch(source, step, trainer.batch_sharding))
    if step >= options.steps:
        warn(f"the checkpoint is at step {step}, not before train.steps={options.steps}; nothing to train.")
    return Start(state, step, time.perf_counter() - t0)


class _Outputs:
    """metrics.jsonl (process 0 only: continued on resume) and the checkpoint writer."""

    def __init__(self, trainer, o: FitOptions, out_dir: str, start: int):
        self.history: list[dict] = []
        self.metrics_file = None
        if _is_main_process():
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, "metrics.jsonl")
            self.history = _continue_metrics(path, start) if start else []
            self.metrics_file = open(path, "a" if start else "w")
        self.writer = None
        self._trainer, self._o, self._out_dir = trainer, o, out_dir
        if o.checkpoint_every:
            self.open_writer()

    def open_writer(self) -> checkpoint.CheckpointWriter:
        """The checkpoint writer (also opened on a termination request when checkpoint.every=0)."""
        if self.writer is None:
            o = self._o
            meta = checkpoint.run_metadata(self._trainer, seed=o.seed, config=o.config, model=o.model)
            self.writer = checkpoint.CheckpointWriter(
                _ckpt_dir(o, self._out_dir), keep=o.checkpoint_keep, run_meta=meta
            )
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
    items_per_step: int = 0  # tokens (token-id inputs) or examples per step
    eval_loss: float | None = None
    bad_run: int = 0  # consecutive non-finite steps
    last_saved: int = 0


def _train_step(trainer, eval_source, o: FitOptions, run: _Run, step: int, batch) -> dict:
    """One step: the state advances, and its metrics.jsonl record is returned."""
    t = time.perf_counter()
    run.state, metrics = trainer.step(run.state, batch)
    loss = float(metrics["loss"])  # blocks until the step is done
    dt = time.perf_counter() - t
    run.times.append(dt)
    bad = int(metrics.get("bad_step", 0))
    run.bad_run = run.bad_run + 1 if bad else 0
    record = {
        "step": step + 1,
        "loss": _finite(loss),
        "grad_norm": _finite(float(metrics["grad_norm"])),
        "bad_step": bad,
        "step_time_s": dt,
        "tokens_per_s": run.items_per_step / dt,
    }
    if o.eval_every and (step + 1) % o.eval_every == 0:
        run.eval_loss = record["eval_loss"] = evaluate(trainer, eval_source, run.state, o.eval_batches)
    run.records.append(record)
    return record


def _after_step(o: FitOptions, run: _Run, out: _Outputs, step: int, ckpt_dir: str, preemption: Preemption) -> None:
    """Stop after too many non-finite steps in a row; save a checkpoint when one is due; on a
    termination request, save this step, wait until the checkpoint is complete, and stop."""
    if run.bad_run >= o.max_bad_steps:
        kept = (
            f"the last good checkpoint is step {run.last_saved} in {ckpt_dir}"
            if run.last_saved
            else "no checkpoint was written"
        )
        raise Diverged(
            f"training stopped at step {step + 1}: {run.bad_run} consecutive steps had a non-finite "
            f"loss, gradient norm or update (train.max_bad_steps={o.max_bad_steps}); {kept}."
        )
    if preemption.reached(step + 1):
        if run.last_saved != step + 1:
            out.open_writer().save(step + 1, run.state)  # a bad step's state is the last good one, step advanced
        out.writer.close()  # waits until the checkpoint is complete on disk
        raise Preempted(
            f"a termination request arrived; step {step + 1} is saved in {ckpt_dir}; "
            "run the same command with --resume to continue."
        )
    # A bad step kept the old state, but its checkpoint would push a good one out: skip it.
    bad = run.records[-1]["bad_step"]
    if out.writer and not bad and ((step + 1) % o.checkpoint_every == 0 or step + 1 == o.steps):
        out.writer.save(step + 1, run.state)
        run.last_saved = step + 1


def fit(
    trainer,
    source=None,
    out_dir: str | None = None,
    *,
    steps: int | None = None,
    eval_source=None,
    options: FitOptions | None = None,
    resume: bool = False,
    on_step: Callable[[dict], None] | None = None,
    start: Start | None = None,
    **kwargs,
) -> dict:
    """Train `trainer` on batch source `source` up to `steps`; returns the summary also written to
    OUT/summary.json, beside OUT/metrics.jsonl (one record per step) and OUT/checkpoints.

    The other keywords are `FitOptions` fields (eval_every, eval_batches, max_bad_steps,
    checkpoint_every, checkpoint_keep, checkpoint_dir, seed, config, model), or pass `options`.
    `resume`: continue from the latest complete checkpoint and continue metrics.jsonl with it; without
    one, start from scratch with a warning. `start`: the result of `prepare`, when the caller ran it.
    `fit(experiment, out_dir, ...)` runs a config's `Experiment`.
    """
    from zerojax.experiment import Experiment

    if isinstance(trainer, Experiment):  # fit(exp, out_dir, on_step=None, *, resume, start)
        exp = trainer
        if out_dir is not None and on_step is None:
            on_step = out_dir
        options = FitOptions.from_config(exp.config, exp.model_meta)
        return fit(
            exp.trainer,
            exp.train_data,
            source,
            eval_source=exp.eval_data,
            options=options,
            resume=resume,
            on_step=on_step,
            start=start,
        )
    if options is None:
        if steps is None:
            raise TypeError("fit needs steps=N (or options=FitOptions(...))")
        options = FitOptions(steps=steps, **kwargs)
    elif steps is not None or kwargs:
        raise TypeError("give either options or steps and FitOptions keywords, not both")
    if out_dir is None:
        raise TypeError("fit needs an output folder")
    o, sharding = options, trainer.batch_sharding
    ckpt_dir = _ckpt_dir(o, out_dir)
    if start is None:
        from zerojax.report import compiling

        with compiling("the step"):
            start = prepare(trainer, source, out_dir, o, resume=resume)
    begun = start
    first = sources.global_batch(source, begun.step, sharding)
    run = _Run(begun.state, begun.step, [], [], sources.items_per_step(first["inputs"]), last_saved=begun.step)
    out = _Outputs(trainer, o, out_dir, run.start)
    try:
        with Preemption() as preemption:
            for step in range(run.start, o.steps):
                batch = first if step == run.start else sources.global_batch(source, step, sharding)
                record = _train_step(trainer, eval_source, o, run, step, batch)
                out.write(record)
                if on_step:
                    on_step(record)
                _after_step(o, run, out, step, ckpt_dir, preemption)
    finally:
        out.close()
    if not o.eval_every or o.steps % o.eval_every or not run.records:
        run.eval_loss = evaluate(trainer, eval_source, run.state, o.eval_batches)
    summary = _summary(trainer, o, run, out.history + run.records, begun.compile_s)
    if _is_main_process():
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _summary(trainer, o: FitOptions, run: _Run, all_records: list[dict], compile_s: float) -> dict:
    from zerojax.accounting.params import count_params

    losses = [r["loss"] for r in all_records]
    steady = run.times[1:] or run.times or [float("nan")]
    return {
        "steps": o.steps,
        "resumed_from": run.start,
        "stage": trainer.stage.index,
        "engine": trainer.engine,
        "precision": trainer.precision.name,
        "devices": int(trainer.mesh.devices.size),
        "mesh": dict(trainer.mesh.shape),
        "params": count_params(trainer.layout.leaves),
        "first_loss": _num(losses[0] if losses else None),
        "final_loss": _num(losses[-1] if losses else None),
        "eval_loss": run.eval_loss,
        "bad_steps": sum(int(r.get("bad_step", 0)) for r in all_records),
        "compile_s": compile_s,
        "median_step_time_s": float(np.median(steady)),
        "tokens_per_s": run.items_per_step / float(np.median(steady)),
        "persistent_bytes_per_device": trainer.persistent_bytes_per_device(run.state),
        "host_persistent_bytes_per_device": trainer.host_persistent_bytes_per_device(run.state),
    }


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)
