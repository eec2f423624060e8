"""TensorBoard event files beside metrics.jsonl, read back with TensorBoard's own reader."""

from __future__ import annotations

import glob
import json
import os

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.cli_helpers import assert_one_line_error, cli_in_process
from tests.user_code import MLP, blobs
from zerojax.train import tensorboard

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

STEPS = 4


def _fit(out: str) -> None:
    mesh = zj.make_mesh(devices=jax.devices()[:1])
    trainer = zj.Trainer(lambda rngs: MLP(rngs=rngs), optax.adam(1e-2), mesh=mesh, stage=0)
    data = blobs(seed=0, batch_size=8)
    schedule = optax.linear_schedule(1e-2, 1e-3, STEPS)  # what the optimizer would use, recorded per step
    zj.fit(
        trainer, data, out, steps=STEPS, eval_source=blobs(seed=1, batch_size=8), eval_every=2, learning_rate=schedule
    )


def _records(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_every_scalar_of_every_step_equals_metrics_jsonl(tmp_path):
    _fit(str(tmp_path))
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    records = _records(str(tmp_path))
    tags = {key for r in records for key in r if key != "step"}
    assert {"loss", "grad_norm", "step_time_s", "tokens_per_s", "eval_loss", "bad_step", "learning_rate"} <= tags
    assert [r["learning_rate"] for r in records] == pytest.approx([1e-2 - 9e-3 * s / STEPS for s in range(STEPS)])
    assert set(events.Tags()["scalars"]) == tags
    for tag in tags:
        want = {r["step"]: r[tag] for r in records if tag in r}
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert sorted(got) == sorted(want), tag
        # Event files store float32.
        np.testing.assert_array_equal([got[s] for s in sorted(want)], np.float32([want[s] for s in sorted(want)]))


def test_tensorboard_false_opens_no_writer_and_none_opens_one(tmp_path):
    assert tensorboard.open_writer(str(tmp_path), False) is None
    writer = tensorboard.open_writer(str(tmp_path), None)
    writer.close()
    assert len(glob.glob(str(tmp_path / "events.out.tfevents.*"))) == 1


def test_a_null_metric_is_nan_and_the_step_is_no_scalar():
    got = tensorboard.scalars({"step": 3, "loss": None, "bad_step": 1, "note": "text"})
    assert list(got) == ["loss", "bad_step"] and np.isnan(got["loss"]) and got["bad_step"] == 1.0


def test_tensorboard_true_without_the_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorboard, "available", lambda: False)
    result = cli_in_process("train", "configs/tiny.yaml", "--set", "train.tensorboard=true", "--out", str(tmp_path))
    assert_one_line_error(result, "train.tensorboard=true needs the tensorboard package")
    assert not os.listdir(tmp_path)
