"""`trainable=`: frozen parameters are never differentiated, updated or given optimizer state, at
every stage in both engines, on a user's NNX model built with `nnx.LoRALinear` (adapters train by
default) and on a plain one frozen by a regex."""

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
from tests.host_copies import trained
from tests.models import LinenMLP, UnevenMLP, classification_batch, tiny_gpt, token_batch
from tests.programs import lower_abstract
from zerojax.accounting.hlo import collective_bytes
from zerojax.accounting.partitioned import compile_partitioned
from zerojax.core.loss import cross_entropy

STEPS = 3
RANK = 4


class LoRAMLP(nnx.Module):
    """37 -> 129 -> 10 with rank-4 adapters on both layers, as Flax's docs build it."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.LoRALinear(37, 129, lora_rank=RANK, rngs=rngs)
        self.out = nnx.LoRALinear(129, 10, lora_rank=RANK, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.hidden(x)))


def _adamw():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def _labels(params):  # optax's own way: the output layer frozen
    return {
        name: jax.tree.map(lambda _, n=name: "train" if n == "hidden" else "frozen", v) for name, v in params.items()
    }


def _trainer(model, stage, engine, tx=None, **choices):
    tx = tx or _adamw()
    return zj.Trainer(model, tx, mesh=zj.make_mesh(fsdp=8), stage=stage, engine=engine, **choices)


@functools.cache
def _run(name: str, stage: int, engine: str):
    model, choices, tx = {
        "lora": (LoRAMLP, {}, None),
        "regex": (UnevenMLP, {"trainable": "^hidden/"}, None),
        "set_to_zero": (
            UnevenMLP,
            {},
            optax.multi_transform({"train": _adamw(), "frozen": optax.set_to_zero()}, _labels),
        ),
    }[name]
    trainer = _trainer(model, stage, engine, tx, **choices)
    return trained(trainer, classification_batch, STEPS)


DEFAULT = {(3, "shard_map"), (3, "gspmd"), (2, "shard_map")}


def stages_and_engines(default: set) -> list:
    """Every stage and engine but the reference (stage 0, gspmd); those not in `default` under -m slow."""
    return [
        (s, e) if (s, e) in default else pytest.param(s, e, marks=pytest.mark.slow)
        for s in (0, 1, 2, 3)
        for e in ("gspmd", "shard_map")
        if (s, e) != (0, "gspmd")
    ]


@pytest.mark.parametrize("stage, engine", stages_and_engines(DEFAULT))
def test_lora_adapters_train_like_stage_0_and_the_base_stays_bit_for_bit(stage, engine):
    losses, initial, final = _run("lora", stage, engine)
    want_losses, _, want_final = _run("lora", 0, "gspmd")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), final, want_final)
    for layer in ("hidden", "out"):
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(final[layer][name], initial[layer][name])
        assert not np.array_equal(final[layer]["lora"]["lora_b"], initial[layer]["lora"]["lora_b"])
    assert losses[-1] < losses[0]


def test_a_regex_trains_like_multi_transform_with_set_to_zero():
    losses, initial, final = _run("regex", 3, "shard_map")
    want_losses, _, want_final = _run("set_to_zero", 3, "shard_map")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(final["out"]["kernel"], initial["out"]["kernel"])
    np.testing.assert_allclose(final["hidden"]["kernel"], want_final["hidden"]["kernel"], rtol=1e-6, atol=1e-7)


def test_frozen_leaves_hold_no_optimizer_state():
    state = _trainer(LoRAMLP, 3, "shard_map").abstract_state(jax.random.key(0), classification_batch())
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == 2 * RANK * (37 + 129 + 129 + 10)  # Adam's two moments of the adapters; none of the base


def _reduced_and_gathered(trainer) -> tuple[float, float]:
    """(gradient reduction bytes: all-reduces and reduce-scatters, all-gather bytes) of the step,
    counted on the partitioned program."""
    batch = classification_batch()
    _, hlo = compile_partitioned(lower_abstract(trainer, batch), tempfile.mkdtemp(prefix="zerojax-hlo-"))
    moved = collective_bytes(hlo)["bytes"]
    return moved["all-reduce"] + moved["reduce-scatter"], moved["all-gather"]


RING = 2 * 7 / 8  # a ring all-reduce over 8 devices sends 2(p-1)/p of its bytes, a reduce-scatter half


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
def test_frozen_gradients_are_never_reduced(engine, stage):
    """The step reduces the adapters' gradients only (and the loss and the norm)."""
    reduced, gathered = _reduced_and_gathered(_trainer(LoRAMLP, stage, engine))
    adapters = 4 * RANK * (37 + 129 + 129 + 10)  # fp32 bytes of the four adapter matrices (replicated)
    base = 4 * (37 * 129 + 129 + 129 * 10 + 10)
    assert RING / 2 * adapters <= reduced < RING * (adapters + base / 10), (reduced, adapters, base)
    if stage == 3:
        assert gathered >= 7 / 8 * base  # the frozen base is still gathered


