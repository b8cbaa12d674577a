"""attnkit's serving-engine ops: attention over packed variable-length batches and over paged
KV caches (chunked prefill and decode in one call), and the cache writer. Each docstring is the
op's specification; tests/python/serving_reference.py restates it in float64 as code.

Conventions shared by the three ops (FlashAttention's and vLLM's):
- Packed tensors put the tokens of every sequence one after another: q [total_q, Hq, D].
- cu_seqlens_* are int32 [B + 1] offsets into the packed tensors (0 first, then
  non-decreasing, the total last). Empty sequences are allowed.
- GQA/MQA whenever Hq is a multiple of Hkv: query head h reads kv head h // (Hq // Hkv).
- lse is float32 [total_q, Hq], natural log. A query that sees no key gets out = 0 and
  lse = -inf, as in attnkit.attention.
- Numerics as attnkit.attention: softmax and accumulation in float32.
"""

import numpy as np

from . import _C
from ._arrays import FLOAT, dtype_name, empty_like_kind, kind_of, typed, typed_or_none, typed_output
from .ops import check_softcap, flag, real_scalar, window_pair


CACHE = "float32, float16, bfloat16, float8_e4m3fn or float8_e5m2"


def _same_kind(kind, named):
    for x, name in named:
        if x is not None and kind_of(x, name) != kind:
            raise ValueError(f"{name} must be a {kind} array like q, got {type(x).__name__}")


def _check_optional_int(value, name):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int or None, got {type(value).__name__}")
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{name} must fit int64, got {value}")
    return int(value)


def _kv_scale(scale, kind, name):
    """A dequantisation scale: None, a Python/numpy number, or a float32 array/tensor."""
    if scale is None:
        return None
    if isinstance(scale, (int, float, np.floating, np.integer)) and not isinstance(scale, bool):
        value = real_scalar(scale, name)  # 10**400: a ValueError, not an OverflowError
        if kind == "torch":
            import torch
            return torch.tensor(value, dtype=torch.float32)
        with np.errstate(over="ignore"):  # past float32's range: inf, refused by the op
            return np.asarray(value, dtype=np.float32)
    if kind_of(scale, name) != kind:
        raise ValueError(f"{name} must be a {kind} array like q, a float, or None, got {type(scale).__name__}")
    return scale


def _packed_out_shapes(q, v, name_v):
    """(out shape, lse shape) from q [total_q, Hq, D] and v (or v_cache); the C++ op checks the rest."""
    for x, name, dims in ((q, "q", "[total_q, Hq, D]"),
                          (v, name_v, "[total_k, Hkv, Dv]" if name_v == "v" else "[num_blocks, block_size, Hkv, Dv]")):
        rank = 3 if name == "q" or name_v == "v" else 4
        if len(x.shape) != rank:
            raise ValueError(f"{name} must be a {rank}-d tensor {dims}, got {len(x.shape)}-d {list(x.shape)}")
    return (q.shape[0], q.shape[1], v.shape[-1]), (q.shape[0], q.shape[1])


def _mods_args(mods):
    """The binding's modifier arguments from (window pair, softcap, alibi_slopes, sinks)."""
    (left, right), softcap, alibi_slopes, sinks = mods
    return (left, right, softcap, typed_or_none(alibi_slopes, "alibi_slopes", "float32"),
            typed_or_none(sinks, "sinks", "float32"))


NO_MODS = ((-1, -1), None, None, None)


def run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, out, lse,
               mods=NO_MODS):
    _C.varlen_attention(typed(q, "q"), typed(k, "k"), typed(v, "v"), typed(cu_seqlens_q, "cu_seqlens_q", "int32"),
                        typed(cu_seqlens_k, "cu_seqlens_k", "int32"), typed_output(out, "out"),
                        None if lse is None else typed_output(lse, "lse", "float32"), max_seqlen_q, max_seqlen_k,
                        causal, scale, *_mods_args(mods))


