"""Correctness of attnkit.attention against the float64 reference (reference.py)."""

import itertools
import math

import numpy as np
import pytest

import attnkit
from conftest import (DTYPES, MASK_SHAPES, assert_bits_equal, assert_unmodified, bhsd_shape,
                      make_mask, make_qkv, np_dtype, poison, randn, snapshot, strided_like,
                      strided_out, to_torch)
from reference import assert_close, attention_ref, pv_magnitude, softmax_ref, tolerance

torch = pytest.importorskip("torch")

LENGTHS = [1, 7, 63, 64, 65, 257]
HEAD_DIMS = [16, 64, 80, 96, 128, 192, 256]
CAUSALS = [False, True, "top_left", "bottom_right"]


# ---------------------------------------------------------------------------------------
# One case: inputs, the call, and the checks every call gets.
# ---------------------------------------------------------------------------------------

def run_checked(q, k, v, *, dtype, mask=None, causal=False, scale=None, enable_gqa=False,
                layout="BHSD", out_mode="poison", rng=None, tol_scale=1.0):
    """Calls attnkit.attention with return_lse=True and checks out and lse against the
    reference, that out was fully written, that out= is returned as is, that the backing
    buffer of a strided out was not written outside the view, and that no input changed.
    out_mode: "poison" (NaN-filled contiguous out=), "strided" (NaN-filled strided out=) or
    "none" (out=None)."""
    ref_out, ref_lse = attention_ref(q, k, v, mask, causal, scale, enable_gqa, layout)
    before = snapshot(q, k, v, mask)
    is_torch = isinstance(q, torch.Tensor)
    buf = None
    if out_mode == "poison":
        out = poison(ref_out.shape, np_dtype(dtype))
    elif out_mode == "strided":
        out, buf = strided_out(ref_out.shape, dtype, rng)
    else:
        assert out_mode == "none"
        out = None
    if out is not None and is_torch:
        out = to_torch(out)
    res = attnkit.attention(q, k, v, attn_mask=mask, causal=causal, scale=scale,
                            enable_gqa=enable_gqa, layout=layout, return_lse=True, out=out)
    assert isinstance(res, tuple) and len(res) == 2
    got, lse = res
    if out is not None:
        assert got is out, "out= must be returned as the same object"
    if is_torch:
        assert isinstance(got, torch.Tensor) and isinstance(lse, torch.Tensor)
        assert got.dtype == q.dtype and lse.dtype == torch.float32
    else:
        assert isinstance(got, np.ndarray) and isinstance(lse, np.ndarray)
        assert got.dtype == np_dtype(dtype) and lse.dtype == np.float32
    assert tuple(got.shape) == ref_out.shape and tuple(lse.shape) == ref_lse.shape
    magnitude = pv_magnitude(q, k, v, mask, causal, scale, enable_gqa, layout)
    atol, rtol = tolerance(dtype, "out", tol_scale, magnitude)
    assert_close(got, ref_out, atol, rtol, "out")
    atol, rtol = tolerance(dtype, "lse", tol_scale)
    assert_close(lse, ref_lse, atol, rtol, "lse")
    assert_unmodified(before, (q, k, v, mask))
    result = (got.clone() if is_torch else got.copy(), lse)
    if buf is not None:  # re-poison the view: then the whole backing buffer must be NaN
        view = got.numpy() if is_torch and got.dtype != torch.bfloat16 else got
        if is_torch and got.dtype == torch.bfloat16:
            got.fill_(float("nan"))
        else:
            view[...] = np.nan
        assert np.isnan(buf.astype(np.float32)).all(), "out= was written outside its view"
    return result


def random_config(seed):
    """A reproducible random configuration covering the axes of the spec."""
    r = np.random.default_rng(1000 + seed)
    B = int(r.integers(1, 4))
    ratio = int(r.choice([1, 2, 4, 8, 0]))  # 0: MQA
    if ratio == 0:
        Hkv, Hq = 1, int(r.choice([2, 3, 5]))
    else:
        Hkv = int(r.integers(1, 3))
        Hq = Hkv * ratio
    D = int(r.choice(HEAD_DIMS))
    Dv = D if r.random() < 0.6 else int(r.choice(HEAD_DIMS))
    Sq, Skv = (int(x) for x in r.choice(LENGTHS, 2))
    # Keep the work small: big head dims go with small lengths.
    while B * Hq * Sq * Skv * (D + Dv) > 2.5e7:
        if Sq >= Skv:
            Sq = LENGTHS[LENGTHS.index(Sq) - 1]
        else:
            Skv = LENGTHS[LENGTHS.index(Skv) - 1]
    mask_kind = r.choice([None, "bool", "float"])
    mask_shape = str(r.choice(list(MASK_SHAPES)))
    mask_dtype = str(r.choice(DTYPES))
    return dict(B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D, Dv=Dv,
                layout=str(r.choice(["BHSD", "BSHD"])),
                causal=CAUSALS[int(r.integers(len(CAUSALS)))],
                mask_kind=None if mask_kind is None else str(mask_kind),
                mask_shape=mask_shape, mask_dtype=mask_dtype,
                strided=bool(r.random() < 0.4),
                scale=[None, None, 0.3, 1.0 / D][int(r.integers(4))],
                seed=seed)


