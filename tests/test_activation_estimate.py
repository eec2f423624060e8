"""The planner's activation estimate against XLA's memory analysis, and `zerojax plan CONFIG`."""

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax as zj
from tests.cli_helpers import REPO, assert_one_line_error, cli_in_process
from zerojax.accounting import measure
from zerojax.accounting.activations import GPTShape, activation_bytes_gpt, gpt_activation_bytes
from zerojax.models.gpt import GPT, gpt_config

P = 8


@pytest.mark.parametrize("preset, seq, batch", [("tiny", 64, 16), ("20m", 128, 128), ("50m", 256, 32)])
def test_activation_estimate_within_15_percent_at_stage_0(preset, seq, batch):
    # fp32: XLA:CPU computes bf16 matmuls in f32, so its bf16 temporaries are not what a GPU keeps.
    cfg = gpt_config(preset, seq_len=seq)
    trainer = zj.Trainer(functools.partial(GPT, cfg), optax.adamw(1e-3), mesh=zj.make_mesh(fsdp=P), stage=0)
    abstract = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in ("inputs", "targets")}
    trainer.abstract_state(jax.random.key(0), abstract)  # layout only: no parameters allocated
    measured = measure.activation_temp_bytes(trainer, abstract)
    estimate = activation_bytes_gpt(
        cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size, seq, batch // P, 4, cfg.remat
    )
    assert estimate == pytest.approx(measured, rel=0.15), (estimate, measured)


def test_activation_estimate_follows_fewer_key_value_heads():
    # Under remat "dots" the saved k and v are as wide as the key/value heads: a fall from 8 to 2 of
    # them frees what the estimate says it does (a 3-layer 20M GPT, fp32).
    seq, batch, out = 128, 64, {}
    abstract = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in ("inputs", "targets")}
    for kv_heads in (8, 2):
        cfg = gpt_config("20m", seq_len=seq, n_layers=3, n_kv_heads=kv_heads, remat="dots")
        trainer = zj.Trainer(functools.partial(GPT, cfg), optax.sgd(1e-3), mesh=zj.make_mesh(fsdp=P), stage=0)
        trainer.abstract_state(jax.random.key(0), abstract)
        estimate = gpt_activation_bytes(GPTShape.of(cfg), seq, batch // P, 4, cfg.remat)
        out[kv_heads] = (measure.activation_temp_bytes(trainer, abstract), estimate)
    measured_drop, estimated_drop = (out[8][i] - out[2][i] for i in range(2))
    assert estimated_drop == pytest.approx(measured_drop, rel=0.25), (estimated_drop, measured_drop)
    assert out[2][1] == pytest.approx(out[2][0], rel=0.15)


def _plan_with_rss(*args) -> tuple[dict, int]:
    """`zerojax plan ... --json` in a fresh process: (its JSON, its peak resident set in bytes)."""
    # VmHWM, not ru_maxrss: the latter keeps the forking parent's (this test process's) peak across exec.
    code = (
        "import re, sys; from zerojax.cli.main import main; rc = main(sys.argv[1:]); "
        "hwm = re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1); "
        "sys.stderr.write(f'RSS {hwm}\\n'); sys.exit(rc)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "plan", *args, "--json"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rss = int(r.stderr.strip().splitlines()[-1].split()[1]) * 1024  # Linux reports KiB
    return json.loads(r.stdout), rss


SEVENTY_B = [
    "--set",
    "model.preset=7b",
    "--set",
    "model.d_model=8192",
    "--set",
    "model.n_layers=80",
    "--set",
    "model.n_heads=64",
    "--set",
    "model.d_ff=24576",
]


@pytest.mark.parametrize(
    "name, overrides, devices", [("7b", ["--set", "model.preset=7b"], "8"), ("70b", SEVENTY_B, "64")]
)
def test_plan_from_config_counts_params_without_allocating(name, overrides, devices):
    out, rss = _plan_with_rss("configs/tiny.yaml", *overrides, "--set", "precision=bf16", "--devices", devices)
    cfg = gpt_config("7b") if name == "7b" else gpt_config("7b", d_model=8192, n_layers=80, n_heads=64, d_ff=24576)
    assert out["params"] == cfg.num_params()  # counted on jax.eval_shape of the model
    assert out["params"] > (6e9 if name == "7b" else 69e9)
    assert rss < 2**30, rss  # a 7B model's fp32 params alone would be 26 GB
    assert out["devices"] == int(devices) and out["seq_len"] == 2048
    # tiny.yaml's global batch of 16 over the devices, at least one sequence each
    assert out["micro_batch"] == max(1, 16 // int(devices))
    act = activation_bytes_gpt(
        cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size, 2048, out["micro_batch"], 2, "full"
    )
    assert [s["activation_bytes_per_device"] for s in out["stages"]] == [act] * 4
    assert out["stages"][3]["persistent_bytes_per_device"] == pytest.approx(16 * out["params"] / int(devices))


def test_plan_config_flags_override_the_config():
    out, _ = _plan_with_rss(
        "configs/tiny.yaml",
        "--devices",
        "8",
        "--seq",
        "32",
        "--micro-batch",
        "4",
        "--precision",
        "bf16",
        "--optimizer",
        "sgd",
    )
    assert (out["seq_len"], out["micro_batch"], out["precision"], out["optimizer"]) == (32, 4, "bf16", "sgd")
    assert out["config"]["params_counted_with"] == "jax.eval_shape" and out["params"] == 115008


@pytest.mark.parametrize(
    "args, needles",
    [
        (["configs/tiny.yaml"], ["--devices", "mesh.fsdp"]),
        (["configs/tiny.yaml", "--params", "7e9", "--devices", "8"], ["either CONFIG or --params"]),
        (["configs/none.yaml", "--devices", "8"], ["configs/none.yaml", "--params"]),
        (["configs/tiny.yaml", "--devices", "8", "--set", "model.n_heads=3"], ["model.d_model"]),
        (["--params", "7e9", "--devices", "8", "--set", "model.preset=7b"], ["--set needs a CONFIG"]),
    ],
)
def test_plan_config_bad_input_exits_2_with_one_line(args, needles):
    assert_one_line_error(cli_in_process("plan", *args), *needles)
