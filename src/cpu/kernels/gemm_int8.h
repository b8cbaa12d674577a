// The int8 dot-product micro-kernel (AVX512-VNNI `vpdpbusd`): C += A · B with the
// reduction axis in quads, each 32-bit element holding four 8-bit values; A unsigned, B
// signed, sums exact in int32. 64 multiply-adds per instruction. Only the avx512bf16
// variant (compiled with VNNI) has it.
#pragma once

#if defined(ATTNKIT_ISA_avx512bf16)

#include <cstdint>

#include "cpu/kernels/simd.h"
#include "cpu/kernels/tiling.h"

namespace attnkit::cpu::ATTNKIT_ISA {

// c[MR][NV*16] = Σ_p a[i * lda + p] ⊙ b[p][NV*16]: each int32 lane adds the four products
// of its u8 quad of a with its s8 quad of b.
template <int MR, int NV>
void gemm_u8s8_tile(int64_t k_quads, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                    int32_t* c, int64_t ldc) {
  __m512i acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_si512();
  }
  for (int64_t p = 0; p < k_quads; ++p) {
    __m512i bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_si512(b + p * ldb + j * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i ai = _mm512_set1_epi32(static_cast<int>(a[i * lda + p]));
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], ai, bv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) _mm512_storeu_si512(c + i * ldc + j * 16, acc[i][j]);
  }
}

struct GemmU8S8Kernel {
  template <int MR, int NV>
  static constexpr auto tile = &gemm_u8s8_tile<MR, NV>;
};

// c[m][n] = A · B over k_quads quads; n a multiple of 16 (callers pad).
template <int MR, int NV>
void gemm_u8s8(int64_t m, int64_t n, int64_t k_quads, const uint32_t* a, int64_t lda, const uint32_t* b,
               int64_t ldb, int32_t* c, int64_t ldc) {
  for_each_tile<GemmU8S8Kernel, MR, NV>(m, n, 16, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k_quads, a + m0 * lda, lda, b + n0, ldb, c + m0 * ldc + n0, ldc);
  });
}

}  // namespace attnkit::cpu::ATTNKIT_ISA

#endif  // ATTNKIT_ISA_avx512bf16
