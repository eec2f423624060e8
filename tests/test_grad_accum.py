"""Gradient accumulation (`grad_accum=k`): k micro-batches in one compiled step equal one step on the
whole batch (every stage, both engines, plain and weighted losses); stages 0-2 reduce the gradient
once per step; stage 3 gathers per micro-batch, or once with `reshard_after_forward=False`.

Traffic is counted on the partitioned HLO (collectives inside the micro-batch loop count once per
iteration). 8 simulated devices, fp32.
"""

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests.cli_helpers import assert_one_line_error, cli_in_process
from tests.models import UnevenMLP, classification_batch, tiny_gpt, token_batch
from zerojax.accounting.hlo import collective_bytes
from zerojax.accounting.measure import ideal
from zerojax.accounting.partitioned import compile_partitioned
from zerojax.errors import UserError

DEVICES = 8
ROWS = 32  # 4 rows per device: k = 4 micro-batches of one row per device
K = 4
STEPS = 3


def masked_loss(logits, batch):
    """Weighted: sum of the rows' cross entropy x mask over the sum of the mask."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return zj.WeightedLoss(jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"]))


def _masked_batch(seed: int) -> dict:
    batch = classification_batch(seed, rows=ROWS)
    rng = np.random.default_rng(100 + seed)
    mask = rng.integers(0, 3, size=ROWS).astype(np.float32)  # weights 0, 1, 2: micro-batches weigh unequally
    mask[:: ROWS // DEVICES] = 0.0  # the first row of every device: micro-batch 0 weighs nothing at all
    return {**batch, "mask": mask}


LOSSES = {"mean": (None, lambda step: classification_batch(step, rows=ROWS)), "masked": (masked_loss, _masked_batch)}


def _trainer(model, stage, engine="gspmd", k=K, loss_fn=None, lr=0.2, **options):
    """`model` trained by SGD on 8 devices of fsdp; `options`: engine options."""
    mesh = zj.make_mesh(fsdp=DEVICES)
    return zj.Trainer(
        model,
        optax.sgd(lr),
        mesh=mesh,
        stage=stage,
        engine=engine,
        loss_fn=loss_fn,
        grad_accum=k,
        engine_options=options,
    )


def _train(stage, engine, k, loss="mean", raf=True, model=UnevenMLP, batches=None, steps=STEPS, whole=False):
    loss_fn, make = LOSSES[loss]
    batches = batches or make
    trainer = _trainer(
        model, stage, engine, k, loss_fn, reshard_after_forward=raf, **({"whole_micro_batches": True} if whole else {})
    )
    state = trainer.init(jax.random.key(0), batches(0))
    losses = []
    for step in range(steps):
        state, metrics = trainer.step(state, batches(step))
        assert int(metrics["bad_step"]) == 0
        losses.append(float(metrics["loss"]))
    params = jax.tree.map(np.asarray, trainer.layout.to_layout(state.params, False))
    return np.array(losses), params


@functools.cache
def _reference(loss):
    return _train(0, "gspmd", 1, loss)


def _assert_equal(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), got[1], want[1])


# fast: each engine's accumulating paths once (shard_map's stage 2 runs its stage 0-1 path, and its
# traffic is checked below; gspmd: the per-group path at stage 1, per-micro-batch gathers at stage 3)
FAST = {(0, "shard_map", "masked"), (1, "gspmd", "masked"), (3, "gspmd", "masked")}
CASES = [
    pytest.param(stage, engine, loss, marks=() if (stage, engine, loss) in FAST else pytest.mark.slow)
    for stage in range(4)
    for engine in ("gspmd", "shard_map")
    for loss in ("mean", "masked")
]


@pytest.mark.parametrize("stage,engine,loss", CASES)
def test_k_micro_batches_equal_one_step_on_the_whole_batch(stage, engine, loss):
    _assert_equal(_train(stage, engine, K, loss), _reference(loss))


@pytest.mark.parametrize("stage", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_whole_micro_batches_equal_one_step_on_the_whole_batch(stage):
    """gspmd, `whole_micro_batches`: each micro-batch's gradient reduced as it is made, to the
    stage's form (sharded at stage 2), and summed."""
    _assert_equal(_train(stage, "gspmd", K, "masked", whole=True), _reference("masked"))


