"""DeepSeek-V3.2 sparse attention (DSA) beyond the prefill: FlashMLA's MLA decode over paged
caches (sparse over the 656-byte fp8 V3.2 cache, dense over a bf16 or V3.2 cache) and the
quantiser that writes V3.2 tokens.
"""

import numpy as np

from . import _C
from ._arrays import empty_like_kind, kind_of, typed, typed_or_none, typed_output

V32_TOKEN_BYTES = 656  # 512 fp8 e4m3 + 4 fp32 scales (one per 128 values) + 64 bf16 rope
INT32_MAX = 2**31 - 1


def _check_kind(kind, named):
    for name, x in named:
        if x is not None and kind_of(x, name) != kind:
            raise ValueError(f"{name} must be a {kind} array like q, got {type(x).__name__}")


def _int(x, name):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(x).__name__}")
    return int(x)


def _topk_count(topk):
    """topk checked before an output of that width is allocated (the op checks it again)."""
    topk = _int(topk, "topk")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if topk > INT32_MAX:
        raise ValueError(f"topk must fit int32, got {topk}")
    return topk


def get_mla_metadata(*args, **kwargs):
    """FlashMLA's get_mla_metadata, for drop-in code: attnkit needs no schedule, so this
    returns (None, None) and flash_mla_with_kvcache ignores what it is given."""
    return None, None


def run_flash_mla(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                  is_fp8_kvcache, indices, attn_sink, topk_length, out, lse):
    """Calls the kernel; every array is already of one kind and the outputs exist."""
    _C.flash_mla_with_kvcache(
        typed(q, "q"), typed(k_cache, "k_cache"), typed_or_none(block_table, "block_table"),
        typed_or_none(cache_seqlens, "cache_seqlens"), head_dim_v, softmax_scale, bool(causal),
        bool(is_fp8_kvcache), typed_or_none(indices, "indices"), typed_or_none(attn_sink, "attn_sink"),
        typed_or_none(topk_length, "topk_length"), typed_output(out, "out"), typed_output(lse, "lse"))


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata=None,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                           indices=None, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                           topk_length=None, extra_topk_length=None, *, out=None):
    """FlashMLA's flash_mla_with_kvcache on the CPU: MLA decode with one latent KV head.
    Returns (out [b, s_q, h_q, head_dim_v] bfloat16, lse [b, h_q, s_q] float32, a transposed
    view of a [b, s_q, h_q] buffer as FlashMLA returns it; natural log).

    q: [b, s_q, h_q, d_qk] bfloat16, any h_q >= 1 (FlashMLA: 64 or 128) and any strides.
    Sparse (indices given; FlashMLA requires is_fp8_kvcache=True and causal=False, so does
    attnkit): k_cache [num_blocks, page_block_size, 1, 656] uint8 / int8 / float8_e4m3fn, the
    V3.2 layout (bytes [0, 512) e4m3 values, [512, 528) four fp32 scales, one per 128 values,
    [528, 656) 64 bf16 rope values), token stride 656, any block stride; d_qk = 576 and
    head_dim_v = 512. indices [b, s_q, topk] int32 flat slot ids block·page_block_size +
    offset; topk_length [b] int32 (optional). Slot t of row (b, i) is used iff
    0 <= indices[b, i, t] < num_blocks·page_block_size and t < topk_length[b]. Every other
    value (-1, any negative, past the cache) is skipped and its row never read: FlashMLA's
    V3.2 kernel reads any index other than -1, so an out-of-range id reads out of bounds
    there; attnkit treats it as invalid (decided; tested). block_table and cache_seqlens are
    ignored (may be None).
    Dense (no indices): block_table [b, max_blocks] int32 and cache_seqlens [b] int32; row
    (b, i) attends to tokens t < cache_seqlens[b] (causal: t <= cache_seqlens[b] - s_q + i)
    of pages block_table[b, t // page_block_size]; k_cache bfloat16 [num_blocks,
    page_block_size, 1, d_qk] (any page size, unlike FlashMLA's 64; V = k_cache[..., :head_dim_v])
    or the V3.2 fp8 cache with is_fp8_kvcache=True. Every referenced block id is checked
    (ValueError when out of [0, num_blocks)), as is 0 <= cache_seqlens[b] <= max_blocks·page.

    Semantics (FlashMLA's tests/ref.py): fp8 values are dequantised to bf16 (value × its
    tile's scale, rounded to bf16: exact for the power-of-two scales quantize_v32_kv writes);
    logits = q·k · softmax_scale (default d_qk^-0.5), softmax over the used tokens in float32,
    out = P·V rounded to bf16 once; lse = log Σ exp(logits). attn_sink [h_q] float32 scales
    out by 1 / (1 + exp(sink - lse)) and leaves lse alone (+inf: out 0). A row with no used
    token gives out = 0 and lse = +inf. Results are bit-identical for any thread count.
    tile_scheduler_metadata and num_splits are accepted and ignored; the extra_* scope
    (DeepSeek-V4) is not implemented (ValueError if given). Inputs: numpy arrays
    (ml_dtypes) or CPU torch tensors; out may be a caller buffer.
    """
    for name, x in (("extra_k_cache", extra_k_cache), ("extra_indices_in_kvcache", extra_indices_in_kvcache),
                    ("extra_topk_length", extra_topk_length)):
        if x is not None:
            raise ValueError(f"{name} (the second KV scope of DeepSeek-V4) is not supported by attnkit")
    head_dim_v = _int(head_dim_v, "head_dim_v")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise ValueError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        softmax_scale = float(softmax_scale)
    kind = kind_of(q, "q")
    kind_of(k_cache, "k_cache")
    _check_kind(kind, (("k_cache", k_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens),
                       ("indices", indices), ("attn_sink", attn_sink), ("topk_length", topk_length),
                       ("out", out)))
    if len(q.shape) != 4:
        raise ValueError(f"q must be a 4-d tensor [batch_size, seq_len_q, num_heads_q, head_dim], "
                         f"got {len(q.shape)}-d {list(q.shape)}")
    b, s_q, h_q, d_qk = q.shape
    if head_dim_v < 0:  # an output that wide cannot be allocated (the op checks the range, after FlashMLA's checks)
        raise ValueError(f"head_dim_v must be in [1, head_dim={d_qk}], got {head_dim_v}")
    if out is None:
        out = empty_like_kind(kind, (b, s_q, h_q, head_dim_v), "bfloat16")
    lse = empty_like_kind(kind, (b, s_q, h_q), "float32")
    args = (q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, bool(causal),
            bool(is_fp8_kvcache), indices, attn_sink, topk_length, out, lse)
    if kind == "torch":
        from . import _torch_dsa
        _torch_dsa.flash_mla_with_kvcache(*args)
        return out, lse.transpose(1, 2)
    run_flash_mla(*args)
    return out, lse.transpose(0, 2, 1)


