"""attnkit.torch: a drop-in for torch.nn.functional.scaled_dot_product_attention, and a
scoped switch that routes torch's own function through it.

    import attnkit.torch
    out = attnkit.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    with attnkit.torch.sdpa_override():
        model(x)        # every F.scaled_dot_product_attention on CPU tensors runs on attnkit

Semantics are torch's (the math kernel's): any number of leading dims, right-aligned
broadcasting between query, key, value and the mask, dim -3 as heads (enable_gqa repeats
key/value heads; a key/value head count of 1 broadcasts), attn_mask bool (True = attend) or
additive float, is_causal top-left (combined with attn_mask when both are given, as torch
2.13's CPU flash kernel does; its math kernel refuses the pair), scale defaulting to 1/sqrt(E) and given as a float, numpy scalar or 0-d tensor.

Inputs that require grad in grad mode get attnkit's backward (torch autograd through
attnkit.attention; a dropout call draws its seed from torch's generator, so the backward
regenerates the same keep mask). What attnkit cannot compute goes to torch's own kernel, with
a warning once per reason: float64 (and other dtypes than float32/float16/bfloat16), tensors
off the CPU, a mask that requires grad (attnkit computes no mask gradient), dropout with
grad under torch.compile (no seed to draw there), head dims over 512, mask dtypes attnkit
does not take and nested tensors. Calls torch refuses go to torch's kernel quietly,
so that they raise its own error.
Inputs with no elements (D = 0, L = 0, S = 0, a zero batch) also go to torch's kernel,
silently: their results are trivial and torch defines them. Differences that remain: dropout
draws its keep mask from attnkit's counter-based generator (seeded from torch's generator,
so torch.manual_seed makes it reproducible, but not the same mask as torch's), and a query
row with no attendable key gives 0 (as torch 2.13's CPU kernels do).
"""

import contextlib
import math
import threading

import torch

from ._warn import WarnOnce
from .ops import attention, flag, real_scalar

__all__ = ["scaled_dot_product_attention", "sdpa_override"]

