"""attnkit.merge_attention_states against a float64 reference: random shapes in both
layouts, mixed dtypes, strides, ±inf / NaN lse, in-place merges, halves of a real
attention, the torch ops (opcheck, compile) and every validation error."""

import math

import numpy as np
import pytest

import attnkit
from conftest import np_dtype, poison, randn, strided_like, to_torch, torch
from reference import attention_ref, to_f64

FLOAT_TYPES = ["float32", "float16", "bfloat16"]
# Bound on |out - ref| relative to the row's largest |input|: float32 arithmetic, plus one
# rounding of out to its dtype (half an ulp: 2^-11 for fp16, 2^-8 for bf16).
OUT_TOL = {"float32": 4e-7, "float16": 2 ** -11 + 4e-7, "bfloat16": 2 ** -8 + 4e-7}


def merge_ref(out_a, lse_a, out_b, lse_b):
    """The docstring's rule in float64."""
    a, b, la, lb = (to_f64(x) for x in (out_a, out_b, lse_a, lse_b))
    m = np.maximum(la, lb)
    with np.errstate(invalid="ignore", over="ignore"):
        wa = np.where(la == m, 1.0, np.exp(la - m))
        wb = np.where(lb == m, 1.0, np.exp(lb - m))
        s = wa + wb
        lse = m + np.log(s)
        # A part whose weight w/(w_a + w_b) is 0 in float32 is never read.
        ta = np.where((np.float32(wa / s) == 0)[..., None], 0.0, (wa / s)[..., None] * a)
        tb = np.where((np.float32(wb / s) == 0)[..., None], 0.0, (wb / s)[..., None] * b)
    out = ta + tb
    empty = m == -np.inf
    out[empty] = 0.0
    lse[empty] = -np.inf
    nan = np.isnan(la) | np.isnan(lb)
    out[nan] = np.nan
    lse[nan] = np.nan
    return out, lse


def check(got_out, got_lse, out_a, lse_a, out_b, lse_b, out_dtype):
    want_out, want_lse = merge_ref(out_a, lse_a, out_b, lse_b)
    got_out, got_lse = to_f64(got_out), to_f64(got_lse)
    np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(want_lse))
    np.testing.assert_array_equal(np.isnan(got_out), np.isnan(want_out))
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(got_lse[~finite & ~np.isnan(want_lse)], want_lse[~finite & ~np.isnan(want_lse)])
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=1e-7, atol=1e-6)
    scale = np.maximum(np.abs(np.nan_to_num(to_f64(out_a))).max(axis=-1, keepdims=True),
                       np.abs(np.nan_to_num(to_f64(out_b))).max(axis=-1, keepdims=True))
    ok = ~np.isnan(want_out)
    err = np.abs(got_out - want_out)[ok]
    bound = (OUT_TOL[out_dtype] * np.broadcast_to(scale, want_out.shape))[ok]
    assert np.all(err <= bound), f"worst error {np.max(err - bound)} over the bound"


def random_lse(rng, shape, spread=4.0):
    return (rng.standard_normal(shape) * spread).astype(np.float32)


SHAPES = [(1, 1, 1), (7, 3, 64), (33, 5, 17), (2, 3, 9, 130), (1, 4, 1, 513), (5, 1000), (2, 2, 2, 2, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_TYPES)
def test_random(rng, shape, dtype):
    out_a, out_b = randn(rng, shape, dtype), randn(rng, shape, dtype)
    lse_a, lse_b = random_lse(rng, shape[:-1]), random_lse(rng, shape[:-1])
    out = poison(shape, dtype)
    lse_out = poison(shape[:-1], np.float32)
    got, got_lse = attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b, out=out, lse_out=lse_out)
    assert got is out and got_lse is lse_out
    check(out, lse_out, out_a, lse_a, out_b, lse_b, dtype)


@pytest.mark.parametrize("dtypes", [("bfloat16", "float32", "float32"), ("float32", "float16", "bfloat16"),
                                    ("float16", "bfloat16", "float32")])
def test_mixed_dtypes(rng, dtypes):
    shape = (9, 4, 40)
    out_a, out_b = randn(rng, shape, dtypes[0]), randn(rng, shape, dtypes[1])
    lse_a, lse_b = random_lse(rng, shape[:-1]), random_lse(rng, shape[:-1])
    out = poison(shape, dtypes[2])
    _, lse = attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b, out=out)
    check(out, lse, out_a, lse_a, out_b, lse_b, dtypes[2])


