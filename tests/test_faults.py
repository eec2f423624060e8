"""Faults, driven through the CLI as a user meets them: SIGKILL at seeded random points, SIGTERM
(one process and a two-process `zerojax launch`), a write that fails half-way through a save, a
loss that blows up, a changed config on resume and unwritable outputs. After each, the last
complete checkpoint resumes bit-exactly and metrics.jsonl has every step exactly once."""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.cli_helpers import (
    LAUNCH_2X4,
    RECORDS_POLL_S,
    assert_one_line_error,
    cli_env,
    cli_in_process,
    dir_digest,
    read_records,
    wait_for,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "tiny.yaml")
STEPS = 8
SETS = [
    f"train.steps={STEPS}",
    "checkpoint.every=2",
    "checkpoint.keep=4",
    "data.max_bytes=200000",
    "train.eval_batches=1",
]


def _records(out) -> list[dict]:
    return read_records(out)


def _train_args(out, *sets, resume=True) -> list[str]:
    """`zerojax train`'s arguments for this module's runs (for `cli_in_process`, or `_cmd`)."""
    args = ["train", CONFIG, "--devices", "8", "--out", str(out)] + (["--resume"] if resume else [])
    return args + [a for s in (*SETS, *sets) for a in ("--set", s)]


def _cmd(out, *sets, resume=True) -> list[str]:
    return [sys.executable, "-m", "zerojax.cli.main", *_train_args(out, *sets, resume=resume)]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return cli_env(tmp_path_factory.mktemp("xla_cache"))


def _run(cmd, env, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO, **kw)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, env):
    """The uninterrupted run: its folder (checkpoints 2, 4, 6 and 8) and its records."""
    out = tmp_path_factory.mktemp("reference")
    done = _run(_cmd(out), env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, _records(out)


@pytest.fixture(scope="module")
def reference(reference_run) -> list[dict]:
    return reference_run[1]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, reference_run):
    """The reference run as it stood after step 4 (checkpoints 2 and 4, four records), which each test
    copies before changing it: the same program, so no run of its own to compile."""
    ref, records = reference_run
    out = tmp_path_factory.mktemp("four_steps") / "run"
    shutil.copytree(
        ref,
        out,
        ignore=lambda d, names: (
            [n for n in names if d == str(ref / "checkpoints") and n.isdigit() and int(n) > 4] + ["summary.json"]
        ),
    )
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records[:4])
    assert _complete(out) == [2, 4]
    return out


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _assert_matches(out, reference: list[dict]) -> None:
    got = _records(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # no gap, no repeat
    assert [r["loss"] for r in got] == [r["loss"] for r in reference]  # bit for bit
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in reference]


def _wait_records(out, n: int, proc, timeout: float = 300) -> None:
    wait_for(lambda: len(_records(out)) >= n, proc, f"step {n}", timeout, poll=RECORDS_POLL_S)


