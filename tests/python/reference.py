"""Float64 numpy reference for attnkit.attention, and the comparator the tests use.

attention_ref restates the docstring of attnkit.ops.attention as plain numpy in float64;
torch is never used here (it is only a second opinion, in test_attention_torch.py).
"""

import math

import numpy as np

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def to_f64(x):
    """A float64 (or bool) numpy copy of a numpy array / torch tensor of any attnkit dtype."""
    if x is None:
        return None
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype == torch.bool:
            return x.numpy().copy()
        return x.to(torch.float64).numpy()
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return x.copy()
    return x.astype(np.float64)


def attention_ref(q, k, v, attn_mask=None, causal=False, scale=None, enable_gqa=False,
                  layout="BHSD", dropout_keep=None, dropout_p=0.0, window=None, softcap=None,
                  alibi_slopes=None, sinks=None):
    """(out, lse) in float64 following the attnkit.attention spec.

    q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv] (or BSHD); attn_mask is bool
    (True = attend) or additive float, broadcastable to [B, Hq, Sq, Skv] (BHSD order for both
    layouts). dropout_keep, if given, is a bool array broadcastable to [B, Hq, Sq, Skv]: kept
    probabilities are scaled by 1 / (1 - dropout_p), the row normaliser is not changed. A row
    with no attendable key gives out = 0 and lse = -inf. lse has shape [B, Hq, Sq], natural log.
    Score modifiers: query i is aligned to key a = i + Skv - Sq, or a = i with top-left causal;
    window (left, right) keeps keys a - left <= j <= a + right (-1: unbounded); softcap c maps
    s -> c tanh(s / c) after the scale, before mask and ALiBi; alibi_slopes [Hq] or [B, Hq]
    adds -slope |a - j|; sinks [Hq] adds e^(sink - m) to each live row's denominator only
    (lse excludes it).
    """
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    if layout == "BSHD":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    else:
        assert layout == "BHSD", layout
    B, Hq, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
    assert k.shape == (B, Hkv, Skv, D) and v.shape == (B, Hkv, Skv, Dv)
    if Hq != Hkv:
        assert enable_gqa and Hkv > 0 and Hq % Hkv == 0, (Hq, Hkv)
    group = Hq // Hkv if Hkv else 1
    kv_head = np.arange(Hq) // group          # query head h reads kv head h // (Hq // Hkv)
    k, v = k[:, kv_head], v[:, kv_head]
    if scale is None:
        scale = 1.0 / math.sqrt(D)

    s = np.matmul(q, k.swapaxes(-1, -2)) * float(scale)          # [B, Hq, Sq, Skv]
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    full = (B, Hq, Sq, Skv)
    allowed = np.ones(full, dtype=bool)
    i = np.arange(Sq)[:, None]
    j = np.arange(Skv)[None, :]
    top_left = causal is True or causal == "top_left"
    a = i if top_left else i + (Skv - Sq)                        # aligned query positions
    if top_left or causal == "bottom_right":
        allowed &= j <= a
    else:
        assert causal is False or causal is None, causal
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= a - left
        if right >= 0:
            allowed &= j <= a + right
    if alibi_slopes is not None:
        slopes = np.broadcast_to(to_f64(alibi_slopes).reshape(-1, Hq), (B, Hq))
        s = s - slopes[:, :, None, None] * np.abs(a - j)[None, None]
    if attn_mask is not None:
        m = to_f64(attn_mask)
        if m.dtype == np.bool_:
            allowed &= np.broadcast_to(m, full)
        else:
            s = s + np.broadcast_to(m, full)
    s = np.where(allowed, s, -np.inf)

    mx = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    live = np.isfinite(mx)  # False: no attendable key in this row
    mx0 = np.where(live, mx, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(s - mx0)
    p = np.where(allowed, p, 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(live, np.log(np.where(live, denom, 1.0)) + mx0, -np.inf)[..., 0]
    if sinks is not None:  # the sink joins the denominator of live rows, not lse
        with np.errstate(over="ignore", invalid="ignore"):
            denom = denom + np.exp(to_f64(sinks)[None, :, None, None] - mx0)
    with np.errstate(invalid="ignore"):
        probs = np.where(live, p / np.where(live, denom, 1.0), 0.0)
    if dropout_keep is not None:
        probs = probs * np.broadcast_to(dropout_keep, full) / (1.0 - dropout_p)
    out = np.matmul(probs, v)                                    # [B, Hq, Sq, Dv]
    if layout == "BSHD":
        out = out.transpose(0, 2, 1, 3)
    return out, lse


def softmax_ref(q, k, attn_mask=None, causal=False, scale=None, enable_gqa=False, layout="BHSD"):
    """The attention probabilities [B, Hq, Sq, Skv] (no dropout) in float64: attention_ref
    with v = identity, read back."""
    q64, k64 = to_f64(q), to_f64(k)
    if layout == "BSHD":
        q64, k64 = q64.transpose(0, 2, 1, 3), k64.transpose(0, 2, 1, 3)
    B, Hkv, Skv, _ = k64.shape
    eye = np.broadcast_to(np.eye(Skv), (B, Hkv, Skv, Skv))
    out, _ = attention_ref(q64, k64, eye, attn_mask, causal, scale, enable_gqa, "BHSD")
    return out


# Tolerances, |got - ref| <= atol + rtol * |ref| elementwise, against the float64 reference
# computed from the *rounded* inputs (so input rounding is not part of the error).
#  - float32: scores/softmax/accumulation in float32 over D <= 256 and Skv <= ~300 give
#    errors of a few 1e-6 relative; 2e-5 leaves margin for exp approximations.
#  - float16 / bfloat16: the kernel works in float32 and rounds out to the dtype once at the
#    end, so the error is dominated by one rounding: half an ulp is 2^-11 ~ 4.9e-4 (fp16) and
#    2^-8 ~ 3.9e-3 (bf16) relative. rtol 2e-3 (fp16) and 1e-2 (bf16); atol covers values
#    near zero (including fp16 subnormals).
#  - bfloat16 P·V may round each probability to bf16 first (attnkit on avx512bf16, as
#    FlashAttention and torch): a relative error of up to 2^-8 per probability, so an output
#    may move by up to 2^-8 * sum_j p_j |v_j| / sum_j p_j on top of the above. That term is
#    elementwise (pv_magnitude) and large where the P @ V sum cancels.
#  - lse is float32 whatever the input dtype and never rounded to the input dtype, so it gets
#    the float32 tolerance for every dtype.
TOLERANCES = {
    #            out (atol, rtol)   lse (atol, rtol)
    "float32":  ((2e-5, 2e-5),      (2e-5, 2e-5)),
    "float16":  ((1e-4, 2e-3),      (2e-5, 2e-5)),
    "bfloat16": ((1e-3, 1e-2),      (2e-5, 2e-5)),
}


def dtype_key(x):
    """"float32" / "float16" / "bfloat16" for a numpy dtype, torch dtype, array or tensor."""
    dt = getattr(x, "dtype", x)
    if torch is not None and isinstance(dt, torch.dtype):
        return {torch.float32: "float32", torch.float16: "float16",
                torch.bfloat16: "bfloat16"}[dt]
    dt = np.dtype(dt)
    if ml_dtypes is not None and dt == np.dtype(ml_dtypes.bfloat16):
        return "bfloat16"
    return {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}[dt]


P_ROUNDING = 2.0 ** -8  # bf16's unit roundoff: P rounded to bf16 for P·V


def pv_magnitude(q, k, v, *args, **kwargs):
    """sum_j p_j |v_j| / sum_j p_j per output, float64: attention_ref (same arguments) on |v|.
    Zero where that is not finite (inf or NaN in V: those outputs are checked as such)."""
    m = attention_ref(q, k, np.abs(to_f64(v)), *args, **kwargs)[0]
    return np.where(np.isfinite(m), m, 0.0)


def tolerance(dtype, what="out", scale=1.0, magnitude=None):
    """(atol, rtol) for `what` ("out" or "lse") of `dtype`, times `scale`. bfloat16 out needs
    `magnitude` (pv_magnitude of the inputs): its atol is then elementwise, with the term for
    P rounded to bf16."""
    key = dtype_key(dtype)
    atol, rtol = TOLERANCES[key][0 if what == "out" else 1]
    atol, rtol = atol * scale, rtol * scale
    if key == "bfloat16" and what == "out":
        assert magnitude is not None, "bfloat16 out: pass magnitude=pv_magnitude(...)"
        atol = atol + P_ROUNDING * scale * np.asarray(magnitude)
    return atol, rtol


def assert_close(got, ref, atol, rtol, name="out"):
    """FlashMLA-style check. NaN positions must match exactly, and so must +-inf (same sign);
    the finite rest must satisfy |got - ref| <= atol + rtol * |ref|. On failure the message
    names the worst element (relative to its allowance) with its coordinates."""
    g = to_f64(got)
    r = np.asarray(ref, dtype=np.float64)
    assert g.shape == r.shape, f"{name}: shape {g.shape} != reference shape {r.shape}"
    g_nan, r_nan = np.isnan(g), np.isnan(r)
    if not np.array_equal(g_nan, r_nan):
        bad = np.argwhere(g_nan != r_nan)
        first = tuple(int(c) for c in bad[0])
        raise AssertionError(
            f"{name}: NaN positions differ at {len(bad)} of {g.size} elements; first at {first}: "
            f"got {g[first]!r}, ref {r[first]!r} (NaN in got where ref has none = not written "
            f"or computed as NaN)")
    g_inf, r_inf = np.isinf(g), np.isinf(r)
    inf_bad = (g_inf | r_inf) & ~((g == r) & g_inf)
    if inf_bad.any():
        bad = np.argwhere(inf_bad)
        first = tuple(int(c) for c in bad[0])
        raise AssertionError(
            f"{name}: inf positions differ at {len(bad)} of {g.size} elements; first at {first}: "
            f"got {g[first]!r}, ref {r[first]!r}")
    fin = np.isfinite(r)
    with np.errstate(invalid="ignore"):
        diff = np.where(fin, np.abs(g - r), 0.0)
    atol = np.asarray(atol, dtype=np.float64)
    allow = atol + rtol * np.abs(np.where(fin, r, 0.0))
    excess = diff / allow
    if excess.size and excess.max() > 1.0:
        worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
        worst = tuple(int(c) for c in worst)
        n_bad = int((excess > 1.0).sum())
        raise AssertionError(
            f"{name}: {n_bad} of {g.size} elements out of tolerance (atol={atol.max():g} at most, rtol={rtol:g}); "
            f"worst at {worst}: got {g[worst]!r}, ref {r[worst]!r}, |diff| {diff[worst]:.3g} "
            f"= {excess[worst]:.3g}x allowed; max |diff| overall {diff.max():.3g}")


def max_errors(got, ref):
    """(max abs error, max rel error) over finite reference entries, for tolerance studies."""
    g, r = to_f64(got), np.asarray(ref, dtype=np.float64)
    fin = np.isfinite(r)
    if not fin.any():
        return 0.0, 0.0
    d = np.abs(g[fin] - r[fin])
    return float(d.max()), float((d / np.maximum(np.abs(r[fin]), 1e-30)).max())
