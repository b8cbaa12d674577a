"""attnkit as a transformers attention implementation: after ``register()``,
``AutoModel.from_pretrained(..., attn_implementation="attnkit")`` (or
``model.set_attn_implementation("attnkit")``) runs every attention layer on attnkit.

register() registers two things under the name "attnkit": the attention function
(AttentionInterface) and its mask function (AttentionMaskInterface, transformers' boolean
SDPA mask). Without the mask registration transformers builds no mask for an unknown name
and passes None, and padded batches then attend to their padding.

The attention function follows transformers' sdpa_attention_forward: query/key/value
[B, H, S, D] in, [B, S, H, D] out; GQA served natively (no repeat_kv); is_causal taken from
the call or the module, only for prefill without a mask; dropout as given (transformers
passes 0 in eval). The output is written straight into a [B, S, H, D] tensor, so nothing is
transposed or copied afterwards. Training (inputs that require grad, in grad mode) runs
attnkit's backward: the dense masked path without out=, dropout with a seed drawn from
torch's generator.

Attention sinks (gpt-oss's s_aux, or sinks: one logit per query head that joins the softmax
denominator only) are attnkit's sinks, with their gradient in training.

What it does not serve goes to transformers' own sdpa function, with a warning once:
softcap, output_attentions, position_bias, sinks of another shape, dropout with inputs that
require grad under torch.compile, and anything attnkit cannot compute (float64, head dims
over 512, tensors off the CPU).
"""

import torch

import attnkit
from attnkit._warn import WarnOnce
from attnkit.integrations._shared import compiled_dropout_reason, dropout_seed, needs_backward, uncomputable_reason

NAME = "attnkit"

_warn_once = WarnOnce("attnkit's transformers attention", "using transformers' sdpa")


def _sinks(kwargs):
    """The per-head sink logits a model passes (gpt-oss: s_aux; others: sinks), or None."""
    sinks = kwargs.get("s_aux")
    return kwargs.get("sinks") if sinks is None else sinks


