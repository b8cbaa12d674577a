// The register-tiled micro-kernel every attention op shares: C (+)= A · B for small tiles,
// A read element by element (broadcast, any two strides) and B by full vectors (B's
// columns are the SIMD axis). Attention computes Sᵀ = K · Qᵀ (K as stored, Q packed
// transposed once per task) and O += P · V with P read from Sᵀ through its strides.
#pragma once

#include <array>
#include <cstdint>
#include <utility>

#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA {

// Register tile: kTileRows rows × kTileVecs vectors of C live in registers.
#if defined(ATTNKIT_ISA_avx512)
inline constexpr int kTileRows = 6, kTileVecs = 4;  // 24 of 32 zmm
#else
inline constexpr int kTileRows = 4, kTileVecs = 3;  // 12 of 16 ymm/xmm
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

using GemmTileFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                            int64_t, bool);

template <int MR, int... NV>
constexpr auto gemm_row_of_tiles(std::integer_sequence<int, NV...>) {
  return std::array<GemmTileFn, sizeof...(NV)>{&gemm_tile<MR, NV + 1>...};
}
template <int... MR>
constexpr auto gemm_tiles(std::integer_sequence<int, MR...>) {
  return std::array{gemm_row_of_tiles<MR + 1>(std::make_integer_sequence<int, kTileVecs>{})...};
}
// gemm_tile<mr, nv> for every 1 <= mr <= kTileRows, 1 <= nv <= kTileVecs (edge tiles).
inline constexpr auto kGemmTiles = gemm_tiles(std::make_integer_sequence<int, kTileRows>{});

// c[m][n] (+)= a[m][k] · b[k][n] with a(i, p) = a[i * lda + p * a_step]; n must be a
// multiple of kLanes (callers pad B and C).
inline void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, int64_t a_step,
                 const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < n; n0 += kTileVecs * kLanes) {
    const int64_t nv = (n - n0) / kLanes < kTileVecs ? (n - n0) / kLanes : kTileVecs;
    for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
      const int64_t mr = m - m0 < kTileRows ? m - m0 : kTileRows;
      kGemmTiles[mr - 1][nv - 1](k, a + m0 * lda, lda, a_step, b + n0, ldb, c + m0 * ldc + n0,
                                 ldc, accumulate);
    }
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
