"""attnkit.attention with torch tensors: agreement with torch SDPA (a second opinion next to
the float64 reference), dtype/kind round trips, out=, torch.compile and torch.library.opcheck."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attnkit
from conftest import (DTYPES, assert_bits_equal, assert_unmodified, make_mask, make_qkv,
                      snapshot, strided_like, to_torch)
from reference import assert_close, attention_ref, pv_magnitude, tolerance

torch = pytest.importorskip("torch")
F = torch.nn.functional


def tq(rng, B, Hq, Hkv, Sq, Skv, D, Dv, dtype="float32", layout="BHSD"):
    return tuple(to_torch(x) for x in make_qkv(rng, B, Hq, Hkv, Sq, Skv, D, Dv, dtype, layout))


def causal_mask(Sq, Skv, convention):
    """Explicit bool mask (True = attend) for a causal convention, for torch SDPA."""
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Skv)[None, :]
    return j <= i + (Skv - Sq if convention == "bottom_right" else 0)


def sdpa(q, k, v, layout="BHSD", **kw):
    if layout == "BSHD":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    return out.transpose(1, 2) if layout == "BSHD" else out


# Agreement with torch: attnkit is held to the float64 reference at the table's tolerance;
# against torch the allowance is wider because torch's CPU kernel rounds the softmax
# probabilities to the 16-bit dtype before P @ V (attnkit does the same for bfloat16 on
# avx512bf16, never for float16): an absolute error of up to ~eps(dtype) * max|v| per output
# on each side (observed 0.016 for bf16 with |v| <= 4.5). So: rtol twice the table's, atol
# 2 * eps(dtype) * max|v| (eps = 2^-8 bf16, 2^-10 fp16), which also covers the elementwise
# bf16 term of tolerance(); float32 gets twice the table's tolerance.
def torch_tol(dtype, v=None):
    atol, rtol = tolerance(dtype, "out", 2.0, magnitude=0.0)
    if dtype != "float32" and v is not None:
        eps = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -10
        atol = max(atol, 2 * eps * float(v.abs().max()))
    return atol, rtol


SDPA_CASES = [
    # B, Hq, Hkv, Sq, Skv, D, Dv, layout, causal, mask kind
    (2, 4, 4, 64, 64, 64, 64, "BHSD", True, None),
    (1, 8, 2, 65, 65, 80, 80, "BSHD", True, None),
    (2, 4, 1, 7, 257, 128, 128, "BHSD", "bottom_right", None),
    (1, 4, 2, 257, 63, 96, 64, "BSHD", "top_left", None),
    (3, 2, 2, 33, 70, 16, 48, "BHSD", False, "bool"),
    (2, 8, 4, 63, 65, 64, 64, "BSHD", False, "float"),
    (1, 4, 2, 40, 100, 32, 32, "BHSD", "bottom_right", "float"),
    (1, 2, 1, 1, 257, 256, 256, "BHSD", False, None),
    (2, 6, 3, 65, 64, 192, 192, "BSHD", True, "bool"),
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=[str(i) for i in range(len(SDPA_CASES))])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_matches_torch_sdpa(rng, dtype, case):
    B, Hq, Hkv, Sq, Skv, D, Dv, layout, causal, mask_kind = case
    q, k, v = tq(rng, B, Hq, Hkv, Sq, Skv, D, Dv, dtype, layout)
    mask = None
    if mask_kind == "bool":
        mask = torch.from_numpy(make_mask(rng, "bool", (B, 1, Sq, Skv), p_attend=0.8))
        mask[..., 0] = True  # no empty rows: torch gives NaN there, attnkit 0
    elif mask_kind == "float":
        mask = to_torch(make_mask(rng, "float", (Hq, Sq, Skv), dtype, neg_inf_frac=0.0))
    # torch: is_causal only where the conventions coincide (Sq == Skv), else an explicit mask
    t_mask, is_causal = mask, False
    if causal is not False:
        if Sq == Skv and mask is None:
            is_causal = True
        else:
            cm = causal_mask(Sq, Skv, "top_left" if causal is True else causal)
            if mask is None:
                t_mask = cm
            elif mask.dtype == torch.bool:
                t_mask = mask & cm
            else:
                t_mask = mask.masked_fill(~cm, float("-inf"))
    scale = 0.25 if D == 80 else None
    want = sdpa(q, k, v, layout, attn_mask=t_mask, is_causal=is_causal, scale=scale,
                enable_gqa=Hq != Hkv)
    got = attnkit.attention(q, k, v, attn_mask=mask, causal=causal, scale=scale,
                            enable_gqa=Hq != Hkv, layout=layout)
    assert isinstance(got, torch.Tensor) and got.dtype == q.dtype and got.shape == want.shape
    assert_close(got, want.double().numpy(), *torch_tol(dtype, v), "attnkit vs torch SDPA")
    # and torch itself agrees with the float64 reference (sanity of the comparison)
    args = (mask, causal, scale, Hq != Hkv, layout)
    ref = attention_ref(q, k, v, *args)[0]
    assert_close(got, ref, *tolerance(dtype, magnitude=pv_magnitude(q, k, v, *args)), "attnkit vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_dtype_and_kind_preserved(rng, dtype):
    q, k, v = tq(rng, 2, 4, 2, 9, 13, 16, 24, dtype, "BSHD")
    before = snapshot(q, k, v)
    out, lse = attnkit.attention(q, k, v, enable_gqa=True, layout="BSHD", return_lse=True)
    assert type(out) is torch.Tensor and out.dtype == q.dtype and out.device.type == "cpu"
    assert tuple(out.shape) == (2, 9, 4, 24) and out.is_contiguous()
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (2, 4, 9)
    assert not out.requires_grad
    assert_unmodified(before, (q, k, v))
    ref_out, ref_lse = attention_ref(q, k, v, enable_gqa=True, layout="BSHD")
    magnitude = pv_magnitude(q, k, v, enable_gqa=True, layout="BSHD")
    assert_close(out, ref_out, *tolerance(dtype, magnitude=magnitude))
    assert_close(lse, ref_lse, *tolerance(dtype, "lse"), "lse")


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_out_written(rng, dtype, return_lse):
    q, k, v = tq(rng, 2, 4, 2, 20, 30, 16, 24, dtype)
    mask = torch.from_numpy(make_mask(rng, "bool", (2, 1, 1, 30)))
    out = torch.full((2, 4, 20, 24), float("nan"), dtype=q.dtype)
    res = attnkit.attention(q, k, v, attn_mask=mask, enable_gqa=True, out=out,
                            return_lse=return_lse)
    got = res[0] if return_lse else res
    assert got is out
    ref_out, ref_lse = attention_ref(q, k, v, mask, enable_gqa=True)
    assert_close(out, ref_out, *tolerance(dtype, magnitude=pv_magnitude(q, k, v, mask, enable_gqa=True)))
    if return_lse:
        assert_close(res[1], ref_lse, *tolerance(dtype, "lse"), "lse")


def test_torch_out_noncontiguous(rng):
    q, k, v = tq(rng, 2, 4, 4, 20, 30, 16, 24, layout="BHSD")
    base = torch.full((2, 20, 4, 24), float("nan"))
    out = base.transpose(1, 2)  # BHSD view of a BSHD buffer
    assert attnkit.attention(q, k, v, out=out, causal=True) is out
    assert_close(out, attention_ref(q, k, v, causal=True)[0], *tolerance("float32"))
    big = torch.full((3, 5, 21, 50), float("nan"))
    out2 = big[:2, :4, 1:21, 1:49:2]
    assert tuple(out2.shape) == (2, 4, 20, 24)
    assert attnkit.attention(q, k, v, out=out2) is out2
    assert_close(out2, attention_ref(q, k, v)[0], *tolerance("float32"))
    untouched = torch.ones_like(big, dtype=torch.bool)
    untouched[:2, :4, 1:21, 1:49:2] = False
    assert torch.isnan(big[untouched]).all(), "torch out= written outside its view"


@pytest.mark.parametrize("seed", [0, 12345, 2**63 - 1, 2**63, 2**63 + 12345, 2**64 - 1])
def test_seed_same_for_numpy_and_torch(rng, seed):
    """Seeds travel to the torch op as int64 (two's complement): the full uint64 range must
    give the numpy path's keep decisions bit for bit."""
    qn, kn, vn = make_qkv(rng, 1, 2, 2, 20, 40, 16, 16)
    a = attnkit.attention(qn, kn, vn, dropout_p=0.3, seed=seed)
    b = attnkit.attention(*(to_torch(x) for x in (qn, kn, vn)), dropout_p=0.3, seed=seed)
    assert_bits_equal(b, a, f"torch vs numpy, seed {seed}")
    out = torch.full((1, 2, 20, 16), float("nan"))
    attnkit.attention(*(to_torch(x) for x in (qn, kn, vn)), dropout_p=0.3, seed=seed, out=out)
    assert_bits_equal(out, a, f"torch out= vs numpy, seed {seed}")


def test_negation_bit(rng):
    """A tensor with torch's lazy negation bit (memory holds -x): the eager call takes the
    dispatcher, which materialises it; a direct kernel call refuses it rather than read -x."""
    z = torch.randn(1, 2, 5, 8, dtype=torch.complex64)
    neg = z.conj().imag
    assert neg.is_neg()
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8)
    want = torch.nn.functional.scaled_dot_product_attention(neg, k[..., :5, :], neg)
    torch.testing.assert_close(attnkit.attention(neg, k[..., :5, :], neg), want)
    out, lse = attnkit.attention(q, k, k, return_lse=True)
    with pytest.raises(ValueError, match="dout has torch's lazy negation bit set"):
        attnkit.attention_backward(q, k, k, out, lse, torch.complex(out, out).conj().imag)


