"""The serving ops registered with torch.library (define + impl + register_fake), so that
torch.compile(fullgraph=True) traces them: varlen and paged attention (functional, and _out
forms writing caller buffers) and append_kv_cache (mutates the caches). The functional
varlen op has a backward (attnkit::varlen_attention_backward, through
torch.library.register_autograd; its modifiers are positional so that sinks get a gradient);
the others refuse inputs that require grad."""

import torch

from ._torch_ops import _MODS, check_no_grad, register_grad_refusal  # _MODS: the score modifiers' schema
from .serving import _packed_out_shapes, run_append, run_paged, run_varlen, run_varlen_backward

_LIB = torch.library.Library("attnkit", "FRAGMENT")

_VARLEN = ("Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q, "
           "int? max_seqlen_k, bool causal, float? scale")
_PAGED = ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, Tensor cu_seqlens_q, "
          "Tensor? k_scale, Tensor? v_scale, bool causal, float? scale")
_LIB.define(f"varlen_attention({_VARLEN}, {_MODS}) -> (Tensor, Tensor)")
_LIB.define(f"varlen_attention_backward({_VARLEN}, Tensor out, Tensor lse, Tensor dout, Tensor? dlse, {_MODS}) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define(f"varlen_attention_out({_VARLEN}, Tensor(a!) out, Tensor(b!)? lse, *, {_MODS}) -> ()")
_LIB.define(f"paged_attention({_PAGED}, *, {_MODS}) -> (Tensor, Tensor)")
_LIB.define(f"paged_attention_out({_PAGED}, Tensor(a!) out, Tensor(b!)? lse, *, {_MODS}) -> ()")
_LIB.define("append_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
            "Tensor? k_scale, Tensor? v_scale) -> ()")


def _new_outputs(q, v, name_v, fake):
    out_shape, lse_shape = _packed_out_shapes(q, v, name_v)
    if fake:
        return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)
    return torch.empty(out_shape, dtype=q.dtype), torch.empty(lse_shape, dtype=torch.float32)


def _mods(window_left=-1, window_right=-1, softcap=None, alibi_slopes=None, sinks=None):
    """The ops' modifier keywords as serving.py's (window, softcap, alibi_slopes, sinks)."""
    return (window_left, window_right), softcap, alibi_slopes, sinks


def _keywords(mods):
    (left, right), softcap, alibi_slopes, sinks = mods
    return dict(window_left=left, window_right=right, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)


def _varlen_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, *mods, **kw_mods):
    out, lse = _new_outputs(q, v, "v", fake=False)
    run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, out, lse, _mods(*mods, **kw_mods))
    return out, lse


def _varlen_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, *mods, **kw_mods):
    return _new_outputs(q, v, "v", fake=True)


def _varlen_out_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, out, lse, **mods):
    run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, out, lse, _mods(**mods))


def _varlen_backward_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, out, lse, dout, dlse, *mods, **kw_mods):
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
    mods = _mods(*mods, **kw_mods)
    sinks = mods[3]
    dsinks = torch.empty(0 if sinks is None else sinks.shape[0], dtype=torch.float32)
    run_varlen_backward(q, k, v, cu_q, cu_k, out, lse, dout, dq, dk, dv, dlse, max_q, max_k, causal, scale, mods,
                        None if sinks is None else dsinks)
    return dq, dk, dv, dsinks


def _varlen_backward_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, out, lse, dout, dlse, *mods, **kw_mods):
    sinks = _mods(*mods, **kw_mods)[3]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((0 if sinks is None else sinks.shape[0],), dtype=torch.float32))


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, alibi_slopes, sinks = inputs
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise ValueError("attnkit.varlen_attention computes no gradient for alibi_slopes, got slopes that "
                         "require grad")
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, alibi_slopes, sinks)
    ctx.args = (max_q, max_k, causal, scale, left, right, softcap)


