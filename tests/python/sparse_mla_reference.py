"""Float64 numpy reference for attnkit's sparse MLA prefill ops, input makers, and the
tolerances the tests hold the kernel to.

sparse_mla_ref restates the op's contract as plain numpy in float64 (torch is never used to
compute anything here; torch tensors are only read):

  for query row s, head h: slot t of indices[s, 0, :] is valid iff 0 <= idx < s_kv and, when
  topk_length is given, t < topk_length[s]; invalid slots are never read.
  logit(t)  = (q[s, h] . kv[idx, 0]) * sm_scale * q_scale * kv_scale  (dequantised values)
  max_logits = max of the valid logits; lse = natural log-sum-exp of the valid logits (no sink)
  out = sum_t exp(logit(t) - m) * V[idx] / (sum_t exp(logit(t) - m) + exp(sink[h] - m))
  a row with no valid slot: out = 0, max_logits = -inf, lse = +inf (with or without a sink).
"""

import numpy as np

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def fp8_dtype():
    return np.dtype(ml_dtypes.float8_e4m3fn)


def bf16_dtype():
    return np.dtype(ml_dtypes.bfloat16)


def to_np(x):
    """A numpy array (bf16/fp8 as ml_dtypes) with the values of a numpy array / torch tensor /
    Python number; None stays None."""
    if x is None:
        return None
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().contiguous()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(bf16_dtype())
        if x.dtype == torch.float8_e4m3fn:
            return x.view(torch.uint8).numpy().view(fp8_dtype())
        return x.numpy()
    return np.asarray(x)


def f64(x):
    x = to_np(x)
    return None if x is None else x.astype(np.float64)


def scalar(x, default=1.0):
    """A scale given as None / Python float / 0-d or 1-element array or tensor, as float64
    (the float32 value the op sees)."""
    if x is None:
        return default
    a = to_np(x).reshape(-1)
    assert a.size == 1, a.shape
    return float(np.float32(a[0]))


def valid_slots(indices, s_kv, topk_length=None):
    """bool [s_q, topk]: which slots of indices[:, 0, :] the op reads."""
    idx = to_np(indices)[:, 0, :].astype(np.int64)
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        tl = to_np(topk_length).astype(np.int64)
        valid &= np.arange(idx.shape[1])[None, :] < tl[:, None]
    return valid


def sparse_mla_ref(q, kv, indices, sm_scale, d_v=512, q_scale=None, kv_scale=None,
                   attn_sink=None, topk_length=None):
    """(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q], pv_abs [s_q, h_q, d_v])
    in float64; pv_abs = Σ p·|V| / denominator, the scale of P's rounding (out_atol)."""
    qs, ks = scalar(q_scale), scalar(kv_scale)
    qf = f64(q) * qs                                   # [s_q, h_q, d_qk]
    kvf = f64(kv)
    s_q, h_q, d_qk = qf.shape
    s_kv = kvf.shape[0]
    assert kvf.shape == (s_kv, 1, d_qk), kvf.shape
    assert 1 <= d_v <= d_qk
    kvf = kvf[:, 0, :] * ks                           # [s_kv, d_qk]
    idx = to_np(indices)[:, 0, :].astype(np.int64)    # [s_q, topk]
    topk = idx.shape[1]
    valid = valid_slots(indices, s_kv, topk_length)
    safe = np.where(valid, idx, 0)
    if s_kv > 0:
        g = kvf[safe]                                  # [s_q, topk, d_qk]
    else:
        g = np.zeros((s_q, topk, d_qk))
    g = np.where(valid[..., None], g, 0.0)            # never read an invalid row (NaN in it)
    with np.errstate(invalid="ignore", over="ignore"):
        logits = np.matmul(qf, g.transpose(0, 2, 1)) * float(sm_scale)   # [s_q, h_q, topk]
    vmask = np.broadcast_to(valid[:, None, :], logits.shape)
    logits = np.where(vmask, logits, -np.inf)
    live = valid.any(axis=1)[:, None]                 # [s_q, 1]
    m = np.max(logits, axis=-1, initial=-np.inf) if topk else np.full((s_q, h_q), -np.inf)
    m0 = np.where(live, m, 0.0)                       # NaN logits keep m NaN (propagates)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(vmask, np.exp(logits - m0[..., None]), 0.0)
        denom = p.sum(axis=-1)
        with np.errstate(divide="ignore"):
            lse = np.where(live, np.log(np.where(live, denom, 1.0)) + m0, np.inf)
        max_logits = np.where(live, m, -np.inf)
        denom_out = denom
        if attn_sink is not None:
            sink = f64(attn_sink).reshape(h_q)
            denom_out = denom + np.exp(sink[None, :] - m0)   # +inf sink -> out 0, -inf -> none
        out = np.matmul(p, g[..., :d_v]) / np.where(live, denom_out, 1.0)[..., None]
        pv_abs = np.matmul(p, np.abs(g[..., :d_v])) / np.where(live, denom_out, 1.0)[..., None]
    out = np.where(live[..., None], out, 0.0)
    pv_abs = np.where(live[..., None], pv_abs, 0.0)
    return out, max_logits, lse, pv_abs


