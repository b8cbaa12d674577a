"""attnkit's public ops. Each docstring is the op's specification; the float64 reference
in tests/python/reference.py restates it as code."""

import math

from . import _C
from ._arrays import empty_like_kind, kind_of, typed, typed_or_none, typed_output

_CAUSAL = {False: 0, None: 0, True: 1, "top_left": 1, "bottom_right": 2}
_LAYOUTS = ("BHSD", "BSHD")


def causal_code(causal) -> int:
    try:
        return _CAUSAL[causal]
    except (KeyError, TypeError):
        raise ValueError(
            f'causal must be False, True, "top_left" or "bottom_right", got {causal!r}') from None


def attention_shapes(q, k, v, layout):
    """(out shape, lse shape) for the given layout; the C++ op checks everything else."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be a 4-d tensor (layout {layout}), got "
                             f"{len(x.shape)}-d {list(x.shape)}")
    if layout == "BHSD":
        B, Hq, Sq, _ = q.shape
        return (B, Hq, Sq, v.shape[3]), (B, Hq, Sq)
    B, Sq, Hq, _ = q.shape
    return (B, Sq, Hq, v.shape[3]), (B, Hq, Sq)


def check_scalars(scale, dropout_p, seed, layout):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be a float or None, got {type(scale).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise ValueError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < 2**64):
        raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed!r}")
    if layout not in _LAYOUTS:
        raise ValueError(f'layout must be "BHSD" or "BSHD", got {layout!r}')


def window_pair(window):
    """(left, right) ints for window=None or a pair; the C++ op checks their values."""
    if window is None:
        return -1, -1
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) for w in window)):
        raise ValueError(f"window must be None or a pair (left, right) of ints, -1 meaning "
                         f"unbounded, got {window!r}")
    return int(window[0]), int(window[1])


def check_softcap(softcap):
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))):
        raise ValueError(f"softcap must be a float > 0 or None, got {type(softcap).__name__}")
    return None if softcap is None else float(softcap)


def run_attention(q, k, v, attn_mask, causal, scale, dropout_p, seed, enable_gqa, layout, out, lse,
                  window=(-1, -1), softcap=None, alibi_slopes=None, sinks=None):
    """Calls the kernel on validated kinds; out (and lse, if not None) are caller-owned."""
    _C.attention(typed(q, "q"), typed(k, "k"), typed(v, "v"), typed_output(out, "out"),
                 None if lse is None else typed_output(lse, "lse"),
                 typed_or_none(attn_mask, "attn_mask"), causal,
                 None if scale is None else float(scale), float(dropout_p), seed,
                 bool(enable_gqa), layout, window[0], window[1], softcap,
                 typed_or_none(alibi_slopes, "alibi_slopes"), typed_or_none(sinks, "sinks"))


def attention(q, k, v, *, attn_mask=None, causal=False, scale=None, dropout_p=0.0, seed=None,
              enable_gqa=False, layout="BHSD", return_lse=False, out=None, window=None,
              softcap=None, alibi_slopes=None, sinks=None):
    """Exact scaled dot-product attention with torch.nn.functional.scaled_dot_product_attention
    semantics, computed on the CPU without materialising the score matrix.

    Shapes (layout "BHSD"): q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv] ->
    out [B, Hq, Sq, Dv]. Layout "BSHD" swaps the head and sequence dims of all four.
    D and Dv are in [1, 512] and may differ. Any strides are accepted.

    - scores = (q · kᵀ) · scale, scale defaulting to 1/sqrt(D).
    - causal: False; True or "top_left" (query i sees keys j <= i); "bottom_right" (query i
      sees keys j <= i + Skv - Sq, FlashAttention's convention for a KV prefix).
    - attn_mask: bool (True = attend) or an additive float tensor, broadcastable to
      [B, Hq, Sq, Skv] in BHSD order whatever the layout. Mask and causal may combine.
    - GQA/MQA: with enable_gqa=True, Hq must be a multiple of Hkv and query head h reads kv
      head h // (Hq // Hkv). Hq != Hkv without enable_gqa is an error.
    - A query row with no attendable key gives out = 0 and lse = -inf.
    - Score modifiers (FlashAttention's conventions; they combine with each other, attn_mask,
      causal and GQA). Query i is aligned to key position a = i + Skv - Sq (bottom-right), or
      a = i with causal True / "top_left": the alignment the causal limit uses, and without
      causal FlashAttention's, so a KV-cache query sits at the end of its keys.
      window=(left, right), -1 meaning unbounded: query i sees keys j with
        a - left <= j <= a + right (under causal, right is moot). Key tiles wholly outside
        are skipped: a window costs O(Sq * window), not O(Sq * Skv).
      softcap=c (finite, > 0): s -> c * tanh(s / c), after the scale, before attn_mask and
        ALiBi (Gemma 2, Grok). tanh is vectorised, within 2 ulp in float32.
      alibi_slopes float32 [Hq] or [B, Hq]: adds -slope[b, h] * |a - j| to the scores
        (with causal, -slope * (a - j)).
      sinks float32 [Hq]: a per-head logit that joins the softmax denominator only
        (gpt-oss's learned sinks; the meaning of sparse MLA's attn_sink):
        out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[h] - m)), m the row
        max; +inf gives out = 0, -inf has no effect. As in sparse MLA, lse does not include
        the sink (lse = log sum_j e^(s_j)). A row that sees no key still gives out = 0 and
        lse = -inf. Slope and sink values are not checked (NaN propagates to the head).
    - dropout_p in [0, 1): after the softmax, each probability is kept with probability
      1 - dropout_p and scaled by 1/(1 - dropout_p). The keep decision is a counter-based
      (Philox4x32-10) function of (seed, b, h, i, j), so one seed gives bit-identical output
      for any thread count and ISA; seed=None draws a fresh seed for each call.
    - dtypes: q, k, v all float32, float16 or bfloat16; out has that dtype; softmax and
      accumulation run in float32. For bfloat16, P may be rounded to bfloat16 before P @ V
      (on CPUs with AVX512-BF16, as FlashAttention and torch do): each output then moves by
      at most 2^-8 * sum_j p_j |v_j| / sum_j p_j beyond the float32 computation. lse is
      float32 [B, Hq, Sq], natural log, over the visible keys (dropout does not change it).
    - Inputs are numpy arrays (bf16 through ml_dtypes) or CPU torch tensors, never copied
      or modified. out=, if given, must have the exact shape and dtype and not alias an input.
      torch tensors go through the registered op torch.ops.attnkit.attention, which
      torch.compile(fullgraph=True) can trace.

    Returns out, or (out, lse) with return_lse=True.
    """
    code = causal_code(causal)
    check_scalars(scale, dropout_p, seed, layout)
    window, softcap = window_pair(window), check_softcap(softcap)
    kind = kind_of(q, "q")
    for x, name in ((k, "k"), (v, "v"), (attn_mask, "attn_mask"), (out, "out"),
                    (alibi_slopes, "alibi_slopes"), (sinks, "sinks")):
        if (x is not None or name in ("k", "v")) and kind_of(x, name) != kind:
            raise ValueError(f"{name} must be a {kind} array like q, got {type(x).__name__}")
    if kind == "torch":
        from . import _torch_ops
        return _torch_ops.attention(q, k, v, attn_mask, code, scale, dropout_p, seed, enable_gqa,
                                    layout, return_lse, out, window=window, softcap=softcap,
                                    alibi_slopes=alibi_slopes, sinks=sinks)
    out_shape, lse_shape = attention_shapes(q, k, v, layout)
    if out is None:
        out = empty_like_kind("numpy", out_shape, typed(q, "q")[1])
    lse = empty_like_kind("numpy", lse_shape, "float32") if return_lse else None
    run_attention(q, k, v, attn_mask, code, scale, dropout_p, seed, enable_gqa, layout, out, lse,
                  window, softcap, alibi_slopes, sinks)
    return (out, lse) if return_lse else out
