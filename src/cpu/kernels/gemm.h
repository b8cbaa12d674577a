// The register-tiled micro-kernel every attention op shares: C (+)= A · B for small tiles,
// A read element by element (broadcast, any two strides) and B by full vectors (B's
// columns are the SIMD axis). Attention computes Sᵀ = K · Qᵀ (K as stored, Q packed
// transposed once per task) and O += P · V with P read from Sᵀ through its strides.
#pragma once

#include <cstdint>

#include "cpu/kernels/simd.h"
#include "cpu/kernels/tiling.h"

namespace attnkit::cpu::ATTNKIT_ISA {

// Register tiles: MR rows × NV vectors of C live in registers. AVX-512 has 32 vector
// registers (24 accumulators); AVX2 and SSE have 16 (12 accumulators).
#if defined(ATTNKIT_ISA_avx512)
inline constexpr int kTallRows = 6, kTallVecs = 4;  // for C with few columns (P·V)
inline constexpr int kWideRows = 4, kWideVecs = 6;  // for C with many columns (Kᵀ·Q)
#else
inline constexpr int kTallRows = 4, kTallVecs = 3;
inline constexpr int kWideRows = 4, kWideVecs = 3;
#endif

// c[MR][NV*kLanes] (+)= a[MR][k] · b[k][NV*kLanes], with a(i, p) = a[i * lda + p * a_step].
template <int MR, int NV>
void gemm_tile(int64_t k, const float* a, int64_t lda, int64_t a_step, const float* b, int64_t ldb,
               float* c, int64_t ldc, bool accumulate) {
  vfloat acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      acc[i][j] = accumulate ? vload(c + i * ldc + j * kLanes) : vfloat{};
    }
  }
  for (int64_t p = 0; p < k; ++p) {
    vfloat bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = vload(b + p * ldb + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const vfloat ai = vbroadcast(a[i * lda + p * a_step]);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] += ai * bv[j];
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) vstore(c + i * ldc + j * kLanes, acc[i][j]);
  }
}

struct GemmKernel {
  template <int MR, int NV>
  static constexpr auto tile = &gemm_tile<MR, NV>;
};

// c[m][n] (+)= a[m][k] · b[k][n] with a(i, p) = a[i * lda + p * a_step], in MR × NV-vector
// register tiles; n must be a multiple of kLanes (callers pad B and C).
template <int MR, int NV>
void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, int64_t a_step,
          const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for_each_tile<GemmKernel, MR, NV>(m, n, kLanes, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k, a + m0 * lda, lda, a_step, b + n0, ldb, c + m0 * ldc + n0, ldc, accumulate);
  });
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
