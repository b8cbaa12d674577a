// DeepSeek-V3.2 sparse MLA prefill: one shared latent KV head; each query row attends to
// its own top-k list of KV rows, shared by all of its query heads. bf16 or FP8 (e4m3fn).
#pragma once

#include <cstdint>
#include <optional>

#include "attnkit/tensor.h"

namespace attnkit {

struct SparseMlaArgs {
  TensorView q;                          // [s_q, h_q, d_qk]  bfloat16 or float8_e4m3fn
  TensorView kv;                         // [s_kv, h_kv=1, d_qk], q's dtype; V = kv[..., :d_v]
  TensorView indices;                    // [s_q, h_kv, topk] int32; invalid slots never read
  double sm_scale = 0.0;
  int64_t d_v = 512;
  std::optional<TensorView> q_scale;     // float32, one element; required for fp8
  std::optional<TensorView> kv_scale;    // float32, one element; required for fp8
  std::optional<TensorView> attn_sink;   // float32 [h_q]
  std::optional<TensorView> topk_length; // int32 [s_q]
  TensorView out;                        // bfloat16 [s_q, h_q, d_v], contiguous
  TensorView max_logits;                 // float32 [s_q, h_q], contiguous
  TensorView lse;                        // float32 [s_q, h_q], contiguous
};

// The general op: any h_q, topk, d_qk >= d_v >= 1, strided inputs; semantics in
// python/attnkit/sparse_mla.py. Throws attnkit::Error on invalid arguments.
void sparse_mla_prefill_fwd(const SparseMlaArgs& args);

// SGLang's sparse_mla_q8kv8_prefill_fwd contract (fp8 only, h_q a positive multiple of 64,
// h_kv = 1, d_qk 512/576, d_v 512, topk a positive multiple of 128, contiguous inputs,
// attn_sink only with topk_length, 0 <= topk_length <= topk), then the general op.
void sparse_mla_q8kv8_prefill_fwd(const SparseMlaArgs& args);

}  // namespace attnkit
