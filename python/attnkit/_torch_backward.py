"""Torch autograd for attnkit::attention: the op attnkit::attention_backward (define + impl +
register_fake) and, through install(), torch.library.register_autograd on attnkit::attention,
so that loss.backward() and torch.compile of a training step run attnkit's backward.

setup_context saves q, k, v, out, lse, the mask and the score modifiers; backward passes
dout and dlse (lse's gradient, zero when lse is unused) to attention_backward, which also
returns the sinks' gradient (an empty tensor without sinks). The mask and the ALiBi slopes
get no gradient. With dropout the forward must be given a seed, since the keep mask is
regenerated from it.
"""

import torch

from .backward import run_attention_backward

_LIB = torch.library.Library("attnkit", "FRAGMENT")
_LIB.define("attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
            "Tensor? dlse, Tensor? attn_mask, int causal, float? scale, float dropout_p, int? seed, "
            "bool enable_gqa, str layout, int window_left=-1, int window_right=-1, float? softcap=None, "
            "Tensor? alibi_slopes=None, Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor)")


def _backward_impl(q, k, v, out, lse, dout, dlse, attn_mask, causal, scale, dropout_p, seed,
                   enable_gqa, layout, window_left=-1, window_right=-1, softcap=None,
                   alibi_slopes=None, sinks=None):
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
    dsinks = torch.empty(0 if sinks is None else sinks.shape[0], dtype=torch.float32)
    run_attention_backward(q, k, v, out, lse, dout, attn_mask, causal, scale, dropout_p,
                           None if seed is None else seed % 2**64, enable_gqa, layout, dq, dk, dv, dlse,
                           (window_left, window_right), softcap, alibi_slopes, sinks,
                           None if sinks is None else dsinks)
    return dq, dk, dv, dsinks


def _backward_fake(q, k, v, out, lse, dout, dlse, attn_mask, causal, scale, dropout_p, seed,
                   enable_gqa, layout, window_left=-1, window_right=-1, softcap=None,
                   alibi_slopes=None, sinks=None):
    n_sinks = 0 if sinks is None else sinks.shape[0]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((n_sinks,), dtype=torch.float32))


_LIB.impl("attention_backward", _backward_impl, "CPU")
torch.library.register_fake("attnkit::attention_backward", _backward_fake, lib=_LIB)


_NO_MODS = (-1, -1, None, None, None)  # window_left, window_right, softcap, alibi_slopes, sinks


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, causal, scale, dropout_p, seed, enable_gqa, layout = inputs[:10]
    window_left, window_right, softcap, alibi_slopes, sinks = tuple(inputs[10:]) + _NO_MODS[len(inputs) - 10:]
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise ValueError("attnkit.attention computes no gradient for alibi_slopes, got slopes that "
                         "require grad")
    if dropout_p > 0.0 and seed is None:
        raise ValueError("attnkit.attention with dropout_p > 0 on tensors that require grad needs a "
                         "seed (the backward regenerates the forward's keep mask from it), got seed=None")
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError("attnkit.attention computes no gradient for attn_mask, got a mask that "
                         "requires grad")
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, alibi_slopes, sinks)
    ctx.args = (causal, scale, dropout_p, seed, enable_gqa, layout, window_left, window_right, softcap)
    ctx.n_inputs = len(inputs)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, alibi_slopes, sinks = ctx.saved_tensors
    causal, scale, dropout_p, seed, enable_gqa, layout, window_left, window_right, softcap = ctx.args
    # Autograd materialises both gradients (zeros for an unused lse).
    dq, dk, dv, dsinks = torch.ops.attnkit.attention_backward(
        q, k, v, out, lse, dout, dlse, attn_mask, causal, scale, dropout_p, seed, enable_gqa, layout,
        window_left, window_right, softcap, alibi_slopes, sinks)
    grads = [dq, dk, dv] + [None] * (ctx.n_inputs - 3)
    if ctx.n_inputs > 14 and sinks is not None and ctx.needs_input_grad[14]:
        grads[14] = dsinks
    return tuple(grads)


_installed = False


def install():
    """Registers the autograd formula of attnkit::attention (idempotent). _torch_ops, which
    defines the op, calls it when it loads."""
    global _installed
    if _installed:
        return
    _installed = True
    from . import _torch_ops  # noqa: F401  (defines attnkit::attention; its last line calls install)
    torch.library.register_autograd("attnkit::attention", _backward, setup_context=_setup_context, lib=_LIB)

