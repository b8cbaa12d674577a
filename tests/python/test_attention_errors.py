"""Invalid inputs to attnkit.attention: each raises ValueError with its documented message,
writes nothing, and leaves attnkit usable."""

import math
import re

import numpy as np
import pytest

import attnkit
from conftest import assert_bits_equal, make_qkv, np_dtype, poison, randn, to_torch
from reference import assert_close, attention_ref, tolerance

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

# q [1, 2, 4, 16], k [1, 2, 5, 16], v [1, 2, 5, 8] -> out [1, 2, 4, 8]
B, H, SQ, SKV, D, DV = 1, 2, 4, 5, 16, 8


def qkv(kind="numpy", dtype="float32", layout="BHSD", Hq=H, Hkv=H):
    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, B, Hq, Hkv, SQ, SKV, D, DV, dtype, layout)
    if kind == "torch":
        return tuple(to_torch(x) for x in (q, k, v))
    return q, k, v


def arr(shape, dtype="float32", kind="numpy"):
    x = np.random.default_rng(1).standard_normal(shape).astype(np_dtype(dtype))
    return to_torch(x) if kind == "torch" else x


def expect(msg, *args, full=False, **kw):
    """Calls attnkit.attention(*args, **kw) and expects ValueError matching msg (a literal,
    escaped; full=True requires the whole message). A NaN-poisoned out= must stay NaN."""
    pattern = re.escape(msg) + ("$" if full else "")
    out = kw.get("out")
    before = _copy(out) if isinstance(out, (np.ndarray, torch.Tensor)) else None
    with pytest.raises(ValueError, match=pattern) as info:
        attnkit.attention(*args, **kw)
    if full:
        assert str(info.value) == msg
    if before is not None:
        assert np.array_equal(_copy(out), before, equal_nan=True), "out written by a failed call"
    return info


def _copy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().float().numpy().copy()
    return np.asarray(x, dtype=np.float64).copy() if x.dtype != np.bool_ else x.copy()


@pytest.fixture(autouse=True)
def still_works_after():
    """After every error test, a valid call still gives the right answer."""
    yield
    q, k, v = qkv()
    out = attnkit.attention(q, k, v, causal=True)
    assert_close(out, attention_ref(q, k, v, causal=True)[0], *tolerance("float32"))
    qt, kt, vt = qkv("torch")
    out = attnkit.attention(qt, kt, vt)
    assert_close(out, attention_ref(qt, kt, vt)[0], *tolerance("float32"))


KINDS = ["numpy", "torch"]


# --- ranks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("rank", [3, 5])
def test_wrong_rank(kind, which, rank):
    q, k, v = qkv(kind)
    x = {"q": q, "k": k, "v": v}[which]
    bad = x[0] if rank == 3 else x[None]
    args = {"q": q, "k": k, "v": v}
    args[which] = bad
    shape = list(bad.shape)
    expect(f"{which} must be a 4-d tensor (layout BHSD), got {rank}-d {shape}",
           args["q"], args["k"], args["v"])


def test_wrong_rank_bshd():
    q, k, v = qkv(layout="BSHD")
    expect("q must be a 4-d tensor (layout BSHD), got 2-d [4, 2]", q[0, :, :, 0], k, v,
           layout="BSHD")


# --- shapes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_k_batch_mismatch(kind):
    q, _, v = qkv(kind)
    k = arr((2, H, SKV, D), kind=kind)
    expect(f"k batch size must equal q's B={B}, got 2", q, k, v)


@pytest.mark.parametrize("kind", KINDS)
def test_k_head_dim_mismatch(kind):
    q, _, v = qkv(kind)
    expect(f"k head dim must equal q's D={D}, got 12", q, arr((B, H, SKV, 12), kind=kind), v)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vshape,layout", [((B, H, SKV + 1, DV), "BHSD"), ((2, H, SKV, DV), "BHSD"),
                                           ((B, 1, SKV, DV), "BHSD"), ((B, SKV + 2, H, DV), "BSHD")])
