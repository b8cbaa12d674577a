// Key-block micro-kernel for score tiles with very few query rows (decode): kLanes keys
// are dotted with each query row along the head dimension, and the partial-sum vectors are
// reduced together (transpose_sum) into row-major scores, keys along the lanes. Where
// Kᵀ·Q would pad a handful of rows to a full vector, this does only the useful
// multiply-adds.
//
// Rows go side by side: a vector holds G query rows (one per segment of S = kLanes / G
// lanes), and each key's row is read once, S elements at a time broadcast to every
// segment. So K streams through in order, once for all rows of the block; reading it
// once per row, or across all kLanes rows at each step, measured about 1.5x slower when
// K comes from memory (decode reads each key once).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA {

inline constexpr int kMaxDotRows = 8;
// Segments hold at least 4 lanes: 128 bits, the widest broadcast load without a shuffle.
inline constexpr int kMaxRowsPerVector = kLanes / 4 < 1 ? 1 : kLanes / 4;

// Chunks of a query row that stay in registers through the key loop (more are reloaded
// at every step, which made the loop load-bound).
inline constexpr int64_t kRegisterChunks = 16;

// Query rows per vector for `rows` rows of `cols` elements: the next power of two, at most
// kMaxRowsPerVector, and fewer where the row would take more than kRegisterChunks chunks.
inline int rows_per_vector(int64_t rows, int64_t cols) {
  int g = 1;
  while (g < rows && g < kMaxRowsPerVector) g *= 2;
  while (g > 1 && (cols + kLanes / g - 1) / (kLanes / g) > kRegisterChunks) g /= 2;
  return g;
}

// Query rows in the grouped layout: qg[(b * chunks + c) * kLanes + r * S + i] holds element
// c * S + i of row b * g + r (zero past `rows` and past `cols`), S = kLanes / g. Elements
// are 4 bytes (fp32, or bf16 pairs).
template <class E>
inline void group_rows(int g, int64_t rows, int64_t cols, const E* q, int64_t ldq, int64_t chunks, E* qg) {
  const int64_t seg = kLanes / g, blocks = (rows + g - 1) / g;
  std::memset(qg, 0, sizeof(E) * blocks * chunks * kLanes);
  for (int64_t r = 0; r < rows; ++r) {
    E* dst = qg + r / g * chunks * kLanes + r % g * seg;
    for (int64_t e0 = 0; e0 < cols; e0 += seg, dst += kLanes) {
      const int64_t n = cols - e0 < seg ? cols - e0 : seg;
      for (int64_t i = 0; i < n; ++i) dst[i] = q[r * ldq + e0 + i];
    }
  }
}

// s[r * lds + j] = Σ_e keys[j * ldk + e] · q[r][e] for r < rows, j < kLanes, with q grouped
// G rows per vector over `chunks` chunks of S elements. Dot is the multiply-add of one
// element type: fp32, or bf16 pairs (vdpbf16ps). C > 0 is a compile-time chunk count: Q
// then stays in registers (loading it at every step made the loop load-bound).
template <int G, class Dot, int C>
inline void dot_key_block_grouped(int64_t rows, int64_t chunks, const float* keys, int64_t ldk, const float* qg,
                                  float* s, int64_t lds) {
  constexpr int S = kLanes / G;
  for (int64_t r0 = 0; r0 < rows; r0 += G, qg += chunks * kLanes) {
    vfloat q[C > 0 ? C : 1];
#pragma GCC unroll 32
    for (int c = 0; c < C; ++c) q[c] = vload(qg + c * kLanes);
    vfloat out[G];
#pragma GCC unroll 4
    for (int n = 0; n < G; ++n) {  // S keys at a time, each row read in address order
      vfloat acc[S];
#pragma GCC unroll 16
      for (int t = 0; t < S; ++t) {
        const float* key = keys + (n * S + t) * ldk;
        vfloat even = {}, odd = {};  // two dependency chains
        if constexpr (C > 0) {
#pragma GCC unroll 32
          for (int c = 0; c < C; c += 2) {
            even = Dot::madd(even, q[c], vload_segment<S>(key + c * S));
            if (c + 1 < C) odd = Dot::madd(odd, q[c + 1], vload_segment<S>(key + (c + 1) * S));
          }
        } else {
          int64_t c = 0;
          for (; c + 1 < chunks; c += 2) {
            even = Dot::madd(even, vload(qg + c * kLanes), vload_segment<S>(key + c * S));
            odd = Dot::madd(odd, vload(qg + (c + 1) * kLanes), vload_segment<S>(key + (c + 1) * S));
          }
          if (c < chunks) even = Dot::madd(even, vload(qg + c * kLanes), vload_segment<S>(key + c * S));
        }
        acc[t] = even + odd;
      }
      transpose_sum_rounds<S, S, S>(acc);  // segment r: row r0 + r, keys n * S + [0, S)
      out[n] = acc[0];
    }
    transpose_segments<G>(out);  // out[r]: row r0 + r, all keys
    for (int r = 0; r < G && r0 + r < rows; ++r) vstore(s + (r0 + r) * lds, out[r]);
  }
}

