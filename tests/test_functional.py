"""The functional core (`zj.shard`): a user's own `jax.jit` step over zerojax's shardings trains like
`Trainer`, compiles to the same program, and its misuse is one `UserError`."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from experiments import own_loop
from zerojax.accounting.analytic import peak_bytes
from zerojax.accounting.hlo import collective_bytes

STEPS = 3
_CASES = [  # stage 3 in both engines by default; the other stages under -m slow
    pytest.param(3, "gspmd"),
    pytest.param(3, "shard_map"),
    *(pytest.param(s, e, marks=pytest.mark.slow) for s in (0, 1, 2) for e in ("gspmd", "shard_map")),
]


def _peak(compiled) -> int:
    ma = compiled.memory_analysis()
    return peak_bytes(ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes, ma.temp_size_in_bytes)


@pytest.mark.parametrize("stage, engine", _CASES)
def test_own_jit_step_trains_and_compiles_like_trainer(stage, engine):
    """Uneven shapes (13 -> 61 -> 11: nothing the 8 devices divide; the kernels padded and sharded):
    the same losses within 1e-6, the same compiled peak within 1% and the same collective bytes as
    `Trainer`'s step."""
    data, mesh = own_loop.batches(STEPS), zj.make_mesh(fsdp=8)
    core = zj.shard(own_loop.Uneven, optax.adamw(1e-2), data[0], mesh=mesh, stage=stage, engine=engine)
    state = core.init(jax.random.key(0))
    step = jax.jit(core.step, donate_argnums=0, compiler_options=core.compiler_options)  # as the README says
    first = core.shard_batch(data[0])
    own = step.lower(state, first).compile()
    losses = []
    for batch in data:
        state, metrics = own(state, core.shard_batch(batch))
        losses.append(float(metrics["loss"]))

    trainer = zj.Trainer(own_loop.Uneven, optax.adamw(1e-2), mesh=mesh, stage=stage, engine=engine)
    reference_state = trainer.init(jax.random.key(0), data[0])
    theirs = trainer.compile(reference_state, data[0])
    reference = []
    for batch in data:
        reference_state, metrics = trainer.step(reference_state, batch)
        reference.append(float(metrics["loss"]))

    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-6)
    assert abs(_peak(own) - _peak(theirs)) <= 0.01 * _peak(theirs), (_peak(own), _peak(theirs))
    moved = collective_bytes(own.as_text())
    assert moved["total"] > 0 and moved == collective_bytes(theirs.as_text())


def test_grads_then_update_is_the_step():
    """`update(state, *grads(state, batch))` is `step(state, batch)`: a loop may look at the
    gradients (reduced and sharded as the stage stores them) between the two."""
    data = own_loop.batches(1)
    core = zj.shard(own_loop.Uneven, optax.adamw(1e-2), data[0], mesh=zj.make_mesh(fsdp=8), stage=3)
    batch = core.shard_batch(data[0])
    whole, metrics = jax.jit(core.step)(core.init(jax.random.key(0)), batch)
    loss, grads, model_state = jax.jit(core.grads)(core.init(jax.random.key(0)), batch)
    parts, parts_metrics = jax.jit(core.update)(core.init(jax.random.key(0)), loss, grads, model_state)
    assert float(parts_metrics["loss"]) == float(metrics["loss"])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(parts.params), jax.tree.leaves(whole.params)))
    kernel = grads["hidden"]["kernel"]
    assert kernel.shape == (13, 64)  # 61 padded to a multiple of 8, a shard per device
    assert kernel.sharding.spec == core.state_shardings.params["hidden"]["kernel"].spec


def test_the_nnx_jit_example_matches_trainer():
    diffs = own_loop.main(steps=2)
    assert diffs["jax.jit"] <= 1e-6 and diffs["nnx.jit"] <= 1e-6, diffs


