// The plain parameter block the dense-attention kernels see. Built only by
// src/ops/attention.cpp after validation; kernels trust it and never re-validate.
// Everything is in BHSD order, whatever the caller's layout: strides (in elements) encode it.
#pragma once

#include <cstdint>

#include "attnkit/attention.h"
#include "attnkit/tensor.h"

namespace attnkit {

struct AttentionParams {
  DType dtype;                  // of q, k, v and out: float32, float16 or bfloat16
  const void* q;                // [B, Hq, Sq, D]
  const void* k;                // [B, Hkv, Skv, D]
  const void* v;                // [B, Hkv, Skv, Dv]
  void* out;                    // [B, Hq, Sq, Dv]
  float* lse;                   // [B, Hq, Sq] or nullptr
  const void* mask;             // [B, Hq, Sq, Skv] (zero strides where broadcast) or nullptr
  DType mask_dtype;             // boolean (true = attend) or a float type (added to scores)
  int64_t q_stride[4], k_stride[4], v_stride[4], out_stride[4], lse_stride[3], mask_stride[4];

  int64_t B, Hq, Hkv, Sq, Skv, D, Dv;
  int64_t group;                // Hq / Hkv: query head h reads kv head h / group
  bool causal;
  int64_t causal_offset;        // query i is aligned to key position i + offset (causal: sees keys j <= i + offset)
  float scale;                  // softmax scale applied to q·k
  float dropout_p;              // 0 disables dropout
  uint64_t seed = 0;            // dropout stream key
  // Score modifiers. The aligned query a = i + causal_offset sees keys a - window_left <= j
  // <= a + window_right; -1 is unbounded (also any window reaching past every key; and
  // window_right under causal, whose limit is tighter).
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;         // > 0: s -> softcap·tanh(s / softcap) after the scale; 0 disables
  const float* alibi_slopes = nullptr;  // slope of (b, h) at b * alibi_stride[0] + h * alibi_stride[1]
  int64_t alibi_stride[2] = {0, 0};
  const float* sinks = nullptr;  // sink logit of head h at h * sinks_stride
  int64_t sinks_stride = 0;

  // Ragged batches (varlen, paged). Dense attention leaves them null: every sequence then
  // has Sq queries and Skv keys at batch strides q_stride[0], k_stride[0], ... A ragged
  // batch aligns each sequence bottom-right (its causal_offset is Skv_b - Sq_b).
  const int32_t* q_begin = nullptr;   // [B+1]: sequence b's queries are rows q_begin[b] ..
                                      // q_begin[b+1]-1 (q_stride[2] apart; q, out and lse
                                      // have batch stride 0); Sq is then the longest
  const int32_t* kv_begin = nullptr;  // [B+1], varlen: sequence b's keys are rows kv_begin[b] ..
  const int32_t* kv_len = nullptr;    // [B], paged: sequence b's key count
  const int32_t* block_table = nullptr;  // paged: [B][block_table_stride] block ids; key j of
                                         // sequence b lies in block block_table[b][j / block_size]
                                         // at k + block * k_stride[0] + (j % block_size) * k_stride[2]
  int64_t block_table_stride = 0, block_size = 0;
  DType kv_dtype;                     // of k and v: q's dtype, or float8 for paged caches
  // Paged caches: dequantisation scales, kv head h's at k_scale[h * k_scale_stride] (stride 0:
  // one per tensor); null means 1.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t k_scale_stride = 0, v_scale_stride = 0;

  // Decode over grouped kv heads reads the block after next into L2, share by share, rather
  // than the next block by loads or L1 prefetches: the machine's rule (detail::l2_read_ahead).
  // Timing only; results never depend on it.
  bool l2_read_ahead = false;
};

namespace detail {
// The dense-attention contract: validates args (throws Error) and fills the params block.
// Shared by every op with attention's shapes (attention, sage_attention, and the backward,
// which reads out and lse: writes_out false, so they are held to the inputs' rules and may
// be broadcast or overlap other inputs).
AttentionParams attention_params(const AttentionArgs& args, bool writes_out = true);
}  // namespace detail

}  // namespace attnkit
