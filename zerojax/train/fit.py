"""The run loop for any `Trainer` and batch source: init or resume, compile, step, evaluate, write
metrics.jsonl and summary.json, save async sharded checkpoints, stop cleanly on SIGTERM and after
too many non-finite steps in a row. `zerojax train` is this loop with a config's pieces.

    summary = zj.fit(trainer, source, "runs/mine", steps=1000, checkpoint_every=100, resume=True)

`source` is a batch source (`zerojax.data.sources`): batch(step) is a pure function of (seed, step), so
the data position of a resumed run is its step and `resume` is exact. The rules of a resume (from
which checkpoint, with which config changes) are in `zerojax.train.resume`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from zerojax.core.state import TrainState
from zerojax.data import sources
from zerojax.errors import Diverged, Preempted, UserError
from zerojax.log import warn
from zerojax.train import checkpoint, tensorboard
from zerojax.train import params_file as init_from
from zerojax.train.preempt import Preemption
from zerojax.train.resume import check_checkpoint_matches, continue_metrics, step_to_resume


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
    # the config's defaults: the value of a key a checkpoint's config predates (`check_resume_config`)
    config_defaults: dict | None = field(default=None, compare=False)
    model: dict | None = field(default=None, compare=False)  # the model's description, for checkpoints
    tensorboard: bool | None = None  # event files beside metrics.jsonl; None: when tensorboard is installed
    init_from: str | None = None  # a params .npz a fresh run starts from (zerojax.train.params_file)
    # the optimizer's learning rate, a number or an optax schedule (step -> rate): recorded per step
    learning_rate: Any = field(default=None, compare=False)


def evaluate(trainer, source, state, batches: int) -> float | None:
    """Mean loss over `batches` batches of `source` (None without one)."""
    if source is None:
        return None
    sharding = trainer.batch_sharding
    losses = [float(trainer.evaluate(state, sources.global_batch(source, i, sharding))) for i in range(batches)]
    return float(np.mean(losses))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # metrics.jsonl stays strict JSON


def _ckpt_dir(o: FitOptions, out_dir: str) -> str:
    return checkpoint.checkpoint_dir(o.checkpoint_dir, out_dir)


def _start(trainer, source, o: FitOptions, ckpt_dir: str, resume: bool, state=None) -> tuple[TrainState, int]:
    """(state, step): the given `state` (e.g. from `zj.shard`), the latest complete checkpoint when
    resuming, else a fresh init."""
    sharding = trainer.batch_sharding
    key = jax.random.key(o.seed)
    if state is not None:
        if resume:
            raise UserError("fit starts from a given state or resumes from a checkpoint, not both.")
        step = int(jax.device_get(state.step))
        return trainer.restore_state(state.saved(), key, sources.global_batch(source, step, sharding)), step
    step = step_to_resume(ckpt_dir, resume=resume, writes_checkpoints=bool(o.checkpoint_every))  # type: ignore[assignment]
    if step is None:
        return _fresh(trainer, o, key, sources.global_batch(source, 0, sharding)), 0
    step_dir = os.path.join(ckpt_dir, str(step))
    meta = checkpoint.read_meta(step_dir)
    check_checkpoint_matches(
        meta,
        step_dir=step_dir,
        ckpt_dir=ckpt_dir,
        seed=o.seed,
        config=o.config,
        mesh=dict(trainer.mesh.shape),
        defaults=o.config_defaults,
    )
    # The data source is a pure function of (seed, step): the data position is the step.
    batch = sources.global_batch(source, step, sharding)
    # saved without its frozen part: that is rebuilt as a fresh start builds it
    base = _fresh(trainer, o, key, batch) if meta.get("frozen") else None
    state, meta = checkpoint.restore(trainer, step_dir, key, batch, base=base)
    return state, int(meta["step"])


def _fresh(trainer, o: FitOptions, key, batch) -> TrainState:
    """Step 0: the model's init, or its params from `train.init_from`."""
    params = None if o.init_from is None else init_from.initial_params(o.init_from, trainer, key, batch)
    return trainer.init(key, batch, params=params)


@dataclass
class Start:
    """Where a run starts: the state (fresh or restored), its step, and the init + compile time."""

    state: TrainState
    step: int
    compile_s: float


def begin(trainer, source, out_dir: str, options: FitOptions, *, resume: bool = False, state=None) -> Start:
    """Init or restore, then compile: every bad-checkpoint error surfaces here, before any output."""
    t0 = time.perf_counter()
    state, step = _start(trainer, source, options, _ckpt_dir(options, out_dir), resume, state)
    trainer.compile(state, sources.global_batch(source, step, trainer.batch_sharding))
    if step >= options.steps:
        warn(f"the checkpoint is at step {step}, not before train.steps={options.steps}; nothing to train.")
    return Start(state, step, time.perf_counter() - t0)


