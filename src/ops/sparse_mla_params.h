// The plain parameter block the sparse MLA kernels see, built by src/ops/sparse_mla.cpp.
#pragma once

#include <cstdint>

#include "attnkit/tensor.h"

namespace attnkit {

struct SparseMlaParams {
  DType dtype;               // of q and kv: bfloat16 or float8_e4m3fn
  const void* q;             // [s_q, h_q, d_qk]
  const void* kv;            // [s_kv, d_qk] (the single kv head)
  const int32_t* indices;    // [s_q, topk]
  const int32_t* topk_length;  // [s_q] or nullptr
  const float* attn_sink;    // [h_q] or nullptr
  uint16_t* out;             // [s_q, h_q, d_v] bfloat16, contiguous
  float* max_logits;         // [s_q, h_q], contiguous
  float* lse;                // [s_q, h_q], contiguous
  int64_t q_stride[3], kv_stride[2], indices_stride[2], topk_length_stride, attn_sink_stride;
  int64_t s_q, s_kv, h_q, d_qk, d_v, topk;
  float logit_scale;         // sm_scale · q_scale · kv_scale
  float q_scale, kv_scale;
};

}  // namespace attnkit