def test_default_outputs(rng):
    out_a, out_b = randn(rng, (3, 2, 8), "bfloat16"), randn(rng, (3, 2, 8), "bfloat16")
    lse_a, lse_b = random_lse(rng, (3, 2)), random_lse(rng, (3, 2))
    out, lse = attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == np_dtype("bfloat16") and out.shape == (3, 2, 8)
    assert lse.dtype == np.float32 and lse.shape == (3, 2)
    check(out, lse, out_a, lse_a, out_b, lse_b, "bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_strided(rng, dtype):
    shape = (4, 3, 5, 37)
    arrays = [randn(rng, shape, dtype), random_lse(rng, shape[:-1]), randn(rng, shape, dtype),
              random_lse(rng, shape[:-1])]
    views = [strided_like(x, rng, allow_negative=True)[0] for x in arrays]
    out, _ = strided_like(poison(shape, dtype), rng)
    lse_out, _ = strided_like(poison(shape[:-1], np.float32), rng)
    attnkit.merge_attention_states(*views, out=out, lse_out=lse_out)
    check(out, lse_out, *arrays, dtype)


def test_bshd_output_as_a_transposed_view(rng):
    # attention's BSHD out [B, S, H, Dv] with its lse [B, H, S]: merge the transposed views.
    q, k, v = randn(rng, (2, 7, 3, 16)), randn(rng, (2, 11, 3, 16)), randn(rng, (2, 11, 3, 8))
    oa, la = attnkit.attention(q, k[:, :5], v[:, :5], layout="BSHD", return_lse=True)
    ob, lb = attnkit.attention(q, k[:, 5:], v[:, 5:], layout="BSHD", return_lse=True)
    out = poison((2, 7, 3, 8), np.float32)
    _, lse = attnkit.merge_attention_states(oa.transpose(0, 2, 1, 3), la, ob.transpose(0, 2, 1, 3), lb,
                                            out=out.transpose(0, 2, 1, 3))
    want, want_lse = attention_ref(q, k, v, layout="BSHD")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", FLOAT_TYPES)
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_halves_of_attention_equal_the_whole(rng, dtype, causal):
    B, H, Sq, Skv, D = 2, 3, 13, 300, 32
    q, k, v = (randn(rng, (B, H, n, D), dtype) for n in (Sq, Skv, Skv))
    split = 171
    # Bottom-right causal over all keys = the prefix in full + the suffix bottom-right.
    oa, la = attnkit.attention(q, k[:, :, :split], v[:, :, :split], return_lse=True)
    ob, lb = attnkit.attention(q, k[:, :, split:], v[:, :, split:], causal=causal, return_lse=True)
    out, lse = attnkit.merge_attention_states(oa, la, ob, lb)
    want, want_lse = attention_ref(q, k, v, causal=causal)
    tol = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
    np.testing.assert_allclose(to_f64(out), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-4)


def test_empty_parts_and_empty_rows(rng):
    # A part attention gave no key (lse -inf): it is never read, even holding NaN.
    T, H, D = 4, 2, 24
    out_a, out_b = randn(rng, (T, H, D)), randn(rng, (T, H, D))
    lse_a, lse_b = random_lse(rng, (T, H)), random_lse(rng, (T, H))
    lse_a[0, :] = -np.inf
    out_a[0, :] = np.nan
    lse_b[1, 0] = -np.inf
    out_b[1, 0] = np.inf
    lse_a[2, 1] = lse_b[2, 1] = -np.inf    # neither part saw a key
    out_a[2, 1] = out_b[2, 1] = np.nan
    lse_a[3, 0] = 30.0
    lse_b[3, 0] = 30.0 - 200.0            # underflows to weight 0: never read either
    out_b[3, 0] = np.nan
    out, lse = attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b)
    np.testing.assert_array_equal(out[0], out_b[0])
    np.testing.assert_array_equal(lse[0], lse_b[0])
    np.testing.assert_array_equal(out[1, 0], out_a[1, 0])
    np.testing.assert_array_equal(out[2, 1], np.zeros(D, np.float32))
    assert lse[2, 1] == -np.inf
    np.testing.assert_array_equal(out[3, 0], out_a[3, 0])
    assert lse[3, 0] == np.float32(30.0)
    check(out, lse, out_a, lse_a, out_b, lse_b, "float32")


