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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_rows_verify(dtype, tmp_path):
    table = tmp_path / "rows.csv"
    res = run_bench("--shape", "B=1,Hq=4,Hkv=2,S=300,D=64,causal", "--dtype", dtype, "--csv", str(table))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAILED" not in res.stdout
    names = [line.split()[1] for line in res.stdout.splitlines() if line.strip().startswith("1 ")]
    assert {"attnkit", "attnkit-forward"} <= set(names), res.stdout
    # The forward's GFLOP/s counts its two products, the backward's its five (D = Dv).
    gflop = {row["contender"]: float(row["gflop"]) for row in csv.DictReader(table.open())}
    assert gflop["attnkit-forward"] == pytest.approx(gflop["attnkit"] * 2 / 5), gflop
    pytest.importorskip("torch")
    assert "torch-sdpa-backward" in names, res.stdout


def test_wrong_gradient_is_reported():
    res = run_bench("--shape", "B=1,Hq=4,Hkv=2,S=300,D=64,causal", "--dtype", "float32", "--inject-error")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAILED" in res.stdout and "dq" in res.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_backward_rows_verify(dtype, tmp_path):
    table = tmp_path / "rows.csv"
    res = run_bench("--shape", "R,n=6,hi=100,hq=4,hkv=2,d=64", "--dtype", dtype, "--csv", str(table),
                    op="varlen_backward")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAILED" not in res.stdout
    names = [line.split()[1] for line in res.stdout.splitlines() if line.strip().startswith("1 ")]
    assert {"attnkit", "attnkit-forward"} <= set(names), res.stdout
    gflop = {row["contender"]: float(row["gflop"]) for row in csv.DictReader(table.open())}
    assert gflop["attnkit-forward"] == pytest.approx(gflop["attnkit"] * 2 / 5), gflop
    pytest.importorskip("torch")
    assert "torch-sdpa-padded-backward" in names, res.stdout


def test_varlen_wrong_gradient_is_reported():
    res = run_bench("--shape", "R,n=6,hi=100,hq=4,hkv=2,d=64", "--dtype", "float32", "--inject-error",
                    op="varlen_backward")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAILED" in res.stdout and "dq" in res.stdout