def quantize_v32_kv(kv):
    """FlashMLA's V3.2 quantiser (tests/quant.py quantize_k_cache): kv [..., 576] bfloat16 or
    float32 -> uint8 [..., 656] of the same kind (numpy / torch). Per 128-value tile of the
    first 512: scale = 2^ceil(log2(max(amax / 448, 1e-4))) (a power of two, so dequantising
    to bf16 is exact), value = e4m3(x / scale), round to nearest even; the last 64 values
    are stored as bf16. A FlashMLA-shaped cache is kv [num_blocks, page, 1, 576] -> [.., 656]."""
    kind = kind_of(kv, "kv")
    shape = tuple(kv.shape)
    if len(shape) < 1 or shape[-1] != 576:
        raise ValueError(f"kv must have a last dim of 576 (512 nope + 64 rope), got shape {list(shape)}")
    flat = kv.reshape(-1, 576)
    dst = empty_like_kind(kind, (flat.shape[0], V32_TOKEN_BYTES), "uint8")
    if kind == "torch":
        _torch_dsa().quantize_v32_kv(flat, dst)
    else:
        run_quantize_v32_kv(flat, dst)
    return dst.reshape(shape[:-1] + (V32_TOKEN_BYTES,))


def run_quantize_v32_kv(kv, dst):
    _C.quantize_v32_kv(typed(kv, "kv"), typed_output(dst, "dst"))


# --- lightning indexer ----------------------------------------------------------------------

def _torch_dsa():
    from . import _torch_dsa
    return _torch_dsa