def build(cfg, dtype, rng=None):
    """(q, k, v, mask) numpy inputs for a config; strided views when cfg says so."""
    r = np.random.default_rng(cfg["seed"]) if rng is None else rng
    q, k, v = make_qkv(r, cfg["B"], cfg["Hq"], cfg["Hkv"], cfg["Sq"], cfg["Skv"], cfg["D"],
                       cfg["Dv"], dtype, cfg["layout"])
    mask = None
    if cfg["mask_kind"]:
        shape = MASK_SHAPES[cfg["mask_shape"]](cfg["B"], cfg["Hq"], cfg["Sq"], cfg["Skv"])
        mask = make_mask(r, cfg["mask_kind"], shape, cfg["mask_dtype"])
    if cfg["strided"]:
        q, k, v = (strided_like(x, r)[0] for x in (q, k, v))
        if mask is not None:
            mask = strided_like(mask, r)[0]
    return q, k, v, mask


def call_cfg(cfg, q, k, v, mask, dtype, out_mode, rng):
    return run_checked(q, k, v, dtype=dtype, mask=mask, causal=cfg["causal"], scale=cfg["scale"],
                       enable_gqa=cfg["Hq"] != cfg["Hkv"], layout=cfg["layout"],
                       out_mode=out_mode, rng=rng)


# ---------------------------------------------------------------------------------------
# Randomised configurations.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_config(dtype, seed):
    cfg = random_config(seed)
    rng = np.random.default_rng(seed)
    q, k, v, mask = build(cfg, dtype)
    got, lse = call_cfg(cfg, q, k, v, mask, dtype, "strided" if cfg["strided"] else "poison", rng)
    got2, lse2 = call_cfg(cfg, q, k, v, mask, dtype, "none", rng)
    assert_bits_equal(got2, got, "out (out=None vs out=)")
    assert_bits_equal(lse2, lse, "lse (out=None vs out=)")
    plain = attnkit.attention(q, k, v, attn_mask=mask, causal=cfg["causal"], scale=cfg["scale"],
                              enable_gqa=cfg["Hq"] != cfg["Hkv"], layout=cfg["layout"])
    assert isinstance(plain, np.ndarray)
    assert_bits_equal(plain, got, "out (return_lse=False)")


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_config_every_isa(isa, dtype, seed):
    cfg = random_config(100 + seed)
    q, k, v, mask = build(cfg, dtype)
    call_cfg(cfg, q, k, v, mask, dtype, "strided" if cfg["strided"] else "poison",
             np.random.default_rng(seed))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_config_torch(dtype, seed):
    cfg = random_config(200 + seed)
    q, k, v, mask = build(cfg, dtype)
    q, k, v = (to_torch(x) for x in (q, k, v))
    mask = None if mask is None else to_torch(mask)
    call_cfg(cfg, q, k, v, mask, dtype, "strided" if cfg["strided"] else "poison",
             np.random.default_rng(seed))
    call_cfg(cfg, q, k, v, mask, dtype, "none", None)


@pytest.mark.parametrize("seed", range(6))
def test_isas_and_threads_agree(seed, restore_runtime):
    dtype = DTYPES[seed % 3]
    cfg = random_config(300 + seed)
    q, k, v, mask = build(cfg, dtype)
    args = (mask, cfg["causal"], cfg["scale"], cfg["Hq"] != cfg["Hkv"], cfg["layout"])
    ref_out, ref_lse = attention_ref(q, k, v, *args)
    out_tol = tolerance(dtype, "out", magnitude=pv_magnitude(q, k, v, *args))
    results = {}
    for isa_name in attnkit.supported_isas():
        for n in (1, 2):
            attnkit.set_isa(isa_name)
            attnkit.set_num_threads(n)
            out, lse = attnkit.attention(q, k, v, attn_mask=mask, causal=cfg["causal"],
                                         scale=cfg["scale"], enable_gqa=cfg["Hq"] != cfg["Hkv"],
                                         layout=cfg["layout"], return_lse=True,
                                         out=poison(ref_out.shape, np_dtype(dtype)))
            assert_close(out, ref_out, *out_tol, f"out[{isa_name}, {n} threads]")
            assert_close(lse, ref_lse, *tolerance(dtype, "lse"), f"lse[{isa_name}, {n} threads]")
            results[isa_name, n] = (out, lse)
    (out0, lse0) = results[attnkit.supported_isas()[0], 1]
    for key, (out, lse) in results.items():
        assert_close(out, out0.astype(np.float64), *out_tol, f"out {key} vs first")
        assert_close(lse, lse0.astype(np.float64), *tolerance(dtype, "lse"), f"lse {key} vs first")


@pytest.mark.parametrize("seed", range(3))
def test_threads(threads, seed):
    cfg = random_config(400 + seed)
    q, k, v, mask = build(cfg, "float32")
    call_cfg(cfg, q, k, v, mask, "float32", "poison", None)


# ---------------------------------------------------------------------------------------
# Targeted axes.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (4, 2), (8, 2), (8, 1), (16, 2), (5, 1), (1, 1),
                                   (96, 1), (128, 2)])
