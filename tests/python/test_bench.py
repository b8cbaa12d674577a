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
    ("--op", "modifiers", "--shape", "A", "--dtype", "bfloat16"),
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


def test_paged_fp8_rows_name_the_bf16_path():
    """fp8 cache rows under bf16 queries run the bf16 paths: their % peak is of the variant's
    bf16 instruction (AMX tiles on avx512amx, vdpbf16ps on avx512bf16)."""
    import re

    import attnkit

    res = run_bench("--op", "paged", "--shape", "M", "--dtype", "float8_e4m3fn", "--threads", "1", "--repeats", "1",
                    "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    row = next(line for line in res.stdout.splitlines() if re.match(r"\s+1\s+attnkit\s", line))
    expected = {"avx512bf16": "vdpbf16ps", "avx512amx": "tdpbf16ps"}.get(attnkit.get_isa(), "fp32 FMA")
    assert re.search(r"\d% of " + expected, row), row


@pytest.mark.parametrize("args", [("--op", "sparse_mla", "--shape", "B,s_q=2,h_q=16,topk=256,s_kv=1024", "--dtype", "fp8"),
                                  ("--op", "dsa", "--shape", "D,b=2,h=16,topk=256,s_k=1000"),
                                  ("--op", "dsa", "--shape", "IL,rows=4,keys=600")])
def test_sparse_mla_rows_name_the_bf16_path(args):
    """Sparse MLA (prefill), its decode and the DSA indexer run their products on the variant's
    bf16 instruction: AMX tiles on avx512amx, vdpbf16ps on avx512bf16, fp32 FMAs elsewhere."""
    import re

    import attnkit

    res = run_bench(*args, "--threads", "1", "--repeats", "1", "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    row = next(line for line in res.stdout.splitlines() if re.match(r"\s+1\s+attnkit\s", line))
    expected = {"avx512bf16": "vdpbf16ps", "avx512amx": "tdpbf16ps"}.get(attnkit.get_isa(), "fp32 FMA")
    assert re.search(r"\d% of " + expected, row), row


def test_decode_row_names_its_instruction():
    """Dense decode (Dc: K and V [B, H, S, D], one kv head per task) runs vdpbf16ps on
    avx512amx too (only decode over kv heads side by side runs on AMX tiles); the row says so."""
    import re

    import attnkit

    res = run_bench("--shape", "Dc", "--quick", "--threads", "1", "--repeats", "1", "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    row = next(line for line in res.stdout.splitlines() if re.match(r"\s+1\s+attnkit\s", line))
    expected = "vdpbf16ps" if attnkit.get_isa() in ("avx512bf16", "avx512amx") else "fp32 FMA"
    assert re.search(r"\d% of " + expected, row), row


def test_labels_and_per_instruction_peak():
    """The verify number is labelled, each row names the instruction its % peak is of (a
    bf16 row on vdpbf16ps against that peak, not fp32's), and the protocol it cites is in
    the repository."""
    import os
    import re

    import attnkit

    res = run_bench("--shape", "A", "--dtype", "bfloat16", "--threads", "1", "--repeats", "1", "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "% of path peak" in res.stdout and "ok (err " in res.stdout
    assert "E = max |out - ref| / rms(ref)" in res.stdout
    row = next(line for line in res.stdout.splitlines() if re.match(r"\s+1\s+attnkit\s", line))
    expected = {"avx512bf16": "vdpbf16ps", "avx512amx": "tdpbf16ps"}.get(attnkit.get_isa(), "fp32 FMA")
    assert re.search(r"\d% of " + expected, row), row
    cited = re.findall(r"protocol:\s+([\w/.]+\.md)", run_bench("--help").stdout)
    assert cited and all(os.path.exists(os.path.join(os.path.dirname(__file__), "..", "..", c)) for c in cited)


def test_every_instruction_peak_is_reported():
    """The machine line gives each instruction's measured peak per thread count, n/a where the
    CPU lacks it; a forced variant's rows name its own path (avx512vnni: bf16 prefill on fp32 FMAs,
    int8 Sage on vpdpbusd+vdpbf16ps, int8_pv_int8 on vpdpbusd alone)."""
    import os

    import attnkit
    from attnkit import _C

    res = run_bench("--op", "sage", "--shape", "B=1,H=2,S=128,D=64", "--dtype", "bfloat16", "--threads", "1",
                    "--repeats", "1", "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    head = res.stdout.splitlines()[0]
    for name in _C.peak_instructions():
        measured = re.search(re.escape(name) + r" 1 thr (\d+) G(FL)?OP/s", head)
        assert measured or f"{name} n/a" in head, head
        assert bool(measured) == (_C.measure_peak_gflops(name, 1) > 0), head
    if "avx512vnni" not in attnkit.supported_isas():
        return
    env = {**os.environ, "ATTNKIT_ISA": "avx512vnni"}
    res = subprocess.run([sys.executable, "-m", "attnkit.bench", "--quick", "--no-progress", "--op", "sage", "--shape",
                          "B=1,H=2,S=128,D=64", "--dtype", "bfloat16", "--threads", "1", "--repeats", "1", "--budget",
                          "1"], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {line.split()[1]: line for line in res.stdout.splitlines() if re.match(r"\s+1\s+\S", line)}
    assert "% of vpdpbusd+vdpbf16ps" in rows["attnkit-sage-int8"], rows
    assert "% of vpdpbusd " in rows["attnkit-sage-int8-pv-int8"], rows
    assert "% of fp32 FMA" in rows["attnkit-exact"], rows


@pytest.mark.skipif("avx512vnni" not in __import__("attnkit").supported_isas(), reason="needs AVX512_BF16/VNNI")
@pytest.mark.parametrize("op,shape,decode", [("attention", "Dc", True), ("attention", "B=1,Hq=8,Hkv=2,S=64,D=64", False),
                                             ("paged", "P16,n=2", True), ("paged", "M,n=2", False)])
def test_avx512vnni_decode_rows_name_vdpbf16ps(op, shape, decode):
    """avx512vnni runs bf16 calls that only decode on vdpbf16ps (src/core/dispatch.cpp): the
    rows say so; prefill and mixed batches stay on fp32 FMAs."""
    import os

    env = {**os.environ, "ATTNKIT_ISA": "avx512vnni"}
    res = subprocess.run([sys.executable, "-m", "attnkit.bench", "--quick", "--no-progress", "--op", op, "--shape",
                          shape, "--dtype", "bfloat16", "--threads", "1", "--repeats", "1", "--budget", "1"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    row = next(line for line in res.stdout.splitlines() if re.match(r"\s+1\s+attnkit\s", line))
    assert ("% of vdpbf16ps" if decode else "% of fp32 FMA") in row, row


@pytest.mark.parametrize("peer,module", [("openvino", "openvino"), ("onnxruntime", "onnxruntime")])
def test_optional_peers_verify(peer, module):
    """OpenVINO and ONNX Runtime (attnkit[peers]) are verified against the float64 reference
    and attnkit before timing: GQA (OpenVINO on repeated K/V), causal, odd sizes, fp32 and
    bf16 (ONNX Runtime on float16 copies, named so)."""
    pytest.importorskip(module)
    if module == "onnxruntime":
        pytest.importorskip("onnx")
    res = run_bench("--shape", "B=2,Hq=6,Hkv=2,S=77,D=40,causal", "--shape", "B=1,H=3,Sq=5,Skv=130,D=64",
                    "--dtype", "float32,bfloat16", "--threads", "1", "--repeats", "1", "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if re.match(r"\s+1\s+" + peer, line)]
    assert len(rows) == 4 and all(" ok (err " in r for r in rows), res.stdout
    if peer == "onnxruntime":
        assert sum("onnxruntime-fp16" in r for r in rows) == 2, rows


def test_call_overhead_row():
    """--shape call: the per-call cost of the numpy and torch entry points and torch's SDPA."""
    res = run_bench("--shape", "call", "--threads", "1", "--repeats", "3", "--budget", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    names = [line.split()[1] for line in res.stdout.splitlines() if re.match(r"\s+1\s+\S", line)]
    assert {"attnkit", "attnkit-torch", "torch-sdpa"} <= set(names), res.stdout


def test_dsa_op_verifies():
    res = run_bench("--op", "dsa", "--shape", "IL,rows=4,keys=600", "--shape", "TK,rows=3,keys=3000",
                    "--shape", "D,b=2,h=16,topk=256,s_k=1000", "--shape", "IP,rows=2,keys=640",
                    "--threads", "1", "--repeats", "1", "--budget", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAILED" not in res.stdout and res.stdout.count(" ok ") + res.stdout.count(" ok (") >= 8


def test_dsa_op_wrong_result_is_reported():
    res = run_bench("--op", "dsa", "--shape", "D,b=2,h=16,topk=256,s_k=1000", "--threads", "1", "--repeats", "1",
                    "--budget", "1", "--inject-error")
    assert res.returncode == 1 and "FAILED" in res.stdout, res.stdout + res.stderr


def test_path_peak_mixes_measured_rates():
    """A mixed path's peak: its FLOP shares each at its instruction's measured rate (time
    adds up); n/a (nan) when one instruction is not on the machine; labels name them all."""
    import math

    from attnkit.bench.machine import Machine, path_label

    m = Machine("cpu", 2, 1 << 25, "avx512bf16", ["avx512bf16"], "0", "torch",
                peaks={"fp32 FMA": {1: 100.0}, "vdpbf16ps": {1: 200.0}, "vpdpbusd": {1: 400.0}, "fp16 FMA": {1: 0.0}})
    assert m.path_peak("vdpbf16ps", 1) == 200.0
    assert math.isclose(m.path_peak((("vpdpbusd", 128), ("vdpbf16ps", 128)), 1), 2 / (1 / 400 + 1 / 200))
    assert math.isclose(m.path_peak((("vdpbf16ps", 576), ("fp32 FMA", 512)), 1), 1088 / (576 / 200 + 512 / 100))
    assert math.isnan(m.path_peak("fp16 FMA", 1)) and math.isnan(m.path_peak("fp32 FMA", 2))
    assert path_label((("vpdpbusd", 1), ("vdpbf16ps", 1))) == "vpdpbusd+vdpbf16ps"
    assert "fp16 FMA n/a" in m.peaks_text() and "vpdpbusd 1 thr 400 GOP/s" in m.peaks_text()
