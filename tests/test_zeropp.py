"""ZeRO++ in the shard_map engine: qwZ (quantized weight gathers), qgZ (quantized gradient
reduce-scatter) and hpZ (state over data x fsdp, a secondary copy over fsdp), their bytes on the
partitioned HLO, their losses, and the refusals."""

import functools
import math
import tempfile
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.models import tiny_gpt, token_batch
from tests.unit_models import DEEP, SHALLOW, block_bytes, unit_allowance, unit_batch, unit_model
from zerojax.accounting import measure
from zerojax.accounting.analytic import GPTShape, peak_bytes
from zerojax.accounting.hlo import axes_spanned, collective_bytes, collectives
from zerojax.accounting.partitioned import compile_partitioned
from zerojax.accounting.zeropp import ZeroPP, stage_3_traffic_by_axis, totals
from zerojax.cli.config import load_config
from zerojax.core.leaf_rule import LeafLayout
from zerojax.engines.quantize import Quantizer
from zerojax.errors import UserError

STEPS = 4


@pytest.mark.parametrize("kind, rel", [("int8", 0.5 / 127), ("fp8", 2.0**-4)])
def test_block_quantization_round_trip(kind, rel):
    q = Quantizer(kind, block=64)
    x = jax.random.normal(jax.random.key(1), (3, 200)) * jnp.array([[1e-3], [1.0], [50.0]])
    x = x.at[1, 64:128].set(0.0)  # an all-zero block stays zero
    codes, scale = q.quantize(x)
    assert codes.shape == (3, 4, 64) and scale.shape == (3, 4) and scale.dtype == jnp.float32
    back = q.dequantize(codes, scale, 200)
    absmax = jnp.repeat(jnp.abs(jnp.pad(x, ((0, 0), (0, 56)))).reshape(3, 4, 64).max(-1), 64, axis=-1)[:, :200]
    assert bool(jnp.all(jnp.abs(back - x) <= rel * absmax + 1e-12))
    assert bool(jnp.all(back[1, 64:128] == 0))