def test_gqa_ratios(rng, Hq, Hkv, layout):
    dtype = "float32"
    q, k, v = make_qkv(rng, 2, Hq, Hkv, 65, 70, 32, 24, dtype, layout)
    run_checked(q, k, v, dtype=dtype, enable_gqa=Hq != Hkv, layout=layout, causal="bottom_right")
    if Hq == Hkv:  # enable_gqa=True with equal heads is plain attention
        run_checked(q, k, v, dtype=dtype, enable_gqa=True, layout=layout)


# Decode over K/V whose kv heads lie side by side ([B, S, H, D]) runs up to 16 kv heads per
# task through the same key blocks: 17 and 40 kv heads leave a partial group (17 = 16 + 1
# takes the one-head path for the last), long keys are split across tasks.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv,Sq,Skv", [(8, 2, 1, 1100), (32, 16, 2, 300), (17, 17, 1, 2500),
                                           (80, 40, 1, 77), (12, 3, 3, 130)])
def test_decode_over_interleaved_kv_heads(rng, dtype, Hq, Hkv, Sq, Skv, isa):
    q, k, v = make_qkv(rng, 2, Hq, Hkv, Sq, Skv, 64, 40, dtype, "BSHD")
    run_checked(q, k, v, dtype=dtype, enable_gqa=Hq != Hkv, layout="BSHD", causal="bottom_right")


@pytest.mark.parametrize("Sq,Skv", list(itertools.product(LENGTHS, LENGTHS)))
def test_lengths(rng, Sq, Skv):
    dtype = "float32"
    causal = ["bottom_right", True, False][(Sq + Skv) % 3]
    q, k, v = make_qkv(rng, 1, 2, 2, Sq, Skv, 16, 16, dtype)
    run_checked(q, k, v, dtype=dtype, causal=causal)


