"""attnkit.attention_backward and the torch autograd of attnkit::attention, against a
float64 reference: torch autograd in float64 through an explicit softmax attention (written
below, following the attnkit.attention spec: masks, both causal conventions, scale, GQA,
dropout keep masks, fully masked rows) on the same rounded inputs.

Tolerances, |got - ref| <= atol + rtol * |ref| elementwise, with atol relative to the
largest |ref| of the three gradients (dS = P∘(dP - D) cancels, so small elements carry the
error of the large ones):
  float32   atol 2e-5 · max|ref|, rtol 1e-4  (float32 accumulation over Sq, Skv <= 257)
  float16   atol 2e-3 · max|ref|, rtol 4e-3  (one rounding of the gradient, of out in D)
  bfloat16  atol 1.6e-2 · max|ref|, rtol 2e-2
"""

import numpy as np
import pytest

import attnkit
from conftest import (DTYPES, assert_bits_equal, assert_unmodified, np_dtype, poison, randn, snapshot,
                      strided_like)
from reference import assert_close, to_f64
from test_attention import build, random_config

torch = pytest.importorskip("torch")
from attnkit import _torch_backward  # noqa: E402

_torch_backward.install()

GRAD_TOL = {"float32": (2e-5, 1e-4), "float16": (2e-3, 4e-3), "bfloat16": (1.6e-2, 2e-2)}


def grad_ref(q, k, v, dout, attn_mask=None, causal=False, scale=None, enable_gqa=False,
             layout="BHSD", keep=None, dropout_p=0.0, dlse=None):
    """(dq, dk, dv) float64 numpy by torch autograd in float64 of out·dout + lse·dlse."""
    t = [torch.from_numpy(to_f64(x)).requires_grad_() for x in (q, k, v)]
    qq, kk, vv = t
    if layout == "BSHD":
        qq, kk, vv = (x.transpose(1, 2) for x in (qq, kk, vv))
    B, Hq, Sq, D = qq.shape
    Hkv, Skv = kk.shape[1], kk.shape[2]
    group = Hq // Hkv if Hkv else 1
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
    s = qq @ kk.transpose(-1, -2) * (scale if scale is not None else D ** -0.5)
    allowed = torch.ones(B, Hq, Sq, Skv, dtype=torch.bool)
    i, j = torch.arange(Sq)[:, None], torch.arange(Skv)[None, :]
    if causal is True or causal == "top_left":
        allowed = allowed & (j <= i)
    elif causal == "bottom_right":
        allowed = allowed & (j <= i + Skv - Sq)
    if attn_mask is not None:
        m = torch.from_numpy(to_f64(attn_mask))
        if m.dtype == torch.bool:
            allowed = allowed & m
        else:
            s = s + m
    s = s.masked_fill(~allowed, -torch.inf)
    mx = s.detach().amax(-1, keepdim=True)
    mx0 = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx0)
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = torch.log(denom) + mx0
    if keep is not None:
        p = p * torch.from_numpy(keep) / (1.0 - dropout_p)
    out = p @ vv
    if layout == "BSHD":
        out = out.transpose(1, 2)
    loss = (out * torch.from_numpy(to_f64(dout))).sum()
    if dlse is not None:
        loss = loss + torch.where(torch.isfinite(lse[..., 0]), lse[..., 0], 0.0).mul(
            torch.from_numpy(to_f64(dlse))).sum()
    loss.backward()
    return [x.grad.numpy() for x in t]


def check_grads(got, ref, dtype, names=("dq", "dk", "dv")):
    atol, rtol = GRAD_TOL[dtype]
    # A gradient that is exactly zero in exact arithmetic (dq with one visible key) is
    # rounding noise of the others' size: the scale is the largest of all three.
    scale = max([float(np.abs(r).max()) for r in ref if r.size] + [1e-30])
    for g, r, name in zip(got, ref, names):
        assert_close(g, r, atol * scale, rtol, name=name)


def forward(q, k, v, **kw):
    return attnkit.attention(q, k, v, return_lse=True, **kw)


def poisoned_grads(q, k, v, rng=None):
    """NaN-filled dq, dk, dv (strided views of NaN buffers when rng is given)."""
    grads = [poison(x.shape, x.dtype) for x in (q, k, v)]
    if rng is not None:
        grads = [strided_like(g, rng)[0] for g in grads]
    return grads