# --- tolerances -----------------------------------------------------------------------------
# Both are checked as |got - ref| <= atol + rtol * |ref| elementwise against the float64
# reference computed from the exact (already rounded) inputs, so input quantisation is not
# part of the error.
#
# out (bfloat16): the kernel accumulates the logits, the softmax and P @ V in float32 and
#   rounds to bf16 once. Rounding to nearest bf16 (8 significant bits) costs at most half an
#   ulp, <= 2^-8 ~ 3.9e-3 relative; rtol = 1e-2 leaves 2.5x margin. The float32 part is an
#   absolute error: P's relative error (fp32 exp, plus the logit error below) times
#   sum_t p_t |V| <= max|V| - ~1e-6 * max|V| in practice, but it is not relative to |out|
#   when the P @ V sum cancels (signed V), so atol = 1e-4 * max|V_dequantised| covers it with
#   margin (and covers outputs that land in bf16 subnormals). On avx512bf16 P is rounded to
#   bf16 before P @ V (as FlashMLA's kernels do): each p gains a relative error <= 2^-9, so out
#   gains <= 2^-9 * sum_t p_t |V_t| / denominator (pv_abs); PV_ROUNDING = 2^-8 doubles it.
OUT_RTOL = 1e-2
OUT_ATOL_PER_V = 1e-4
PV_ROUNDING = 2.0 ** -8
# max_logits / lse (float32): a logit is a float32 sum of d_qk exact products (bf16*bf16 and
#   fp8*fp8 products are exact in float32); its rounding error is a few float32 eps (6e-8)
#   times the sum of |products|, sqrt(d_qk)-ish in practice, so 1e-5 * (the largest
#   sum_i |q_i k_i| * scale over the row's valid slots) bounds it with margin. lse adds
#   log(sum of exp) in float32 (|rel. error| ~1e-6 over <= 2048 terms), covered by a fixed
#   +1e-5 absolute, and the same 1e-5 relative to |lse|.
LOGIT_RTOL = 1e-5
LOGIT_ATOL = 1e-5


def out_tol(kv, d_v, kv_scale=None):
    """(atol, rtol) for out where P is not rounded (fp32 P·V, or one valid row: p = 1)."""
    v = f64(kv)[:, 0, :d_v] * scalar(kv_scale)
    vmax = float(np.nanmax(np.abs(v))) if v.size and not np.isnan(v).all() else 1.0
    return OUT_ATOL_PER_V * max(vmax, 1e-30), OUT_RTOL


def out_atol(kv, d_v, kv_scale, pv_abs):
    """Elementwise atol for out: out_tol's, plus P's bf16 rounding where the ISA in use rounds
    it (avx512bf16 and avx512amx run P·V on vdpbf16ps)."""
    import attnkit
    atol = out_tol(kv, d_v, kv_scale)[0]
    return atol + (PV_ROUNDING * pv_abs if attnkit.get_isa() in ("avx512bf16", "avx512amx") else 0.0)


def logit_magnitude(q, kv, indices, sm_scale, q_scale=None, kv_scale=None, topk_length=None):
    """[s_q, h_q]: max over valid slots of sum_i |q_i k_i| * |scale| (0 for empty rows; NaN
    inputs are ignored)."""
    qf = np.abs(np.nan_to_num(f64(q))) * scalar(q_scale)
    kvf = np.abs(np.nan_to_num(f64(kv)[:, 0, :])) * scalar(kv_scale)
    valid = valid_slots(indices, kvf.shape[0], topk_length)
    idx = np.where(valid, to_np(indices)[:, 0, :].astype(np.int64), 0)
    g = kvf[idx] if kvf.shape[0] else np.zeros(idx.shape + (kvf.shape[1],))
    g = np.where(valid[..., None], g, 0.0)
    mag = np.matmul(qf, g.transpose(0, 2, 1)) * abs(float(sm_scale))
    return mag.max(axis=-1, initial=0.0)


