// The dot-product micro-kernels of avx512bf16: C (+)= A · B where the reduction axis comes
// packed in 32-bit elements, each instruction summing the products within one element.
//   vdpbf16ps (AVX512_BF16): bf16 pairs; products exact in fp32, sums in fp32. On the CPUs
//     seen here (Zen 4) 32 multiply-adds per instruction at nearly twice the fp32 FMA rate.
//   vpdpbusd (AVX512-VNNI): int8 quads, A unsigned and B signed; sums exact in int32. 64
//     multiply-adds per instruction.
// One register tile serves both, with the instruction as a policy. Only the avx512bf16
// variant (compiled with both extensions) has them.
#pragma once

#if defined(ATTNKIT_ISA_avx512bf16)

#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/kernels/simd.h"
#include "cpu/kernels/tiling.h"

namespace attnkit::cpu::ATTNKIT_ISA {

// The register tile of attention's Sᵀ = K · Qᵀ on pairs: a task's 48 rows are 3 vectors of
// columns, and 8 keys × 3 give 24 accumulators (4 × 3 left vdpbf16ps's latency exposed:
// 10% slower on Zen 5).
inline constexpr int kDotWideRows = 8, kDotWideVecs = 3;
// Decode's P·V from V's rows (gemm_bf16_row_pairs): 4 rows × 2 pairs of vectors (16 accumulators).
inline constexpr int kRowPairRows = 4, kRowPairVecs = 2;

// bf16 pairs (lo, hi): each fp32 lane adds a.lo·b.lo + a.hi·b.hi.
struct Bf16PairsDot {
  using Acc = __m512;
  using Out = float;
  static Acc load(const float* c) { return _mm512_loadu_ps(c); }
  static void store(float* c, Acc v) { _mm512_storeu_ps(c, v); }
  static Acc madd(Acc acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
};

// u8 quads of A with s8 quads of B: each int32 lane adds the four products.
struct U8S8QuadsDot {
  using Acc = __m512i;
  using Out = int32_t;
  static Acc load(const int32_t* c) { return _mm512_loadu_si512(c); }
  static void store(int32_t* c, Acc v) { _mm512_storeu_si512(c, v); }
  static Acc madd(Acc acc, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(acc, a, b); }
};

// c[MR][NV*16] (+)= Σ_p a(i, p) ⊙ b[p][NV*16], where a(i, p) = a[i * lda + p * a_step] is
// broadcast and B is read by vectors; ⊙ is Dot's instruction on packed elements.
// acc[MR][NV] += Σ_p a(i, p) ⊙ b[p][NV*16] over k packed elements, a(i, p) = a[i * lda + p *
// a_step] broadcast: the k loop every tile below shares.
template <class Dot, int MR, int NV>
inline void dot_tile_sums(int64_t k, const uint32_t* a, int64_t lda, int64_t a_step, const uint32_t* b, int64_t ldb,
                          typename Dot::Acc (&acc)[MR][NV]) {
  for (int64_t p = 0; p < k; ++p) {
    __m512i bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_si512(b + p * ldb + j * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      // memcpy: A may be bf16 read in place from an odd element (2-byte aligned only); it
      // compiles to the same broadcast load.
      uint32_t a_ip;
      std::memcpy(&a_ip, a + i * lda + p * a_step, sizeof a_ip);
      const __m512i ai = _mm512_set1_epi32(static_cast<int>(a_ip));
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = Dot::madd(acc[i][j], ai, bv[j]);
    }
  }
}

// Never inlined: inside gemm_u8s8_rescale_tile GCC 12 spilled its accumulators on every
// step of the k loop.
template <class Dot, int MR, int NV>
[[gnu::noinline]] void gemm_dot_tile(int64_t k, const uint32_t* a, int64_t lda, int64_t a_step,
                                     const uint32_t* b, int64_t ldb, typename Dot::Out* c, int64_t ldc,
                                     bool accumulate) {
  typename Dot::Acc acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = accumulate ? Dot::load(c + i * ldc + j * 16) : typename Dot::Acc{};
  }
  dot_tile_sums<Dot>(k, a, lda, a_step, b, ldb, acc);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) Dot::store(c + i * ldc + j * 16, acc[i][j]);
  }
}

template <class Dot>
struct GemmDotKernel {
  template <int MR, int NV>
  static constexpr auto tile = &gemm_dot_tile<Dot, MR, NV>;
};

