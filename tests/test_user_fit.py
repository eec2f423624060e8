"""A user's own model and batch source (tests/user_code.py, outside zerojax/) through `zj.fit` and
through `zerojax train | plan | inspect | launch` with model.target / data.target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import optax
import pytest

import zerojax as zj
from tests.cli_helpers import (
    LAUNCH_2X4,
    RECORDS_POLL_S,
    assert_one_line_error,
    cli_env,
    cli_in_process,
    read_records,
    run_cli,
)
from tests.user_code import MLP, blobs
from zerojax.data.sources import ArraySource, IterableSource, global_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8
TARGETS = [
    "--set",
    "model.target=tests.user_code:MLP",
    "--set",
    "data.target=tests.user_code:blobs",
    "--set",
    "data.eval_kwargs={}",
    "--set",
    "train.batch_size=16",
    "--set",
    "precision=fp32",
    "--set",
    "optimizer.warmup_steps=0",
    "--set",
    "checkpoint.every=2",
    "--set",
    "checkpoint.keep=3",
    "--set",
    "train.eval_batches=1",
]


def _records(out) -> list[dict]:
    return read_records(out)


LR = 1e-2


def _trainer(stage=3):
    return zj.Trainer(lambda rngs: MLP(rngs=rngs), optax.adam(LR), mesh=zj.make_mesh(), stage=stage)


# ---- sources --------------------------------------------------------------------------------------


def test_array_source_is_a_pure_function_of_seed_and_step_and_rows_agree():
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    a, b = ArraySource({"inputs": x}, batch_size=8, seed=3), ArraySource({"inputs": x}, batch_size=8, seed=3)
    for step in (5, 0, 2, 5):
        np.testing.assert_array_equal(a.batch(step)["inputs"], b.batch(step)["inputs"])
        np.testing.assert_array_equal(a.rows(step, 3, 7)["inputs"], a.batch(step)["inputs"][3:7])
    seen = np.concatenate([a.batch(s)["inputs"][:, 0] for s in range(5)])[:20]  # one epoch: every row once
    assert sorted(seen.tolist()) == x[:, 0].tolist()
    sharded = global_batch(a, 4, _trainer().batch_sharding)  # built from per-device rows
    np.testing.assert_array_equal(np.asarray(sharded["inputs"]), a.batch(4)["inputs"])


def test_iterable_source_replays_to_the_step():
    made = []

    def make():
        made.append(1)
        return ({"inputs": np.full((2, 1), i, np.float32)} for i in range(10))

    src = IterableSource(make)
    assert [float(src.batch(s)["inputs"][0, 0]) for s in (0, 1, 1, 4)] == [0, 1, 1, 4] and len(made) == 1
    assert float(src.batch(2)["inputs"][0, 0]) == 2 and len(made) == 2  # a step back restarts and replays


# ---- zj.fit ---------------------------------------------------------------------------------------


def test_fit_trains_any_trainer_and_resume_is_bit_exact(tmp_path):
    opts = dict(checkpoint_every=2, checkpoint_keep=3, eval_every=4, eval_batches=1)
    full = zj.fit(
        _trainer(),
        blobs(seed=0, batch_size=16),
        str(tmp_path / "a"),
        steps=STEPS,
        eval_source=blobs(seed=1, batch_size=16),
        **opts,
    )
    ref = _records(tmp_path / "a")
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1)) and ref[-1]["loss"] < ref[0]["loss"]
    assert full["params"] == 12 * 24 + 24 + 24 * 4 + 4 and full["eval_loss"] is not None
    assert full["tokens_per_s"] > 0 and ref[0]["tokens_per_s"] > 0  # examples per second: float inputs

    zj.fit(_trainer(), blobs(seed=0, batch_size=16), str(tmp_path / "b"), steps=5, **opts)
    resumed = zj.fit(
        _trainer(),
        blobs(seed=0, batch_size=16),
        str(tmp_path / "b"),
        steps=STEPS,
        resume=True,
        eval_source=blobs(seed=1, batch_size=16),
        **opts,
    )
    got = _records(tmp_path / "b")
    assert resumed["resumed_from"] == 5  # the 5-step run saved its last step
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]  # bit for bit
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in ref]


def test_summary_and_metrics_have_the_gpt_fields(tmp_path):
    from zerojax.cli.config import load_config
    from zerojax.cli.experiment import build_experiment, fit_experiment

    gpt = fit_experiment(
        build_experiment(
            load_config("configs/tiny.yaml", ["train.steps=2", "data.max_bytes=100000", "train.eval_batches=1"])
        ),
        str(tmp_path / "g"),
    )
    mine = zj.fit(
        _trainer(),
        blobs(seed=0, batch_size=16),
        str(tmp_path / "m"),
        steps=2,
        eval_source=blobs(seed=1, batch_size=16),
        eval_batches=1,
        learning_rate=LR,  # a config run knows its optimizer's rate; a user's fit is told it
    )
    assert set(mine) == set(gpt)
    assert set(_records(tmp_path / "m")[0]) == set(_records(tmp_path / "g")[0])


def test_a_learning_rate_function_with_python_control_flow_is_recorded(tmp_path):
    """Schedules are compiled once per run; one that cannot be traced
    (a branch on the step, a dict looked up by it) is called as is."""
    zj.fit(
        _trainer(), blobs(seed=0, batch_size=16), str(tmp_path), steps=3, learning_rate=lambda s: 0.1 if s < 2 else 0.01
    )
    assert [r["learning_rate"] for r in _records(tmp_path)] == [0.1, 0.1, 0.01]
    table = {0: 0.5, 1: 0.25}  # looked up by the step: unhashable while traced
    out = str(tmp_path / "table")
    zj.fit(_trainer(), blobs(seed=0, batch_size=16), out, steps=3, learning_rate=lambda s: table.get(s, 0.0))
    assert [r["learning_rate"] for r in _records(out)] == [0.5, 0.25, 0.0]


# ---- the CLI with model.target / data.target ------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return cli_env(tmp_path_factory.mktemp("xla_cache"))


def _cmd(out, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "zerojax.cli.main",
        "train",
        "configs/tiny.yaml",
        "--devices",
        "8",
        "--out",
        str(out),
        "--set",
        f"train.steps={STEPS}",
        *TARGETS,
        *extra,
    ]


def _sigkill_and_resume(env, tmp_path, *sets) -> tuple[list[dict], list[dict]]:
    """(the uninterrupted run's records, those of a run SIGKILLed after step 5 and resumed)."""
    ref = subprocess.run(_cmd(tmp_path / "ref", *sets), env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(out, *sets), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(_records(out)) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(RECORDS_POLL_S)
    proc.kill()
    proc.wait()
    done = subprocess.run(_cmd(out, "--resume", *sets), env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _records(tmp_path / "ref"), _records(out)


@pytest.mark.slow  # the default suite kills and resumes the RegularisedMLP target below
def test_cli_train_with_targets_sigkill_and_resume_is_bit_exact(env, tmp_path):
    reference, got = _sigkill_and_resume(env, tmp_path)
    assert len(reference) == STEPS and reference[-1]["loss"] < reference[0]["loss"]
    summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["params"] == 12 * 24 + 24 + 24 * 4 + 4 and summary["eval_loss"] is not None
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in reference]  # bit for bit
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in reference]


def test_cli_sigkill_and_resume_with_dropout_and_batchnorm_is_bit_exact(env, tmp_path):
    """The RNG stream and the BatchNorm statistics are part of what a checkpoint restores."""
    reference, got = _sigkill_and_resume(env, tmp_path, "--set", "model.target=tests.user_code:RegularisedMLP")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in reference]  # bit for bit
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in reference]
    # Evaluation runs on the running BatchNorm statistics, which only a restored model state carries.
    evals = [json.loads((tmp_path / d / "summary.json").read_text())["eval_loss"] for d in ("ref", "killed")]
    assert evals[0] is not None and evals[0] == evals[1]