def run_varlen_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, dout, dq, dk, dv, dlse, max_seqlen_q,
                        max_seqlen_k, causal, scale, mods=NO_MODS, dsinks=None):
    _C.varlen_attention_backward(typed(q, "q"), typed(k, "k"), typed(v, "v"),
                                 typed(cu_seqlens_q, "cu_seqlens_q", "int32"),
                                 typed(cu_seqlens_k, "cu_seqlens_k", "int32"), typed(out, "out"),
                                 typed(lse, "lse", "float32"), typed(dout, "dout"), typed_output(dq, "dq"),
                                 typed_output(dk, "dk"), typed_output(dv, "dv"),
                                 typed_or_none(dlse, "dlse", "float32"), max_seqlen_q, max_seqlen_k, causal, scale,
                                 *_mods_args(mods), None if dsinks is None else typed_output(dsinks, "dsinks"))


def run_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_scale, v_scale, causal, scale, out, lse,
              mods=NO_MODS):
    _C.paged_attention(typed(q, "q"), typed(k_cache, "k_cache", CACHE), typed(v_cache, "v_cache", CACHE),
                       typed(block_table, "block_table", "int32"), typed(seq_lens, "seq_lens", "int32"),
                       typed(cu_seqlens_q, "cu_seqlens_q", "int32"), typed_output(out, "out"),
                       None if lse is None else typed_output(lse, "lse", "float32"),
                       typed_or_none(k_scale, "k_scale", "float32"), typed_or_none(v_scale, "v_scale", "float32"),
                       causal, scale, *_mods_args(mods))


def run_append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    _C.append_kv_cache(typed(k, "k"), typed(v, "v"), typed_output(k_cache, "k_cache", CACHE),
                       typed_output(v_cache, "v_cache", CACHE), typed(slot_mapping, "slot_mapping", "int32 or int64"),
                       typed_or_none(k_scale, "k_scale", "float32"), typed_or_none(v_scale, "v_scale", "float32"))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                     causal=False, scale=None, return_lse=False, out=None, window=None, softcap=None,
                     alibi_slopes=None, sinks=None):
    """Attention over a packed batch of variable-length sequences (FlashAttention's
    flash_attn_varlen_func).

    Shapes: q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] -> out
    [total_q, Hq, Dv]; cu_seqlens_q / cu_seqlens_k int32 [B + 1]. Sequence b's queries are
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] and its keys k[cu_seqlens_k[b]:cu_seqlens_k[b+1]];
    sequences never see each other. D and Dv in [1, 512]; any strides.

    - scores = (q · kᵀ) · scale, scale defaulting to 1/sqrt(D).
    - causal=True aligns bottom-right per sequence: query i of a sequence with Sq queries and
      Sk keys sees keys j <= i + Sk - Sq (so a query with no key at or before its position
      sees none).
    - max_seqlen_q / max_seqlen_k are optional (attnkit plans from cu_seqlens itself); if
      given they must be at least the longest sequence.
    - dtypes: q, k, v all float32, float16 or bfloat16; out has that dtype. lse float32
      [total_q, Hq].
    - Score modifiers, as in attnkit.attention (each sequence aligned bottom-right: its query i
      sits at key position i + Sk - Sq): window=(left, right), softcap, alibi_slopes float32
      [Hq] or [B, Hq], sinks float32 [Hq] (in the denominator only; lse leaves it out).
    Returns out, or (out, lse) with return_lse=True.
    """
    causal, return_lse = flag(causal, "causal"), flag(return_lse, "return_lse")
    scale = None if scale is None else real_scalar(scale, "scale")
    max_seqlen_q = _check_optional_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _check_optional_int(max_seqlen_k, "max_seqlen_k")
    mods = (window_pair(window), check_softcap(softcap), alibi_slopes, sinks)
    kind = kind_of(q, "q")
    _same_kind(kind, ((k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"),
                      (out, "out"), (alibi_slopes, "alibi_slopes"), (sinks, "sinks")))
    if kind == "torch":
        from . import _torch_serving
        return _torch_serving.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               causal, scale, return_lse, out, mods)
    out_shape, lse_shape = _packed_out_shapes(q, v, "v")
    if out is None:
        out = empty_like_kind("numpy", out_shape, typed(q, "q")[1])
    lse = empty_like_kind("numpy", lse_shape, "float32") if return_lse else None
    run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, out, lse, mods)
    return (out, lse) if return_lse else out