def logit_tol(mag):
    """Elementwise atol array for max_logits / lse, given logit_magnitude()."""
    return LOGIT_ATOL * (np.asarray(mag) + 1.0)


# --- input makers ---------------------------------------------------------------------------

def make_qkv(rng, s_q, h_q, s_kv, d_qk, dtype="float8_e4m3fn", q_std=1.0, kv_std=1.0):
    """q [s_q, h_q, d_qk] and kv [s_kv, 1, d_qk] as numpy bf16 / fp8 arrays. fp8 values are
    normal draws with a per-element random magnitude factor (2^[-3, 3]) so that the whole
    e4m3 range is exercised (subnormals through ~100), then rounded to e4m3fn. No NaN codes."""
    dt = fp8_dtype() if dtype == "float8_e4m3fn" else bf16_dtype()

    def draw(shape, std):
        x = rng.standard_normal(shape) * std
        if dtype == "float8_e4m3fn":
            x = x * np.exp2(rng.uniform(-3.0, 3.0, size=shape))
            x = np.clip(x, -448.0, 448.0)
        x = np.where(x == 0.0, 0.5, x)
        return x.astype(dt)

    return draw((s_q, h_q, d_qk), q_std), draw((s_kv, 1, d_qk), kv_std)


def make_indices(rng, s_q, s_kv, topk, p_neg=0.1, p_oob=0.1, p_dup=0.05, p_extreme=0.05):
    """int32 [s_q, 1, topk]: per row, distinct random rows of [0, s_kv) (as many as fit; the
    rest invalid), then some slots replaced with -1, with values >= s_kv, with extreme int32
    values (INT32_MIN / INT32_MAX / other negatives) and with duplicates of a valid slot."""
    idx = np.empty((s_q, topk), dtype=np.int64)
    for s in range(s_q):
        n = min(topk, s_kv)
        row = np.full(topk, -1, dtype=np.int64)
        row[:n] = rng.permutation(s_kv)[:n]
        if n < topk:  # the rest: a mix of invalid values
            row[n:] = rng.choice([-1, s_kv, s_kv + 7, INT32_MAX, INT32_MIN], size=topk - n)
        row = row[rng.permutation(topk)]
        idx[s] = row
    u = rng.random((s_q, topk))
    idx = np.where(u < p_neg, -1, idx)
    oob = s_kv + rng.integers(0, 1000, size=(s_q, topk))
    idx = np.where((u >= p_neg) & (u < p_neg + p_oob), oob, idx)
    ext = rng.choice([INT32_MIN, INT32_MAX, -2, -1000000, 2**30], size=(s_q, topk))
    lo = p_neg + p_oob
    idx = np.where((u >= lo) & (u < lo + p_extreme), ext, idx)
    # duplicates: copy another slot's value (valid or not) into this slot
    lo += p_extreme
    dup = (u >= lo) & (u < lo + p_dup)
    if topk > 1:
        src = rng.integers(0, topk, size=(s_q, topk))
        idx = np.where(dup, np.take_along_axis(idx, src, axis=1), idx)
    return idx.astype(np.int32)[:, None, :]


def make_topk_length(rng, s_q, topk, extra=()):
    """int32 [s_q] in [0, topk], with 0 and topk always present when s_q allows, plus any
    `extra` values (e.g. > topk) placed in the last rows."""
    tl = rng.integers(0, topk + 1, size=s_q)
    if s_q >= 2:
        tl[0], tl[1] = 0, topk
    for i, e in enumerate(extra):
        if s_q - 1 - i >= 2:
            tl[s_q - 1 - i] = e
    return tl.astype(np.int32)


def make_sink(rng, h_q, specials=True):
    """float32 [h_q]: finite normals, with +inf / -inf / large finite values in a few heads."""
    sink = (rng.standard_normal(h_q) * 2.0).astype(np.float32)
    if specials and h_q >= 4:
        sink[0], sink[1], sink[2] = np.inf, -np.inf, 60.0
        sink[3] = -60.0
    return sink


def fp8_from_bits(b):
    return np.asarray(b, dtype=np.uint8).view(fp8_dtype())