def test_v_shape_mismatch(kind, vshape, layout):
    q, k, _ = qkv(kind, layout=layout)
    v = arr(vshape, kind=kind)
    want = f"[{B}, {H}, {SKV}, {DV}]" if layout == "BHSD" else f"[{B}, {SKV}, {H}, {DV}]"
    expect(f"v must have shape {want} (B, Hkv, Skv from q and k), got {list(vshape)}",
           q, k, v, layout=layout, full=True)


# --- dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which,other", [("k", "float16"), ("v", "bfloat16"), ("k", "bfloat16")])
def test_dtype_mismatch(kind, which, other):
    q, k, v = qkv(kind)
    args = {"q": q, "k": k, "v": v}
    args[which] = arr(tuple(args[which].shape), other, kind)
    expect(f"{which} must have q's dtype float32, got {other}", args["q"], args["k"], args["v"],
           full=True)


def test_dtype_mismatch_q_is_16bit():
    q, k, v = qkv(dtype="bfloat16")
    expect("v must have q's dtype bfloat16, got float32", q, k, arr((B, H, SKV, DV)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["int32", "int64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"])
def test_unsupported_attention_dtype(kind, dtype):
    shapes = [(B, H, SQ, D), (B, H, SKV, D), (B, H, SKV, DV)]
    if kind == "numpy":
        npdt = getattr(ml_dtypes, dtype) if dtype.startswith("float8") else np.dtype(dtype)
        q, k, v = (np.ones(s, dtype=npdt) for s in shapes)
    else:
        q, k, v = (torch.ones(s, dtype=getattr(torch, dtype)) for s in shapes)
    expect(f"q must be float32, float16 or bfloat16, got {dtype}", q, k, v, full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float64", "complex64"])
def test_unknown_dtype(kind, dtype):
    shapes = [(B, H, SQ, D), (B, H, SKV, D), (B, H, SKV, DV)]
    if kind == "numpy":
        q, k, v = (np.ones(s, dtype=dtype) for s in shapes)
    else:
        q, k, v = (torch.ones(s, dtype=getattr(torch, dtype)) for s in shapes)
    # numpy's and torch's default float and int dtypes get this op's list, not every dtype
    # attnkit knows
    expect(f"q must be float32, float16 or bfloat16, got {q.dtype}", q, k, v, full=True)


# --- heads -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_heads_differ_without_gqa(kind):
    q, k, v = qkv(kind, Hq=8, Hkv=2)
    expect("q and k must have the same number of heads unless enable_gqa=True, got q_heads=8 "
           "and kv_heads=2", q, k, v, full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("Hq,Hkv", [(12, 8), (3, 2), (2, 4), (5, 3)])
def test_gqa_not_a_multiple(kind, layout, Hq, Hkv):
    q, k, v = qkv(kind, layout=layout, Hq=Hq, Hkv=Hkv)
    expect(f"GQA/MQA requires query heads to be a multiple of KV heads, got q_heads={Hq} "
           f"and kv_heads={Hkv}", q, k, v, enable_gqa=True, layout=layout, full=True)


def test_gqa_exact_message_12_8():
    q, k, v = qkv(Hq=12, Hkv=8)
    with pytest.raises(ValueError) as info:
        attnkit.attention(q, k, v, enable_gqa=True)
    assert re.fullmatch(re.escape("GQA/MQA requires query heads to be a multiple of KV heads, "
                                  "got q_heads=12 and kv_heads=8"), str(info.value))


def test_gqa_zero_kv_heads():
    q, _, _ = qkv()
    k, v = np.ones((B, 0, SKV, D), np.float32), np.ones((B, 0, SKV, DV), np.float32)
    expect(f"GQA/MQA requires query heads to be a multiple of KV heads, got q_heads={H} "
           "and kv_heads=0", q, k, v, enable_gqa=True, full=True)


# --- mask ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(SQ, SKV + 1), (SQ + 1, SKV), (3, SQ, SKV), (2, 1, SQ, SKV),
                                   (SKV - 1,), (B, H, SQ, 1, SKV)])
def test_mask_not_broadcastable(kind, shape):
    q, k, v = qkv(kind)
    mask = np.ones(shape, dtype=bool)
    if kind == "torch":
        mask = torch.from_numpy(mask)
    if len(shape) > 4:
        msg = "attn_mask must have at most 4 dims (broadcastable to [B, Hq, Sq, Skv]), got 5-d"
    else:
        msg = (f"attn_mask of shape {list(shape)} is not broadcastable to [B, Hq, Sq, Skv] = "
               f"[{B}, {H}, {SQ}, {SKV}]")
    expect(msg, q, k, v, attn_mask=mask)


def test_mask_bshd_order_is_still_bhsd():
    """The mask is [B, Hq, Sq, Skv] in both layouts: a BSHD-ordered mask is rejected."""
    q, k, v = qkv(layout="BSHD", Hq=3, Hkv=3)
    mask = np.ones((B, SQ, 3, SKV), dtype=bool)
    expect(f"attn_mask of shape [{B}, {SQ}, 3, {SKV}] is not broadcastable to [B, Hq, Sq, Skv] "
           f"= [{B}, 3, {SQ}, {SKV}]", q, k, v, attn_mask=mask, layout="BSHD")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["int32", "int8", "uint8", "float8_e4m3fn"])
