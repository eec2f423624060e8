"""The planner's picks (`zerojax plan CONFIG --memory BYTES`): stage x accumulation x offload x remat,
ranked, checked against compiled steps on 8 simulated CPU devices.

A combination the planner says fits compiles with a peak (`memory_analysis`: arguments + outputs -
aliased + temporaries) within 15% of its prediction, and the fastest one it rejects compiles above
the budget. On CPU only offload "none" and remat none/dots/full are compiled (XLA:CPU places no
host memory; `zero.offload` is not part of this checkout's config); offload is checked as arithmetic.
"""

import functools
import json

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax as zj
from tests.cli_helpers import assert_one_line_error, cli_in_process
from zerojax.accounting import analytic as A
from zerojax.accounting import picks
from zerojax.accounting.activations import GPTShape
from zerojax.accounting.hardware import get_hardware
from zerojax.cli.config import load_config
from zerojax.core.optim import get_optimizer
from zerojax.core.precision import get_precision
from zerojax.core.remat import REMAT_POLICIES
from zerojax.models.gpt import GPT, gpt_config

P = 8
ADAMW = get_optimizer("adamw")
CPU_RUNS = dict(remats=("none", "dots", "full"), offloads=("none",))


def _rank(shape_kw, rows, memory, precision="fp32", **kw):
    cfg = gpt_config("20m", **shape_kw)
    return picks.rank(
        cfg.num_params(),
        P,
        get_hardware("h100"),
        rows_per_device=rows,
        seq_len=cfg.seq_len,
        precision=get_precision(precision),
        optimizer=ADAMW,
        shape=GPTShape.of(cfg),
        memory=memory,
        **kw,
    )


def _compiled_peak(shape_kw, pick, rows) -> int:
    cfg = gpt_config("20m", **shape_kw, remat=pick.remat)
    trainer = zj.Trainer(
        functools.partial(GPT, cfg),
        optax.adamw(1e-3),
        mesh=zj.make_mesh(fsdp=P),
        stage=pick.stage,
        grad_accum=pick.grad_accum,
    )
    batch = {k: jax.ShapeDtypeStruct((rows * P, cfg.seq_len), jnp.int32) for k in ("inputs", "targets")}
    prep = trainer.prepare(jax.random.key(0), batch)  # abstract: nothing allocated
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding) for k, v in batch.items()}
    ma = prep.step_fn.lower(prep.abstract, batch).compile().memory_analysis()
    return A.peak_bytes(
        ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes, ma.temp_size_in_bytes
    )


# (GPT shape, sequences per device per step, device budget): small GPTs where the budget rules out
# the fastest combinations, so the planner has to trade.
CASES = {
    "2x256": (dict(d_model=256, n_layers=2, n_heads=4, d_ff=768, seq_len=128), 8, 40e6),
    "4x256": (dict(d_model=256, n_layers=4, n_heads=4, d_ff=768, seq_len=128), 8, 60e6),
    "2x384": (dict(d_model=384, n_layers=2, n_heads=6, d_ff=1024, seq_len=128), 4, 70e6),
}


@pytest.mark.parametrize(
    "case", ["2x256", pytest.param("4x256", marks=pytest.mark.slow), pytest.param("2x384", marks=pytest.mark.slow)]
)
def test_best_fit_compiles_within_its_prediction_and_a_rejected_one_exceeds_the_budget(case):
    shape_kw, rows, budget = CASES[case]
    ranked = _rank(shape_kw, rows, budget, **CPU_RUNS)
    best = ranked[0]
    rejected = next(p for p in ranked if not p.fits)  # the fastest combination that does not fit
    assert best.fits and 0 < sum(p.fits for p in ranked) < len(ranked)
    peak = _compiled_peak(shape_kw, best, rows)
    assert peak == pytest.approx(best.device_peak_bytes, rel=0.15), (best, peak)
    assert peak <= budget
    assert _compiled_peak(shape_kw, rejected, rows) > budget, rejected


def test_offload_moves_master_and_moments_to_the_host():
    psi, bf16 = 7e9, get_precision("bf16")
    for stage, share in ((0, 1), (1, 1 / 8), (3, 1 / 8)):
        plain = picks.placed_state_bytes(psi, 8, stage, bf16, ADAMW, "none")
        moved = picks.placed_state_bytes(psi, 8, stage, bf16, ADAMW, "optimizer")
        assert moved["host"] == pytest.approx(12 * psi * share)  # fp32 master + Adam's two moments
        assert plain["device"] - moved["device"] == pytest.approx(moved["host"]) and plain["host"] == 0
    # optimizer+params also moves the bf16 compute copy stages 0-2 keep; fp32's params are the master
    assert picks.placed_state_bytes(psi, 8, 2, bf16, ADAMW, "optimizer+params")["host"] == pytest.approx(
        12 * psi / 8 + 2 * psi
    )
    assert picks.host_groups("optimizer", get_precision("fp32")) == ("master", "optimizer", "compute_params")