# ---------------------------------------------------------------------------------------
# Random configurations: shapes (odd sizes, tile edges 1/7/63/64/65/257), GQA/MQA, masks
# (bool, additive with -inf, broadcast shapes), causal modes, scale, layouts, strides.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_config(dtype, seed):
    cfg = random_config(seed)
    q, k, v, mask = build(cfg, dtype)
    rng = np.random.default_rng(seed)
    kw = dict(attn_mask=mask, causal=cfg["causal"], scale=cfg["scale"],
              enable_gqa=cfg["Hq"] != cfg["Hkv"], layout=cfg["layout"])
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape, dtype)
    if cfg["strided"]:
        dout = strided_like(dout, rng)[0]
    inputs = (q, k, v, out, lse, dout, mask)
    before = snapshot(*inputs)
    dq, dk, dv = poisoned_grads(q, k, v, rng if cfg["strided"] else None)
    got = attnkit.attention_backward(q, k, v, out, lse, dout, dq=dq, dk=dk, dv=dv, **kw)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    assert_unmodified(before, inputs)
    check_grads(got, grad_ref(q, k, v, dout, **kw), dtype)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_isa(isa, dtype, seed):
    cfg = random_config(100 + seed)
    q, k, v, mask = build(cfg, dtype)
    kw = dict(attn_mask=mask, causal=cfg["causal"], scale=cfg["scale"],
              enable_gqa=cfg["Hq"] != cfg["Hkv"], layout=cfg["layout"])
    out, lse = forward(q, k, v, **kw)
    dout = randn(np.random.default_rng(seed), out.shape, dtype)
    check_grads(attnkit.attention_backward(q, k, v, out, lse, dout, **kw),
                grad_ref(q, k, v, dout, **kw), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,Dv", [(33, 17), (1, 2), (130, 65)])
@pytest.mark.parametrize("strided", [False, True])
def test_odd_head_dims(rng, dtype, D, Dv, strided):
    """Odd D and Dv (bf16 pairs with a lone last element), element strides != 1."""
    q, k = randn(rng, (1, 2, 50, D), dtype), randn(rng, (1, 2, 70, D), dtype)
    v = randn(rng, (1, 2, 70, Dv), dtype)
    out, lse = forward(q, k, v, causal=True)
    dout = randn(rng, out.shape, dtype)
    if strided:
        q, k, v, dout = (strided_like(x, rng)[0] for x in (q, k, v, dout))
    check_grads(attnkit.attention_backward(q, k, v, out, lse, dout, causal=True),
                grad_ref(q, k, v, dout, causal=True), dtype)


def test_out_and_lse_are_inputs(rng):
    """The backward reads out and lse: a broadcast (stride 0) lse is fine there, as in any input."""
    q = np.ascontiguousarray(np.broadcast_to(randn(rng, (1, 1, 1, 16)), (1, 2, 9, 16)))  # every row alike
    k = randn(rng, (1, 1, 11, 16)).repeat(2, 1)
    v = randn(rng, (1, 1, 11, 16)).repeat(2, 1)
    out, lse = forward(q, k, v)   # so every row of lse is alike too
    broadcast = np.broadcast_to(lse[:, :1, :1], lse.shape)
    dout = randn(rng, out.shape)
    got = attnkit.attention_backward(q, k, v, out, broadcast, dout)
    want = attnkit.attention_backward(q, k, v, out, lse, dout)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)


@pytest.mark.parametrize("enable_gqa", ["no", None, 1])
def test_enable_gqa_must_be_bool(rng, enable_gqa):
    q, k, v = randn(rng, (1, 2, 4, 8)), randn(rng, (1, 2, 5, 8)), randn(rng, (1, 2, 5, 8))
    out, lse = forward(q, k, v)
    with pytest.raises(ValueError, match=f"enable_gqa must be True or False, got {enable_gqa!r}"):
        attnkit.attention_backward(q, k, v, out, lse, out, enable_gqa=enable_gqa)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("D", [40, 128])
def test_interleaved_buffers(rng, dtype, D):
    """Outputs interleaved with inputs or with each other in one buffer (out beside q; dk beside
    dv, as FlashAttention's kvpacked gradients; dq beside dout) share no element, so they are
    accepted, and each call writes exactly its own elements: results bit-identical to separate
    buffers, the neighbours untouched."""
    B, Hq, Hkv, Sq, Skv = 1, 4, 2, 37, 70
    qbuf = poison((B, Hq, Sq, 2, D), dtype)
    qbuf[..., 0, :] = randn(rng, (B, Hq, Sq, D), dtype)
    q, k, v = qbuf[..., 0, :], randn(rng, (B, Hkv, Skv, D), dtype), randn(rng, (B, Hkv, Skv, D), dtype)
    q_before = q.copy()
    out, lse = attnkit.attention(q, k, v, causal=True, enable_gqa=True, return_lse=True, out=qbuf[..., 1, :])
    apart, lse_apart = forward(q.copy(), k, v, causal=True, enable_gqa=True)
    assert_bits_equal(out, apart)
    assert_bits_equal(lse, lse_apart)
    assert_bits_equal(q, q_before)
    dbuf = poison((B, Hq, Sq, 2, D), dtype)
    dbuf[..., 0, :] = randn(rng, (B, Hq, Sq, D), dtype)
    dout = dbuf[..., 0, :]
    dout_before = dout.copy()
    dkv = poison((B, Hkv, Skv, 2, D), dtype)
    got = attnkit.attention_backward(q, k, v, apart, lse, dout, causal=True, enable_gqa=True, dq=dbuf[..., 1, :],
                                     dk=dkv[..., 0, :], dv=dkv[..., 1, :])
    want = attnkit.attention_backward(q, k, v, apart, lse, dout.copy(), causal=True, enable_gqa=True)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)
    assert_bits_equal(dout, dout_before)


@pytest.mark.parametrize("Hq,Hkv", [(1, 1), (4, 1), (6, 2), (8, 8), (12, 3)])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_gqa_and_causal(rng, Hq, Hkv, causal):
    q = randn(rng, (2, Hq, 70, 40))
    k, v = randn(rng, (2, Hkv, 130, 40)), randn(rng, (2, Hkv, 130, 24))
    kw = dict(causal=causal, enable_gqa=Hq != Hkv)
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape)
    check_grads(attnkit.attention_backward(q, k, v, out, lse, dout, **kw),
                grad_ref(q, k, v, dout, **kw), "float32")


