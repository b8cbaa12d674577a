"""Float64 references for attnkit's serving ops: varlen and paged attention loop over the
sequences and run reference.attention_ref on each (bottom-right causal), paged attention on the
keys gathered from the cache through the block table and dequantised; append_kv_cache_ref
writes a numpy copy of the caches."""

import numpy as np

from reference import attention_ref, pv_magnitude, to_f64


def _per_sequence(q, seqs, causal, scale):
    """seqs: (q rows [sq, Hq, D] as f64, k [sk, Hkv, D], v [sk, Hkv, Dv]) per sequence ->
    (out [total_q, Hq, Dv], lse [total_q, Hq], magnitude like out)."""
    outs, lses, mags = [], [], []
    for qb, kb, vb in seqs:
        if qb.shape[0] == 0:
            continue
        args = (qb.transpose(1, 0, 2)[None], kb.transpose(1, 0, 2)[None], vb.transpose(1, 0, 2)[None])
        kw = dict(causal="bottom_right" if causal else False, scale=scale, enable_gqa=True)
        o, l = attention_ref(*args, **kw)
        outs.append(o[0].transpose(1, 0, 2))
        lses.append(l[0].T)
        mags.append(pv_magnitude(*args, **kw)[0].transpose(1, 0, 2))
    hq, dv = q.shape[1], seqs[0][2].shape[2] if seqs else 0
    if not outs:
        return np.zeros((0, hq, dv)), np.zeros((0, hq)), np.zeros((0, hq, dv))
    return np.concatenate(outs), np.concatenate(lses), np.concatenate(mags)


def varlen_ref(q, k, v, cu_q, cu_k, causal=False, scale=None):
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    cu_q, cu_k = np.asarray(cu_q), np.asarray(cu_k)
    seqs = [(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]) for b in range(len(cu_q) - 1)]
    return _per_sequence(q, seqs, causal, scale)


def gather_cache(cache, block_table, seq_len, scale=None):
    """The first seq_len tokens of one sequence, [seq_len, Hkv, D] float64, times its scale."""
    cache = to_f64(cache)
    bs = cache.shape[1]
    j = np.arange(seq_len)
    rows = cache[np.asarray(block_table)[j // bs], j % bs] if seq_len else cache[:0, 0]
    if scale is not None:
        rows = rows * np.asarray(scale, dtype=np.float64).reshape(-1)[None, :, None]
    return rows


def paged_ref(q, k_cache, v_cache, block_table, seq_lens, cu_q, causal=True, scale=None, k_scale=None, v_scale=None):
    q = to_f64(q)
    cu_q, seq_lens, block_table = np.asarray(cu_q), np.asarray(seq_lens), np.asarray(block_table)
    seqs = [(q[cu_q[b]:cu_q[b + 1]], gather_cache(k_cache, block_table[b], seq_lens[b], k_scale),
             gather_cache(v_cache, block_table[b], seq_lens[b], v_scale)) for b in range(len(seq_lens))]
    return _per_sequence(q, seqs, causal, scale)