def _complete(out) -> list[int]:
    d = os.path.join(out, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


# ---- SIGKILL at seeded random points ------------------------------------------------------------


def _kill_and_resume(points: int, seed: int, env, reference, tmp_path) -> None:
    rng = random.Random(seed)
    for i in range(points):
        out = tmp_path / f"run{i}"
        # Killed after a random number of steps, then perhaps again, then run to the end.
        for kill_at in sorted(rng.sample(range(1, STEPS), rng.choice((1, 2)))):
            if len(_records(out)) >= kill_at:
                continue
            proc = subprocess.Popen(_cmd(out), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _wait_records(out, kill_at, proc)
            time.sleep(rng.random() * 0.05)  # anywhere in the next step or save
            proc.kill()
            proc.wait()
        last = _complete(out)
        done = _run(_cmd(out), env)
        assert done.returncode == 0, done.stderr[-3000:]
        _assert_matches(out, reference)
        with open(out / "summary.json") as f:
            assert json.load(f)["resumed_from"] == (last[-1] if last else 0)


@pytest.mark.slow  # the default suite kills mid-run and mid-save in test_resume.py
def test_sigkill_at_random_points_resumes_bit_exact(env, reference, tmp_path):
    _kill_and_resume(2, 13, env, reference, tmp_path)


@pytest.mark.slow
def test_sigkill_at_20_random_points_resumes_bit_exact(env, reference, tmp_path):
    _kill_and_resume(20, 1313, env, reference, tmp_path)


# ---- SIGTERM -------------------------------------------------------------------------------------


def test_sigterm_saves_the_current_step_exits_75_and_resumes_bit_exact(env, reference, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_records(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    stopped = len(_records(out))
    assert _complete(out)[-1] == stopped  # the step it stopped after is saved, odd or even
    assert f"stopped: a termination request arrived; step {stopped} is saved in" in err and "Traceback" not in err
    done = _run(_cmd(out), env)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_matches(out, reference)


LAUNCH_SETS = [
    "--set",
    "train.batch_size=8",
    "--set",
    "data.max_bytes=200000",
    "--set",
    "data.eval_fraction=0",
    "--set",
    "checkpoint.every=100",
]


def _launch(out, steps: int, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "zerojax.cli.main",
        *LAUNCH_2X4,
        "train",
        CONFIG,
        "--out",
        str(out),
        "--set",
        f"train.steps={steps}",
        *LAUNCH_SETS,
        *extra,
    ]


@pytest.mark.slow  # 2.5 minutes: two processes, a reference run, the interrupted run and its resume
def test_sigterm_to_a_two_process_launch_checkpoints_and_resumes_bit_exact(env, tmp_path):
    steps = 40
    ref = tmp_path / "ref"
    done = _run(_launch(ref, steps), env)
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "run"
    proc = subprocess.Popen(
        _launch(out, steps), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    _wait_records(out, 3, proc)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - t < 60 and proc.returncode == 75, err[-3000:]
    assert "launch: all 2 processes stopped after the termination request" in err
    stopped = len(_records(out))
    assert stopped < steps and _complete(out)[-1] == stopped
    done = _run(_launch(out, steps, "--resume"), env)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = _records(out), _records(ref)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


# ---- a write that fails during a save ------------------------------------------------------------


def _limit_file_size(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_a_failed_checkpoint_write_is_one_line_and_the_last_checkpoint_resumes(env, reference, four_steps, tmp_path):
    out = _copy(four_steps, tmp_path)  # checkpoints 2 and 4, written normally
    before = {s: dir_digest(out / "checkpoints" / str(s)) for s in (2, 4)}
    # Every save writes files over 10 kB (its sharding and array metadata: 13-16 kB; its data files,
    # ~1 MB in all, are batched into files of a size that depends on timing); metrics.jsonl and the
    # event file stay far below. Every program is in the shared compilation cache already (the
    # reference ran this config), so the cache only reads.
    done = _run(_cmd(out), env, preexec_fn=_limit_file_size(10_000))
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [l for l in done.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "writing the checkpoint of step 6" in errors[0] and "file too large (EFBIG)" in errors[0], errors
    assert "corrupted" not in errors[0]
    assert _complete(out) == [2, 4] and not [n for n in os.listdir(out / "checkpoints") if not n.isdigit()]
    assert {s: dir_digest(out / "checkpoints" / str(s)) for s in (2, 4)} == before
    done = _run(_cmd(out), env)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_matches(out, reference)


# ---- a loss that blows up ------------------------------------------------------------------------


def test_a_blown_up_loss_stops_with_exit_3_and_never_saves_a_non_finite_value(env, tmp_path):
    out = tmp_path / "run"
    done = _run(_cmd(out, "optimizer.lr=1e30", "checkpoint.every=1", "checkpoint.keep=20", resume=False), env)
    assert done.returncode == 3, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: training stopped at step ") and "(train.max_bad_steps=3)" in line, line
    records = _records(out)
    assert [r["bad_step"] for r in records][-3:] == [1, 1, 1]
    saved = _complete(out)
    assert saved and saved[-1] == len(records) - 3  # bad steps write no checkpoint
    for step in saved:
        npz = tmp_path / f"p{step}.npz"
        done = cli_in_process("export", str(out / "checkpoints" / str(step)), str(npz))
        assert done.returncode == 0, done.stderr[-3000:]
        with np.load(npz) as f:
            assert all(np.isfinite(f[k]).all() for k in f.files)


# ---- a changed config on resume ------------------------------------------------------------------


TRAJECTORY = {
    "optimizer.lr": "optimizer.lr=0.001",
    "optimizer.name": "optimizer.name=adam",
    "optimizer.warmup_steps": "optimizer.warmup_steps=2",
    "train.batch_size": "train.batch_size=8",
    "train.seed": "train.seed=1",
    "data.max_bytes": "data.max_bytes=300000",
    "precision": "precision=bf16",
    "model.d_model": "model.d_model=32",
}


def test_each_trajectory_key_changed_on_resume_is_named(tmp_path):
    from zerojax.cli.config import load_config
    from zerojax.errors import UserError
    from zerojax.train.resume import check_resume_config

    saved = load_config(CONFIG, SETS).to_dict()
    for key, override in TRAJECTORY.items():
        with pytest.raises(UserError, match=rf"{key.replace('.', '[.]')} is .* here but .* in the checkpoint"):
            check_resume_config(saved, load_config(CONFIG, [*SETS, override]).to_dict(), "ckpt")
    for safe in (
        "zero.stage=2",
        "zero.engine=shard_map",
        "mesh.data=2",
        "checkpoint.every=3",
        "train.steps=20",
        "checkpoint.keep=5",
        "train.eval_every=2",
        "train.microbatches=2",
    ):
        check_resume_config(saved, load_config(CONFIG, [*SETS, safe]).to_dict(), "ckpt")


def test_resume_refuses_a_new_learning_rate_and_accepts_a_new_stage_and_length(env, four_steps, tmp_path):
    out = _copy(four_steps, tmp_path)
    before = dir_digest(out)
    done = cli_in_process(*_train_args(out, "optimizer.lr=0.01", "train.batch_size=8"))
    assert_one_line_error(
        done,
        "optimizer.lr is 0.01 here but 0.003 in the checkpoint",
        "train.batch_size is 8 here but 16 in the checkpoint",
    )
    assert dir_digest(out) == before
    cmd = _cmd(out, "train.steps=6", "zero.stage=1", "zero.engine=shard_map")
    done = _run([*cmd[: cmd.index("--devices") + 1], "4", *cmd[cmd.index("--devices") + 2 :]], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "warning: resuming with changed settings: devices 8 (fsdp 8) -> 4 (fsdp 4), train.steps 8 -> 6, "
        "zero.engine 'gspmd' -> 'shard_map', zero.stage 3 -> 1; the learning-rate schedule now spans the new "
        "train.steps." in " ".join(done.stderr.split())
    ), done.stderr[-2000:]
    assert [r["step"] for r in _records(out)] == list(range(1, 7))


# ---- outputs that cannot be written --------------------------------------------------------------


def test_out_naming_a_file_or_under_one_is_one_line(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    before = dir_digest(tmp_path)
    assert_one_line_error(cli_in_process(*_train_args(a_file)), f"--out {str(a_file)!r} is a file")
    assert_one_line_error(cli_in_process(*_train_args(a_file / "sub")), f"is under {str(a_file)!r}, which is a file")
    assert dir_digest(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_out_in_a_read_only_folder_is_one_line(env, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert_one_line_error(_run(_cmd(ro / "out"), env), "is not writable")
    finally:
        ro.chmod(0o755)


def test_export_refuses_folders_in_the_way(four_steps, tmp_path):
    out = four_steps
    (tmp_path / "p.npz.partial").mkdir()
    (tmp_path / "q.npz").mkdir()
    before = dir_digest(tmp_path)
    export = ["export", str(out)]
    assert_one_line_error(cli_in_process(*export, str(tmp_path / "p.npz")), "p.npz.partial' is a folder")
    assert_one_line_error(cli_in_process(*export, str(tmp_path / "q.npz")), "q.npz' is a folder")
    assert dir_digest(tmp_path) == before and (tmp_path / "p.npz.partial").is_dir()
