"""attnkit's dtype conversions (src/core/dtype.cpp, via attnkit._C.cast) against PyTorch 2.13
and ml_dtypes, bit for bit.

torch's CPU .to() is the oracle. ml_dtypes must agree wherever it agrees with torch; where
the two differ (listed below, all NaN encodings except e4m3fn overflow) we follow torch:

  widening (narrow -> float32)
    float16      torch sets the quiet bit of signalling NaNs (0x7C01 -> 0x7FC02000);
                 ml_dtypes / numpy keep them signalling (0x7F802000).
    e4m3fn       NaN: torch 0x7FF00000|sign (payload kept), ml_dtypes 0x7FC00000|sign.
    e5m2         NaN 0x7D/0x7F: torch 0x7FE00000|sign (quiet bit set, as for fp16),
                 ml_dtypes 0x7FC00000|sign.
  narrowing (float32 -> narrow)
    float16      signalling NaN: torch quiets it (0x7F800001 -> 0x7E00), numpy keeps it
                 signalling (0x7C01).
    bfloat16     NaN: torch's vectorised (AVX2/AVX512) kernel writes 0xFFFF whatever the
                 sign; ml_dtypes gives 0x7FC0|sign; torch's own scalar fallback (only at
                 ATEN_CPU_CAPABILITY=default, or for direct fp16/fp8 -> bf16) gives 0x7FC0.
    e4m3fn       torch 2.13 saturates: finite overflow and +-inf give +-448 (0x7E|sign);
                 ml_dtypes gives NaN. NaN gives 0x7F|sign in both.
    e5m2         NaN: torch 0x7F|sign, ml_dtypes 0x7E|sign.

torch's fp16 -> float32 kernel also has a scalar tail (the last n % 8 elements) that writes
0x7FFFFFFF for every NaN; the oracle helpers below pad inputs so torch always runs its
vectorised path, whose results attnkit matches.
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

from attnkit import _C  # noqa: E402


class Fmt:
    def __init__(self, name, torch_dtype, ml_dtype, exp_bits, man_bits, has_inf):
        self.name = name
        self.torch_dtype = torch_dtype
        self.ml_dtype = ml_dtype
        self.exp_bits = exp_bits
        self.man_bits = man_bits
        self.has_inf = has_inf
        self.nbits = 1 + exp_bits + man_bits
        self.bits_dtype = np.uint16 if self.nbits == 16 else np.uint8
        self.sign_bit = 1 << (exp_bits + man_bits)
        exp_ones, man_ones = (1 << exp_bits) - 1, (1 << man_bits) - 1
        # Largest finite positive code (e4m3fn: S.1111.110, others: just below inf).
        top = exp_ones << man_bits
        self.max_code = top - 1 if has_inf else (top | man_ones) - 1

    def __repr__(self):
        return self.name

    def all_codes(self):
        return np.arange(1 << self.nbits, dtype=np.uint32).astype(self.bits_dtype)


FORMATS = [
    Fmt("float16", torch.float16, np.float16, 5, 10, True),
    Fmt("bfloat16", torch.bfloat16, ml_dtypes.bfloat16, 8, 7, True),
    Fmt("float8_e4m3fn", torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 4, 3, False),
    Fmt("float8_e5m2", torch.float8_e5m2, ml_dtypes.float8_e5m2, 5, 2, True),
]
BY_NAME = {f.name: f for f in FORMATS}

# torch's vectorised bf16 kernel (AVX2/AVX512) is what attnkit matches for NaN; see above.
TORCH_BF16_VECTOR_NAN = torch.backends.cpu.get_cpu_capability() != "DEFAULT"

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32}
_TORCH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def f32(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def bits32(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


# ---- attnkit

def ak_widen(fmt, codes):
    out = np.empty(codes.shape, np.float32)
    _C.cast((np.ascontiguousarray(codes), fmt.name), (out, "float32"))
    return out.view(np.uint32)


def ak_narrow(fmt, x):
    out = np.empty(x.shape, fmt.bits_dtype)
    _C.cast((np.ascontiguousarray(x, dtype=np.float32), "float32"), (out, fmt.name))
    return out


# ---- torch (padded to a multiple of 64 elements so only the vectorised kernel runs)

def _pad(a):
    n = a.size
    return np.concatenate([a, np.zeros((-n) % 64, a.dtype)]), n


def _torch_bits(t):
    return t.view(_TORCH_INT[t.element_size()]).numpy().view(
        {1: np.uint8, 2: np.uint16, 4: np.uint32}[t.element_size()])


def torch_widen(fmt, codes):
    padded, n = _pad(codes)
    t = torch.from_numpy(padded.view(_SIGNED[padded.itemsize]).copy()).view(fmt.torch_dtype)
    return _torch_bits(t.to(torch.float32))[:n]


def torch_narrow(fmt, x):
    padded, n = _pad(np.asarray(x, np.float32))
    return _torch_bits(torch.from_numpy(padded).to(fmt.torch_dtype))[:n]


# ---- ml_dtypes

def ml_widen(fmt, codes):
    return codes.view(fmt.ml_dtype).astype(np.float32).view(np.uint32)


def ml_narrow(fmt, x):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, np.float32).astype(fmt.ml_dtype).view(fmt.bits_dtype)


def assert_bits_equal(got, want, inputs, what):
    bad = np.nonzero(got != want)[0]
    if bad.size:
        rows = [f"in 0x{int(inputs[i]):x}: got 0x{int(got[i]):x}, want 0x{int(want[i]):x}"
                for i in bad[:8]]
        pytest.fail(f"{what}: {bad.size} of {got.size} differ\n  " + "\n  ".join(rows))


def is_nan_code(fmt, codes):
    c = codes.astype(np.uint32) & (fmt.sign_bit - 1)
    exp_ones = ((1 << fmt.exp_bits) - 1) << fmt.man_bits
    if fmt.has_inf:
        return c > exp_ones
    return c == exp_ones | ((1 << fmt.man_bits) - 1)


# ---- narrow -> float32: every bit pattern

@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_widen_every_code_matches_torch(fmt):
    codes = fmt.all_codes()
    assert_bits_equal(ak_widen(fmt, codes), torch_widen(fmt, codes), codes, f"{fmt} -> float32")


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_widen_every_code_matches_ml_dtypes(fmt):
    codes = fmt.all_codes()
    got, want = ak_widen(fmt, codes), ml_widen(fmt, codes)
    nan = is_nan_code(fmt, codes)
    assert_bits_equal(got[~nan], want[~nan], codes[~nan], f"{fmt} -> float32 (non-NaN)")
    # NaN payloads differ (see module docstring); NaN-ness and sign agree.
    assert np.isnan(f32(got[nan])).all() and np.isnan(f32(want[nan])).all()
    assert_bits_equal(got[nan] >> 31, want[nan] >> 31, codes[nan], f"{fmt} NaN sign")


# ---- float32 -> narrow

@functools.cache
def strided_sweep():
    """Every 263rd float32 bit pattern (all signs, exponents, NaN and inf regions)."""
    return f32(np.arange(0, 1 << 32, 263, dtype=np.uint64).astype(np.uint32))  # cached: don't modify


SPECIAL_BITS = [
    0x00000000, 0x80000000,                          # +-0
    0x7F800000, 0xFF800000,                          # +-inf
    0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF,  # quiet NaNs
    0x7F800001, 0xFF800001, 0x7FA00000, 0x7FBFFFFF, 0x7F802000,  # signalling NaNs
    0x7FC02000, 0x7FE00000, 0x7FF00000, 0xFFD55555,  # payloads
    0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x00400000,  # float32 subnormals
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000,  # FLT_MAX, bf16 max region
]


def special_values():
    vals = [448, 449, 464, 465, 479, 480, 481, 496, 512, 57344, 57345, 61439, 61440, 61441,
            65504, 65505, 65519, 65520, 65521, 65536, 1e10, 1e30, 3.4e38,
            1.0, 1.5, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 2.0 ** -14, 2.0 ** -16, 2.0 ** -17,
            2.0 ** -24, 2.0 ** -25, 2.0 ** -126, 2.0 ** -133, 2.0 ** -134]
    v = np.array(vals, np.float32)
    near = np.concatenate([v, np.nextafter(v, np.float32(0)), np.nextafter(v, np.float32(np.inf))])
    return np.concatenate([near, -near, f32(SPECIAL_BITS)])


def midpoint_values(fmt):
    """Every representable value of fmt, every midpoint between neighbours (and the virtual
    one above the largest finite value), each +-1 float32 ulp, both signs. All exact."""
    codes = np.arange(0, fmt.max_code + 1, dtype=np.uint32).astype(fmt.bits_dtype)
    v = ak_widen(fmt, codes).view(np.float32).astype(np.float64)
    top = v[-1] + (v[-1] - v[-2])  # next value above max in the same binade spacing
    nxt = np.append(v[1:], top)
    mids = (v + nxt) / 2
    assert (mids.astype(np.float32).astype(np.float64) == mids).all(), "midpoints must be exact"
    mids32 = mids.astype(np.float32)
    vals = np.concatenate([
        v.astype(np.float32), mids32,
        np.nextafter(mids32, np.float32(0)), np.nextafter(mids32, np.float32(np.inf)),
    ])
    return np.concatenate([vals, -vals])


def sweep_inputs(fmt):
    return np.concatenate([strided_sweep(), special_values(), midpoint_values(fmt)])


def assert_narrow_matches_torch(fmt, x, what):
    got, want = ak_narrow(fmt, x), torch_narrow(fmt, x)
    if fmt.name == "bfloat16" and not TORCH_BF16_VECTOR_NAN:
        # torch is running its scalar kernel (NaN -> 0x7FC0); attnkit writes 0xFFFF.
        nan = np.isnan(x)
        assert (got[nan] == 0xFFFF).all()
        got, want, x = got[~nan], want[~nan], x[~nan]
    assert_bits_equal(got, want, bits32(x), what)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_narrow_sweep_matches_torch(fmt):
    assert_narrow_matches_torch(fmt, strided_sweep(), f"float32 -> {fmt} (strided sweep)")


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_narrow_midpoints_matches_torch(fmt):
    x = midpoint_values(fmt)
    assert_narrow_matches_torch(fmt, x, f"float32 -> {fmt} (midpoints)")


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_narrow_specials_match_torch(fmt):
    assert_narrow_matches_torch(fmt, special_values(), f"float32 -> {fmt} (specials)")


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_narrow_matches_ml_dtypes_where_torch_does(fmt):
    x = sweep_inputs(fmt)
    got, want = ak_narrow(fmt, x), ml_narrow(fmt, x)
    keep = ~np.isnan(x)  # NaN encodings differ, see module docstring
    if fmt.name == "float8_e4m3fn":
        keep &= np.abs(x) <= 464  # above: torch (and attnkit) saturate, ml_dtypes gives NaN
    assert_bits_equal(got[keep], want[keep], bits32(x[keep]), f"float32 -> {fmt} vs ml_dtypes")
    # Where they differ, both still agree that NaN in means NaN out.
    nan_in = np.isnan(x)
    assert is_nan_code(fmt, got[nan_in]).all() and is_nan_code(fmt, want[nan_in]).all()


def test_documented_differences_from_ml_dtypes():
    """Pins the torch behaviours attnkit follows where ml_dtypes differs."""
    def one(name, value_bits):
        return int(ak_narrow(BY_NAME[name], f32([value_bits]))[0])

    def ml_one(name, value_bits):
        return int(ml_narrow(BY_NAME[name], f32([value_bits]))[0])

    inf, nan, neg_nan, snan = 0x7F800000, 0x7FC00000, 0xFFC00000, 0x7F800001
    e4 = BY_NAME["float8_e4m3fn"]
    assert one("float8_e4m3fn", inf) == 0x7E == int(torch_narrow(e4, f32([inf]))[0])
    assert one("float8_e4m3fn", 0xFF800000) == 0xFE
    assert one("float8_e4m3fn", 0x43F00000) == 0x7E  # 480.0
    assert ml_one("float8_e4m3fn", inf) == 0x7F  # ml_dtypes: NaN
    assert one("float8_e5m2", neg_nan) == 0xFF and ml_one("float8_e5m2", neg_nan) == 0xFE
    assert one("bfloat16", neg_nan) == 0xFFFF and one("bfloat16", nan) == 0xFFFF
    assert ml_one("bfloat16", neg_nan) == 0xFFC0
    assert one("float16", snan) == 0x7E00 and ml_one("float16", snan) == 0x7C01
    e4_nan = np.array([0x7F, 0xFF], np.uint8)
    assert list(ak_widen(e4, e4_nan)) == [0x7FF00000, 0xFFF00000]
    assert list(ml_widen(e4, e4_nan)) == [0x7FC00000, 0xFFC00000]


# ---- cast() between dtypes

@pytest.mark.parametrize("src", FORMATS, ids=repr)
@pytest.mark.parametrize("dst", FORMATS, ids=repr)
def test_cast_between_narrow_formats(src, dst):
    codes = src.all_codes()
    out = np.empty(codes.shape, dst.bits_dtype)
    _C.cast((codes, src.name), (out, dst.name))
    if src is dst:
        want = codes  # identity: a bit copy, as torch's .to(same dtype)
    else:
        # attnkit casts through float32. torch's direct fp16/fp8 -> bf16 takes a scalar
        # path (NaN -> 0x7FC0), so compare with torch's own two-step conversion.
        via = torch_widen(src, codes).view(np.float32)
        want = torch_narrow(dst, via)
        if dst.name == "bfloat16" and not TORCH_BF16_VECTOR_NAN:
            keep = ~np.isnan(via)
            assert (out[~keep] == 0xFFFF).all()
            out, want, codes = out[keep], want[keep], codes[keep]
    assert_bits_equal(out, want, codes, f"{src} -> {dst}")


INT_SOURCES = {
    "int8": np.arange(-128, 128, dtype=np.int8),
    "uint8": np.arange(0, 256, dtype=np.uint8),
    "int32": np.concatenate([
        np.random.default_rng(0).integers(-2**31, 2**31, 20000, dtype=np.int64),
        np.arange(-70000, 70000),
        [2**31 - 1, -2**31, 16777217, 16777219, -16777219, 448, 464, 465, 480, 57344, 61440,
         65504, 65519, 65520],
    ]).astype(np.int32),
}


@pytest.mark.parametrize("src", list(INT_SOURCES), ids=str)
@pytest.mark.parametrize("dst", ["float32"] + [f.name for f in FORMATS], ids=str)
def test_cast_integer_sources_match_torch(src, dst):
    x = INT_SOURCES[src]
    tdst = torch.float32 if dst == "float32" else BY_NAME[dst].torch_dtype
    want = _torch_bits(torch.from_numpy(x).to(tdst))
    out = np.empty(x.shape, want.dtype)
    _C.cast((x, src), (out, dst))
    assert_bits_equal(out, want, x.view(_SIGNED[x.itemsize]).astype(np.int64), f"{src} -> {dst}")
    if dst == "float32":
        assert (out.view(np.float32) == x.astype(np.float32)).all()  # numpy's static_cast


def test_cast_bool_source():
    b = np.array([0, 1, 2, 255], np.uint8)
    out = np.empty(4, np.float32)
    _C.cast((b, "boolean"), (out, "float32"))
    assert out.tolist() == torch.from_numpy(b).view(torch.bool).to(torch.float32).tolist()


@pytest.mark.parametrize("dst", ["int8", "uint8", "int32", "boolean"])
def test_cast_rejects_non_float_destinations(dst):
    x = np.ones(4, np.float32)
    out = np.zeros(4, {"int32": np.int32, "int8": np.int8}.get(dst, np.uint8))
    with pytest.raises(ValueError, match=dst):
        _C.cast((x, "float32"), (out, dst))


def test_cast_unknown_dtype_name():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r'unknown dtype "foo"; expected one of float32, float16'):
        _C.cast((x, "foo"), (np.empty(4, np.float32), "float32"))


def test_cast_contiguous_2d():
    x = strided_sweep()[:4096].reshape(64, 64)
    out = np.empty((64, 64), np.uint16)
    _C.cast((x, "float32"), (out, "float16"))
    assert_bits_equal(out.ravel(), torch_narrow(BY_NAME["float16"], x.ravel()), bits32(x.ravel()),
                      "2-d float32 -> float16")
