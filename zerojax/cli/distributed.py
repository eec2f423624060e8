"""Multi-process start-up on JAX's distributed runtime (`jax.distributed.initialize`).

Three ways to start, chosen once by `resolve`:
  off       one process (no flags, no ZEROJAX_* variables): nothing to initialise;
  explicit  --coordinator HOST:PORT --num-processes N --process-id I (or ZEROJAX_COORDINATOR,
            ZEROJAX_NUM_PROCESSES, ZEROJAX_PROCESS_ID, as `zerojax launch` sets them);
  auto      --distributed: JAX detects SLURM, Cloud TPU pods, Open MPI or Kubernetes itself.

`initialize` must run before anything touches a JAX backend, which is why this module imports JAX
only inside it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerojax.errors import Preempted, UserError, first_line

ENV_COORDINATOR = "ZEROJAX_COORDINATOR"
ENV_NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROJAX_PROCESS_ID"
ENV_HEARTBEAT_TIMEOUT = "ZEROJAX_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "ZEROJAX_SHUTDOWN_TIMEOUT"

# JAX's own defaults are 100 s (heartbeat) and 300 s (shutdown): a dead peer would keep the others
# waiting for minutes. 60 s still rides out a long compile or a slow checkpoint write.
DEFAULT_HEARTBEAT_TIMEOUT_S = 60
DEFAULT_SHUTDOWN_TIMEOUT_S = 60
DEFAULT_INIT_TIMEOUT_S = 300  # every process must have connected by then (slow pods, image pulls)

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


@dataclass(frozen=True)
class DistributedSpec:
    mode: str = "off"  # "off" | "explicit" | "auto"
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def add_arguments(parser) -> None:
    """The distributed flags of `zerojax train` (and any command that trains)."""
    g = parser.add_argument_group("multi-process (jax.distributed)")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process run, detecting SLURM / TPU pod / Open MPI / Kubernetes",
    )
    g.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help=f"address of process 0's coordinator (or ${ENV_COORDINATOR})",
    )
    g.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help=f"number of processes in the run (or ${ENV_NUM_PROCESSES})",
    )
    g.add_argument(
        "--process-id", type=int, default=None, metavar="I", help=f"this process's index, 0..N-1 (or ${ENV_PROCESS_ID})"
    )
    g.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        metavar="S",
        help=f"seconds without heartbeats before a process counts as dead "
        f"(default {DEFAULT_HEARTBEAT_TIMEOUT_S}, or ${ENV_HEARTBEAT_TIMEOUT})",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=int,
        default=None,
        metavar="S",
        help=f"seconds an exiting process waits for the others "
        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S}, or ${ENV_SHUTDOWN_TIMEOUT})",
    )


def _int_from(name: str, flag, env: Mapping[str, str], env_name: str) -> int | None:
    if flag is not None:
        return flag
    raw = env.get(env_name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{env_name}={raw!r} must be an integer ({name}).") from None


def resolve(
    *,
    distributed: bool = False,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout: int | None = None,
    shutdown_timeout: int | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedSpec:
    """Flags first, then ZEROJAX_* variables; validated here so a bad value fails before JAX starts."""
    env = os.environ if env is None else env
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    num_processes = _int_from("--num-processes", num_processes, env, ENV_NUM_PROCESSES)
    process_id = _int_from("--process-id", process_id, env, ENV_PROCESS_ID)
    heartbeat = _int_from("--heartbeat-timeout", heartbeat_timeout, env, ENV_HEARTBEAT_TIMEOUT)
    shutdown = _int_from("--shutdown-timeout", shutdown_timeout, env, ENV_SHUTDOWN_TIMEOUT)
    timeouts: dict[str, Any] = {
        "heartbeat_timeout_s": DEFAULT_HEARTBEAT_TIMEOUT_S if heartbeat is None else heartbeat,
        "shutdown_timeout_s": DEFAULT_SHUTDOWN_TIMEOUT_S if shutdown is None else shutdown,
    }
    for key, value in timeouts.items():
        if value < 1:
            flag = "--" + key.removesuffix("_s").replace("_", "-")
            raise UserError(f"{flag} must be a positive number of seconds, got {value}.")

    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if all(v is None for v in given.values()):
        return DistributedSpec("auto" if distributed else "off", **timeouts)
    if coordinator is not None and not _HOST_PORT.match(coordinator):
        raise UserError(f"--coordinator must be HOST:PORT (e.g. 10.0.0.1:1234), got {coordinator!r}.")
    if coordinator is not None and not 0 < int(coordinator.rsplit(":", 1)[1]) < 65536:
        raise UserError(f"--coordinator port must be in 1..65535, got {coordinator!r}.")
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes must be a positive integer, got {num_processes}.")
    if process_id is not None and process_id < 0:
        raise UserError(f"--process-id must be >= 0, got {process_id}.")
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise UserError(f"--process-id={process_id} must be below --num-processes={num_processes}.")
    missing = [k for k, v in given.items() if v is None]
    if missing and not distributed:
        # Half-given settings are a typo far more often than an intent to auto-detect the rest.
        raise UserError(
            f"a multi-process run needs --coordinator, --num-processes and --process-id together "
            f"(missing {', '.join(missing)}); or pass --distributed to auto-detect the rest."
        )
    return DistributedSpec("auto" if missing else "explicit", coordinator, num_processes, process_id, **timeouts)


def spec_from_args(args) -> DistributedSpec:
    return resolve(
        distributed=args.distributed,
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        heartbeat_timeout=args.heartbeat_timeout,
        shutdown_timeout=args.shutdown_timeout,
    )


def apply_compiler_flags(xla_flags: list[str], libtpu_flags: list[str], env=None) -> None:
    """Put a config's compiler flags in front of XLA_FLAGS / LIBTPU_INIT_ARGS; before JAX starts.

    Flags already in the environment come after and so win (XLA keeps the last value of a flag):
    a one-off `XLA_FLAGS=... zerojax train pod.yaml` overrides the pod config, not the other way.
    """
    env = os.environ if env is None else env
    for name, flags in (("XLA_FLAGS", xla_flags), ("LIBTPU_INIT_ARGS", libtpu_flags)):
        if flags:
            env[name] = " ".join([*flags, env.get(name, "")]).strip()


def initialize(spec: DistributedSpec) -> None:
    """Join the run described by `spec` (no-op when off). Call before any other JAX call."""
    if not spec.enabled:
        return
    import jax

    # CPU processes exchange collectives over TCP with gloo (ignored by GPU and TPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            spec.coordinator,
            spec.num_processes,
            spec.process_id,
            initialization_timeout=spec.init_timeout_s,
            heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
            shutdown_timeout_seconds=spec.shutdown_timeout_s,
        )
    except (ValueError, TypeError) as e:  # auto-detection found no cluster, or inconsistent values
        if spec.mode == "auto" and ("should be defined" in str(e) or "must be defined" in str(e)):
            raise UserError(
                "--distributed found no cluster to join (SLURM, Cloud TPU pod, Open MPI or Kubernetes); "
                "pass --coordinator HOST:PORT --num-processes N --process-id I instead."
            ) from None
        raise UserError(f"could not start the multi-process run: {e}") from None
    except RuntimeError as e:  # e.g. the coordinator never answered within the init timeout
        raise UserError(
            f"could not join the multi-process run at {spec.coordinator or 'the detected coordinator'}: "
            f"{str(e).splitlines()[0]}"
        ) from None


def describe() -> str:
    """One line naming this process and what it sees, e.g. for the launcher's log."""
    import jax

    return (
        f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local "
        f"{jax.default_backend()} devices, {jax.device_count()} in all"
    )