def test_offload_and_remat_trade_device_bytes_for_host_link_time():
    h100, bf16 = get_hardware("h100"), get_precision("bf16")
    cfg = gpt_config("7b")
    common = dict(
        stage=3, grad_accum=1, micro_batch=4, seq_len=2048, precision=bf16, optimizer=ADAMW, shape=GPTShape.of(cfg)
    )
    by = {
        (o, r): picks.evaluate(cfg.num_params(), 8, h100, offload=o, remat=r, **common)
        for o in ("none", "optimizer")
        for r in REMAT_POLICIES
    }
    device = {r: by["none", r].device_peak_bytes for r in REMAT_POLICIES}
    assert device["none"] > device["dots"] > device["full"] == device["offload"]
    assert by["none", "offload"].host_activation_bytes > 0 and by["none", "dots"].host_activation_bytes == 0
    assert by["none", "offload"].host_s > 0 == by["none", "dots"].host_s
    # recompute: full re-runs the layers' forward; dots and offload only attention
    assert by["none", "full"].compute_s > by["none", "dots"].compute_s == by["none", "offload"].compute_s
    assert by["none", "dots"].compute_s > by["none", "none"].compute_s
    opt = by["optimizer", "full"]
    assert opt.host_state_bytes == pytest.approx(12 * cfg.num_params() / 8)
    assert opt.host_link_bytes == pytest.approx(opt.host_state_bytes)  # in and out once per step
    assert opt.host_s == pytest.approx(opt.host_state_bytes / h100.host_bytes_per_s)


def test_accumulation_splits_the_rows_and_stage_3_pays_per_micro_batch():
    ranked = _rank(CASES["2x256"][0], 8, 1e12)
    assert {p.grad_accum for p in ranked} == {1, 2, 4, 8}
    assert all(p.grad_accum * p.micro_batch == 8 for p in ranked)
    s3 = {
        p.grad_accum: p.collective_bytes for p in ranked if p.stage == 3 and p.offload == "none" and p.remat == "full"
    }
    assert s3[4] == pytest.approx(4 * s3[1])
    s1 = {
        p.grad_accum: p.collective_bytes for p in ranked if p.stage == 1 and p.offload == "none" and p.remat == "full"
    }
    assert s1[4] == s1[1]


def test_plan_cli_ranks_and_prints_the_overrides_of_the_best():
    r = cli_in_process("plan", "configs/tiny.yaml", "--devices", "8", "--memory", "2MB", "--headroom", "0", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["memory_bytes"] == 2e6 and out["rows_per_device"] == 2
    assert all(p["memory_bytes"] == 2e6 for p in out["picks"])
    ranked = out["picks"]
    assert {(p["offload"], p["remat"]) for p in ranked} >= {("optimizer", "offload"), ("none", "none")}
    assert all(p["fits"] for p in ranked[:1]) and not ranked[-1]["fits"]
    assert [p["step_s"] for p in ranked if p["fits"]] == sorted(p["step_s"] for p in ranked if p["fits"])
    best = out["best"]
    assert best["overrides"] == ranked[0]["overrides"]
    if ranked[0]["offload"] == "none":  # zero.offload is set only when on
        c = load_config("configs/tiny.yaml", best["overrides"])
        assert (c.zero.stage, c.train.grad_accum, c.model.remat) == (
            ranked[0]["stage"],
            ranked[0]["grad_accum"],
            ranked[0]["remat"],
        )
    table = cli_in_process("plan", "configs/tiny.yaml", "--devices", "8", "--memory", "2MB")
    assert "Recommendation: --set zero.stage=" in table.stdout, table.stdout[-2000:]
    assert "less 10% headroom" in table.stdout


@pytest.mark.parametrize(
    "flag, value",
    [("--memory", "lots"), ("--memory", "-3GB"), ("--memory", "0"), ("--host-memory", "x"), ("--headroom", "1.5")],
)
def test_bad_budgets_are_one_line_errors(flag, value):
    assert_one_line_error(cli_in_process("plan", "--params", "7e9", "--devices", "8", flag, value), flag)


def test_host_memory_rules_out_offload_that_does_not_fit_on_the_host():
    cfg = gpt_config("7b")
    kw = dict(rows_per_device=4, seq_len=2048, precision=get_precision("bf16"), optimizer=ADAMW, shape=GPTShape.of(cfg))
    free = picks.rank(cfg.num_params(), 8, get_hardware("h100"), **kw)
    tight = picks.rank(cfg.num_params(), 8, get_hardware("h100"), host_memory=5e9, **kw)
    assert any(p.fits and p.host_bytes > 5e9 for p in free)
    assert not any(p.fits and p.host_bytes > 5e9 for p in tight)


def test_stage_3_without_remat_counts_the_gathered_weights_its_backward_reuses():
    """Nothing recomputed: each layer's weights gathered in the forward are kept for its backward, so
    stage 3 holds the whole model gathered (param_bytes per parameter), which the planner counts.
    One sequence per device, so the weights (53 MB) outweigh the activations: without them the
    prediction was 0.54x the compiled peak."""
    shape_kw = dict(d_model=512, n_layers=4, n_heads=8, d_ff=1536, seq_len=128)
    by = {(p.stage, p.grad_accum, p.remat): p for p in _rank(shape_kw, 1, 1e9, **CPU_RUNS)}
    none, full = by[3, 1, "none"], by[3, 1, "full"]
    assert none.device_peak_bytes - full.device_peak_bytes >= 4 * gpt_config("20m", **shape_kw).num_params()
    assert _compiled_peak(shape_kw, none, 1) == pytest.approx(none.device_peak_bytes, rel=0.15)