@pytest.mark.parametrize("engine", [pytest.param("shard_map"), pytest.param("gspmd", marks=pytest.mark.slow)])
def test_stage_3_keeping_gathered_weights_equals_one_step(engine):
    _assert_equal(_train(3, engine, K, "masked", raf=False), _reference("masked"))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
@pytest.mark.parametrize("stage", [0, 3])
def test_gpt_accumulated_equals_whole_batch(engine, stage):
    model, _ = tiny_gpt(n_layers=2)
    batches = lambda step: token_batch(step, rows=32)  # noqa: E731

    def train(stage, engine, k):
        return _train(stage, engine, k, model=model, batches=batches, steps=2)

    _assert_equal(train(stage, engine, K), train(0, "gspmd", 1))


# ---- model state and RNG ---------------------------------------------------------------------------


class _Norm(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(37, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
        self.out = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.norm(self.hidden(x))))


@pytest.mark.parametrize("engine", [pytest.param("gspmd", marks=pytest.mark.slow), "shard_map"])
def test_batch_norm_statistics_thread_through_the_micro_batches(engine):
    """After one step the running statistics are the k micro-batches' updates applied in order
    (the params are the same for every micro-batch of a step)."""
    batch = classification_batch(0, rows=ROWS)
    trainer = _trainer(_Norm, 0, engine, lr=0.1)
    state = trainer.init(jax.random.key(0), batch)
    state, _ = trainer.step(state, batch)

    model = _Norm(nnx.Rngs(jax.random.key(0)))
    model.train()
    rows = ROWS // DEVICES
    x = batch["inputs"].reshape(DEVICES, K, rows // K, -1)
    for i in range(K):  # micro-batch i: the i-th slice of every device's rows
        model(x[:, i].reshape(-1, x.shape[-1]))
    np.testing.assert_allclose(
        np.asarray(state.model_state["batch_stats"]["norm"]["mean"]),
        np.asarray(model.norm.mean[...]),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        np.asarray(state.model_state["batch_stats"]["norm"]["var"]),
        np.asarray(model.norm.var[...]),
        rtol=1e-5,
        atol=1e-6,
    )


class _Masks(nnx.Module):
    """Its output is its dropout mask (times a weight that starts at one)."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones((16,)))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.ones((x.shape[0], 16))) * self.w[...]


@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
def test_every_micro_batch_draws_its_own_masks(engine):
    seen = []

    def record_loss(out, batch):
        jax.debug.callback(lambda o: seen.append(np.asarray(o).reshape(-1, 16)), out)
        return jnp.mean(out**2)

    batch = classification_batch(0, rows=ROWS)
    trainer = _trainer(_Masks, 0, engine, loss_fn=record_loss, lr=0.1)
    state = trainer.init(jax.random.key(0), batch)
    jax.block_until_ready(trainer.step(state, batch))
    jax.effects_barrier()
    masks = np.concatenate(seen) != 0
    assert masks.shape[0] >= ROWS
    assert len({m.tobytes() for m in masks}) == masks.shape[0]  # no row's mask repeats another's


def test_stage_3_and_whole_micro_batches_draw_the_same_masks_and_verify_passes():
    """gspmd: stage 3 re-gathering runs each micro-batch whole, drawing its masks over the
    micro-batch's rows; stage 0 by default draws them per data-parallel group. With
    `whole_micro_batches` stage 0 draws as stage 3 does, and `verify` compares against that: before,
    it compared stage 3 with the per-group draws and failed a correct model (loss 2% apart)."""
    batch = classification_batch(0, rows=ROWS)
    loss = lambda out, b: jnp.mean(out**2)  # noqa: E731 - depends on every mask

    def trainer(stage, **options):
        return _trainer(_Masks, stage, loss_fn=loss, lr=0.1, **options)

    def losses(t):
        state, out = t.init(jax.random.key(0), batch), []
        for _ in range(2):
            state, metrics = t.step(state, batch)
            out.append(float(metrics["loss"]))
        return out

    stage_3 = trainer(3)
    want = losses(stage_3)
    np.testing.assert_allclose(losses(trainer(0, whole_micro_batches=True)), want, rtol=1e-6)
    assert np.abs(np.array(losses(trainer(0))) / want - 1).max() > 1e-3  # the per-group draws: other masks
    assert stage_3.verify(batch, steps=2).passed


def test_options_that_cannot_hold_together_are_one_sentence():
    """Whole micro-batches reduce per micro-batch, kept weights once a step; and stage 3 keeping its
    weights without accumulation runs per group, drawing masks no stage-0 step draws, which verify
    would compare against other masks."""
    batch = classification_batch(0, rows=ROWS)

    def trainer(**options):
        return _trainer(_Masks, 3, k=1, lr=0.1, **options)

    with pytest.raises(UserError, match="reshard_after_forward=false keeps the gathered weights.*choose one"):
        trainer(reshard_after_forward=False, whole_micro_batches=True).init(jax.random.key(0), batch)
    with pytest.raises(UserError, match="verify cannot compare this step.*draws its random numbers per group"):
        trainer(reshard_after_forward=False).verify(batch, steps=1)


# ---- traffic: reduce once at stages 0-2; stage 3 gathers k times, or once when it keeps the weights -----


class _Wide(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(64, 256, rngs=rngs)
        self.b = nnx.Linear(256, 256, rngs=rngs)
        self.c = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.c(jax.nn.gelu(self.b(jax.nn.gelu(self.a(x)))))


@functools.cache
def _traffic(stage, engine, k, raf=True, whole=False):
    rng = np.random.default_rng(0)
    batch = {
        "inputs": rng.normal(size=(64, 64)).astype(np.float32),
        "targets": rng.integers(0, 10, size=(64,)).astype(np.int32),
    }
    trainer = _trainer(_Wide, stage, engine, k, lr=0.1, reshard_after_forward=raf, whole_micro_batches=whole)
    state = trainer.init(jax.random.key(0), batch)
    compiled, hlo = compile_partitioned(
        trainer.lower(state, trainer.shard_batch(batch)), tempfile.mkdtemp(prefix="zerojax-hlo-")
    )
    moved = collective_bytes(hlo)["bytes"]
    return {
        "reduce": moved["all-reduce"] + moved["reduce-scatter"],
        "gather": moved["all-gather"],
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "ideal": ideal(trainer),
    }


REDUCE_FAST = {(2, "shard_map")}


@pytest.mark.parametrize(
    "stage,engine",
    [
        pytest.param(s, e, marks=() if (s, e) in REDUCE_FAST else pytest.mark.slow)
        for s in (0, 1, 2)
        for e in ("gspmd", "shard_map")
    ],
)
def test_stages_0_to_2_reduce_once_per_step(stage, engine):
    once, accumulated = _traffic(stage, engine, 1), _traffic(stage, engine, K)
    assert abs(accumulated["reduce"] - once["reduce"]) <= 0.02 * once["reduce"], (once, accumulated)
    assert abs(accumulated["gather"] - once["gather"]) <= 0.02 * max(once["gather"], 1), (once, accumulated)


def test_whole_micro_batches_reduce_each_micro_batch_and_gather_once():
    """gspmd, `whole_micro_batches` at stage 1: k reductions a step and still one gather of the
    updated weights, as the analytic model counts them (`zerojax compare`). The loop once took the
    update's sharded layout for its accumulator and gathered it in every micro-batch: k + 1 gathers."""
    once, whole = _traffic(1, "gspmd", 1), _traffic(1, "gspmd", K, whole=True)
    assert abs(whole["gather"] - once["gather"]) <= 0.02 * once["gather"], (once, whole)
    assert abs(whole["reduce"] - K * once["reduce"]) <= 0.02 * K * once["reduce"], (once, whole)
    assert whole["ideal"].param_allgather_bytes == once["ideal"].param_allgather_bytes > 0
    assert whole["ideal"].grad_reduce_bytes == K * once["ideal"].grad_reduce_bytes > 0


@pytest.mark.parametrize("engine", [pytest.param("shard_map"), pytest.param("gspmd", marks=pytest.mark.slow)])
def test_stage_3_gathers_per_micro_batch_or_once_when_kept(engine):
    once, accumulated = _traffic(3, engine, 1), _traffic(3, engine, K)
    kept = _traffic(3, engine, K, False)
    assert abs(accumulated["gather"] - K * once["gather"]) <= 0.02 * K * once["gather"], (once, accumulated)
    assert abs(accumulated["reduce"] - K * once["reduce"]) <= 0.02 * K * once["reduce"], (once, accumulated)
    # kept: one gather of every sharded weight (once's forward gather) and one gradient reduction
    assert kept["gather"] <= 0.6 * once["gather"], (once, kept)
    assert abs(kept["reduce"] - once["reduce"]) <= 0.02 * once["reduce"], (once, kept)
    assert kept["temp"] > accumulated["temp"]  # the price: whole weights and gradient held through the step


# ---- errors ----------------------------------------------------------------------------------------


def test_bad_grad_accum_is_one_clear_error():
    for k in (0, -1, 2.5, True):
        with pytest.raises(UserError, match="train.grad_accum must be a positive integer"):
            zj.Trainer(UnevenMLP, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=DEVICES), grad_accum=k)
    trainer = zj.Trainer(UnevenMLP, optax.sgd(0.1), mesh=zj.make_mesh(fsdp=DEVICES), grad_accum=3)
    with pytest.raises(UserError, match="does not split into train.grad_accum=3 micro-batches"):
        trainer.init(jax.random.key(0), classification_batch(0, rows=ROWS))  # 4 rows per device


