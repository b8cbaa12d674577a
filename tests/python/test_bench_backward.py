"""python -m attnkit.bench --op backward and --op varlen_backward: every contender
(attnkit's backward, its forward, torch SDPA's backward) verified before timing, and a wrong
gradient reported as FAILED."""

import csv
import subprocess
import sys

import pytest


def run_bench(*args, op="backward"):
    return subprocess.run([sys.executable, "-m", "attnkit.bench", "--op", op, "--quick", "--no-progress",
                           "--threads", "1", "--repeats", "1", "--budget", "1", *args],
                          capture_output=True, text=True, timeout=600)


CASES = {"backward": ("B=1,Hq=4,Hkv=2,S=300,D=64,causal", "torch-sdpa-backward"),
         "varlen_backward": ("R,n=6,hi=100,hq=4,hkv=2,d=64", "torch-sdpa-padded-backward")}


@pytest.mark.parametrize("op", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_rows_verify(op, dtype, tmp_path):
    shape, peer = CASES[op]
    table = tmp_path / "rows.csv"
    res = run_bench("--shape", shape, "--dtype", dtype, "--csv", str(table), op=op)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAILED" not in res.stdout
    names = [line.split()[1] for line in res.stdout.splitlines() if line.strip().startswith("1 ")]
    assert {"attnkit", "attnkit-forward"} <= set(names), res.stdout
    # The forward's GFLOP/s counts its two products, the backward's its five (D = Dv).
    gflop = {row["contender"]: float(row["gflop"]) for row in csv.DictReader(table.open())}
    assert gflop["attnkit-forward"] == pytest.approx(gflop["attnkit"] * 2 / 5), gflop
    pytest.importorskip("torch")
    assert peer in names, res.stdout


@pytest.mark.parametrize("op", CASES)
def test_wrong_gradient_is_reported(op):
    res = run_bench("--shape", CASES[op][0], "--dtype", "float32", "--inject-error", op=op)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAILED" in res.stdout and "dq" in res.stdout
