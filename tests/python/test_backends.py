"""attnkit.backends: SGLang-shaped attention backends (SDPA, SageAttention int8,
SageAttention3 FP4 with its exact-SDPA GQA/MQA fallback), their validation and selection."""

import logging
import math
import re

import numpy as np
import pytest

import attnkit
from attnkit import backends
from attnkit.backends import (AttentionConfig, SageAttention3Backend, SageAttention3Impl,
                              SageAttentionBackend, SDPABackend)
from conftest import assert_bits_equal, assert_unmodified, np_dtype, randn, snapshot, to_torch
from reference import to_f64

torch = pytest.importorskip("torch")

DTYPES = ["float32", "float16", "bfloat16"]
SEED_MSG = "GQA/MQA requires query heads to be a multiple of KV heads, got q_heads=12 and kv_heads=8"

SAGE_OK, SAGE_WHY = backends.sage_kernel_status("int8")
needs_sage = pytest.mark.skipif(
    not SAGE_OK, reason=f"attnkit.sage_attention (int8) is not available yet: {SAGE_WHY}")
FP4_OK, FP4_WHY = backends.fp4_kernel_status()


@pytest.fixture
def fresh_warn_flag():
    """Resets SageAttention3's once-per-process GQA fallback warning."""
    SageAttention3Impl._warned_gqa_fallback_global = False
    yield
    SageAttention3Impl._warned_gqa_fallback_global = False


def qkv(rng, B, S, Hq, Hkv, D, dtype="float32", kind="numpy", Skv=None):
    """[batch, seq, heads, head_dim] inputs."""
    Skv = S if Skv is None else Skv
    arrays = (randn(rng, (B, S, Hq, D), dtype), randn(rng, (B, Skv, Hkv, D), dtype),
              randn(rng, (B, Skv, Hkv, D), dtype))
    return tuple(to_torch(a) for a in arrays) if kind == "torch" else arrays


def ref_bshd(q, k, v, causal=False, scale=None):
    """Float64 attention on BSHD inputs with GQA, top-left causal and a softmax scale."""
    q, k, v = (to_f64(x).transpose(0, 2, 1, 3) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if causal:
        Sq, Skv = s.shape[-2:]
        s = np.where(np.arange(Skv)[None, :] <= np.arange(Sq)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3)


def cosine(a, b):
    a, b = to_f64(a).ravel(), to_f64(b).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def config(**kw):
    base = dict(head_size=64, num_heads=8, num_kv_heads=8, dtype="bfloat16", causal=False,
                dropout_p=0.0)
    base.update(kw)
    return AttentionConfig(**base)


# ----------------------------------------------------------------------------- validation

def test_capabilities_and_head_sizes():
    assert SDPABackend.get_supported_head_sizes() is None
    assert SageAttentionBackend.get_supported_head_sizes() is None
    assert SageAttention3Backend.get_supported_head_sizes() == [64, 128, 256]
    assert SDPABackend.capabilities.dropout and not SageAttentionBackend.capabilities.dropout
    for b in (SDPABackend, SageAttentionBackend, SageAttention3Backend):
        caps = b.get_capabilities()
        assert set(caps.dtypes) == {"float32", "float16", "bfloat16"}
        assert caps.gqa and True in caps.causal and caps.deterministic
        assert b.get_impl_cls().backend is b


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", "torch.bfloat16", "float16", np.float16,
                                   np.dtype("float32"), "float32"])
def test_dtype_forms_accepted(dtype):
    assert SDPABackend.validate(config(dtype=dtype)) == []
    assert SDPABackend.validate(config(dtype=torch.bfloat16)) == []
    assert SDPABackend.validate(config(dtype=np_dtype("bfloat16"))) == []


def test_sdpa_reasons_all_listed():
    reasons = SDPABackend.validate(config(head_size=600, num_heads=12, num_kv_heads=8,
                                          dtype="int8", causal="diagonal", dropout_p=1.0))
    assert len(reasons) == 5, reasons
    assert any("head_size=600" in r and "1..512" in r for r in reasons)
    assert SEED_MSG in reasons
    assert any("dtype int8" in r for r in reasons)
    assert any("causal='diagonal'" in r for r in reasons)
    assert any("dropout_p must be a float in [0, 1)" in r for r in reasons)
    assert SDPABackend.validate(config(num_heads=8, num_kv_heads=2, dropout_p=0.3,
                                       causal="bottom_right")) == []
    bad = SDPABackend.validate(config(num_heads=0, num_kv_heads=None, head_size=64.0))
    assert any("num_heads must be a positive int" in r for r in bad)
    assert any("head_size must be an int" in r for r in bad)