@pytest.mark.parametrize("Sq,Skv", [(130, 60), (60, 130), (1, 200)])
def test_causal_conventions_differ(rng, Sq, Skv):
    """top_left and bottom_right give different gradients when Sq != Skv (and the reference
    tells them apart): a backward ignoring the convention would fail one of them."""
    q, k, v = randn(rng, (1, 2, Sq, 32)), randn(rng, (1, 2, Skv, 32)), randn(rng, (1, 2, Skv, 32))
    dout = randn(rng, (1, 2, Sq, 32))
    grads = {}
    for causal in ("top_left", "bottom_right"):
        out, lse = forward(q, k, v, causal=causal)
        grads[causal] = attnkit.attention_backward(q, k, v, out, lse, dout, causal=causal)
        check_grads(grads[causal], grad_ref(q, k, v, dout, causal=causal), "float32")
    assert not np.allclose(grads["top_left"][1], grads["bottom_right"][1])


def test_fully_masked_rows_get_zero_gradient(rng):
    q, k, v = randn(rng, (1, 2, 20, 16)), randn(rng, (1, 2, 90, 16)), randn(rng, (1, 2, 90, 16))
    mask = rng.random((20, 90)) < 0.7
    mask[[0, 7, 19]] = False
    out, lse = forward(q, k, v, attn_mask=mask)
    dout = randn(rng, out.shape)
    dq, dk, dv = attnkit.attention_backward(q, k, v, out, lse, dout, attn_mask=mask)
    assert np.all(dq[:, :, [0, 7, 19]] == 0)
    check_grads((dq, dk, dv), grad_ref(q, k, v, dout, attn_mask=mask), "float32")


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_scale(rng, scale):
    q, k, v = randn(rng, (1, 2, 33, 24)), randn(rng, (1, 2, 65, 24)), randn(rng, (1, 2, 65, 8))
    out, lse = forward(q, k, v, scale=scale)
    dout = randn(rng, out.shape)
    check_grads(attnkit.attention_backward(q, k, v, out, lse, dout, scale=scale),
                grad_ref(q, k, v, dout, scale=scale), "float32")


def test_dlse(rng):
    """lse's own gradient (dlse) enters as dS += dlse·P."""
    q, k, v = randn(rng, (2, 2, 40, 16)), randn(rng, (2, 2, 77, 16)), randn(rng, (2, 2, 77, 16))
    out, lse = forward(q, k, v, causal="bottom_right")
    dout, dlse = randn(rng, out.shape), randn(rng, lse.shape)
    got = attnkit.attention_backward(q, k, v, out, lse, dout, causal="bottom_right", dlse=dlse)
    check_grads(got, grad_ref(q, k, v, dout, causal="bottom_right", dlse=dlse), "float32")


def test_empty(rng):
    q = randn(rng, (1, 2, 5, 8))
    k0, v0 = randn(rng, (1, 2, 0, 8)), randn(rng, (1, 2, 0, 8))
    out, lse = forward(q, k0, v0)
    dq, dk, dv = attnkit.attention_backward(q, k0, v0, out, lse, randn(rng, out.shape),
                                            dq=poison(q.shape, q.dtype))
    assert np.all(dq == 0) and dk.shape == k0.shape and dv.shape == v0.shape
    q0, k, v = randn(rng, (1, 2, 0, 8)), randn(rng, (1, 2, 9, 8)), randn(rng, (1, 2, 9, 8))
    out, lse = forward(q0, k, v)
    dq, dk, dv = attnkit.attention_backward(q0, k, v, out, lse, out, dk=poison(k.shape, k.dtype),
                                            dv=poison(v.shape, v.dtype))
    assert np.all(dk == 0) and np.all(dv == 0)


# ---------------------------------------------------------------------------------------
# Dropout: the reference gets the forward's keep mask, read back from the forward itself
# with v = identity (out = P∘keep/(1-p), so keep = out != 0 where P > 0). A backward that
# drew a different mask (or none) fails against it.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
@pytest.mark.parametrize("Hq,Hkv,causal", [(2, 2, False), (4, 2, "bottom_right"), (3, 1, True)])
def test_dropout(rng, dropout_p, Hq, Hkv, causal):
    B, Sq, Skv, D = 2, 37, 150, 16
    q, k, v = randn(rng, (B, Hq, Sq, D)), randn(rng, (B, Hkv, Skv, D)), randn(rng, (B, Hkv, Skv, 20))
    kw = dict(causal=causal, enable_gqa=Hq != Hkv, dropout_p=dropout_p, seed=1234 + Hq)
    eye = np.broadcast_to(np.eye(Skv, dtype=np.float32), (B, Hkv, Skv, Skv)).copy()
    p_dropped = attnkit.attention(q, k, eye, **kw)
    keep = p_dropped != 0
    visible = grad_mask(B, Hq, Sq, Skv, causal)
    dropped = 1 - keep[visible].mean()
    assert abs(dropped - dropout_p) < 0.05, dropped
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape)
    got = attnkit.attention_backward(q, k, v, out, lse, dout, **kw)
    ref = grad_ref(q, k, v, dout, causal=causal, enable_gqa=Hq != Hkv, keep=keep, dropout_p=dropout_p)
    check_grads(got, ref, "float32")
    # The wrong seed regenerates another mask: the gradients then disagree.
    wrong = attnkit.attention_backward(q, k, v, out, lse, dout, **{**kw, "seed": kw["seed"] + 1})
    assert not np.allclose(wrong[2], ref[2], atol=1e-3)


def grad_mask(B, Hq, Sq, Skv, causal):
    """Where keys are visible under the causal mode, [B, Hq, Sq, Skv]."""
    i, j = np.arange(Sq)[:, None], np.arange(Skv)[None, :]
    vis = np.ones((Sq, Skv), bool)
    if causal is True or causal == "top_left":
        vis = j <= i
    elif causal == "bottom_right":
        vis = j <= i + Skv - Sq
    return np.broadcast_to(vis, (B, Hq, Sq, Skv))


