"""DeepSeek-V3.2 sparse MLA prefill (bf16 and FP8 q8kv8) and the head-padding helpers."""

import numpy as np

from . import _C
from ._arrays import empty_like_kind, is_torch, kind_of, typed, typed_or_none, typed_output
from .ops import check_kinds, real_scalar

_QKV = "bfloat16 or float8_e4m3fn"

_SEMANTICS = """
    Shapes: q [s_q, h_q, d_qk] and kv [s_kv, h_kv=1, d_qk], both bfloat16 or both
    float8_e4m3fn; indices [s_q, h_kv, topk] int32; V is kv[..., :d_v]. Outputs: out
    [s_q, h_q, d_v] bfloat16, max_logits and lse [s_q, h_q] float32 (allocated when None;
    caller buffers must be contiguous, exactly shaped and typed, and alias nothing).

    For query row s and head h, slot t of indices[s, 0, :] is valid iff 0 <= idx < s_kv
    and, when topk_length is given, t < topk_length[s]. Invalid slots are never read (any
    int32 is safe); a duplicated index counts once per slot. All heads of a row share its
    slots. With dequantised values (fp8 value × its scale):
      logit(t)        = (q[s,h] · kv[idx, 0]) · sm_scale · q_scale · kv_scale
      max_logits[s,h] = max over valid t of logit(t)
      lse[s,h]        = log Σ_t exp(logit(t))            (natural log; no sink)
      out[s,h]        = Σ_t exp(logit(t) - m) · kv[idx, 0, :d_v] · kv_scale
                        / (Σ_t exp(logit(t) - m) + exp(attn_sink[h] - m))
    with m = max_logits[s,h] and the sink term only when attn_sink is given (+inf gives
    out = 0, -inf has no effect). A row with no valid slot gives out = 0, max_logits = -inf,
    lse = +inf, sink or not. topk_length and a -1 tail give bit-identical results.
    Softmax and both products accumulate in float32; where the CPU has vdpbf16ps P is
    rounded to bf16 before P·V, as FlashMLA's kernels do (SGLang's SM90 q8kv8 kernel rounds
    it to fp8; elsewhere it stays float32); out is rounded to bf16 once.
    NaN in q or in a valid kv row propagates to that row. Results are bit-identical run to
    run and for any thread count. Inputs: numpy arrays (ml_dtypes) or CPU torch tensors,
    never modified; torch tensors go through torch.ops.attnkit.*, outputs as mutated args.
"""


def _shapes(q, d_v):
    if len(q.shape) != 3:
        raise ValueError(f"q must be a 3-d tensor [s_q, h_q, d_qk], got {len(q.shape)}-d {list(q.shape)}")
    if isinstance(d_v, bool) or not isinstance(d_v, int):
        raise ValueError(f"d_v must be an int, got {type(d_v).__name__}")
    s_q, h_q, d_qk = q.shape
    if d_v < 0:  # an output that wide cannot be allocated (the op checks the range, after peers' checks)
        raise ValueError(f"d_v must be in [1, d_qk={d_qk}], got {d_v}")
    return (s_q, h_q, d_v), (s_q, h_q)


def _scale_array(x, name, kind, strict):
    """A float32 one-element array/tensor for a scale given as such, or (general op only)
    as a Python float."""
    if x is None or kind_of_or_none(x) is not None:
        return x
    if strict:
        raise ValueError(f"{name} must be a float32 tensor with one element, got {type(x).__name__}")
    x = real_scalar(x, name)
    if kind == "torch":
        import torch
        return torch.tensor([x], dtype=torch.float32)
    return np.array([x], dtype=np.float32)


def kind_of_or_none(x):
    if isinstance(x, np.ndarray):
        return "numpy"
    return "torch" if is_torch(x) else None


def run_sparse_mla(strict, q, kv, indices, sm_scale, d_v, q_scale, kv_scale, attn_sink, topk_length,
                   out, max_logits, lse):
    """Calls the kernel; every array argument is already of one kind and outputs exist."""
    fn = _C.sparse_mla_q8kv8_prefill_fwd if strict else _C.sparse_mla_prefill_fwd
    fn(typed(q, "q", _QKV), typed(kv, "kv", _QKV), typed(indices, "indices", "int32"), sm_scale, d_v,
       typed_or_none(q_scale, "q_scale", "float32"), typed_or_none(kv_scale, "kv_scale", "float32"),
       typed_or_none(attn_sink, "attn_sink", "float32"), typed_or_none(topk_length, "topk_length", "int32"),
       typed_output(out, "out", "bfloat16"), typed_output(max_logits, "max_logits", "float32"),
       typed_output(lse, "lse", "float32"))