def test_mask_bad_dtype(kind, dtype):
    q, k, v = qkv(kind)
    if kind == "numpy":
        npdt = getattr(ml_dtypes, dtype) if dtype.startswith("float8") else np.dtype(dtype)
        mask = np.zeros((SQ, SKV), dtype=npdt)
    else:
        mask = torch.zeros((SQ, SKV), dtype=getattr(torch, dtype))
    expect(f"attn_mask must be bool or float32/float16/bfloat16, got {dtype}", q, k, v,
           attn_mask=mask, full=True)


def test_mask_float64():
    q, k, v = qkv()
    expect("attn_mask must be bool or float32/float16/bfloat16, got float64", q, k, v,
           attn_mask=np.zeros((SQ, SKV)), full=True)


# --- scalars ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), float("inf"), -float("inf")])
def test_dropout_out_of_range(kind, p):
    q, k, v = qkv(kind)
    expect("dropout_p must be in [0, 1), got ", q, k, v, dropout_p=p, seed=1)


@pytest.mark.parametrize("p", ["0.1", None, True, [0.1]])
def test_dropout_wrong_type(p):
    q, k, v = qkv()
    expect(f"dropout_p must be a float, got {type(p).__name__}", q, k, v, dropout_p=p, full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", ["0.5", True, [1.0], 1j, np.True_])
def test_scale_wrong_type(kind, scale):
    q, k, v = qkv(kind)
    expect(f"scale must be a float, got {type(scale).__name__}", q, k, v, scale=scale,
           full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [lambda: np.zeros(2), lambda: np.array(True), lambda: np.array(1j),
                                  lambda: torch.zeros(2), lambda: torch.tensor(True),
                                  lambda: np.zeros((1, 1))])
def test_scale_wrong_array(kind, make):
    q, k, v = qkv(kind)
    scale = make()
    expect(f"scale must be a float, got a {type(scale).__name__} of dtype {scale.dtype} and shape "
           f"{list(scale.shape)}", q, k, v, scale=scale, full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [np.float32, np.float64, np.float16, np.int64, np.array,
                                  lambda x: np.array([x]), torch.tensor,
                                  lambda x: torch.tensor(x, dtype=torch.bfloat16)])
def test_scale_numpy_and_tensor_scalars(kind, make, rng):
    """A numpy scalar, or a 0-d array or tensor, is the same scale as the Python float."""
    q, k, v = (randn(rng, s) for s in ((B, H, SQ, D), (B, H, SKV, D), (B, H, SKV, DV)))
    if kind == "torch":
        q, k, v = (to_torch(x) for x in (q, k, v))
    value = 0.25 if make is not np.int64 else 2
    got = attnkit.attention(q, k, v, scale=make(value))
    want = attnkit.attention(q, k, v, scale=float(value))
    assert_bits_equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", [10**400, -10**400])
def test_scale_past_float_range(kind, scale):
    q, k, v = qkv(kind)
    expect("scale must be a float, got ", q, k, v, scale=scale)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["enable_gqa", "return_lse"])
