"""`zerojax train`: the default experiment trains, and every bad input is one line with exit status 2."""

import json

import pytest

from tests.cli_helpers import assert_one_line_error, cli_in_process, run_cli

TINY = "configs/tiny.yaml"


def test_tiny_config_trains_and_loss_falls(tmp_path):
    result = run_cli("train", TINY, "--devices", "8", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(r["tokens_per_s"] > 0 for r in records)
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 1.0, (first, last)  # clearly falling within 30 steps
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["devices"] == 8 and summary["stage"] == 3 and summary["final_loss"] == last


@pytest.fixture
def bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\n  preset: tiny\n")
    return str(path)


@pytest.fixture
def empty_corpus(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    return str(path)


CASES = {
    "unknown key": (["--set", "zero.stagee=1"], ["zero.stagee"]),
    "wrong type": (["--set", "train.steps=many"], ["train.steps", "many"]),
    "stage outside 0-3": (["--set", "zero.stage=4"], ["zero.stage", "4"]),
    "unknown engine": (["--set", "zero.engine=magic"], ["zero.engine", "magic"]),
    "batch not divisible": (["--set", "train.batch_size=12", "--devices", "8"], ["train.batch_size=12", "8"]),
    "mesh does not match devices": (["--set", "mesh.fsdp=4", "--devices", "8"], ["fsdp=4", "8"]),
    "missing data path": (["--set", "data.path=/no/such/corpus", "--devices", "8"], ["data.path", "/no/such/corpus"]),
    "negative learning rate": (["--set", "optimizer.lr=-0.1"], ["optimizer.lr", "-0.1"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_override_is_one_line_exit_2(case, tmp_path):
    extra, needles = CASES[case]
    result = cli_in_process("train", TINY, "--out", str(tmp_path / "out"), *extra)
    assert_one_line_error(result, *needles)


def test_empty_corpus(empty_corpus, tmp_path):
    result = cli_in_process(
        "train", TINY, "--devices", "8", "--out", str(tmp_path), "--set", f"data.path={empty_corpus}"
    )
    assert_one_line_error(result, "data.path", "empty")


def test_malformed_yaml(bad_yaml):
    assert_one_line_error(cli_in_process("train", bad_yaml), bad_yaml, "YAML")


def test_missing_yaml():
    assert_one_line_error(cli_in_process("train", "configs/does-not-exist.yaml"), "does-not-exist.yaml")


def test_bad_device_count():
    assert_one_line_error(cli_in_process("train", TINY, "--devices", "0"), "--devices")