def test_numpy_uint64_seed_with_grad(rng):
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    seed = np.uint64(2**64 - 1)
    want = attnkit.attention(q, k, v, dropout_p=0.5, seed=seed)
    got = attnkit.attention(q.clone().requires_grad_(), k, v, dropout_p=0.5, seed=seed)
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)


def test_nested_tensor_message():
    nested = torch.nested.nested_tensor([torch.randn(2, 3, 8)])
    with pytest.raises(ValueError, match="q must be a dense \\(strided\\) tensor, got a nested tensor"):
        attnkit.attention(nested, torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))


# ---------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------

def test_torch_compile_fullgraph(rng):
    torch._dynamo.reset()
    q, k, v = tq(rng, 1, 4, 2, 17, 33, 16, 8)
    mask = torch.from_numpy(make_mask(rng, "bool", (17, 33)))

    def f(q, k, v, mask):
        out, lse = attnkit.attention(q * 2, k, v, attn_mask=mask, causal="bottom_right",
                                     scale=0.3, enable_gqa=True, return_lse=True)
        return out + 1, lse

    cf = torch.compile(f, fullgraph=True)
    got, got_lse = cf(q, k, v, mask)
    want, want_lse = f(q, k, v, mask)
    assert_close(got, want.double().numpy(), *tolerance("float32"), "compiled vs eager")
    assert_close(got_lse, want_lse.double().numpy(), *tolerance("float32", "lse"), "lse")
    ref_out, ref_lse = attention_ref(q * 2, k, v, mask, "bottom_right", 0.3, True)
    assert_close(got, ref_out + 1, *tolerance("float32"), "compiled vs reference")
    # a second call with new values reuses the graph and is still right
    q2, k2, v2 = tq(rng, 1, 4, 2, 17, 33, 16, 8)
    assert_close(cf(q2, k2, v2, mask)[0], f(q2, k2, v2, mask)[0].double().numpy(),
                 *tolerance("float32"), "compiled, second call")