def run_mqa_logits(q, kv, kv_scale, weights, ks, ke, clean_logits, max_seqlen_k, logits, topk_indices):
    _C.fp8_mqa_logits(typed(q, "q", "float8_e4m3fn"), typed(kv, "kv", "float8_e4m3fn"),
                      typed(kv_scale, "kv_scale", "float32"), typed(weights, "weights", "float32"),
                      typed(ks, "cu_seq_len_k_start", "int32"), typed(ke, "cu_seq_len_k_end", "int32"),
                      bool(clean_logits), max_seqlen_k,
                      None if logits is None else typed_output(logits, "logits", "float32"),
                      None if topk_indices is None else typed_output(topk_indices, "topk_indices", "int32"))


def _mqa_inputs(q, kv, weights, ks, ke):
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ValueError(f"kv must be a pair (kv_fp8 [seq_len_kv, D], kv_scale [seq_len_kv]), got {type(kv).__name__}")
    kind = kind_of(q, "q")
    kv_fp8, kv_scale = kv
    _check_kind(kind, (("kv[0]", kv_fp8), ("kv[1]", kv_scale), ("weights", weights), ("cu_seq_len_k_start", ks),
                       ("cu_seq_len_k_end", ke)))
    for name, x in (("kv[0]", kv_fp8), ("kv[1]", kv_scale), ("weights", weights), ("cu_seq_len_k_start", ks),
                    ("cu_seq_len_k_end", ke)):
        if x is None:
            raise ValueError(f"{name} is required")
    if len(q.shape) != 3:
        raise ValueError(f"q must be a 3-d tensor [seq_len, num_heads, head_dim], got {len(q.shape)}-d {list(q.shape)}")
    if len(kv_fp8.shape) != 2:
        raise ValueError(f"kv[0] must be a 2-d tensor [seq_len_kv, head_dim], got {len(kv_fp8.shape)}-d")
    return kind, kv_fp8, kv_scale


def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0, *,
                   out=None):
    """DeepGEMM's fp8_mqa_logits (DSA's lightning indexer, prefill):
    logits[t, s] = Σ_h weights[t, h] · ReLU(q[t, h] · kv_fp8[s]) · kv_scale[s] for
    cu_seq_len_k_start[t] <= s < cu_seq_len_k_end[t] (the range clipped to [0, seq_len_kv)).

    q [seq_len, H, D] float8_e4m3fn (any H >= 1, D in {32, 64, 128}; DeepGEMM: H 32/64),
    kv = (kv_fp8 [seq_len_kv, D] float8_e4m3fn, kv_scale [seq_len_kv] float32), weights
    [seq_len, H] float32 (q's scale folded in, as SGLang does), ks / ke [seq_len] int32.
    Returns float32 logits [seq_len, seq_len_kv]: outside a row's range -inf with
    clean_logits, else not written (DeepGEMM's clean_logits=False; with out= the caller's
    values stay, else they are whatever the new buffer held). max_seqlen_k > 0 gives the
    compressed form [seq_len, max_seqlen_k] whose column c is key ks[t] + c (a longer row's
    keys past the width are not written; clean_logits must then be False, as DeepGEMM
    asserts). DeepGEMM returns a row-padded strided view;
    attnkit returns a contiguous array (out= may be any buffer with a unit last stride).
    q·k runs on bf16 pairs (e4m3 is exact in bf16: exact products, float32 sums); NaN
    propagates through ReLU. Results are bit-identical for any thread count.
    """
    kind, kv_fp8, kv_scale = _mqa_inputs(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end)
    max_seqlen_k = _int(max_seqlen_k, "max_seqlen_k")
    _check_kind(kind, (("out", out),))
    if out is None:
        width = max_seqlen_k if max_seqlen_k > 0 else kv_fp8.shape[0]
        out = empty_like_kind(kind, (q.shape[0], max(width, 0)), "float32")
    args = (q, kv_fp8, kv_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, bool(clean_logits), max_seqlen_k)
    if kind == "torch":
        _torch_dsa().mqa_logits(*args, out)
    else:
        run_mqa_logits(*args, out, None)
    return out


