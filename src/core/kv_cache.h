// Writing tokens into a paged KV cache (attnkit::append_kv_cache after validation): a plain
// description of one tensor's copy and the loop that performs it.
#pragma once

#include <cstdint>

#include "attnkit/tensor.h"

namespace attnkit::detail {

struct KvWrite {
  const void* src;           // [tokens, heads, dim]
  DType src_dtype;           // float32, float16 or bfloat16
  int64_t src_stride[3];
  void* dst;                 // [num_blocks, block_size, heads, dim]
  DType dst_dtype;           // float32, float16, bfloat16 or float8
  int64_t dst_stride[4];
  int64_t tokens, heads, dim, block_size;
  const int64_t* slot;       // [tokens]: block * block_size + offset, or -1 to skip
  const float* scale;        // stored = value / scale[head * scale_stride]; null: 1
  int64_t scale_stride;
};

// Copies token t to slot[t] for t in order, rounding to nearest even into dst's dtype;
// float8 saturates to its largest finite value (NaN stays NaN).
void write_kv(const KvWrite& w);

}  // namespace attnkit::detail
