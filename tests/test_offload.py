"""Host offload (`zero.offload`): the fp32 master and optimizer state in host memory between steps.

Device-space bytes drop by exactly what host space gains (12 bytes per parameter over p at stage 3
with AdamW), in the live arrays and in the compiled step's argument layout; losses equal the
device-resident run; checkpoints resume bit-exactly and restore across offload settings, stages
and device counts; export reads an offloaded run's checkpoint unchanged."""

import functools
import os
from dataclasses import dataclass

import jax
import numpy as np
import optax
import pytest

from tests.models import UnevenMLP, classification_batch, train_on_stream
from zerojax import Trainer, load_params, make_mesh
from zerojax.accounting.placed_bytes import compiled_argument_bytes
from zerojax.cli.config import load_config
from zerojax.core import offload as offload_lib
from zerojax.core.trees import count_params
from zerojax.data.corpus import BatchStream, load_corpus
from zerojax.errors import UserError
from zerojax.interop.params import export_params
from zerojax.models.gpt import GPT, gpt_config
from zerojax.train.checkpoint import CheckpointWriter, restore, run_metadata

KEY = jax.random.key(0)
# Every dimension divides 8, so no leaf is padded; leaves under 2 KiB would stay replicated by
# default, so these trainers shard every leaf (`replicate_below_bytes=0`): exactly 12 psi / p at stage 3.
CFG = gpt_config("tiny", d_model=32, n_heads=4, d_ff=64, n_layers=2, seq_len=16, remat="none")


def _tx():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))


def _gpt(stage, offload="none", devices=8, **kw) -> Trainer:
    kw.setdefault("replicate_below_bytes", 0)
    mesh = make_mesh(devices=jax.devices()[:devices])
    return Trainer(functools.partial(GPT, CFG), _tx(), mesh=mesh, stage=stage, offload=offload, **kw)


@pytest.fixture(scope="module")
def stream():
    return BatchStream(load_corpus(None, 200_000), seq_len=CFG.seq_len, global_batch=8, seed=0)


def _kinds(tree) -> set:
    """Memory kinds of a tree of arrays (or of shardings)."""
    return {getattr(x, "sharding", x).memory_kind for x in jax.tree.leaves(tree)}


# ---- bytes ---------------------------------------------------------------------------------------


def _bytes(trainer, state, compiled) -> dict:
    return {
        "device": trainer.persistent_bytes_per_device(state),
        "host": trainer.host_persistent_bytes_per_device(state),
        "args": compiled_argument_bytes(compiled),
        "state": state,
    }


def _check_bytes(none, off, psi, p=8):
    assert none["host"] == 0 and none["args"]["host"] == 0
    assert none["device"] - off["device"] == off["host"]  # moved, not copied
    assert none["device"] - off["device"] == pytest.approx(12 * psi / p, rel=0.01)  # fp32 master 4 + moments 8
    # The compiled program agrees: its host-space arguments (memory space S(5)) are those bytes.
    assert off["args"]["host"] == off["host"] and none["args"]["device"] - off["args"]["device"] == off["host"]
    s0, s1 = none["state"], off["state"]
    assert _kinds(s1.params) == _kinds(s1.opt_state) == {"pinned_host"}
    assert _kinds(s0.params) == {"device"} and _kinds(s1.step) == {"device"}


def test_stage3_device_bytes_drop_by_master_and_moments(saved):
    none, off = saved["none"], saved["optimizer"]
    _check_bytes(none.bytes, off.bytes, count_params(off.trainer.layout.leaves))


@pytest.mark.slow
def test_stage3_bf16_device_bytes_drop_by_master_and_moments(stream):
    batch = stream.host_batch(0)
    measured = {}
    for mode in ("none", "optimizer"):
        trainer = _gpt(3, mode, precision="bf16")
        state = trainer.init(KEY, batch)
        measured[mode] = _bytes(trainer, state, trainer.compile(state, batch))
    _check_bytes(measured["none"], measured["optimizer"], count_params(trainer.layout.leaves))