class _Outputs:
    """metrics.jsonl (process 0 only: continued on resume), its TensorBoard events and the checkpoint
    writer."""

    def __init__(self, trainer, o: FitOptions, out_dir: str, start: int):
        self.history: list[dict] = []
        self.metrics_file = self.events = None
        if _is_main_process():
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, "metrics.jsonl")
            self.history = continue_metrics(path, start) if start else []
            self.metrics_file = open(path, "a" if start else "w")
            self.events = tensorboard.open_writer(out_dir, o.tensorboard)
        self.writer: checkpoint.CheckpointWriter | None = None
        self._trainer, self._o, self._out_dir = trainer, o, out_dir
        if o.checkpoint_every:
            self.open_writer()

    def open_writer(self) -> checkpoint.CheckpointWriter:
        """The checkpoint writer (also opened on a termination request when checkpoint.every=0)."""
        if self.writer is None:
            o = self._o
            meta = checkpoint.run_metadata(
                self._trainer, seed=o.seed, config=o.config, model=o.model, source=o.init_from
            )
            self.writer = checkpoint.CheckpointWriter(
                _ckpt_dir(o, self._out_dir), keep=o.checkpoint_keep, run_meta=meta
            )
        return self.writer

    def write(self, record: dict) -> None:
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if self.events:
            self.events.write(record)

    def close(self) -> None:
        if self.metrics_file:
            self.metrics_file.close()
        if self.events:
            self.events.close()
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
    rate: Callable | None = None  # step -> the learning rate (`FitOptions.learning_rate`, `_schedule`)


def _schedule(rate):
    """The learning rate (a number, or step -> rate) as step -> rate: an optax schedule compiled once
    (run op by op, it compiled a dozen small programs and ran them every step); a function that
    cannot be traced (Python control flow on the step, a dict looked up by it) as it is."""
    if not callable(rate):
        return lambda step: rate
    compiled = jax.jit(rate)
    try:
        compiled(0)
    except Exception:  # noqa: BLE001 - whatever stops tracing it: called as the user wrote it
        return rate
    return compiled


def _rate_and_memory(run: _Run, step: int) -> dict:
    """The learning rate the step used (where known) and the device's peak memory so far (where the
    backend reports it: GPU and TPU, not CPU)."""
    out = {}
    if run.rate is not None:
        out["learning_rate"] = float(run.rate(step))
    stats = jax.local_devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        out["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
    return out


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
    record.update(_rate_and_memory(run, step))
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
        out.open_writer().close()  # waits until the checkpoint is complete on disk
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
    state: TrainState | None = None,
    **kwargs,
) -> dict:
    """Train `trainer` on batch source `source` up to `steps`; returns the summary also written to
    OUT/summary.json, beside OUT/metrics.jsonl (one record per step) and OUT/checkpoints.

    The other keywords are `FitOptions` fields (eval_every, eval_batches, max_bad_steps,
    checkpoint_every, checkpoint_keep, checkpoint_dir, seed, config, model), or pass `options`.
    `resume`: continue from the latest complete checkpoint and continue metrics.jsonl with it; without
    one, start from scratch with a warning. `start`: the result of `begin`, when the caller ran it.
    `state`: start from this state and its step instead (one a `zj.shard` loop made, laid out as
    `trainer` lays it out).
    """
    o = _fit_options(options, steps, kwargs)
    if out_dir is None:
        raise TypeError("fit needs an output folder")
    if start is None:
        from zerojax.train.progress import compiling

        with compiling("the step"):
            start = begin(trainer, source, out_dir, o, resume=resume, state=state)
    run, history = _train(trainer, source, eval_source, o, out_dir, start, on_step)
    if not o.eval_every or o.steps % o.eval_every or not run.records:
        run.eval_loss = evaluate(trainer, eval_source, run.state, o.eval_batches)
    summary = _summary(trainer, o, run, history + run.records, start.compile_s)
    if _is_main_process():
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _fit_options(options: FitOptions | None, steps: int | None, kwargs: dict) -> FitOptions:
    """`options`, or the `FitOptions` built from `steps` and its keywords: one of the two."""
    if options is None:
        if steps is None:
            raise TypeError("fit needs steps=N (or options=FitOptions(...))")
        return FitOptions(steps=steps, **kwargs)
    if steps is not None or kwargs:
        raise TypeError("give either options or steps and FitOptions keywords, not both")
    return options


def _train(trainer, source, eval_source, o: FitOptions, out_dir: str, begun: Start, on_step) -> tuple[_Run, list[dict]]:
    """The step loop from `begun` to `o.steps`: (what it accumulated, the metrics records kept from
    before `begun`)."""
    sharding, ckpt_dir = trainer.batch_sharding, _ckpt_dir(o, out_dir)
    first = sources.global_batch(source, begun.step, sharding)
    run = _Run(begun.state, begun.step, [], [], sources.items_per_step(first["inputs"]), last_saved=begun.step)
    run.rate = None if o.learning_rate is None else _schedule(o.learning_rate)
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
    return run, out.history


def _summary(trainer, o: FitOptions, run: _Run, all_records: list[dict], compile_s: float) -> dict:
    from zerojax.core.trees import count_params

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
        "trainable_params": count_params(trainer.layout.trained_leaves()),
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