def fp8_mqa_topk(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, topk, *, out=None):
    """The indexer fused with top-k, never materialising a row of logits: int32 [seq_len, topk],
    row t's best keys as offsets from cu_seq_len_k_start[t] (what topk() gives on
    fp8_mqa_logits' output with row_starts=ks, lengths=ke-ks: the same ordering, -1 fill, tie
    break and -inf/NaN rule; bit-identical to it). A streaming selection keeps at most 2·topk
    candidates per row, so memory is O(seq_len · topk), not O(seq_len · seq_len_kv)."""
    kind, kv_fp8, kv_scale = _mqa_inputs(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end)
    topk = _topk_count(topk)
    _check_kind(kind, (("out", out),))
    if out is None:
        out = empty_like_kind(kind, (q.shape[0], topk), "int32")
    elif tuple(out.shape) != (q.shape[0], topk):
        raise ValueError(f"out must have shape [{q.shape[0]}, {topk}], got {list(out.shape)}")
    args = (q, kv_fp8, kv_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end)
    if kind == "torch":
        _torch_dsa().mqa_topk(*args, out)
    else:
        run_mqa_logits(*args, False, 0, None, out)
    return out


def get_paged_mqa_logits_metadata(*args, **kwargs):
    """DeepGEMM's schedule builder, for drop-in code: attnkit needs none (returns None)."""
    return None


def run_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len, clean_logits, out):
    _C.fp8_paged_mqa_logits(typed(q, "q", "float8_e4m3fn"),
                            typed(kv_cache, "kv_cache", "uint8 (or int8 / float8_e4m3fn bytes)"),
                            typed(weights, "weights", "float32"), typed(context_lens, "context_lens", "int32"),
                            typed(block_table, "block_table", "int32"), max_context_len, bool(clean_logits),
                            typed_output(out, "logits", "float32"))


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta=None, max_context_len=None,
                         clean_logits=False, *, out=None):
    """DeepGEMM's fp8_paged_mqa_logits (the indexer in decode) over the index-K cache.

    q [B, next_n, H, D] float8_e4m3fn; kv_cache [num_blocks, block_kv, 1, D + 4] uint8 whose
    page holds block_kv·D e4m3 values, then block_kv fp32 scales (not interleaved per token);
    any block_kv (DeepGEMM: 64) and block stride; weights [B·next_n, H] float32;
    context_lens [B, next_n] int32 (or [B] with next_n = 1); block_table [B, max_blocks]
    int32; max_context_len (required) the logits width. Row (b, n) = b·next_n + n scores keys
    s < context_lens[b, n] of pages block_table[b, s // block_kv]; beyond: -inf with
    clean_logits, else not written (DeepGEMM's default). Each referenced block id is checked
    (ValueError when out of range), as is context_lens <= max_context_len. schedule_meta is
    accepted and ignored. Returns float32 logits [B·next_n, max_context_len]."""
    kind = kind_of(q, "q")
    _check_kind(kind, (("kv_cache", kv_cache), ("weights", weights), ("context_lens", context_lens),
                       ("block_table", block_table), ("out", out)))
    if max_context_len is None:
        raise ValueError("max_context_len is required (the logits width)")
    max_context_len = _int(max_context_len, "max_context_len")
    if len(q.shape) != 4:
        raise ValueError(f"q must be a 4-d tensor [batch_size, next_n, num_heads, head_dim], got {len(q.shape)}-d")
    if out is None:
        out = empty_like_kind(kind, (q.shape[0] * q.shape[1], max(max_context_len, 0)), "float32")
    args = (q, kv_cache, weights, context_lens, block_table, max_context_len, bool(clean_logits), out)
    if kind == "torch":
        _torch_dsa().paged_mqa_logits(*args)
    else:
        run_paged_mqa_logits(*args)
    return out


