"""attnkit as backends of diffusers' attention dispatcher (diffusers.models.attention_dispatch):
after ``register()``, ``model.set_attention_backend("attnkit")`` or
``with attention_backend("attnkit"): ...`` runs every dispatched attention on attnkit.

- "attnkit": exact attention (attnkit.attention, torch SDPA semantics: masks, causal,
  scale, dropout, GQA); a 2-d mask [B, Skv] pads each batch entry's keys, as diffusers'
  native backend reads it.
- "attnkit_sage": SageAttention-style int8 attention (attnkit.sage_attention(mode="int8")),
  lossy, so only when named: no mask and no dropout (a ValueError, as diffusers' own sage
  backend refuses a mask).

diffusers keeps its backend names in a closed Enum (AttentionBackendName) and offers no way
to add one, so register() adds the two members to that Enum's member tables, the one step
here that reaches into diffusers' internals; everything else uses its registry's public
decorator. Tensors are [B, S, H, D], the dispatcher's layout, which attnkit reads in place
(layout "BSHD"). Training runs attnkit's backward on "attnkit" (dropout with a seed drawn
from torch's generator); "attnkit_sage" has no backward, so inputs that require grad in grad
mode go to diffusers' native backend there, as does what attnkit cannot compute (float64,
tensors off the CPU, head dims over 512), with a warning once.
"""

import enum

import attnkit
from attnkit._warn import WarnOnce
from attnkit.integrations._shared import compiled_dropout_reason, dropout_seed, needs_backward, uncomputable_reason

EXACT = "attnkit"
SAGE = "attnkit_sage"

_warn_once = WarnOnce("attnkit's diffusers backend", "using diffusers' native backend")


def _native_reason(query, key, value, attn_mask, has_backward, dropout_p=0.0):
    tensors = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    reason = uncomputable_reason(query, value, tensors) or compiled_dropout_reason(dropout_p, tensors)
    if reason is not None:
        return reason
    if not has_backward and needs_backward(*tensors):
        return "inputs require grad and attnkit_sage has no backward"
    return None


def _native(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    native = _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]
    return native(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse)


def _no_context_parallel(parallel_config):
    if parallel_config is not None:
        raise ValueError("attnkit's diffusers backends do not support context parallelism")


def exact_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, return_lse=False, _parallel_config=None):
    """The "attnkit" backend: [B, S, H, D] in and out; lse [B, H, S] with return_lse."""
    _no_context_parallel(_parallel_config)
    reason = _native_reason(query, key, value, attn_mask, has_backward=True, dropout_p=dropout_p)
    if reason is not None:
        _warn_once(reason)
        return _native(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)
    if attn_mask is not None and attn_mask.dim() == 2 and tuple(attn_mask.shape) == (query.shape[0], key.shape[1]):
        attn_mask = attn_mask[:, None, None, :]  # [B, Skv] pads keys per batch entry, as the native backend reads it
    return attnkit.attention(query, key, value, attn_mask=attn_mask, causal=bool(is_causal), scale=scale,
                             dropout_p=dropout_p, seed=dropout_seed(dropout_p),
                             enable_gqa=query.shape[2] != key.shape[2] or enable_gqa, layout="BSHD",
                             return_lse=return_lse)


def sage_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   return_lse=False, _parallel_config=None):
    """The "attnkit_sage" backend (int8, lossy): [B, S, H, D] in and out."""
    _no_context_parallel(_parallel_config)
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported by the attnkit_sage backend")
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p} is not supported by the attnkit_sage backend")
    reason = _native_reason(query, key, value, None, has_backward=False)
    if reason is not None:
        _warn_once(reason)
        return _native(query, key, value, None, 0.0, is_causal, scale, False, return_lse)
    return attnkit.sage_attention(query, key, value, causal=bool(is_causal), scale=scale, layout="BSHD",
                                  mode="int8", return_lse=return_lse)


def _enum_member(enum_cls, name, value):
    """enum_cls(value), adding the member first if the Enum does not have it."""
    try:
        return enum_cls(value)
    except ValueError:
        pass
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def register():
    """Adds the "attnkit" and "attnkit_sage" backends to diffusers' dispatcher. Idempotent.
    Returns the two names."""
    from diffusers.models.attention_dispatch import (AttentionBackendName, _AttentionBackendRegistry,
                                                     _check_device, _check_shape)
    assert issubclass(AttentionBackendName, enum.Enum)
    for name, value, fn in (("ATTNKIT", EXACT, exact_attention), ("ATTNKIT_SAGE", SAGE, sage_attention)):
        member = _enum_member(AttentionBackendName, name, value)
        _AttentionBackendRegistry.register(member, constraints=[_check_device, _check_shape])(fn)
    return EXACT, SAGE