@functools.cache
def _run(data=1, precision="bf16", steps=STEPS, grad_accum=1, **options):
    """(collective bytes of the step's partitioned HLO, losses over `steps` steps); also kept in
    `_RUNS`: the HLO's collectives, the state's bytes per device and the sharded parameter count."""
    model, _ = tiny_gpt()
    mesh = zj.make_mesh(data=data, fsdp=8 // data)
    trainer = zj.Trainer(
        model,
        optax.adamw(3e-3),
        mesh=mesh,
        stage=3,
        engine="shard_map",
        precision=precision,
        engine_options=options or None,
        grad_accum=grad_accum,
    )
    state = trainer.init(jax.random.key(0), token_batch(0))
    # one compile serves the byte count and the steps
    step, hlo = compile_partitioned(
        trainer.lower(state, trainer.shard_batch(token_batch(0))), tempfile.mkdtemp(prefix="zerojax-hlo-")
    )
    sharded = _sharded_params(trainer)
    _RUNS[data, options.get("hierarchical", False), grad_accum] = SimpleNamespace(
        collectives=collectives(hlo),
        persistent=trainer.persistent_bytes_per_device(state),
        sharded=sharded,
        temp=step.memory_analysis().temp_size_in_bytes,
        mesh=mesh,
    )
    losses = []
    for i in range(steps):
        state, metrics = step(state, trainer.shard_batch(token_batch(i)))
        losses.append(float(metrics["loss"]))
    return collective_bytes(hlo, mesh=mesh), np.array(losses)


_RUNS = {}
_is_layout = lambda x: isinstance(x, LeafLayout)  # noqa: E731


def _sharded_params(trainer) -> int:
    return sum(
        math.prod(l.shape) for l in jax.tree.leaves(trainer.layout.leaves, is_leaf=_is_layout) if l.axis is not None
    )


def test_qwz_and_qgz_halve_the_bf16_bytes():
    """Acceptance: parameter-gather bytes <= 0.55x the bf16 stage-3 gather (scales included), and
    gradient-reduction bytes <= 0.55x the bf16 reduce-scatter, on the partitioned HLO."""
    base = _run()[0]["bytes"]
    both = _run(quantize_weights="int8", quantize_grads="int8")[0]["bytes"]
    assert base["all-to-all"] == 0
    assert both["all-gather"] <= 0.55 * base["all-gather"]
    assert both["reduce-scatter"] + both["all-to-all"] <= 0.55 * base["reduce-scatter"]
    # int8 codes plus one fp32 scale per 256: (1 + 4/256) / 2 of bf16, plus the small leaves' bf16
    assert both["all-gather"] / base["all-gather"] == pytest.approx((1 + 4 / 256) / 2, abs=0.01)


def test_quantized_losses_stay_close():
    base = _run()[1]
    for options in ({"quantize_weights": "int8", "quantize_grads": "int8"},):
        losses = _run(**dict(options))[1]
        np.testing.assert_allclose(losses, base, rtol=2e-3)
    assert base[-1] < base[0]


@pytest.mark.slow
def test_fp8_weights_move_the_same_bytes_as_int8():
    fp8, losses = _run(quantize_weights="fp8")
    assert fp8["bytes"]["all-gather"] == _run(quantize_weights="int8", quantize_grads="int8")[0]["bytes"]["all-gather"]
    np.testing.assert_allclose(losses, _run()[1], rtol=5e-3)


def _hpz_checks(traffic, run):
    """hpZ on data=2 x fsdp=4 (acceptance): no gather inside a loop (the layers' forward and
    backward) spans data; what crosses data is the once-per-step gather of the secondary copy and,
    in each layer's backward, the reduce-scatter of its gradient into the primary shard, each
    2 bytes x (sharded params) / fsdp x (data - 1) / data per step."""
    looped = [c for c in run.collectives if c.kind == "all-gather" and c.runs > 1]
    assert looped and all(axes_spanned(c.groups, run.mesh.shape) == "fsdp" for c in looped)
    across = [c for c in run.collectives if axes_spanned(c.groups, run.mesh.shape) == "data"]
    assert {c.kind for c in across} == {"all-gather", "reduce-scatter"}
    assert all(c.runs == 1 for c in across if c.kind == "all-gather")
    assert any(c.runs > 1 for c in across if c.kind == "reduce-scatter")  # per layer, not at the end
    model = 2 * run.sharded / 4 * (2 - 1) / 2
    assert traffic["by_kind_axis"]["all-gather"]["data"] == pytest.approx(model, rel=0.02)
    assert traffic["by_kind_axis"]["reduce-scatter"]["data"] == pytest.approx(model, rel=0.02)


@pytest.mark.slow  # each option alone is a default test
def test_hpz_with_qwz_and_qgz_on_data_fsdp_mesh():
    """data=2 x fsdp=4, all three together: the quantized gathers and all-to-alls span fsdp only,
    data carries only the copy's gather and the layers' reduce-scatters, and the state is sharded over
    all 8 devices."""
    traffic, losses = _run(data=2, hierarchical=True, quantize_weights="int8", quantize_grads="int8")
    axes = traffic["by_kind_axis"]
    assert set(axes["all-to-all"]) == {"fsdp"} and "data" not in axes.get("all-reduce", {})
    _hpz_checks(traffic, _RUNS[2, True, 1])
    np.testing.assert_allclose(losses, _run()[1], rtol=5e-3)


@pytest.mark.slow
def test_hpz_against_hybrid_sharding():
    """hpZ alone against plain stage 3 on the same data=2 x fsdp=4 mesh (state over fsdp only):
    the same fsdp bytes, the data all-reduce replaced by the copy's gather + the reduce-scatters (the same
    bytes), the state halved, the same losses."""
    base, base_losses = _run(data=2)
    hpz, losses = _run(data=2, hierarchical=True)
    _hpz_checks(hpz, _RUNS[2, True, 1])
    assert hpz["by_kind_axis"]["all-gather"]["fsdp"] == base["by_kind_axis"]["all-gather"]["fsdp"]
    data = hpz["by_kind_axis"]["all-gather"]["data"] + hpz["by_kind_axis"]["reduce-scatter"]["data"]
    assert data == pytest.approx(base["by_kind_axis"]["all-reduce"]["data"], rel=0.01)
    assert _RUNS[2, True, 1].persistent == pytest.approx(_RUNS[2, False, 1].persistent / 2, rel=0.01)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-3)