def varlen_attention_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                              max_seqlen_k=None, causal=False, scale=None, window=None, softcap=None,
                              alibi_slopes=None, sinks=None, dlse=None, dq=None, dk=None, dv=None, dsinks=None):
    """Gradients (dq, dk, dv) of varlen_attention at (q, k, v), given its out and lse
    (``varlen_attention(..., return_lse=True)``) and dout, the gradient of out; with sinks,
    (dq, dk, dv, dsinks), dsinks the float32 [Hq] gradient of the sink logits summed over the
    sequences. FlashAttention's varlen backward.

    The keyword arguments must be the forward's (cu_seqlens, causal, scale and score
    modifiers; ALiBi slopes get no gradient). dlse, if given, is the gradient of lse (float32
    [total_q, Hq]); None means zero. dq, dk, dv, if given, must have the shapes and dtype of
    q, k, v and not alias any input; they are allocated otherwise (dsinks likewise). Each
    sequence's gradients are attnkit.attention_backward's on its own rows (bottom-right
    aligned): float32 accumulation, rounded once to the input dtype, bit-identical for any
    thread count. Keys of a sequence without queries get zero dk and dv; queries without keys
    get zero dq.
    """
    causal = flag(causal, "causal")
    scale = None if scale is None else real_scalar(scale, "scale")
    max_seqlen_q = _check_optional_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _check_optional_int(max_seqlen_k, "max_seqlen_k")
    mods = (window_pair(window), check_softcap(softcap), alibi_slopes, sinks)
    kind = kind_of(q, "q")
    _same_kind(kind, ((k, "k"), (v, "v"), (out, "out"), (lse, "lse"), (dout, "dout"),
                      (cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"), (dlse, "dlse"), (dq, "dq"),
                      (dk, "dk"), (dv, "dv"), (alibi_slopes, "alibi_slopes"), (sinks, "sinks"),
                      (dsinks, "dsinks")))
    dtype = dtype_name(q, "q", FLOAT)
    dq = empty_like_kind(kind, tuple(q.shape), dtype) if dq is None else dq
    dk = empty_like_kind(kind, tuple(k.shape), dtype) if dk is None else dk
    dv = empty_like_kind(kind, tuple(v.shape), dtype) if dv is None else dv
    if sinks is not None and dsinks is None:
        dsinks = empty_like_kind(kind, (int(sinks.shape[0]) if len(sinks.shape) else 0,), "float32")
    run_varlen_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, dout, dq, dk, dv, dlse, max_seqlen_q,
                        max_seqlen_k, causal, scale, mods, dsinks)
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, *, causal=True, scale=None,
                    k_scale=None, v_scale=None, return_lse=False, out=None, window=None, softcap=None,
                    alibi_slopes=None, sinks=None):
    """Attention of each sequence's new tokens over its keys in a paged KV cache: chunked
    prefill and decode, mixed in one batch (vLLM's unified CPU call; FlashAttention's
    flash_attn_with_kvcache cache layout).

    Shapes: q [total_q, Hq, D] packed (sequence b's new tokens are
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]: 1 for a decode, many for a prefill chunk);
    k_cache [num_blocks, block_size, Hkv, D], v_cache [num_blocks, block_size, Hkv, Dv],
    any block_size >= 1 and any strides; block_table int32 [B, max_blocks]; seq_lens int32
    [B]; cu_seqlens_q int32 [B + 1] -> out [total_q, Hq, Dv].

    - Sequence b's keys are positions 0 .. seq_lens[b]-1 (its cached prefix and its new
      tokens, already appended with append_kv_cache); key j lies in block
      block_table[b, j // block_size] at offset j % block_size. Only the first
      ceil(seq_lens[b] / block_size) entries of a row are read (each must be a block in
      [0, num_blocks)); the rest may hold anything, e.g. -1. Blocks may be shared between
      sequences (prefix sharing) and listed in any order.
    - The queries are the last positions of their sequence: with causal=True (the default)
      query i of n new tokens sees keys j <= seq_lens[b] - n + i; causal=False: all keys.
    - seq_lens[b] must be at least the sequence's query count and at most
      max_blocks * block_size.
    - dtypes: q float32, float16 or bfloat16; the caches q's dtype, or float8_e4m3fn /
      float8_e5m2 (dequantised as value * k_scale / v_scale: scales float32, a number, [] / [1]
      per tensor or [Hkv] per kv head, finite and positive; default 1). out has q's dtype.
    - Score modifiers, as in attnkit.attention (each sequence aligned bottom-right: its query i
      sits at key position i + Sk - Sq): window=(left, right), softcap, alibi_slopes float32
      [Hq] or [B, Hq], sinks float32 [Hq] (in the denominator only; lse leaves it out).
    Returns out, or (out, lse) with return_lse=True (lse float32 [total_q, Hq]).
    """
    causal, return_lse = flag(causal, "causal"), flag(return_lse, "return_lse")
    scale = None if scale is None else real_scalar(scale, "scale")
    mods = (window_pair(window), check_softcap(softcap), alibi_slopes, sinks)
    kind = kind_of(q, "q")
    _same_kind(kind, ((k_cache, "k_cache"), (v_cache, "v_cache"), (block_table, "block_table"),
                      (seq_lens, "seq_lens"), (cu_seqlens_q, "cu_seqlens_q"), (out, "out"),
                      (alibi_slopes, "alibi_slopes"), (sinks, "sinks")))
    k_scale = _kv_scale(k_scale, kind, "k_scale")
    v_scale = _kv_scale(v_scale, kind, "v_scale")
    if kind == "torch":
        from . import _torch_serving
        return _torch_serving.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_scale,
                                              v_scale, causal, scale, return_lse, out, mods)
    out_shape, lse_shape = _packed_out_shapes(q, v_cache, "v_cache")
    if out is None:
        out = empty_like_kind("numpy", out_shape, typed(q, "q")[1])
    lse = empty_like_kind("numpy", lse_shape, "float32") if return_lse else None
    run_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_scale, v_scale, causal, scale, out, lse,
              mods)
    return (out, lse) if return_lse else out