def test_config_rejects_an_indivisible_batch():
    from zerojax.cli.config import load_config

    assert load_config(None, ["train.grad_accum=4", "mesh.fsdp=8", "train.batch_size=32"]).train.grad_accum == 4
    with pytest.raises(UserError, match="multiple of 24"):
        load_config(None, ["train.grad_accum=3", "mesh.fsdp=8", "train.batch_size=32"])
    with pytest.raises(UserError, match="train.grad_accum must be"):
        load_config(None, ["train.grad_accum=0"])
    assert load_config(None, ["zero.reshard_after_forward=false"]).zero.reshard_after_forward is False


def test_cli_indivisible_batch_is_one_line_exit_2(tmp_path):
    result = cli_in_process(
        "train", "configs/tiny.yaml", "--devices", "8", "--out", str(tmp_path), "--set", "train.grad_accum=3"
    )
    assert_one_line_error(result, "train.grad_accum=3", "train.batch_size=16")


def test_planner_counts_stage_3_traffic_per_micro_batch():
    from zerojax.accounting import analytic as A

    for stage in (0, 1, 2):
        assert A.traffic_bytes(1e9, 8, stage, 2, grad_accum=4) == A.traffic_bytes(1e9, 8, stage, 2)
    once, four = A.traffic_bytes(1e9, 8, 3, 2), A.traffic_bytes(1e9, 8, 3, 2, grad_accum=4)
    assert four["param_allgather"] == 4 * once["param_allgather"] and four["grad_reduce"] == 4 * once["grad_reduce"]
    kept = A.traffic_bytes(1e9, 8, 3, 2, grad_accum=4, reshard_after_forward=False)
    assert kept["param_allgather"] == once["param_allgather"] / 2 and kept["grad_reduce"] == once["grad_reduce"]


def test_resume_checks_grad_accum_and_accepts_checkpoints_from_before_it():
    from zerojax.cli.config import Config
    from zerojax.train.resume import check_resume_config

    before = Config().to_dict()
    del before["train"]["grad_accum"], before["zero"]["reshard_after_forward"]  # a checkpoint's config from before
    check_resume_config(before, Config().to_dict(), "ckpt", defaults=Config().to_dict())  # nothing changed
    changed = Config().to_dict()
    changed["train"]["grad_accum"] = 2  # other micro-batches, other dropout keys: another trajectory
    with pytest.raises(UserError, match="train.grad_accum is 2 here but 1 in the checkpoint"):
        check_resume_config(before, changed, "ckpt", defaults=Config().to_dict())