@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
def test_gpt_lora_reduces_only_its_adapters(engine):
    """The shipped GPT with rank-4 adapters at stage 3: the scanned blocks' reductions are the
    adapters' (the base, gathered per layer forward and backward, is never reduced)."""
    model, cfg = tiny_gpt(lora={"rank": 4})
    trainer = zj.Trainer(model, _adamw(), mesh=zj.make_mesh(fsdp=8), stage=3, engine=engine)
    batch = token_batch(0)
    _, hlo = compile_partitioned(lower_abstract(trainer, batch), tempfile.mkdtemp(prefix="zerojax-hlo-"))
    moved = collective_bytes(hlo)["bytes"]
    adapters, base = 4 * cfg.num_lora_params(), 4 * (cfg.num_params() - cfg.num_lora_params())
    reduced = moved["all-reduce"] + moved["reduce-scatter"]
    assert RING / 2 * adapters <= reduced < RING * (adapters + base / 10), (reduced, adapters, base)
    assert moved["all-gather"] >= 7 / 8 * base  # the frozen base is still gathered


@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
def test_linen_units_never_reduce_frozen_gradients(engine):
    """A Linen model's FSDP units (its three `nn.Dense`) at stage 3, the biases alone trained: each
    unit holds frozen and trainable leaves, and its backward differentiates only what its caller
    does (under `gspmd` each unit's input gradient waits for its parameter gradients, so a frozen
    one computed there would be kept, and reduced)."""
    trainer = _trainer(LinenMLP(), 3, engine, trainable="bias$")
    assert trainer.prepare(jax.random.key(0), classification_batch()).report.route == "units"
    reduced, _ = _reduced_and_gathered(trainer)
    trained = 4 * (96 + 40 + 10)
    frozen = 4 * (37 * 96 + 96 * 40 + 40 * 10)
    assert RING / 2 * trained <= reduced < RING * (trained + frozen / 10), (reduced, trained, frozen)


def test_a_selection_of_nothing_is_one_sentence():
    trainer = _trainer(UnevenMLP, 3, "shard_map", trainable="nowhere")
    with pytest.raises(zj.UserError, match="selects none of the model's 4 parameters"):
        trainer.init(jax.random.key(0), classification_batch())