def test_sage_refuses_dropout_and_lists_every_reason():
    reasons = SageAttentionBackend.validate(config(dropout_p=0.1))
    assert any("dropout_p=0.1" in r and "no dropout" in r for r in reasons), reasons
    reasons = SageAttentionBackend.validate(config(head_size=1024, dtype="float64", dropout_p=0.1,
                                                   num_heads=12, num_kv_heads=8))
    for needle in ("head_size=1024", "dtype float64", "no dropout", SEED_MSG):
        assert any(needle in r for r in reasons), (needle, reasons)
    assert (SageAttentionBackend.validate(config()) == []) == SAGE_OK
    if not SAGE_OK:
        assert any("int8 SageAttention kernel is not available" in r
                   for r in SageAttentionBackend.validate(config()))


def test_sage_available_once_built():
    """Once the extension has the kernel, the backend must not refuse it (a broken op must
    fail here rather than skip the SageAttention tests)."""
    if getattr(attnkit, "sage_attention", None) is None or not hasattr(attnkit._C, "sage_attention"):
        pytest.skip("attnkit.sage_attention is not built yet")
    assert SAGE_OK, SAGE_WHY


def test_sage3_reasons():
    # GQA/MQA is served by the exact fallback, dropout included.
    assert SageAttention3Backend.validate(config(num_heads=8, num_kv_heads=2, dropout_p=0.2)) == []
    assert SageAttention3Backend.validate(config(num_heads=8, num_kv_heads=1, head_size=256)) == []
    assert SageAttention3Backend.validate(config(num_heads=12, num_kv_heads=8)) == [SEED_MSG]
    reasons = SageAttention3Backend.validate(config(head_size=96, num_heads=12, num_kv_heads=8,
                                                    dtype="int8"))
    assert len(reasons) == 3
    assert any("head_size=96" in r and "64, 128, 256" in r for r in reasons)
    assert SEED_MSG in reasons
    mha = SageAttention3Backend.validate(config(dropout_p=0.1))
    assert any("MHA" in r and "no dropout" in r for r in mha), mha
    assert any("fp4 kernel, which is not built" in r for r in mha) == (not FP4_OK)


def test_sage3_mha_reason_follows_fp4_capability(monkeypatch):
    monkeypatch.setattr(backends.sage_attn3, "fp4_kernel_status", lambda refresh=False: (True, None))
    assert SageAttention3Backend.validate(config()) == []
    monkeypatch.setattr(backends.sage_attn3, "fp4_kernel_status",
                        lambda refresh=False: (False, 'mode "fp4" is not built yet'))
    reasons = SageAttention3Backend.validate(config())
    assert len(reasons) == 1 and "not built" in reasons[0] and "MHA" in reasons[0]


def test_fp4_probe_today():
    if FP4_OK:
        pytest.skip("the fp4 kernel is built")
    assert not backends.fp4_kernel_available()
    if getattr(attnkit, "sage_attention", None) is not None and SAGE_OK:
        assert "not built" in FP4_WHY


# ----------------------------------------------------------------------------- selection

def test_explicit_refused_choice_raises_with_all_reasons():
    with pytest.raises(ValueError) as e:
        backends.select("sage_attn", head_size=64, num_heads=12, num_kv_heads=8, dtype="bfloat16",
                        causal=False, dropout_p=0.1)
    msg = str(e.value)
    assert "SageAttentionBackend" in msg and "no dropout" in msg and SEED_MSG in msg
    with pytest.raises(ValueError) as e:
        backends.select("SageAttention3Backend", head_size=96, num_heads=8, num_kv_heads=8,
                        dtype="float16", causal=True, dropout_p=0.1)
    msg = str(e.value)
    assert "head_size=96" in msg and "no dropout" in msg
    if not FP4_OK:
        assert "not built" in msg
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        backends.select("flash", head_size=64, num_heads=8, num_kv_heads=8, dtype="float16",
                        causal=False)


