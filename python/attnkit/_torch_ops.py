"""attnkit's ops registered with torch.library (define + impl + register_fake), so that
torch.compile(fullgraph=True) traces them and torch.library.opcheck passes.

attnkit::attention is functional; attnkit::attention_out writes caller buffers (mutated
arguments). Seeds travel as int64 (two's complement of the uint64 seed); None means a fresh
seed drawn at run time, never at trace time.

attnkit::attention has a backward (_torch_backward, registered when this module loads), and
so has the functional varlen op (_torch_serving); every other op's Autograd kernel refuses
an input that requires grad while grad mode is on (a ValueError naming it), instead of
torch's default of a warning and a None gradient. Eager calls of attnkit.attention on plain tensors skip the dispatcher and
call the kernel directly (the dispatcher and a Python kernel cost ~20 us a call); under
torch.compile, tensor subclasses or dispatch modes the registered op runs as before.
"""

import torch

from . import _C
from ._arrays import MASK, typed, typed_or_none
from .ops import attention_shapes, run_attention, shapes_of
from .sage import run_sage
from .sparse_mla import run_sparse_mla

_LIB = torch.library.Library("attnkit", "DEF")
_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor? attn_mask, int causal, float? scale, "
         "float dropout_p, int? seed, bool enable_gqa, str layout")
# The score modifiers, defaulted (window -1: unbounded); positional, not keyword-only, since
# torch.library.register_autograd takes no keyword-only tensors.
_MODS = ("int window_left=-1, int window_right=-1, float? softcap=None, Tensor? alibi_slopes=None, "
         "Tensor? sinks=None")
_LIB.define(f"attention({_ARGS}, {_MODS}) -> (Tensor, Tensor)")
_LIB.define(f"attention_out({_ARGS}, Tensor(a!) out, Tensor(b!)? lse, {_MODS}) -> ()")


def _seed_to_op(seed):
    if seed is None:
        return None
    seed = int(seed)  # a numpy uint64 would wrap in the subtraction
    return seed - 2**64 if seed >= 2**63 else seed


def _seed_from_op(seed):
    return None if seed is None else seed % 2**64


def check_no_grad(op_name, named):
    """ValueError if grad mode is on and a tensor in named ((name, value) pairs) requires
    grad: attnkit has no backward yet, and torch would otherwise leave its grad None."""
    if not torch.is_grad_enabled():
        return
    for name, x in named:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise ValueError(
                f"{op_name} has no backward yet, and {name} requires grad: call it under "
                f"torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")


