"""Resuming runs: `zerojax train --resume` killed with SIGKILL mid-run and during an asynchronous
save continues bit-exactly; fit-level resume continues metrics.jsonl; non-finite steps are skipped
and counted, and train.max_bad_steps stops the run keeping the last good checkpoint; bad
checkpoints exit 2 with one line and change nothing."""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.cli_helpers import RECORDS_POLL_S, dir_digest, read_records, wait_for
from zerojax.cli import main as cli
from zerojax.cli.config import load_config
from zerojax.cli.experiment import build_experiment, fit_experiment
from zerojax.core.loss import cross_entropy
from zerojax.errors import UserError
from zerojax.train.checkpoint import complete_steps, restore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "tiny.yaml")
STEPS = 12
SETS = [f"train.steps={STEPS}", "checkpoint.every=2", "data.max_bytes=200000", "train.eval_batches=1"]
TMP_MARK = ".orbax-checkpoint-tmp"


# ---- helpers -------------------------------------------------------------------------------------


def _records(out) -> list[dict]:
    return read_records(out)


def _train_cmd(out, *sets) -> list[str]:
    cmd = [sys.executable, "-m", "zerojax.cli.main", "train", CONFIG, "--devices", "8", "--out", str(out), "--resume"]
    for s in (*SETS, *sets):
        cmd += ["--set", s]
    return cmd


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """Each subprocess compiles the same step: a shared disk cache makes all but the first cheap."""
    cache = tmp_path_factory.mktemp("xla_cache")
    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "PYTHONPATH": REPO,
        "COLUMNS": "200",
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env) -> str:
    """An uninterrupted stage-3 run on 8 devices (its first --resume finds nothing and starts fresh)."""
    out = tmp_path_factory.mktemp("reference")
    done = subprocess.run(_train_cmd(out), env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "no complete checkpoint" in done.stderr and "starting from scratch" in done.stderr
    return str(out)


def _tmp_dirs(ckpt_dir) -> set[str]:
    return {n for n in os.listdir(ckpt_dir) if TMP_MARK in n}


def _kill_during_save(proc, ckpt_dir, stale: set[str]) -> str:
    """SIGSTOP as soon as a save's tmp folder appears; SIGKILL if it is still there (the save is
    truly in flight), else let the process go on to its next save. Tmp folders left by an earlier
    kill (`stale`) must first be cleaned up by the new process, so they are not mistaken for its own."""
    wait_for(lambda: not (stale & _tmp_dirs(ckpt_dir)), proc, "stale tmp folders cleaned up")
    while True:
        wait_for(lambda: any(TMP_MARK in n for n in os.listdir(ckpt_dir)), proc, "an asynchronous save started")
        proc.send_signal(signal.SIGSTOP)
        tmp = [n for n in os.listdir(ckpt_dir) if TMP_MARK in n]
        if tmp:
            proc.kill()
            proc.wait()
            return tmp[0]
        proc.send_signal(signal.SIGCONT)


# ---- the CLI, killed and resumed -----------------------------------------------------------------


def test_sigkill_mid_run_and_mid_save_then_resume_is_bit_exact(reference, env, tmp_path):
    out = tmp_path / "run"
    ckpt_dir = out / "checkpoints"

    # 1. Killed between steps, with checkpoints written and possibly one in flight.
    proc = subprocess.Popen(_train_cmd(out), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: len(_records(out)) >= 5, proc, "step 5", poll=RECORDS_POLL_S)
    proc.kill()
    proc.wait()
    first_kill = complete_steps(str(ckpt_dir), report=False)
    assert first_kill and first_kill[-1] >= 2

    # 2. Resumed, then killed while an asynchronous save is being written.
    stale = _tmp_dirs(ckpt_dir)  # a save the first kill may have cut short
    proc = subprocess.Popen(_train_cmd(out), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    interrupted = _kill_during_save(proc, ckpt_dir, stale)
    assert os.path.isdir(ckpt_dir / interrupted)  # left behind, half written
    assert int(interrupted.split(".")[0]) > first_kill[-1]  # by the resumed process
    steps_before = complete_steps(str(ckpt_dir), report=False)

    # 3. The same command again: skips the half-written save with a warning, finishes the run.
    done = subprocess.run(_train_cmd(out), env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert f"ignoring the incomplete checkpoint {ckpt_dir / interrupted}" in done.stderr

    got, want = _records(out), _records(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # none missing, none twice
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bit for bit (JSON floats round-trip)
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    assert not any(TMP_MARK in n for n in os.listdir(ckpt_dir))  # the writer cleaned it up
    assert complete_steps(str(ckpt_dir), report=False) == [STEPS - 2, STEPS]  # checkpoint.keep = 2
    with open(out / "summary.json") as f:
        assert json.load(f)["resumed_from"] == steps_before[-1]


# ---- bad input -----------------------------------------------------------------------------------


def _main(capsys, *argv) -> tuple[int, list[str]]:
    rc = cli.main([str(a) for a in argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, lines


def test_bad_checkpoints_exit_2_with_one_line_and_change_nothing(reference, env, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    sets = [a for s in SETS for a in ("--set", s)]
    before = dir_digest(run)

    # Checkpoints there, but no --resume: refuse rather than overwrite them; a different data order.
    rc, err = _main(capsys, "train", CONFIG, "--out", run, *sets)
    assert rc == 2 and len(err) == 1 and f"already holds checkpoints (latest step {STEPS}); pass --resume" in err[0]
    rc, err = _main(capsys, "train", CONFIG, "--out", run, "--resume", *sets, "--set", "train.seed=1")
    assert rc == 2 and len(err) == 1 and "train.seed is 1 here but 0 in the checkpoint" in err[0], err
    # Another model.
    rc, err = _main(capsys, "train", CONFIG, "--out", run, "--resume", *sets, "--set", "model.d_model=32")
    assert rc == 2 and len(err) == 1 and "model.d_model is 32 here but None in the checkpoint" in err[0], err
    # A path that does not exist.
    rc, err = _main(capsys, "export", run / "nope", tmp_path / "p.npz")
    assert rc == 2 and err == [f"error: checkpoint path {str(run / 'nope')!r} does not exist."]
    assert dir_digest(run) == before

    # Corrupted metadata of the latest checkpoint.
    meta = run / "checkpoints" / str(STEPS) / "meta" / "metadata"
    meta.write_text('{"format": 1, "step": ')
    before = dir_digest(run)
    for argv in (("train", CONFIG, "--out", run, "--resume", *sets), ("export", run, tmp_path / "p.npz")):
        rc, err = _main(capsys, *argv)
        assert rc == 2 and len(err) == 1 and "is corrupted or truncated: its metadata cannot be read" in err[0], err
    assert dir_digest(run) == before

    # Truncated array data (export runs as a real process: nothing but the one line on stderr).
    data = run / "checkpoints" / str(STEPS - 2) / "state" / "ocdbt.process_0" / "d"
    for f in data.iterdir():
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    before = dir_digest(run)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerojax.cli.main",
            "export",
            str(run / "checkpoints" / str(STEPS - 2)),
            str(tmp_path / "p.npz"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: checkpoint {str(run / 'checkpoints' / str(STEPS - 2))!r} is "
        "corrupted or truncated: its parameters cannot be read."
    ]
    assert dir_digest(run) == before and not (tmp_path / "p.npz").exists()


# ---- fit: resume, non-finite steps, max_bad_steps ------------------------------------------------


@pytest.fixture(scope="module", autouse=False)
def compile_cache(tmp_path_factory):
    """Fresh experiments rebuilt from a checkpoint compile the same programs: hit a disk cache."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    old = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("inproc_xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    cc.reset_cache()
    yield
    for n, v in old.items():
        jax.config.update(n, v)
    cc.reset_cache()


def _poisonable_loss(logits, batch):
    loss = cross_entropy(logits, batch)
    return loss + jnp.sum(batch["poison"]) if "poison" in batch else loss  # + 0.0 keeps the bits


class _Poisoned:
    """The experiment's batches, plus a `poison` row vector that is NaN at `bad` steps."""

    def __init__(self, stream, bad: set[int]):
        self.stream, self.bad = stream, bad

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def global_batch(self, step, sharding):
        batch = self.stream.global_batch(step, sharding)
        rows = np.full((self.stream.batch_size,), np.nan if step in self.bad else 0.0, np.float32)
        batch["poison"] = jax.make_array_from_callback(rows.shape, sharding, lambda i: rows[i])
        return batch


def _experiment(bad: set[int], *sets: str):
    base = [
        "zero.stage=0",
        "train.steps=6",
        "checkpoint.every=2",
        "checkpoint.keep=3",
        "data.max_bytes=200000",
        "train.eval_batches=1",
    ]
    exp = build_experiment(load_config(CONFIG, base + list(sets)))
    exp.trainer.loss_fn = _poisonable_loss
    exp.train_data = _Poisoned(exp.train_data, bad)
    return exp


def test_fit_resume_at_stage_0_is_bit_exact_and_a_nan_batch_is_skipped(compile_cache, tmp_path):
    a = tmp_path / "a"
    exp = _experiment({2})  # the batch of step 3 (index 2) is poisoned
    summary = fit_experiment(exp, str(a))
    rec = _records(a)
    assert [r["bad_step"] for r in rec] == [0, 0, 1, 0, 0, 0] and summary["bad_steps"] == 1
    assert rec[2]["loss"] is None and all(np.isfinite(r["loss"]) for i, r in enumerate(rec) if i != 2)

    # The bad step kept params and optimizer state bit for bit and still advanced the step.
    state, _ = restore(
        exp.trainer,
        str(a / "checkpoints" / "2"),
        jax.random.key(0),
        exp.train_data.global_batch(2, exp.trainer.batch_sharding),
    )
    kept = jax.tree.map(np.asarray, {k: getattr(state, k) for k in ("params", "opt_state")})
    after, metrics = exp.trainer.step(state, exp.train_data.global_batch(2, exp.trainer.batch_sharding))
    assert int(metrics["bad_step"]) == 1 and int(after.step) == 3
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, {k: getattr(after, k) for k in kept}), kept)

    # A crash after step 3: checkpoint 2 on disk, metrics up to step 3 and a torn line.
    b = tmp_path / "b"
    shutil.copytree(a / "checkpoints" / "2", b / "checkpoints" / "2")
    with open(a / "metrics.jsonl") as f:
        lines = f.readlines()
    (b / "metrics.jsonl").write_text("".join(lines[:3]) + lines[3][:20])
    summary = fit_experiment(_experiment({2}), str(b), resume=True)
    assert summary["resumed_from"] == 2 and summary["bad_steps"] == 1
    keys = ("step", "loss", "grad_norm", "bad_step")
    assert [{k: r[k] for k in keys} for r in _records(b)] == [{k: r[k] for k in keys} for r in rec]


def test_max_bad_steps_stops_the_run_and_keeps_the_last_good_checkpoint(compile_cache, tmp_path):
    exp = _experiment({4, 5}, "train.steps=8", "train.max_bad_steps=2")
    with pytest.raises(
        UserError,
        match=r"training stopped at step 6: 2 consecutive steps had a non-finite loss, "
        r"gradient norm or update \(train.max_bad_steps=2\); the last good checkpoint is step 4",
    ):
        fit_experiment(exp, str(tmp_path))
    assert complete_steps(str(tmp_path / "checkpoints")) == [2, 4]
    assert [r["bad_step"] for r in _records(tmp_path)] == [0, 0, 0, 0, 1, 1]

    # Once the data is fixed, the same run resumes from the last good checkpoint and finishes.
    summary = fit_experiment(_experiment(set(), "train.steps=8", "train.max_bad_steps=2"), str(tmp_path), resume=True)
    assert summary["resumed_from"] == 4 and summary["bad_steps"] == 0
    assert [r["step"] for r in _records(tmp_path)] == list(range(1, 9))
    assert complete_steps(str(tmp_path / "checkpoints")) == [4, 6, 8]
