// The online-softmax update (FlashAttention's running max and sum), one row at a time,
// in the log2 domain: scores arrive pre-multiplied by log2(e) so exp becomes exp2.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA {

// Folds scores s[0, n) (n a multiple of kLanes; -inf where masked) into the row's running
// max m and sum l. Overwrites s with P = 2^(s - m_new) and returns the factor 2^(m - m_new)
// by which the row's output accumulator must be rescaled.
inline float online_softmax_row(float* s, int64_t n, float& m, float& l) {
  vfloat vmx = vbroadcast(-INFINITY);
  for (int64_t j = 0; j < n; j += kLanes) vmx = vmax(vmx, vload(s + j));
  const float tile_max = hmax(vmx);
  const float m_new = tile_max > m ? tile_max : m;
  if (m_new == -INFINITY) {  // nothing visible yet: P = 0, state unchanged
    for (int64_t j = 0; j < n; j += kLanes) vstore(s + j, vfloat{});
    return 1.0f;
  }
  const vfloat vm = vbroadcast(m_new);
  vfloat vsum{};
  for (int64_t j = 0; j < n; j += kLanes) {
    const vfloat p = vexp2(vload(s + j) - vm);
    vstore(s + j, p);
    vsum += p;
  }
  const float alpha = std::exp2(m - m_new);
  l = l * alpha + hsum(vsum);
  m = m_new;
  return alpha;
}

// row[0, n) *= factor (n a multiple of kLanes).
inline void scale_row(float* row, int64_t n, float factor) {
  const vfloat f = vbroadcast(factor);
  for (int64_t j = 0; j < n; j += kLanes) vstore(row + j, vload(row + j) * f);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
