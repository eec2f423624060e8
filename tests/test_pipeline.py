"""Pipeline parallelism (`mesh.pipeline`, `zerojax.engines.pipeline`): GPipe over the shipped GPT's
blocks and a user's `zj.Stacked` blocks gives the unpipelined model's losses and gradients; bubbles
never reach a gradient; the state of the blocks is split over pipeline x fsdp; checkpoints are saved
in the unpipelined layout; what cannot be pipelined is one sentence."""

from __future__ import annotations

import dataclasses
import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests.host_copies import logical_params
from tests.models import classification_batch, stacked_blocks, unrolled_blocks
from zerojax.accounting.measure import ideal, measure_step
from zerojax.engines.pipeline import bubble_fraction, gpipe
from zerojax.errors import UserError
from zerojax.interop.params import export_params
from zerojax.models.gpt import GPT, gpt_config
from zerojax.train.checkpoint import CheckpointWriter, restore, run_metadata

CFG = gpt_config("tiny", d_model=32, n_heads=4, n_layers=4, d_ff=48, seq_len=16, remat="full")
LR = 0.5  # SGD: one step's parameter change is LR x the gradient, so it compares gradients
KEY = jax.random.key(0)


def _tokens(seed: int, rows: int = 16) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, 256, (rows, CFG.seq_len)).astype(np.int32) for k in ("inputs", "targets")}


def _trainer(
    make, mesh, stage: int, microbatches=None, engine="gspmd", tx=None, repeats=1, gather="per_step", k=1, **options
):
    """`options`: engine options beside `pipeline_gather`; `k`: gradient accumulation."""
    return zj.Trainer(
        make,
        tx or optax.sgd(LR),
        mesh=mesh,
        stage=stage,
        engine=engine,
        microbatches=microbatches,
        pipeline_repeats=repeats,
        grad_accum=k,
        engine_options={**options, **({"pipeline_gather": gather} if gather != "per_step" else {})},
    )


def _run(trainer, batches, steps: int = 3, lr: float = LR, state=None, step=None):
    """(losses, each step's parameter change / lr: the gradients) over `steps` steps of SGD at `lr`,
    from `state` (default: a fresh one) by `step(state, batch)` (default: `trainer.step`)."""
    state = trainer.init(KEY, batches(0)) if state is None else state
    step = trainer.step if step is None else step
    losses, grads, before = [], [], logical_params(trainer, state)
    for i in range(steps):
        state, metrics = step(state, batches(i))
        after = logical_params(trainer, state)
        losses.append(float(metrics["loss"]))
        grads.append(jax.tree.map(lambda a, b: (a - b) / lr, before, after))
        before = after
    return np.array(losses), grads


def _assert_same_training(got, want, rel: float = 1e-5, floor: float = 1e-7) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=rel)
    for g, w in zip(got[1], want[1]):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            assert np.abs(a - b).max() <= rel * np.abs(b).max() + floor, (np.abs(a - b).max(), np.abs(b).max())


def _resolution(lr: float) -> float:
    """A gradient read from one step's parameter change resolves no finer than the last bit of a
    parameter of scale 1 (a norm's weight) over the learning rate; a deeper stack has leaves whose
    gradients are that small."""
    return 2 * float(np.finfo(np.float32).eps) / lr


@pytest.fixture(scope="module")
def gpt_reference():
    return _run(_trainer(functools.partial(GPT, CFG), zj.make_mesh(fsdp=8), 0), _tokens)


