"""`zerojax.train.choices`: the options of `Trainer` and `zj.shard`, declared once."""

import dataclasses
import inspect

import optax
import pytest

import zerojax as zj
from tests.models import UnevenMLP
from zerojax.train.choices import Choices


def test_trainer_and_shard_take_exactly_the_declared_choices():
    declared = [f.name for f in dataclasses.fields(Choices)]
    assert [p for p in inspect.signature(zj.Trainer).parameters][2:] == declared
    assert [p for p in inspect.signature(zj.shard).parameters][4:] == declared


def test_an_unknown_option_is_one_sentence_naming_the_valid_ones():
    with pytest.raises(zj.UserError, match="unknown option 'stages'; the options are mesh, stage, engine"):
        zj.Trainer(UnevenMLP, optax.sgd(0.1), stages=3)


def test_the_reference_is_the_same_run_at_stage_0_under_gspmd():
    trainer = zj.Trainer(UnevenMLP, optax.sgd(0.1), stage=3, engine="shard_map", precision="bf16", grad_accum=2)
    reference = trainer.setup.reference()
    assert (reference.stage.index, reference.engine.name, reference.grad_accum) == (0, "gspmd", 2)
    assert reference.precision == trainer.setup.precision and reference.mesh is trainer.setup.mesh