def test_empty_row_of_attention_merges_as_empty(rng):
    # attnkit.attention's empty rows (out 0, lse -inf) stay empty through a merge.
    q, k, v = randn(rng, (1, 2, 4, 8)), randn(rng, (1, 2, 6, 8)), randn(rng, (1, 2, 6, 8))
    mask = np.ones((4, 6), bool)
    mask[1] = False
    oa, la = attnkit.attention(q, k[:, :, :3], v[:, :, :3], attn_mask=mask[:, :3], return_lse=True)
    ob, lb = attnkit.attention(q, k[:, :, 3:], v[:, :, 3:], attn_mask=mask[:, 3:], return_lse=True)
    out, lse = attnkit.merge_attention_states(oa, la, ob, lb)
    np.testing.assert_array_equal(out[:, :, 1], 0.0)
    assert np.all(lse[:, :, 1] == -np.inf)
    want, want_lse = attention_ref(q, k, v, attn_mask=mask)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_plus_inf_and_nan_lse(rng):
    out_a, out_b = randn(rng, (4, 16)), randn(rng, (4, 16))
    lse_a = np.array([np.inf, np.inf, np.nan, 1.0], np.float32)
    lse_b = np.array([2.0, np.inf, 0.0, np.nan], np.float32)
    out, lse = attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b)
    np.testing.assert_array_equal(out[0], out_a[0])
    assert lse[0] == np.inf and lse[1] == np.inf
    np.testing.assert_allclose(out[1], (out_a[1].astype(np.float64) + out_b[1]) / 2, rtol=1e-6)
    assert np.all(np.isnan(out[2:])) and np.all(np.isnan(lse[2:]))
    check(out, lse, out_a, lse_a, out_b, lse_b, "float32")


def test_large_lse_gap_keeps_precision(rng):
    out_a, out_b = randn(rng, (3, 5, 8)), randn(rng, (3, 5, 8))
    lse_a = np.full((3, 5), 1e4, np.float32)
    lse_b = lse_a - np.float32(20.0)
    out, lse = attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b)
    check(out, lse, out_a, lse_a, out_b, lse_b, "float32")


@pytest.mark.parametrize("into", ["a", "b"])
def test_in_place(rng, into):
    shape = (6, 3, 70)
    out_a, out_b = randn(rng, shape), randn(rng, shape)
    lse_a, lse_b = random_lse(rng, shape[:-1]), random_lse(rng, shape[:-1])
    keep = [x.copy() for x in (out_a, lse_a, out_b, lse_b)]
    acc, acc_lse = (out_a, lse_a) if into == "a" else (out_b, lse_b)
    attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b, out=acc, lse_out=acc_lse)
    check(acc, acc_lse, *keep, "float32")


def test_zero_rows_and_zero_dv(rng):
    out, lse = attnkit.merge_attention_states(np.zeros((0, 3, 4), np.float32), np.zeros((0, 3), np.float32),
                                              np.zeros((0, 3, 4), np.float32), np.zeros((0, 3), np.float32))
    assert out.shape == (0, 3, 4) and lse.shape == (0, 3)
    la, lb = random_lse(rng, (5, 2)), random_lse(rng, (5, 2))
    lse_out = poison((5, 2), np.float32)
    attnkit.merge_attention_states(np.zeros((5, 2, 0), np.float32), la, np.zeros((5, 2, 0), np.float32), lb,
                                   lse_out=lse_out)
    np.testing.assert_allclose(lse_out, np.logaddexp(la.astype(np.float64), lb), rtol=1e-6)


def test_thread_count_does_not_change_bits(rng, restore_runtime):
    shape = (4096, 4, 64)  # several tasks
    args = (randn(rng, shape), random_lse(rng, shape[:-1]), randn(rng, shape), random_lse(rng, shape[:-1]))
    attnkit.set_num_threads(1)
    one = attnkit.merge_attention_states(*args)
    attnkit.set_num_threads(2)
    two = attnkit.merge_attention_states(*args)
    for x, y in zip(one, two):
        np.testing.assert_array_equal(x, y)
    check(*two, *args, "float32")


def test_every_isa(rng, isa):
    shape = (5, 3, 45)
    args = (randn(rng, shape, "bfloat16"), random_lse(rng, shape[:-1]), randn(rng, shape, "bfloat16"),
            random_lse(rng, shape[:-1]))
    out, lse = attnkit.merge_attention_states(*args)
    check(out, lse, *args, "bfloat16")