# ---------------------------------------------------------------------------------------
# Determinism: bit-identical gradients across runs and thread counts (with and without
# key splits: few (batch, kv head) pairs split the keys and sum partial dQs in order).
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("B,Hq,Hkv", [(1, 4, 1), (2, 8, 8)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitwise_across_threads(rng, restore_runtime, B, Hq, Hkv, dtype):
    q = randn(rng, (B, Hq, 150, 64), dtype)
    k, v = randn(rng, (B, Hkv, 700, 64), dtype), randn(rng, (B, Hkv, 700, 64), dtype)
    kw = dict(causal="bottom_right", enable_gqa=Hq != Hkv, dropout_p=0.2, seed=7)
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape, dtype)
    results = []
    for n in (1, 2, 3, 1):
        attnkit.set_num_threads(n)
        results.append(attnkit.attention_backward(q, k, v, out, lse, dout, **kw))
    for other in results[1:]:
        for a, b, name in zip(results[0], other, ("dq", "dk", "dv")):
            assert_bits_equal(a, b, name)


# ---------------------------------------------------------------------------------------
# Errors: every check of src/ops/attention_backward.cpp, and the forward's through it.
# ---------------------------------------------------------------------------------------

def _err_inputs(rng):
    q, k, v = randn(rng, (1, 2, 6, 8)), randn(rng, (1, 2, 9, 8)), randn(rng, (1, 2, 9, 4))
    out, lse = forward(q, k, v)
    return q, k, v, out, lse, randn(rng, out.shape)


@pytest.mark.parametrize("case,match", [
    ("dout_shape", r"dout must have out's shape \[1, 2, 6, 4\], got \[1, 2, 6, 5\]"),
    ("dout_rank", r"dout must be a 4-d tensor"),
    ("dout_dtype", r"dout must have out's dtype float32, got float16"),
    ("dq_shape", r"dq must have q's shape \[1, 2, 6, 8\], got \[1, 2, 6, 9\]"),
    ("dk_dtype", r"dk must have k's dtype float32, got bfloat16"),
    ("dv_shape", r"dv must have v's shape \[1, 2, 9, 4\], got \[1, 2, 8, 4\]"),
    ("dq_aliases_q", r"dq must not alias q \(their memory overlaps\)"),
    ("dk_aliases_dv", r"dk must not alias dv"),
    ("dv_aliases_dout", r"dv must not alias dout"),
    ("dlse_shape", r"dlse must have lse's shape \[1, 2, 6\], got \[1, 2, 5\]"),
    ("dlse_dtype", r"dlse must be float32, got float16"),
    ("dropout_no_seed", r"seed must be the forward's dropout seed when dropout_p > 0"),
    ("lse_shape", r"lse must have shape \[1, 2, 6\]"),
    ("gqa", r"enable_gqa"),
    ("kind", r"dout must be a numpy array like q"),
])
def test_errors(rng, case, match):
    q, k, v, out, lse, dout = _err_inputs(rng)
    kw = {}
    if case == "dout_shape":
        dout = randn(rng, (1, 2, 6, 5))
    elif case == "dout_rank":
        dout = randn(rng, (2, 6, 4))
    elif case == "dout_dtype":
        dout = dout.astype(np.float16)
    elif case == "dq_shape":
        kw["dq"] = poison((1, 2, 6, 9), np.float32)
    elif case == "dk_dtype":
        kw["dk"] = poison(k.shape, np_dtype("bfloat16"))
    elif case == "dv_shape":
        kw["dv"] = poison((1, 2, 8, 4), np.float32)
    elif case == "dq_aliases_q":
        kw["dq"] = q
    elif case == "dk_aliases_dv":
        buf = poison((2, 1, 2, 9, 8), np.float32)
        kw["dk"], kw["dv"] = buf[0], buf[0][..., :4]
    elif case == "dv_aliases_dout":
        big = poison((1, 2, 9, 4), np.float32)
        dout = big[:, :, :6]
        kw["dv"] = big
    elif case == "dlse_shape":
        kw["dlse"] = randn(rng, (1, 2, 5))
    elif case == "dlse_dtype":
        kw["dlse"] = randn(rng, (1, 2, 6), "float16")
    elif case == "dropout_no_seed":
        kw["dropout_p"] = 0.3
    elif case == "lse_shape":
        lse = lse[:, :, :5]
    elif case == "gqa":
        k, v = k[:, :1], v[:, :1]
    elif case == "kind":
        dout = torch.from_numpy(dout)
    with pytest.raises(ValueError, match=match):
        attnkit.attention_backward(q, k, v, out, lse, dout, **kw)


def test_error_zero_stride_gradient(rng):
    q, k, v, out, lse, dout = _err_inputs(rng)
    t = [torch.from_numpy(x) for x in (q, k, v, out, lse, dout)]
    dq = torch.empty(1, 2, 1, 8).expand(1, 2, 6, 8)
    with pytest.raises(ValueError, match="dq"):
        attnkit.attention_backward(*t, dq=dq)


# ---------------------------------------------------------------------------------------
# Torch autograd: register_autograd on attnkit::attention, the attnkit::attention_backward
# op (opcheck), and a tiny model trained with attnkit and with torch SDPA.
# ---------------------------------------------------------------------------------------

def _leaves(rng, shapes, dtype=torch.float32):
    return [torch.from_numpy(randn(rng, s)).to(dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_autograd(rng, dtype, layout):
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    shp = (lambda b, h, s, d: (b, h, s, d)) if layout == "BHSD" else (lambda b, h, s, d: (b, s, h, d))
    q, k, v = _leaves(rng, [shp(2, 4, 19, 16), shp(2, 2, 71, 16), shp(2, 2, 71, 12)], tdt)
    mask = torch.from_numpy(rng.random((19, 71)) < 0.8)
    out, lse = torch.ops.attnkit.attention(q, k, v, mask, 2, 0.4, 0.0, None, True, layout)
    dout = torch.from_numpy(randn(rng, tuple(out.shape))).to(tdt)
    dlse = torch.from_numpy(randn(rng, tuple(lse.shape)))
    torch.autograd.backward([out, lse], [dout, dlse])
    ref = grad_ref(q.detach(), k.detach(), v.detach(), dout, attn_mask=mask.numpy(),
                   causal="bottom_right", scale=0.4, enable_gqa=True, layout=layout, dlse=dlse.numpy())
    check_grads([x.grad for x in (q, k, v)], ref, dtype)


def test_autograd_dropout_needs_seed(rng):
    q, k, v = _leaves(rng, [(1, 1, 4, 8)] * 3)
    with pytest.raises(ValueError, match="needs a seed"):
        torch.ops.attnkit.attention(q, k, v, None, 0, None, 0.5, None, False, "BHSD")


def test_gradcheck_float32_vs_finite_differences_of_forward(rng):
    """Independent of the reference: the backward against central differences of attnkit's
    own forward, dropout included (fixed seed: the forward is a fixed function of q, k, v)."""
    q, k, v = _leaves(rng, [(1, 2, 5, 4), (1, 2, 7, 4), (1, 2, 7, 3)])
    args = (None, 2, None, 0.3, 99, False, "BHSD")
    out, lse = torch.ops.attnkit.attention(q, k, v, *args)
    dout = torch.from_numpy(randn(rng, tuple(out.shape)))
    out.backward(dout)
    eps = 1e-2
    for x in (q, k, v):
        flat = x.detach().view(-1)
        for idx in range(0, flat.numel(), 3):
            def f(delta):
                y = flat.clone()
                y[idx] += delta
                xs = [y.view(x.shape) if z is x else z.detach() for z in (q, k, v)]
                return (torch.ops.attnkit.attention(*xs, *args)[0].double() * dout).sum().item()
            fd = (f(eps) - f(-eps)) / (2 * eps)
            assert abs(x.grad.view(-1)[idx].item() - fd) < 2e-3 * (1 + abs(fd)), (idx, fd)


@pytest.mark.parametrize("dropout_p,mask_kind", [(0.0, None), (0.0, "float"), (0.3, "bool")])
def test_opcheck(rng, dropout_p, mask_kind):
    q, k, v = _leaves(rng, [(1, 4, 9, 16), (1, 2, 13, 16), (1, 2, 13, 8)])
    mask = None
    if mask_kind == "bool":
        mask = torch.from_numpy(rng.random((9, 13)) < 0.8)
    elif mask_kind == "float":
        mask = torch.from_numpy(randn(rng, (9, 13)))
    args = (q, k, v, mask, 1, None, dropout_p, 5, True, "BHSD")
    torch.library.opcheck(torch.ops.attnkit.attention.default, args)
    out, lse = torch.ops.attnkit.attention(*args)
    bargs = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
             torch.randn(out.shape), torch.randn(lse.shape), mask, 1, None, dropout_p, 5, True, "BHSD")
    torch.library.opcheck(torch.ops.attnkit.attention_backward.default, bargs)


class TinyModel(torch.nn.Module):
    """Embedding, one causal self-attention block with GQA, and a head."""

    def __init__(self, use_attnkit):
        super().__init__()
        self.use_attnkit = use_attnkit
        self.emb = torch.nn.Embedding(50, 32)
        self.q, self.kv, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 50)

    def forward(self, tokens):
        x = self.emb(tokens)
        B, S, _ = x.shape
        q = self.q(x).view(B, S, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, 2, 8).permute(3, 0, 2, 1, 4)
        if self.use_attnkit:
            a = torch.ops.attnkit.attention(q, k, v, None, 1, None, 0.0, None, True, "BHSD")[0]
        else:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(x + self.o(a.transpose(1, 2).reshape(B, S, 32)))


def test_tiny_model_trains_like_sdpa():
    losses = {}
    for use_attnkit in (True, False):
        torch.manual_seed(0)
        model = TinyModel(use_attnkit)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        tokens = torch.randint(0, 50, (4, 33), generator=torch.Generator().manual_seed(1))
        curve = []
        for _ in range(10):  # one fixed batch: the loss must fall fast
            logits = model(tokens[:, :-1]).reshape(-1, 50)
            loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses[use_attnkit] = curve
    assert losses[True][-1] < losses[True][0] - 0.5  # it learns
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-4)


