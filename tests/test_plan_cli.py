"""`zerojax plan` end to end, as a user runs it."""

import json
import subprocess
import sys

import pytest


def _plan(*args):
    return subprocess.run(
        [sys.executable, "-m", "zerojax.cli.main", "plan", *args], capture_output=True, text=True, timeout=60
    )


def test_json_7b_on_8_matches_the_zero_paper():
    r = _plan("--params", "7e9", "--devices", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["params"] == 7e9 and out["devices"] == 8 and out["hardware"]["name"] == "h100"
    stages = out["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2, 3]
    persistent = [s["persistent_bytes_per_device"] for s in stages]
    assert persistent == pytest.approx([112e9, 38.5e9, 26.25e9, 14e9], rel=0.005)
    gathers = [s["param_allgather_bytes_per_device_per_step"] for s in stages]
    assert gathers == pytest.approx([0, 12.25e9, 12.25e9, 24.5e9])  # stage 3: two 12.25 GB gathers
    traffic = [s["traffic_bytes_per_device_per_step"] for s in stages]
    assert traffic == pytest.approx([24.5e9, 24.5e9, 24.5e9, 36.75e9])
    assert [s["fits"] for s in stages] == [False, True, True, True]
    assert all(s["compute_time_s"] > 0 and s["comm_time_s"] > 0 for s in stages)
    assert out["state_alone"]["stage"] == 1
    assert out["recommendation"] == out["best"]  # one recommendation: the best combination that fits


def test_a_group_over_several_nodes_is_timed_at_the_rate_between_nodes():
    one_node, pod = (json.loads(_plan("--params", "7e9", "--devices", str(n), "--json").stdout) for n in (8, 64))
    assert one_node["hardware"]["collective_link_bytes_per_s"] == one_node["hardware"]["link_bytes_per_s"] == 450e9
    assert pod["hardware"]["collective_link_bytes_per_s"] == 50e9 and pod["hardware"]["link_bytes_per_s"] == 450e9
    stage_3 = pod["stages"][3]
    assert stage_3["comm_time_s"] == pytest.approx(stage_3["traffic_bytes_per_device_per_step"] / 50e9)


def test_fine_tuning_7b_on_8_is_the_frozen_and_trainable_formula():
    """1% of 7B trains (bf16 + Adam): stage 3 keeps 2*Psi_frozen/N + 12*Psi_trainable/N, the textbook
    state adds the trainable gradient (16 per trainable parameter); the frozen part is gathered
    twice and never reduced, and stages 0-2 hold it replicated."""
    r = _plan("--params", "7e9", "--devices", "8", "--trainable", "0.01", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    frozen, trains = 0.99 * 7e9, 0.01 * 7e9
    stages = out["stages"]
    assert out["trainable_params"] == pytest.approx(trains)
    assert stages[3]["kept_bytes_per_device"] == pytest.approx((2 * frozen + 12 * trains) / 8)
    assert stages[3]["persistent_bytes_per_device"] == pytest.approx((2 * frozen + 16 * trains) / 8)
    assert stages[1]["kept_bytes_per_device"] == pytest.approx(2 * 7e9 + 12 * trains / 8)
    ring = 7 / 8
    assert stages[3]["param_allgather_bytes_per_device_per_step"] == pytest.approx(2 * 2 * 7e9 * ring)
    assert stages[3]["grad_reduce_bytes_per_device_per_step"] == pytest.approx(2 * trains * ring)
    assert stages[0]["param_allgather_bytes_per_device_per_step"] == 0


def test_table_output_names_the_recommendation():
    r = _plan("--params", "125M", "--devices", "4", "--hardware", "tpu-v5e")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("Recommendation:") == 1 and "--set zero.stage=" in r.stdout.split("Recommendation:")[1]
    assert "State alone (no activations): stage 0" in r.stdout  # 2 GB fits everywhere


def test_a_small_model_is_shown_in_units_it_can_be_read_in():
    """5,000 parameters: 80 KB of stage-0 state, not 0.00 GB."""
    r = _plan("--params", "5000", "--devices", "8")
    assert r.returncode == 0, r.stderr
    assert "ZeRO plan: 5,000 params on 8" in r.stdout and "model state KB" in r.stdout
    stage_0 = next(line for line in r.stdout.splitlines() if line.strip("│ ").startswith("0 "))
    assert "80.00" in stage_0, stage_0  # 16 bytes x 5,000 = 80 KB
    assert "device KB" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--params", "0", "--devices", "8"], "--params"),
        (["--params", "-7e9", "--devices", "8"], "--params"),
        (["--params", "7e9", "--devices", "0"], "--devices"),
        (["--params", "7e9", "--devices", "8", "--hardware", "v100"], "h100"),
        (["--params", "7e9"], "--devices"),
        (["configs/some.yaml", "--devices", "8"], "--params"),
        (["--params", "7e9", "--devices", "eight"], "--devices"),
        (["--params", "7e9", "--devices", "8", "--trainable", "1.5"], "--trainable"),
        (["--params", "7e9", "--devices", "8", "--lora-rank", "8"], "--lora-rank needs a CONFIG"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, needle):
    r = _plan(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_stage_3_traffic_by_axis_with_zeropp_options():
    """A data x fsdp config (7B on 8 x 8 H100s) with qwZ, qgZ and hpZ: the plan reports stage 3's bytes
    by collective and mesh axis, plain and with the options (`accounting.zeropp`, checked against
    compiled programs in tests/test_zeropp.py): the inter-node (data) all-reduce becomes a gather and
    a reduce-scatter of the same bytes, and the fsdp gathers and reductions shrink to int8 + scales."""
    out = _plan(
        "configs/gpu-7b-64xh100.yaml",
        "--set",
        "zero.stage=3",
        "--set",
        "zero.engine=shard_map",
        "--set",
        "zero.quantize_weights=int8",
        "--set",
        "zero.quantize_grads=int8",
        "--set",
        "zero.hierarchical=true",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    section = plan["stage_3_traffic_by_axis"]
    assert (section["data"], section["fsdp"]) == (8, 8)
    psi, plain, chosen = plan["params"], section["plain"], section["with_options"]
    shard = psi / 8
    assert plain["all-reduce"]["data"] == pytest.approx(2 * shard * 2 * 7 / 8)
    assert chosen["all-gather"]["data"] + chosen["reduce-scatter"]["data"] == pytest.approx(plain["all-reduce"]["data"])
    assert chosen["all-gather"]["fsdp"] / plain["all-gather"]["fsdp"] == pytest.approx((1 + 4 / 256) / 2)
    assert chosen["all-to-all"]["fsdp"] / plain["reduce-scatter"]["fsdp"] == pytest.approx((1 + 4 / 256) / 2)
    assert "all-reduce" not in chosen and section["with_options_total"] < section["plain_total"]
    # hpZ memory: the 12-byte state over all 64 devices instead of 8, plus a bf16 copy over fsdp
    assert section["plain_memory"] == {"kept": pytest.approx(12 * psi / 8), "secondary_copy": 0.0}
    assert section["with_options_memory"] == {
        "kept": pytest.approx(12 * psi / 64),
        "secondary_copy": pytest.approx(2 * psi / 8),
    }


def test_no_by_axis_section_on_a_one_axis_mesh_without_options():
    out = _plan("--params", "7e9", "--devices", "8", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stage_3_traffic_by_axis"] is None


def test_a_configs_trainable_regex_is_counted():
    """train.trainable on the tiny GPT: wq and wv of both layers (2 x 2 x 64 x 64) train."""
    r = _plan("configs/tiny.yaml", "--devices", "8", "--set", "train.trainable=blocks/w[qv]$", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["params"], out["trainable_params"]) == (115008, 16384)
