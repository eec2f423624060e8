"""Multi-process runs with real processes on this machine: start-up, launcher, data, loss parity, failure.

The multi-process tests start JAX processes that talk over gloo on 127.0.0.1 (tiny model, 5 steps);
each compiles once, so they take a few tens of seconds each on two cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.cli_helpers import LAUNCH_2X4, cli_in_process
from zerojax.cli import distributed
from zerojax.cli import main as cli
from zerojax.cli.commands import launch
from zerojax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
# Five steps of a one-layer, 32-wide GPT on 8 rows of 16 bytes; no eval split, so no second compile.
FAST = [
    "--set",
    "train.steps=5",
    "--set",
    "train.batch_size=8",
    "--set",
    "data.max_bytes=200000",
    "--set",
    "data.eval_fraction=0",
    "--set",
    "model.n_layers=1",
    "--set",
    "model.d_model=32",
    "--set",
    "model.d_ff=64",
    "--set",
    "model.seq_len=16",
]
RUN_TIMEOUT_S = 300  # a hung run fails the test instead of the CI job


# ---- start-up settings ------------------------------------------------------------------------------


def test_resolve_is_off_without_flags_or_environment():
    spec = distributed.resolve(env={})
    assert spec.mode == "off" and not spec.enabled
    assert (spec.heartbeat_timeout_s, spec.shutdown_timeout_s) == (60, 60)


def test_resolve_reads_the_environment_and_flags_win():
    env = {
        "ZEROJAX_COORDINATOR": "10.0.0.1:1234",
        "ZEROJAX_NUM_PROCESSES": "4",
        "ZEROJAX_PROCESS_ID": "3",
        "ZEROJAX_HEARTBEAT_TIMEOUT": "15",
    }
    spec = distributed.resolve(env=env)
    assert (spec.mode, spec.coordinator, spec.num_processes, spec.process_id) == ("explicit", "10.0.0.1:1234", 4, 3)
    assert (spec.heartbeat_timeout_s, spec.shutdown_timeout_s) == (15, 60)
    spec = distributed.resolve(process_id=1, coordinator="[::1]:99", shutdown_timeout=5, env=env)
    assert (spec.coordinator, spec.process_id, spec.shutdown_timeout_s) == ("[::1]:99", 1, 5)


def test_resolve_auto_detects_with_distributed_and_keeps_given_values():
    assert distributed.resolve(distributed=True, env={}).mode == "auto"
    spec = distributed.resolve(distributed=True, num_processes=8, env={})  # SLURM finds the rest
    assert (spec.mode, spec.num_processes, spec.coordinator) == ("auto", 8, None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"coordinator": "10.0.0.1"}, "HOST:PORT"),
        ({"coordinator": "h:70000", "num_processes": 2, "process_id": 0}, "port must be in 1..65535"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, "--process-id=2 must be below --num-processes=2"),
        ({"coordinator": "h:1", "num_processes": 0, "process_id": 0}, "--num-processes must be a positive"),
        ({"num_processes": 2}, "missing --coordinator, --process-id"),
        ({"heartbeat_timeout": 0}, "--heartbeat-timeout must be a positive"),
    ],
)
def test_resolve_rejects_bad_settings_in_one_sentence(kwargs, message):
    with pytest.raises(UserError, match=re.escape(message)):
        distributed.resolve(env={}, **kwargs)


def test_resolve_rejects_a_non_integer_environment_variable():
    with pytest.raises(UserError, match="ZEROJAX_PROCESS_ID='one' must be an integer"):
        distributed.resolve(env={"ZEROJAX_PROCESS_ID": "one"})


def test_initialize_passes_timeouts_and_selects_gloo(monkeypatch):
    import jax

    calls, updates = [], []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
    distributed.initialize(distributed.resolve(env={}))
    assert calls == [] and updates == []  # off: nothing touched
    distributed.initialize(distributed.resolve(coordinator="127.0.0.1:5", num_processes=2, process_id=1, env={}))
    assert updates == [("jax_cpu_collectives_implementation", "gloo")]
    ((args, kwargs),) = calls
    assert args == ("127.0.0.1:5", 2, 1)
    assert kwargs == {"initialization_timeout": 300, "heartbeat_timeout_seconds": 60, "shutdown_timeout_seconds": 60}


def test_distributed_without_a_cluster_is_one_clear_error():
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ZEROJAX_", "SLURM_", "OMPI_", "JAX_COORDINATOR", "KUBERNETES_", "TPU_"))
    }
    done = subprocess.run(
        [sys.executable, "-m", "zerojax.cli.main", "train", TINY, "--distributed"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: --distributed found no cluster to join (SLURM, Cloud TPU pod")


def test_compiler_flags_go_first_so_the_environment_wins():
    env = {"XLA_FLAGS": "--xla_a=2"}
    distributed.apply_compiler_flags(["--xla_a=1", "--xla_b=1"], ["--xla_tpu_c=true"], env)
    assert env == {"XLA_FLAGS": "--xla_a=1 --xla_b=1 --xla_a=2", "LIBTPU_INIT_ARGS": "--xla_tpu_c=true"}


# ---- launcher pieces and fail-fast (plain Python children, no JAX) ------------------------------------


def test_child_command_and_environment():
    assert launch.child_argv(["--", "train", "a.yaml"]) == [
        sys.executable,
        "-u",
        "-m",
        "zerojax.cli.main",
        "train",
        "a.yaml",
    ]
    assert launch.child_argv(["probe.py", "x"]) == [sys.executable, "-u", "probe.py", "x"]
    env = launch.child_env(
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_keep=1"},
        process_id=1,
        processes=2,
        port=1234,
        devices=4,
        heartbeat=None,
        shutdown=7,
    )
    assert env["XLA_FLAGS"] == "--xla_keep=1 --xla_force_host_platform_device_count=4"
    assert (env["ZEROJAX_COORDINATOR"], env["ZEROJAX_NUM_PROCESSES"], env["ZEROJAX_PROCESS_ID"]) == (
        "127.0.0.1:1234",
        "2",
        "1",
    )
    assert env["ZEROJAX_SHUTDOWN_TIMEOUT"] == "7" and "ZEROJAX_HEARTBEAT_TIMEOUT" not in env
    assert env["JAX_PLATFORMS"] == "cpu"
    assert launch.describe_exit(-9) == "was killed by SIGKILL" and launch.describe_exit(3) == "exited with status 3"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["launch", "--processes", "0", "--", "train", "x.yaml"], "--processes must be a positive integer, got 0."),
        (["launch", "--processes", "2"], "launch needs a command after `--`"),
        (["launch", "--processes", "2", "--", "launch", "--processes", "2"], "launch cannot launch itself"),
    ],
)
def test_launch_rejects_bad_input(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


_CHILD = """
import os, sys, time
i = int(os.environ["ZEROJAX_PROCESS_ID"])
print("hello", i, os.environ["ZEROJAX_NUM_PROCESSES"], os.environ["ZEROJAX_COORDINATOR"], flush=True)
if sys.argv[1] == "fail" and i == 1:
    print("boom", file=sys.stderr)
    sys.exit(3)