@pytest.mark.slow
def test_bf16_stage1_optimizer_params_also_moves_the_compute_copy(stream):
    batch = stream.host_batch(0)
    sizes = {}
    for mode in ("none", "optimizer", "optimizer+params"):
        trainer = _gpt(1, mode, precision="bf16")
        state = trainer.init(KEY, batch)
        sizes[mode] = (trainer.persistent_bytes_per_device(state), trainer.host_persistent_bytes_per_device(state))
        assert trainer.layout.keeps_compute_copy
    psi = count_params(trainer.layout.leaves)
    compute = 2 * psi  # the replicated bf16 copy stages 0-2 keep for the forward
    assert _kinds(state.compute) == {"pinned_host"}
    assert sizes["optimizer"][0] - sizes["optimizer+params"][0] == compute
    assert sizes["optimizer+params"][1] - sizes["optimizer"][1] == compute
    assert sizes["none"][0] - sizes["optimizer"][0] == sizes["optimizer"][1]


# ---- losses --------------------------------------------------------------------------------------


def _mlp_losses(stage, engine, offload, steps=20, **kw):
    trainer = Trainer(UnevenMLP, optax.adamw(1e-2), stage=stage, engine=engine, offload=offload, **kw)
    state = trainer.init(KEY, classification_batch(0))
    losses = []
    for i in range(steps):
        state, metrics = trainer.step(state, classification_batch(i))
        losses.append(float(metrics["loss"]))
    return losses, trainer, state


# Two of the four run by default; the other two under -m slow.
@pytest.mark.parametrize(
    "stage,engine",
    [
        (1, "gspmd"),
        (3, "shard_map"),
        pytest.param(3, "gspmd", marks=pytest.mark.slow),
        pytest.param(1, "shard_map", marks=pytest.mark.slow),
    ],
)
def test_losses_equal_the_device_resident_run(stage, engine):
    want, ref, ref_state = _mlp_losses(stage, engine, "none")
    got, trainer, state = _mlp_losses(stage, engine, "optimizer")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert want[-1] < want[0]
    assert _kinds(state.opt_state) == {"pinned_host"}  # still there after 20 steps
    # eval streams the master in as the step does
    batch = classification_batch(0)
    assert float(trainer.evaluate(state, batch)) == pytest.approx(float(ref.evaluate(ref_state, batch)), abs=1e-6)


@pytest.mark.slow
def test_with_gradient_accumulation_losses_equal():
    want, _, _ = _mlp_losses(2, "shard_map", "none", steps=5, grad_accum=2)
    got, _, state = _mlp_losses(2, "shard_map", "optimizer", steps=5, grad_accum=2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert _kinds(state.opt_state) == {"pinned_host"}


@pytest.mark.slow
def test_bf16_optimizer_params_losses_equal():
    want, _, _ = _mlp_losses(2, "gspmd", "none", steps=5, precision="bf16")
    got, _, state = _mlp_losses(2, "gspmd", "optimizer+params", steps=5, precision="bf16")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert _kinds(state.compute) == {"pinned_host"}


# ---- checkpoints ---------------------------------------------------------------------------------


@dataclass
class Saved:
    trainer: Trainer
    step_dir: str
    losses: list  # the uninterrupted run's losses after the save
    params: dict  # host copies of the saved master params
    bytes: dict  # `_bytes` at init


@pytest.fixture(scope="module")
def saved(tmp_path_factory, stream) -> dict[str, Saved]:
    """Per offload mode, stage 3 on 8 devices: compile, 2 steps, save, 2 more (the uninterrupted losses)."""
    root = tmp_path_factory.mktemp("offload_ckpt")
    out = {}
    for mode in ("none", "optimizer"):
        trainer = _gpt(3, mode)
        state = trainer.init(KEY, stream.host_batch(0))
        measured = _bytes(trainer, state, trainer.compile(state, stream.host_batch(0)))  # `step` reuses it
        measured["state"] = jax.tree.map(lambda x: x.sharding, state)
        state, _ = train_on_stream(trainer, state, stream, range(2))
        writer = CheckpointWriter(str(root / mode), keep=1, run_meta=run_metadata(trainer, seed=0))
        writer.save(2, state)
        params = jax.tree.map(np.asarray, state.params)
        _, losses = train_on_stream(trainer, state, stream, range(2, 4))
        writer.close()
        out[mode] = Saved(trainer, str(root / mode / "2"), losses, params, measured)
    return out


def test_resume_with_offload_is_bit_exact(saved, stream):
    src = saved["optimizer"]
    trainer, step_dir, losses = src.trainer, src.step_dir, src.losses
    state, _ = restore(trainer, step_dir, KEY, stream.host_batch(2))
    assert _kinds(state.params) == _kinds(state.opt_state) == {"pinned_host"}
    for x, want in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings)):
        assert x.sharding == want
    _, got = train_on_stream(trainer, state, stream, range(2, 4))
    assert got == losses  # bit-exact


