"""`zerojax inspect`: each parameter's spec per state group, bytes per device, replicated and padded leaves."""

import json

import pytest

from tests.cli_helpers import assert_one_line_error, cli_in_process, run_cli
from zerojax.accounting import analytic as A
from zerojax.core.optim import OPTIMIZERS
from zerojax.core.precision import PRECISIONS

TINY = "configs/tiny.yaml"
PSI = 115008  # the tiny GPT


def _inspect(*args) -> dict:
    # 8 devices are this process's own; another count needs a process of its own
    run = cli_in_process if args[args.index("--devices") + 1] == "8" else run_cli
    r = run("inspect", TINY, "--json", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def three_devices():
    # 3 divides no dimension of the tiny GPT: big leaves are padded, the small norms replicated.
    return _inspect("--devices", "3", "--set", "train.batch_size=12", "--stage", "3")


def test_uneven_leaves_are_padded_or_replicated_with_the_reason(three_devices):
    leaves = {l["path"]: l for l in three_devices["leaves"]}
    assert three_devices["params"] == PSI and three_devices["fsdp"] == 3
    norm = leaves["final_norm"]
    assert norm["status"] == "replicated" and "256 bytes" in norm["reason"] and "divisible by 3" in norm["reason"]
    assert norm["spec"]["master"] == "()" and norm["bytes_per_device"]["master"] == 64 * 4
    embed = leaves["embed"]
    assert embed["status"] == "padded" and embed["stored_shape"] == [258, 64]
    assert embed["reason"] == "padded axis 0 from 256 to 258"
    assert embed["spec"]["master"] == "('fsdp',)" and embed["spec"]["optimizer"] == "('fsdp',)"
    assert embed["bytes_per_device"]["master"] == 258 * 64 // 3 * 4
    assert embed["bytes_per_device"]["optimizer"] == 2 * 258 * 64 // 3 * 4  # Adam's two moments
    wq = leaves["blocks/wq"]  # the layer axis is never split
    assert wq["stored_shape"] == [2, 66, 64] and wq["spec"]["master"] == "(None, 'fsdp')"
    statuses = [l["status"] for l in three_devices["leaves"]]
    assert statuses.count("replicated") == 3 and statuses.count("padded") == 9


def test_totals_add_up(three_devices):
    t = three_devices["persistent_bytes_per_device"]
    per_leaf = sum(l["bytes_per_device"]["total"] for l in three_devices["leaves"])
    assert t["total"] == per_leaf + t["other_state"]
    assert t["compute_params"] == 0  # fp32 at stage 3: the master is the compute copy


def test_bf16_stage_1_specs_per_group_and_total():
    out = _inspect("--devices", "8", "--stage", "1", "--set", "precision=bf16")
    assert out["groups_sharded"] == {"compute_params": False, "master": True, "optimizer": True, "grads": False}
    for leaf in out["leaves"]:  # every tiny leaf divides by 8
        assert leaf["status"] == "sharded"
        assert leaf["spec"]["compute_params"] == "()" and leaf["spec"]["grads"] == "()"
        assert "fsdp" in leaf["spec"]["master"] and leaf["spec"]["optimizer"] == leaf["spec"]["master"]
    kept = A.kept_state_bytes(PSI, 8, 1, PRECISIONS["bf16"], OPTIMIZERS["adamw"])
    total = out["persistent_bytes_per_device"]
    assert total["compute_params"] == kept["compute_params"] == 2 * PSI
    assert total["total"] == pytest.approx(kept["total"], rel=0.001)


def test_bf16_stage_1_lora_keeps_the_frozen_base_once_replicated():
    """rank-4 adapters on the tiny GPT: the base is held once, in bf16, replicated (no master, no
    moments); the adapters as any stage-1 parameter. Totals as the planner counts them."""
    out = _inspect("--devices", "8", "--stage", "1", "--set", "precision=bf16", "--set", "model.lora={rank: 4}")
    leaves = {l["path"]: l for l in out["leaves"]}
    assert out["params"] == PSI + 8704 and out["trainable_params"] == 8704
    wq, adapter = leaves["blocks/wq"], leaves["blocks/q_lora_a"]
    assert not wq["trainable"] and wq["spec"]["master"] == wq["spec"]["optimizer"] == "-"
    assert wq["bytes_per_device"] == {"compute_params": 2 * 64 * 64 * 2, "master": 0, "optimizer": 0, "total": 16384}
    assert adapter["trainable"] and adapter["bytes_per_device"]["master"] == 2 * 64 * 4 * 4 // 8
    kept = A.kept_state_bytes(PSI + 8704, 8, 1, PRECISIONS["bf16"], OPTIMIZERS["adamw"], trainable=8704)
    assert out["persistent_bytes_per_device"]["total"] == pytest.approx(kept["total"], rel=0.001)


def test_table_lists_replicated_and_padded_leaves(three_devices, capsys):
    from zerojax.cli.commands.inspect import print_report

    print_report(three_devices)
    out = capsys.readouterr().out
    assert "replicated leaves: 3 (blocks/attn_norm, blocks/mlp_norm, final_norm)" in out
    assert "padded leaves: 9" in out and "padded axis" in out  # the reason column


@pytest.mark.parametrize(
    "args, needles",
    [(["--stage", "7"], ["--stage", "0, 1, 2 or 3"]), (["--set", "precision=fp8"], ["precision", "fp8"])],
)
def test_bad_arguments_exit_2_with_one_line(args, needles):
    assert_one_line_error(cli_in_process("inspect", TINY, *args), *needles)


def test_missing_config_is_one_line():
    assert_one_line_error(cli_in_process("inspect", "configs/none.yaml"), "configs/none.yaml")


def test_names_a_parameter_read_outside_its_unit():
    """The head reads layer `a`'s kernel itself: the report says the root gathers it, in the table's
    last line and in --json."""
    args = [
        "configs/tiny.yaml",
        "--devices",
        "8",
        "--set",
        "model.target=tests.user_code:ReadsAKernel",
        "--set",
        "data.target=tests.user_code:blobs",
        "--set",
        "zero.engine=shard_map",
    ]
    done = cli_in_process("inspect", *args, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    gathers = json.loads(done.stdout)["gathers"]
    assert gathers.startswith("FSDP units: 3 x Linear") and gathers.endswith("gathered by the root: a/kernel"), gathers
    done = cli_in_process("inspect", *args)
    assert done.stdout.strip().splitlines()[-1] == f"gathers: {gathers}"
