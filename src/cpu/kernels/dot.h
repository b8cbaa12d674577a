// Key-block micro-kernel for score tiles with very few query rows (decode): each of kLanes
// keys is dotted with each query row along the head dimension (the SIMD axis), and the
// kLanes partial-sum vectors of a row are reduced together (transpose_sum) into one vector
// of scores, keys along the lanes. Where Kᵀ·Q would pad a handful of rows to a full
// vector, this does only the useful multiply-adds, and leaves row-major scores that the
// row-wise softmax and P·V read directly.
#pragma once

#include <cstdint>

#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA {

inline constexpr int kMaxDotRows = 8;

// s[r * lds + j] = Σ_{p < k} keys[j * ldk + p] · q[r * ldq + p] for r < rows, j < kLanes;
// k is a multiple of kLanes (callers zero-pad keys and q alike).
inline void dot_key_block(int64_t rows, int64_t k, const float* keys, int64_t ldk, const float* q, int64_t ldq,
                          float* s, int64_t lds) {
  for (int64_t r = 0; r < rows; ++r) {
    vfloat acc[kLanes] = {};
    for (int64_t p = 0; p < k; p += kLanes) {
      const vfloat qv = vload(q + r * ldq + p);
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) acc[j] += vload(keys + j * ldk + p) * qv;
    }
    vstore(s + r * lds, transpose_sum(acc));
  }
}

#if defined(ATTNKIT_ISA_avx512bf16)
// The same on bf16 pairs (vdpbf16ps, exact products summed in fp32): keys and q rows hold
// k_pairs pairs, a multiple of 16.
inline void dot_key_block_bf16(int64_t rows, int64_t k_pairs, const uint32_t* keys, int64_t ldk, const uint32_t* q,
                               int64_t ldq, float* s, int64_t lds) {
  for (int64_t r = 0; r < rows; ++r) {
    vfloat acc[kLanes] = {};
    for (int64_t p = 0; p < k_pairs; p += 16) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + r * ldq + p);
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) {
        acc[j] = (vfloat)_mm512_dpbf16_ps((__m512)acc[j], qv, (__m512bh)_mm512_loadu_si512(keys + j * ldk + p));
      }
    }
    vstore(s + r * lds, transpose_sum(acc));
  }
}
#endif

}  // namespace attnkit::cpu::ATTNKIT_ISA