def test_misuse_is_one_user_error():
    data = own_loop.batches(1)
    with pytest.raises(zj.UserError, match="divisible|divide"):
        zj.shard(own_loop.Uneven, optax.adamw(1e-2), {key: rows[:5] for key, rows in data[0].items()})
    core = zj.shard(own_loop.Uneven, optax.adamw(1e-2), data[0], mesh=zj.make_mesh(fsdp=8), stage=3)
    with pytest.raises(zj.UserError, match="do not match"):
        core.init(jax.random.key(0), params={"hidden": {"kernel": np.zeros((13, 61))}})
    with pytest.raises(zj.UserError, match="outside"):  # labels the 11 classes cannot hold
        core.shard_batch({**data[0], "targets": np.full(16, 11, np.int32)})
    # a stage-0 state holds the logical (unpadded) params where stage 3 stores padded shards
    other = zj.shard(own_loop.Uneven, optax.adamw(1e-2), data[0], mesh=zj.make_mesh(fsdp=8), stage=0)
    with pytest.raises(zj.UserError, match=r"state leaf .* another model, stage or device count"):
        jax.jit(core.step)(other.init(jax.random.key(0)), core.shard_batch(data[0]))


def test_checkpoints_and_load_params_take_the_functional_state(tmp_path):
    """A `zj.shard` state saves like `Trainer`'s and restores into another stage's `Sharded`, each
    device reading its own slice; exported, its logical weights are what `init` starts from."""
    from zerojax.interop.params import export_params
    from zerojax.train.checkpoint import CheckpointWriter, restore, run_metadata

    data, mesh = own_loop.batches(2), zj.make_mesh(fsdp=8)
    core = zj.shard(own_loop.Uneven, optax.adamw(1e-2), data[0], mesh=mesh, stage=3)
    state, _ = jax.jit(core.step)(core.init(jax.random.key(0)), core.shard_batch(data[0]))
    writer = CheckpointWriter(str(tmp_path / "ckpt"), keep=1, run_meta=run_metadata(core, seed=0))
    writer.save(1, state)
    writer.close()
    other = zj.shard(own_loop.Uneven, optax.adamw(1e-2), data[0], mesh=mesh, stage=1)
    restored, meta = restore(other, str(tmp_path / "ckpt" / "1"))
    assert meta["stage"] == 3 and meta["engine"] == "gspmd"
    export_params(str(tmp_path / "ckpt" / "1"), str(tmp_path / "params.npz"))
    whole = zj.load_params(str(tmp_path / "params.npz"))
    np.testing.assert_array_equal(whole["hidden"]["kernel"], np.asarray(state.params["hidden"]["kernel"])[:, :61])
    np.testing.assert_array_equal(np.asarray(restored.params["hidden"]["kernel"]), whole["hidden"]["kernel"])
    assert np.array_equal(
        other.init(jax.random.key(1), params=whole).params["out"]["kernel"][:61], whole["out"]["kernel"]
    )


def test_fit_continues_a_functional_state(tmp_path):
    """`zj.fit(trainer, ..., state=...)` takes up a state a `zj.shard` loop made, at its step, and
    trains on as an uninterrupted `fit` of the same trainer does."""
    data, mesh = own_loop.batches(4), zj.make_mesh(fsdp=8)
    source = zj.ArraySource({k: np.concatenate([b[k] for b in data]) for k in data[0]}, batch_size=16)
    core = zj.shard(own_loop.Uneven, optax.adamw(1e-2), data[0], mesh=mesh, stage=3)
    state = core.init(jax.random.key(0))
    state, _ = jax.jit(core.step, donate_argnums=0)(state, core.shard_batch(source.batch(0)))

    def trainer():
        return zj.Trainer(own_loop.Uneven, optax.adamw(1e-2), mesh=mesh, stage=3)

    opts = {"steps": 3, "eval_every": 0, "checkpoint_every": 0}
    taken_up = zj.fit(trainer(), source, str(tmp_path / "a"), state=state, **opts)
    whole = zj.fit(trainer(), source, str(tmp_path / "b"), **opts)
    assert taken_up["final_loss"] == whole["final_loss"]
    with open(tmp_path / "a" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [2, 3]  # from the state's step on
    with pytest.raises(zj.UserError, match="not both"):
        zj.fit(trainer(), source, str(tmp_path / "c"), state=state, resume=True, **opts)
    stage_0 = zj.shard(own_loop.Uneven, optax.adamw(1e-2), data[0], mesh=mesh, stage=0).init(jax.random.key(0))
    with pytest.raises(zj.UserError, match=r"is \[13, 61\], but this step stores it as \[13, 64\]"):
        zj.fit(trainer(), source, str(tmp_path / "d"), state=stage_0, **opts)
