// The register-tiled micro-kernel every attention op shares: C (+)= A · B for small tiles,
// A read element by element (broadcast, any two strides) and B by full vectors (B's
// columns are the SIMD axis). Attention computes Sᵀ = K · Qᵀ (K as stored, Q packed
// transposed once per task) and O += P · V with P read from Sᵀ through its strides.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/kernels/simd.h"
#include "cpu/kernels/tiling.h"

namespace attnkit::cpu::ATTNKIT_ISA {

// Register tiles: MR rows × NV vectors of C live in registers. AVX-512 has 32 vector
// registers (24 accumulators); AVX2 and SSE have 16 (12 accumulators).
// Decode's P·V (few rows) takes tiles of whole 128-column rows, so each V row is read in
// address order in one go: from memory, two passes over half rows measured ~1.5x slower.
#if defined(ATTNKIT_ISA_avx512)
inline constexpr int kTallRows = 6, kTallVecs = 4;  // for C with few columns (P·V)
inline constexpr int kWideRows = 4, kWideVecs = 6;  // for C with many columns (Kᵀ·Q)
inline constexpr int kRowRows = 2, kRowVecs = 8;    // for C with few rows (decode P·V)
#else
inline constexpr int kTallRows = 4, kTallVecs = 3;
inline constexpr int kWideRows = 4, kWideVecs = 3;
inline constexpr int kRowRows = 4, kRowVecs = 3;
#endif

// NV vectors of B's row at b: fp32 as stored, or bf16 widened without shuffles: each
// 32-bit pair (even element low, odd high) gives its even element by a shift and its odd
// element by a mask, so vector 2i holds the even and 2i+1 the odd columns of the 2·kLanes
// columns at 2i·kLanes ("split bf16": C's columns come out in that order too).
template <int NV>
inline void load_b(const float* b, vfloat (&bv)[NV]) {
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) bv[j] = vload(b + j * kLanes);
}
template <int NV>
inline void load_b(const uint16_t* b, vfloat (&bv)[NV]) {
  static_assert(NV % 2 == 0, "split bf16 comes in pairs of vectors");
#pragma GCC unroll 8
  for (int j = 0; j < NV; j += 2) {
    vint pairs;
    std::memcpy(&pairs, b + j * kLanes, sizeof pairs);
    bv[j] = (vfloat)(pairs << 16);
    bv[j + 1] = (vfloat)(pairs & int32_t(0xFFFF0000u));
  }
}

// c[MR][NV*kLanes] (+)= a[MR][k] · b[k][NV*kLanes], with a(i, p) = a[i * lda + p * a_step];
// B is fp32, or bf16 in split order (load_b).
template <int MR, int NV, class B = float>
void gemm_tile(int64_t k, const float* a, int64_t lda, int64_t a_step, const B* b, int64_t ldb,
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
    load_b(b + p * ldb, bv);
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
// Tiles of the split-bf16 B counted in pairs of vectors.
struct GemmSplitBf16Kernel {
  template <int MR, int NV2>
  static constexpr auto tile = &gemm_tile<MR, 2 * NV2, uint16_t>;
};

// c[m][n] (+)= a[m][k] · b[k][n] with a(i, p) = a[i * lda + p * a_step], in MR × NV-vector
// register tiles, each summing over its rows' band only (tiling.h); n must be a multiple of kLanes
// (callers pad B and C).
template <int MR, int NV, class Band = NoBand>
void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, int64_t a_step,
          const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate, Band band = {}) {
  for_each_tile<GemmKernel, MR, NV>(m, n, kLanes, [&](auto tile, int64_t m0, int64_t n0) {
    const auto [p0, p1] = tile_range(band, m0, std::min<int64_t>(MR, m - m0), k);
    tile(p1 - p0, a + m0 * lda + p0 * a_step, lda, a_step, b + p0 * ldb + n0, ldb, c + m0 * ldc + n0, ldc,
         accumulate);
  });
}

// gemm<kWideRows, kWideVecs> for C with many columns; with at most 3 vectors of columns (the
// forward's 48 query rows as the SIMD axis) taller tiles of 8 rows × 3 vectors, so that 24
// accumulators stay busy rather than 12.
inline void gemm_wide(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, int64_t a_step,
                      const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
#if defined(ATTNKIT_ISA_avx512)
  if (n <= 3 * kLanes) return gemm<8, 3>(m, n, k, a, lda, a_step, b, ldb, c, ldc, accumulate);
#endif
  gemm<kWideRows, kWideVecs>(m, n, k, a, lda, a_step, b, ldb, c, ldc, accumulate);
}

// The same with B's rows in bf16, read in place (n a multiple of 2·kLanes; tiles of NV / 2
// pairs of vectors); C's columns come out in split order: within each 2·kLanes block, the
// even columns, then the odd ones (split_bf16_column maps them back).
template <int MR, int NV>
void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, int64_t a_step,
          const uint16_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for_each_tile<GemmSplitBf16Kernel, MR, NV / 2>(m, n, 2 * kLanes, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k, a + m0 * lda, lda, a_step, b + n0, ldb, c + m0 * ldc + n0, ldc, accumulate);
  });
}

// Where column d of a split-bf16 product lies in C's row.
inline int64_t split_bf16_column(int64_t d) {
  const int64_t block = d / (2 * kLanes) * (2 * kLanes), i = d % (2 * kLanes);
  return block + (i % 2) * kLanes + i / 2;
}

// dst[d] = src[split_bf16_column(d)] for d < n (a multiple of 2·kLanes): each block's even
// and odd vectors interleaved back into column order.
template <int... L>
inline void unsplit_bf16_block(const float* src, float* dst, std::integer_sequence<int, L...>) {
  const vfloat even = vload(src), odd = vload(src + kLanes);
  vstore(dst, __builtin_shufflevector(even, odd, (L / 2 + L % 2 * kLanes)...));
  vstore(dst + kLanes, __builtin_shufflevector(even, odd, ((L + kLanes) / 2 + L % 2 * kLanes)...));
}
inline void unsplit_bf16_row(const float* src, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; d += 2 * kLanes) {
    unsplit_bf16_block(src + d, dst + d, std::make_integer_sequence<int, kLanes>{});
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