def test_first_compiled_call_does_not_recompile():
    """A fresh process whose first attnkit call is compiled: the call loads attnkit's torch
    ops, which once changed a global the trace had guarded on (one recompile per process)."""
    script = textwrap.dedent("""
        import torch, torch._dynamo
        import attnkit
        torch._dynamo.config.error_on_recompile = True
        cf = torch.compile(lambda q: attnkit.attention(q, q, q, causal=True) * 2, fullgraph=True)
        q = torch.randn(1, 2, 16, 32)
        for _ in range(3):
            cf(q)
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_compiled_graph_holds_the_registered_op(rng):
    """Eager calls skip the dispatcher (call overhead); compiled ones must still be one
    traced attnkit op, not a graph break into the eager path."""
    torch._dynamo.reset()
    q, k, v = tq(rng, 1, 2, 2, 9, 12, 16, 16)
    graphs = []

    def backend(gm, inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    cf = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, causal=True), backend=backend,
                       fullgraph=True)
    got = cf(q, k, v)
    assert len(graphs) == 1 and "attnkit.attention" in graphs[0], graphs
    assert_bits_equal(got, attnkit.attention(q, k, v, causal=True))


def test_eager_call_skips_the_dispatcher(rng, monkeypatch):
    """The call-overhead fix: an eager call on plain tensors never enters the registered op
    (whose Python kernel goes through run_attention); tensor subclasses still do."""
    import attnkit._torch_ops as tops

    entered = []
    real = tops.run_attention
    monkeypatch.setattr(tops, "run_attention", lambda *a: entered.append(1) or real(*a))
    q, k, v = tq(rng, 1, 2, 2, 5, 7, 8, 8)
    attnkit.attention(q, k, v)
    attnkit.attention(q, k, v, out=torch.empty(1, 2, 5, 8), return_lse=True)
    assert entered == []
    attnkit.attention(torch.nn.Parameter(q, requires_grad=False), k, v)
    assert entered == [1]


def test_eager_path_equals_the_registered_op(rng):
    """The direct eager call, the registered op through the dispatcher, and a call under a
    dispatch mode (which must take the dispatcher, so that the mode sees the op) agree bitwise."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = tq(rng, 2, 4, 2, 33, 70, 16, 24)
    mask = torch.from_numpy(make_mask(rng, "float", (2, 1, 33, 70)))
    eager = attnkit.attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.2)
    op, _ = torch.ops.attnkit.attention(q, k, v, mask, 0, 0.2, 0.0, None, True, "BHSD")
    with Record() as rec:
        moded = attnkit.attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.2)
    assert any("attnkit.attention" in o for o in rec.ops), rec.ops
    assert_bits_equal(eager, op)
    assert_bits_equal(eager, moded)
    out = torch.full((2, 4, 33, 24), float("nan"))
    res, lse = attnkit.attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.2, out=out,
                                 return_lse=True)
    assert res is out
    assert_bits_equal(out, eager)
    assert_bits_equal(lse, torch.ops.attnkit.attention(q, k, v, mask, 0, 0.2, 0.0, None, True, "BHSD")[1])


