// The parameter block of the dense-attention backward kernel: the forward's params (q, k,
// v, out, lse, mask, causal, scale, dropout, GQA, score modifiers; BHSD strides) plus dO
// and the gradients.
// Built only by src/ops/attention_backward.cpp after validation.
#pragma once

#include <cstdint>

#include "ops/attention_params.h"

namespace attnkit {

struct AttentionBackwardParams {
  AttentionParams fwd;       // lse is always set
  const void* dout;          // [B, Hq, Sq, Dv], fwd.dtype
  void* dq;                  // [B, Hq, Sq, D]
  void* dk;                  // [B, Hkv, Skv, D]
  void* dv;                  // [B, Hkv, Skv, Dv]
  int64_t dout_stride[4], dq_stride[4], dk_stride[4], dv_stride[4];  // BHSD order
  const float* dlse = nullptr;  // [B, Hq, Sq] or null (zero)
  int64_t dlse_stride[3];
  float* dsinks = nullptr;      // [Hq] gradient of fwd.sinks, or null (no sinks)
  int64_t dsinks_stride = 0;
};

}  // namespace attnkit