# ---- errors: each check of src/ops/merge.cpp and of the Python layer

def _args(rng, shape=(3, 2, 8)):
    return dict(out_a=randn(rng, shape), lse_a=random_lse(rng, shape[:-1]), out_b=randn(rng, shape),
                lse_b=random_lse(rng, shape[:-1]))


def _call(args):
    a = dict(args)
    return attnkit.merge_attention_states(a.pop("out_a"), a.pop("lse_a"), a.pop("out_b"), a.pop("lse_b"), **a)


@pytest.mark.parametrize("change, message", [
    (dict(out_a=np.ones(5, np.float32), lse_a=np.ones((), np.float32)), "out_a must have at least 2 dims"),
    (dict(out_a=np.ones((3, 2, 8), np.int32)), "out_a must be float32, float16 or bfloat16, got int32"),
    (dict(out_b=np.ones((3, 2, 8), np.int8)), "out_b must be float32, float16 or bfloat16, got int8"),
    (dict(out=np.ones((3, 2, 8), np.uint8)), "out must be float32, float16 or bfloat16, got uint8"),
    (dict(out_b=np.ones((3, 2, 9), np.float32)), r"out_b must have out_a's shape \[3, 2, 8\], got \[3, 2, 9\]"),
    (dict(out=np.ones((2, 3, 8), np.float32)), r"out must have out_a's shape \[3, 2, 8\], got \[2, 3, 8\]"),
    (dict(lse_a=np.ones((3, 2, 8), np.float32)), r"lse_a must have out_a's shape without its last dim, \[3, 2\], "
                                                 r"got \[3, 2, 8\]"),
    (dict(lse_b=np.ones((2,), np.float32)), r"lse_b must have out_a's shape without its last dim"),
    (dict(lse_out=np.ones((3, 3), np.float32)), r"lse_out must have out_a's shape without its last dim"),
    (dict(lse_a=np.ones((3, 2), np.float16)), "lse_a must be float32, got float16"),
    (dict(lse_out=np.ones((3, 2), np.int32)), "lse_out must be float32, got int32"),
    (dict(out_a=np.ones((3, 2, 8), np.float64)), "out_a must be float32, float16 or bfloat16, got float64"),
    (dict(lse_b=[[0.0, 0.0]] * 3), "lse_b must be a numpy array or a torch tensor, got list"),
])
def test_errors(rng, change, message):
    args = _args(rng)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        _call(args)


def test_error_overlapping_outputs(rng):
    args = _args(rng)
    buf = np.zeros((4, 2, 8), np.float32)
    args["out_a"][...] = buf[:3]
    with pytest.raises(ValueError, match="out must not alias out_a"):
        _call(dict(args, out_a=buf[:3], out=buf[1:]))                  # overlaps out_a, not the same view
    with pytest.raises(ValueError, match="out must not alias out_b"):
        _call(dict(args, out=args["out_b"][:, ::-1]))                  # same memory, another view
    lse_flat = np.zeros(3 * 2 + 1, np.float32)
    lse_flat[:-1] = args["lse_a"].reshape(-1)
    with pytest.raises(ValueError, match="lse_out must not alias lse_a"):   # one element apart
        _call(dict(args, lse_a=lse_flat[:-1].reshape(3, 2), lse_out=lse_flat[1:].reshape(3, 2)))
    # Interleaved views of one buffer share no element: not aliases.
    lse_buf = np.stack([args["lse_a"], np.full((3, 2), np.nan, np.float32)], axis=-1)
    apart = _call(dict(args))
    together = _call(dict(args, lse_a=lse_buf[..., 0], lse_out=lse_buf[..., 1]))
    for x, y in zip(apart, together):
        np.testing.assert_array_equal(x, y)
    out = np.zeros((3, 2, 8), np.float32)
    with pytest.raises(ValueError, match="out must not alias lse_out"):
        _call(dict(args, out=out, lse_out=out[..., 0]))
    with pytest.raises(ValueError, match="lse_out must not alias out_a"):
        _call(dict(args, lse_out=args["out_a"][..., 0]))
    with pytest.raises(ValueError, match="out must not alias lse_a"):
        _call(dict(args, out=out, lse_a=out[..., 0]))