template <int G, class Dot>
inline void dot_key_block_chunks(int64_t rows, int64_t chunks, const float* keys, int64_t ldk, const float* qg,
                                 float* s, int64_t lds) {
  static_assert(kRegisterChunks == 16, "compiled chunk counts");
  if (chunks == 16) return dot_key_block_grouped<G, Dot, 16>(rows, chunks, keys, ldk, qg, s, lds);
  if (chunks == 8) return dot_key_block_grouped<G, Dot, 8>(rows, chunks, keys, ldk, qg, s, lds);
  dot_key_block_grouped<G, Dot, 0>(rows, chunks, keys, ldk, qg, s, lds);
}

template <class Dot>
inline void dot_key_block_rows(int g, int64_t rows, int64_t chunks, const float* keys, int64_t ldk, const float* qg,
                               float* s, int64_t lds) {
  if constexpr (kMaxRowsPerVector >= 4) {
    if (g == 4) return dot_key_block_chunks<4, Dot>(rows, chunks, keys, ldk, qg, s, lds);
  }
  if constexpr (kMaxRowsPerVector >= 2) {
    if (g == 2) return dot_key_block_chunks<2, Dot>(rows, chunks, keys, ldk, qg, s, lds);
  }
  dot_key_block_chunks<1, Dot>(rows, chunks, keys, ldk, qg, s, lds);
}

struct Fp32Dot {
  static vfloat madd(vfloat acc, vfloat q, vfloat k) { return acc + q * k; }
};

// fp32 keys and q (grouped g rows per vector, see group_rows): chunks of kLanes / g.
inline void dot_key_block(int g, int64_t rows, int64_t chunks, const float* keys, int64_t ldk, const float* qg,
                          float* s, int64_t lds) {
  dot_key_block_rows<Fp32Dot>(g, rows, chunks, keys, ldk, qg, s, lds);
}

#if defined(ATTNKIT_ISA_avx512bf16)
// bf16 pairs (element 2p low, 2p + 1 high): products exact, summed in fp32; gemm_dot.h's
// instruction on this kernel's vector types.
struct Bf16PairDot {
  static vfloat madd(vfloat acc, vfloat q, vfloat k) {
    return (vfloat)Bf16PairsDot::madd((__m512)acc, (__m512i)q, (__m512i)k);
  }
};

// The same on bf16 pairs: keys rows and q chunks count pairs (ldk, chunks of kLanes / g pairs).
inline void dot_key_block_bf16(int g, int64_t rows, int64_t chunks, const uint32_t* keys, int64_t ldk,
                               const uint32_t* qg, float* s, int64_t lds) {
  dot_key_block_rows<Bf16PairDot>(g, rows, chunks, reinterpret_cast<const float*>(keys), ldk,
                                  reinterpret_cast<const float*>(qg), s, lds);
}
#endif

}  // namespace attnkit::cpu::ATTNKIT_ISA