// c[m][n] (+)= A · B over k_pairs bf16 pairs, each tile over its rows' band of pairs only
// (tiling.h); n a multiple of 16 (callers pad).
template <int MR, int NV, class Band = NoBand>
void gemm_bf16(int64_t m, int64_t n, int64_t k_pairs, const uint32_t* a, int64_t lda, int64_t a_step,
               const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate, Band band = {}) {
  for_each_tile<GemmDotKernel<Bf16PairsDot>, MR, NV>(m, n, 16, [&](auto tile, int64_t m0, int64_t n0) {
    const auto [p0, p1] = tile_range(band, m0, std::min<int64_t>(MR, m - m0), k_pairs);
    tile(p1 - p0, a + m0 * lda + p0 * a_step, lda, a_step, b + p0 * ldb + n0, ldb, c + m0 * ldc + n0, ldc,
         accumulate);
  });
}

// Decode's P·V on bf16 pairs straight from V's bf16 rows: c[MR][NV2 * 32] (+)= Σ_p a[i * lda + p]
// ⊙ (b[2p], b[2p + 1]), each pair of consecutive rows of B interleaved in registers
// (vpunpck{l,h}wd) rather than staged as pairs in memory. Those interleave within 128-bit
// lanes, so C's columns come in pair order (unpair_bf16_row puts them back).
template <int MR, int NV2>
void gemm_bf16_row_pairs_tile(int64_t k_pairs, const uint32_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                              float* c, int64_t ldc, bool accumulate) {
  __m512 acc[MR][2 * NV2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NV2; ++j) acc[i][j] = accumulate ? _mm512_loadu_ps(c + i * ldc + j * 16) : __m512{};
  }
  for (int64_t p = 0; p < k_pairs; ++p) {
    __m512i bv[2 * NV2];
    const uint16_t* even = b + 2 * p * ldb;
#pragma GCC unroll 8
    for (int j = 0; j < NV2; ++j) {
      const __m512i x = _mm512_loadu_si512(even + j * 32), y = _mm512_loadu_si512(even + ldb + j * 32);
      bv[2 * j] = _mm512_unpacklo_epi16(x, y);
      bv[2 * j + 1] = _mm512_unpackhi_epi16(x, y);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i ai = _mm512_set1_epi32(static_cast<int>(a[i * lda + p]));
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NV2; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)ai, (__m512bh)bv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NV2; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, acc[i][j]);
  }
}

struct GemmBf16RowPairsKernel {
  template <int MR, int NV2>
  static constexpr auto tile = &gemm_bf16_row_pairs_tile<MR, NV2>;
};

// c[m][n] (+)= A · B over k_pairs pairs of B's bf16 rows (2 · k_pairs rows of ldb elements);
// n a multiple of 32; C's columns in pair order.
template <int MR, int NV2>
void gemm_bf16_row_pairs(int64_t m, int64_t n, int64_t k_pairs, const uint32_t* a, int64_t lda, const uint16_t* b,
                         int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for_each_tile<GemmBf16RowPairsKernel, MR, NV2>(m, n, 32, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k_pairs, a + m0 * lda, lda, b + n0, ldb, c + m0 * ldc + n0, ldc, accumulate);
  });
}

// Where column d of a gemm_bf16_row_pairs product lies in C's row: within each block of 32,
// columns 8l + i (i < 4) at 4l + i, columns 8l + 4 + i at 16 + 4l + i.
inline int64_t pair_order_column(int64_t d) {
  const int64_t i = d % 32;
  return d - i + (i % 8 >= 4 ? 16 : 0) + i / 8 * 4 + i % 4;
}

// dst[d] = src[pair_order_column(d)] for d < n (a multiple of 32).
template <int... L>
inline void unpair_bf16_block(const float* src, float* dst, std::integer_sequence<int, L...>) {
  const vfloat lo = vload(src), hi = vload(src + 16);
  vstore(dst, __builtin_shufflevector(lo, hi, ((L % 8 >= 4 ? 16 : 0) + L / 8 * 4 + L % 4)...));
  vstore(dst + 16, __builtin_shufflevector(lo, hi, ((L % 8 >= 4 ? 16 : 0) + (L + 16) / 8 * 4 + L % 4)...));
}
inline void unpair_bf16_row(const float* src, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; d += 32) unpair_bf16_block(src + d, dst + d, std::make_integer_sequence<int, 16>{});
}

