"""Float64 numpy references for attnkit.dsa (DeepSeek-V3.2 sparse attention beyond the
prefill), input makers, and the tolerances the tests hold the kernels to.

The references restate each op's contract as plain numpy (torch is only read, never used to
compute):
  v32_dequant: FlashMLA's V3.2 token -> 576 values (fp8 · tile scale rounded to bf16, rope bf16)
  v32_quantize: FlashMLA's tests/quant.py, bit-exact
  mla_decode_ref: flash_mla_with_kvcache over the rows each (batch, query) uses
"""

import numpy as np

from sparse_mla_reference import bf16_dtype, f64, fp8_dtype, to_np

TOKEN = 656
NAN_BF16 = 0x7FC0


def v32_quantize(kv):
    """[..., 576] (bf16 / float32 values) -> uint8 [..., 656], FlashMLA's quantiser in numpy."""
    x = to_np(kv).astype(np.float32)
    lead = x.shape[:-1]
    out = np.empty(lead + (TOKEN,), dtype=np.uint8)
    scales = np.empty(lead + (4,), dtype=np.float32)
    for t in range(4):
        tile = x[..., t * 128:(t + 1) * 128]
        amax = np.abs(tile).max(axis=-1)
        scale = np.exp2(np.ceil(np.log2(np.maximum(amax / np.float32(448.0), np.float32(1e-4))))).astype(np.float32)
        scales[..., t] = scale
        q = (tile / scale[..., None]).astype(fp8_dtype())
        out[..., t * 128:(t + 1) * 128] = q.view(np.uint8)
    out[..., 512:528] = scales.view(np.uint8).reshape(lead + (16,))
    out[..., 528:] = x[..., 512:].astype(bf16_dtype()).view(np.uint8).reshape(lead + (128,))
    return out


def v32_dequant(tokens):
    """uint8 [..., 656] -> float64 [..., 576]: fp8 · scale in float32, rounded to bf16 (as
    FlashMLA's kernel), then the bf16 rope values."""
    t = np.ascontiguousarray(to_np(tokens)).view(np.uint8)
    lead = t.shape[:-1]
    vals = t[..., :512].view(fp8_dtype()).astype(np.float32).reshape(lead + (4, 128))
    scales = np.ascontiguousarray(t[..., 512:528]).view(np.float32).reshape(lead + (4, 1))
    with np.errstate(invalid="ignore", over="ignore"):
        nope = (vals * scales).astype(bf16_dtype()).astype(np.float64).reshape(lead + (512,))
    rope = np.ascontiguousarray(t[..., 528:]).view(bf16_dtype()).astype(np.float64)
    return np.concatenate([nope, rope], axis=-1)


