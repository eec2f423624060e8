"""`Trainer.verify` and `zerojax verify`: the user's model against stage 0 passes where zerojax is
right, and fails, naming the parameter, when a gather hands the model its own shard instead."""

from __future__ import annotations

import io

import jax.numpy as jnp
import optax
import pytest
from rich.console import Console

import zerojax as zj
from tests.cli_helpers import cli_in_process
from tests.test_gather_on_read import MODELS, _batch
from tests.user_code import RegularisedMLP, blobs
from zerojax.engines.collectives import Reduce
from zerojax.train import progress as report

BATCHES = [_batch(step) for step in range(3)]


@pytest.fixture
def shard_for(monkeypatch):
    """`shard_for(path)`: from now on, stage 3's gathers hand the model the device's own shard of
    `path`, repeated to the whole leaf's shape (the values a missing all-gather leaves behind)."""

    def inject(path: str):
        gather_group = Reduce.gather_group

        def faulty(self, leaves, values, *args, **kwargs):
            out = gather_group(self, leaves, values, *args, **kwargs)
            return [
                jnp.resize(jnp.asarray(x, w.dtype), w.shape) if leaf.path == path else w
                for leaf, x, w in zip(leaves, values, out)
            ]

        monkeypatch.setattr(Reduce, "gather_group", faulty)

    return inject


def _trainer(kind="nnx", engine="shard_map", stage=3):
    return zj.Trainer(
        MODELS[kind], optax.adamw(1e-2), mesh=zj.make_mesh(fsdp=8), stage=stage, engine=engine, replicate_below_bytes=0
    )


def test_verify_passes_on_a_tied_decoder():
    result = _trainer().verify(BATCHES)
    assert result.passed, result.lines()
    assert result.reference_engine == "gspmd"  # it draws nothing: shard_map is checked against gspmd
    assert result.loss_diff <= 1e-5 and result.update_diff <= 1e-4
    assert len(result.losses) == len(result.reference_losses) == 3


@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_a_model_drawing_dropout_masks_passes_against_the_masks_its_engine_draws(engine):
    """`shard_map` draws dropout masks per device, `gspmd` over the global batch: against `gspmd`'s
    stage 0 every such model failed under `shard_map` (the loss off by a tenth). Its reference now
    runs under `shard_map`."""
    trainer = zj.Trainer(RegularisedMLP, optax.adamw(1e-2), mesh=zj.make_mesh(fsdp=8), stage=3, engine=engine)
    batch = blobs(seed=0, batch_size=16).batch(0)
    result = trainer.verify(batch, steps=2)
    assert result.passed and result.reference_engine == engine, result.lines()


def test_verify_fails_and_names_the_parameter_a_gather_left_as_a_shard(shard_for):
    shard_for("blocks/0/fc/kernel")
    result = _trainer().verify(BATCHES)
    assert not result.passed
    assert result.update_diffs["blocks/0/fc/kernel"] > 0.1, result.lines()  # the worst may be one it fed
    assert result.update_diff == max(result.update_diffs.values())
    assert result.lines()[0].startswith("FAIL")


# The shipped GPT's tiny shape, one layer: a few thousand parameters.
_SMALL = [
    "--set",
    "model.n_layers=1",
    "--set",
    "model.d_model=32",
    "--set",
    "model.d_ff=64",
    "--set",
    "model.seq_len=16",
    "--set",
    "train.batch_size=8",
    "--set",
    "data.max_bytes=100000",
    "--set",
    "zero.engine=shard_map",
]


def test_cli_verify_exits_0_when_the_stage_matches_stage_0():
    done = cli_in_process("verify", "configs/tiny.yaml", "--devices", "8", *_SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS: 3 steps against stage 0" in done.stdout and "gathers        per layer" in done.stdout


def test_cli_verify_exits_1_naming_the_parameter_a_shard_reached(shard_for):
    shard_for("blocks/w_up")
    done = cli_in_process("verify", "configs/tiny.yaml", "--devices", "8", "--steps", "2", *_SMALL)
    assert done.returncode == 1, done.stdout + done.stderr
    # the worst update is a layer weight's (w_up's wrong activations move w_down most here)
    update = next(line for line in done.stdout.splitlines() if line.strip().startswith("update"))
    assert "FAIL: 2 steps" in done.stdout and "parameter blocks/w_" in update and update.endswith("<- over"), update


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_verify_passes_at_every_stage(kind, engine, stage):
    result = _trainer(kind, engine, stage).verify(BATCHES)
    assert result.passed, result.lines()


def test_compiling_shows_a_status_line_on_a_terminal_only(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(report, "console", Console(file=out, force_terminal=True, width=80))
    with report.compiling("the step"):
        pass
    assert "compiling the step ..." in out.getvalue()
    out = io.StringIO()
    monkeypatch.setattr(report, "console", Console(file=out, force_terminal=False))
    with report.compiling("the step"):
        pass
    assert out.getvalue() == ""
