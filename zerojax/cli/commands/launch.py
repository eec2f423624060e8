"""`zerojax launch --processes N [--devices-per-process K] -- COMMAND ...`: a multi-process run on this machine.

Starts N copies of `zerojax COMMAND ...` (or of a Python script, `-- script.py ARGS`) joined into
one JAX distributed run through a coordinator on 127.0.0.1, streams their output with a `[i]`
prefix, and fails fast: the first process to exit non-zero is named and the others are stopped.
A SIGTERM to the launcher is forwarded to every process, which then saves a checkpoint and exits
75; the launcher waits for all of them (up to `_PREEMPT_GRACE_S`) and exits 75 too.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from zerojax.cli import distributed
from zerojax.errors import UserError

_STOP_GRACE_S = 10.0  # after SIGTERM, how long a process may take before SIGKILL
_POLL_S = 0.1
_PREEMPT_GRACE_S = 300.0  # after a forwarded SIGTERM: time to finish the step and write a checkpoint
PREEMPTED = 75  # the status `zerojax train` exits with after a termination request (errors.Preempted)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a command as N JAX processes on this machine (CPU simulation)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--processes", type=int, required=True, metavar="N", help="number of processes")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="simulated CPU devices per process (sets XLA_FLAGS and JAX_PLATFORMS=cpu)",
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        metavar="S",
        help=f"passed to every process (default {distributed.DEFAULT_HEARTBEAT_TIMEOUT_S} s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=None,
        metavar="S",
        help=f"passed to every process (default {distributed.DEFAULT_SHUTDOWN_TIMEOUT_S} s)",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after `--`: a zerojax subcommand (e.g. train CONFIG ...) or a .py script with its args",
    )
    p.set_defaults(run=run)


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it; a tiny race remains, as with any launcher)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_argv(command: list[str]) -> list[str]:
    """`train a.yaml` -> python -m zerojax.cli.main train a.yaml; `x.py a` -> python x.py a."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError(
            "launch needs a command after `--`, e.g. `zerojax launch --processes 2 -- train configs/tiny.yaml`."
        )
    if command[0].endswith(".py"):
        return [sys.executable, "-u", *command]
    if command[0] == "launch":
        raise UserError(
            "launch cannot launch itself; give the command each process should run, e.g. `-- train CONFIG`."
        )
    return [sys.executable, "-u", "-m", "zerojax.cli.main", *command]


def child_env(
    base: dict,
    *,
    process_id: int,
    processes: int,
    port: int,
    devices: int | None,
    heartbeat: int | None,
    shutdown: int | None,
) -> dict:
    env = dict(base)
    env.update(
        {
            distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
            distributed.ENV_NUM_PROCESSES: str(processes),
            distributed.ENV_PROCESS_ID: str(process_id),
            "PYTHONUNBUFFERED": "1",  # lines reach the launcher as they are printed
        }
    )
    if heartbeat is not None:
        env[distributed.ENV_HEARTBEAT_TIMEOUT] = str(heartbeat)
    if shutdown is not None:
        env[distributed.ENV_SHUTDOWN_TIMEOUT] = str(shutdown)
    if devices is not None:
        flags = [
            f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count=")
        ]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _parent_death_signal():
    """Linux: a `preexec_fn` that makes a child get SIGTERM if the launcher dies, so no orphan lingers."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _pump(stream, out, prefix: str, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _say(message: str) -> None:
    sys.stderr.write(f"launch: {message}\n")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    """Start the processes, stream their output, and return the run's exit status."""
    _check_args(args)
    argv = child_argv(args.command)
    port = args.port or free_port()
    _say(_describe_run(args.processes, args.devices_per_process, port, argv))
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    preexec = _parent_death_signal()
    try:
        for i in range(args.processes):  # all started before any thread runs: preexec_fn and threads don't mix
            procs.append(_spawn(argv, _process_env(args, i, port), preexec))
        for i, p in enumerate(procs):
            _say(f"process {i} started (pid {p.pid})")
            pumps += _stream_output(p, f"[{i}] ", lock)
        status = _watch(procs, _forward_sigterm(procs))
    except KeyboardInterrupt:
        _say("interrupted; stopping all processes")
        _stop(procs, _STOP_GRACE_S)
        status = 130
    for t in pumps:
        t.join(timeout=5)
    return status