def test_torch_compile_training_step(rng):
    """torch.compile(fullgraph=True) traces the forward and the registered backward; the
    compiled step's gradients equal the eager ones bit for bit."""
    q, k, v = _leaves(rng, [(1, 4, 33, 16), (1, 2, 33, 16), (1, 2, 33, 16)])

    def step(q, k, v):
        out, lse = torch.ops.attnkit.attention(q, k, v, None, 1, None, 0.0, None, True, "BHSD")
        return (out * out).sum() + lse.sum()

    torch.compile(step, fullgraph=True)(q, k, v).backward()
    compiled = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    step(q, k, v).backward()
    for a, x, name in zip(compiled, (q, k, v), ("dq", "dk", "dv")):
        assert_bits_equal(a, x.grad, name)


# ---------------------------------------------------------------------------------------
# Score modifiers in the backward: window, soft-cap, ALiBi, sinks (with dsinks), against
# torch float64 autograd of the modifiers' reference written here (reference.py's spec).
# dsinks is checked with the gradients' tolerance, scaled by its own largest |ref|.
# ---------------------------------------------------------------------------------------

def grad_ref_mods(q, k, v, dout, attn_mask=None, causal=False, scale=None, enable_gqa=False,
                  window=None, softcap=None, alibi_slopes=None, sinks=None, dlse=None, keep=None,
                  dropout_p=0.0, seed=None):
    """(dq, dk, dv[, dsinks]) float64 by torch autograd in float64 of out·dout (+ lse·dlse)."""
    t = [torch.from_numpy(to_f64(x)).requires_grad_() for x in (q, k, v)]
    qq, kk, vv = t
    B, Hq, Sq, D = qq.shape
    Hkv, Skv = kk.shape[1], kk.shape[2]
    group = Hq // Hkv
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
    s = qq @ kk.transpose(-1, -2) * (scale if scale is not None else D ** -0.5)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(Sq)[:, None], torch.arange(Skv)[None, :]
    top_left = causal is True or causal == "top_left"
    a = i if top_left else i + (Skv - Sq)
    allowed = torch.ones(B, Hq, Sq, Skv, dtype=torch.bool)
    if causal:
        allowed = allowed & (j <= a)
    if window is not None:
        if window[0] >= 0:
            allowed = allowed & (j >= a - window[0])
        if window[1] >= 0:
            allowed = allowed & (j <= a + window[1])
    if alibi_slopes is not None:
        slopes = torch.from_numpy(to_f64(alibi_slopes)).reshape(-1, Hq).expand(B, Hq)
        s = s - slopes[:, :, None, None] * (a - j).abs()
    if attn_mask is not None:
        m = torch.from_numpy(to_f64(attn_mask))
        if m.dtype == torch.bool:
            allowed = allowed & m
        else:
            s = s + m
    s = s.masked_fill(~allowed, -torch.inf)
    mx = s.detach().amax(-1, keepdim=True)
    live = torch.isfinite(mx)
    mx0 = torch.where(live, mx, torch.zeros_like(mx))
    e = torch.exp(s - mx0)
    denom = e.sum(-1, keepdim=True)
    lse = torch.log(torch.where(live, denom, torch.ones_like(denom))) + mx0
    sk = None
    if sinks is not None:
        sk = torch.from_numpy(to_f64(sinks)).requires_grad_()
        denom = denom + torch.where(live, torch.exp(sk[None, :, None, None] - mx0), torch.zeros_like(mx0))
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    if keep is not None:
        p = p * torch.from_numpy(keep) / (1.0 - dropout_p)
    out = p @ vv
    loss = (out * torch.from_numpy(to_f64(dout))).sum()
    if dlse is not None:
        loss = loss + torch.where(live[..., 0], lse[..., 0], 0.0).mul(torch.from_numpy(to_f64(dlse))).sum()
    loss.backward()
    grads = [x.grad.numpy() for x in t]
    return grads + ([sk.grad.numpy()] if sk is not None else [])