@pytest.mark.parametrize("name", ["sdpa", "SDPABackend", SDPABackend])
def test_explicit_choice(name, caplog):
    caplog.set_level(logging.INFO, logger="attnkit")
    b = backends.select(name, head_size=64, num_heads=8, num_kv_heads=2, dtype="bfloat16",
                        causal=True, dropout_p=0.1)
    assert b is SDPABackend
    assert backends.select("sage_attn3", head_size=128, num_heads=8, num_kv_heads=2,
                           dtype="bfloat16", causal=True, dropout_p=0.1) is SageAttention3Backend


def test_automatic_choice_logs_reasons(caplog):
    caplog.set_level(logging.INFO, logger="attnkit")
    b = backends.select(head_size=64, num_heads=8, num_kv_heads=2, dtype="float16", causal=True,
                        dropout_p=0.1, allow_lossy=True)
    assert b is SDPABackend
    recs = [r for r in caplog.records if r.name == "attnkit" and r.levelno == logging.INFO]
    assert len(recs) == 1
    msg = recs[0].getMessage()
    assert "chose SDPABackend" in msg
    assert "SageAttentionBackend refused" in msg and "no dropout" in msg

    caplog.clear()
    b = backends.select(head_size=64, num_heads=8, num_kv_heads=8, dtype="bfloat16", causal=False,
                        allow_lossy=True)
    msg = caplog.records[-1].getMessage()
    if SAGE_OK:
        assert b is SageAttentionBackend and "chose SageAttentionBackend" in msg
    else:
        assert b is SDPABackend and "SageAttentionBackend refused" in msg
        assert "not available" in msg


def test_automatic_choice_is_exact_by_default(caplog):
    """Without allow_lossy=True, select() never picks a quantized backend on its own, and
    its log says why each was skipped."""
    caplog.set_level(logging.INFO, logger="attnkit")
    for dtype in ("bfloat16", "float16", "float32"):
        for heads, kv in ((8, 8), (8, 2)):
            b = backends.select(head_size=128, num_heads=heads, num_kv_heads=kv, dtype=dtype,
                                causal=False)
            assert b is SDPABackend and not b.capabilities.lossy
    msg = caplog.records[-1].getMessage()
    assert "SageAttentionBackend refused: [lossy (quantized): pass allow_lossy=True" in msg
    with pytest.raises(ValueError, match="allow_lossy must be True or False, got 'yes'"):
        backends.select(head_size=64, num_heads=8, num_kv_heads=8, dtype="bfloat16", causal=False,
                        allow_lossy="yes")
    assert [b.capabilities.lossy for b in backends.BACKENDS] == [True, False, True]


def test_impl_refuses_a_dtype_it_was_not_built_for():
    b = backends.select(head_size=16, num_heads=2, num_kv_heads=2, dtype="bfloat16", causal=False)
    impl = b.get_impl_cls()(num_heads=2, head_size=16, causal=False, softmax_scale=None,
                            dtype="bfloat16")
    x = np.ones((1, 3, 2, 16), np.float32)
    with pytest.raises(ValueError, match="was built for dtype bfloat16, the tensors are float32"):
        impl.forward(x, x, x)
    free = b.get_impl_cls()(num_heads=2, head_size=16, causal=False, softmax_scale=None)
    assert free.forward(x, x, x).dtype == np.float32  # no dtype given: any the backend serves


@pytest.mark.parametrize("allow_lossy", [False, True])
def test_automatic_choice_none_validates(allow_lossy):
    with pytest.raises(ValueError) as e:
        backends.select(head_size=1000, num_heads=12, num_kv_heads=8, dtype="float16",
                        causal=False, allow_lossy=allow_lossy)
    msg = str(e.value)
    for name in ("SageAttentionBackend", "SDPABackend", "SageAttention3Backend"):
        assert name in msg
    assert msg.count(SEED_MSG) == (3 if allow_lossy else 1)


# ----------------------------------------------------------------------------- impls

def test_window_that_is_not_a_pair_is_a_reason():
    reasons = SDPABackend.validate(head_size=64, num_heads=8, window=5)
    assert any("window must be None or a pair" in r for r in reasons), reasons
    with pytest.raises(ValueError, match="window must be None or a pair"):
        SDPABackend.get_impl_cls()(8, 64, False, None, window=5)