_MLP = ["model.target=tests.user_code:MLP", "data.target=tests.user_code:blobs"]
BAD = {
    "missing module": (["model.target=no_such_pkg.models:Net"], ["model.target", "no_such_pkg"]),
    "missing name": (["model.target=tests.user_code:Nope"], ["model.target", "Nope"]),
    "not callable": (["data.target=tests.user_code:NOT_CALLABLE"], ["data.target", "NOT_CALLABLE"]),
    "no colon": (["loss.target=tests.user_code"], ["loss.target", "package.module:name"]),
    "model returns the wrong kind": (["model.target=tests.user_code:not_a_model"], ["model.target", "int"]),
    # (a traceback's text about JAX types, and "returned a ShapeDtypeStruct", before)
    "a class of neither kind": (["model.target=tests.user_code:NotAModule"], ["class that is neither an nnx.Module"]),
    "rngs give no module": (["model.target=tests.user_code:a_number"], ["returned an array or a number, not an nnx"]),
    "data returns the wrong kind": (
        ["model.target=tests.user_code:MLP", "data.target=tests.user_code:not_a_source"],
        ["data.target", "batch source"],
    ),
    "bad model kwargs": (
        ["model.target=tests.user_code:MLP", "model.kwargs={colour: red}"],
        ["model.kwargs", "colour"],
    ),
    "GPT key with a target": ([*_MLP, "model.remat=dots"], ["model.remat configures the shipped GPT", "model.kwargs"]),
    # the model, the loss and the batch do not fit: found on abstract shapes before compiling
    "output vs targets": (
        ["model.target=tests.user_code:FlatMLP", "data.target=tests.user_code:blobs"],
        ["model's output is float32[16]", "targets are int32[16]", "[16, 'classes']"],
    ),
    "no targets": (
        ["model.target=tests.user_code:MLP", "data.target=tests.user_code:unlabelled"],
        ["no 'targets' key", "['inputs']"],
    ),
    "per-row loss": ([*_MLP, "loss.target=tests.user_code:per_row_loss"], ["loss function returned shape [16]"]),
    "labels outside the classes": ([*_MLP, "model.kwargs={classes: 3}"], ["a target is 3", "3 output classes"]),
    "a Linen stream not keyed": (
        ["model.target=tests.user_code:NoisyLinen", "data.target=tests.user_code:blobs"],
        ["RNG stream 'noise'", "model.rng_streams"],
    ),
    "streams without a target": (["model.rng_streams=[noise]"], ["model.rng_streams", "model.target"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_target_is_one_line_exit_2(case, tmp_path):
    sets, needles = BAD[case]
    args = [a for s in sets for a in ("--set", s)]
    assert_one_line_error(
        cli_in_process("train", "configs/tiny.yaml", "--devices", "8", "--out", str(tmp_path), *args), *needles
    )


def test_a_configs_rng_streams_reach_the_trainer():
    """model.rng_streams keys the Linen target's own stream: the step's check traces it in training."""
    import jax

    from zerojax.cli.config import load_config
    from zerojax.cli.experiment import build_experiment

    sets = ["model.target=tests.user_code:NoisyLinen", "data.target=tests.user_code:blobs"]
    c = load_config("configs/tiny.yaml", [*sets, "model.rng_streams=[dropout, noise]", "train.batch_size=16"])
    experiment = build_experiment(c)
    batch = blobs(seed=0, batch_size=16).batch(0)
    assert int(experiment.trainer.init(jax.random.key(0), batch).step) == 0


# the same model, its data's inputs an array, then a dict of arrays (features and a per-row gate)
GATED = ["--set", "model.target=tests.user_code:GatedMLP", "--set", "data.target=tests.user_code:gated_blobs"]


@pytest.mark.parametrize("targets", [TARGETS, GATED], ids=["array", "dict"])
def test_plan_and_inspect_count_a_target_model(targets):
    """Both count the model's parameters from one row of each input leaf."""
    n = 12 * 24 + 24 + 24 * 4 + 4
    plan = cli_in_process("plan", "configs/tiny.yaml", *targets, "--devices", "8", "--json")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert json.loads(plan.stdout)["params"] == n
    inspect = cli_in_process("inspect", "configs/tiny.yaml", *targets, "--devices", "8", "--json")
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    report = json.loads(inspect.stdout)
    assert report["params"] == n and {l["path"] for l in report["leaves"]} >= {"hidden/kernel", "out/kernel"}


@pytest.mark.slow
def test_compare_runs_a_target_model(tmp_path):
    done = run_cli(
        "compare",
        "configs/tiny.yaml",
        *TARGETS,
        "--devices",
        "8",
        "--stages",
        "0,3",
        "--steps",
        "2",
        "--json",
        str(tmp_path / "c.json"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert abs(rows[0]["final_loss"] - rows[1]["final_loss"]) < 1e-5


@pytest.mark.slow
def test_launch_two_processes_match_one_with_targets(env, tmp_path):
    base = [*TARGETS, "--set", f"train.steps={STEPS}"]
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerojax.cli.main",
            "train",
            "configs/tiny.yaml",
            "--devices",
            "8",
            "--out",
            str(tmp_path / "one"),
            *base,
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerojax.cli.main",
            *LAUNCH_2X4,
            "train",
            "configs/tiny.yaml",
            "--out",
            str(tmp_path / "two"),
            *base,
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert len(a) == len(b) == STEPS
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=0, atol=1e-6)