def _call(strict, q, kv, indices, sm_scale, d_v, q_scale, kv_scale, attn_sink, topk_length, out,
          max_logits, lse):
    sm_scale = real_scalar(sm_scale, "sm_scale")
    kind = kind_of(q, "q")
    q_scale = _scale_array(q_scale, "q_scale", kind, strict)
    kv_scale = _scale_array(kv_scale, "kv_scale", kind, strict)
    named = (("kv", kv), ("indices", indices), ("q_scale", q_scale), ("kv_scale", kv_scale),
             ("attn_sink", attn_sink), ("topk_length", topk_length), ("out", out),
             ("max_logits", max_logits), ("lse", lse))
    check_kinds(kind, named, ("kv", "indices"))
    out_shape, stat_shape = _shapes(q, d_v)
    if out is None:
        out = empty_like_kind(kind, out_shape, "bfloat16")
    if max_logits is None:
        max_logits = empty_like_kind(kind, stat_shape, "float32")
    if lse is None:
        lse = empty_like_kind(kind, stat_shape, "float32")
    args = (q, kv, indices, sm_scale, d_v, q_scale, kv_scale, attn_sink, topk_length, out,
            max_logits, lse)
    if kind == "torch":
        from . import _torch_ops
        _torch_ops.sparse_mla(strict, *args)
    else:
        run_sparse_mla(strict, *args)
    return out, max_logits, lse


def sparse_mla_prefill_fwd(q, kv, indices, sm_scale, d_v=512, *, q_scale=None, kv_scale=None,
                           attn_sink=None, topk_length=None, out=None, max_logits=None, lse=None):
    return _call(False, q, kv, indices, sm_scale, d_v, q_scale, kv_scale, attn_sink, topk_length,
                 out, max_logits, lse)


def sparse_mla_q8kv8_prefill_fwd(q, kv, indices, sm_scale, q_scale, kv_scale, d_v=512, attn_sink=None,
                                 topk_length=None, *, out=None, max_logits=None, lse=None):
    return _call(True, q, kv, indices, sm_scale, d_v, q_scale, kv_scale, attn_sink, topk_length, out,
                 max_logits, lse)


sparse_mla_prefill_fwd.__doc__ = """Sparse MLA prefill, the general op: any h_q >= 1 (padded
    internally), any topk >= 1, any d_qk >= d_v >= 1, strided inputs. For fp8, q_scale and
    kv_scale (float32 scalars: a 0-d or 1-element array/tensor, or a Python float) are
    required; for bf16 they default to 1. attn_sink float32 [h_q] and topk_length int32
    [s_q] are each optional. Returns (out, max_logits, lse).
""" + _SEMANTICS

sparse_mla_q8kv8_prefill_fwd.__doc__ = """SGLang's sparse_mla_q8kv8_prefill_fwd contract, so code
    written against it runs unchanged: fp8 e4m3fn q and kv; h_q a positive multiple of 64
    (else "sparse_mla_q8kv8_prefill_fwd requires h_q padded to a positive multiple of 64,
    got 43"; use attnkit.pad_heads, or the general op, which pads internally); h_kv = 1;
    d_qk 512 or 576; d_v = 512; topk a positive multiple of 128; q, kv, indices contiguous;
    q_scale, kv_scale float32 one-element tensors; attn_sink only with topk_length;
    0 <= topk_length <= topk. Returns (out, max_logits, lse).
""" + _SEMANTICS


def pad_heads(x, multiple, dim=1):
    """x with dim `dim` zero-padded up to the next multiple of `multiple` (x's kind)."""
    kind = kind_of(x, "x")
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple must be a positive int, got {multiple!r}")
    if not -len(x.shape) <= dim < len(x.shape):
        raise ValueError(f"dim must be in [{-len(x.shape)}, {len(x.shape)}), got {dim}")
    h = x.shape[dim]
    extra = -h % multiple
    if extra == 0 and h > 0:
        return x
    if h == 0:
        extra = multiple
    shape = list(x.shape)
    shape[dim] = extra
    if kind == "torch":
        import torch
        return torch.cat([x, x.new_zeros(shape)], dim=dim)
    return np.concatenate([x, np.zeros(shape, dtype=x.dtype)], axis=dim)


def unpad_heads(x, h, dim=1):
    """The first h entries of dim `dim` of x (a view)."""
    kind_of(x, "x")
    if not -len(x.shape) <= dim < len(x.shape):
        raise ValueError(f"dim must be in [{-len(x.shape)}, {len(x.shape)}), got {dim}")
    if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= x.shape[dim]:
        raise ValueError(f"h must be an int in [0, {x.shape[dim]}], got {h!r}")
    index = [slice(None)] * len(x.shape)
    index[dim] = slice(0, h)
    return x[tuple(index)]