class WideLoRA(nnx.Module):
    """Two 512-wide `nnx.LoRALinear`s: every leaf shards evenly over 8 devices."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.LoRALinear(512, 512, lora_rank=8, rngs=rngs)
        self.out = nnx.LoRALinear(512, 512, lora_rank=8, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.hidden(x)))


def _wide_batch(step: int = 0):
    x = np.random.default_rng(step).normal(size=(16, 512)).astype(np.float32)
    return {"inputs": x, "targets": x}


def _mse(out, batch):
    return ((out - batch["targets"]) ** 2).mean()


def _per_device_bytes(tree) -> int:
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim
    )


def _wide_gpt_lora():
    """The shipped GPT, 256 wide, with rank-8 adapters on all seven targets; (model, loss, batch,
    params frozen, params trained)."""
    model, cfg = tiny_gpt(d_model=256, d_ff=512, lora={"rank": 8})
    return model, cross_entropy, token_batch(0), cfg.num_params() - cfg.num_lora_params(), cfg.num_lora_params()


def _wide_user_lora():
    return WideLoRA, _mse, _wide_batch(), 2 * (512 * 512 + 512), 2 * 8 * (512 + 512)


@pytest.mark.parametrize("model", [_wide_user_lora, _wide_gpt_lora])
@pytest.mark.parametrize("precision, frozen_bytes", [("fp32", 4), ("bf16", 2)])
def test_state_kept_per_device_is_the_fine_tuning_formula(model, precision, frozen_bytes):
    """Stage 3 keeps `frozen_bytes * Psi_frozen / N + 12 * Psi_trainable / N` between steps: the frozen
    base in the compute dtype (no fp32 master, no moments), the adapters' fp32 master and Adam's two
    moments, all sharded over the 8 devices."""
    model, loss_fn, batch, frozen, adapters = model()
    trainer = _trainer(model, 3, "shard_map", optax.adam(1e-3), precision=precision, loss_fn=loss_fn)
    state = trainer.abstract_state(jax.random.key(0), batch)
    formula = (frozen_bytes * frozen + 12 * adapters) / 8
    kept = _per_device_bytes(state)
    assert abs(kept - formula) <= 0.01 * formula, (kept, formula)
    kinds = {x.dtype.itemsize for x in jax.tree.leaves(state.params)}
    assert kinds == ({4} if frozen_bytes == 4 else {2, 4})


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_frozen_leaves_are_kept_once_replicated_in_bf16(stage):
    """Stages 1-2 shard the trainable leaves' master; a frozen leaf has none, and no compute copy
    beside it: it is stored once, replicated, as the forward reads it. Training still matches stage 0."""
    trainer = _trainer(WideLoRA, stage, "shard_map", optax.adam(1e-3), precision="bf16", loss_fn=_mse)
    state = trainer.init(jax.random.key(0), _wide_batch())
    kernel = state.params["hidden"]["kernel"]
    assert kernel.dtype == jax.numpy.bfloat16 and kernel.sharding.is_fully_replicated
    assert state.compute["hidden"]["kernel"] is None and state.compute["hidden"]["lora"]["lora_a"] is not None
    assert not state.params["hidden"]["lora"]["lora_a"].sharding.is_fully_replicated
    losses, initial, final = trained(trainer, _wide_batch, 2)
    stage_0 = _trainer(WideLoRA, 0, "gspmd", optax.adam(1e-3), precision="bf16", loss_fn=_mse)
    want, _, _ = trained(stage_0, _wide_batch, 2)
    np.testing.assert_allclose(losses, want, rtol=1e-2)
    np.testing.assert_array_equal(final["out"]["kernel"], initial["out"]["kernel"])


@functools.cache
def _gpt_run(stage: int, engine: str):
    model, _ = tiny_gpt(lora={"rank": 4, "alpha": 8})
    return trained(_trainer(model, stage, engine), token_batch, STEPS)


@pytest.mark.parametrize("stage, engine", stages_and_engines({(3, "shard_map")}))
def test_gpt_lora_trains_like_stage_0_and_the_base_stays_bit_for_bit(stage, engine):
    """`model.lora` on the shipped GPT: the adapters alone train (B starts at zero, so step 0 is the
    base model's loss), at every stage and engine as at stage 0."""
    losses, initial, final = _gpt_run(stage, engine)
    want_losses, _, want_final = _gpt_run(0, "gspmd")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), final, want_final)
    for name in ("embed", "head", "final_norm"):
        np.testing.assert_array_equal(final[name], initial[name])
    for name in ("wq", "w_down", "attn_norm"):
        np.testing.assert_array_equal(final["blocks"][name], initial["blocks"][name])
    assert not np.array_equal(final["blocks"]["q_lora_b"], initial["blocks"]["q_lora_b"])
    assert losses[-1] < losses[0]


def test_an_unknown_lora_target_is_one_sentence():
    with pytest.raises(zj.UserError, match=r"model.lora.targets \['q', 'qq'\]: each must be one of"):
        tiny_gpt(lora={"rank": 4, "targets": ["q", "qq"]})


