"""`zerojax plan`'s pipeline x tensor x fsdp search: a pipeline pays where stage 3's traffic of the whole
model cannot hide under the compute of the sequences each device's memory holds, and the 405B pod
config carries what it picks."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.cli_helpers import cli_in_process
from zerojax.accounting import analytic, pipeline_plan
from zerojax.accounting.activations import GPTShape, gpt_activation_bytes
from zerojax.accounting.hardware import get_hardware
from zerojax.cli.config import load_config
from zerojax.cli.experiment import model_config
from zerojax.core.optim import OPTIMIZERS
from zerojax.core.precision import PRECISIONS
from zerojax.engines.pipeline import bubble_fraction

CONFIG = "configs/gpu-405b-512xh100.yaml"
H100 = get_hardware("h100")
SHAPE = GPTShape(1024, 16, 8, 4096, 256, 256)


def _pod(hw=H100, rows=256, seq=1024) -> pipeline_plan.Pod:
    stacked = SHAPE.n_layers * pipeline_plan.Pod(0, 1, hw, SHAPE, 1, 1, 1, 1).block_params
    return pipeline_plan.Pod(stacked, 64, hw, SHAPE, rows, seq, 0.45, 1.0)


@pytest.fixture(scope="module")
def planned() -> dict:
    r = cli_in_process("plan", CONFIG, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)["pipeline_parallel"]


def test_the_405b_pod_picks_a_pipeline_and_the_config_uses_it(planned):
    c = load_config(CONFIG)
    assert 4e11 < model_config(c).num_params() < 4.2e11 and planned["devices"] == 512
    pick, flat = planned["pick"], planned["best_without_pipeline"]
    assert pick["pipeline"] > 1 and pick["memory_bytes"] <= planned["budget_bytes"]
    mesh, train = c.mesh, c.train
    assert (pick["pipeline"], pick["tensor"], pick["fsdp"]) == (mesh.pipeline, mesh.tensor, mesh.fsdp)
    assert (pick["grad_accum"], pick["microbatches"]) == (train.grad_accum, train.microbatches)
    assert (pick["repeats"], pick["gather"]) == (mesh.pipeline_repeats, c.zero.pipeline_gather)
    assert (pick["stage"], pick["remat"]) == (c.zero.stage, c.model.remat)
    assert pick["bubble"] == pytest.approx(bubble_fraction(mesh.pipeline, train.microbatches, mesh.pipeline_repeats))
    # why: without a pipeline the step waits on stage 3's gathers; with it, on compute and its bubble
    assert flat["bound"] == "fsdp traffic" and flat["step_s"] > 1.2 * pick["step_s"]
    assert pick["bound"] == "compute" and pick["fsdp_s"] < flat["fsdp_s"] / 4
    assert f"bubble {pick['bubble']:.0%}" in planned["why"] and "fsdp traffic" in planned["why"]


def test_the_plan_prints_the_pipeline_pick_and_its_bubble():
    r = cli_in_process("plan", CONFIG)
    assert r.returncode == 0, r.stderr[-2000:]
    mesh = load_config(CONFIG).mesh
    said = f"Pipeline: mesh.pipeline={mesh.pipeline} x tensor={mesh.tensor} x fsdp={mesh.fsdp}"
    assert "Pipeline x tensor x fsdp, ZeRO stage and remat" in r.stdout and said in r.stdout
    assert "mesh.pipeline_repeats=4, zero.stage=3: bubble 10%" in r.stdout
    assert "The config has mesh.pipeline" not in r.stdout
    # the stage table above counts the same links: NVLink within a node, the network between nodes
    said = " ".join(r.stdout.split())
    assert "450 GB/s per direction in a node of 8, 50 GB/s between nodes" in said and "follow its pick" not in said


def test_links_that_carry_stage_3_traffic_need_no_pipeline():
    # every chip on one fabric at NVLink's rate: stage 3's gathers hide under compute, a bubble would not
    fast = dataclasses.replace(H100, name="one-fabric")
    opts = pipeline_plan.options(_pod(fast))
    assert pipeline_plan.best(opts, 72e9).split.pipeline == 1
    # where the state fits whole, stage 0's one all-reduce (two units) beats stage 3's three
    slow = pipeline_plan.options(_pod(H100, rows=64))
    pick = pipeline_plan.best(slow, 72e9)
    third = pipeline_plan.option(_pod(H100, rows=64), dataclasses.replace(pick.split, stage=3))
    assert pick.split.pipeline == 1 and pick.split.stage == 0 and pick.split.remat != "none"
    assert pick.fsdp_s == pytest.approx(third.fsdp_s * 2 / 3) and pick.step_s < third.step_s


def test_an_option_adds_up_as_the_module_says():
    pod = _pod()
    flat = pipeline_plan.option(pod, pipeline_plan.Split(1, 2, 32, 2, 1))
    # without a pipeline: stage 3 of one tensor slice, k times, over the links between nodes
    stage_3 = analytic.traffic_bytes(pod.params / 2, 32, 3, 2, grad_accum=2)["total"]
    assert flat.fsdp_s == pytest.approx(stage_3 / 50e9) and flat.sends_s == 0
    assert flat.state_bytes == pytest.approx(16 * pod.params / 64)
    piped = pipeline_plan.option(pod, pipeline_plan.Split(4, 2, 8, 2, 8))
    assert piped.state_bytes == pytest.approx(16 * pod.params / 64)
    assert piped.compute_s == pytest.approx(flat.compute_s * (8 + 3) / 8)  # the bubble stretches compute
    # one gather and one reduction of a quarter of the slice, k times
    assert piped.fsdp_s == pytest.approx(2 * 2 * 2 * pod.params / 8 * 7 / 8 / 50e9)
    micro = 256 // (8 * 2 * 8) * 1024 * SHAPE.d_model * 2  # a device's rows of one microbatch, bf16
    sends = 2 * (2 * 8 * micro + 2 * 8 * micro * 2 * 3 / 4)  # v m items on and back, the outputs summed
    assert piped.sends_s == pytest.approx(sends / 50e9)  # pipeline neighbours on other nodes
    # the stage's weights gathered whole, and its gradient summed whole over the loop
    assert piped.whole_bytes == pytest.approx(2 * 2 * pod.params / 8)


def test_stages_0_to_2_and_remat_add_up_as_the_module_says():
    pod, adam, bf16 = _pod(), OPTIMIZERS["adam"], PRECISIONS["bf16"]
    full = pipeline_plan.option(pod, pipeline_plan.Split(1, 2, 32, 2, 1))
    one = pipeline_plan.option(pod, pipeline_plan.Split(1, 2, 32, 2, 1, stage=1, remat="dots"))
    piece = pod.params / 2  # one tensor slice
    assert one.state_bytes == pytest.approx(analytic.model_state_bytes(piece, 32, 1, bf16, adam)["total"])
    # reduced and gathered back once a step, whatever the accumulation
    assert one.fsdp_s == pytest.approx(analytic.traffic_bytes(piece, 32, 1, 2)["total"] / 50e9)
    assert one.compute_s == pytest.approx(full.compute_s * 6 / 8)  # no forward recomputed
    assert one.whole_bytes == pytest.approx(4 * piece)  # the fp32 gradient two micro-batches sum into
    rows = 256 // (32 * 2)
    assert one.activation_bytes == pytest.approx(gpt_activation_bytes(SHAPE, 1024, rows, 2, "dots"))
    # a pipeline at stage 2 sums its stage's gradient whole over the loop, and accumulates in fp32
    two = pipeline_plan.option(pod, pipeline_plan.Split(4, 2, 8, 2, 8, stage=2))
    assert two.whole_bytes == pytest.approx(2 * pod.params / 8 + 4 * pod.params / 8)
    assert two.state_bytes == pytest.approx(analytic.model_state_bytes(pod.params / 8, 8, 2, bf16, adam)["total"])


def test_the_circular_schedule_and_per_microbatch_gathers_add_up():
    pod = _pod()
    gpipe = pipeline_plan.option(pod, pipeline_plan.Split(4, 2, 8, 2, 8))
    circular = pipeline_plan.option(pod, pipeline_plan.Split(4, 2, 8, 2, 8, repeats=2))
    assert circular.split.bubble == pytest.approx(bubble_fraction(4, 8, 2)) == pytest.approx(3 / 19)
    assert circular.compute_s == pytest.approx(gpipe.compute_s * (19 / 16) / (11 / 8))  # a smaller bubble
    micro = 256 // (8 * 2 * 8) * 1024 * SHAPE.d_model * 2
    stage_share = pod.params / 4 / 2  # one tensor slice of a pipeline stage
    reorder = 2 * 3 / 4 * 2 * stage_share / 8  # the shards into chunks and their gradient back
    sends = 2 * (2 * 16 * micro + 2 * 8 * micro * 2 * 3 / 4 + reorder)
    assert circular.sends_s == pytest.approx(sends / 50e9)
    assert circular.fsdp_s == pytest.approx(gpipe.fsdp_s)  # still gathered once per step
    each = pipeline_plan.option(pod, pipeline_plan.Split(4, 2, 8, 2, 8, gather="per_microbatch"))
    # every iteration gathers its chunk forward and backward and reduces it: (2 + 1) x 11, k times
    assert each.fsdp_s == pytest.approx(2 * 3 * 11 * 2 * stage_share * 7 / 8 / 50e9)
    assert each.whole_bytes == pytest.approx(2 * 2 * pod.block_params / 2)  # two layers, one tensor slice
    assert each.whole_bytes < gpipe.whole_bytes  # per step: a stage (two layers) and the rest


def test_the_leaves_outside_the_stack_and_a_frozen_part_add_up():
    block = pipeline_plan.Pod(0, 1, H100, SHAPE, 1, 1, 1, 1).block_params
    stacked, rest = SHAPE.n_layers * block, 2 * SHAPE.vocab_size * SHAPE.d_model  # + embedding and head
    pod = pipeline_plan.Pod(stacked + rest, 64, H100, SHAPE, 256, 1024, 0.45, 0.25)  # a quarter trains
    per_param = 2 + 14 * 0.25  # bf16 weights; the trained quarter's gradient, fp32 master and Adam
    zero = pipeline_plan.option(pod, pipeline_plan.Split(4, 2, 8, 2, 8, stage=0))
    share = stacked / 8 + rest / 2  # a stage's tensor slice, and the embedding and head whole on each
    assert zero.state_bytes == pytest.approx(per_param * share)  # stage 0 keeps all of it
    assert zero.whole_bytes == pytest.approx(4 * 0.25 * share)  # the trained part's fp32 accumulator
    assert zero.fsdp_s == pytest.approx(2 * 0.25 * share * 2 * 7 / 8 / 50e9)  # one all-reduce a step
    # stage 3 without remat keeps every gathered layer for the backward: one gather, not two
    kept = pipeline_plan.option(pod, pipeline_plan.Split(1, 2, 32, 2, 1, stage=3, remat="none"))
    assert kept.state_bytes == pytest.approx(per_param * pod.params / 64)
    assert kept.whole_bytes == pytest.approx(2 * pod.params / 2)
    assert kept.fsdp_s == pytest.approx(2 * (1 + 0.25) * pod.params / 2 * 2 * 31 / 32 / 50e9)