@pytest.mark.parametrize("D,Dv", [(d, d) for d in HEAD_DIMS]
                         + [(16, 256), (256, 16), (80, 96), (192, 64), (64, 192), (1, 1),
                            (3, 5), (33, 7), (511, 9), (512, 512), (8, 512)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(rng, dtype, D, Dv):
    S = 65 if max(D, Dv) <= 128 else 20
    q, k, v = make_qkv(rng, 1, 2, 1, S, S + 3, D, Dv, dtype, "BSHD")
    run_checked(q, k, v, dtype=dtype, enable_gqa=True, layout="BSHD", causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts_equivalent(rng, dtype):
    q, k, v = make_qkv(rng, 2, 4, 2, 40, 70, 32, 48, dtype, "BHSD")
    mask = make_mask(rng, "float", (2, 1, 40, 70))
    a = attnkit.attention(q, k, v, attn_mask=mask, causal="bottom_right", enable_gqa=True)
    t = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
    run_checked(*t, dtype=dtype, mask=mask, causal="bottom_right", enable_gqa=True, layout="BSHD")
    b = attnkit.attention(*[np.ascontiguousarray(x) for x in t], attn_mask=mask,
                          causal="bottom_right", enable_gqa=True, layout="BSHD")
    magnitude = pv_magnitude(q, k, v, mask, "bottom_right", None, True)
    assert_close(b.transpose(0, 2, 1, 3), a.astype(np.float64), *tolerance(dtype, magnitude=magnitude),
                 "BSHD vs BHSD")


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs_and_out(rng, dtype, layout):
    q, k, v = make_qkv(rng, 2, 4, 2, 65, 67, 40, 24, dtype, layout)
    mask = make_mask(rng, "bool", (2, 4, 65, 67))
    sq, sk, sv = (strided_like(x, rng)[0] for x in (q, k, v))
    smask = strided_like(mask, rng)[0]
    assert not any(x.flags.c_contiguous for x in (sq, sk, sv, smask))
    run_checked(sq, sk, sv, dtype=dtype, mask=smask, causal=True, enable_gqa=True, layout=layout,
                out_mode="strided", rng=rng)
    # torch views of the same strided buffers
    tq, tk, tv, tm = (to_torch(x) for x in (sq, sk, sv, smask))
    assert not tq.is_contiguous()
    run_checked(tq, tk, tv, dtype=dtype, mask=tm, causal=True, enable_gqa=True, layout=layout,
                out_mode="strided", rng=rng)


def test_negative_strides(rng):
    """numpy views with negative strides are any strides too."""
    dtype = "float32"
    q, k, v = make_qkv(rng, 1, 2, 2, 30, 40, 16, 16, dtype)
    nq, nk, nv = (strided_like(x, rng, allow_negative=True)[0] for x in (q, k, v))
    assert any(s < 0 for x in (nq, nk, nv) for s in x.strides)
    run_checked(nq, nk, nv, dtype=dtype, causal=True)
    out = np.flip(poison((1, 2, 30, 16), dtype), axis=2)
    got = attnkit.attention(q, k, v, causal=True, out=out)
    assert got is out
    assert_close(got, attention_ref(q, k, v, causal=True)[0], *tolerance(dtype))  # float32


def test_broadcast_and_readonly_inputs(rng):
    """Inputs are never modified, so read-only and zero-stride (broadcast) views are valid
    inputs ("any strides are accepted")."""
    dtype = "float32"
    q, k, v = make_qkv(rng, 2, 2, 2, 9, 11, 16, 16, dtype)
    for x in (q, k, v):
        x.setflags(write=False)
    run_checked(q, k, v, dtype=dtype)
    kb = np.broadcast_to(k[:, :1], k.shape)  # one kv head shared by both, stride 0
    vb = np.broadcast_to(v[:1], v.shape)     # one batch shared, stride 0
    mb = np.broadcast_to(rng.random((1, 1, 1, 11)) < 0.8, (2, 2, 9, 11))
    run_checked(q, kb, vb, dtype=dtype, mask=mb)


@pytest.mark.parametrize("shape_kind", list(MASK_SHAPES))
@pytest.mark.parametrize("kind,mask_dtype", [("bool", None), ("float", "float32"),
                                             ("float", "float16"), ("float", "bfloat16")])
def test_mask_broadcast(rng, shape_kind, kind, mask_dtype):
    B, Hq, Hkv, Sq, Skv = 2, 4, 2, 33, 70
    layout = "BSHD" if shape_kind in ("HSqSkv", "B11Skv") else "BHSD"
    q, k, v = make_qkv(rng, B, Hq, Hkv, Sq, Skv, 32, 32, "float32", layout)
    mask = make_mask(rng, kind, MASK_SHAPES[shape_kind](B, Hq, Sq, Skv), mask_dtype or "float32")
    run_checked(q, k, v, dtype="float32", mask=mask, enable_gqa=True, layout=layout)
    run_checked(q, k, v, dtype="float32", mask=mask, enable_gqa=True, layout=layout,
                causal="bottom_right")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_dtype_independent_of_q(rng, dtype):
    q, k, v = make_qkv(rng, 1, 2, 2, 20, 30, 16, 16, dtype)
    for md in DTYPES:
        mask = make_mask(rng, "float", (20, 30), md)
        run_checked(q, k, v, dtype=dtype, mask=mask)


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(rng, dtype, layout):
    """Rows with no attendable key give out = 0 exactly and lse = -inf."""
    B, H, Sq, Skv = 2, 2, 70, 67
    q, k, v = make_qkv(rng, B, H, H, Sq, Skv, 32, 16, dtype, layout)

    def rows(out):
        return out if layout == "BHSD" else out.transpose(0, 2, 1, 3)

    bmask = rng.random((B, H, Sq, Skv)) < 0.6
    bmask[0, 1, [0, 5, 69]] = False
    bmask[1, :, 64:] = False
    out, lse = run_checked(q, k, v, dtype=dtype, mask=bmask, layout=layout)
    assert np.all(rows(out)[0, 1, [0, 5, 69]].astype(np.float32) == 0)
    assert np.all(np.isneginf(lse[0, 1, [0, 5, 69]])) and np.all(np.isneginf(lse[1, :, 64:]))

    fmask = make_mask(rng, "float", (B, 1, Sq, Skv))
    fmask[:, :, [3, 66]] = -np.inf
    out, lse = run_checked(q, k, v, dtype=dtype, mask=fmask, layout=layout)
    assert np.all(rows(out)[:, :, [3, 66]].astype(np.float32) == 0)
    assert np.all(np.isneginf(lse[:, :, [3, 66]]))

    # causal and mask together leave row i with no key: mask row allows only keys > i
    i = np.arange(Sq)[:, None]
    j = np.arange(Skv)[None, :]
    cmask = j > i + 1000 * (i % 2)  # odd rows: nothing; even rows: keys after i (causal cut)
    out, lse = run_checked(q, k, v, dtype=dtype, mask=cmask, layout=layout, causal=True)
    assert np.all(np.isneginf(lse))
    assert np.all(out.astype(np.float32) == 0)


@pytest.mark.parametrize("causal", [True, "top_left", "bottom_right"])
@pytest.mark.parametrize("Sq,Skv", [(1, 257), (7, 65), (63, 257), (65, 64), (257, 63),
                                    (64, 7), (65, 1), (64, 64), (100, 130)])
def test_causal(rng, causal, Sq, Skv):
    dtype = "float32"
    q, k, v = make_qkv(rng, 2, 4, 1, Sq, Skv, 24, 40, dtype)
    out, lse = run_checked(q, k, v, dtype=dtype, causal=causal, enable_gqa=True)
    if causal == "bottom_right" and Sq > Skv:  # the first Sq - Skv rows see no key
        assert np.all(np.isneginf(lse[:, :, : Sq - Skv]))
        assert np.all(out[:, :, : Sq - Skv] == 0)
        assert np.all(np.isfinite(lse[:, :, Sq - Skv:]))
    else:
        assert np.all(np.isfinite(lse))


def test_causal_conventions_differ(rng):
    q, k, v = make_qkv(rng, 1, 1, 1, 5, 9, 8, 8, "float32")
    a = attnkit.attention(q, k, v, causal=True)
    b = attnkit.attention(q, k, v, causal="top_left")
    c = attnkit.attention(q, k, v, causal="bottom_right")
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)
    # last query row sees every key with bottom_right: equals the non-causal row
    full = attnkit.attention(q, k, v)
    assert_close(c[0, 0, -1], full[0, 0, -1].astype(np.float64), *tolerance("float32"))
    assert_close(attnkit.attention(q, k, v, causal=False), full.astype(np.float64),
                 *tolerance("float32"))
    assert_close(attnkit.attention(q, k, v, causal=None), full.astype(np.float64),
                 *tolerance("float32"))


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_skv_zero(rng, kind, layout, causal):
    """No keys at all: every row gives out = 0 and lse = -inf."""
    q, k, v = make_qkv(rng, 2, 4, 2, 5, 0, 16, 8, "float32", layout)
    mask = np.ones((5, 0), dtype=bool)
    if kind == "torch":
        q, k, v, mask = (to_torch(x) for x in (q, k, v, mask))
    out, lse = run_checked(q, k, v, dtype="float32", causal=causal, layout=layout,
                           enable_gqa=True, mask=mask)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
    out, lse = run_checked(q, k, v, dtype="float32", causal=causal, layout=layout,
                           enable_gqa=True, out_mode="none")
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("dims", [(0, 2, 2, 5, 7), (2, 0, 0, 5, 7), (2, 0, 2, 5, 7),
                                  (2, 2, 2, 0, 7), (0, 0, 0, 0, 0), (1, 2, 1, 0, 0)])
def test_empty_result(rng, kind, layout, dims):
    B, Hq, Hkv, Sq, Skv = dims
    q, k, v = make_qkv(rng, B, Hq, Hkv, Sq, Skv, 16, 8, "float32", layout)
    if kind == "torch":
        q, k, v = (to_torch(x) for x in (q, k, v))
    gqa = Hq != Hkv
    out, lse = attnkit.attention(q, k, v, enable_gqa=gqa, layout=layout, return_lse=True,
                                 causal=True)
    assert tuple(out.shape) == bhsd_shape(layout, B, Hq, Sq, 8) and out.dtype == q.dtype
    assert tuple(lse.shape) == (B, Hq, Sq)
    assert out.numel() == 0 if kind == "torch" else out.size == 0
    shape = bhsd_shape(layout, B, Hq, Sq, 8)
    given = torch.empty(shape) if kind == "torch" else np.empty(shape, np.float32)
    assert attnkit.attention(q, k, v, enable_gqa=gqa, layout=layout, out=given) is given


@pytest.mark.parametrize("scale", [0.0, 0.05, 2, -0.7, 1e-3, 3.5])
def test_scale(rng, scale):
    q, k, v = make_qkv(rng, 1, 2, 2, 37, 70, 16, 16, "float32")
    run_checked(q, k, v, dtype="float32", scale=scale, causal="bottom_right")


def test_default_scale_is_inverse_sqrt_d(rng):
    q, k, v = make_qkv(rng, 1, 2, 2, 17, 30, 48, 16, "float32")
    a = attnkit.attention(q, k, v)
    b = attnkit.attention(q, k, v, scale=1.0 / math.sqrt(48))
    assert_close(a, b.astype(np.float64), *tolerance("float32"))


def test_large_scores_stable(rng):
    """Scores around +-200 with peaked softmax: no overflow, exact online rescaling."""
    q, k, v = make_qkv(rng, 1, 2, 2, 65, 200, 16, 16, "float32", scale=4.0)
    run_checked(q, k, v, dtype="float32", scale=1.0, causal="bottom_right")
    mask = make_mask(rng, "float", (65, 200)) * np.float32(50)
    run_checked(q, k, v, dtype="float32", scale=1.0, mask=mask)


@pytest.mark.parametrize("scale", [0.5, 0.9, 1.2])
@pytest.mark.parametrize("size", [5e3, 2e38])
def test_huge_finite_logits_bfloat16(rng, isa, size, scale):
    """bf16 logits of about `size` (finite once scaled), over two AMX key tiles: the bf16
    softmax that folds the scale into one FMA per exponent rounds its reference -m·log2 e
    by up to |m|·2^-24, which near 1e38 sent every P of a row to 0 (NaN rows, lse -inf);
    such rows take the scaled scores rounded first. At 5e3 the logits differ by O(1), so the
    softmax spreads over both tiles."""
    Sq, Skv, D = 24, 700, 16
    q, k, v = make_qkv(rng, 1, 2, 2, Sq, Skv, D, 16, "float32")
    if size > 1e6:  # one-hot rows: logit q0·k0 up to 2.3e38
        q[..., 0], k[..., 0] = 1.6e19, rng.uniform(0.3, 0.9, size=(1, 2, Skv)) * 1.6e19
    else:  # logit size + O(1): q0·k0 the same for every key
        q[..., 0], k[..., 0] = size / 64, 64.0
    bf16 = np_dtype("bfloat16")
    run_checked(q.astype(bf16), k.astype(bf16), v.astype(bf16), dtype="bfloat16", scale=scale)


@pytest.mark.parametrize("mask_dtype", DTYPES)
def test_finite_min_float_mask(rng, mask_dtype):
    """An additive mask of the dtype's most negative finite value (the usual HF-style mask)
    is a finite bias. On part of a row it removes those keys; on a whole row every key has
    the same huge bias, so the row still has attendable keys (torch SDPA gives the softmax
    of the row, uniform when the bias swamps the scores in float32): not out = 0, lse = -inf."""
    q, k, v = make_qkv(rng, 1, 2, 2, 10, 70, 16, 16, "float32")
    lo = float(np.finfo(np.float32).min) if mask_dtype == "float32" else (
        float(np.finfo(np.float16).min) if mask_dtype == "float16" else -3.3895313892515355e38)
    mask = np.zeros((10, 70), dtype=np_dtype(mask_dtype))
    mask[:, 40:] = lo           # partial rows: keys 40.. effectively dropped
    mask[3, :] = lo             # row 3: every key at the same huge negative bias
    partial = np.arange(10) != 3
    out, lse = attnkit.attention(q, k, v, attn_mask=mask, return_lse=True,
                                 out=poison((1, 2, 10, 16), np.float32))
    ref_out, ref_lse = attention_ref(q, k, v, mask)
    assert_close(out[:, :, partial], ref_out[:, :, partial], *tolerance("float32"), "partial rows")
    assert_close(lse[:, :, partial], ref_lse[:, :, partial], *tolerance("float32", "lse"),
                 "partial rows lse")
    # Row 3: float32 cannot hold score differences next to |lo| (ulp(65504) ~ 0.004 for the
    # float16 mask; the float32 / bf16 minimum swamps the scores to a uniform softmax), so
    # this row is checked loosely (2e-2) against the float64 reference.
    assert np.all(np.isfinite(lse[:, :, 3])), f"row 3 treated as empty: lse {lse[:, :, 3]}"
    assert_close(out[:, :, 3], ref_out[:, :, 3], 2e-2, 2e-2, "row 3 out")
    assert_close(lse[:, :, 3], ref_lse[:, :, 3], 0, 1e-5, "row 3 lse")


# ---------------------------------------------------------------------------------------
# Return kinds, out= and inputs.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_in_numpy_out(rng, dtype):
    q, k, v = make_qkv(rng, 1, 2, 2, 8, 9, 16, 12, dtype)
    out = attnkit.attention(q, k, v)
    assert type(out) is np.ndarray and out.dtype == np_dtype(dtype) and out.shape == (1, 2, 8, 12)
    assert out.flags.c_contiguous
    out, lse = attnkit.attention(q, k, v, return_lse=True)
    assert type(lse) is np.ndarray and lse.dtype == np.float32 and lse.shape == (1, 2, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_in_torch_out(rng, dtype):
    q, k, v = (to_torch(x) for x in make_qkv(rng, 1, 2, 2, 8, 9, 16, 12, dtype))
    out = attnkit.attention(q, k, v)
    assert type(out) is torch.Tensor and out.dtype == q.dtype and tuple(out.shape) == (1, 2, 8, 12)
    out, lse = attnkit.attention(q, k, v, return_lse=True)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (1, 2, 8)
    assert_close(out, attention_ref(q, k, v)[0], *tolerance(dtype, magnitude=pv_magnitude(q, k, v)))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_out_is_returned(rng, kind):
    q, k, v = make_qkv(rng, 1, 2, 2, 8, 9, 16, 12, "float32")
    out = poison((1, 2, 8, 12), np.float32)
    if kind == "torch":
        q, k, v, out = (to_torch(x) for x in (q, k, v, out))
    assert attnkit.attention(q, k, v, out=out) is out
    res = attnkit.attention(q, k, v, out=out, return_lse=True)
    assert res[0] is out
    assert_close(out, attention_ref(q, k, v)[0], *tolerance("float32"))


def test_out_overwritten_not_accumulated(rng):
    q, k, v = make_qkv(rng, 1, 2, 2, 8, 9, 16, 12, "float32")
    out = np.full((1, 2, 8, 12), 1e6, np.float32)
    attnkit.attention(q, k, v, out=out)
    assert_close(out, attention_ref(q, k, v)[0], *tolerance("float32"))


def test_repeated_calls_deterministic(rng):
    cfg = random_config(7)
    q, k, v, mask = build(cfg, "float32")
    kw = dict(attn_mask=mask, causal=cfg["causal"], enable_gqa=cfg["Hq"] != cfg["Hkv"],
              layout=cfg["layout"], return_lse=True)
    a = attnkit.attention(q, k, v, **kw)
    b = attnkit.attention(q, k, v, **kw)
    assert_bits_equal(a[0], b[0], "out")
    assert_bits_equal(a[1], b[1], "lse")


# ---------------------------------------------------------------------------------------
# Dropout.
# ---------------------------------------------------------------------------------------

def identity_v(B, Hkv, Skv, Dv, dtype="float32", layout="BHSD"):
    """v with v[b, h, j] = e_j, so that out[b, h, i, j] = P_ij * keep_ij / (1 - p)."""
    assert Dv >= Skv
    v = np.zeros((B, Hkv, Skv, Dv), np.float64)
    v[:, :, np.arange(Skv), np.arange(Skv)] = 1.0
    if layout == "BSHD":
        v = v.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(v).astype(np_dtype(dtype))


def recover_keep(q, k, p, seed, mask=None, causal=False, enable_gqa=True, layout="BHSD",
                 dtype="float32", Dv=None):
    """Runs attnkit with identity v and returns (keep mask [B,Hq,Sq,Skv], probabilities,
    raw out in BHSD)."""
    if layout == "BHSD":
        B, Hkv, Skv, _ = k.shape
    else:
        B, Skv, Hkv, _ = k.shape
    Dv = Dv or Skv + 3
    v = identity_v(B, Hkv, Skv, Dv, dtype, layout)
    out = attnkit.attention(q, k, v, attn_mask=mask, causal=causal, dropout_p=p, seed=seed,
                            enable_gqa=enable_gqa, layout=layout)
    out = out.astype(np.float64)
    if layout == "BSHD":
        out = out.transpose(0, 2, 1, 3)
    assert np.all(out[..., Skv:] == 0)
    probs = softmax_ref(q, k, mask, causal, None, enable_gqa, layout)
    return out[..., :Skv] != 0, probs, out[..., :Skv]


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_recovered_keep_mask(rng, p):
    B, Hq, Hkv, Sq, Skv = 2, 4, 2, 65, 130
    q, k, _ = make_qkv(rng, B, Hq, Hkv, Sq, Skv, 32, 1, "float32", scale=0.5)
    keep, probs, out = recover_keep(q, k, p, seed=1234)
    assert np.all(probs > 0)  # so a zero in out can only be a dropped key
    # every kept entry is the undropped softmax / (1 - p)
    assert_close(np.where(keep, out, 0), np.where(keep, probs / (1 - p), 0),
                 *tolerance("float32"), "kept probabilities")
    n = keep.size
    sigma = math.sqrt(p * (1 - p) / n)
    dropped = 1 - keep.mean()
    assert abs(dropped - p) < 5 * sigma, (dropped, p)
    # each of the 4 lanes of one Philox draw, and every (b, h), is dropped at rate p
    for c in range(4):
        frac = 1 - keep[..., c::4].mean()
        assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / keep[..., c::4].size), (c, frac)
    # adjacent keys are independent: P(both kept) = (1 - p)^2
    both = (keep[..., 1:] & keep[..., :-1]).mean()
    assert abs(both - (1 - p) ** 2) < 5 * math.sqrt((1 - p) ** 2 / keep[..., 1:].size), both
    # the decision depends on b, on h (even within one GQA group) and on i
    assert not np.array_equal(keep[0], keep[1])
    assert not np.array_equal(keep[0, 0], keep[0, 1])  # heads 0 and 1 share kv head 0
    assert not np.array_equal(keep[0, 0, 0], keep[0, 0, 1])

    # the same seed gives the same keep decisions with any v, in either layout
    v = randn(rng, (B, Hkv, Skv, 24))
    got, lse = attnkit.attention(q, k, v, dropout_p=p, seed=1234, enable_gqa=True,
                                 return_lse=True, out=poison((B, Hq, Sq, 24), np.float32))
    ref_out, ref_lse = attention_ref(q, k, v, enable_gqa=True, dropout_keep=keep, dropout_p=p)
    assert_close(got, ref_out, *tolerance("float32"), "dropout out")
    assert_close(lse, ref_lse, *tolerance("float32", "lse"), "dropout lse")
    t = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)]
    got_bshd = attnkit.attention(*t, dropout_p=p, seed=1234, enable_gqa=True, layout="BSHD")
    assert_close(got_bshd.transpose(0, 2, 1, 3), ref_out, *tolerance("float32"), "BSHD dropout")


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_with_mask_and_causal(rng, p):
    B, Hq, Sq, Skv = 1, 2, 40, 70
    q, k, _ = make_qkv(rng, B, Hq, Hq, Sq, Skv, 16, 1, "float32", layout="BSHD", scale=0.5)
    mask = make_mask(rng, "float", (B, 1, Sq, Skv))
    keep, probs, out = recover_keep(q, k, p, seed=99, mask=mask, causal="bottom_right",
                                    layout="BSHD")
    visible = probs > 0
    assert np.all(out[~visible] == 0)
    keep_v = keep[visible]
    assert abs((1 - keep_v.mean()) - p) < 5 * math.sqrt(p * (1 - p) / keep_v.size)
    assert_close(np.where(keep, out, 0), np.where(keep, probs / (1 - p), 0),
                 *tolerance("float32"), "kept probabilities")


