"""attnkit's public ops. Each docstring is the op's specification; the float64 reference
in tests/python/reference.py restates it as code."""

import numbers

import numpy as np

from . import _C
from ._arrays import (FLOAT, MASK, _torch, dtype_name, empty_like_kind, is_torch, kind_of, typed,
                      typed_or_none, typed_output)

_CAUSAL_NAMES = {"top_left": 1, "bottom_right": 2}
_LAYOUTS = ("BHSD", "BSHD")


def flag(x, name: str) -> bool:
    """A bool argument: True/False (numpy's np.bool_ too); anything else is a ValueError, so
    that "yes", 1 or a tensor never means True by accident."""
    if x is False or x is True:
        return x
    if isinstance(x, np.bool_):
        return bool(x)
    raise ValueError(f"{name} must be True or False, got {x!r}")


def causal_code(causal) -> int:
    if causal is False or causal is None:
        return 0
    if causal is True or isinstance(causal, (bool, np.bool_)):
        return int(bool(causal))
    if isinstance(causal, str) and causal in _CAUSAL_NAMES:
        return _CAUSAL_NAMES[causal]
    raise ValueError(f'causal must be False, True, "top_left" or "bottom_right", got {causal!r}')


def _is_real_array(x) -> bool:
    """A numpy array or tensor holding one real (not bool, not complex) number."""
    if x.ndim > 1 or (x.ndim == 1 and x.shape[0] != 1):
        return False
    if is_torch(x):
        return not x.dtype.is_complex and x.dtype is not _torch().bool
    return x.dtype.kind in "iuf"


def real_scalar(x, name: str) -> float:
    """A scale as a Python float: an int, a float, a numpy real scalar, or a 0-d (or
    one-element) numpy array or tensor of a real dtype. Bools, strings and the rest are a
    ValueError, and so is a number past float's range (10**400), never an OverflowError."""
    if type(x) is float:  # the common case, first: this is on every call's path
        return x
    value = x
    if isinstance(x, np.ndarray) or is_torch(x):
        if not _is_real_array(x):
            raise ValueError(f"{name} must be a float, got a {type(x).__name__} of dtype {x.dtype} "
                             f"and shape {list(x.shape)}")
        value = x.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a float, got {type(x).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a float, got {value!r}, past float's range") from None


def check_scalars(scale, dropout_p, seed, layout):
    """(scale or None, dropout_p) as floats; every argument checked."""
    scale = None if scale is None else real_scalar(scale, "scale")
    dropout_p = real_scalar(dropout_p, "dropout_p")
    if seed is not None and (isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral)
                             or not 0 <= seed < 2**64):
        raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed!r}")
    if layout not in _LAYOUTS:
        raise ValueError(f'layout must be "BHSD" or "BSHD", got {layout!r}')
    return scale, dropout_p


_torch_ops = None


def torch_ops():
    """attnkit._torch_ops, imported on the first torch call (it imports torch); kept in a
    global since an import statement costs about a microsecond on every call. A trace
    (torch.compile) imports it instead: reading the global there made dynamo guard on its
    value, and the first compiled call, which sets it, recompiled the caller."""
    global _torch_ops
    if _torch().compiler.is_compiling():
        from . import _torch_ops as module
        return module
    if _torch_ops is None:
        from . import _torch_ops as module
        _torch_ops = module
    return _torch_ops


def check_kinds(kind, named, required=()):
    """Every (name, array) in named is of q's kind; None only for names not in required."""
    for name, x in named:
        if (x is not None or name in required) and kind_of(x, name) != kind:
            what = "tensor" if kind == "torch" else "array"
            raise ValueError(f"{name} must be a {kind} {what} like q, got {type(x).__name__}")


def attention_shapes(q, k, v, layout):
    """(out shape, lse shape) for the given layout; the C++ op checks everything else."""
    return shapes_of(q.shape, k.shape, v.shape, layout)


def shapes_of(q_shape, k_shape, v_shape, layout):
    """attention_shapes() from the three shapes."""
    for shape, name in ((q_shape, "q"), (k_shape, "k"), (v_shape, "v")):
        if len(shape) != 4:
            raise ValueError(f"{name} must be a 4-d tensor (layout {layout}), got "
                             f"{len(shape)}-d {list(shape)}")
    if layout == "BHSD":
        B, Hq, Sq, _ = q_shape
        return (B, Hq, Sq, v_shape[3]), (B, Hq, Sq)
    B, Sq, Hq, _ = q_shape
    return (B, Sq, Hq, v_shape[3]), (B, Hq, Sq)


def window_pair(window):
    """(left, right) ints for window=None or a pair; the C++ op checks their values."""
    if window is None:
        return -1, -1
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral) for w in window)):
        raise ValueError(f"window must be None or a pair (left, right) of ints, -1 meaning "
                         f"unbounded, got {window!r}")
    if not all(-2**63 <= w < 2**63 for w in window):
        raise ValueError(f"window must be a pair of ints that fit int64, got {window!r}")
    return int(window[0]), int(window[1])