def append_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Writes new tokens into paged KV caches in place (vLLM's reshape_and_cache).

    Shapes: k [T, Hkv, D], v [T, Hkv, Dv] (float32, float16 or bfloat16); k_cache
    [num_blocks, block_size, Hkv, D], v_cache [num_blocks, block_size, Hkv, Dv] (float32,
    float16, bfloat16, float8_e4m3fn or float8_e5m2); slot_mapping int32 or int64 [T].

    Token t goes to block slot_mapping[t] // block_size, offset slot_mapping[t] % block_size;
    -1 skips it (a padding token). Tokens are written in order, so a repeated slot keeps the
    last token's values. Values are stored as value / scale (k_scale, v_scale as in
    paged_attention; default 1), rounded to nearest even in the cache dtype; float8 saturates
    to its largest finite value (NaN stays NaN). Returns None.
    """
    kind = kind_of(k, "k")
    _same_kind(kind, ((v, "v"), (k_cache, "k_cache"), (v_cache, "v_cache"), (slot_mapping, "slot_mapping")))
    k_scale = _kv_scale(k_scale, kind, "k_scale")
    v_scale = _kv_scale(v_scale, kind, "v_scale")
    if kind == "torch":
        from . import _torch_serving
        return _torch_serving.append_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    run_append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return None
