"""The per-machine path choice (src/core/dispatch.cpp) and the peak probes the benchmark uses.

The default variant follows the bf16 rule (Intel family 6: avx512vnni, bf16 through fp32
FMAs; elsewhere avx512bf16, vdpbf16ps), checked here against /proc/cpuinfo read
independently. Every variant is forced (set_isa, ATTNKIT_ISA) and checked against the
float64 reference, and avx512vnni is checked to be what it claims: avx512's arithmetic for
bf16 inputs but for decode, avx512bf16's bf16 decode and int8 Sage.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import attnkit
from attnkit import _C
from conftest import assert_bits_equal, bits, make_qkv, poison, randn
from reference import assert_close, attention_ref, pv_magnitude, tolerance

HAS_BF16_VARIANTS = "avx512bf16" in attnkit.supported_isas()


def cpuinfo_vendor_family():
    fields = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
            if not line.strip():
                break
    return fields.get("vendor_id", ""), int(fields.get("cpu family", "-1"))


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs /proc/cpuinfo")
def test_default_variant_follows_the_bf16_rule():
    vendor, family = cpuinfo_vendor_family()
    isas = attnkit.supported_isas()
    rule = _C.isa_rule()
    assert f"{vendor} family {family} " in rule, rule
    assert ("avx512vnni" in isas) == ("avx512bf16" in isas)
    if HAS_BF16_VARIANTS:
        expected = "avx512vnni" if (vendor, family) == ("GenuineIntel", 6) else "avx512bf16"
        if "avx512amx" in isas:  # AMX first where the CPU and the OS allow it
            assert isas[0] == "avx512amx" and isas[1] == expected, isas
            expected = "avx512amx"
        assert isas[0] == expected and rule.startswith(expected + ":"), (isas, rule)
    assert rule.split(":")[0] == isas[0]


def test_info_reports_the_choice():
    res = subprocess.run([sys.executable, "-m", "attnkit", "info"], capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert res.returncode == 0, res.stderr
    assert f"default isa: {_C.isa_rule()}" in res.stdout
    assert "bf16 products on: " in res.stdout and "int8 Sage Q·Kᵀ on: " in res.stdout


CHECK_IN_CHILD = """
import numpy as np, attnkit, ml_dtypes, sys
sys.path.insert(0, {tests!r})
from reference import attention_ref, pv_magnitude, tolerance, assert_close
rng = np.random.default_rng(5)
q = rng.standard_normal((1, 4, 67, 48)).astype(ml_dtypes.bfloat16)
k = rng.standard_normal((1, 2, 131, 48)).astype(ml_dtypes.bfloat16)
v = rng.standard_normal((1, 2, 131, 48)).astype(ml_dtypes.bfloat16)
out = attnkit.attention(q, k, v, causal=True, enable_gqa=True)
ref, _ = attention_ref(q, k, v, None, True, None, True)
assert_close(out, ref, *tolerance("bfloat16", "out", magnitude=pv_magnitude(q, k, v, None, True, None, True)))
print(attnkit.get_isa())
"""


@pytest.mark.parametrize("isa_name", attnkit.supported_isas())
def test_every_variant_forced_by_env_is_correct(isa_name):
    """ATTNKIT_ISA forces each variant at load (no warning); bf16 attention is right on it."""
    env = {**os.environ, "ATTNKIT_ISA": isa_name}
    code = CHECK_IN_CHILD.format(tests=os.path.dirname(__file__))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [isa_name] and res.stderr == ""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("Sq,Skv,D,causal", [(1, 300, 64, False), (49, 129, 128, True), (130, 257, 80, False)])
def test_every_variant_forced_by_set_isa_matches_float64(rng, dtype, Sq, Skv, D, causal, restore_runtime):
    q, k, v = make_qkv(rng, 2, 6, 2, Sq, Skv, D, D, dtype)
    args = (None, causal, None, True)
    ref, _ = attention_ref(q, k, v, *args)
    tol = tolerance(dtype, "out", magnitude=pv_magnitude(q, k, v, *args))
    for isa_name in attnkit.supported_isas():
        attnkit.set_isa(isa_name)
        out = attnkit.attention(q, k, v, causal=causal, enable_gqa=True, out=poison(ref.shape, q.dtype))
        assert_close(out, ref, *tol, f"out[{isa_name}]")


@pytest.mark.skipif(not HAS_BF16_VARIANTS, reason="needs a CPU with AVX512_BF16 and AVX512_VNNI")
def test_avx512vnni_is_avx512_for_bf16_and_avx512bf16_for_int8_sage(rng, restore_runtime):
    """avx512vnni computes bf16 attention with avx512's fp32 FMAs (bit-identical to it) and
    int8 Sage with avx512bf16's vpdpbusd kernel (bit-identical to that)."""
    q, k, v = make_qkv(rng, 1, 8, 2, 77, 200, 128, 128, "bfloat16")

    def run(isa_name, fn):
        attnkit.set_isa(isa_name)
        return fn()

    exact = lambda: attnkit.attention(q, k, v, causal=True, enable_gqa=True)  # noqa: E731
    sage = lambda: attnkit.sage_attention(q, k, v, causal=True, mode="int8")  # noqa: E731
    assert_bits_equal(run("avx512vnni", exact), run("avx512", exact), "bf16 attention vnni vs avx512")
    assert_bits_equal(run("avx512vnni", sage), run("avx512bf16", sage), "int8 sage vnni vs avx512bf16")