@pytest.mark.parametrize("source,target", [("optimizer", "none"), ("none", "optimizer")])
def test_restore_across_offload_settings(saved, stream, source, target):
    step_dir, losses, params = saved[source].step_dir, saved[source].losses, saved[source].params
    into = saved[target].trainer
    state, _ = restore(into, step_dir, KEY, stream.host_batch(2))
    assert _kinds(state.opt_state) == ({"pinned_host"} if target == "optimizer" else {"device"})
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), params)
    _, got = train_on_stream(into, state, stream, range(2, 4))
    np.testing.assert_allclose(got, losses, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "stage,offload,devices", [(1, "optimizer", 4), pytest.param(0, "none", 1, marks=pytest.mark.slow)]
)
def test_reshard_offloaded_checkpoint_to_another_stage_and_device_count(saved, stream, stage, offload, devices):
    step_dir, losses = saved["optimizer"].step_dir, saved["optimizer"].losses
    target = _gpt(stage, offload, devices=devices)
    state, _ = restore(target, step_dir, KEY, stream.host_batch(2))
    _, got = train_on_stream(target, state, stream, range(2, 4))
    rel = np.abs(np.array(got) / np.array(losses) - 1)
    assert rel.max() < 1e-4, (stage, devices, got, losses)


def test_export_of_an_offloaded_checkpoint(saved, tmp_path):
    step_dir, params = saved["optimizer"].step_dir, saved["optimizer"].params
    export_params(os.path.dirname(step_dir), str(tmp_path / "params.npz"))
    loaded = load_params(str(tmp_path / "params.npz"))
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, want[tuple(slice(0, s) for s in got.shape)])


# ---- configuration -------------------------------------------------------------------------------


def test_config_key_and_errors():
    assert load_config(None, ["zero.offload=optimizer+params"]).zero.offload == "optimizer+params"
    assert load_config(None).zero.offload == "none"
    with pytest.raises(UserError, match="zero.offload must be one of none, optimizer, optimizer\\+params"):
        load_config(None, ["zero.offload=params"])
    with pytest.raises(UserError, match="zero.offload"):
        Trainer(UnevenMLP, optax.adamw(1e-2), offload="gpu")


def test_backend_without_host_memory_is_a_user_error():
    class Memory:
        def __init__(self, kind):
            self.kind = kind

    class Device:
        platform = "fake"

        def addressable_memories(self):
            return [Memory("device")]

        def __str__(self):
            return "fake:0"

    offload_lib.check_backend("none", [Device()])
    with pytest.raises(UserError, match="needs the memory kind 'pinned_host'.*has device"):
        offload_lib.check_backend("optimizer", [Device()])
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert "pinned_host" in kinds  # the CPU backend of jax 0.10.2 and 0.12 has it


# ---- compare -------------------------------------------------------------------------------------


def test_compare_row_reports_device_and_host_space():
    """`zerojax compare --set zero.offload=optimizer`: one row, as the command builds it."""
    from zerojax.cli.commands.compare_run import run_row

    sets = [
        "zero.stage=3",
        "zero.offload=optimizer",
        "train.batch_size=8",
        "train.steps=1",
        "model.seq_len=16",
        "data.max_bytes=200000",
    ]
    row, params, devices = run_row(
        load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"), sets), steps=1
    )
    assert row["persistent_bytes_per_device"] == 12  # the step counter and the RNG key
    assert row["host_persistent_bytes_per_device"] == row["host_argument_bytes_per_device"]
    assert row["host_persistent_bytes_per_device"] == pytest.approx(12 * params / devices, rel=0.01)
    assert row["persistent_ratio"] == pytest.approx(1.0, rel=0.01)