def random_mods(rng, Hq, B):
    """A random combination of the four modifiers (each present with probability ~1/2)."""
    mods = {}
    if rng.random() < 0.5:
        mods["window"] = (int(rng.choice([-1, 0, 5, 40])), int(rng.choice([-1, 0, 7, 300])))
    if rng.random() < 0.5:
        mods["softcap"] = float(rng.choice([0.5, 3.0, 30.0]))
    if rng.random() < 0.5:
        shape = (Hq,) if rng.random() < 0.5 else (B, Hq)
        mods["alibi_slopes"] = (rng.random(shape) * 0.3).astype(np.float32)
    if rng.random() < 0.6:
        mods["sinks"] = (rng.standard_normal(Hq) * 2).astype(np.float32)
    return mods


def check_mod_grads(got, ref, dtype):
    check_grads(got[:3], ref[:3], dtype)
    if len(ref) > 3:
        check_grads([got[3]], [ref[3]], dtype, names=("dsinks",))


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("dtype", DTYPES)
def test_modifiers_random(dtype, seed):
    rng = np.random.default_rng(1000 + seed)
    B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
    Hq = Hkv * int(rng.choice([1, 3]))
    Sq, Skv = int(rng.choice([1, 7, 96, 131])), int(rng.choice([5, 63, 193, 260]))
    D, Dv = int(rng.choice([16, 33, 64])), int(rng.choice([8, 17, 64]))
    causal = [False, True, "bottom_right"][seed % 3]
    mods = random_mods(rng, Hq, B)
    mask = None
    if seed % 4 == 1:
        mask = rng.random((Sq, Skv)) < 0.85
    q, k, v = randn(rng, (B, Hq, Sq, D), dtype), randn(rng, (B, Hkv, Skv, D), dtype), randn(rng, (B, Hkv, Skv, Dv), dtype)
    kw = dict(attn_mask=mask, causal=causal, enable_gqa=Hq != Hkv, **mods)
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape, dtype)
    dlse = randn(rng, lse.shape) if seed % 2 else None
    dq, dk, dv = poisoned_grads(q, k, v)
    got = attnkit.attention_backward(q, k, v, out, lse, dout, dlse=dlse, dq=dq, dk=dk, dv=dv, **kw)
    assert len(got) == (4 if "sinks" in mods else 3)
    ref = grad_ref_mods(q, k, v, dout, dlse=dlse, **kw)
    check_mod_grads(got, ref, dtype)