@pytest.mark.skipif(not HAS_BF16_VARIANTS, reason="needs a CPU with AVX512_BF16 and AVX512_VNNI")
@pytest.mark.parametrize("sq", [1, 2])
def test_avx512vnni_decodes_bf16_as_avx512bf16(rng, restore_runtime, sq):
    """Calls that only decode (at most 8 query rows per kv head) run avx512bf16's key blocks on
    avx512vnni, dense and paged, bit-identical to it (and not to avx512: the route shows); a
    serving batch with a prefill chunk stays avx512's."""
    def run(isa_name, fn):  # out and lse (fp32: it shows the path where bf16 outputs round alike)
        attnkit.set_isa(isa_name)
        return np.concatenate([bits(x).astype(np.uint32).ravel() for x in fn()])

    q, k, v = make_qkv(rng, 2, 8, 2, sq, 700, 128, 128, "bfloat16")
    dense = lambda: attnkit.attention(q, k, v, causal=True, enable_gqa=True, return_lse=True)  # noqa: E731
    assert_bits_equal(run("avx512vnni", dense), run("avx512bf16", dense), "bf16 decode vnni vs avx512bf16")
    assert not np.array_equal(run("avx512", dense), run("avx512bf16", dense))

    block_size, hkv, hq, d = 16, 2, 8, 64
    seq_lens = np.array([300, 41, 129], dtype=np.int32)
    blocks = (seq_lens + block_size - 1) // block_size
    table = np.full((len(seq_lens), blocks.max()), -1, dtype=np.int32)
    ids = rng.permutation(int(blocks.sum())).astype(np.int32)
    for b, n in enumerate(blocks):
        table[b, :n], ids = ids[:n], ids[n:]
    kc = randn(rng, (int(blocks.sum()), block_size, hkv, d), "bfloat16")
    vc = randn(rng, (int(blocks.sum()), block_size, hkv, d), "bfloat16")
    for q_lens, expected in (([sq] * 3, "avx512bf16"), ([sq, 40, sq], "avx512")):
        cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        qp = randn(rng, (int(cu_q[-1]), hq, d), "bfloat16")
        paged = lambda: attnkit.paged_attention(qp, kc, vc, table, seq_lens, cu_q, return_lse=True)  # noqa: E731
        assert_bits_equal(run("avx512vnni", paged), run(expected, paged), f"paged q_lens {q_lens}: vnni vs {expected}")


@pytest.mark.skipif("avx512amx" not in attnkit.supported_isas(), reason="needs AMX (and the OS's leave)")
def test_avx512amx_is_avx512bf16_outside_the_bf16_products(rng, restore_runtime):
    """avx512amx runs bf16 products on AMX tiles (the tile loop, decode's key blocks over kv
    heads side by side, sage's P·V): fp32 attention, and bf16 decode one kv head at a time,
    are bit-identical to avx512bf16's, whose code it compiles; its bf16 prefill and grouped
    decode sum the same exact products in another order, so they are checked against
    float64 (and they are not avx512bf16's: the products did run on the tiles; the fp32 lse
    shows it where the bf16 outputs round alike)."""
    def run(isa_name, *args, **kw):
        attnkit.set_isa(isa_name)
        return attnkit.attention(*args, **kw)

    q, k, v = make_qkv(rng, 1, 8, 2, 77, 200, 128, 128, "float32")
    assert_bits_equal(run("avx512amx", q, k, v, causal=True, enable_gqa=True),
                      run("avx512bf16", q, k, v, causal=True, enable_gqa=True), "fp32 amx vs bf16")
    # bf16 decode one kv head at a time ([B, H, S, D] K and V) stays on vdpbf16ps
    q, k, v = make_qkv(rng, 2, 8, 2, 1, 300, 128, 128, "bfloat16")
    assert_bits_equal(run("avx512amx", q, k, v, enable_gqa=True, return_lse=True)[1],
                      run("avx512bf16", q, k, v, enable_gqa=True, return_lse=True)[1], "bf16 decode lse")
    prefill, decode = ((1, 8, 2, 150, 333, 96, 80), True), ((2, 8, 2, 1, 300, 128, 128), False)
    for shape, causal in [prefill, decode]:
        q, k, v = make_qkv(rng, *shape, "bfloat16")
        if shape[3] == 1:  # decode: K and V stored [B, S, H, D], each key's kv heads side by side
            k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (k, v))
        out = poison(q.shape[:3] + (shape[-1],), "bfloat16")
        _, lse = run("avx512amx", q, k, v, causal=causal, enable_gqa=True, out=out, return_lse=True)
        want = attention_ref(q, k, v, causal=causal, enable_gqa=True)[0]
        assert_close(out, want, *tolerance("bfloat16", "out", magnitude=pv_magnitude(q, k, v, causal=causal,
                                                                                     enable_gqa=True)))
        _, lse_bf16 = run("avx512bf16", q, k, v, causal=causal, enable_gqa=True, return_lse=True)
        assert not np.array_equal(np.asarray(lse), np.asarray(lse_bf16))