def rows_used(b, i, s_q, page, num_blocks, indices=None, topk_length=None, block_table=None,
              cache_seqlens=None, causal=False):
    """[(block, offset)] of the cache rows query (b, i) uses, in order."""
    if indices is not None:
        idx = to_np(indices)[b, i].astype(np.int64)
        limit = len(idx)
        if topk_length is not None:
            limit = int(np.clip(to_np(topk_length)[b], 0, limit))
        return [(int(x) // page, int(x) % page) for x in idx[:limit] if 0 <= x < num_blocks * page]
    n = int(to_np(cache_seqlens)[b])
    if causal:
        n = max(0, n - s_q + i + 1)
    table = to_np(block_table)[b]
    return [(int(table[t // page]), t % page) for t in range(n)]


def mla_decode_ref(q, k_cache, head_dim_v, softmax_scale=None, is_fp8=False, indices=None,
                   topk_length=None, block_table=None, cache_seqlens=None, causal=False, attn_sink=None):
    """(out [b, s_q, h_q, d_v], lse [b, h_q, s_q], pv_abs [b, s_q, h_q, d_v]) in float64; only
    the rows used are read. pv_abs = Σ p·|V| / denominator, the scale of the bf16 rounding of
    P that the kernel (as FlashMLA) applies before P·V."""
    qf = f64(q)
    b, s_q, h_q, d_qk = qf.shape
    cache = to_np(k_cache)
    num_blocks, page = cache.shape[0], cache.shape[1]
    scale = d_qk ** -0.5 if softmax_scale is None else float(np.float32(softmax_scale))
    out = np.zeros((b, s_q, h_q, head_dim_v))
    pv_abs = np.zeros_like(out)
    lse = np.full((b, s_q, h_q), np.inf)
    sink = None if attn_sink is None else f64(attn_sink)
    for bi in range(b):
        for i in range(s_q):
            used = rows_used(bi, i, s_q, page, num_blocks, indices, topk_length, block_table, cache_seqlens, causal)
            if not used:
                continue
            blocks = np.array([u[0] for u in used]), np.array([u[1] for u in used])
            raw = cache[blocks[0], blocks[1], 0]
            kv = v32_dequant(raw) if is_fp8 else raw.astype(np.float64)
            logits = qf[bi, i] @ kv.T * scale                      # [h_q, n]
            m = logits.max(axis=-1, keepdims=True)
            p = np.exp(logits - m)
            denom = p.sum(axis=-1)
            lse[bi, i] = np.log(denom) + m[:, 0]
            if sink is not None:
                denom = denom + np.exp(sink - m[:, 0])
            out[bi, i] = p @ kv[:, :head_dim_v] / denom[:, None]
            pv_abs[bi, i] = p @ np.abs(kv[:, :head_dim_v]) / denom[:, None]
    return out, lse.transpose(0, 2, 1), pv_abs


def logit_magnitude(q, k_cache, is_fp8, used_rows_fn, softmax_scale):
    """[b, h_q, s_q]: max over used rows of Σ|q_i k_i| · scale (0 for empty rows)."""
    qf = np.abs(f64(q))
    b, s_q, h_q, _ = qf.shape
    cache = to_np(k_cache)
    mag = np.zeros((b, s_q, h_q))
    for bi in range(b):
        for i in range(s_q):
            used = used_rows_fn(bi, i)
            if used:
                raw = cache[[u[0] for u in used], [u[1] for u in used], 0]
                kv = np.abs(v32_dequant(raw) if is_fp8 else raw.astype(np.float64))
                mag[bi, i] = (qf[bi, i] @ kv.T).max(axis=-1) * softmax_scale
    return mag.transpose(0, 2, 1)


# Tolerances (|got - ref| <= atol + rtol·|ref|, against float64 on the exact inputs), the
# sparse MLA prefill's (derived in sparse_mla_reference.py): out bf16 rtol 1e-2 + atol
# 1e-4·max|V| of the used rows; lse float32 1e-5 relative + 1e-5·(logit magnitude + 1).
# On avx512bf16 the decode rounds P to bf16 before P·V (FlashMLA does the same): each p gains a
# relative error <= 2^-9, so out gains <= 2^-9·Σp|V|/denominator; PV_ROUNDING = 2^-8 doubles it.
OUT_RTOL, OUT_ATOL_PER_V = 1e-2, 1e-4
PV_ROUNDING = 2.0 ** -8
LSE_RTOL, LSE_ATOL = 1e-5, 1e-5


def poison_v32(cache_bytes, keep):
    """NaN in every token of a uint8 [num_blocks, page_alloc, 1, 656] cache except the
    (block, offset) pairs in keep: fp8 NaN codes, NaN scales, NaN rope values."""
    c = cache_bytes
    mask = np.ones(c.shape[:2], dtype=bool)
    for blk, off in keep:
        mask[blk, off] = False
    tok = c[mask][:, 0]
    tok[:, :512] = 0x7F
    tok[:, 512:528] = np.full(4, np.nan, dtype=np.float32).view(np.uint8)
    tok[:, 528:] = np.full(64, NAN_BF16, dtype=np.uint16).view(np.uint8)
    c[mask] = tok[:, None]
    return c


def poison_bf16(cache, keep):
    """NaN in every row of a bf16 [num_blocks, page_alloc, 1, d] cache except keep."""
    mask = np.ones(cache.shape[:2], dtype=bool)
    for blk, off in keep:
        mask[blk, off] = False
    bits = cache.view(np.uint16)
    bits[mask] = NAN_BF16
    return cache


# --- lightning indexer and top-k ------------------------------------------------------------

def mqa_logits_ref(q, kv, kv_scale, weights, ks, ke):
    """float64 [T, S]: Σ_h w[t,h]·ReLU(q[t,h]·k[s])·k_scale[s] inside [ks, ke), -inf outside;
    also the magnitude Σ_h |w|·Σ_d|q k|·|k_scale| (for tolerances)."""
    qf, kf = f64(q), f64(kv)
    sc, w = f64(kv_scale), f64(weights)
    s = np.einsum("thd,sd->ths", qf, kf)
    logits = np.einsum("th,ths->ts", w, np.maximum(s, 0)) * sc[None, :]
    mag = np.einsum("th,ths->ts", np.abs(w), np.einsum("thd,sd->ths", np.abs(qf), np.abs(kf))) * np.abs(sc)[None, :]
    cols = np.arange(kf.shape[0])[None, :]
    inside = (cols >= to_np(ks)[:, None]) & (cols < to_np(ke)[:, None])
    return np.where(inside, logits, -np.inf), mag, inside


LOGITS_RTOL, LOGITS_ATOL = 1e-5, 1e-5
# logits: float32 sums of exact products (e4m3·e4m3 in bf16 pairs) over D, then over H:
# a few float32 eps (6e-8) times Σ|terms|; 1e-5·(magnitude) + 1e-5·|ref| leaves margin.


def topk_ref(logits, lengths, k, row_starts=None):
    """int64 [N, k] row-relative: by (value desc, index asc) among values > -inf (no NaN)."""
    lg = to_np(logits).astype(np.float64)
    n = lg.shape[0]
    out = np.full((n, k), -1, dtype=np.int64)
    for r in range(n):
        start = 0 if row_starts is None else int(to_np(row_starts)[r])
        row = lg[r, start:start + int(to_np(lengths)[r])]
        cand = [t for t in range(len(row)) if row[t] > -np.inf]
        cand.sort(key=lambda t: (-row[t], t))
        out[r, :min(k, len(cand))] = cand[:k]
    return out
