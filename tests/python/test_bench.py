"""The benchmark tool's verification (the README's main job) runs here on quick shapes:
it must verify every contender and exit 0, and a wrong result must be reported as FAILED
with a non-zero exit, never timed as if it were right."""

import re
import subprocess
import sys

import pytest


def run_bench(*args):
    return subprocess.run([sys.executable, "-m", "attnkit.bench", "--quick", "--no-progress", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("shape,dtype", [("A", "float32"), ("Dc", "bfloat16"), ("B=1,Hq=4,Hkv=2,S=200,D=80,Dv=48", "float16")])
def test_quick_run_verifies(shape, dtype):
    res = run_bench("--shape", shape, "--dtype", dtype, "--threads", "1", "--repeats", "1", "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAILED" not in res.stdout
    assert " ok " in res.stdout or " ok (" in res.stdout


@pytest.mark.parametrize("args", [
    ("--op", "sparse_mla", "--shape", "B,s_q=2,h_q=16,topk=256,s_kv=1024", "--dtype", "fp8"),
    ("--op", "sage", "--shape", "A", "--dtype", "bfloat16"),
])
def test_other_ops_verify(args):
    res = run_bench(*args, "--threads", "1", "--repeats", "1", "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAILED" not in res.stdout


def test_wrong_result_is_reported_not_timed():
    res = run_bench("--shape", "A", "--dtype", "float32", "--threads", "1", "--repeats", "1", "--budget", "1",
                    "--inject-error")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAILED" in res.stdout


def test_labels_and_per_instruction_peak():
    """The verify number is labelled, each row names the instruction its % peak is of (a
    bf16 row on vdpbf16ps against that peak, not fp32's), and the protocol it cites is in
    the repository."""
    import os
    import re

    import attnkit

    res = run_bench("--shape", "A", "--dtype", "bfloat16", "--threads", "1", "--repeats", "1", "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "peak of" in res.stdout and "ok (err " in res.stdout
    assert "E = max |out - ref| / rms(ref)" in res.stdout
    row = next(line for line in res.stdout.splitlines() if re.match(r"\s+1\s+attnkit\s", line))
    assert ("bf16 dot" if attnkit.get_isa() == "avx512bf16" else "fp32 FMA") in row
    cited = re.findall(r"protocol:\s+([\w/.]+\.md)", run_bench("--help").stdout)
    assert cited and all(os.path.exists(os.path.join(os.path.dirname(__file__), "..", "..", c)) for c in cited)


def test_call_overhead_row():
    """--shape call: the per-call cost of the numpy and torch entry points and torch's SDPA."""
    res = run_bench("--shape", "call", "--threads", "1", "--repeats", "3", "--budget", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    names = [line.split()[1] for line in res.stdout.splitlines() if re.match(r"\s+1\s+\S", line)]
    assert {"attnkit", "attnkit-torch", "torch-sdpa"} <= set(names), res.stdout