def check_softcap(softcap):
    """softcap as a float or None (the C++ op checks that it is finite and > 0)."""
    if softcap is None:
        return None
    try:
        return real_scalar(softcap, "softcap")
    except ValueError:
        raise ValueError(f"softcap must be a float > 0 or None, got {softcap!r}") from None


def run_attention(q, k, v, attn_mask, causal, scale, dropout_p, seed, enable_gqa, layout, out, lse,
                  window=(-1, -1), softcap=None, alibi_slopes=None, sinks=None):
    """Calls the kernel on validated kinds and scalars; out (and lse, if not None) are
    caller-owned."""
    _C.attention(typed(q, "q"), typed(k, "k"), typed(v, "v"), typed_output(out, "out"),
                 None if lse is None else typed_output(lse, "lse", "float32"),
                 typed_or_none(attn_mask, "attn_mask", MASK), causal, scale, dropout_p,
                 None if seed is None else int(seed), enable_gqa, layout, window[0], window[1], softcap,
                 typed_or_none(alibi_slopes, "alibi_slopes", "float32"), typed_or_none(sinks, "sinks", "float32"))


def attention(q, k, v, *, attn_mask=None, causal=False, scale=None, dropout_p=0.0, seed=None,
              enable_gqa=False, layout="BHSD", return_lse=False, out=None, window=None,
              softcap=None, alibi_slopes=None, sinks=None):
    """Exact scaled dot-product attention with torch.nn.functional.scaled_dot_product_attention
    semantics, computed on the CPU without materialising the score matrix.

    Shapes (layout "BHSD"): q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv] ->
    out [B, Hq, Sq, Dv]. Layout "BSHD" swaps the head and sequence dims of all four.
    D and Dv are in [1, 512] and may differ. Any strides are accepted.

    - scores = (q · kᵀ) · scale, scale defaulting to 1/sqrt(D).
    - causal: False (or None); True or "top_left" (query i sees keys j <= i); "bottom_right"
      (query i sees keys j <= i + Skv - Sq, FlashAttention's convention for a KV prefix).
    - attn_mask: bool (True = attend) or an additive float tensor, broadcastable to
      [B, Hq, Sq, Skv] in BHSD order whatever the layout. Mask and causal may combine.
    - GQA/MQA: with enable_gqa=True, Hq must be a multiple of Hkv and query head h reads kv
      head h // (Hq // Hkv). Hq != Hkv without enable_gqa is an error.
    - A query row with no attendable key gives out = 0 and lse = -inf.
    - Most paths multiply q by scale before Q·Kᵀ: where |q|·|scale| exceeds float32's range
      (3.4e38) the row is NaN even if (q·kᵀ)·scale is finite.
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
      Under torch.compile, torch tensors go through the registered op
      torch.ops.attnkit.attention (traced with fullgraph=True); eager calls on plain tensors
      call the kernel directly, the same computation without the dispatcher's cost.
    - scale and dropout_p: a Python or numpy number, or a 0-d tensor / array. Flags
      (enable_gqa, return_lse) are bools, causal as above: anything else is a ValueError.
    - Autograd: torch inputs q, k, v (and sinks) that require grad get gradients from
      attnkit's backward (attnkit.attention_backward; dropout then needs a seed), score
      modifiers included. out=, a mask or ALiBi slopes that require grad have no backward:
      a ValueError with grad mode on.

    Returns out, or (out, lse) with return_lse=True.
    """
    code = causal_code(causal)
    scale, dropout_p = check_scalars(scale, dropout_p, seed, layout)
    enable_gqa = flag(enable_gqa, "enable_gqa")
    return_lse = flag(return_lse, "return_lse")
    kind = kind_of(q, "q")
    check_kinds(kind, (("k", k), ("v", v), ("attn_mask", attn_mask), ("out", out),
                       ("alibi_slopes", alibi_slopes), ("sinks", sinks)), ("k", "v"))
    window, softcap = window_pair(window), check_softcap(softcap)
    if kind == "torch":
        return torch_ops().attention(q, k, v, attn_mask, code, scale, dropout_p, seed, enable_gqa,
                                     layout, return_lse, out, window, softcap, alibi_slopes, sinks)
    out_shape, lse_shape = attention_shapes(q, k, v, layout)
    if out is None:
        out = empty_like_kind("numpy", out_shape, dtype_name(q, "q", FLOAT))
    lse = empty_like_kind("numpy", lse_shape, "float32") if return_lse else None
    run_attention(q, k, v, attn_mask, code, scale, dropout_p, seed, enable_gqa, layout, out, lse,
                  window, softcap, alibi_slopes, sinks)
    return (out, lse) if return_lse else out
