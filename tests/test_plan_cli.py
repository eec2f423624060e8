"""`zerojax plan` end to end, as a user runs it."""

import json
import subprocess
import sys

import pytest


def _plan(*args):
    return subprocess.run(
        [sys.executable, "-m", "zerojax.cli", "plan", *args], capture_output=True, text=True, timeout=60
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
    assert out["recommendation"]["stage"] == 1


def test_table_output_names_the_recommendation():
    r = _plan("--params", "125M", "--devices", "4", "--hardware", "tpu-v5e")
    assert r.returncode == 0, r.stderr
    assert "Recommendation:" in r.stdout and "stage 0" in r.stdout  # 2 GB fits everywhere


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
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, needle):
    r = _plan(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
