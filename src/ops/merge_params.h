// The plain parameter block of the merge kernel, built by src/ops/merge.cpp.
#pragma once

#include <cstdint>

#include "attnkit/tensor.h"

namespace attnkit {

// Rows are the leading dims of out (all but the last), flattened in row-major order; each
// tensor reaches row r through its own strides over those dims.
struct MergeStatesParams {
  static constexpr int kMaxRowDims = kMaxRank - 1;
  int row_dims;                         // rank of out minus one
  int64_t row_shape[kMaxRowDims];       // the leading dims of out
  int64_t rows, d_v;
  DType dtype_a, dtype_b, dtype_out;    // float32, float16 or bfloat16 each
  const void* out_a;                    // [rows..., d_v]
  const void* out_b;
  void* out;
  const float* lse_a;                   // [rows...]
  const float* lse_b;
  float* lse_out;
  int64_t out_a_stride[kMaxRank], out_b_stride[kMaxRank], out_stride[kMaxRank];  // rows..., d_v
  int64_t lse_a_stride[kMaxRowDims], lse_b_stride[kMaxRowDims], lse_out_stride[kMaxRowDims];
};

}  // namespace attnkit