if sys.argv[1] == "fail":
    time.sleep(120)
"""


def _launch(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zerojax.cli.main", "launch", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=ROOT,
        **kwargs,
    )


def test_launch_prefixes_output_and_succeeds(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    done = _launch(["--processes", "3", "--", str(script), "ok"])
    assert done.returncode == 0, done.stderr
    for i in range(3):
        assert re.search(rf"^\[{i}\] hello {i} 3 127\.0\.0\.1:\d+$", done.stdout, re.M), done.stdout
    assert "launch: all 3 processes finished" in done.stderr


def test_launch_fails_fast_and_names_the_process(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    t0 = time.monotonic()
    done = _launch(["--processes", "2", "--", str(script), "fail"])
    assert time.monotonic() - t0 < 60  # process 0 sleeps 120 s: it was stopped, not waited for
    assert done.returncode == 3
    assert "[1] boom" in done.stderr
    assert re.search(r"launch: error: process 1 \(pid \d+\) exited with status 3; stopping the other 1", done.stderr)


# ---- real JAX processes -------------------------------------------------------------------------------


def _losses(out_dir) -> list[float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def _plain(args: list[str]) -> subprocess.CompletedProcess:
    """`zerojax train` as one process of 8 devices, outside any launcher or cluster: this test process,
    which needs no new interpreter."""
    return cli_in_process("train", TINY, *FAST, "--devices", "8", *args)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`launched(stage, processes)`: a 5-step tiny run, run once per module: through `zerojax launch`
    (processes >= 1), or as a plain process of 8 devices (processes 0).

    Checkpoints at steps 3 and 5, written by every process, for the cross-process restore test.
    """
    cache = {}

    def run(stage: int, processes: int):
        if (stage, processes) not in cache:
            out = tmp_path_factory.mktemp(f"stage{stage}-p{processes}")
            args = ["--set", f"zero.stage={stage}", "--set", "checkpoint.every=3", "--out", str(out)]
            if processes:
                done = _launch(
                    [
                        "--processes",
                        str(processes),
                        "--devices-per-process",
                        str(8 // processes),
                        "--",
                        "train",
                        TINY,
                        *FAST,
                        *args,
                    ]
                )
            else:
                done = _plain(args)
            assert done.returncode == 0, done.stderr[-3000:]
            cache[stage, processes] = (out, done)
        return cache[stage, processes]

    return run


# Stage 0, and the one-process launch against the plain process, under -m slow (36 s more each).
@pytest.mark.parametrize(
    "stage, one", [(3, 0), pytest.param(3, 1, marks=pytest.mark.slow), pytest.param(0, 1, marks=pytest.mark.slow)]
)
def test_two_processes_match_one_process(stage, one, launched):
    """2 processes x 4 devices and 1 process x 8 devices (plain, or launched): the same global batches,
    the same losses."""
    losses = {}
    for processes in (2, one):
        out, done = launched(stage, processes)
        losses[processes] = _losses(out)
        if not processes:
            continue
        assert f"[0] zerojax: process 0 of {processes}: {8 // processes} local cpu devices, 8 in all" in done.stderr
        # Only process 0 reports: progress and the summary table carry its prefix, never another's.
        assert re.search(r"^\[0\] .*zerojax run", done.stdout, re.M)
        assert not re.search(r"^\[1\] .*(zerojax run|step \d)", done.stdout + done.stderr, re.M)
    losses[1] = losses[one]
    assert len(losses[2]) == len(losses[1]) == 5
    for got, want in zip(losses[2], losses[1]):
        assert got == pytest.approx(want, rel=1e-6)
    assert losses[2][-1] < losses[2][0]  # it did train


def test_a_two_process_checkpoint_resumes_in_one_process(launched, tmp_path):
    """Both processes wrote their shards of step 3; one process with 8 devices reads them all back."""
    two, _ = launched(3, 2)
    one, _ = launched(3, 0)
    # Orbax keeps each process's shards in its own store: both processes wrote theirs.
    written = sorted(p.name for p in (two / "checkpoints" / "3" / "state").glob("ocdbt.process_*"))
    assert written == ["ocdbt.process_0", "ocdbt.process_1"]
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(two / "checkpoints", ckpt)
    shutil.rmtree(ckpt / "5")  # resume from step 3, written by the two processes
    out = tmp_path / "resumed"
    done = _plain(["--set", "zero.stage=3", "--set", f"checkpoint.dir={ckpt}", "--out", str(out), "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = _losses(out)
    assert len(resumed) == 2  # steps 4 and 5 only
    for got, want in zip(resumed, _losses(one)[3:]):
        assert got == pytest.approx(want, rel=1e-6)


_PROBE = """
import json
from zerojax.cli import distributed
distributed.initialize(distributed.resolve())  # ZEROJAX_* from the launcher
import jax, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from zerojax.data.corpus import BatchStream
from zerojax.core.mesh import BATCH_AXES, make_mesh

tokens = (np.arange(5000) * 7 % 256).astype(np.uint8)
stream = BatchStream(tokens, seq_len=16, global_batch=8, seed=0)
loaded = []
rows = stream.rows
stream.rows = lambda step, start, stop: loaded.append((start, stop)) or rows(step, start, stop)
mesh = make_mesh(data=2)  # hybrid: data=2 x fsdp=4
batch = stream.global_batch(3, NamedSharding(mesh, P(BATCH_AXES)))
full = multihost_utils.process_allgather(batch["inputs"], tiled=True)
expected = BatchStream(tokens, seq_len=16, global_batch=8, seed=0).host_batch(3)["inputs"]
print("PROBE " + json.dumps({
    "process": jax.process_index(),
    "rows": sorted({r for a, b in loaded for r in range(a, b)}),
    "row_reads": sum(b - a for a, b in loaded),
    "global_equals_single_process": bool(np.array_equal(full, expected)),
    "mesh_row_processes": [sorted({d.process_index for d in row.flat}) for row in mesh.devices],
}), flush=True)
"""


def test_each_process_loads_only_its_rows_of_the_global_batch(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    # the probe runs from tmp_path: the package is found from the checkout, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = _launch(["--processes", "2", "--devices-per-process", "4", "--", str(script)], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    probes = {p["process"]: p for p in (json.loads(m) for m in re.findall(r"^\[\d\] PROBE (.*)$", done.stdout, re.M))}
    assert sorted(probes) == [0, 1]
    assert probes[0]["rows"] == [0, 1, 2, 3] and probes[1]["rows"] == [4, 5, 6, 7]
    # Each owned row is read once for `inputs` and once for `targets`; no other row is read at all.
    assert probes[0]["row_reads"] == probes[1]["row_reads"] == 2 * 4
    assert all(p["global_equals_single_process"] for p in probes.values())
    # Hybrid meshes put one host on each `data` row: fsdp collectives stay inside a process.
    assert probes[0]["mesh_row_processes"] == [[0], [1]]


# ---- failure: a dead process ends the run, bounded in time -----------------------------------------------


class _Lines:
    """Collects a stream's lines in a thread, so a test can wait for one without blocking on the pipe."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in iter(stream.readline, ""):
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{''.join(self.lines)[-3000:]}")

    def text(self) -> str:
        self._thread.join(timeout=10)
        return "".join(self.lines)


LONG = ["--set", "train.steps=100000", *FAST[2:]]


def test_killing_a_process_stops_the_launcher_and_its_peer(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-m", "zerojax.cli.main", *LAUNCH_2X4, "train", TINY, *LONG, "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    err = _Lines(p.stderr)
    try:
        pids = {k: int(err.wait_for(rf"process {k} started \(pid (\d+)\)", 30).group(1)) for k in (0, 1)}
        err.wait_for(r"^\[1\] zerojax: process 1 of 2", 120)  # both have joined the run
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        code = p.wait(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert code != 0 and elapsed < 90
    assert re.search(
        rf"launch: error: process 1 \(pid {pids[1]}\) was killed by SIGKILL; stopping the other 1", err.text()
    )
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # the survivor is gone too


def test_survivor_exits_on_its_own_when_its_peer_dies(tmp_path):
    """No launcher (as under srun): process 0 must notice process 1's death and exit, not hang."""
    port = launch.free_port()
    procs, errs = [], []
    for i in range(2):
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    "-m",
                    "zerojax.cli.main",
                    "train",
                    TINY,
                    *LONG,
                    "--devices",
                    "4",
                    "--out",
                    str(tmp_path),
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                    "--heartbeat-timeout",
                    "10",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={k: v for k, v in os.environ.items() if not k.startswith("ZEROJAX_")},
            )
        )
        errs.append(_Lines(procs[-1].stderr))
    try:
        for i in range(2):
            errs[i].wait_for(rf"zerojax: process {i} of 2", 120)
        procs[1].kill()
        t0 = time.monotonic()
        code = procs[0].wait(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
    assert code != 0 and elapsed < 90
    # Either the failed collective (our message) or the coordination service's heartbeat check (XLA's).
    assert re.search(r"another (process|task) (most likely )?died", errs[0].text()), errs[0].text()[-3000:]