@pytest.mark.parametrize(
    "stage,mesh,microbatches,repeats,gather,engine",
    [
        (3, {"pipeline": 2, "fsdp": 4}, 4, 1, "per_step", "gspmd"),
        pytest.param(3, {"pipeline": 2, "fsdp": 4}, 2, 2, "per_step", "gspmd", marks=pytest.mark.slow),  # circular
        # per-microbatch gathers on gspmd: by default in the user model's circular case
        pytest.param(3, {"pipeline": 2, "fsdp": 4}, 2, 1, "per_microbatch", "gspmd", marks=pytest.mark.slow),
        (3, {"pipeline": 2, "fsdp": 4}, 2, 2, "per_step", "shard_map"),
        pytest.param(
            3, {"pipeline": 2, "fsdp": 2, "tensor": 2}, 4, 2, "per_microbatch", "gspmd", marks=pytest.mark.slow
        ),
        pytest.param(3, {"pipeline": 2, "fsdp": 4}, 4, 2, "per_microbatch", "shard_map", marks=pytest.mark.slow),
        pytest.param(3, {"pipeline": 2, "fsdp": 4}, 4, 1, "per_microbatch", "shard_map", marks=pytest.mark.slow),
        # stages 1 and 2 (the matrix below runs 0 and 3 on every mesh)
        pytest.param(1, {"pipeline": 2, "fsdp": 4}, 2, 2, "per_step", "shard_map", marks=pytest.mark.slow),
        pytest.param(2, {"pipeline": 2, "fsdp": 4}, 4, 2, "per_step", "shard_map", marks=pytest.mark.slow),
        pytest.param(2, {"pipeline": 2, "fsdp": 4}, 2, 1, "per_step", "gspmd", marks=pytest.mark.slow),
    ],
)
def test_the_pipelined_gpt_trains_as_the_unpipelined_one(
    gpt_reference, stage, mesh, microbatches, repeats, gather, engine
):
    make = functools.partial(GPT, CFG)
    trainer = _trainer(make, zj.make_mesh(**mesh), stage, microbatches, engine, repeats=repeats, gather=gather)
    _assert_same_training(_run(trainer, _tokens), gpt_reference)
    schedule = "GPipe" if repeats == 1 else f"the circular schedule ({repeats} chunks a device)"
    assert f"split into {mesh['pipeline']} pipeline stages, {schedule}" in trainer.gather_report().description