def _saved_array_bytes(step_dir: str) -> int:
    """The bytes of the arrays a checkpoint holds (orbax's own metadata files left out)."""
    from etils import epath

    from zerojax.train.checkpoint import state_handler

    tree = state_handler().metadata(epath.Path(step_dir) / "state").tree
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if x.shape)


def _base_file(path, cfg) -> str:
    """A base model's params file (as `zerojax export` writes one): the GPT without its adapters."""
    from zerojax.core.trees import path_str
    from zerojax.models.gpt import GPT

    base = nnx.to_pure_dict(nnx.state(GPT(dataclasses.replace(cfg, lora=None), rngs=nnx.Rngs(1)), nnx.Param))
    flat = {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(base)[0]}
    np.savez(path, **flat)
    return str(path)


def test_a_lora_checkpoint_holds_the_trainable_part_resumes_bit_exact_and_refuses_another_base(tmp_path):
    """Rank 4 on all seven targets of the tiny GPT (bf16), started from a base file without adapters:
    the checkpoint saves the adapters, their moments and a fingerprint of the frozen base, which a
    resume and an export take from that file again, and refuse once it holds another base."""
    from zerojax.interop.params import export_params
    from zerojax.train.checkpoint import CheckpointWriter, restore, run_metadata
    from zerojax.train.params_file import initial_params

    model, cfg = tiny_gpt(lora={"rank": 4})
    key, batch, base = jax.random.key(0), token_batch(0), _base_file(tmp_path / "base.npz", cfg)
    trainer = _trainer(model, 3, "shard_map", precision="bf16")
    start = lambda: trainer.init(key, batch, params=initial_params(base, trainer, key, batch))  # noqa: E731
    state, _ = trainer.step(start(), batch)
    writer = CheckpointWriter(str(tmp_path / "run"), keep=1, run_meta=run_metadata(trainer, seed=0, source=base))
    writer.save(1, state)
    writer.close()
    want, _ = trainer.step(state, token_batch(1))
    step_dir = str(tmp_path / "run" / "1")

    full = _trainer(model, 3, "shard_map", precision="bf16", trainable=".*").abstract_state(key, batch).saved()
    full_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(full))  # what a full checkpoint saves
    fraction = cfg.num_lora_params() / cfg.num_params()
    ratio = _saved_array_bytes(step_dir) / full_bytes
    assert abs(ratio - fraction) <= 0.1 * fraction, (ratio, fraction)

    restored, _ = restore(trainer, step_dir, key, token_batch(1), base=start())
    got, _ = trainer.step(restored, token_batch(1))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got.params), jax.device_get(want.params))
    exported, file = np.load(export_params(step_dir, str(tmp_path / "out.npz"))["path"]), np.load(base)
    assert len(exported.files) == len(file.files) + 14  # the base, and an A and a B per target
    for name in file.files:  # as the run computed with them: in bf16
        np.testing.assert_array_equal(exported[name], file[name].astype(jax.numpy.bfloat16).astype(np.float32))
    with pytest.raises(zj.UserError, match="holds only the trainable params"):
        restore(trainer, step_dir, key, token_batch(1))
    np.savez(base, **{**dict(np.load(base)), "head": np.load(base)["head"] + 1})  # one base leaf changed
    with pytest.raises(zj.UserError, match="was trained on another frozen part .from .*base.npz.: "):
        restore(trainer, step_dir, key, token_batch(1), base=start())
    with pytest.raises(zj.UserError, match="was trained on another frozen part than .*base.npz. now holds"):
        export_params(step_dir, str(tmp_path / "again.npz"))