def _peak_and_state(data, rows, **options):
    """(the compiled step's peak bytes per device, state bytes per device, sharded parameter count)
    for stage 3 on a 4-layer GPT of width 256, bf16, on data x fsdp = 8 devices."""
    model, _ = tiny_gpt(d_model=256, n_layers=4, d_ff=1024)
    trainer = zj.Trainer(
        model,
        optax.adamw(3e-3),
        mesh=zj.make_mesh(data=data, fsdp=8 // data),
        stage=3,
        engine="shard_map",
        precision="bf16",
        engine_options=options or None,
    )
    state = trainer.init(jax.random.key(0), token_batch(0, rows=rows))
    m = trainer.lower(state, trainer.shard_batch(token_batch(0, rows=rows))).compile().memory_analysis()
    peak = peak_bytes(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes)
    return peak, trainer.persistent_bytes_per_device(state), _sharded_params(trainer)


def test_hpz_memory_rises_by_the_secondary_copy():
    """Acceptance: on data=2 x fsdp=4, hpZ's compiled peak is ZeRO-3's over all 8 devices (the same
    primary partition, the same state) plus the secondary copy, 2 bytes x (sharded params) / 4,
    within 5%: 0.970x the copy measured with 8, 32 and 64 rows of 32 tokens (before the two fixes in
    docs/zeropp.md it was 1.3-2.2x). Where the peak falls elsewhere than the layers' passes the rise
    differs (48 rows: 1.12x; see docs/zeropp.md)."""
    base, base_state, sharded = _peak_and_state(1, rows=32)
    hpz, hpz_state, _ = _peak_and_state(2, rows=32, hierarchical=True)
    assert hpz_state == base_state
    assert hpz - base == pytest.approx(2 * sharded / 4, rel=0.05)


def _unit_route_temp(depth, **options):
    """(temp bytes per device, first loss) of stage 3 on a user NNX model of `depth` blocks (FSDP
    units), fp32, on data=2 x fsdp=4."""
    trainer = zj.Trainer(
        unit_model("nnx", 256, depth),
        optax.sgd(1e-2),
        mesh=zj.make_mesh(data=2, fsdp=4),
        stage=3,
        engine="shard_map",
        precision="fp32",
        engine_options=options or None,
    )
    batch = unit_batch(256)
    state = trainer.init(jax.random.key(0), batch)
    step = trainer.compile(state, batch)
    assert trainer.gather_report().route == "units"
    return step.memory_analysis().temp_size_in_bytes, float(step(state, trainer.shard_batch(batch))[1]["loss"])


def test_hpz_on_a_user_models_units():
    """hpZ on FSDP units (a user NNX model): the same loss as plain stage 3 on the mesh, and each
    added block grows temp by its secondary copy (a quarter of the fp32 block here) plus the units'
    own bound (0.15 of a block and its saved input): each unit's gathers stay tied to its input and
    cotangent. Untied (the secondary copy skipped by `zerojax.adapt.ordering.tie`), every gathered block was kept:
    1.0 block per block."""
    (shallow, loss), (deep, _) = _unit_route_temp(SHALLOW, hierarchical=True), _unit_route_temp(DEEP, hierarchical=True)
    assert loss == pytest.approx(_unit_route_temp(SHALLOW)[1], rel=1e-6)
    block, added = block_bytes(256), DEEP - SHALLOW
    assert deep - shallow <= added * (block / 4 + unit_allowance(256, 4)), (deep - shallow) / block / added


def test_refusals():
    model, _ = tiny_gpt()
    mesh = zj.make_mesh(fsdp=8)
    make = lambda stage, engine, **o: zj.Trainer(
        model,
        optax.adamw(1e-3),
        mesh=mesh,
        stage=stage,  # noqa: E731
        engine=engine,
        engine_options=o,
    ).init(jax.random.key(0), token_batch(0))
    with pytest.raises(UserError, match="gspmd engine does not support the option quantize_weights"):
        make(3, "gspmd", quantize_weights="int8")
    with pytest.raises(UserError, match="gspmd engine does not support the option quantize_grads"):
        make(3, "gspmd", quantize_grads="int8")
    with pytest.raises(UserError, match="stage 2 has none"):
        make(2, "shard_map", quantize_weights="int8")
    with pytest.raises(UserError, match="stage 0 all-reduces"):
        make(0, "shard_map", quantize_grads="int8")
    with pytest.raises(UserError, match="int4"):
        make(3, "shard_map", quantize_weights="int4")
    with pytest.raises(UserError, match="gspmd engine does not support the option hierarchical"):
        make(3, "gspmd", hierarchical=True)
    with pytest.raises(UserError, match="zero.hierarchical"):
        zj.Trainer(
            model, optax.adamw(1e-3), mesh=mesh, stage=2, engine="shard_map", engine_options={"hierarchical": True}
        ).init(jax.random.key(0), token_batch(0))


def test_config_keys():
    c = load_config(
        "configs/tiny.yaml",
        ["zero.engine=shard_map", "zero.quantize_weights=int8", "zero.quantize_grads=int8", "zero.quantize_block=128"],
    )
    assert (c.zero.quantize_weights, c.zero.quantize_grads, c.zero.quantize_block) == ("int8", "int8", 128)
    assert load_config("configs/tiny.yaml", ["zero.hierarchical=true"]).zero.hierarchical is True
    with pytest.raises(UserError, match="zero.quantize_grads"):
        load_config("configs/tiny.yaml", ["zero.quantize_grads=int4"])
    with pytest.raises(UserError, match="zero.quantize_block"):
        load_config("configs/tiny.yaml", ["zero.quantize_block=0"])


@pytest.mark.parametrize(
    "data,options",
    [
        (1, {}),
        (1, {"quantize_weights": "int8", "quantize_grads": "int8"}),
        (2, {"hierarchical": True, "quantize_weights": "int8", "quantize_grads": "int8"}),
        (2, {"grad_accum": 2, "quantize_weights": "int8"}),
        pytest.param(2, {}, marks=pytest.mark.slow),
        pytest.param(2, {"hierarchical": True}, marks=pytest.mark.slow),
        pytest.param(2, {"reshard_after_forward": False}, marks=pytest.mark.slow),
    ],
)
def test_analytic_model_matches_every_kind_and_axis(data, options):
    """`accounting.zeropp.stage_3_traffic_by_axis` against the partitioned HLO, within 2% for every
    collective kind on the fsdp and data axes (the replicated leaves' all-reduce over both is not
    modelled: it is the only other entry). The tiny GPT's embedding, final norm and head sit outside
    its layer stack: gathered once."""
    traffic = _run(data=data, **options)[0]["by_kind_axis"]
    k = options.get("grad_accum", 1)
    run = _RUNS[data, options.get("hierarchical", False), k]
    zpp = ZeroPP(
        options.get("quantize_weights"), options.get("quantize_grads"), 256, options.get("hierarchical", False)
    )
    cfg = tiny_gpt()[1]
    once = 2 * cfg.vocab_size * cfg.d_model + cfg.d_model
    model = stage_3_traffic_by_axis(
        run.sharded, data, 8 // data, 2, 2, zpp, k, once, options.get("reshard_after_forward", True)
    )
    for kind, axes in model.items():
        for axis, want in axes.items():
            assert traffic[kind][axis] == pytest.approx(want, rel=0.02), (kind, axis)
    unmodelled = {(k, a): v for k, axes in traffic.items() for a, v in axes.items() if a not in model.get(k, {})}
    assert sum(unmodelled.values()) <= 0.02 * totals(model)["total"], unmodelled


def test_compare_rows_model_zeropp_per_axis():
    """`zerojax compare`'s ideal for a ZeRO++ run is the per-axis model, so its collective ratio is
    about 1 (int8 gathers and reductions, hpZ on data=2 x fsdp=4), not the plain bf16 figure's ~0.5."""
    model, cfg = tiny_gpt()
    options = {"hierarchical": True, "quantize_weights": "int8", "quantize_grads": "int8"}
    trainer = zj.Trainer(
        model,
        optax.adamw(3e-3),
        mesh=zj.make_mesh(data=2, fsdp=4),
        stage=3,
        engine="shard_map",
        precision="bf16",
        engine_options=options,
    )
    state = trainer.init(jax.random.key(0), token_batch(0))
    m, _ = measure.measure_step(
        trainer, state, trainer.shard_batch(token_batch(0)), shape=GPTShape.of(cfg), seq_len=cfg.seq_len
    )
    row = m.row()
    assert row["collective_ratio"] == pytest.approx(1.0, abs=0.03)
    for kind, axes in row["ideal_collective_bytes_by_kind_axis"].items():
        for axis, want in axes.items():
            assert row["collective_bytes_by_kind_axis"][kind][axis] == pytest.approx(want, rel=0.02), (kind, axis)