@pytest.mark.parametrize("isa_name", attnkit.supported_isas())
@pytest.mark.parametrize("unfused", [False, True])
@pytest.mark.parametrize("scale", [0.5, 4.0])
def test_lazy_max_follows_rising_logits(rng, isa_name, unfused, scale, restore_runtime):
    """The bf16 tile loop's fused softmax (every ISA's: bf16 pairs and AMX tiles) moves a
    row's reference max only when a tile beats it by more than ln 256: logits that climb across the 256-key tiles (scale 0.5: in about
    60% of (row, tile) pairs by more than that, in another 20% by less; scale 4: every row's
    max climbs by more than 88 over its first tile, so a max that never moved would
    overflow) and a late outlier key, vs float64; with a mask (the unfused softmax, exact
    max) as well."""
    import ml_dtypes
    attnkit.set_isa(isa_name)
    B, Hq, Hkv, Sq, Skv, D = 1, 8, 2, 70, 1300, 128
    q = rng.standard_normal((B, Hq, Sq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Skv, D)).astype(np.float32)
    k *= np.linspace(0.2, 3.0, Skv, dtype=np.float32)[None, None, :, None]
    k[:, :, 1111] = 4.0 * q[:, ::4].mean(axis=(1, 2)) / np.linalg.norm(q[:, ::4].mean(axis=(1, 2)))
    v = rng.standard_normal((B, Hkv, Skv, D)).astype(np.float32)
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    mask = rng.random((Sq, Skv)) > 0.1 if unfused else None
    out = poison((B, Hq, Sq, D), "bfloat16")
    got, got_lse = attnkit.attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True, return_lse=True, out=out)
    assert got is out
    want, want_lse = attention_ref(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    mag = pv_magnitude(q, k, v, mask, False, scale, True)
    assert_close(got, want, *tolerance("bfloat16", "out", magnitude=mag))
    assert_close(got_lse, want_lse, *tolerance("bfloat16", "lse"), name="lse")


# ---- the peak probes -------------------------------------------------------------------

def test_peak_instructions_and_errors():
    assert _C.peak_instructions() == ["fp32 FMA", "vdpbf16ps", "vpdpbusd", "fp16 FMA", "tdpbf16ps",
                                       "tdpbusd"]
    with pytest.raises(ValueError, match=r'instruction must be one of "fp32 FMA", .*got "fma"'):
        _C.measure_peak_gflops("fma", 1)
    with pytest.raises(ValueError, match=r"threads must be in \[1, get_num_threads"):
        _C.measure_peak_gflops("fp32 FMA", attnkit.get_num_threads() + 1)
    with pytest.raises(ValueError, match=r"threads must be in"):
        _C.measure_peak_gflops("vpdpbusd", 0)


def test_peaks_measured_where_the_cpu_has_them():
    features = _C.cpu_features().split()
    peaks = {name: _C.measure_peak_gflops(name, 1) for name in _C.peak_instructions()}
    assert peaks["fp32 FMA"] > 1.0
    assert (peaks["vdpbf16ps"] > 1.0) == HAS_BF16_VARIANTS
    assert (peaks["vpdpbusd"] > 1.0) == HAS_BF16_VARIANTS
    assert (peaks["fp16 FMA"] > 1.0) == ("avx512fp16" in features and HAS_BF16_VARIANTS)
    assert (peaks["tdpbf16ps"] > 1.0) == ("avx512amx" in attnkit.supported_isas())
    assert (peaks["tdpbusd"] > 1.0) == ("avx512amx" in attnkit.supported_isas())
    assert all(p == 0.0 or p > 1.0 for p in peaks.values()), peaks
    assert _C.measure_fma_peak_gflops(1) > 1.0