def _dropout_runs(rng, p, dtype, combos):
    q, k, v = make_qkv(rng, 2, 4, 2, 70, 100, 32, 40, dtype)
    mask = make_mask(rng, "bool", (70, 100), p_attend=0.9)
    results = {}
    for isa_name, n in combos:
        attnkit.set_isa(isa_name)
        attnkit.set_num_threads(n)
        results[isa_name, n] = attnkit.attention(
            q, k, v, attn_mask=mask, causal="bottom_right", dropout_p=p, seed=2024,
            enable_gqa=True, return_lse=True)
    key0 = next(iter(results))
    out0, lse0 = results[key0]
    for key, (out, lse) in results.items():
        assert_bits_equal(out, out0, f"dropout out {key} vs {key0}")
        assert_bits_equal(lse, lse0, f"lse {key} vs {key0}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_bit_identical_across_threads(rng, isa, p, dtype, restore_runtime):
    _dropout_runs(rng, p, dtype, [(isa, 1), (isa, 2)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_bit_identical_across_fma_isas(rng, p, dtype, restore_runtime):
    """One seed gives bit-identical output for any thread count on every ISA with the same
    arithmetic: fp32 FMAs in the same order (avx512, avx2, and avx512bf16 and avx512amx
    except for bf16 inputs, whose products they sum in pairs with vdpbf16ps or on AMX
    tiles). The portable path rounds a*b+c
    twice (baseline x86-64 has no FMA), so its output may differ in the last bits; the
    dropout decisions are identical on every path (test_dropout_keep_mask_same_across_isas)."""
    other_arithmetic = {"generic"} | ({"avx512bf16", "avx512amx"} if dtype == "bfloat16" else set())
    isas = [i for i in attnkit.supported_isas() if i not in other_arithmetic]
    if not isas:
        pytest.skip("no FMA ISA on this CPU")
    _dropout_runs(rng, p, dtype, [(i, n) for i in isas for n in (1, 2)])


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_mask_same_across_isas(rng, p, restore_runtime):
    q, k, _ = make_qkv(rng, 1, 4, 1, 33, 70, 16, 1, "float32", scale=0.5)
    keeps = []
    for isa_name in attnkit.supported_isas():
        for n in (1, 2):
            attnkit.set_isa(isa_name)
            attnkit.set_num_threads(n)
            keeps.append(recover_keep(q, k, p, seed=77)[0])
    for kp in keeps[1:]:
        assert np.array_equal(kp, keeps[0])


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_seeds(rng, p):
    q, k, v = make_qkv(rng, 1, 2, 2, 20, 30, 16, 16, "float32")
    kw = dict(dropout_p=p)
    a = attnkit.attention(q, k, v, seed=1, **kw)
    assert_bits_equal(a, attnkit.attention(q, k, v, seed=1, **kw), "same seed")
    assert not np.array_equal(a, attnkit.attention(q, k, v, seed=2, **kw))
    assert not np.array_equal(attnkit.attention(q, k, v, seed=None, **kw),
                              attnkit.attention(q, k, v, seed=None, **kw))
    assert not np.array_equal(attnkit.attention(q, k, v, seed=0, **kw),
                              attnkit.attention(q, k, v, seed=2**64 - 1, **kw))
    assert not np.array_equal(attnkit.attention(q, k, v, seed=5, **kw),
                              attnkit.attention(q, k, v, seed=5 + 2**32, **kw))
    nodrop = attnkit.attention(q, k, v)
    assert not np.allclose(a, nodrop)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_does_not_change_lse(rng, dtype):
    """lse is the undropped softmax's. Bitwise where both calls take the same softmax; bf16
    without dropout takes the fused bf16-pairs softmax (its lazy max moves the reference the
    sum is taken against, and its exp2 is to 3e-6 relative), so there within 4e-6 of it."""
    q, k, v = make_qkv(rng, 2, 2, 1, 33, 70, 16, 16, dtype)
    _, lse0 = attnkit.attention(q, k, v, enable_gqa=True, causal="bottom_right", return_lse=True)
    for p, seed in ((0.1, 3), (0.5, None), (0.9, 11)):
        out, lse = attnkit.attention(q, k, v, enable_gqa=True, causal="bottom_right",
                                     dropout_p=p, seed=seed, return_lse=True)
        if dtype == "bfloat16":
            assert_close(lse, lse0, 4e-6, 2.5e-7, name=f"lse with dropout_p={p}")
        else:
            assert_bits_equal(lse, lse0, f"lse with dropout_p={p}")
        assert np.isfinite(out.astype(np.float32)).all()


def test_dropout_zero_is_exact(rng):
    q, k, v = make_qkv(rng, 1, 2, 2, 20, 30, 16, 16, "float32")
    a = attnkit.attention(q, k, v, dropout_p=0.0, seed=5)
    b = attnkit.attention(q, k, v)
    assert_bits_equal(a, b, "dropout_p=0")


def test_dropout_mean_matches_no_dropout(rng):
    """E[out] over seeds is the undropped output (inverted dropout is unbiased)."""
    q, k, v = make_qkv(rng, 1, 1, 1, 4, 16, 8, 8, "float32")
    ref = attention_ref(q, k, v)[0]
    p, n = 0.5, 400
    acc = np.zeros_like(ref)
    acc2 = np.zeros_like(ref)
    for s in range(n):
        o = attnkit.attention(q, k, v, dropout_p=p, seed=s).astype(np.float64)
        acc += o
        acc2 += o * o
    mean = acc / n
    sd = np.sqrt(np.maximum(acc2 / n - mean ** 2, 0) / n)
    assert np.all(np.abs(mean - ref) < 5 * sd + 1e-6)