def test_impl_constructors_validate():
    with pytest.raises(ValueError, match="no dropout"):
        SageAttentionBackend.get_impl_cls()(num_heads=8, head_size=64, causal=False,
                                            softmax_scale=None, dropout_p=0.1)
    with pytest.raises(ValueError, match=re.escape(SEED_MSG)):
        SageAttention3Impl(num_heads=12, head_size=64, causal=False, softmax_scale=None,
                           num_kv_heads=8)
    with pytest.raises(ValueError, match="head_size=80"):
        SageAttention3Impl(num_heads=8, head_size=80, causal=False, softmax_scale=None,
                           num_kv_heads=2)
    with pytest.raises(ValueError, match="dtype int8"):
        SDPABackend.get_impl_cls()(8, 64, False, None, dtype="int8")
    with pytest.raises(ValueError, match="softmax_scale"):
        SDPABackend.get_impl_cls()(8, 64, False, "0.1")
    if not FP4_OK:
        with pytest.raises(ValueError, match="not built"):
            SageAttention3Impl(num_heads=8, head_size=64, causal=False, softmax_scale=None)


@pytest.mark.parametrize("backend", [SDPABackend, SageAttentionBackend, SageAttention3Backend])
def test_exact_gqa_error_from_forward(backend, rng):
    if backend is SageAttentionBackend and not SAGE_OK:
        pytest.skip(f"attnkit.sage_attention (int8) is not available yet: {SAGE_WHY}")
    impl = backend.get_impl_cls()(num_heads=12, head_size=64, causal=False, softmax_scale=None,
                                  num_kv_heads=4)
    q, k, v = qkv(rng, 1, 4, 12, 8, 64)
    with pytest.raises(ValueError) as e:
        impl.forward(q, k, v)
    assert str(e.value) == SEED_MSG
    q, k, v = qkv(rng, 1, 4, 8, 4, 64)  # divisible, but not the configured heads
    with pytest.raises(ValueError, match="built for num_heads=12"):
        impl.forward(q, k, v)


def test_sage3_fallback_warns_once(fresh_warn_flag, rng, caplog):
    caplog.set_level(logging.INFO, logger="attnkit")
    impls = [SageAttention3Backend.get_impl_cls()(num_heads=8, head_size=64, causal=True,
                                                  softmax_scale=None, num_kv_heads=2)
             for _ in range(3)]
    q, k, v = qkv(rng, 1, 5, 8, 2, 64)
    for impl in impls:
        for _ in range(3):
            impl.forward(q, k, v)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [backends.GQA_FALLBACK_WARNING]
    assert warnings[0].name == "attnkit"
    assert backends.GQA_FALLBACK_WARNING == ("SageAttention3 does not support GQA/MQA (Hq != Hkv); "
                                             "falling back to exact SDPA.")


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,scale,dropout_p,Hkv", [
    (False, None, 0.0, 2), (True, 0.05, 0.0, 1), (True, None, 0.3, 2), (False, 0.2, 0.5, 4)])
def test_sage3_fallback_bitwise_equals_sdpa(fresh_warn_flag, rng, kind, dtype, causal, scale,
                                            dropout_p, Hkv):
    args = dict(num_heads=8, head_size=64, causal=causal, softmax_scale=scale, num_kv_heads=Hkv,
                dropout_p=dropout_p, seed=1234)
    sdpa = SDPABackend.get_impl_cls()(**args)
    sage3 = SageAttention3Backend.get_impl_cls()(**args)
    q, k, v = qkv(rng, 2, 7, 8, Hkv, 64, dtype, kind, Skv=9)
    before = snapshot(q, k, v)
    a, b = sdpa.forward(q, k, v), sage3.forward(q, k, v, attn_metadata=None)
    assert type(a) is type(b) is type(q)
    assert tuple(b.shape) == (2, 7, 8, 64)
    assert_bits_equal(a, b)
    assert_bits_equal(b, attnkit.attention(q, k, v, causal=causal, scale=scale, dropout_p=dropout_p,
                                           seed=1234, enable_gqa=True, layout="BSHD"))
    assert_unmodified(before, (q, k, v))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("Hkv", [8, 2])