def test_error_output_layout(rng):
    args = _args(rng)
    read_only = np.zeros((3, 2, 8), np.float32)
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="out must be a writable array"):
        _call(dict(args, out=read_only))
    if torch is not None:
        targs = {k: to_torch(v) for k, v in args.items()}
        with pytest.raises(ValueError, match="out must not have overlapping elements, got stride 0 in dim 1"):
            _call(dict(targs, out=torch.zeros(3, 1, 8).expand(3, 2, 8)))
        with pytest.raises(ValueError, match="lse_out must not have overlapping elements"):
            _call(dict(targs, lse_out=torch.zeros(1, 2).expand(3, 2)))


# ---- torch

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


@needs_torch
@pytest.mark.parametrize("dtype", FLOAT_TYPES)
def test_torch_matches_numpy(rng, dtype):
    shape = (2, 3, 11, 40)
    arrays = [randn(rng, shape, dtype), random_lse(rng, shape[:-1]), randn(rng, shape, dtype),
              random_lse(rng, shape[:-1])]
    want = attnkit.merge_attention_states(*arrays)
    got = attnkit.merge_attention_states(*(to_torch(x) for x in arrays))
    assert isinstance(got[0], torch.Tensor) and got[0].dtype == to_torch(arrays[0]).dtype
    for g, w in zip(got, want):
        np.testing.assert_array_equal(to_f64(g), to_f64(w))
    out, lse = torch.full(shape, math.nan, dtype=got[0].dtype), torch.full(shape[:-1], math.nan)
    attnkit.merge_attention_states(*(to_torch(x) for x in arrays), out=out, lse_out=lse)
    np.testing.assert_array_equal(to_f64(out), to_f64(want[0]))


@needs_torch
def test_torch_in_place_and_kinds(rng):
    shape = (5, 2, 16)
    a, la, b, lb = (to_torch(x) for x in (randn(rng, shape), random_lse(rng, shape[:-1]), randn(rng, shape),
                                          random_lse(rng, shape[:-1])))
    want = attnkit.merge_attention_states(a.numpy(), la.numpy(), b.numpy(), lb.numpy())
    got = attnkit.merge_attention_states(a, la, b, lb, out=b, lse_out=lb)
    assert got[0] is b
    np.testing.assert_array_equal(b.numpy(), want[0])
    np.testing.assert_array_equal(lb.numpy(), want[1])
    with pytest.raises(ValueError, match="out_b must be a torch array like out_a"):
        attnkit.merge_attention_states(a, la, b.numpy(), lb)


@needs_torch
def test_torch_opcheck(rng):
    shape = (4, 3, 24)
    args = [to_torch(x) for x in (randn(rng, shape), random_lse(rng, shape[:-1]), randn(rng, shape, "float32"),
                                  random_lse(rng, shape[:-1]))]
    torch.library.opcheck(torch.ops.attnkit.merge_attention_states, args)
    torch.library.opcheck(torch.ops.attnkit.merge_attention_states_out,
                          args + [torch.empty(shape), torch.empty(shape[:-1])])
    torch.library.opcheck(torch.ops.attnkit.merge_attention_states_, [a.clone() for a in args])


@needs_torch
def test_torch_compile_fullgraph(rng):
    shape = (4, 3, 24)
    args = [to_torch(x) for x in (randn(rng, shape), random_lse(rng, shape[:-1]), randn(rng, shape),
                                  random_lse(rng, shape[:-1]))]

    def f(a, la, b, lb):
        out, lse = attnkit.merge_attention_states(a * 2, la, b, lb)
        return out + 1, lse

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    want = f(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_out_buffers_compile_fullgraph(rng):
    """out= / lse_out= into caller buffers and the in-place form trace (the in-place test
    compares tensors, not data pointers, under torch.compile)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, 8, generator=g)
    la, lb = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    want = attnkit.merge_attention_states(a, la, b, lb)
    torch._dynamo.reset()
    into = torch.compile(lambda a, la, b, lb, o, lo: attnkit.merge_attention_states(a, la, b, lb, out=o, lse_out=lo),
                         fullgraph=True, backend="aot_eager")
    got = into(a, la, b, lb, torch.empty_like(a), torch.empty_like(la))
    in_place = torch.compile(lambda a, la, b, lb: attnkit.merge_attention_states(a, la, b, lb, out=a, lse_out=la),
                             fullgraph=True, backend="aot_eager")
    acc, acc_lse = a.clone(), la.clone()
    in_place(acc, acc_lse, b, lb)
    torch._dynamo.reset()
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(acc, want[0], rtol=0, atol=0)
    torch.testing.assert_close(acc_lse, want[1], rtol=0, atol=0)
