"""`zerojax compare`: one table and one JSON of measured vs analytic bytes, and losses, per stage."""

import json

import pytest

from tests.cli_helpers import assert_one_line_error, cli_in_process
from zerojax.cli.commands.compare import engine_available

TINY = "configs/tiny.yaml"
FIELDS = {
    "stage",
    "engine",
    "persistent_bytes_per_device",
    "ideal_persistent_bytes_per_device",
    "peak_bytes_per_device",
    "collective_bytes_per_device_per_step",
    "ideal_collective_bytes_per_device_per_step",
    "step_time_s",
    "losses",
}


def _compare(tmp_path, *args):
    out = tmp_path / "compare.json"
    r = cli_in_process(
        "compare", TINY, "--devices", "8", "--steps", "2", "--set", "train.batch_size=8", "--json", str(out), *args
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(out.read_text())


@pytest.fixture(scope="module")
def stages_0_1(tmp_path_factory):
    return _compare(tmp_path_factory.mktemp("compare"), "--stages", "0,1", "--engines", "gspmd")


def test_json_has_every_row_and_field(stages_0_1):
    _, out = stages_0_1
    assert out["params"] == 115008 and out["devices"] == 8
    assert [(r["stage"], r["engine"]) for r in out["rows"]] == [(0, "gspmd"), (1, "gspmd")]
    for r in out["rows"]:
        assert FIELDS <= set(r)
        assert len(r["losses"]) == 2 and r["step_time_s"] > 0
        # one fsdp axis of 8 devices: every collective byte is on it
        assert r["collective_bytes_by_axis"] == {"fsdp": pytest.approx(r["collective_bytes_per_device_per_step"])}


def test_persistent_bytes_match_and_stage_1_keeps_less(stages_0_1):
    rows = stages_0_1[1]["rows"]
    for r in rows:
        assert r["persistent_bytes_per_device"] == pytest.approx(r["ideal_persistent_bytes_per_device"], rel=0.01)
    # fp32 stage 1 shards the 8 bytes of Adam moments: 12 -> 4 + 8/8 bytes per parameter.
    assert rows[0]["persistent_bytes_per_device"] / rows[1]["persistent_bytes_per_device"] == pytest.approx(
        12 / 5, rel=0.01
    )


def test_collective_ratios(stages_0_1):
    s0, s1 = stages_0_1[1]["rows"]
    assert s0["collective_ratio"] == pytest.approx(1.0, rel=0.01)  # one all-reduce of fp32 gradients
    # gspmd's stage 1: all-reduce, slice, update, all-gather: at most 3 units against the ideal 2.
    assert 0.98 <= s1["collective_ratio"] <= 1.5 * 1.02
    assert s1["collective_bytes_per_device_per_step"] > s0["collective_bytes_per_device_per_step"]


def test_losses_match_stage_0(stages_0_1):
    s0, s1 = stages_0_1[1]["rows"]
    assert s0["final_loss_diff_vs_stage0"] == 0.0
    assert s1["losses"] == pytest.approx(s0["losses"], abs=1e-4)
    assert abs(s1["final_loss_diff_vs_stage0"]) < 1e-4


def test_table_names_the_columns(stages_0_1):
    r, _ = stages_0_1
    assert "kept (ideal)" in r.stdout and "collective/step" in r.stdout and "vs stage 0" in r.stdout


@pytest.mark.slow
@pytest.mark.skipif(not engine_available("shard_map"), reason="engines/shard_map.py is not in this checkout")
def test_both_engines(tmp_path):
    _, out = _compare(tmp_path, "--stages", "0,3", "--engines", "gspmd,shard_map")
    rows = {(r["stage"], r["engine"]): r for r in out["rows"]}
    assert set(rows) == {(0, "gspmd"), (3, "gspmd"), (0, "shard_map"), (3, "shard_map")}
    assert rows[(3, "shard_map")]["collective_ratio"] <= 1.0
    for r in rows.values():
        assert r["persistent_ratio"] == pytest.approx(1.0, rel=0.01)
        assert abs(r["final_loss_diff_vs_stage0"]) < 1e-4


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--stages", "0,5"], ["--stages", "0, 1, 2, 3"]),
        (["--stages", "one"], ["--stages"]),
        (["--engines", "xla"], ["--engines", "gspmd"]),
        (["--steps", "0"], ["--steps"]),
        (["--set", "zero.stagee=1"], ["zero.stagee"]),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, needles):
    assert_one_line_error(cli_in_process("compare", TINY, *args), *needles)


def test_missing_config_is_one_line():
    assert_one_line_error(cli_in_process("compare", "configs/none.yaml"), "configs/none.yaml")
