"""attnkit's DSA ops registered with torch.library (define + impl + register_fake), so that
torch.compile traces them and torch.library.opcheck passes; imported on the first torch
tensor that reaches attnkit.dsa. Outputs are caller buffers (mutated arguments)."""

import torch

from ._torch_ops import register_grad_refusal
from .dsa import run_flash_mla, run_mqa_logits, run_paged_mqa_logits, run_quantize_v32_kv, run_topk

_LIB = torch.library.Library("attnkit", "FRAGMENT")
_LIB.define("flash_mla_with_kvcache(Tensor q, Tensor k_cache, Tensor? block_table, Tensor? cache_seqlens, "
            "int head_dim_v, float? softmax_scale, bool causal, bool is_fp8_kvcache, Tensor? indices, "
            "Tensor? attn_sink, Tensor? topk_length, Tensor(a!) out, Tensor(b!) lse) -> ()")


def _no_result_fake(*args):
    return None


_LIB.impl("flash_mla_with_kvcache", run_flash_mla, "CPU")
torch.library.register_fake("attnkit::flash_mla_with_kvcache", _no_result_fake, lib=_LIB)
register_grad_refusal("flash_mla_with_kvcache", _LIB)


def flash_mla_with_kvcache(*args):
    """The torch path of attnkit.dsa.flash_mla_with_kvcache (arguments already of one kind)."""
    torch.ops.attnkit.flash_mla_with_kvcache(*args)


_LIB.define("fp8_mqa_logits(Tensor q, Tensor kv, Tensor kv_scale, Tensor weights, Tensor ks, Tensor ke, "
            "bool clean_logits, int max_seqlen_k, Tensor(a!) logits) -> ()")
_LIB.define("fp8_mqa_topk(Tensor q, Tensor kv, Tensor kv_scale, Tensor weights, Tensor ks, Tensor ke, "
            "Tensor(a!) topk_indices) -> ()")
_LIB.define("fp8_paged_mqa_logits(Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, "
            "Tensor block_table, int max_context_len, bool clean_logits, Tensor(a!) logits) -> ()")
_LIB.define("topk_transform(Tensor logits, Tensor lengths, int topk, Tensor? row_starts, Tensor? offsets, "
            "Tensor? page_table, int page_size, Tensor? row_to_batch, Tensor(a!) out) -> ()")
_LIB.define("quantize_v32_kv(Tensor kv, Tensor(a!) dst) -> ()")


def _mqa_logits_impl(q, kv, kv_scale, weights, ks, ke, clean_logits, max_seqlen_k, logits):
    run_mqa_logits(q, kv, kv_scale, weights, ks, ke, clean_logits, max_seqlen_k, logits, None)


def _mqa_topk_impl(q, kv, kv_scale, weights, ks, ke, topk_indices):
    run_mqa_logits(q, kv, kv_scale, weights, ks, ke, False, 0, None, topk_indices)


for _name, _impl in (("fp8_mqa_logits", _mqa_logits_impl), ("fp8_mqa_topk", _mqa_topk_impl),
                     ("fp8_paged_mqa_logits", run_paged_mqa_logits), ("topk_transform", run_topk),
                     ("quantize_v32_kv", run_quantize_v32_kv)):
    _LIB.impl(_name, _impl, "CPU")
    torch.library.register_fake(f"attnkit::{_name}", _no_result_fake, lib=_LIB)
    register_grad_refusal(_name, _LIB)


def mqa_logits(*args):
    torch.ops.attnkit.fp8_mqa_logits(*args)


def mqa_topk(*args):
    torch.ops.attnkit.fp8_mqa_topk(*args)


def paged_mqa_logits(*args):
    torch.ops.attnkit.fp8_paged_mqa_logits(*args)


def topk(*args):
    torch.ops.attnkit.topk_transform(*args)


def quantize_v32_kv(*args):
    torch.ops.attnkit.quantize_v32_kv(*args)