def _varlen_backward(ctx, dout, dlse):
    q, k, v, cu_q, cu_k, out, lse, alibi_slopes, sinks = ctx.saved_tensors
    max_q, max_k, causal, scale, left, right, softcap = ctx.args
    # Autograd materialises both gradients (zeros for an unused lse).
    dq, dk, dv, dsinks = torch.ops.attnkit.varlen_attention_backward(
        q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, out, lse, dout, dlse, left, right, softcap,
        alibi_slopes, sinks)
    return (dq, dk, dv) + (None,) * 10 + (dsinks if sinks is not None and ctx.needs_input_grad[13] else None,)


def _paged_impl(q, k_cache, v_cache, block_table, seq_lens, cu_q, k_scale, v_scale, causal, scale, **mods):
    out, lse = _new_outputs(q, v_cache, "v_cache", fake=False)
    run_paged(q, k_cache, v_cache, block_table, seq_lens, cu_q, k_scale, v_scale, causal, scale, out, lse,
              _mods(**mods))
    return out, lse


def _paged_fake(q, k_cache, v_cache, block_table, seq_lens, cu_q, k_scale, v_scale, causal, scale, **mods):
    return _new_outputs(q, v_cache, "v_cache", fake=True)


def _paged_out_impl(q, k_cache, v_cache, block_table, seq_lens, cu_q, k_scale, v_scale, causal, scale, out, lse,
                    **mods):
    run_paged(q, k_cache, v_cache, block_table, seq_lens, cu_q, k_scale, v_scale, causal, scale, out, lse,
              _mods(**mods))


def _nothing(*args, **kwargs):
    return None


for _name, _impl, _fake in (("varlen_attention", _varlen_impl, _varlen_fake),
                            ("varlen_attention_backward", _varlen_backward_impl, _varlen_backward_fake),
                            ("varlen_attention_out", _varlen_out_impl, _nothing),
                            ("paged_attention", _paged_impl, _paged_fake),
                            ("paged_attention_out", _paged_out_impl, _nothing),
                            ("append_kv_cache", run_append, _nothing)):
    _LIB.impl(_name, _impl, "CPU")
    torch.library.register_fake(f"attnkit::{_name}", _fake, lib=_LIB)
    if _name == "varlen_attention":
        torch.library.register_autograd("attnkit::varlen_attention", _varlen_backward,
                                        setup_context=_varlen_setup_context, lib=_LIB)
    elif _name != "varlen_attention_backward":
        register_grad_refusal(_name, _LIB)


def varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, out, mods):
    """The torch path of attnkit.varlen_attention (arguments already checked for kind)."""
    kw = _keywords(mods)
    if out is None:
        out, lse = torch.ops.attnkit.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, **kw)
        return (out, lse) if return_lse else out
    # varlen_attention_out writes a caller's buffer: no autograd
    check_no_grad("attnkit.varlen_attention with out=", (("q", q), ("k", k), ("v", v), ("sinks", kw["sinks"])))
    lse = torch.empty(_packed_out_shapes(q, v, "v")[1], dtype=torch.float32) if return_lse else None
    torch.ops.attnkit.varlen_attention_out(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, out, lse, **kw)
    return (out, lse) if return_lse else out


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, k_scale, v_scale, causal, scale, return_lse,
                    out, mods):
    """The torch path of attnkit.paged_attention (arguments already checked for kind)."""
    args = (q, k_cache, v_cache, block_table, seq_lens, cu_q, k_scale, v_scale, causal, scale)
    kw = _keywords(mods)
    if out is None:
        out, lse = torch.ops.attnkit.paged_attention(*args, **kw)
        return (out, lse) if return_lse else out
    lse = torch.empty(_packed_out_shapes(q, v_cache, "v_cache")[1], dtype=torch.float32) if return_lse else None
    torch.ops.attnkit.paged_attention_out(*args, out, lse, **kw)
    return (out, lse) if return_lse else out


def append_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """The torch path of attnkit.append_kv_cache."""
    torch.ops.attnkit.append_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
