// The bf16 dot-product micro-kernel (AVX512_BF16 `vdpbf16ps`): C (+)= A · B where the
// reduction axis comes in pairs, each 32-bit element holding two bf16 values. On the CPUs
// seen here (Zen 4) it does 32 multiply-adds per instruction at nearly twice the fp32 FMA
// rate; products of bf16 values are exact in fp32 and sums accumulate in fp32.
// Only the avx512bf16 variant compiles it.
#pragma once

#if defined(ATTNKIT_ISA_avx512bf16)

#include <cstdint>
#include <cstring>

#include "cpu/kernels/simd.h"
#include "cpu/kernels/tiling.h"

namespace attnkit::cpu::ATTNKIT_ISA {

// c[MR][NV*16] (+)= Σ_p a(i, p) ⊙ b[p][NV*16], where a(i, p) = a[i * lda + p * a_step] and
// every element is a bf16 pair (lo, hi): each fp32 lane adds a.lo·b.lo + a.hi·b.hi.
template <int MR, int NV>
void gemm_bf16_tile(int64_t k_pairs, const uint32_t* a, int64_t lda, int64_t a_step, const uint32_t* b,
                    int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = accumulate ? _mm512_loadu_ps(c + i * ldc + j * 16) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k_pairs; ++p) {
    __m512bh bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + p * ldb + j * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + p * a_step]));
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], ai, bv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, acc[i][j]);
  }
}

struct GemmBf16Kernel {
  template <int MR, int NV>
  static constexpr auto tile = &gemm_bf16_tile<MR, NV>;
};

// c[m][n] (+)= A · B over k_pairs bf16 pairs; n a multiple of 16 (callers pad).
template <int MR, int NV>
void gemm_bf16(int64_t m, int64_t n, int64_t k_pairs, const uint32_t* a, int64_t lda, int64_t a_step,
               const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for_each_tile<GemmBf16Kernel, MR, NV>(m, n, 16, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k_pairs, a + m0 * lda, lda, a_step, b + n0, ldb, c + m0 * ldc + n0, ldc, accumulate);
  });
}

}  // namespace attnkit::cpu::ATTNKIT_ISA

#endif  // ATTNKIT_ISA_avx512bf16