# torch's function as it was when attnkit.torch was first imported: the fallback, and what
# sdpa_override restores. Never the override itself, so a fallback cannot recurse.
_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MASK_DTYPES = (torch.bool, torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 512

_warn_once = WarnOnce("attnkit.torch.scaled_dot_product_attention", "using torch's own kernel")


def _fallback_reason(query, key, value, attn_mask, dropout_p, scale):
    """Why attnkit cannot compute this call ("" = it can, None = leave it to torch quietly:
    arguments torch itself rejects, inputs with no elements, and the edge values whose
    result torch defines where attnkit.attention refuses them: dropout_p 1, an infinite scale)."""
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    if dropout_p >= 1.0 or (scale is not None and not math.isfinite(real_scalar(scale, "scale"))):
        return None
    if attn_mask is not None and not 2 <= attn_mask.dim() <= max(query.dim(), key.dim(), value.dim()):
        return None  # torch refuses a mask of one dim, or of more dims than the inputs
    if any(t.is_nested for t in tensors):
        return "nested tensors"
    if any(t.device.type != "cpu" for t in tensors):
        return f"tensors on {query.device.type}"
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        return None
    if not query.dtype == key.dtype == value.dtype:
        return None
    if query.dtype not in _DTYPES:
        return f"dtype {str(query.dtype).removeprefix('torch.')}"
    if attn_mask is not None and attn_mask.dtype not in _MASK_DTYPES:
        return f"attn_mask dtype {str(attn_mask.dtype).removeprefix('torch.')}"
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        return None  # torch refuses a float16 / bfloat16 mask of another dtype than the query's
    if torch.is_grad_enabled() and attn_mask is not None and attn_mask.requires_grad:
        return "attn_mask requires grad and attnkit computes no mask gradient"
    if any(t.numel() == 0 for t in (query, key, value)):
        return None
    if query.shape[-1] > _MAX_HEAD_DIM or value.shape[-1] > _MAX_HEAD_DIM:
        return f"head dim over {_MAX_HEAD_DIM}"
    return ""


def _as_4d_batch(x, batch, heads):
    """x ([..., heads, rows, cols]) expanded to batch + [heads, rows, cols] and flattened to
    [prod(batch), heads, rows, cols]: a view, except where a broadcast batch cannot merge."""
    x = x.expand(*batch, heads, *x.shape[-2:])
    if len(batch) == 1:
        return x
    return x.reshape(-1, heads, *x.shape[-2:])


def _pad(x, ndim):
    """x with leading size-1 dims up to ndim (torch's right-aligned broadcasting)."""
    return x.reshape((1,) * (ndim - x.dim()) + tuple(x.shape)) if x.dim() < ndim else x


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, computed by attnkit.attention on CPU
    tensors (see the module docstring for what goes to torch's kernel instead).

    query [..., Hq, L, E], key [..., Hk, S, E], value [..., Hv, S, Ev] -> [..., H, L, Ev]."""
    is_causal = flag(is_causal, "is_causal")
    enable_gqa = flag(enable_gqa, "enable_gqa")
    dropout_p = real_scalar(dropout_p, "dropout_p")
    reason = _fallback_reason(query, key, value, attn_mask, dropout_p, scale)
    if reason == "":
        try:
            return _attnkit_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        except _Unmapped as e:
            reason = e.reason
    if reason:
        _warn_once(reason)
    return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                       scale=scale, enable_gqa=enable_gqa)


class _Unmapped(Exception):
    """The call has no attnkit.attention equivalent; reason as in _fallback_reason."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


def _attnkit_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The call on attnkit.attention (raises _Unmapped where there is none)."""
    ndim = max(query.dim(), key.dim(), value.dim(), 4)
    q, k, v = _pad(query, ndim), _pad(key, ndim), _pad(value, ndim)
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    # attnkit reads kv head h // (H / Hkv) for query head h: torch's repeat_interleave under
    # enable_gqa, and also its broadcast of a single kv head.
    if hk != hv:
        if min(hk, hv) != 1:
            raise _Unmapped(None)  # torch refuses it: no broadcast
        hk = max(hk, hv)                  # one of key / value broadcast over the other's heads
    heads = hq
    if hq != hk:
        if hq == 1:                       # one query head broadcast over the kv heads
            heads = hk
        elif not (hk == 1 or (enable_gqa and hq % hk == 0)):
            raise _Unmapped(None)  # torch refuses it: neither a broadcast nor GQA
    try:
        batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except RuntimeError:
        raise _Unmapped(None) from None  # torch's own error, from its kernel
    out_shape = (*batch, heads, q.shape[-2], v.shape[-1])
    q4 = _as_4d_batch(q, batch, heads)
    k4, v4 = _as_4d_batch(k, batch, hk), _as_4d_batch(v, batch, hk)
    mask4 = None
    if attn_mask is not None:
        # broadcastable to the scores [*batch, heads, L, S], never widening them (as torch)
        scores = torch.Size((*batch, heads, q.shape[-2], k.shape[-2]))
        try:
            widens = torch.broadcast_shapes(attn_mask.shape, scores) != scores
        except RuntimeError:
            widens = True
        if widens:
            raise _Unmapped(None)
        mask = _pad(attn_mask, ndim)
        mask4 = attn_mask if ndim == 4 else _as_4d_batch(mask, batch, mask.shape[-3])
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    # enable_gqa=True below: which head layouts are legal was decided above (heads == hk is a
    # group of one), and a comparison of head counts would be a SymBool under dynamic shapes.
    seed = None
    if dropout_p > 0.0:
        if torch.compiler.is_compiling():
            if needs_grad:  # the backward needs the forward's seed, and none is drawn here
                raise _Unmapped("dropout with inputs that require grad under torch.compile")
        else:
            # from torch's generator, so that torch.manual_seed makes the call reproducible
            seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    if needs_grad:  # autograd through attnkit::attention; expand and reshape carry the rest
        out4 = attention(q4, k4, v4, attn_mask=mask4, causal=is_causal, scale=scale, dropout_p=dropout_p,
                         seed=seed, enable_gqa=True)
        out = out4.reshape(out_shape)
        result_ndim = max(query.dim(), key.dim(), value.dim())
        return out.view(out_shape[ndim - result_ndim:]) if result_ndim < ndim else out
    out = query.new_empty(out_shape)
    out4 = out if len(batch) == 1 else out.view(-1, heads, *out_shape[-2:])
    attention(q4, k4, v4, attn_mask=mask4, causal=is_causal, scale=scale, dropout_p=dropout_p, seed=seed,
              enable_gqa=True, out=out4)
    result_ndim = max(query.dim(), key.dim(), value.dim())
    return out.view(out_shape[ndim - result_ndim:]) if result_ndim < ndim else out


def _routed(query, key, value, *args, **kwargs):
    """What torch.nn.functional.scaled_dot_product_attention is while an override is active."""
    if isinstance(query, torch.Tensor) and query.device.type == "cpu":
        return scaled_dot_product_attention(query, key, value, *args, **kwargs)
    return _TORCH_SDPA(query, key, value, *args, **kwargs)


_override_lock = threading.Lock()
_override_depth = 0


@contextlib.contextmanager
def sdpa_override():
    """Within the block, torch.nn.functional.scaled_dot_product_attention on CPU tensors
    runs scaled_dot_product_attention above (other devices keep torch's). The switch is the
    module attribute, so it is process-wide while any override is active (blocks nest, and
    torch's function is restored when the last one exits), and code that bound torch's
    function to a name of its own before the block keeps it."""
    global _override_depth
    with _override_lock:
        if _override_depth == 0:
            torch.nn.functional.scaled_dot_product_attention = _routed
        _override_depth += 1
    try:
        yield
    finally:
        with _override_lock:
            _override_depth -= 1
            if _override_depth == 0:
                torch.nn.functional.scaled_dot_product_attention = _TORCH_SDPA