def quantize_index_k_cache(k, page_size):
    """The index-K cache DeepGEMM's paged kernel reads, from k [num_tokens, D] float32/bf16
    (tokens in order, the last page padded with zeros): per token an fp32 scale amax/448
    (clamped at 1e-4, DeepGEMM's test quantiser) and e4m3 values k/scale; returns (uint8
    [num_pages, page_size, 1, D + 4] with each page's values then its scales, fp8 k
    [num_tokens, D], float32 scales [num_tokens]). numpy only (a test and example helper)."""
    import ml_dtypes
    k = np.asarray(k, dtype=np.float32)
    n, d = k.shape
    scale = np.maximum(np.abs(k).max(axis=1) / np.float32(448.0), np.float32(1e-4)).astype(np.float32)
    fp8 = (k / scale[:, None]).astype(ml_dtypes.float8_e4m3fn)
    pages = -(-n // page_size)
    vals = np.zeros((pages * page_size, d), dtype=np.uint8)
    vals[:n] = fp8.view(np.uint8)
    scales = np.zeros(pages * page_size, dtype=np.float32)
    scales[:n] = scale
    cache = np.concatenate([vals.reshape(pages, page_size * d), scales.reshape(pages, page_size).view(np.uint8)], axis=1)
    return cache.reshape(pages, page_size, 1, d + 4), fp8, scale


# --- top-k and its transforms ---------------------------------------------------------------

def run_topk(logits, lengths, topk, row_starts, offsets, page_table, page_size, row_to_batch, out):
    _C.topk_transform(typed(logits, "logits"), typed(lengths, "lengths"), topk, typed_or_none(row_starts, "row_starts"),
                      typed_or_none(offsets, "offsets"), typed_or_none(page_table, "page_table"), page_size,
                      typed_or_none(row_to_batch, "row_to_batch"), typed_output(out, "out"))


def _topk(logits, lengths, topk, row_starts=None, offsets=None, page_table=None, page_size=1, row_to_batch=None,
          out=None):
    kind = kind_of(logits, "logits")
    _check_kind(kind, (("lengths", lengths), ("row_starts", row_starts), ("offsets", offsets),
                       ("page_table", page_table), ("row_to_batch", row_to_batch), ("out", out)))
    kind_of(lengths, "lengths")
    topk, page_size = _topk_count(topk), _int(page_size, "page_size")
    if len(logits.shape) != 2:
        raise ValueError(f"logits must be a 2-d tensor [num_rows, max_len], got {len(logits.shape)}-d")
    if out is None:
        out = empty_like_kind(kind, (logits.shape[0], topk), "int32")
    args = (logits, lengths, topk, row_starts, offsets, page_table, page_size, row_to_batch, out)
    if kind == "torch":
        _torch_dsa().topk(*args)
    else:
        run_topk(*args)
    return out


_TOPK_SEMANTICS = """
    Row r ranges over logits[r, row_starts[r] : row_starts[r] + lengths[r]] (row_starts
    default 0; the range must lie inside the row). Its best topk positions t (row-relative)
    come first in order of (value desc, t asc): ties go to the lower index, so results are
    identical for any thread count and on every tensor-parallel rank. -inf and NaN are never
    selected (SGLang's reference gives -1 for -inf); the rest of the row is -1. When
    lengths[r] <= topk every finite position is selected. Any topk >= 1 (SGLang's kernels:
    2048 only). logits float32 (any strides), lengths / row_starts [num_rows] int32; returns
    int32 [num_rows, topk] (out= a caller buffer)."""


def topk(logits, lengths, topk, row_starts=None, *, out=None):
    return _topk(logits, lengths, topk, row_starts=row_starts, out=out)


def topk_ragged_transform(logits, offsets, lengths, topk, row_starts=None, *, out=None):
    return _topk(logits, lengths, topk, row_starts=row_starts, offsets=offsets, out=out)


def topk_page_table_transform(logits, page_table, lengths, topk, row_to_batch=None, page_size=1, row_starts=None, *,
                              out=None):
    return _topk(logits, lengths, topk, row_starts=row_starts, page_table=page_table, page_size=page_size,
                 row_to_batch=row_to_batch, out=out)


topk.__doc__ = "Top-k of each row's valid range, as row-relative indices." + _TOPK_SEMANTICS
topk_ragged_transform.__doc__ = """Top-k with SGLang's RAGGED transform: each selected t becomes
    t + offsets[r] (offsets [num_rows] int32, the row's start in the batch's gathered KV), -1
    stays -1 (FlashInfer's top_k_ragged_transform argument order).""" + _TOPK_SEMANTICS
topk_page_table_transform.__doc__ = """Top-k with the PAGED transform: each selected t becomes the
    physical slot page_table[row_to_batch[r], t // page_size] · page_size + t % page_size
    (page_size 1: SGLang's page_table_1 gather), -1 stays -1. page_table [batches,
    max_pages] int32; row_to_batch [num_rows] int32 (default: row r uses page_table row r);
    lengths must fit in max_pages · page_size, and every page a row's keys reach must hold an
    id >= 0 whose slots fit int32 (FlashInfer's top_k_page_table_transform order, plus
    page_size).""" + _TOPK_SEMANTICS