def test_torch_compile_out_and_dropout(rng):
    """out= (the mutating op) and a fixed-seed dropout trace with fullgraph=True too."""
    torch._dynamo.reset()
    q, k, v = tq(rng, 1, 2, 2, 9, 12, 8, 8, "bfloat16")

    def g(q, k, v, out):
        attnkit.attention(q, k, v, out=out, dropout_p=0.25, seed=2**63 + 7)
        return out * 1

    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    o1 = torch.full((1, 2, 9, 8), float("nan"), dtype=torch.bfloat16)
    o2 = torch.full((1, 2, 9, 8), float("nan"), dtype=torch.bfloat16)
    r1 = cg(q, k, v, o1)
    r2 = g(q, k, v, o2)
    assert_bits_equal(r1, r2, "compiled out= vs eager")
    assert_bits_equal(o1, o2, "compiled out buffer vs eager")


# ---------------------------------------------------------------------------------------
# torch.library.opcheck
# ---------------------------------------------------------------------------------------

def _op_args(rng, dtype, layout, mask_kind, causal, scale, dropout_p, seed, gqa):
    Hq, Hkv = (4, 2) if gqa else (2, 2)
    q, k, v = tq(rng, 2, Hq, Hkv, 9, 13, 16, 8, dtype, layout)
    mask = None
    if mask_kind == "bool":
        mask = torch.from_numpy(make_mask(rng, "bool", (9, 13)))
    elif mask_kind == "float":
        mask = to_torch(make_mask(rng, "float", (2, 1, 9, 13), dtype))
    return (q, k, v, mask, causal, scale, dropout_p, seed, gqa, layout)