@pytest.mark.parametrize("value", ["yes", 1, 0, None, 1.0, "False", [True]])
def test_flags_must_be_bool(kind, name, value):
    q, k, v = qkv(kind)
    expect(f"{name} must be True or False, got {value!r}", q, k, v, full=True, **{name: value})


@pytest.mark.parametrize("kind", KINDS)
def test_flags_take_numpy_bools(kind):
    q, k, v = qkv(kind)
    out, lse = attnkit.attention(q, k, v, enable_gqa=np.True_, return_lse=np.True_, causal=np.True_)
    assert_bits_equal(out, attnkit.attention(q, k, v, causal=True))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", [float("inf"), -float("inf"), float("nan"), 1e309, 1e39, -3.5e38])
def test_scale_not_finite(kind, scale):
    """Finite in double is not enough: the kernels use float32, where 1e39 is inf."""
    q, k, v = qkv(kind)
    expect("scale must be finite, got ", q, k, v, scale=scale)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64, 2**70, 1.5, "1", True])
def test_bad_seed(kind, seed):
    q, k, v = qkv(kind)
    expect(f"seed must be None or an int in [0, 2**64), got {seed!r}", q, k, v, seed=seed,
           dropout_p=0.1, full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", ["x", "bottom-right", "TOP_LEFT", 2, -1, 0.5, [True], "True", 1, 0,
                                    1.0])
def test_bad_causal(kind, causal):
    q, k, v = qkv(kind)
    expect(f'causal must be False, True, "top_left" or "bottom_right", got {causal!r}', q, k, v,
           causal=causal, full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["bhsd", "BSDH", "", None, 0, "BHSD "])
def test_bad_layout(kind, layout):
    q, k, v = qkv(kind)
    expect(f'layout must be "BHSD" or "BSHD", got {layout!r}', q, k, v, layout=layout, full=True)