def _exit_now(code: int) -> None:
    # os._exit skips JAX's atexit shutdown barrier, which would wait shutdown_timeout_s for peers
    # that are dead or stuck, and closes our sockets at once so the peers' collectives fail fast too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def fail_fast(spec: DistributedSpec):
    """Around the work of a multi-process run: any error ends this process at once, non-zero.

    A failed collective (a peer died) becomes one clear `error:` line; a bad-input `UserError`
    keeps its message and status 2; anything else prints its traceback first.
    """
    if not spec.enabled:
        yield
        return
    import jax

    who = f"process {jax.process_index()} of {jax.process_count()}"
    try:
        yield
    except SystemExit as e:
        if e.code not in (0, None):
            _exit_now(e.code if isinstance(e.code, int) else 1)
        raise
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        _exit_now(e.exit_code)
    except Preempted as e:  # the checkpoint is complete on disk: leave without the shutdown barrier
        sys.stderr.write(f"stopped: {e}\n")
        _exit_now(e.exit_code)
    except jax.errors.JaxRuntimeError as e:
        first = first_line(e) or type(e).__name__
        sys.stderr.write(
            f"error: {who}: a collective with the other processes failed; another process most "
            f"likely died or was stopped (see its log). XLA said: {first}\n"
        )
        _exit_now(1)
    except BaseException as e:  # noqa: BLE001 - a bug, ^C or SIGTERM: still never wait for the others
        traceback.print_exc()
        sys.stderr.write(f"error: {who} failed: {type(e).__name__}: {e}\n")
        _exit_now(130 if isinstance(e, KeyboardInterrupt) else 1)
