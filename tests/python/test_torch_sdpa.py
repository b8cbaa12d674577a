"""attnkit.torch.scaled_dot_product_attention, the drop-in for torch's, and sdpa_override():
torch's signature and semantics (leading dims, broadcasting, GQA, masks, causal, scales,
empty results), checked against a float64 reference of torch's math kernel written here;
what attnkit cannot compute goes to torch's kernel with one warning per reason."""

import warnings

import numpy as np
import pytest

import attnkit
from conftest import assert_bits_equal, np_dtype
from reference import P_ROUNDING, TOLERANCES, assert_close, to_f64

torch = pytest.importorskip("torch")
import attnkit.torch as ak  # noqa: E402

F = torch.nn.functional


def sdpa_ref(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch's math SDPA in float64 (numpy): broadcasting matmuls over any leading dims,
    enable_gqa as repeat_interleave on dim -3; (out, sum_j p_j |v_j| per output)."""
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    L, S = q.shape[-2], k.shape[-2]
    if enable_gqa and q.ndim >= 3:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
        v = np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if is_causal:
        s = np.where(np.tril(np.ones((L, S), bool)), s, -np.inf)
    if attn_mask is not None:
        m = to_f64(attn_mask)
        s = np.where(m, s, -np.inf) if m.dtype == np.bool_ else s + m
    mx = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(mx), mx, 0.0))
    den = p.sum(-1, keepdims=True)
    p = np.where(den > 0, p / np.where(den > 0, den, 1.0), 0.0)
    return np.matmul(p, v), np.matmul(p, np.abs(v))


def tol(dtype, magnitude):
    atol, rtol = TOLERANCES[dtype][0]
    if dtype == "bfloat16":
        atol = atol + P_ROUNDING * magnitude
    return atol, rtol


def rand(rng, shape, dtype="float32"):
    x = rng.standard_normal(shape)
    x = np.where(x == 0, 0.5, x).astype(np_dtype(dtype) if dtype != "bfloat16" else np.float32)
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(torch.bfloat16) if dtype == "bfloat16" else t


CASES = [
    # q shape, k shape, v shape, mask shape or None, is_causal, enable_gqa
    ((2, 4, 33, 16), (2, 4, 47, 16), (2, 4, 47, 24), None, False, False),          # 4-d
    ((3, 17, 8), (3, 29, 8), (3, 29, 8), None, True, False),                        # 3-d
    ((2, 3, 2, 9, 16), (2, 3, 2, 13, 16), (2, 3, 2, 13, 16), (9, 13), False, False),  # 5-d
    ((11, 32), (7, 32), (7, 16), None, False, False),                               # 2-d
    ((2, 8, 5, 16), (1, 8, 130, 16), (1, 8, 130, 16), None, False, False),          # batch broadcast
    ((2, 8, 5, 16), (2, 1, 20, 16), (2, 1, 20, 16), None, True, False),             # singleton kv head
    ((2, 1, 5, 16), (2, 4, 20, 16), (2, 4, 20, 16), None, False, False),            # singleton q head
    ((2, 8, 65, 64), (2, 2, 129, 64), (2, 2, 129, 64), (2, 1, 65, 129), True, True),  # GQA + mask + causal
    ((1, 4, 49, 16), (1, 4, 20, 16), (1, 4, 20, 16), (4, 49, 20), True, False),     # L > S causal
    ((4, 6, 16), (4, 9, 16), (1, 9, 16), (4, 6, 9), False, False),                  # 3-d, v broadcast
    ((2, 3, 1, 5, 8), (1, 3, 1, 7, 8), (2, 1, 1, 7, 8), (1, 1, 5, 7), False, False),  # 5-d broadcasts
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_matches_reference(rng, case, dtype, mask_kind):
    qs, ks, vs, ms, causal, gqa = CASES[case]
    q, k, v = rand(rng, qs, dtype), rand(rng, ks, dtype), rand(rng, vs, dtype)
    mask = None
    if ms is not None:
        if mask_kind == "bool":
            mask = torch.from_numpy(rng.random(ms) < 0.8)
        else:
            mask = rand(rng, ms, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here may fall back to torch's kernel
        out = ak.scaled_dot_product_attention(q, k, v, mask, 0.0, causal, None, gqa)
    ref, mag = sdpa_ref(q, k, v, mask, causal, None, gqa)
    assert out.dtype == q.dtype
    # the shape torch gives (its math kernel refuses a mask with is_causal; shapes don't depend on it)
    assert tuple(out.shape) == ref.shape == tuple(F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), None if mask is None else mask if mask.dtype == torch.bool
        else mask.float(), is_causal=causal and mask is None, enable_gqa=gqa).shape)
    assert_close(out, ref, *tol(dtype, mag))


@pytest.mark.parametrize("scale", [0.3, np.float32(0.3), np.float64(0.3), np.array(0.3),
                                   torch.tensor(0.3), torch.tensor(0.3, dtype=torch.float64)])
def test_scale_forms(rng, scale):
    q, k, v = (rand(rng, (1, 2, 9, 16)) for _ in range(3))
    got = ak.scaled_dot_product_attention(q, k, v, scale=scale)
    assert_bits_equal(got, attnkit.attention(q, k, v, scale=float(scale)))


def test_positional_and_keyword_arguments_as_torch(rng):
    q, k, v = (rand(rng, (2, 2, 9, 16)) for _ in range(3))
    mask = torch.from_numpy(rng.random((9, 9)) < 0.7)
    a = ak.scaled_dot_product_attention(q, k, v, mask, 0.0, False, 0.25)
    b = ak.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=mask, scale=0.25)
    assert_bits_equal(a, b)
    assert_close(a, sdpa_ref(q, k, v, mask, False, 0.25)[0], *tol("float32", 0))


@pytest.mark.parametrize("shapes", [
    ((2, 4, 3, 0), (2, 4, 5, 0), (2, 4, 5, 6)),   # D = 0: the mean of v
    ((2, 4, 0, 8), (2, 4, 5, 8), (2, 4, 5, 6)),   # L = 0
    ((2, 4, 3, 8), (2, 4, 0, 8), (2, 4, 0, 6)),   # S = 0: zeros
    ((0, 4, 3, 8), (0, 4, 5, 8), (0, 4, 5, 6)),   # no batch
    ((2, 4, 3, 8), (2, 4, 5, 8), (2, 4, 5, 0)),   # Ev = 0
])
def test_empty_as_torch(rng, shapes):
    q, k, v = (rand(rng, s) for s in shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ak.scaled_dot_product_attention(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shapes,kw", [
    (((1, 2, 6, 16), (1, 2, 9, 16), (1, 2, 9, 16), (3, 1, 6, 9)), {}),   # a mask may not widen the batch
    (((2, 8, 6, 16), (2, 3, 9, 16), (2, 3, 9, 16), None), {"enable_gqa": True}),  # 8 % 3
    (((2, 8, 6, 16), (2, 2, 9, 16), (2, 2, 9, 16), None), {}),           # GQA without enable_gqa
    (((2, 2, 6, 16), (3, 2, 9, 16), (3, 2, 9, 16), None), {}),           # batches 2 and 3
    (((1, 2, 6, 16), (1, 2, 9, 16), (1, 2, 9, 16), ((6, 9), torch.float16)), {}),  # fp16 mask, fp32 q
])
def test_what_torch_refuses_is_refused(rng, shapes, kw):
    q, k, v = (rand(rng, s) for s in shapes[:3])
    mask = None if shapes[3] is None else (torch.zeros(shapes[3][0], dtype=shapes[3][1])
                                           if isinstance(shapes[3][-1], torch.dtype) else torch.zeros(shapes[3]))
    with pytest.raises(RuntimeError) as want:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError) as got:
            ak.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    assert str(got.value) == str(want.value)


def test_fully_masked_row_is_zero(rng):
    q, k, v = (rand(rng, (1, 2, 4, 8)) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2] = False
    out = ak.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out[:, :, 2] == 0).all()
    assert (F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:, :, 2] == 0).all()


def _fallback(reason, call):
    ak._warn_once.reasons.discard(reason)
    with pytest.warns(UserWarning, match=f"attnkit.torch.scaled_dot_product_attention: {reason}; "
                                         "using torch's own kernel"):
        first = call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        second = call()
    return first, second


def test_float64_falls_back_once(rng):
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 3, 7, 8))) for _ in range(3))
    first, second = _fallback("dtype float64", lambda: ak.scaled_dot_product_attention(q, k, v, is_causal=True))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_bits_equal(first, want)
    assert_bits_equal(second, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shapes,kw", [
    (((2, 4, 37, 16), (2, 2, 53, 16), (2, 2, 53, 8)), dict(is_causal=True, enable_gqa=True)),
    (((3, 1, 4, 9, 8), (1, 4, 11, 8), (1, 4, 11, 8)), dict(scale=0.3)),   # broadcast batch dims
    (((1, 9, 8), (2, 11, 8), (2, 11, 8)), dict(attn_mask="bool")),        # one query head over two kv heads
    (((2, 3, 12, 8), (2, 1, 12, 8), (2, 1, 12, 8)), dict(attn_mask="float")),  # one kv head broadcast
])
def test_requires_grad_runs_attnkits_backward(rng, dtype, shapes, kw):
    """Grad mode with inputs that require grad: attnkit's backward (no fallback warning),
    the gradients against torch float64 autograd of torch's own SDPA (the math kernel)."""
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    q, k, v = (rand(rng, s).to(tdt) for s in shapes)
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.from_numpy(rng.random((q.shape[-2], k.shape[-2])) < 0.8)
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.from_numpy(rng.standard_normal((q.shape[-2], k.shape[-2])).astype(np.float32))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        out = ak.scaled_dot_product_attention(*leaves, **kw)
    dout = rand(rng, tuple(out.shape)).to(tdt)
    out.backward(dout)
    ref_leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref_kw = dict(kw)
    if isinstance(ref_kw.get("attn_mask"), torch.Tensor) and ref_kw["attn_mask"].is_floating_point():
        ref_kw["attn_mask"] = ref_kw["attn_mask"].double()
    F.scaled_dot_product_attention(*ref_leaves, **ref_kw).backward(dout.double())
    atol, rtol = {"float32": (2e-5, 1e-4), "bfloat16": (1.6e-2, 2e-2)}[dtype]
    top = max(float(x.grad.abs().max()) for x in ref_leaves)
    for got, ref in zip(leaves, ref_leaves):
        assert got.grad.dtype == tdt and got.grad.shape == got.shape
        assert_close(got.grad.double(), ref.grad, atol * top, rtol)


def test_requires_grad_dropout_backward_uses_the_forwards_mask(rng):
    """Dropout under grad: the keep mask regenerated in the backward is the forward's (v =
    identity makes out the dropped probabilities, so dv = Pᵀ·dout shows the same zeros)."""
    q, k = rand(rng, (1, 2, 6, 8)), rand(rng, (1, 2, 6, 8))
    v = torch.eye(6).expand(1, 2, 6, 6).clone().requires_grad_(True)
    torch.manual_seed(3)
    out = ak.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    dout = torch.zeros_like(out)
    dout[..., 2, :] = 1.0  # dv[j] = P_dropped[2, j]
    out.backward(dout)
    assert torch.equal(v.grad[..., 0] != 0, out.detach()[..., 2, :] != 0)


def test_mask_requiring_grad_falls_back(rng):
    q, k, v = (rand(rng, (1, 2, 5, 8)).requires_grad_(True) for _ in range(3))
    mask = torch.zeros(5, 5, requires_grad=True)
    out, _ = _fallback("attn_mask requires grad and attnkit computes no mask gradient",
                       lambda: ak.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    out.sum().backward()
    assert mask.grad is not None and q.grad is not None


def test_large_head_dim_and_mask_dtype_fall_back(rng):
    q = rand(rng, (1, 1, 3, 520))
    _fallback("head dim over 512", lambda: ak.scaled_dot_product_attention(q, q, q))
    q = rand(rng, (1, 1, 3, 8))
    mask = torch.zeros(3, 3, dtype=torch.float64)
    ak._warn_once.reasons.discard("attn_mask dtype float64")
    with pytest.warns(UserWarning, match="attn_mask dtype float64"), pytest.raises(RuntimeError):
        ak.scaled_dot_product_attention(q, q, q, attn_mask=mask)  # torch rejects it too


@pytest.mark.parametrize("name,value", [("is_causal", "yes"), ("is_causal", 1), ("enable_gqa", "yes"),
                                        ("enable_gqa", None)])
def test_flags_must_be_bool(rng, name, value):
    q = rand(rng, (1, 1, 3, 8))
    with pytest.raises(ValueError, match=f"{name} must be True or False, got {value!r}"):
        ak.scaled_dot_product_attention(q, q, q, **{name: value})


def test_dropout_reproducible_from_torch_seed(rng):
    q, k, v = (rand(rng, (1, 2, 16, 8)) for _ in range(3))
    torch.manual_seed(5)
    a = ak.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    b = ak.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert_bits_equal(a, b)
    assert not torch.equal(a, ak.scaled_dot_product_attention(q, k, v))


# --- sdpa_override ---------------------------------------------------------------------------

def test_override_routes_cpu_calls(rng):
    q, k, v = (rand(rng, (2, 4, 9, 16)) for _ in range(3))
    original = F.scaled_dot_product_attention
    calls = []
    real = ak.scaled_dot_product_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ak, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        with ak.sdpa_override():
            assert F.scaled_dot_product_attention is not original
            got = torch.nn.functional.scaled_dot_product_attention(q, k, v, None, 0.0, True)
            with ak.sdpa_override():  # nests
                F.scaled_dot_product_attention(q, k, v)
            F.scaled_dot_product_attention(q, k, v)
        assert F.scaled_dot_product_attention is original
    assert len(calls) == 3
    assert_bits_equal(got, attnkit.attention(q, k, v, causal=True))


def test_override_restores_after_an_exception():
    original = F.scaled_dot_product_attention
    with pytest.raises(KeyError):
        with ak.sdpa_override():
            raise KeyError("x")
    assert F.scaled_dot_product_attention is original


def test_override_leaves_other_devices_to_torch():
    q = torch.empty(1, 2, 3, 8, device="meta")
    with ak.sdpa_override():
        out = F.scaled_dot_product_attention(q, q, q)
    assert out.device.type == "meta" and out.shape == (1, 2, 3, 8)


def test_override_reaches_multihead_attention(rng):
    """nn.MultiheadAttention calls F.scaled_dot_product_attention through the module."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)  # train mode: eval takes a fused kernel
    x = rand(rng, (2, 10, 32))
    with torch.no_grad():
        want = mha(x, x, x, need_weights=False)[0]
        seen = []
        real = ak.scaled_dot_product_attention
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ak, "scaled_dot_product_attention", lambda *a, **kw: seen.append(1) or real(*a, **kw))
            with ak.sdpa_override():
                got = mha(x, x, x, need_weights=False)[0]
    assert seen
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_override_under_compile_traces_the_op(rng):
    q, k, v = (rand(rng, (1, 2, 9, 16)) for _ in range(3))
    graphs = []

    def backend(gm, inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      backend=backend, fullgraph=True)
    with ak.sdpa_override(), torch.no_grad():
        got = f(q, k, v)
    torch._dynamo.reset()
    assert any("attnkit.attention" in g for g in graphs), graphs
    assert_bits_equal(got, attnkit.attention(q, k, v, causal=True))


def test_edge_values_torch_defines_go_to_torch(rng):
    """dropout_p = 1 (all dropped: zeros) and an infinite scale are defined by torch and refused
    by attnkit.attention: the drop-in leaves them to torch, quietly, and matches it."""
    q, k, v = (rand(rng, (1, 2, 5, 8)) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in (dict(dropout_p=1.0), dict(scale=float("inf"))):
            torch.testing.assert_close(ak.scaled_dot_product_attention(q, k, v, **kw),
                                       F.scaled_dot_product_attention(q, k, v, **kw), equal_nan=True)


@pytest.mark.parametrize("mask_shape,q_shape", [((5,), (1, 2, 5, 8)), ((1, 2, 5, 5), (2, 5, 8))])
def test_masks_torch_refuses_go_to_torch(rng, mask_shape, q_shape):
    """A 1-d mask, or one with more dims than the inputs: torch's own error."""
    q = rand(rng, q_shape)
    mask = torch.ones(mask_shape, dtype=torch.bool)
    with pytest.raises(Exception) as want:
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    with pytest.raises(Exception) as got:
        ak.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


def test_dynamic_shapes_compile_fullgraph(rng):
    """Under dynamic shapes the head counts are symbolic: the drop-in passes no comparison of
    them as a flag (it was a SymBool, refused as not a bool)."""
    q, k, v = rand(rng, (1, 4, 6, 8)), rand(rng, (1, 2, 7, 8)), rand(rng, (1, 2, 7, 8))
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: ak.scaled_dot_product_attention(q, k, v, enable_gqa=True), fullgraph=True,
                      dynamic=True)
    with torch.no_grad():
        got = f(q, k, v)
    torch._dynamo.reset()
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