def test_the_planner_counts_a_lora_config_as_the_step_keeps_it():
    """`zerojax plan configs/lora-tiny.yaml` at stage 3: the state the trainer really keeps per device,
    within 1% (the tiny norms it replicates are the difference)."""
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "zerojax.cli.main", "plan", "configs/lora-tiny.yaml", "--devices", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    planned = json.loads(r.stdout)["stages"][3]["kept_bytes_per_device"]
    model, _ = tiny_gpt(lora={"rank": 4, "alpha": 8})
    kept = _per_device_bytes(_trainer(model, 3, "shard_map").abstract_state(jax.random.key(0), token_batch(0)))
    assert abs(kept - planned) <= 0.01 * planned, (kept, planned)


@pytest.mark.parametrize("engine", ["gspmd", "shard_map"])
def test_grad_accumulation_keeps_no_accumulator_for_frozen_leaves(engine):
    """Stage 1, two micro-batches, fp32: each device would hold a whole fp32 accumulator per frozen
    leaf (2 MiB here); the compiled step's temporaries are a small fraction of that."""
    trainer = _trainer(WideLoRA, 1, engine, optax.adam(1e-3), loss_fn=_mse, grad_accum=2)
    temp = lower_abstract(trainer, _wide_batch()).compile().memory_analysis().temp_size_in_bytes
    frozen_fp32 = 4 * 2 * (512 * 512 + 512)
    assert temp < frozen_fp32 / 4, (temp, frozen_fp32)


COMPOSED = {
    "grad_accum": {"grad_accum": 2},
    "offload": {"offload": "optimizer"},
    "tensor": {"mesh": "tensor"},
    "quantized_gathers": {"engine": "shard_map", "engine_options": {"quantize_weights": "int8"}},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPOSED)
def test_gpt_lora_composes(name):
    """LoRA on the GPT at stage 3 with accumulation, offload, tensor parallelism (2 x fsdp 4) or
    int8 weight gathers (qwZ gathers the frozen base too): the base stays bit for bit, the losses
    track stage 0's (exactly but for qwZ's quantized weights)."""
    model, _ = tiny_gpt(lora={"rank": 4, "alpha": 8})
    choices = dict(COMPOSED[name])
    mesh = zj.make_mesh(fsdp=4, tensor=2) if choices.pop("mesh", None) else zj.make_mesh(fsdp=8)
    engine = choices.pop("engine", "gspmd")
    trainer = zj.Trainer(model, _adamw(), mesh=mesh, stage=3, engine=engine, **choices)
    losses, initial, final = trained(trainer, token_batch, STEPS)
    want, _, _ = _gpt_run(0, "gspmd")
    np.testing.assert_allclose(losses, want, rtol=2e-2 if name == "quantized_gathers" else 1e-5)
    for name in ("embed", "head"):
        np.testing.assert_array_equal(final[name], initial[name])
    np.testing.assert_array_equal(final["blocks"]["w_up"], initial["blocks"]["w_up"])
    assert not np.array_equal(final["blocks"]["up_lora_b"], initial["blocks"]["up_lora_b"])


def test_compares_analytic_figures_count_the_frozen_part():
    """`zerojax compare`'s ideal row for a LoRA trainer: the state it keeps (within 1%) and a gradient
    reduction of the adapters alone (one fp32 reduce-scatter of them at stage 3)."""
    from zerojax.accounting.measure import ideal

    model, cfg = tiny_gpt(lora={"rank": 4, "alpha": 8})
    trainer = _trainer(model, 3, "shard_map")
    kept = _per_device_bytes(trainer.init(jax.random.key(0), token_batch(0)))
    figures = ideal(trainer)
    assert abs(figures.persistent_bytes - kept) <= 0.01 * kept, (figures.persistent_bytes, kept)
    assert figures.grad_reduce_bytes == pytest.approx(4 * cfg.num_lora_params() * 7 / 8)