OPCHECK_CASES = [
    # dtype, layout, mask, causal code, scale, dropout_p, seed, gqa
    ("float32", "BHSD", None, 0, None, 0.0, None, False),
    ("float32", "BSHD", "bool", 1, 0.5, 0.0, None, True),
    ("bfloat16", "BHSD", "float", 2, None, 0.0, None, True),
    ("float16", "BSHD", None, 2, 0.125, 0.0, None, False),
    ("float32", "BHSD", "float", 0, None, 0.3, 42, True),
    ("float32", "BHSD", None, 1, None, 0.5, -5, False),  # int64 view of a seed >= 2**63
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=[str(i) for i in range(len(OPCHECK_CASES))])
def test_opcheck_attention(rng, case):
    args = _op_args(rng, *case)
    torch.library.opcheck(torch.ops.attnkit.attention.default, args)
    out, lse = torch.ops.attnkit.attention.default(*args)
    q, k, v, mask, causal, scale, dropout_p, seed, gqa, layout = args
    if dropout_p == 0.0:
        conv = {0: False, 1: True, 2: "bottom_right"}[causal]
        ref_out, ref_lse = attention_ref(q, k, v, mask, conv, scale, gqa, layout)
        magnitude = pv_magnitude(q, k, v, mask, conv, scale, gqa, layout)
        assert_close(out, ref_out, *tolerance(case[0], magnitude=magnitude))
        assert_close(lse, ref_lse, *tolerance(case[0], "lse"), "lse")


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=[str(i) for i in range(len(OPCHECK_CASES))])
def test_opcheck_attention_out(rng, case, with_lse):
    args = _op_args(rng, *case)
    q, k, v, mask, causal, scale, dropout_p, seed, gqa, layout = args
    out_shape = (2, q.shape[1], 9, 8) if layout == "BHSD" else (2, 9, q.shape[2], 8)
    Hq = q.shape[1] if layout == "BHSD" else q.shape[2]
    out = torch.full(out_shape, float("nan"), dtype=q.dtype)
    lse = torch.full((2, Hq, 9), float("nan")) if with_lse else None
    torch.library.opcheck(torch.ops.attnkit.attention_out.default, args + (out, lse))
    out.fill_(float("nan"))
    if lse is not None:
        lse.fill_(float("nan"))
    assert torch.ops.attnkit.attention_out.default(*args, out, lse) is None
    want_out, want_lse = torch.ops.attnkit.attention.default(*args)
    if seed is not None or dropout_p == 0.0:
        assert_bits_equal(out, want_out, "attention_out vs attention")
        if lse is not None:
            assert_bits_equal(lse, want_lse, "attention_out lse vs attention")


def test_torch_inputs_strided(rng):
    qn, kn, vn = make_qkv(rng, 2, 4, 2, 30, 45, 32, 16, "bfloat16", "BSHD")
    q, k, v = (to_torch(strided_like(x, rng)[0]) for x in (qn, kn, vn))
    assert not q.is_contiguous()
    out = attnkit.attention(q, k, v, enable_gqa=True, layout="BSHD", causal="bottom_right")
    want = sdpa(q, k, v, "BSHD", attn_mask=causal_mask(30, 45, "bottom_right"), enable_gqa=True)
    assert_close(out, want.double().numpy(), *torch_tol("bfloat16", v), "strided vs SDPA")
