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

#include "cpu/kernels/simd.h"
#include "cpu/kernels/tiling.h"

namespace attnkit::cpu::ATTNKIT_ISA {

// The register tile of attention's Sᵀ = K · Qᵀ on pairs: a task's 48 rows are 3 vectors of
// columns, and 8 keys × 3 give 24 accumulators (4 × 3 left vdpbf16ps's latency exposed:
// 10% slower on Zen 5).
inline constexpr int kDotWideRows = 8, kDotWideVecs = 3;

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
template <class Dot, int MR, int NV>
void gemm_dot_tile(int64_t k, const uint32_t* a, int64_t lda, int64_t a_step, const uint32_t* b, int64_t ldb,
                   typename Dot::Out* c, int64_t ldc, bool accumulate) {
  typename Dot::Acc acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = accumulate ? Dot::load(c + i * ldc + j * 16) : typename Dot::Acc{};
  }
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

// c[m][n] (+)= A · B over k_pairs bf16 pairs; n a multiple of 16 (callers pad).
template <int MR, int NV>
void gemm_bf16(int64_t m, int64_t n, int64_t k_pairs, const uint32_t* a, int64_t lda, int64_t a_step,
               const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for_each_tile<GemmDotKernel<Bf16PairsDot>, MR, NV>(m, n, 16, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k_pairs, a + m0 * lda, lda, a_step, b + n0, ldb, c + m0 * ldc + n0, ldc, accumulate);
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
// c[i][·] = c[i][·] · alpha[i] + sums · scale[i] (the online softmax's rescale and the
// tile's dequantisation in one pass over C). a(i, p) = a[i * lda + p * a_step].
template <int MR, int NV>
void gemm_u8s8_rescale_tile(int64_t k, const uint32_t* a, int64_t lda, int64_t a_step, const uint32_t* b,
                            int64_t ldb, float* c, int64_t ldc, const float* alpha, const float* scale) {
  __m512i acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = __m512i{};
  }
  for (int64_t p = 0; p < k; ++p) {
    __m512i bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_si512(b + p * ldb + j * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i ai = _mm512_set1_epi32(static_cast<int>(a[i * lda + p * a_step]));
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], ai, bv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const vfloat al = vbroadcast(alpha[i]), sc = vbroadcast(scale[i]);
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {  // (GCC 12 warns on _mm512_cvtepi32_ps: vector conversions instead)
      float* ci = c + i * ldc + j * 16;
      vstore(ci, vload(ci) * al + __builtin_convertvector((vint)acc[i][j], vfloat) * sc);
    }
  }
}

struct GemmU8S8RescaleKernel {
  template <int MR, int NV>
  static constexpr auto tile = &gemm_u8s8_rescale_tile<MR, NV>;
};

// c[m][n] = c · alpha (per row) + (A · B) · scale (per row) over k_quads int8 quads (A of
// u8, B of s8); n a multiple of 16.
template <int MR, int NV>
void gemm_u8s8_rescale(int64_t m, int64_t n, int64_t k_quads, const uint32_t* a, int64_t lda, int64_t a_step,
                       const uint32_t* b, int64_t ldb, float* c, int64_t ldc, const float* alpha,
                       const float* scale) {
  for_each_tile<GemmU8S8RescaleKernel, MR, NV>(m, n, 16, [&](auto tile, int64_t m0, int64_t n0) {
    tile(k_quads, a + m0 * lda, lda, a_step, b + n0, ldb, c + m0 * ldc + n0, ldc, alpha + m0, scale + m0);
  });
}

}  // namespace attnkit::cpu::ATTNKIT_ISA

#endif  // ATTNKIT_ISA_avx512bf16