def test_sdpa_honours_scale_causal(rng, kind, Hkv):
    q, k, v = qkv(rng, 2, 6, 8, Hkv, 32, "float32", kind, Skv=6)
    for causal in (False, True):
        for scale in (None, 0.07, 0.5):
            impl = SDPABackend.get_impl_cls()(num_heads=8, head_size=32, causal=causal,
                                              softmax_scale=scale, num_kv_heads=Hkv)
            out = impl.forward(q, k, v)
            np.testing.assert_allclose(to_f64(out), ref_bshd(q, k, v, causal, scale),
                                       atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_sdpa_honours_dropout(rng, kind):
    q, k, v = qkv(rng, 1, 16, 4, 4, 32, "float32", kind)
    seeded = SDPABackend.get_impl_cls()(num_heads=4, head_size=32, causal=False,
                                        softmax_scale=None, dropout_p=0.4, seed=7)
    out = seeded.forward(q, k, v)
    assert_bits_equal(out, seeded.forward(q, k, v))
    assert_bits_equal(out, attnkit.attention(q, k, v, dropout_p=0.4, seed=7, layout="BSHD"))
    exact = SDPABackend.get_impl_cls()(4, 32, False, None).forward(q, k, v)
    assert not np.allclose(to_f64(out), to_f64(exact))
    other = SDPABackend.get_impl_cls()(4, 32, False, None, dropout_p=0.4, seed=8).forward(q, k, v)
    assert not np.array_equal(to_f64(out), to_f64(other))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_unmodified_every_backend(fresh_warn_flag, rng, kind, dtype):
    cases = [(SDPABackend, 8, 0.2), (SDPABackend, 2, 0.0), (SageAttention3Backend, 2, 0.2)]
    if SAGE_OK:
        cases += [(SageAttentionBackend, 8, 0.0), (SageAttentionBackend, 2, 0.0)]
    if FP4_OK:
        cases += [(SageAttention3Backend, 8, 0.0)]
    for backend, Hkv, p in cases:
        # K with a large per-head mean: a backend smoothing K in place would show it.
        q, k, v = qkv(rng, 1, 130, 8, Hkv, 64, dtype, kind)
        k = k + (3 if kind == "numpy" else torch.tensor(3, dtype=k.dtype))
        if kind == "numpy":
            k = k.astype(np_dtype(dtype))
        before = snapshot(q, k, v)
        impl = backend.get_impl_cls()(num_heads=8, head_size=64, causal=True, softmax_scale=None,
                                      num_kv_heads=Hkv, dropout_p=p, seed=3)
        impl.forward(q, k, v)
        assert_unmodified(before, (q, k, v))


def test_sglang_style_usage(fresh_warn_flag, rng):
    q, k, v = qkv(rng, 1, 10, 8, 2, 128, "bfloat16", "torch")
    for name in ("sdpa", "sage_attn", "sage_attn3"):
        if name == "sage_attn" and not SAGE_OK:
            continue
        backend = backends.select(name, head_size=128, num_heads=8, num_kv_heads=2,
                                  dtype=q.dtype, causal=False)
        impl = backend.get_impl_cls()(num_heads=8, head_size=128, causal=False,
                                      softmax_scale=1 / math.sqrt(128), num_kv_heads=2,
                                      dropout_p=0.0, prefix="blocks.0.attn")
        out = impl.forward(q, k, v, None)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert tuple(out.shape) == (1, 10, 8, 128)
        assert cosine(out, ref_bshd(q, k, v)) >= 0.999


# ----------------------------------------------------------------------------- SageAttention int8

@needs_sage
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hkv,D,S", [(4, 64, 150), (1, 128, 40), (4, 72, 129)])
def test_sage_accuracy_contract(rng, kind, dtype, Hkv, D, S):
    q, k, v = qkv(rng, 2, S, 4, Hkv, D, dtype, kind)
    impl = SageAttentionBackend.get_impl_cls()(num_heads=4, head_size=D, causal=False,
                                               softmax_scale=None, num_kv_heads=Hkv)
    out = impl.forward(q, k, v)
    assert type(out) is type(q) and out.dtype == q.dtype and tuple(out.shape) == (2, S, 4, D)
    assert cosine(out, ref_bshd(q, k, v)) >= 0.999


@needs_sage
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_sage_honours_scale_and_causal(rng, kind):
    q, k, v = qkv(rng, 1, 96, 4, 2, 64, "float32", kind)
    for causal, scale in ((True, None), (False, 0.03), (True, 0.4)):
        impl = SageAttentionBackend.get_impl_cls()(num_heads=4, head_size=64, causal=causal,
                                                   softmax_scale=scale, num_kv_heads=2)
        out = to_f64(impl.forward(q, k, v))
        right = ref_bshd(q, k, v, causal, scale)
        wrong = ref_bshd(q, k, v, not causal, None if scale else 0.03)
        assert cosine(out, right) >= 0.999
        assert np.linalg.norm(out - right) < 0.25 * np.linalg.norm(out - wrong)
