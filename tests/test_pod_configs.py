"""The GPU and TPU pod configs: valid configs, meshes of the intended size, and state that fits.

None of them is run here; the planner (`zerojax.accounting.analytic`) checks that the chosen stage
fits in the accelerator's memory, and XLA itself checks that the GPU flags exist.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from zerojax.accounting import planning
from zerojax.accounting.activations import GPTShape
from zerojax.accounting.hardware import get_hardware
from zerojax.cli import main as cli
from zerojax.cli.config import load_config
from zerojax.cli.experiment import model_config
from zerojax.core.optim import get_optimizer
from zerojax.core.precision import get_precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# config -> (hardware, devices in all, processes (hosts), parameter-count class)
PODS = {
    "gpu-1b-8xh100.yaml": ("h100", 8, 1, (0.9e9, 1.2e9)),
    "gpu-7b-64xh100.yaml": ("h100", 64, 8, (6e9, 8e9)),
    "tpu-7b-v5p-128.yaml": ("tpu-v5p", 64, 16, (6e9, 8e9)),
    "gpu-70b-64xh100.yaml": ("h100", 64, 8, (6.5e10, 7.5e10)),
    "gpu-8b-lora-8xh100.yaml": ("h100", 8, 1, (8e9, 9.5e9)),
    "gpu-405b-512xh100.yaml": ("h100", 512, 64, (4e11, 4.2e11)),
}
PIPELINED = {"gpu-405b-512xh100.yaml"}  # planned by the pipeline section: tests/test_pipeline_plan.py
PLANNER_PICKED = {"gpu-8b-lora-8xh100.yaml"}  # stage, accumulation and remat as `zerojax plan` picks them


def _path(name: str) -> str:
    return os.path.join(ROOT, "configs", name)


def test_every_pod_config_is_checked_here():
    found = {os.path.basename(p) for p in glob.glob(_path("gpu-*.yaml")) + glob.glob(_path("tpu-*.yaml"))}
    assert found == set(PODS)


@pytest.mark.parametrize("name", sorted(set(PODS) - PIPELINED))
def test_pod_config_validates_and_its_stage_fits(name, capsys):
    hardware, devices, hosts, (low, high) = PODS[name]
    c = load_config(_path(name))  # full validation, as `zerojax train` does before starting JAX
    params = model_config(c).num_params()
    assert low <= params <= high
    assert c.mesh.fsdp is not None and c.mesh.data * c.mesh.fsdp * c.mesh.tensor == devices
    assert devices % hosts == 0
    # With a tensor axis, each device keeps 1/(fsdp x tensor) of the state and 1/tensor of its group's
    # rows' work: planned as fsdp x tensor shards of one row each.
    shards, dp = c.mesh.fsdp * c.mesh.tensor, c.mesh.data * c.mesh.fsdp * c.mesh.tensor
    assert c.train.batch_size % dp == 0
    micro_batch = c.train.batch_size // dp // c.train.grad_accum
    gpt = model_config(c)
    trains = gpt.num_lora_params()  # a LoRA config: the adapters alone train

    # The planner's CLI, as a user would ask it: state only, sharded over the fsdp axis.
    assert (
        cli.main(
            [
                "plan",
                "--params",
                str(params),
                "--devices",
                str(shards),
                "--hardware",
                hardware,
                "--seq",
                str(gpt.seq_len),
                "--micro-batch",
                str(micro_batch),
                "--grad-accum",
                str(c.train.grad_accum),
                "--precision",
                c.precision,
                "--optimizer",
                c.optimizer.name,
                *(["--trainable", str(trains / params)] if trains else []),
                "--json",
            ]
        )
        == 0
    )
    stages = {s["stage"]: s for s in json.loads(capsys.readouterr().out)["stages"]}
    assert stages[c.zero.stage]["fits"]

    # Stricter: with this model's activations at this micro-batch and remat policy.
    plan = planning.plan(
        params,
        shards,
        get_hardware(hardware),
        gpt.seq_len,
        micro_batch,
        precision=get_precision(c.precision),
        optimizer=get_optimizer(c.optimizer.name),
        shape=GPTShape(gpt.d_model, gpt.n_layers, gpt.n_heads, gpt.d_ff, gpt.vocab_size),
        remat=gpt.remat,
        grad_accum=c.train.grad_accum,
        trainable=trains or None,
    )
    row = plan.stages[c.zero.stage]
    assert row.fits
    # Hand-picked configs leave half the memory free; the planner's pick its own 10% headroom.
    headroom = 0.9 if name in PLANNER_PICKED else 0.5
    assert row.memory["total"] + row.activation_bytes < headroom * get_hardware(hardware).hbm_bytes


@pytest.mark.parametrize("name", sorted(PLANNER_PICKED))
def test_the_config_is_the_planners_pick(name):
    r = subprocess.run(
        [sys.executable, "-m", "zerojax.cli.main", "plan", _path(name), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    c = load_config(_path(name))
    picked = json.loads(r.stdout)["best"]["overrides"]
    assert picked == [
        f"zero.stage={c.zero.stage}",
        f"train.grad_accum={c.train.grad_accum}",
        f"model.remat={c.model.remat}",
    ]


def test_the_64_gpu_config_is_hybrid_stage_3():
    c = load_config(_path("gpu-7b-64xh100.yaml"))
    # Sharded within a host (8 GPUs on NVLink), replicated across the 8 hosts.
    assert (c.zero.stage, c.mesh.data, c.mesh.fsdp) == (3, 8, 8)


@pytest.mark.parametrize("name", sorted(PODS))
def test_pod_config_sets_the_scheduler_and_async_collective_flags(name):
    c = load_config(_path(name))
    if name.startswith("gpu-"):
        assert c.xla.libtpu_flags == []
        flags = c.xla.flags
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
        assert "--xla_gpu_enable_pipelined_all_gather=true" in flags
        assert "--xla_gpu_enable_pipelined_reduce_scatter=true" in flags
    else:
        assert c.xla.flags == []  # XLA_FLAGS never reaches libtpu
        flags = c.xla.libtpu_flags
        assert "--xla_tpu_enable_latency_hiding_scheduler=true" in flags
        assert "--xla_tpu_enable_async_collective_fusion=true" in flags
        assert "--xla_tpu_enable_async_collective_fusion_multiple_steps=true" in flags
    assert len(flags) == len(set(flags))


def test_gpu_flags_exist_in_this_xla():
    """XLA aborts on an unknown XLA_FLAGS entry (a typo, or a flag removed in this version)."""
    flags = sorted({f for name in PODS if name.startswith("gpu-") for f in load_config(_path(name)).xla.flags})
    code = (
        "from zerojax.cli import distributed\n"
        f"distributed.apply_compiler_flags({flags!r}, [])\n"
        "import jax, jax.numpy as jnp\n"
        "print(float(jax.jit(lambda x: (x * 2).sum())(jnp.ones(4))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**env, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0 and done.stdout.strip() == "8.0", done.stderr[-2000:]