# --- head dims -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [0, 513, 1024])
def test_head_dim_out_of_range(kind, d):
    q, k, v = arr((B, H, SQ, d), kind=kind), arr((B, H, SKV, d), kind=kind), \
        arr((B, H, SKV, DV), kind=kind)
    expect(f"q head dim D must be in [1, 512], got {d}", q, k, v, full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dv", [0, 513])
def test_value_head_dim_out_of_range(kind, dv):
    q, k, _ = qkv(kind)
    expect(f"v head dim Dv must be in [1, 512], got {dv}", q, k, arr((B, H, SKV, dv), kind=kind),
           full=True)


# --- out= ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_out_wrong_shape(kind, layout):
    q, k, v = qkv(kind, layout=layout)
    want = f"[{B}, {H}, {SQ}, {DV}]" if layout == "BHSD" else f"[{B}, {SQ}, {H}, {DV}]"
    for shape in [(B, H, SQ, D), (B, H, SQ + 1, DV), (B, SQ, H, DV) if layout == "BHSD"
                  else (B, H, SQ, DV)]:
        out = poison(shape, np.float32)
        out = to_torch(out) if kind == "torch" else out
        expect(f"out must have shape {want}, got {list(shape)}", q, k, v, out=out, layout=layout,
               full=True)


@pytest.mark.parametrize("kind", KINDS)
def test_out_wrong_rank(kind):
    q, k, v = qkv(kind)
    out = poison((B * H, SQ, DV), np.float32)
    out = to_torch(out) if kind == "torch" else out
    expect(f"out must be a 4-d tensor [B, Hq, Sq, Dv] (layout BHSD), got 3-d [{B * H}, {SQ}, {DV}]",
           q, k, v, out=out, full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_out_wrong_dtype(kind, dtype):
    q, k, v = qkv(kind)
    out = poison((B, H, SQ, DV), np_dtype(dtype))
    out = to_torch(out) if kind == "torch" else out
    expect(f"out must have q's dtype float32, got {dtype}", q, k, v, out=out, full=True)


def test_out_float64():
    q, k, v = qkv()
    expect("out must be float32, float16 or bfloat16, got float64", q, k, v,
           out=np.zeros((B, H, SQ, DV)), full=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["q", "k", "v", "attn_mask"])
def test_out_aliases_input(kind, which):
    # D == Dv == Sq == Skv so that out can be q, k, v or the mask itself
    rng = np.random.default_rng(3)
    q, k, v = make_qkv(rng, B, H, H, DV, DV, DV, DV)
    mask = np.zeros((B, H, DV, DV), np.float32)
    if kind == "torch":
        q, k, v, mask = (to_torch(x) for x in (q, k, v, mask))
    out = {"q": q, "k": k, "v": v, "attn_mask": mask}[which]
    expect(f"out must not alias {which} (their memory overlaps)", q, k, v, attn_mask=mask,
           out=out, full=True)


def test_out_partial_overlap_with_input():
    """A view that overlaps q's buffer only partly is aliasing too."""
    buf = np.random.default_rng(4).standard_normal(2 * B * H * SQ * D).astype(np.float32)
    q = buf[: B * H * SQ * D].reshape(B, H, SQ, D)
    _, k, v = qkv()
    out = buf[B * H * SQ * D - 5: B * H * SQ * D - 5 + B * H * SQ * DV].reshape(B, H, SQ, DV)
    expect("out must not alias q (their memory overlaps)", q, k, v, out=out, full=True)


@pytest.mark.parametrize("kind", KINDS)
def test_out_zero_stride(kind):
    q, k, v = qkv(kind)
    if kind == "numpy":
        base = np.full((B, 1, SQ, DV), np.nan, np.float32)
        out = np.lib.stride_tricks.as_strided(base, (B, H, SQ, DV),
                                              (base.strides[0], 0) + base.strides[2:])
        assert out.flags.writeable
    else:
        out = torch.full((B, 1, SQ, DV), float("nan")).expand(B, H, SQ, DV)
    expect("out must not have overlapping elements, got stride 0 in dim 1 of shape "
           f"[{B}, {H}, {SQ}, {DV}]", q, k, v, out=out, full=True)


def test_out_read_only():
    """A read-only out= is invalid input: ValueError, not a TypeError from the binding."""
    q, k, v = qkv()
    out = poison((B, H, SQ, DV), np.float32)
    out.setflags(write=False)
    with pytest.raises(ValueError, match="out"):
        attnkit.attention(q, k, v, out=out)
    bc = np.broadcast_to(poison((B, 1, SQ, DV), np.float32), (B, H, SQ, DV))
    with pytest.raises(ValueError, match="out"):
        attnkit.attention(q, k, v, out=bc)


# --- kinds -----------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["k", "v", "attn_mask", "out"])
def test_mixed_numpy_then_torch(which):
    q, k, v = qkv("numpy")
    args = dict(k=k, v=v, attn_mask=None, out=None)
    args[which] = {"k": to_torch(k), "v": to_torch(v),
                   "attn_mask": torch.ones(SQ, SKV, dtype=torch.bool),
                   "out": torch.empty(B, H, SQ, DV)}[which]
    expect(f"{which} must be a numpy array like q, got Tensor", q, args["k"], args["v"],
           attn_mask=args["attn_mask"], out=args["out"], full=True)


@pytest.mark.parametrize("which", ["k", "v", "attn_mask", "out"])
def test_mixed_torch_then_numpy(which):
    q, k, v = qkv("torch")
    args = dict(k=k, v=v, attn_mask=None, out=None)
    args[which] = {"k": k.numpy(), "v": v.numpy(), "attn_mask": np.ones((SQ, SKV), bool),
                   "out": np.empty((B, H, SQ, DV), np.float32)}[which]
    expect(f"{which} must be a torch tensor like q, got ndarray", q, args["k"], args["v"],
           attn_mask=args["attn_mask"], out=args["out"], full=True)


@pytest.mark.parametrize("which", ["q", "k", "v", "attn_mask", "out"])
@pytest.mark.parametrize("bad", [[[[[1.0]]]], 1.0, "q", (1, 2)])
def test_not_an_array(which, bad):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, attn_mask=None, out=None)
    args[which] = bad
    if which == "q":
        msg = f"q must be a numpy array or a torch tensor, got {type(bad).__name__}"
    else:
        msg = f"{which} must be a numpy array or a torch tensor, got {type(bad).__name__}"
    expect(msg, args["q"], args["k"], args["v"], attn_mask=args["attn_mask"], out=args["out"],
           full=True)


def test_none_inputs():
    q, k, v = qkv()
    expect("k must be a numpy array or a torch tensor, got NoneType", q, None, v, full=True)


# --- errors leave state intact ---------------------------------------------------------------

def test_many_errors_then_valid_calls(restore_runtime):
    q, k, v = qkv()
    bad_calls = [
        dict(dropout_p=2.0), dict(layout="x"), dict(causal="x"), dict(scale=math.inf),
        dict(attn_mask=np.ones((3, 3), bool)), dict(out=np.empty((1,), np.float32)),
        dict(seed=-1),
    ]
    for _ in range(3):
        for isa_name in attnkit.supported_isas():
            attnkit.set_isa(isa_name)
            for kw in bad_calls:
                with pytest.raises(ValueError):
                    attnkit.attention(q, k, v, **kw)
            out = attnkit.attention(q, k, v, dropout_p=0.5, seed=3)
            assert np.isfinite(out).all()
    assert_close(attnkit.attention(q, k, v), attention_ref(q, k, v)[0], *tolerance("float32"))


def test_error_does_not_write_out():
    q, k, v = qkv()
    out = poison((B, H, SQ, DV), np.float32)
    expect("attn_mask of shape", q, k, v, out=out, attn_mask=np.ones((7, 7), bool))
    expect("scale must be finite", q, k, v, out=out, scale=math.nan)
    expect("dropout_p must be in [0, 1)", q, k, v, out=out, dropout_p=1.0)
    assert np.isnan(out).all()


def test_non_cpu_tensor():
    q, k, v = qkv("torch")
    expect("q must be a CPU tensor, got device meta", q.to("meta"), k, v, full=True)
    expect("k must be a CPU tensor, got device meta", q, k.to("meta"), v, full=True)


def test_registered_op_rejects_bad_codes():
    """The torch.library op validates what the Python wrapper normally checks for it."""
    q, k, v = qkv("torch")
    op = torch.ops.attnkit.attention.default
    with pytest.raises(ValueError, match=re.escape("causal: expected 0, 1 or 2")):
        op(q, k, v, None, 3, None, 0.0, None, False, "BHSD")
    with pytest.raises(ValueError, match=re.escape('layout must be "BHSD" or "BSHD", got "XY"')):
        op(q, k, v, None, 0, None, 0.0, None, False, "XY")
    with pytest.raises(ValueError, match=re.escape("dropout_p must be in [0, 1), got 1")):
        op(q, k, v, None, 0, None, 1.0, 5, False, "BHSD")
    out = torch.full((B, H, SQ, DV), float("nan"))
    with pytest.raises(ValueError, match=re.escape("lse must have shape [1, 2, 4] ([B, Hq, Sq]), "
                                                   "got [1, 2, 5]")):
        torch.ops.attnkit.attention_out.default(q, k, v, None, 0, None, 0.0, None, False, "BHSD",
                                                out, torch.empty(B, H, SKV))
    with pytest.raises(ValueError, match=re.escape("lse must be float32, got bfloat16")):
        torch.ops.attnkit.attention_out.default(q, k, v, None, 0, None, 0.0, None, False, "BHSD",
                                                out, torch.empty(B, H, SQ, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=re.escape("out must not alias lse")):
        torch.ops.attnkit.attention_out.default(q, k, v, None, 0, None, 0.0, None, False, "BHSD",
                                                out, out[:, :, :, 0])
    assert torch.isnan(out).all()