def test_an_own_jit_loop_trains_only_what_zj_shard_is_told_to():
    """`zj.shard(..., trainable=)` in a user's own `jax.jit` step: the losses are `Trainer`'s and the
    frozen layer stays bit for bit (stage 3, bf16: the frozen leaf is kept in bf16, no master)."""
    choices = dict(mesh=zj.make_mesh(fsdp=8), stage=3, precision="bf16", trainable="^hidden/")
    core = zj.shard(UnevenMLP, _adamw(), classification_batch(), **choices)
    state = core.init(jax.random.key(0))
    assert state.params["out"]["kernel"].dtype == jax.numpy.bfloat16
    frozen = np.asarray(jax.device_get(state.params["out"]["kernel"]))
    step = jax.jit(core.step, donate_argnums=0)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, core.shard_batch(classification_batch(i)))
        losses.append(float(metrics["loss"]))
    want, _, _ = trained(zj.Trainer(UnevenMLP, _adamw(), **choices), classification_batch, STEPS)
    np.testing.assert_allclose(losses, want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.device_get(state.params["out"]["kernel"])), frozen)


def test_zeropp_figures_reduce_only_what_trains():
    """Stage 3's traffic by axis (`zerojax plan`'s ZeRO++ section) with 1% trainable: the frozen part
    gathered over fsdp as any weight, the gradients reduced over fsdp and data the trainable part's."""
    from zerojax.accounting import zeropp

    params, trains = 7e9, 7e7
    full = zeropp.stage_3_traffic_by_axis(params, 2, 8, 2, 2)
    tuned = zeropp.stage_3_traffic_by_axis(params, 2, 8, 2, 2, trainable=trains)
    assert tuned["all-gather"] == full["all-gather"]
    assert tuned["reduce-scatter"]["fsdp"] == pytest.approx(full["reduce-scatter"]["fsdp"] / 100)
    assert tuned["all-reduce"]["data"] == pytest.approx(full["all-reduce"]["data"] / 100)


class PackedInt4MLP(nnx.Module):
    """A quantized checkpoint's layer as its authors write it: two signed int4 codes packed in each
    int8 of a frozen `nnx.Param`, unpacked by shifts (integer operations only), a scale per column."""

    def __init__(self, rngs: nnx.Rngs):
        self.packed = nnx.Param(jax.random.randint(rngs.params(), (20, 64), -128, 128).astype(jnp.int8))
        self.scale = nnx.Param(jnp.full((64,), 0.05))
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        codes = jnp.concatenate([jnp.left_shift(self.packed[...], 4) >> 4, self.packed[...] >> 4])[:37]
        return self.out(jax.nn.gelu(x @ (codes.astype(jnp.float32) * self.scale[...])))


def _packed_reference_losses(steps: int) -> list:
    """A plain optax loop training every leaf but the codes."""
    graphdef, codes, rest = nnx.split(PackedInt4MLP(nnx.Rngs(0)), nnx.PathContains("packed"), ...)
    tx, losses = optax.adam(1e-2), []
    opt_state = tx.init(rest)

    def loss(rest, batch):
        return cross_entropy(nnx.merge(graphdef, codes, rest)(batch["inputs"]), batch)

    for step in range(steps):
        value, grads = jax.value_and_grad(loss)(rest, classification_batch(step))
        updates, opt_state = tx.update(grads, opt_state, rest)
        rest = optax.apply_updates(rest, updates)
        losses.append(float(value))
    return losses


@pytest.mark.parametrize(
    "stage, engine, mesh",
    [(3, "gspmd", {"fsdp": 8}), (2, "shard_map", {"fsdp": 8}), (3, "shard_map", {"data": 2, "fsdp": 4})],
)
def test_a_frozen_integer_param_is_read_in_its_own_dtype(stage, engine, mesh):
    """Kept in the compute dtype, which holds int8 exactly, the codes reach the model as int8 again:
    gathered whole (stage 3), from stage 2's resident copy, and through hpZ's secondary copy."""
    options = {"hierarchical": True} if "data" in mesh else {}
    trainer = zj.Trainer(
        PackedInt4MLP,
        optax.adam(1e-2),
        mesh=zj.make_mesh(**mesh),
        stage=stage,
        engine=engine,
        trainable=r"(scale|kernel|bias)$",
        engine_options=options,
        replicate_below_bytes=0,
    )
    losses, before, after = trained(trainer, classification_batch, STEPS)
    np.testing.assert_allclose(losses, _packed_reference_losses(STEPS), rtol=1e-6)
    np.testing.assert_array_equal(after["packed"], before["packed"])
