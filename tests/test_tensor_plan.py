"""`zerojax plan`'s FSDP x tensor search: tensor parallelism pays where stage 3's traffic of the whole
model outweighs the compute of few tokens per device, and the pod configs carry what it picks."""

from __future__ import annotations

import json

import pytest

from tests.cli_helpers import cli_in_process
from zerojax.accounting import analytic, tensor_plan
from zerojax.accounting.activations import GPTShape
from zerojax.accounting.hardware import get_hardware
from zerojax.cli.config import load_config
from zerojax.core.optim import OPTIMIZERS
from zerojax.core.precision import PRECISIONS

SHAPE_70B = GPTShape(8192, 80, 64, 24576)
PARAMS_70B = 69.8e9


HARDWARE = {"configs/gpu-70b-64xh100.yaml": "h100", "configs/tpu-7b-v5p-128.yaml": "tpu-v5p"}


def _plan(config: str) -> dict:
    r = cli_in_process("plan", config, "--hardware", HARDWARE[config], "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)["tensor_parallel"]


@pytest.mark.parametrize("config", sorted(HARDWARE))
def test_the_pod_configs_use_the_tensor_size_the_planner_picks(config):
    section, c = _plan(config), load_config(config)
    assert section["pick"]["tensor"] == c.mesh.tensor and section["pick"]["fsdp"] == c.mesh.fsdp
    assert section["crossover_tokens_per_device"] is not None
    pays = section["tokens_per_device"] < section["crossover_tokens_per_device"]
    assert pays == (c.mesh.tensor > 1)


def test_the_70b_pod_picks_tensor_parallelism_and_the_crossover_separates_the_choices():
    section = _plan("configs/gpu-70b-64xh100.yaml")
    assert section["devices"] == 64 and section["devices_per_node"] == 8 and section["pick"]["tensor"] > 1
    cross = section["crossover_tokens_per_device"]
    h100 = get_hardware("h100")
    below = tensor_plan.best(tensor_plan.options(PARAMS_70B, 64, h100, SHAPE_70B, 0.9 * cross, 0.45))
    above = tensor_plan.best(tensor_plan.options(PARAMS_70B, 64, h100, SHAPE_70B, 1.1 * cross, 0.45))
    assert below.tensor > 1 and above.tensor == 1


def test_the_fsdp_term_is_stage_3_traffic_of_one_tensor_slice():
    h100 = get_hardware("h100")
    one, four = (tensor_plan.option(t, PARAMS_70B, 64, h100, SHAPE_70B, 4096, 0.45, "full") for t in (1, 4))
    stage_3 = analytic.traffic_bytes(PARAMS_70B, 64, 3, 2)["total"]
    assert one.fsdp_s == pytest.approx(stage_3 / 50e9)  # between nodes: one 400 Gb/s NIC per GPU
    assert four.fsdp_s == pytest.approx(analytic.traffic_bytes(PARAMS_70B / 4, 16, 3, 2)["total"] / 50e9)
    assert one.tensor_s == 0 and four.tensor_s > 0 and four.compute_s == one.compute_s
    double = tensor_plan.option(4, PARAMS_70B, 64, h100, SHAPE_70B, 8192, 0.45, "full")
    assert double.tensor_s == pytest.approx(2 * four.tensor_s)  # activations grow with the tokens


def test_a_frozen_model_keeps_and_moves_as_the_analytic_model_says():
    """1% trainable: the state is the fine-tuning stage-3 textbook state, the fsdp term stage 3's
    traffic with the frozen part gathered but never reduced."""
    h100, trains = get_hardware("h100"), 0.01 * PARAMS_70B
    one = tensor_plan.option(1, PARAMS_70B, 64, h100, SHAPE_70B, 4096, 0.45, "full", trains)
    bf16, adamw = PRECISIONS["bf16"], OPTIMIZERS["adamw"]
    state = analytic.model_state_bytes(PARAMS_70B, 64, 3, bf16, adamw, trainable=trains)["total"]
    assert one.state_bytes == pytest.approx(state)
    traffic = analytic.traffic_bytes(PARAMS_70B, 64, 3, 2, trainable=trains)["total"]
    assert one.fsdp_s == pytest.approx(traffic / 50e9)