class _MlpBlock(nnx.Module):
    """A residual MLP block whose widths name the `mlp` dimension, as Flax's docs annotate them."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(width, 2 * width, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(2 * width, width, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class _StackedMlp(nnx.Module):
    """A user's model: an input layer, 8 annotated blocks in a `zj.Stacked`, a 10-way head."""

    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(24, 24, rngs=rngs)
        self.blocks = zj.Stacked(_MlpBlock, 8, 24, rngs=rngs)
        self.out = nnx.Linear(24, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(self.blocks(self.inp(x)))


MESHES = ({"pipeline": 2, "fsdp": 4}, {"pipeline": 4, "data": 2, "fsdp": 1}, {"pipeline": 2, "fsdp": 2, "tensor": 2})
DEEP = dataclasses.replace(CFG, n_layers=8)  # 8 layers: pipeline=4 x 2 repeats divides them
# (model, batches, SGD's learning rate: 0.5 sends an 8-block user model's loss to 1e33 by step 3)
MODELS = {"gpt": (functools.partial(GPT, DEEP), _tokens, LR), "stacked": (_StackedMlp, None, 0.05)}


@pytest.fixture(scope="module")
def deep_references():
    return {
        name: _run(_trainer(make, zj.make_mesh(fsdp=8), 0, tx=optax.sgd(lr)), _batches(name), 5, lr)
        for name, (make, _, lr) in MODELS.items()
    }


def _batches(name):
    return MODELS[name][1] or functools.partial(classification_batch, rows=16, features=24)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("repeats", [1, 2])
@pytest.mark.parametrize("per_stage", [1, 2])
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_every_mesh_schedule_and_stage_trains_as_unpipelined(
    deep_references, model, engine, stage, repeats, per_stage, mesh
):
    """The acceptance matrix: 5 steps, fp32, m = p and 2p microbatches."""
    make, _, lr = MODELS[model]
    m = per_stage * mesh["pipeline"]
    trainer = _trainer(make, zj.make_mesh(**mesh), stage, m, engine, tx=optax.sgd(lr), repeats=repeats)
    _assert_same_training(_run(trainer, _batches(model), 5, lr), deep_references[model], floor=_resolution(lr))


def test_a_users_stacked_blocks_pipeline_too():
    batches = functools.partial(classification_batch, rows=16, features=24)
    model = stacked_blocks(24, 4)
    reference = _run(_trainer(model, zj.make_mesh(fsdp=8), 0), batches)
    deep = _trainer(model, zj.make_mesh(pipeline=4, data=2, fsdp=1), 3, microbatches=4)
    state = deep.init(KEY, batches(0))
    measured, step = measure_step(deep, state, batches(0))  # one compile: the bytes and the steps
    _assert_same_training(_run(deep, batches, state=state, step=lambda s, b: step(s, deep.shard_batch(b))), reference)
    # 2 m v b S D: each stage boundary carries every microbatch's activations (2 rows a device, 24
    # wide, fp32) on and their gradient back, nothing in the bubble; a middle stage sends both
    item = 16 // 2 // 4 * 24 * 4
    assert measured.stage_boundary_bytes == measured.collective_by_kind["collective-permute"] == 2 * 4 * item
    circular = _trainer(model, zj.make_mesh(pipeline=2, fsdp=4), 3, microbatches=2, repeats=2, gather="per_microbatch")
    _assert_same_training(_run(circular, batches), reference)
    # shard_map with hpZ: the state split over data too, each layer gathered over fsdp alone
    _assert_same_training(_run(_hpz_pipelined(model), batches), reference)


class _GatedBlock(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x, gate):
        return x + gate * jnp.tanh(self.dense(x))


class _Gated(nnx.Module):
    """A learned gate outside the stack, handed to every block as its extra argument."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Linear(24, 16, rngs=rngs)
        self.gate = nnx.Param(jnp.full((16,), 0.5))
        self.blocks = zj.Stacked(_GatedBlock, 2, 16, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(self.blocks(self.embed(x), self.gate[...]))


def test_a_parameter_outside_the_stack_handed_to_its_blocks_gets_every_stages_gradient():
    """Each pipeline stage's blocks add their part of the gate's gradient: summed over the stages
    (shard_map), or refused in one sentence where the region cannot read it (gspmd)."""
    batches = functools.partial(classification_batch, rows=16, features=24)
    reference = _run(_trainer(_Gated, zj.make_mesh(fsdp=8), 0), batches, steps=2)
    piped = _trainer(_Gated, zj.make_mesh(pipeline=2, fsdp=4), 3, microbatches=2, engine="shard_map")
    _assert_same_training(_run(piped, batches, steps=2), reference)
    refused = _trainer(_Gated, zj.make_mesh(pipeline=2, fsdp=4), 0, microbatches=2)
    with pytest.raises(UserError, match="set zero.engine=shard_map, or keep such parameters inside the blocks"):
        refused.step(refused.init(KEY, batches(0)), batches(0))


class _DropoutBlock(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.dense, self.drop = nnx.Linear(width, width, rngs=rngs), nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.dense(x)))


class _Dense(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(x))


class _PairBlock(_Dense):
    def __call__(self, xs):
        return super().__call__(xs[0]), xs[1]


class _MaskedBlock(_Dense):
    def __call__(self, x, mask):
        return super().__call__(x) * mask


class _Refused(nnx.Module):
    """Blocks with dropout state, a stack called feature-major (its first axis not the batch's), one
    carrying a tuple between its blocks, or one handed an extra argument with a row per sequence."""

    def __init__(self, case: str, *, rngs: nnx.Rngs):
        self.case = case
        self.embed, self.head = nnx.Linear(24, 16, rngs=rngs), nnx.Linear(16, 10, rngs=rngs)
        block = {"dropout": _DropoutBlock, "feature-major": _Dense, "tuple": _PairBlock, "per-row": _MaskedBlock}[case]
        self.blocks = zj.Stacked(block, 2, 16, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        if self.case == "dropout":
            return self.head(self.blocks(h))
        if self.case == "tuple":
            return self.head(self.blocks((h, h))[0])
        if self.case == "per-row":  # a row per sequence: passed whole to every microbatch
            return self.head(self.blocks(h, (x[:, :1] > 0).astype(h.dtype)))
        return self.head(self.blocks(h[:, :12].T).T @ jnp.ones((12, 16)))  # the stack sees [12, 16 rows]


@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
@pytest.mark.parametrize(
    "case,words",
    [
        ("dropout", "without dropout and BatchNorm in the blocks"),
        ("feature-major", "call the stack batch-first"),
        ("tuple", "this stack carries a tuple; carry one array"),
        ("per-row", "one has a row per sequence"),
    ],
)
def test_what_a_pipeline_cannot_split_is_refused_in_one_sentence(engine, case, words):
    batch = classification_batch(0, rows=16, features=24)
    trainer = _trainer(functools.partial(_Refused, case), zj.make_mesh(pipeline=2, fsdp=4), 0, 2, engine=engine)
    with pytest.raises(UserError, match=words):
        trainer.step(trainer.init(KEY, batch), batch)


def test_bf16_stages_1_and_2_keep_each_pipeline_stages_compute_copy():
    """shard_map, bf16: the compute copy gathered after the update is this device's pipeline stage's
    layers (it was the whole stack, stored as if split: twice the layers, refused at the next step)."""
    batches = functools.partial(classification_batch, rows=16, features=24)
    mesh, losses = zj.make_mesh(pipeline=2, fsdp=4), {}
    for stage in (0, 1, 2):
        trainer = zj.Trainer(
            stacked_blocks(24, 4), optax.adamw(1e-2), mesh=mesh, stage=stage, engine="shard_map",
            precision="bf16", microbatches=2,
        )  # fmt: skip
        state = trainer.init(KEY, batches(0))
        shapes = {k: v.shape for k, v in jax.tree_util.tree_leaves_with_path(state.compute)}
        steps = _steps(trainer, state, batches, 3)
        losses[stage] = [float(metrics["loss"]) for _, metrics in steps]
        assert {k: v.shape for k, v in jax.tree_util.tree_leaves_with_path(steps[-1][0].compute)} == shapes
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    np.testing.assert_allclose(losses[2], losses[0], rtol=1e-6)


def _steps(trainer, state, batches, n: int):
    out = []
    for i in range(n):
        state, metrics = trainer.step(state, batches(i))
        out.append((state, metrics))
    return out


def _hpz_pipelined(make):
    """shard_map, stage 3, SGD, hpZ on pipeline=2 x data=2 x fsdp=2, two microbatches."""
    mesh = zj.make_mesh(pipeline=2, data=2, fsdp=2)
    options = {"hierarchical": True}
    return zj.Trainer(
        make, optax.sgd(LR), mesh=mesh, stage=3, engine="shard_map", microbatches=2, engine_options=options
    )


@pytest.mark.parametrize("repeats", [1, 2, 4])
def test_bubbles_never_reach_the_output_or_the_gradient(repeats):
    mesh = zj.make_mesh(pipeline=2, fsdp=4)
    w = jax.random.normal(KEY, (8, 8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (8, 8))

    def layer(h, wl):
        return jnp.tanh(h @ wl)

    def loss(w, x, fill):
        out = gpipe(layer, x, w, mesh=mesh, microbatches=2, repeats=repeats, fill=fill) if fill is not None else None
        if out is None:
            out = jax.lax.scan(lambda h, wl: (layer(h, wl), None), x, w)[0]
        return jnp.sum(out**2)

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(w, x, None)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(w, x, float("nan"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.isfinite(a).all()
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    assert bubble_fraction(2, 2) == pytest.approx(1 / 3) and bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)


@pytest.mark.parametrize("mesh", [{"pipeline": 2, "fsdp": 4}, {"pipeline": 2, "fsdp": 2, "tensor": 2}])
def test_stage_3_keeps_the_whole_model_split_over_pipeline_x_fsdp_x_tensor(mesh):
    trainer = _trainer(functools.partial(GPT, CFG), zj.make_mesh(**mesh), 3, 2, tx=optax.adam(1e-3))
    state = trainer.init(KEY, _tokens(0))
    kept = {}
    for x in jax.tree.leaves(state):
        for s in x.addressable_shards:
            kept[s.device] = kept.get(s.device, 0) + s.data.nbytes
    # fp32 master + Adam's two moments: 12 bytes a parameter, over pipeline x fsdp x tensor: the
    # blocks by layers, the embedding, head and final norm (outside the pipeline) over fsdp x
    # pipeline; the norms are not split over tensor (0.6% here)
    want = 12 * CFG.num_params() / (2 * 4)
    assert all(abs(k / want - 1) < 0.01 for k in kept.values()), (kept, want)
    assert abs(ideal(trainer, "adam").persistent_bytes / want - 1) < 0.01  # the analytic model counts it so


def _is_leaf(x) -> bool:
    return hasattr(x, "padded_shape")


def test_a_checkpoint_saved_pipelined_restores_at_other_pipeline_sizes(tmp_path):
    make = functools.partial(GPT, CFG)
    saved = _trainer(make, zj.make_mesh(pipeline=2, fsdp=4), 3, 2)
    state = saved.init(KEY, _tokens(0))
    state, _ = saved.step(state, _tokens(0))
    _save(saved, state, tmp_path / "piped")
    want = logical_params(saved, state)
    for mesh in ({"fsdp": 8}, {"pipeline": 4, "data": 2, "fsdp": 1}):
        target = _trainer(make, zj.make_mesh(**mesh), 3, 4 if "pipeline" in mesh else None)
        restored, _ = restore(target, str(tmp_path / "piped" / "1"), KEY, _tokens(1))
        jax.tree.map(np.testing.assert_array_equal, logical_params(target, restored), want)
    _save(target, restored, tmp_path / "resaved")  # at pipeline=4
    # the export (the unpipelined layout) is the same whichever pipeline size wrote the checkpoint
    exported = [export_params(str(tmp_path / d), str(tmp_path / f"{d}.npz")) for d in ("piped", "resaved")]
    assert exported[0]["step"] == exported[1]["step"] == 1
    with np.load(tmp_path / "piped.npz") as a, np.load(tmp_path / "resaved.npz") as b:
        assert a.files == b.files and "blocks/w_up" in a.files
        for name in a.files:
            np.testing.assert_array_equal(a[name], b[name])


def _save(trainer, state, folder) -> None:
    writer = CheckpointWriter(str(folder), keep=1, run_meta=run_metadata(trainer, seed=0))
    writer.save(1, state)
    writer.close()


@pytest.mark.parametrize(
    "case,words",
    [
        ("layers", "4 layers do not divide into mesh.pipeline=8 pipeline stages"),
        ("repeats", "4 layers do not divide into mesh.pipeline=2 x mesh.pipeline_repeats=3"),
        ("no-stack", "this model has none it can split"),
        ("shard_map", "6 layers do not divide into mesh.pipeline=2 x mesh.pipeline_repeats=2"),
        ("microbatches", "train.microbatches=1 is fewer than the 2 pipeline stages"),
        ("uneven", "the batch of 16 rows does not split into train.microbatches=3 microbatches"),
        ("no-pipeline", "train.microbatches splits a pipeline's work; this mesh has no pipeline axis"),
        ("repeats-no-pipeline", "mesh.pipeline_repeats splits a pipeline's work; this mesh has no pipeline axis"),
        ("gather-stage-0", "zero.pipeline_gather=per_microbatch gathers weights split over fsdp, which only stage 3"),
        ("gather-no-pipeline", "zero.pipeline_gather chooses how a pipeline gathers; this mesh has no pipeline axis"),
    ],
)
def test_what_cannot_be_pipelined_is_one_sentence(case, words):
    make, mesh, engine, microbatches = functools.partial(GPT, CFG), {"pipeline": 2, "fsdp": 4}, "gspmd", None
    batch, repeats = _tokens(0), 3 if case.startswith("repeats") else 1
    stage, gather = (
        (0 if case == "gather-stage-0" else 3),
        ("per_microbatch" if case.startswith("gather") else "per_step"),
    )
    if case == "layers":
        mesh = {"pipeline": 8, "fsdp": 1}
    elif case == "no-stack":
        make, batch = unrolled_blocks(24, 4), classification_batch(rows=16, features=24)
    elif case == "shard_map":  # its loop checks the layers too
        make, engine, repeats = functools.partial(GPT, dataclasses.replace(CFG, n_layers=6)), "shard_map", 2
    elif case in ("no-pipeline", "repeats-no-pipeline", "gather-no-pipeline"):
        mesh, microbatches = {"fsdp": 8}, (2 if case == "no-pipeline" else None)
    elif case == "microbatches":
        microbatches = 1
    elif case == "uneven":  # refused as the batch is checked, before any trace (`zerojax inspect` too)
        microbatches = 3
    with pytest.raises(UserError, match=words):
        trainer = _trainer(
            make, zj.make_mesh(**mesh), stage, microbatches, engine=engine, repeats=repeats, gather=gather
        )
        trainer.step(trainer.init(KEY, batch), batch)


@pytest.mark.parametrize(
    "engine,options,accum,words",
    [
        ("shard_map", {"prefetch": True}, 1, "zero.prefetch does not combine with mesh.pipeline=2"),
        ("gspmd", {"prefetch": True}, 1, "zero.prefetch does not combine with mesh.pipeline=2"),
        ("shard_map", {"reshard_after_forward": False, "pipeline_gather": "per_microbatch"}, 1, "contradicts"),
        ("gspmd", {"reshard_after_forward": False, "pipeline_gather": "per_microbatch"}, 1, "contradicts"),
        ("gspmd", {"reshard_after_forward": False}, 2, "on the shard_map engine only"),
    ],
)
def test_options_a_pipeline_cannot_honour_are_one_sentence(engine, options, accum, words):
    make, mesh = functools.partial(GPT, CFG), zj.make_mesh(pipeline=2, fsdp=4)
    trainer = zj.Trainer(
        make, optax.sgd(LR), mesh=mesh, stage=3, engine=engine, grad_accum=accum, engine_options=options
    )
    with pytest.raises(UserError, match=words):
        trainer.init(KEY, _tokens(0))


def test_zeropp_quantized_collectives_on_a_pipeline():
    """shard_map, stage 3, bf16, pipeline=2 x fsdp=4: qwZ and qgZ halve the bytes of a pipeline
    stage's gathers and gradient over fsdp (int8 codes and a scale per 256); the leaves beside the
    pipeline, over fsdp x pipeline, keep their plain collectives; the losses stay close."""

    runs = []
    for options in (None, {"quantize_weights": "int8", "quantize_grads": "int8"}):
        trainer = zj.Trainer(
            functools.partial(GPT, CFG),
            optax.adamw(3e-3),
            mesh=zj.make_mesh(pipeline=2, fsdp=4),
            stage=3,
            engine="shard_map",
            precision="bf16",
            microbatches=2,
            engine_options=options,
        )
        state = trainer.init(KEY, _tokens(0))
        measured, step = measure_step(trainer, state, _tokens(0))  # one compile: the bytes and the steps
        losses = []
        for i in range(3):
            state, metrics = step(state, trainer.shard_batch(_tokens(i)))
            losses.append(float(metrics["loss"]))
        runs.append((measured.collective_by_kind_axis, np.array(losses)))
    (base, base_losses), (quantized, losses) = runs
    assert quantized["all-gather"]["pipeline+fsdp"] == base["all-gather"]["pipeline+fsdp"]
    assert quantized["all-gather"]["fsdp"] / base["all-gather"]["fsdp"] == pytest.approx((1 + 4 / 256) / 2, abs=0.01)
    beside = quantized["reduce-scatter"]["fsdp"]  # the plain reduce-scatters left: the leaves beside the pipeline
    assert quantized["all-to-all"]["fsdp"] / (base["reduce-scatter"]["fsdp"] - beside) <= 0.55
    np.testing.assert_allclose(losses, base_losses, rtol=2e-3)


def test_hpz_on_a_pipeline_trains_as_unpipelined_and_keeps_its_gathers_off_data(gpt_reference):
    """shard_map, stage 3, hpZ on pipeline=2 x data=2 x fsdp=2: the state split over data too (the
    leaves beside the stack over fsdp x pipeline x data, data minor), the secondary copies gathered
    over data once per step, every layer's gather over fsdp (or fsdp x pipeline beside the stack)
    and its gradient reduce-scattered over fsdp then data; it trains as the unpipelined model."""

    trainer = _hpz_pipelined(functools.partial(GPT, CFG))
    state = trainer.init(KEY, _tokens(0))
    measured, step = measure_step(trainer, state, _tokens(0))  # one compile: the bytes and the steps
    by_kind = measured.collective_by_kind_axis
    model_bytes = 4 * sum(np.prod(l.shape) for l in jax.tree.leaves(trainer.layout.leaves, is_leaf=_is_leaf))
    assert measured.persistent_bytes == pytest.approx(model_bytes / 8, rel=0.01)  # fp32 SGD: the master, / 8
    # the secondary copies: gathered over data once, (d-1)/d of a device's fsdp (x pipeline) share
    assert by_kind["all-gather"]["data"] == pytest.approx(model_bytes / 8, rel=0.01)
    assert by_kind["reduce-scatter"]["data"] == by_kind["all-gather"]["data"]  # the gradient, into the primary
    assert set(by_kind["all-gather"]) == {"data", "fsdp", "pipeline+fsdp"}
    assert "data" not in by_kind["all-reduce"]  # no gradient all-reduced over data
    compiled = lambda s, batch: step(s, trainer.shard_batch(batch))  # noqa: E731  (no second compile)
    _assert_same_training(_run(trainer, _tokens, state=state, step=compiled), gpt_reference)


def test_kept_weights_on_a_pipeline_train_as_unpipelined(gpt_reference):
    """shard_map, stage 3, reshard_after_forward=False: a pipeline stage's weights gathered once per
    step and kept across two accumulation micro-batches."""
    trainer = _trainer(
        functools.partial(GPT, CFG),
        zj.make_mesh(pipeline=2, fsdp=4),
        3,
        2,
        "shard_map",
        k=2,
        reshard_after_forward=False,
    )
    _assert_same_training(_run(trainer, _tokens), gpt_reference)
    assert trainer.gather_report().description.endswith(
        "every weight gathered once per step, kept for every micro-batch"
    )


def test_gspmd_accumulates_micro_batches_through_the_pipeline(gpt_reference):
    """gspmd, stage 0, two accumulation micro-batches: each runs through the pipeline (its sends in the
    compiled step) and the step trains as unpipelined. Before, accumulating at stages 0-2 ran the
    model once per data-parallel group with no pipeline at all, every device holding every layer,
    while the gather report said it was pipelined."""
    trainer = _trainer(functools.partial(GPT, CFG), zj.make_mesh(pipeline=2, fsdp=4), 0, 2, k=2)
    state = trainer.init(KEY, _tokens(0))
    compiled = trainer.lower(state, trainer.shard_batch(_tokens(0))).compile()
    assert compiled.as_text().count("collective-permute(") >= 2  # a stage's activations sent forward and back
    _assert_same_training(_run(trainer, _tokens, state=state), gpt_reference)


def test_shard_map_stage_2_accumulating_on_a_pipeline_says_so():
    """Its report named the accumulation alone, though each micro-batch runs through the pipeline."""
    trainer = _trainer(functools.partial(GPT, CFG), zj.make_mesh(pipeline=2, fsdp=4), 2, 2, "shard_map", k=2)
    trainer.init(KEY, _tokens(0))
    description = trainer.gather_report().description
    assert description.startswith("pipelined: 'blocks' split into 2 pipeline stages"), description
    assert "stage 2 with gradient accumulation" in description


def test_stage_sends_follow_the_schedule_and_the_gradient_is_reduced_once():
    """On the partitioned HLO, its sends counted as often as a profile of the step shows they ran:
    each work item's activations cross a stage boundary forward and their gradient backward, and
    nothing in the bubble (2 v m b S D x 4 bytes, b a device's rows of a microbatch, not
    2 (v m + p - 1)); the blocks' weight gradient is reduced over fsdp once per step whatever the
    number of microbatches.
    The circular schedule also reorders a stage's weights in and its gradient back (an all-to-all
    over pipeline of (p - 1) / p of them, each way)."""

    mesh, batch, sent = zj.make_mesh(pipeline=2, fsdp=4), _tokens(0), {}
    for m, v in ((2, 1), (4, 1), (2, 2)):
        trainer = _trainer(functools.partial(GPT, CFG), mesh, 0, m, repeats=v)
        measured = measure_step(trainer, trainer.init(KEY, batch), batch)[0]
        by_kind, item = measured.collective_by_kind_axis, 16 // m // 4 * CFG.seq_len * CFG.d_model * 4
        # at p = 2 the circular schedule's two boundaries, 0 -> 1 and 1 -> 0 (round to stage 0 for
        # all but the last repeat), share one pair of devices
        assert measured.stage_boundary_bytes == 2 * (v * m + (v - 1) * m) * item
        # a device sends one way: stage 0 its outputs, stage 1 its input's gradient (and, circular,
        # each the other way for all but the last repeat)
        assert by_kind["collective-permute"] == {"pipeline": (2 * v - 1) * m * item}
        sent[m, v] = by_kind["all-reduce"]["fsdp"], by_kind.get("all-to-all")
    blocks = jax.tree.leaves(trainer.layout.leaves["blocks"], is_leaf=_is_leaf)
    stage_bytes = 4 * sum(np.prod(l.shape) for l in blocks) / 2  # one pipeline stage's fp32 weights
    assert sent[2, 1][0] == sent[4, 1][0] == sent[2, 2][0]  # the fsdp reduction: once per step, whatever m and v
    assert sent[2, 1][1] is None and sent[2, 2][1] == {"pipeline": 2 * stage_bytes / 2}
    # jax 0.10: exactly the blocks' all-reduce (2 (f-1)/f of a stage's fp32 weights); jax 0.12's
    # partitioner adds ~98 KB more over fsdp, also once per step (docs/parallelism.md)
    assert sent[2, 1][0] >= 2 * 3 / 4 * stage_bytes
    if jax.__version_info__ < (0, 11):
        assert sent[2, 1][0] == pytest.approx(2 * 3 / 4 * stage_bytes)


# shard_map's count under -m slow (6 s): its pipeline gathers are counted by default in the hpZ test
@pytest.mark.parametrize("engine", ["gspmd", pytest.param("shard_map", marks=pytest.mark.slow)])
def test_stage_3_gathers_each_weight_once_per_step_or_each_layer_per_microbatch(engine):
    """Counted on the partitioned HLO (fp32, pipeline=2 x fsdp=4, m = 2): gathering once per step,
    each of a pipeline stage's stacked weights is all-gathered over fsdp by one collective that runs
    once ((f-1)/f of the stage's weights in all) and its gradient reduce-scattered once; per
    microbatch, every loop iteration gathers the stage's layers forward and again in the
    rematerialised backward and reduce-scatters their gradient, for a smaller peak."""
    from tests.programs import lower_abstract
    from zerojax.accounting.groups import axes_spanned
    from zerojax.accounting.hlo import collectives
    from zerojax.accounting.partitioned import compile_partitioned

    mesh, batch, m, found = zj.make_mesh(pipeline=2, fsdp=4), _tokens(0), 2, {}
    for gather in ("per_step", "per_microbatch"):
        trainer = _trainer(functools.partial(GPT, CFG), mesh, 3, m, engine, gather=gather)
        compiled, hlo = compile_partitioned(lower_abstract(trainer, batch), tempfile.mkdtemp(prefix="zerojax-hlo-"))
        spans = [(c, axes_spanned(c.groups, dict(mesh.shape))) for c in collectives(hlo)]
        on_fsdp, on_both = ([c for c, a in spans if a == axes] for axes in ("fsdp", "pipeline+fsdp"))
        found[gather] = on_fsdp, compiled.memory_analysis().temp_size_in_bytes, on_both
    leaves = trainer.prepare(KEY, batch).layout.leaves
    blocks = jax.tree.leaves(leaves["blocks"], is_leaf=_is_leaf)
    stage_bytes = 4 * sum(np.prod(l.shape) for l in blocks) / 2
    # The embedding, head and final norm (outside the pipeline) are sharded over fsdp x pipeline:
    # both engines gather them there once. shard_map reduce-scatters their gradient over fsdp and
    # keeps its pipeline part (every pipeline stage holds the whole gradient); gspmd all-reduces it,
    # over pipeline x fsdp on jax 0.10 and over fsdp on jax 0.12.
    rest = [l for k, v in leaves.items() if k != "blocks" for l in jax.tree.leaves(v, is_leaf=_is_leaf)]
    rest_fp32 = 4 * sum(np.prod(l.shape) for l in rest)
    scattered = 3 / 4 * rest_fp32 if engine == "shard_map" else 0
    all_reduced = 2 * 3 / 4 * rest_fp32 if engine == "gspmd" and jax.__version_info__ >= (0, 11) else 0
    once, beside = found["per_step"][0], found["per_step"][2]

    def moved(collectives, kind):
        return sum(c.sent * c.runs for c in collectives if c.kind == kind)

    assert [c.runs for c in beside if c.kind == "all-gather"] == [1] * len(rest)
    assert moved(beside, "all-gather") == 7 / 8 * rest_fp32
    if engine == "gspmd" and jax.__version_info__ < (0, 11):
        assert 0 <= moved(beside, "all-reduce") - 2 * 7 / 8 * rest_fp32 < 100  # besides it: scalars only
    gathers = [c for c in once if c.kind == "all-gather"]
    assert len(gathers) == len(blocks) and all(c.runs == 1 for c in gathers)
    assert moved(once, "all-gather") == 3 / 4 * stage_bytes
    # and its gradient reduce-scattered once, after the last microbatch (no fsdp all-reduce of it)
    assert moved(once, "reduce-scatter") == 3 / 4 * stage_bytes + scattered
    assert 0 <= moved(once, "all-reduce") - all_reduced < 100  # besides the rest's: scalars only
    each = found["per_microbatch"][0]

    iterations = m + 2 - 1
    assert moved(each, "all-gather") == 2 * iterations * 3 / 4 * stage_bytes
    assert moved(each, "reduce-scatter") == iterations * 3 / 4 * stage_bytes + scattered
    assert found["per_microbatch"][1] < found["per_step"][1]


def test_inspect_counts_a_kept_compute_copy_per_pipeline_stage():
    from zerojax.cli.commands.inspect import layout_report
    from zerojax.cli.config import load_config

    overrides = ["mesh.pipeline=2", "precision=bf16", "zero.stage=1", "model.n_layers=2"]
    leaves = {l["path"]: l for l in layout_report(load_config("configs/tiny.yaml", overrides))["leaves"]}
    w_down, embed = leaves["blocks/w_down"], leaves["embed"]
    assert w_down["bytes_per_device"]["compute_params"] == np.prod(w_down["shape"]) * 2 // 2  # bf16, half the layers
    assert embed["bytes_per_device"]["compute_params"] == np.prod(embed["shape"]) * 2  # outside the pipeline


class _OptedInGPT(GPT):
    layer_stacks = ()  # declares no stack of its own: the engine option names it


def test_verify_pipelines_the_reference_of_a_model_opted_into_its_layer_stacks():
    """The stage-0 reference keeps the engine option `layer_stacks`: without it, it could not split
    the model over the `pipeline` axis and `verify` refused a model that trains."""
    trainer = _trainer(
        functools.partial(_OptedInGPT, CFG), zj.make_mesh(pipeline=2, fsdp=4), 3, layer_stacks=("blocks",)
    )
    result = trainer.verify(_tokens(0), steps=1)
    assert result.passed, result.lines()
    assert "pipelined: 'blocks' split into 2 pipeline stages" in "\n".join(result.lines())
