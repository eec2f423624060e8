"""FSDP x tensor parallelism on one mesh: a model names its parameters' dimensions the Flax way, the
axis rules put heads, mlp and vocab on `tensor`, and every stage shards the rest over `fsdp`. The
loss equals stage 0 on an fsdp-only mesh, each device keeps 1/(fsdp x tensor) of the state, the
tensor axis moves the activation all-reduces Megatron's split needs, and checkpoints move between
meshes with and without a tensor axis."""

from __future__ import annotations

import functools
import json
import tempfile

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zerojax as zj
from tests.cli_helpers import assert_one_line_error, cli_in_process
from tests.host_copies import logical_params
from zerojax.accounting import hlo, partitioned
from zerojax.accounting.params import tensor_local_params
from zerojax.core.offload import split_bytes
from zerojax.interop.params import export_params
from zerojax.models.gpt import GPT, gpt_config
from zerojax.train.checkpoint import CheckpointWriter, restore, run_metadata

D, F, ROWS, CLASSES = 16, 64, 16, 8
STEPS = 5  # fp32 steps compared with stage 0, within 1e-5
MESHES = {
    "fsdp8": {"fsdp": 8},
    "fsdp4_tensor2": {"fsdp": 4, "tensor": 2},
    "dp2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
}
_init = nnx.initializers.lecun_normal()


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        up, down = nnx.with_partitioning(_init, ("embed", "mlp")), nnx.with_partitioning(_init, ("mlp", "embed"))
        self.up = nnx.Linear(D, F, use_bias=False, kernel_init=up, rngs=rngs)
        self.down = nnx.Linear(F, D, use_bias=False, kernel_init=down, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class BlocksNNX(nnx.Module):
    """A list of annotated blocks and an unannotated head (free for FSDP, whole over `tensor`)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(D, CLASSES, use_bias=False, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BlocksLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        for _ in range(2):
            h = nn.Dense(F, use_bias=False, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
            x = x + nn.Dense(D, use_bias=False, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(
                nn.gelu(h)
            )
        return nn.Dense(CLASSES, use_bias=False, kernel_init=nn.with_logical_partitioning(init, ("embed", "vocab")))(x)


GPT_CFG = gpt_config("tiny", d_model=32, n_heads=4, d_ff=64, n_layers=1, seq_len=8)


def _model(kind: str):
    return {"nnx": BlocksNNX, "linen": BlocksLinen(), "gpt": functools.partial(GPT, GPT_CFG)}[kind]


def _batch(kind: str) -> dict:
    rng = np.random.default_rng(0)
    if kind == "gpt":
        tokens = rng.integers(0, 256, (8, GPT_CFG.seq_len + 1)).astype(np.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return {
        "inputs": rng.normal(size=(ROWS, D)).astype(np.float32),
        "targets": rng.integers(0, CLASSES, ROWS).astype(np.int32),
    }


def _trainer(kind: str, mesh: str, stage: int, engine: str = "gspmd", sequence_parallel=False) -> zj.Trainer:
    rules = {**zj.DEFAULT_AXIS_RULES, **(zj.SEQUENCE_PARALLEL_RULES if sequence_parallel else {})}
    mesh = zj.make_mesh(**MESHES[mesh])
    return zj.Trainer(_model(kind), optax.adamw(1e-2), mesh=mesh, stage=stage, engine=engine, axis_rules=rules)


def _losses(kind: str, mesh: str, stage: int, engine: str) -> np.ndarray:
    sequence_parallel = kind == "gpt-sp"
    kind = "gpt" if sequence_parallel else kind
    trainer, batch = _trainer(kind, mesh, stage, engine, sequence_parallel), _batch(kind)
    state, losses = trainer.init(jax.random.key(0), batch), []
    for _ in range(STEPS):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@functools.cache
def _reference(kind: str) -> np.ndarray:
    return _losses("gpt" if kind == "gpt-sp" else kind, "fsdp8", 0, "gspmd")


# "gpt-sp": the shipped GPT with sequence parallelism (the rule seq -> tensor)
FAST = [("nnx", "fsdp4_tensor2", 3, "gspmd"), ("linen", "dp2_fsdp2_tensor2", 3, "shard_map")]
FAST += [("gpt-sp", "fsdp4_tensor2", 3, "gspmd")]
SLOW = [
    (kind, mesh, stage, engine)
    for kind in ("nnx", "linen", "gpt", "gpt-sp")
    for mesh in ("fsdp4_tensor2", "dp2_fsdp2_tensor2")
    for stage in range(4)
    for engine in ("gspmd", "shard_map")
    if (kind, mesh, stage, engine) not in FAST
]


@pytest.mark.parametrize(
    "kind, mesh, stage, engine", FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in SLOW]
)
def test_loss_on_a_tensor_mesh_equals_stage_0_on_fsdp_alone(kind, mesh, stage, engine):
    reference = _reference(kind)
    np.testing.assert_allclose(_losses(kind, mesh, stage, engine), reference, rtol=1e-5, atol=0)
    assert reference[-1] < reference[0]


def _slice_params(layout) -> int:
    """One tensor-parallel slice: the tensor-split leaves count 1/tensor (the unannotated head whole)."""
    return tensor_local_params(layout.leaves)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_each_device_keeps_its_fsdp_x_tensor_share_of_the_state(kind):
    """fp32 + Adam at stage 3: 12 bytes a parameter over fsdp x tensor, the tensor-split dims too."""
    trainer = _trainer(kind, "fsdp4_tensor2", 3)
    prepared = trainer.prepare(jax.random.key(0), _batch(kind))
    abstract, layout = prepared.abstract, prepared.layout
    kept = split_bytes((abstract.params, abstract.opt_state), jax.devices()[0])["device"]
    ideal = 12 * _slice_params(layout) / 4
    whole = sum(int(np.prod(l.shape)) for l in jax.tree.leaves(layout.leaves, is_leaf=lambda x: hasattr(x, "spec")))
    assert _slice_params(layout) < 0.6 * whole  # most of the model is split over tensor
    assert abs(kept / ideal - 1) < 0.01, (kept, ideal)
    up = layout.leaves["blocks"][0]["up"]["kernel"] if kind == "nnx" else None
    if up is not None:
        assert tuple(up.spec(True)) == ("fsdp", "tensor") and tuple(up.spec(False)) == (None, "tensor")


def test_the_tensor_axis_moves_megatrons_activation_all_reduces():
    """Per block, the partial sums of `down`'s output (forward) and of `up`'s input gradient
    (backward; none for the first block, whose input is data) are all-reduced over `tensor`: rows x D
    compute-dtype bytes each, sending 2(t-1)/t of it; the FSDP gathers move one tensor slice of the
    model over fsdp (counted on the partitioned HLO)."""
    trainer, batch = _trainer("nnx", "fsdp4_tensor2", 3), _batch("nnx")
    state = trainer.init(jax.random.key(0), batch)
    with tempfile.TemporaryDirectory() as tmp:
        _, text = partitioned.compile_partitioned(trainer.lower(state, batch), tmp)
    by = hlo.collective_bytes(text, mesh=trainer.mesh)["by_kind_axis"]
    layout = trainer.layout
    rows, t, blocks = ROWS // 4, 2, 2
    tensor_ideal = (2 * blocks - 1) * (rows * D * 4) * 2 * (t - 1) / t
    assert abs(by["all-reduce"]["tensor"] / tensor_ideal - 1) < 0.05, by
    gather_ideal = 2 * 4 * _slice_params(layout) * 3 / 4  # forward and backward gathers, fp32, fsdp=4
    assert abs(by["all-gather"]["fsdp"] / gather_ideal - 1) < 0.05, by
    assert "tensor" not in by.get("all-gather", {})  # nothing is gathered over tensor


@pytest.mark.slow
def test_sequence_parallelism_gathers_the_sequence_over_tensor():
    """With seq -> tensor the residual stream between blocks is a sequence slice: each block's
    matmuls all-gather it over `tensor` (B x L x D compute bytes, sending (t-1)/t), twice a block
    forward, and the state per device is unchanged."""
    batch, counted, kept = _batch("gpt"), {}, {}
    for sp in (False, True):
        trainer = _trainer("gpt", "fsdp4_tensor2", 3, sequence_parallel=sp)
        state = trainer.init(jax.random.key(0), batch)
        with tempfile.TemporaryDirectory() as tmp:
            _, text = partitioned.compile_partitioned(trainer.lower(state, batch), tmp)
        counted[sp] = hlo.collective_bytes(text, mesh=trainer.mesh)["by_kind_axis"]
        kept[sp] = split_bytes((state.params, state.opt_state), jax.devices()[0])["device"]
    assert "tensor" not in counted[False].get("all-gather", {})
    rows = 8 // 4
    one = rows * GPT_CFG.seq_len * GPT_CFG.d_model * 4 / 2  # fp32, (t-1)/t with t = 2
    assert counted[True]["all-gather"]["tensor"] >= 2 * GPT_CFG.n_layers * one
    assert kept[True] == kept[False]


def _save(trainer, state, where) -> str:
    writer = CheckpointWriter(str(where), keep=1, run_meta=run_metadata(trainer, seed=0))
    writer.save(1, state)
    writer.close()
    return str(where / "1")


def _exported(step_dir: str, out) -> dict:
    export_params(step_dir, str(out))
    with np.load(str(out)) as f:
        return {k: f[k] for k in f.files}


def test_a_checkpoint_restores_across_tensor_meshes_exactly(tmp_path):
    """fsdp=8 -> fsdp=4 x tensor=2 and data=2 x fsdp=2 x tensor=2 -> back to fsdp=8, the params equal
    bit for bit (the losses that follow are the parity tests'); each mesh's checkpoint exports the
    same file."""
    kind, batch = "nnx", _batch("nnx")
    source = _trainer(kind, "fsdp8", 3)
    state = source.init(jax.random.key(0), batch)
    state, _ = source.step(state, batch)
    saved = _save(source, state, tmp_path / "fsdp8")
    want, exported = logical_params(source, state), _exported(saved, tmp_path / "fsdp8.npz")
    for mesh, stage in (("fsdp4_tensor2", 3), ("dp2_fsdp2_tensor2", 1)):
        target = _trainer(kind, mesh, stage)
        restored, _ = restore(target, saved, jax.random.key(0), batch)
        jax.tree.map(np.testing.assert_array_equal, logical_params(target, restored), want)
        saved = _save(target, restored, tmp_path / mesh)
        jax.tree.map(np.testing.assert_array_equal, _exported(saved, tmp_path / f"{mesh}.npz"), exported)
    back = _trainer(kind, "fsdp8", 2)
    restored, _ = restore(back, saved, jax.random.key(0), batch)
    jax.tree.map(np.testing.assert_array_equal, logical_params(back, restored), want)


def test_a_model_with_nothing_on_the_tensor_axis_is_refused_in_one_line():
    class Plain(nnx.Module):
        def __init__(self, *, rngs):
            self.dense = nnx.Linear(D, CLASSES, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)

    trainer = zj.Trainer(Plain, optax.adamw(1e-2), mesh=zj.make_mesh(fsdp=4, tensor=2), stage=3)
    with pytest.raises(zj.UserError, match="no parameter of this model is mapped to it.*repeat each other's work"):
        trainer.init(jax.random.key(0), _batch("nnx"))


def test_bad_axis_rules_and_indivisible_dims_are_one_line():
    with pytest.raises(zj.UserError, match="a rule maps to one of data, fsdp, tensor, a list of them, or None"):
        zj.Trainer(BlocksNNX, optax.adamw(1e-2), axis_rules={"mlp": "pipeline"})
    on_data = zj.Trainer(BlocksNNX, optax.adamw(1e-2), axis_rules={"mlp": "data"})
    with pytest.raises(zj.UserError, match="maps axis \\d \\('mlp'\\) to \\('data',\\).*whole replicas"):
        on_data.init(jax.random.key(0), _batch("nnx"))
    three = zj.make_mesh(fsdp=2, tensor=3, devices=jax.devices()[:6])
    trainer = zj.Trainer(BlocksNNX, optax.adamw(1e-2), mesh=three, stage=3)
    with pytest.raises(zj.UserError, match="'blocks/0/down/kernel' splits axis 0 \\(64\\) over the tensor axis"):
        trainer.init(jax.random.key(0), _batch("nnx"))


def test_inspect_shows_the_tensor_axis_and_why():
    r = cli_in_process(
        "inspect", "configs/tiny.yaml", "--json", "--devices", "8", "--stage", "3", "--set", "mesh.tensor=2"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    leaves = {l["path"]: l for l in report["leaves"]}
    assert report["tensor"] == 2 and report["fsdp"] == 4 and report["unmapped_axis_names"] == []
    wq = leaves["blocks/wq"]
    assert wq["tensor_axis"] == 2 and wq["reason"] == "sharded on axis 1; tensor on axis 2"
    assert wq["spec"]["master"] == "(None, 'fsdp', 'tensor')"
    assert leaves["final_norm"]["tensor_axis"] is None
    bad = cli_in_process("inspect", "configs/tiny.yaml", "--devices", "8", "--set", "mesh.rules={mlp: pipeline}")
    assert_one_line_error(bad, "axis rule 'mlp' -> 'pipeline'")


OPTIONS = {
    "grad_accum gspmd": ("gspmd", 3, {"grad_accum": 2}),
    "grad_accum shard_map stage 2": ("shard_map", 2, {"grad_accum": 2}),
    "offload gspmd": ("gspmd", 3, {"offload": "optimizer"}),
    "hpZ shard_map": ("shard_map", 3, {"engine_options": {"hierarchical": True}}),
    "prefetch shard_map": ("shard_map", 3, {"engine_options": {"prefetch": True}}),
    "kept gathers gspmd": ("gspmd", 3, {"engine_options": {"reshard_after_forward": False}}),
    "qwZ int8 shard_map": ("shard_map", 3, {"engine_options": {"quantize_weights": "int8"}}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIONS)
def test_stage_options_compose_with_a_tensor_axis(name):
    """Accumulation, offload and ZeRO++'s options on data=2 x fsdp=2 x tensor=2: the losses of the same
    options on fsdp=8 (qwZ's quantized gathers: within 1% of the exact loss)."""
    engine, stage, options = OPTIONS[name]
    batch, losses = _batch("nnx"), {}
    for mesh in ("fsdp8", "dp2_fsdp2_tensor2"):
        trainer = zj.Trainer(
            BlocksNNX, optax.adamw(1e-2), mesh=zj.make_mesh(**MESHES[mesh]), stage=stage, engine=engine, **options
        )
        state, losses[mesh] = trainer.init(jax.random.key(0), batch), []
        for _ in range(STEPS):
            state, metrics = trainer.step(state, batch)
            losses[mesh].append(float(metrics["loss"]))
    exact = "quantize_weights" not in options.get("engine_options", {})
    rtol = 1e-5 if exact else 1e-2
    np.testing.assert_allclose(losses["dp2_fsdp2_tensor2"], losses["fsdp8"], rtol=rtol, atol=0)
    np.testing.assert_allclose(losses["fsdp8"], _reference("nnx"), rtol=rtol, atol=0)