def _stock_reason(query, key, value, attention_mask, dropout, kwargs):
    """Why this call goes to transformers' sdpa instead, or None."""
    if kwargs.get("softcap") is not None:
        return "softcap"
    if kwargs.get("output_attentions"):
        return "output_attentions"
    if kwargs.get("position_bias") is not None:
        return "position_bias"
    sinks = _sinks(kwargs)
    if sinks is not None and not (isinstance(sinks, torch.Tensor) and tuple(sinks.shape) == (query.shape[1],)):
        return "sinks that are not one logit per query head"
    tensors = [query, key, value] + ([attention_mask] if isinstance(attention_mask, torch.Tensor) else [])
    return uncomputable_reason(query, value, tensors) or compiled_dropout_reason(dropout, tensors)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention-function contract: (attn_output [B, S, H, Dv], None)."""
    reason = _stock_reason(query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        _warn_once(reason)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    B, Hq, Sq, _ = query.shape
    Hkv, Skv, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if attention_mask is not None and attention_mask.shape[-1] != Skv:
        attention_mask = attention_mask[..., :Skv]  # a static cache's mask covers its capacity
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' sdpa: causal only for prefill without a mask (a mask already holds it;
    # a single decode row sees every key). With Skv > Sq (a static cache's empty tail, or
    # a cached prefix), top-left causal is transformers' choice too.
    causal = bool(is_causal) and Sq > 1 and attention_mask is None
    sinks = _sinks(kwargs)
    sinks = None if sinks is None else sinks.float()  # attnkit's sinks are float32 (the cast keeps grad)
    return _dense(query, key, value, attention_mask, causal, scaling, dropout, Hq != Hkv, (B, Sq, Hq, Dv),
                  sinks), None


def _dense(query, key, value, mask, causal, scaling, dropout, gqa, out_shape, sinks=None):
    """One attention call, output in [B, S, H, Dv]. A batch whose mask only pads keys on the
    right (an encoder's padded batch) runs as a varlen batch that never reads the padding
    (training too, through varlen's backward, unless there is dropout); anything else attends
    densely through the mask. Inference writes the output in place; training returns a new
    tensor (autograd records no out= call)."""
    lengths = None if causal or dropout else _right_padding(mask)
    if needs_backward(query, key, value, sinks):
        if lengths is not None:
            return _skip_padding(query, key, value, lengths, scaling, sinks=sinks).view(out_shape)
        out = attnkit.attention(query, key, value, attn_mask=mask, causal=causal, scale=scaling,
                                dropout_p=float(dropout), seed=dropout_seed(dropout), enable_gqa=gqa, sinks=sinks)
        return out.transpose(1, 2).contiguous()
    out = query.new_empty(out_shape)  # [B, S, H, Dv]: transformers' layout, written in place
    if lengths is not None:
        _skip_padding(query, key, value, lengths, scaling, out, sinks)
        return out
    attnkit.attention(query, key, value, attn_mask=mask, causal=causal, scale=scaling,
                      dropout_p=float(dropout), seed=dropout_seed(dropout), enable_gqa=gqa, out=out.transpose(1, 2),
                      sinks=sinks)
    return out


# (mask, its version, its key lengths): every layer of a forward shares one mask. The version
# counter moves when the mask is written in place, so an edited mask is looked at again.
_last_mask = [None, None, None]


def _right_padding(mask):
    """Key lengths [B] (int32) if the bool mask [B, 1, Sq, Skv] lets every query of sequence
    b see exactly its first lengths[b] keys (and some key is padding); else None. Under
    torch.compile always None: the test reads the mask's values (a data-dependent branch),
    and the masked dense path traces without one."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    if torch.compiler.is_compiling():
        return None
    if _last_mask[0] is mask and _last_mask[1] == mask._version:
        return _last_mask[2]
    first_row = mask[:, :, :1, :]
    lengths = None
    if torch.equal(mask, first_row.expand_as(mask)):
        valid = first_row[:, 0, 0, :]
        n = valid.sum(dim=-1, dtype=torch.int32)
        prefix = torch.arange(valid.shape[-1]) < n[:, None]
        if torch.equal(valid, prefix) and bool((n < valid.shape[-1]).any()):
            lengths = n
    _last_mask[:] = mask, mask._version, lengths
    return lengths


def _skip_padding(query, key, value, lengths, scaling, out=None, sinks=None):
    """Non-causal attention of every query of sequence b over its first lengths[b] keys, as
    attnkit.varlen_attention over the tensors in place: the padding keys of each sequence
    form a sequence of their own with no queries, so nothing is copied or computed for them
    (and their gradient is zero). Into out ([B, S, H, Dv]), or a new [B·S, H, Dv] tensor."""
    B, Hq, Sq, D = query.shape
    Hkv, Skv, Dv = key.shape[1], key.shape[2], value.shape[-1]
    q = query.transpose(1, 2).reshape(B * Sq, Hq, D)  # a view for transformers' [B, S, H, D] storage
    k = key.transpose(1, 2).reshape(B * Skv, Hkv, D)
    v = value.transpose(1, 2).reshape(B * Skv, Hkv, Dv)
    starts = torch.arange(B, dtype=torch.int32)
    cu_k = torch.stack([starts * Skv, starts * Skv + lengths], dim=1).reshape(-1)
    cu_q = torch.stack([starts * Sq, starts * Sq + Sq], dim=1).reshape(-1)
    end = torch.tensor([B], dtype=torch.int32)
    return attnkit.varlen_attention(q, k, v, torch.cat([cu_q, end * Sq]), torch.cat([cu_k, end * Skv]),
                                    scale=scaling, out=None if out is None else out.view(B * Sq, Hq, Dv), sinks=sinks)


def register():
    """Registers "attnkit" with transformers' AttentionInterface (attention_forward) and
    AttentionMaskInterface (transformers' boolean sdpa_mask, which attnkit takes as is).
    Idempotent. Returns the name to pass as attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