def eager(tensors) -> bool:
    """Whether a call may skip the dispatcher: not tracing, no dispatch mode active, and
    every tensor a plain torch.Tensor (subclasses such as FakeTensor need the dispatcher)
    without the lazy negation bit (the dispatcher materialises it; the kernel reads memory).
    is_compiling() comes first: under dynamo it is True and the rest is never traced."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or t.is_neg()):
            return False
    return True


def _attention_impl(q, k, v, attn_mask, causal, scale, dropout_p, seed, enable_gqa, layout,
                    window_left=-1, window_right=-1, softcap=None, alibi_slopes=None, sinks=None):
    out_shape, lse_shape = attention_shapes(q, k, v, layout)
    out = q.new_empty(out_shape)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    run_attention(q, k, v, attn_mask, causal, scale, dropout_p, _seed_from_op(seed), enable_gqa,
                  layout, out, lse, (window_left, window_right), softcap, alibi_slopes, sinks)
    return out, lse


def _attention_fake(q, k, v, attn_mask, causal, scale, dropout_p, seed, enable_gqa, layout, *mods, **kw_mods):
    out_shape, lse_shape = attention_shapes(q, k, v, layout)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


def _attention_out_impl(q, k, v, attn_mask, causal, scale, dropout_p, seed, enable_gqa, layout,
                        out, lse, window_left=-1, window_right=-1, softcap=None,
                        alibi_slopes=None, sinks=None):
    run_attention(q, k, v, attn_mask, causal, scale, dropout_p, _seed_from_op(seed), enable_gqa,
                  layout, out, lse, (window_left, window_right), softcap, alibi_slopes, sinks)


def _attention_out_fake(q, k, v, attn_mask, causal, scale, dropout_p, seed, enable_gqa, layout,
                        out, lse, *mods, **kw_mods):
    return None


_SPARSE_ARGS = ("Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? q_scale, "
                "Tensor? kv_scale, Tensor? attn_sink, Tensor? topk_length, Tensor(a!) out, "
                "Tensor(b!) max_logits, Tensor(c!) lse")
_LIB.define(f"sparse_mla_prefill_fwd({_SPARSE_ARGS}) -> ()")
_LIB.define(f"sparse_mla_q8kv8_prefill_fwd({_SPARSE_ARGS}) -> ()")


def _sparse_impl(strict):
    def impl(q, kv, indices, sm_scale, d_v, q_scale, kv_scale, attn_sink, topk_length, out, max_logits,
             lse):
        run_sparse_mla(strict, q, kv, indices, sm_scale, d_v, q_scale, kv_scale, attn_sink,
                       topk_length, out, max_logits, lse)
    return impl


def _sparse_fake(q, kv, indices, sm_scale, d_v, q_scale, kv_scale, attn_sink, topk_length, out,
                 max_logits, lse):
    return None


for _name, _strict in (("sparse_mla_prefill_fwd", False), ("sparse_mla_q8kv8_prefill_fwd", True)):
    _LIB.impl(_name, _sparse_impl(_strict), "CPU")
    torch.library.register_fake(f"attnkit::{_name}", _sparse_fake, lib=_LIB)


def sparse_mla(strict, *args):
    """The torch path of the sparse MLA ops (arguments already checked for kind)."""
    op = torch.ops.attnkit.sparse_mla_q8kv8_prefill_fwd if strict else torch.ops.attnkit.sparse_mla_prefill_fwd
    op(*args)


_LIB.define("sage_attention(Tensor q, Tensor k, Tensor v, int causal, float? scale, str layout, "
            f"str mode, *, {_MODS}, Tensor? attn_mask=None, Tensor? kv_lens=None) -> (Tensor, Tensor)")


def _sage_impl(q, k, v, causal, scale, layout, mode, *, window_left=-1, window_right=-1,
               softcap=None, alibi_slopes=None, sinks=None, attn_mask=None, kv_lens=None):
    out_shape, lse_shape = attention_shapes(q, k, v, layout)
    out = q.new_empty(out_shape)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    run_sage(q, k, v, causal, scale, layout, mode, out, lse, (window_left, window_right), softcap,
             alibi_slopes, sinks, attn_mask, kv_lens)
    return out, lse


def _sage_fake(q, k, v, causal, scale, layout, mode, **mods):
    out_shape, lse_shape = attention_shapes(q, k, v, layout)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


_LIB.impl("sage_attention", _sage_impl, "CPU")
torch.library.register_fake("attnkit::sage_attention", _sage_fake, lib=_LIB)


def sage_attention(q, k, v, causal, scale, layout, mode, window=(-1, -1), softcap=None,
                   alibi_slopes=None, sinks=None, attn_mask=None, kv_lens=None):
    """The torch path of attnkit.sage_attention: (out, lse)."""
    return torch.ops.attnkit.sage_attention(q, k, v, causal, scale, layout, mode,
                                            **_mods(window, softcap, alibi_slopes, sinks),
                                            attn_mask=attn_mask, kv_lens=kv_lens)


def _mods(window, softcap, alibi_slopes, sinks):
    """The modifier keywords of the ops' schemas."""
    return dict(window_left=window[0], window_right=window[1], softcap=softcap,
                alibi_slopes=alibi_slopes, sinks=sinks)


