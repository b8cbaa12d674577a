"""attnkit.attention_backward: the gradients of attnkit.attention (numpy and torch arrays).

Torch autograd uses it through python/attnkit/_torch_backward.py; the C++ op
(src/ops/attention_backward.cpp) checks every argument.
"""

from . import _C
from ._arrays import FLOAT, MASK, dtype_name, empty_like_kind, kind_of, typed, typed_or_none, typed_output
from .ops import causal_code, check_scalars, check_softcap, flag, window_pair


def run_attention_backward(q, k, v, out, lse, dout, attn_mask, causal, scale, dropout_p, seed,
                           enable_gqa, layout, dq, dk, dv, dlse=None, window=(-1, -1), softcap=None,
                           alibi_slopes=None, sinks=None, dsinks=None):
    """Calls the kernel on validated kinds; dq, dk, dv (and dsinks) are caller-owned."""
    _C.attention_backward(typed(q, "q"), typed(k, "k"), typed(v, "v"), typed(out, "out"),
                          typed(lse, "lse", "float32"), typed(dout, "dout"), typed_output(dq, "dq"),
                          typed_output(dk, "dk"), typed_output(dv, "dv"), typed_or_none(dlse, "dlse", "float32"),
                          typed_or_none(attn_mask, "attn_mask", MASK), causal,
                          None if scale is None else float(scale), float(dropout_p), seed,
                          bool(enable_gqa), layout, window[0], window[1], softcap,
                          typed_or_none(alibi_slopes, "alibi_slopes", "float32"),
                          typed_or_none(sinks, "sinks", "float32"),
                          None if dsinks is None else typed_output(dsinks, "dsinks"))


def attention_backward(q, k, v, out, lse, dout, *, attn_mask=None, causal=False, scale=None,
                       dropout_p=0.0, seed=None, enable_gqa=False, layout="BHSD", dlse=None,
                       dq=None, dk=None, dv=None, window=None, softcap=None, alibi_slopes=None,
                       sinks=None, dsinks=None):
    """Gradients (dq, dk, dv) of attnkit.attention at (q, k, v), given its out and lse
    (``attention(..., return_lse=True)``) and dout, the gradient of out; with sinks,
    (dq, dk, dv, dsinks), dsinks the float32 [Hq] gradient of the sink logits.

    The keyword arguments must be the forward's (the same mask, causal mode, scale, GQA,
    layout and score modifiers: window, softcap, alibi_slopes, sinks; ALiBi slopes get no
    gradient); with dropout_p > 0, seed is required and must be the forward's seed, so that
    the same keep mask is regenerated. dlse, if given, is the gradient of lse (float32
    [B, Hq, Sq]); None means zero. The mask gets no gradient. dq, dk, dv, if given, must
    have the shapes and dtype of q, k, v and not alias any input; they are allocated
    otherwise (dsinks likewise). Gradients are accumulated in float32, rounded once to the input dtype, and
    are bit-identical for any thread count.

    The math (FlashAttention-2): P = exp(q·kᵀ·scale + mask - lse) (times keep/(1-p) with
    dropout), D = rowsum(dout ∘ out) - dlse, dv = Pᵀ·dout, dS = P ∘ (dout·vᵀ - D),
    dq = dS·k·scale, dk = dSᵀ·q·scale; with GQA, dk and dv are summed over each group.
    With the soft-cap dS is multiplied by 1 - tanh²(s/c); with sinks, P carries the sink's
    share of the denominator and dsinks[h] = -Σ_(b,i) P_sink(b, h, i)·D(b, h, i).

    Limits (as FlashAttention's and torch's flash backward): P is rebuilt from the float32
    lse alone, so where lse = m + log(l) cannot hold log(l) (|m| far beyond log(l)·2^24, e.g.
    a row whose every key is masked by -1e30 or finfo.min instead of False / -inf) that row's
    P, and its gradients, are up to l times too large; and at scores of magnitude ~1e5 and
    beyond, exp's argument S·scale - lse loses precision (1e8: P off by a large factor).
    """
    code = causal_code(causal)
    enable_gqa = flag(enable_gqa, "enable_gqa")
    scale, dropout_p = check_scalars(scale, dropout_p, seed, layout)
    kind = kind_of(q, "q")
    optional = ("attn_mask", "dlse", "dq", "dk", "dv", "alibi_slopes", "sinks", "dsinks")
    for x, name in ((k, "k"), (v, "v"), (out, "out"), (lse, "lse"), (dout, "dout"),
                    (attn_mask, "attn_mask"), (dlse, "dlse"), (dq, "dq"), (dk, "dk"), (dv, "dv"),
                    (alibi_slopes, "alibi_slopes"), (sinks, "sinks"), (dsinks, "dsinks")):
        if x is None and name in optional:
            continue
        if kind_of(x, name) != kind:
            what = "tensor" if kind == "torch" else "array"
            raise ValueError(f"{name} must be a {kind} {what} like q, got {type(x).__name__}")
    dtype = dtype_name(q, "q", FLOAT)
    dq = empty_like_kind(kind, tuple(q.shape), dtype) if dq is None else dq
    dk = empty_like_kind(kind, tuple(k.shape), dtype) if dk is None else dk
    dv = empty_like_kind(kind, tuple(v.shape), dtype) if dv is None else dv
    window, softcap = window_pair(window), check_softcap(softcap)
    if sinks is not None and dsinks is None:
        dsinks = empty_like_kind(kind, (int(sinks.shape[0]) if len(sinks.shape) else 0,), "float32")
    run_attention_backward(q, k, v, out, lse, dout, attn_mask, code, scale, dropout_p, seed,
                           enable_gqa, layout, dq, dk, dv, dlse, window, softcap, alibi_slopes, sinks,
                           dsinks)
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)