def _check_args(args: argparse.Namespace) -> None:
    """Refuse counts, port and timeouts out of range, naming the flag and the value."""
    n, k = args.processes, args.devices_per_process
    if n < 1:
        raise UserError(f"--processes must be a positive integer, got {n}.")
    if k is not None and k < 1:
        raise UserError(f"--devices-per-process must be a positive integer, got {k}.")
    if args.port is not None and not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}.")
    for flag, value in (("--heartbeat-timeout", args.heartbeat_timeout), ("--shutdown-timeout", args.shutdown_timeout)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be a positive number of seconds, got {value}.")


def _describe_run(processes: int, devices: int | None, port: int, argv: list[str]) -> str:
    """The launcher's first line: how many processes of how many devices, where, running what."""
    per_process = f" x {devices} CPU devices" if devices else ""
    return f"{processes} processes{per_process}, coordinator 127.0.0.1:{port}: {' '.join(argv[1:])}"


def _process_env(args: argparse.Namespace, process_id: int, port: int) -> dict:
    """The environment of process `process_id`: the launcher's, plus its place in the run and the flags."""
    return child_env(
        dict(os.environ),
        process_id=process_id,
        processes=args.processes,
        port=port,
        devices=args.devices_per_process,
        heartbeat=args.heartbeat_timeout,
        shutdown=args.shutdown_timeout,
    )


def _spawn(argv: list[str], env: dict, preexec) -> subprocess.Popen:
    """One process, its stdout and stderr piped to the launcher line by line."""
    return subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        errors="replace",
        preexec_fn=preexec,
    )


def _stream_output(p: subprocess.Popen, prefix: str, lock: threading.Lock) -> list[threading.Thread]:
    """Threads that copy the process's stdout and stderr to the launcher's, each line prefixed."""
    threads = []
    for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
        t = threading.Thread(target=_pump, args=(stream, out, prefix, lock), daemon=True)
        t.start()
        threads.append(t)
    return threads


def _forward_sigterm(procs: list[subprocess.Popen]) -> threading.Event:
    """On SIGTERM, pass it on to every process once; the returned event says it happened."""
    forwarded = threading.Event()

    def on_sigterm(signum, frame):
        if not forwarded.is_set():
            forwarded.set()
            _say("SIGTERM: forwarded to every process; waiting for their checkpoint")
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    return forwarded


def _watch(procs: list[subprocess.Popen], forwarded: threading.Event | None = None) -> int:
    """Wait for all; on the first non-zero exit, name it, stop the rest and return its status.
    After a forwarded SIGTERM every process is given time to save, and the worst status is returned."""
    forwarded = forwarded or threading.Event()
    while True:
        if forwarded.is_set():
            return _wait_preempted(procs)
        running = False
        for i, p in enumerate(procs):
            code = p.poll()
            if code is None:
                running = True
            elif code != 0 and not forwarded.is_set():
                others = [q for q in procs if q.poll() is None]
                _say(
                    f"error: process {i} (pid {p.pid}) {describe_exit(code)}"
                    + (f"; stopping the other {len(others)}" if others else "")
                )
                _stop(others, _STOP_GRACE_S)
                return code if code > 0 else 128 - code
        if not running:
            _say(f"all {len(procs)} processes finished")
            return 0
        time.sleep(_POLL_S)


def _wait_preempted(procs: list[subprocess.Popen]) -> int:
    deadline = time.monotonic() + _PREEMPT_GRACE_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    _stop(procs, 0.0)  # any still running past the grace period
    codes = [p.returncode for p in procs]
    if all(c in (0, PREEMPTED) for c in codes):
        _say(f"all {len(procs)} processes stopped after the termination request")
        return PREEMPTED if PREEMPTED in codes else 0
    for i, (p, c) in enumerate(zip(procs, codes)):
        if c not in (0, PREEMPTED):
            _say(f"error: process {i} (pid {p.pid}) {describe_exit(c)} after the termination request")
            return c if c > 0 else 128 - c
    return 1
