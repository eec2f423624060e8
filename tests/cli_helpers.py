"""Run the `zerojax` CLI in a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# `zerojax launch` of two processes with four devices each, before the command it launches
LAUNCH_2X4 = ("launch", "--processes", "2", "--devices-per-process", "4", "--")


def without_device_count(flags: str) -> str:
    """The session's XLA flags (tests/conftest.py) less the device count: each command sets its own
    with --devices."""
    return re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags).strip()


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env["XLA_FLAGS"] = without_device_count(full_env.get("XLA_FLAGS", ""))
    return subprocess.run(
        [sys.executable, "-m", "zerojax.cli.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """`zerojax ARGS` through the CLI's own `main` in this process, as `run_cli` reports it: for a test
    that checks what a command says, with no new interpreter to start. JAX is up here with 8
    devices, so `--devices` may only say 8 (or a count it refuses); the environment a command
    changes is restored after it."""
    import contextlib
    import io

    from zerojax.cli import main as cli

    devices = [args[i + 1] for i, a in enumerate(args) if a == "--devices"]
    assert all(int(d) == 8 or int(d) < 1 for d in devices), "a command on another device count needs run_cli"
    environ = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as e:  # argparse's errors
                code = e.code
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["zerojax", *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit status 2, exactly one `error:` line on stderr, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = [l for l in result.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def dir_digest(path) -> dict:
    """SHA-256 of every file under `path`, by relative path: proof that nothing on disk changed."""
    import hashlib

    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


# How often a test re-reads a run's metrics.jsonl while waiting for a step: each read parses the file,
# and a faster loop takes a core from the run it waits for.
RECORDS_POLL_S = 0.01


def wait_for(predicate, proc, what: str, timeout: float = 300, poll: float = 0.0005) -> None:
    """Poll `predicate` until it holds; fail (killing `proc` on a timeout) if `proc` ends first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the training process ended (rc {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(poll)


def cli_env(cache_dir) -> dict:
    """The environment of CLI subprocesses sharing one compilation cache (each compiles the same
    step, so all but the first are cheap); each sets its own device count with --devices."""
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "PYTHONPATH": REPO,
        "COLUMNS": "200",
    }
    env["XLA_FLAGS"] = without_device_count(env.get("XLA_FLAGS", ""))
    return env


def read_records(out) -> list[dict]:
    """The complete lines of OUT/metrics.jsonl (a run killed mid-write may leave a partial last one)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]