@pytest.mark.parametrize("B,H,Sq,Skv,causal,window", [
    (2, 8, 800, 800, True, None),                 # one key split: key blocks in a group of 4, then 1
    (1, 8, 900, 1700, "bottom_right", None),      # groups of 4, 4 and 1; query i sees keys up to i + 800
    (1, 4, 1200, 1100, "bottom_right", None),     # two splits of 3 blocks; rows 0-99 see no key
    (1, 4, 1100, 1100, False, (200, 30)),         # a window: each group sees a band of rows
    (1, 8, 1000, 1000, False, (300, 50)),         # a window over groups of 4 and 2
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_keys_several_key_blocks_per_task(rng, dtype, B, H, Sq, Skv, causal, window):
    """Tasks of several key blocks (192 keys each, run in groups of up to 4) and key splits
    whose partial dQs are summed: the other tests' shapes have at most two key blocks."""
    q, k, v = randn(rng, (B, H, Sq, 16), dtype), randn(rng, (B, H, Skv, 16), dtype), randn(rng, (B, H, Skv, 16), dtype)
    kw = dict(causal=causal, window=window)
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape, dtype)
    dq, dk, dv = poisoned_grads(q, k, v)
    got = attnkit.attention_backward(q, k, v, out, lse, dout, dq=dq, dk=dk, dv=dv, **kw)
    check_grads(got, grad_ref_mods(q, k, v, dout, **kw), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_modifiers_every_isa(isa, dtype):
    rng = np.random.default_rng(7)
    q, k, v = randn(rng, (1, 4, 70, 32), dtype), randn(rng, (1, 2, 200, 32), dtype), randn(rng, (1, 2, 200, 16), dtype)
    kw = dict(causal="bottom_right", enable_gqa=True, window=(50, -1), softcap=2.0,
              alibi_slopes=np.array([0.1, 0.0, 0.3, 0.05], np.float32), sinks=np.array([0.5, -1, 2, 0], np.float32))
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape, dtype)
    check_mod_grads(attnkit.attention_backward(q, k, v, out, lse, dout, **kw),
                    grad_ref_mods(q, k, v, dout, **kw), dtype)


def test_sink_gradient_matches_finite_differences(rng):
    """dsinks against central differences of attnkit's own forward (float64 loss)."""
    q, k, v = randn(rng, (2, 3, 9, 8)), randn(rng, (2, 3, 11, 8)), randn(rng, (2, 3, 11, 4))
    sinks = np.array([0.3, -0.5, 1.5], np.float32)
    out, lse = forward(q, k, v, causal=True, sinks=sinks)
    dout = randn(rng, out.shape)
    dsinks = attnkit.attention_backward(q, k, v, out, lse, dout, causal=True, sinks=sinks)[3]
    eps = 1e-2
    for h in range(3):
        def f(delta):
            s = sinks.copy()
            s[h] += delta
            return float((attnkit.attention(q, k, v, causal=True, sinks=s).astype(np.float64) * dout).sum())
        fd = (f(eps) - f(-eps)) / (2 * eps)
        assert abs(dsinks[h] - fd) < 2e-3 * (1 + abs(fd)), (h, dsinks[h], fd)


def test_modifiers_bitwise_across_threads(rng, restore_runtime):
    q, k, v = randn(rng, (1, 4, 300, 32), "bfloat16"), randn(rng, (1, 1, 300, 32), "bfloat16"), randn(rng, (1, 1, 300, 32), "bfloat16")
    kw = dict(causal=True, enable_gqa=True, window=(100, -1), softcap=5.0, sinks=np.ones(4, np.float32))
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape, "bfloat16")
    runs = []
    for threads in (1, 2, 3):
        attnkit.set_num_threads(threads)
        runs.append(attnkit.attention_backward(q, k, v, out, lse, dout, **kw))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert_bits_equal(a, b)


@pytest.mark.parametrize("case,match", [
    ("dsinks_shape", r"dsinks must be float32 of shape \[2\] \(sinks' shape\), got float32 of shape \[3\]"),
    ("dsinks_dtype", r"dsinks must be float32 of shape \[2\]"),
    ("dsinks_without_sinks", r"dsinks must be None without sinks"),
    ("dsinks_aliases_sinks", r"dsinks must not alias sinks"),
    ("softcap", r"softcap must be a finite number > 0"),
    ("window", r"window left must be -1 \(unbounded\) or >= 0, got -2"),
])
def test_modifier_errors(rng, case, match):
    q, k, v, out, lse, dout = _err_inputs(rng)
    sinks = np.zeros(2, np.float32)
    kw = dict(sinks=sinks)
    if case == "dsinks_shape":
        kw["dsinks"] = np.zeros(3, np.float32)
    elif case == "dsinks_dtype":
        kw["dsinks"] = np.zeros(2, np.float16)
    elif case == "dsinks_without_sinks":
        kw = dict(dsinks=np.zeros(2, np.float32))
    elif case == "dsinks_aliases_sinks":
        kw["dsinks"] = sinks
    elif case == "softcap":
        kw["softcap"] = -1.0
    elif case == "window":
        kw["window"] = (-2, 0)
    with pytest.raises(ValueError, match=match):
        attnkit.attention_backward(q, k, v, out, lse, dout, **kw)


