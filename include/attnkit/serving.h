// The serving-engine contract: attention over packed variable-length batches (FlashAttention's
// flash_attn_varlen_func), over paged KV caches with chunked prefill and decode in one call
// (vLLM's unified CPU call, FlashAttention's flash_attn_with_kvcache layout), and the cache
// writer. Same numerics as attnkit::attention; lse is natural log, -inf (and out 0) for a
// query that sees no key.
#pragma once

#include <cstdint>
#include <optional>

#include "attnkit/tensor.h"

namespace attnkit {

struct VarlenAttentionArgs {
  TensorView q;                    // [total_q, Hq, D] float32, float16 or bfloat16; any strides
  TensorView k, v;                 // [total_k, Hkv, D], [total_k, Hkv, Dv], q's dtype
  TensorView cu_seqlens_q;         // int32 [B + 1]: 0, ..., total_q, non-decreasing
  TensorView cu_seqlens_k;         // int32 [B + 1]: 0, ..., total_k, non-decreasing
  TensorView out;                  // [total_q, Hq, Dv], q's dtype
  std::optional<TensorView> lse;   // float32 [total_q, Hq]
  std::optional<int64_t> max_seqlen_q, max_seqlen_k;  // if given: at least the longest sequence
  bool causal = false;             // bottom-right per sequence: query i sees keys j <= i + Sk - Sq
  std::optional<double> scale;     // default 1/sqrt(D)
  // Score modifiers, as in AttentionArgs (each sequence aligned bottom-right; alibi_slopes
  // [Hq] or [B, Hq]).
  int64_t window_left = -1, window_right = -1;
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes, sinks;
};

// The backward of varlen_attention: dq, dk, dv (and the sinks' gradient) from the forward's
// arguments, its out and lse, and the gradient of out. Each sequence runs the dense backward
// (attention_backward's kernel) on its own rows, aligned bottom-right as in the forward.
struct VarlenAttentionBackwardArgs {
  TensorView q, k, v;              // the forward's packed inputs
  TensorView cu_seqlens_q, cu_seqlens_k;
  TensorView out;                  // the forward's output [total_q, Hq, Dv]
  TensorView lse;                  // the forward's float32 lse [total_q, Hq]
  TensorView dout;                 // gradient of out: out's shape and dtype, any strides
  TensorView dq, dk, dv;           // caller-owned, the shapes and dtype of q, k and v
  std::optional<TensorView> dlse;  // gradient of lse, float32 [total_q, Hq]; none = 0
  // The forward's other arguments, unchanged (see VarlenAttentionArgs).
  std::optional<int64_t> max_seqlen_q, max_seqlen_k;
  bool causal = false;
  std::optional<double> scale;
  int64_t window_left = -1, window_right = -1;
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes, sinks;  // ALiBi slopes get no gradient
  std::optional<TensorView> dsinks;  // caller-owned float32 [Hq]: required with sinks
};

struct PagedAttentionArgs {
  TensorView q;                    // [total_q, Hq, D] float32, float16 or bfloat16: each sequence's new tokens
  TensorView k_cache, v_cache;     // [num_blocks, block_size, Hkv, D | Dv]: q's dtype, or float8_e4m3fn / e5m2
  TensorView block_table;          // int32 [B, max_blocks]
  TensorView seq_lens;             // int32 [B]: keys of each sequence (cached prefix + its new tokens)
  TensorView cu_seqlens_q;         // int32 [B + 1]; the queries are the last positions of their sequence
  TensorView out;                  // [total_q, Hq, Dv], q's dtype
  std::optional<TensorView> lse;   // float32 [total_q, Hq]
  std::optional<TensorView> k_scale, v_scale;  // float32, one ([] or [1]) or one per kv head ([Hkv])
  bool causal = true;              // bottom-right: query i of n new tokens sees keys j <= seq_len - n + i
  std::optional<double> scale;     // default 1/sqrt(D)
  // Score modifiers, as in AttentionArgs (each sequence aligned bottom-right; alibi_slopes
  // [Hq] or [B, Hq]).
  int64_t window_left = -1, window_right = -1;
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes, sinks;
};

struct AppendKvCacheArgs {
  TensorView k, v;                 // [T, Hkv, D], [T, Hkv, Dv]: float32, float16 or bfloat16
  TensorView k_cache, v_cache;     // [num_blocks, block_size, Hkv, D | Dv], written in place
  TensorView slot_mapping;         // int32 or int64 [T]: block * block_size + offset, or -1 (skip)
  std::optional<TensorView> k_scale, v_scale;  // float32 [] / [1] / [Hkv]: cache = value / scale
};

// Each throws attnkit::Error on invalid arguments before reading any data it is not asked to
// validate; never modifies an input; writes every element of out and lse.
void varlen_attention(const VarlenAttentionArgs& args);
// Writes every element of dq, dk and dv (and dsinks); bit-identical for any thread count.
void varlen_attention_backward(const VarlenAttentionBackwardArgs& args);
void paged_attention(const PagedAttentionArgs& args);
// Writes token t into slot slot_mapping[t] of both caches (in token order: a repeated slot
// keeps the last token's values), converting to the cache dtype (round to nearest even;
// float8 saturates to its largest finite value, NaN stays NaN).
void append_kv_cache(const AppendKvCacheArgs& args);

}  // namespace attnkit