// The lightning indexer's products with their reduction: for MR rows of A (keys, bf16 pairs)
// against NV vectors of B's columns (one query row's heads), s = A · B stays in registers and
// out[i] += Σ_c ReLU(s[i][c]) · w[c] (NaN kept), so the scores are never stored.
template <int MR, int NV>
void gemm_bf16_relu_dot_tile(int64_t k_pairs, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                             const float* w, float* out) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = __m512{};
  }
  dot_tile_sums<Bf16PairsDot>(k_pairs, a, lda, 1, b, ldb, acc);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    vfloat sum{};
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      const vfloat v = (vfloat)acc[i][j];
      sum += (v < 0.0f ? vfloat{} : v) * vload(w + j * 16);
    }
    out[i] += hsum(sum);
  }
}

struct GemmBf16ReluDotKernel {
  template <int MR, int NV>
  static constexpr auto tile = &gemm_bf16_relu_dot_tile<MR, NV>;
};

// out[i] += Σ_c ReLU((A · B)[i][c]) · w[c] for i < m, c < n (a multiple of 16), over k_pairs
// bf16 pairs: A's rows of lda pairs, B's pairs [k_pairs][ldb].
template <int MR, int NV>
void gemm_bf16_relu_dot(int64_t m, int64_t n, int64_t k_pairs, const uint32_t* a, int64_t lda, const uint32_t* b,
                        int64_t ldb, const float* w, float* out) {
  for_each_tile<GemmBf16ReluDotKernel, MR, NV>(m, n, 16, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k_pairs, a + m0 * lda, lda, b + n0, ldb, w + n0, out + m0);
  });
}

// c[m][n] = A · B over k_quads int8 quads (A rows of u8, B of s8); n a multiple of 16.
template <int MR, int NV>
void gemm_u8s8(int64_t m, int64_t n, int64_t k_quads, const uint32_t* a, int64_t lda, const uint32_t* b,
               int64_t ldb, int32_t* c, int64_t ldc) {
  for_each_tile<GemmDotKernel<U8S8QuadsDot>, MR, NV>(m, n, 16, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k_quads, a + m0 * lda, lda, 1, b + n0, ldb, c + m0 * ldc + n0, ldc, false);
  });
}

// The u8 × s8 tile of sage's int8 P·V: the int32 sums of one key tile, then in registers
// c[i][j] = c[i][j] · alpha[i] + sums[i][j] · scale[i] · col_scale[j] (the online softmax's
// rescale and the tile's dequantisation in one pass over C). a(i, p) = a[i * lda + p * a_step].
template <int MR, int NV>
void gemm_u8s8_rescale_tile(int64_t k, const uint32_t* a, int64_t lda, int64_t a_step, const uint32_t* b,
                            int64_t ldb, float* c, int64_t ldc, const float* alpha, const float* scale,
                            const float* col_scale) {
  // The sums pass through L1 from gemm_dot_tile (kept out of line): with the rescale in
  // the same function GCC 12 stored every accumulator to the stack on each step of the k
  // loop, and this tile took 1.4x the time.
  alignas(64) int32_t sums[MR][NV * 16];
  gemm_dot_tile<U8S8QuadsDot, MR, NV>(k, a, lda, a_step, b, ldb, sums[0], NV * 16, false);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const vfloat al = vbroadcast(alpha[i]), sc = vbroadcast(scale[i]);
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      vint s;
      std::memcpy(&s, sums[i] + j * 16, sizeof s);
      float* ci = c + i * ldc + j * 16;
      vstore(ci, vload(ci) * al + __builtin_convertvector(s, vfloat) * sc * vload(col_scale + j * 16));
    }
  }
}

struct GemmU8S8RescaleKernel {
  template <int MR, int NV>
  static constexpr auto tile = &gemm_u8s8_rescale_tile<MR, NV>;
};

// c[m][n] = c · alpha (per row) + (A · B) · scale (per row) · col_scale (per column) over
// k_quads int8 quads (A of u8, B of s8); n a multiple of 16.
template <int MR, int NV>
void gemm_u8s8_rescale(int64_t m, int64_t n, int64_t k_quads, const uint32_t* a, int64_t lda, int64_t a_step,
                       const uint32_t* b, int64_t ldb, float* c, int64_t ldc, const float* alpha,
                       const float* scale, const float* col_scale) {
  for_each_tile<GemmU8S8RescaleKernel, MR, NV>(m, n, 16, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k_quads, a + m0 * lda, lda, a_step, b + n0, ldb, c + m0 * ldc + n0, ldc, alpha + m0, scale + m0,
         col_scale + n0);
  });
}

}  // namespace attnkit::cpu::ATTNKIT_ISA

#endif  // ATTNKIT_ISA_avx512bf16