def test_autograd_modifiers_and_sink_gradient(rng):
    """attnkit.attention under autograd with every modifier: q, k, v and the sinks get
    gradients; ALiBi slopes that require grad are refused."""
    q, k, v = _leaves(rng, [(2, 4, 21, 16), (2, 2, 77, 16), (2, 2, 77, 8)])
    sinks = torch.from_numpy(randn(rng, (4,))).requires_grad_()
    slopes = torch.tensor([0.1, 0.2, 0.0, 0.05])
    mods = dict(window=(30, 4), softcap=4.0, alibi_slopes=slopes, sinks=sinks)
    out = attnkit.attention(q, k, v, enable_gqa=True, **mods)
    dout = torch.from_numpy(randn(rng, tuple(out.shape)))
    out.backward(dout)
    ref = grad_ref_mods(q.detach(), k.detach(), v.detach(), dout, enable_gqa=True, window=(30, 4), softcap=4.0,
                        alibi_slopes=slopes.numpy(), sinks=sinks.detach().numpy())
    check_mod_grads([x.grad for x in (q, k, v, sinks)], ref, "float32")
    # sinks alone requiring grad still get their gradient
    sinks.grad = None
    attnkit.attention(q.detach(), k.detach(), v.detach(), enable_gqa=True, sinks=sinks).sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()
    with pytest.raises(ValueError, match="no gradient for alibi_slopes"):
        attnkit.attention(q, k, v, enable_gqa=True, alibi_slopes=slopes.clone().requires_grad_())


def test_opcheck_modifiers(rng):
    q, k, v = _leaves(rng, [(1, 4, 9, 16), (1, 2, 13, 16), (1, 2, 13, 8)])
    sinks = torch.from_numpy(randn(rng, (4,))).requires_grad_()
    slopes = torch.tensor([0.1, 0.2, 0.0, 0.05])
    args = (q, k, v, None, 2, None, 0.0, None, True, "BHSD", 3, 2, 5.0, slopes, sinks)
    torch.library.opcheck(torch.ops.attnkit.attention.default, args)
    out, lse = torch.ops.attnkit.attention(*args)
    bargs = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), torch.randn(out.shape),
             torch.randn(lse.shape), None, 2, None, 0.0, None, True, "BHSD", 3, 2, 5.0, slopes, sinks.detach())
    torch.library.opcheck(torch.ops.attnkit.attention_backward.default, bargs)


def test_modifiers_with_dropout(rng):
    """Dropout regenerated under the soft-cap, a window and sinks (the keep mask read back
    from the forward with v = identity)."""
    B, Hq, Hkv, Sq, Skv = 2, 4, 2, 40, 210
    q, k, v = randn(rng, (B, Hq, Sq, 16)), randn(rng, (B, Hkv, Skv, 16)), randn(rng, (B, Hkv, Skv, 8))
    kw = dict(causal="bottom_right", enable_gqa=True, window=(120, -1), softcap=3.0,
              sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32), dropout_p=0.3, seed=77)
    eye = np.broadcast_to(np.eye(Skv, dtype=np.float32), (B, Hkv, Skv, Skv)).copy()
    keep = attnkit.attention(q, k, eye, **kw) != 0
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape)
    got = attnkit.attention_backward(q, k, v, out, lse, dout, **kw)
    ref = grad_ref_mods(q, k, v, dout, keep=keep, **kw)
    check_mod_grads(got, ref, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal,D,Dv,mods", [
    (True, 128, 80, {}), ("bottom_right", 128, 80, {}), ("bottom_right", 128, 80, {"window": (100, -1)}),
    (False, 128, 80, {"window": (70, 30)}),
    ("bottom_right", 72, 40, {"sinks": np.array([0.5, -1.0, 2.0, 0.0], np.float32), "softcap": 3.0}),
    (True, 33, 17, {"window": (-1, 50), "alibi_slopes": np.array([0.1, 0.0, 0.3, 0.05], np.float32)}),
])
@pytest.mark.parametrize("batch", [1, 8])
def test_many_blocks_every_isa(isa, dtype, causal, D, Dv, mods, batch):
    """Several key blocks (192 keys), row blocks (96 rows, 192 on AMX) and slabs of 32 query
    rows, a causal offset that is no multiple of 32 (Skv - Sq = 184), a last slab only partly
    filled (Sq = 333), whole and partial AMX tiles (D = 128, 72, 33), modifiers (the non-plain
    pass), GQA: the edges of each ISA's layouts, avx512amx's slabs of Qᵀ and dOᵀ and its dKᵀ,
    dVᵀ accumulators included. Batch 1 splits the 3 key blocks into 3 tasks per kv head;
    batch 8 (16 kv heads) keeps them in one, whose first two blocks run together (one query
    block after the other) and whose third runs alone."""
    rng = np.random.default_rng(11)
    Sq, Skv = 333, 517
    q, k = randn(rng, (batch, 4, Sq, D), dtype), randn(rng, (batch, 2, Skv, D), dtype)
    v = randn(rng, (batch, 2, Skv, Dv), dtype)
    kw = dict(causal=causal, enable_gqa=True, **mods)
    out, lse = forward(q, k, v, **kw)
    dout = randn(rng, out.shape, dtype)
    dq, dk, dv = poisoned_grads(q, k, v)
    got = attnkit.attention_backward(q, k, v, out, lse, dout, dq=dq, dk=dk, dv=dv, **kw)
    check_mod_grads(got, grad_ref_mods(q, k, v, dout, **kw), dtype)