_LIB.impl("attention", _attention_impl, "CPU")
_LIB.impl("attention_out", _attention_out_impl, "CPU")
torch.library.register_fake("attnkit::attention", _attention_fake, lib=_LIB)
torch.library.register_fake("attnkit::attention_out", _attention_out_fake, lib=_LIB)


def register_grad_refusal(op_name, lib=_LIB):
    """Makes torch.ops.attnkit.<op_name> refuse inputs that require grad (check_no_grad) in
    its Autograd kernel; `lib` is the library (fragment) that defined the op."""
    op = getattr(torch.ops.attnkit, op_name).default
    names = [a.name for a in op._schema.arguments]

    def kernel(keyset, *args, **kwargs):
        check_no_grad(f"torch.ops.attnkit.{op_name}", list(zip(names, args)) + list(kwargs.items()))
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    lib.impl(op_name, kernel, "Autograd", with_keyset=True)


# attnkit::attention has a backward (_torch_backward, installed at the end of this module);
# the others refuse inputs that require grad.
for _name in ("attention_out", "sage_attention", "sparse_mla_prefill_fwd", "sparse_mla_q8kv8_prefill_fwd"):
    register_grad_refusal(_name)


def attention(q, k, v, attn_mask, causal, scale, dropout_p, seed, enable_gqa, layout, return_lse,
              out, window=(-1, -1), softcap=None, alibi_slopes=None, sinks=None):
    """The torch path of attnkit.attention (arguments already checked for kind and value)."""
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                              or (sinks is not None and sinks.requires_grad))
    if needs_grad and out is not None:  # attention_out writes a caller's buffer: no autograd
        check_no_grad("attnkit.attention with out=", (("q", q), ("k", k), ("v", v), ("sinks", sinks)))
    if eager((q, k, v, attn_mask, out, alibi_slopes, sinks)) and not needs_grad:
        check_no_grad("attnkit.attention", (("attn_mask", attn_mask), ("out", out), ("alibi_slopes", alibi_slopes),
                                            ("sinks", sinks)))
        # run_attention's call, each tensor's shape read once and a new out described
        # without asking torch (each tensor attribute read costs ~0.2 us)
        tq, tk, tv = typed(q, "q"), typed(k, "k"), typed(v, "v")
        out_shape, lse_shape = shapes_of(tq[1], tk[1], tv[1], layout)
        if out is None:
            out = q.new_empty(out_shape)
            b, x, y, d = out_shape
            t_out = (out.data_ptr(), out_shape, (x * y * d, y * d, d, 1), tq[3])
        else:
            t_out = typed(out, "out")
        lse = q.new_empty(lse_shape, dtype=torch.float32) if return_lse else None
        _C.attention(tq, tk, tv, t_out, None if lse is None else typed(lse, "lse", "float32"),
                     typed_or_none(attn_mask, "attn_mask", MASK), causal, scale, dropout_p, seed,
                     enable_gqa, layout, window[0], window[1], softcap,
                     typed_or_none(alibi_slopes, "alibi_slopes", "float32"), typed_or_none(sinks, "sinks", "float32"))
        return (out, lse) if return_lse else out
    seed = _seed_to_op(seed)
    mods = _mods(window, softcap, alibi_slopes, sinks)
    if out is None:
        out, lse = torch.ops.attnkit.attention(q, k, v, attn_mask, causal, scale, dropout_p, seed,
                                               enable_gqa, layout, **mods)
        return (out, lse) if return_lse else out
    lse = None
    if return_lse:
        lse = q.new_empty(attention_shapes(q, k, v, layout)[1], dtype=torch.float32)
    torch.ops.attnkit.attention_out(q, k, v, attn_mask, causal, scale, dropout_p, seed,
                                    enable_gqa, layout, out, lse, **mods)
    return (out, lse) if return_lse else out


# The autograd formula of attnkit::attention (its module imports this one's names).
from . import _torch_backward  # noqa: E402

_torch_backward.install()
