// The SIMD vocabulary of the CPU micro-kernels, written once with GCC/Clang vector
// extensions and compiled per ISA: 16 float lanes (zmm) on AVX-512, 8 (ymm) on AVX2,
// 4 (xmm) on the portable path. Each ISA build gets its own namespace (ATTNKIT_ISA).
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#ifndef ATTNKIT_ISA
#error "kernel headers are compiled per ISA: define ATTNKIT_ISA"
#endif

namespace attnkit::cpu::ATTNKIT_ISA {

#if defined(ATTNKIT_ISA_avx512)
inline constexpr int kLanes = 16;
#elif defined(ATTNKIT_ISA_avx2)
inline constexpr int kLanes = 8;
#else
inline constexpr int kLanes = 4;
#endif

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
// Spelled with intrinsics: GCC turns the portable spellings into 0 + x or lane inserts.
inline vfloat vbroadcast(float x) {
#if defined(ATTNKIT_ISA_avx512)
  return (vfloat)_mm512_set1_ps(x);
#elif defined(ATTNKIT_ISA_avx2)
  return (vfloat)_mm256_set1_ps(x);
#elif defined(__SSE2__)
  return (vfloat)_mm_set1_ps(x);
#else
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
#endif
}
// The running max a against new values b: a NaN in b never wins (a NaN score poisons its
// row through exp2 instead), so the max stays the max of the other scores and exp2 only
// ever sees s - max <= 0 or NaN. (a > b ? a : b let a NaN in b through and reset the max.)
inline vfloat vmax(vfloat a, vfloat b) { return b > a ? b : a; }
inline float hmax(vfloat v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
// Bit i set where a[i] > b[i] (clear where either is NaN).
inline uint32_t lanes_greater(vfloat a, vfloat b) {
#if defined(ATTNKIT_ISA_avx512)
  return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GT_OQ);
#elif defined(ATTNKIT_ISA_avx2)
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_GT_OQ)));
#elif defined(__SSE2__)
  return static_cast<uint32_t>(_mm_movemask_ps(_mm_cmpgt_ps((__m128)a, (__m128)b)));
#else
  uint32_t bits = 0;
  for (int i = 0; i < kLanes; ++i) bits |= uint32_t{a[i] > b[i]} << i;
  return bits;
#endif
}
// Whether any lane of a exceeds the same lane of b (false where either is NaN).
inline bool any_greater(vfloat a, vfloat b) { return lanes_greater(a, b) != 0; }
// Bit i set where a[i] <= b[i], unsigned.
inline uint32_t lanes_at_most(vuint a, vuint b) {
#if defined(ATTNKIT_ISA_avx512)
  return _mm512_cmple_epu32_mask((__m512i)a, (__m512i)b);
#elif defined(ATTNKIT_ISA_avx2)
  const __m256i at_most = _mm256_cmpeq_epi32(_mm256_max_epu32((__m256i)a, (__m256i)b), (__m256i)b);
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(at_most)));
#else
  uint32_t bits = 0;
  for (int i = 0; i < kLanes; ++i) bits |= uint32_t{a[i] <= b[i]} << i;
  return bits;
#endif
}
inline float hsum(vfloat v) {
#if defined(ATTNKIT_ISA_avx512) || defined(ATTNKIT_ISA_avx2)
  // Halve with shuffles down to 4 lanes (GCC 12 warns inside _mm512_reduce_add_ps).
#if defined(ATTNKIT_ISA_avx512)
  typedef float v8 __attribute__((vector_size(32)));
  const v8 w = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vfloat w = v;
#endif
  const __m128 h = (__m128)(__builtin_shufflevector(w, w, 0, 1, 2, 3) + __builtin_shufflevector(w, w, 4, 5, 6, 7));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
#else
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

#if defined(ATTNKIT_ISA_avx512)
// out[i] = hsum(v[i]) for kLanes vectors: pairs of vectors halved into one by shuffles and
// adds, 15 times (128-bit quarters, then 2-lane and 1-lane steps within them), then one
// permute: ~3 operations per vector where hsum takes 7.
inline vfloat lane_sums(const vfloat (&v)[kLanes]) {
  vfloat quarters[8], lanes4[4], lanes2[2];
  for (int i = 0; i < 8; ++i) {  // quarters 0-1: v[2i]'s halves summed, 2-3: v[2i + 1]'s
    const vfloat a = v[2 * i], b = v[2 * i + 1];
    quarters[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // quarter k: 4 lanes summing to v[4i + k]'s total
    const vfloat a = quarters[2 * i], b = quarters[2 * i + 1];
    lanes4[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // quarter k: 2 lanes each of lanes4[2i] and lanes4[2i + 1], interleaved
    const vfloat a = lanes4[2 * i], b = lanes4[2 * i + 1];
    lanes2[i] = __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
                __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  const vfloat a = lanes2[0], b = lanes2[1];  // quarter k, lane m: the total of v[4m + k]
  const vfloat totals = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                        __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(totals, totals, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}
#endif

// Row-grouped vectors (the decode key block): a vector holds kLanes / S segments of S lanes,
// one query row per segment. S = kLanes is the plain layout.

// S lanes at p broadcast to every segment: one load (vbroadcastf32x4 from memory costs no
// shuffle). Intrinsics: GCC spells the portable shufflevector through the stack; the
// all-ones maskz forms avoid GCC 12's false -Wmaybe-uninitialized in the unmasked ones.
template <int S>
inline vfloat vload_segment(const float* p) {
  static_assert(S == kLanes || S == 4 || S == 8, "segments of 4, 8 or kLanes lanes");
  if constexpr (S == kLanes) {
    return vload(p);
  } else {
#if defined(ATTNKIT_ISA_avx512)
    if constexpr (S == 4) {
      return (vfloat)_mm512_maskz_broadcast_f32x4(0xFFFF, _mm_loadu_ps(p));
    } else {
      return (vfloat)_mm512_maskz_broadcast_f32x8(0xFFFF, _mm256_loadu_ps(p));
    }
#elif defined(ATTNKIT_ISA_avx2)
    return (vfloat)_mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
#endif
  }
}

// One round of transpose_sum: within each segment of S lanes, a and b each hold S / W keys
// with W partial sums apiece (key blocks contiguous); the result's segment holds a's keys
// then b's with W / 2 partial sums each. Lane L of the result takes the sum of two lanes of
// the concatenation [a | b]: key k = t / (W / 2) of the segment, partials W / 2 apart.
constexpr int transpose_sum_source(int S, int W, int L, int half) {
  const int segment = L / S, t = L % S;
  const int at = t / (W / 2) * W + t % (W / 2) + half * (W / 2);  // in [0, 2S): a's keys, then b's
  return at < S ? segment * S + at : kLanes + segment * S + at - S;
}
template <int S, int W, int... L>
inline vfloat transpose_sum_pair(vfloat a, vfloat b, std::integer_sequence<int, L...>) {
  return __builtin_shufflevector(a, b, transpose_sum_source(S, W, L, 0)...) +
         __builtin_shufflevector(a, b, transpose_sum_source(S, W, L, 1)...);
}
// Reduces v[0 .. N), W partials per key and segment, to v[0 .. N / W), whose segment r
// holds the sums of row r for W times as many consecutive keys as each input held.
template <int S, int W, int N>
inline void transpose_sum_rounds(vfloat* v) {
  if constexpr (W > 1) {
#pragma GCC unroll 16
    for (int i = 0; i < N / 2; ++i) {
      v[i] = transpose_sum_pair<S, W>(v[2 * i], v[2 * i + 1], std::make_integer_sequence<int, kLanes>{});
    }
    transpose_sum_rounds<S, W / 2, N / 2>(v);
  }
}

// Lane j of the result is the sum of v[j]'s lanes: kLanes horizontal sums done together in
// log2(kLanes) rounds of two shuffles and an add (kLanes - 1 rounds' worth of vectors in
// all), instead of kLanes separate reductions. Overwrites v.
inline vfloat transpose_sum(vfloat (&v)[kLanes]) {
  transpose_sum_rounds<kLanes, kLanes, kLanes>(v);
  return v[0];
}

// Lanes of a's (lo: first, hi: second) half of segments interleaved with b's, segment by
// segment of S lanes: lo = [a0 b0 a1 b1 ...], hi = [a(n/2) b(n/2) ...].
template <int S, int Half, int... L>
inline vfloat interleave_segments(vfloat a, vfloat b, std::integer_sequence<int, L...>) {
  return __builtin_shufflevector(
      a, b, ((L / S) % 2 * kLanes + (Half * kLanes / 2 + L / S / 2 * S) + L % S)...);
}
template <int S, int Half>
inline vfloat interleave_segments(vfloat a, vfloat b) {
  return interleave_segments<S, Half>(a, b, std::make_integer_sequence<int, kLanes>{});
}

// The G x G transpose of segments (S = kLanes / G lanes each): afterwards segment n of v[r]
// is what segment r of v[n] was. G is 1, 2 or 4.
template <int G>
inline void transpose_segments(vfloat* v) {
  constexpr int S = kLanes / G;
  if constexpr (G == 2) {
    const vfloat lo = interleave_segments<S, 0>(v[0], v[1]), hi = interleave_segments<S, 1>(v[0], v[1]);
    v[0] = lo, v[1] = hi;
  } else if constexpr (G == 4) {
    const vfloat a0 = interleave_segments<S, 0>(v[0], v[1]), a1 = interleave_segments<S, 1>(v[0], v[1]);
    const vfloat b0 = interleave_segments<S, 0>(v[2], v[3]), b1 = interleave_segments<S, 1>(v[2], v[3]);
    v[0] = interleave_segments<2 * S, 0>(a0, b0), v[1] = interleave_segments<2 * S, 1>(a0, b0);
    v[2] = interleave_segments<2 * S, 0>(a1, b1), v[3] = interleave_segments<2 * S, 1>(a1, b1);
  }
}

// dst[c * ld + r] = src[r * lds + c] for r < rows and c < cols (both multiples of kLanes):
// kLanes × kLanes blocks, each transposed in registers by log2(kLanes) rounds that
// interleave vector i with vector i + kLanes / 2 (a perfect shuffle). Moves bits only, so
// any 32-bit elements (bf16 pairs too) go through as they are.
inline void transpose_matrix(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ld) {
  constexpr int kHalf = kLanes / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {
      vfloat v[kLanes], w[kLanes];
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) v[i] = vload(src + (r0 + i) * lds + c0);
#pragma GCC unroll 4
      for (int round = 1; round < kLanes; round *= 2) {
#pragma GCC unroll 16
        for (int i = 0; i < kHalf; ++i) {
          w[2 * i] = interleave_segments<1, 0>(v[i], v[i + kHalf]);
          w[2 * i + 1] = interleave_segments<1, 1>(v[i], v[i + kHalf]);
        }
#pragma GCC unroll 16
        for (int i = 0; i < kLanes; ++i) v[i] = w[i];
      }
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) vstore(dst + (c0 + i) * ld + r0, v[i]);
    }
  }
}

// Asks the caches for bytes [offset, offset + n) of the object at p, one prefetch per 64-byte
// line they touch (an unaligned range's last partial line too), into L1 or only as far as
// L2. Prefetches never fault, so the range may lie past the end of an array; the address is
// formed in integers for that reason. On x86 they are asm statements: GCC 12 at -O3 deleted
// the __builtin_prefetch(line, 0, 1) loops of decode's helpers as dead code (-fno-tree-dce
// kept them), so those L2 read-aheads never ran.
enum class Cache { l1, l2 };
inline void prefetch_bytes(const void* p, int64_t offset, int64_t n, Cache level = Cache::l1) {
  if (n <= 0) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(offset);
  const uintptr_t end = begin + static_cast<uintptr_t>(n);
  for (uintptr_t at = begin & ~uintptr_t{63}; at < end; at += 64) {
    const void* line = reinterpret_cast<const void*>(at);
#if defined(__x86_64__)
    if (level == Cache::l1) {
      asm volatile("prefetcht0 (%0)" : : "r"(line));
    } else {
      asm volatile("prefetcht2 (%0)" : : "r"(line));
    }
#else
    if (level == Cache::l1) {
      __builtin_prefetch(line, 0, 3);
    } else {
      __builtin_prefetch(line, 0, 1);
    }
#endif
  }
}

// One byte of every cache line of [p, p + bytes), summed: demand loads, which bring lines
// from memory where software prefetches (dropped, or not followed by the hardware
// prefetchers) did not (see the sparse MLA tile's load_ahead and decode's attend_kv_heads).
inline uint32_t touch_lines(const void* p, int64_t bytes) {
  if (bytes <= 0) return 0;
  const uint8_t* b = static_cast<const uint8_t*>(p);
  uint32_t sum = 0;
  for (int64_t i = 0; i < bytes; i += 64) sum += b[i];
  return sum + b[bytes - 1];
}

// 2^x for x <= 0 (softmax exponents after max subtraction), relative error ~1 ulp;
// exactly 1 at 0. x below -126 gives exactly 0 (so masked -inf scores vanish); NaN stays NaN.
// kForBf16: to 3e-6 relative instead (a degree-4 polynomial, two FMAs fewer), for
// probabilities rounded to bf16 next (the bf16 pairs softmax), whose rounding (2^-9) is a
// thousand times coarser; torch's CPU flash attention takes its 20-ulp exp_u20 there.
template <bool kForBf16 = false>
inline vfloat vexp2(vfloat x) {
  // x = n + f with n integer and f in [-0.5, 0.5]; 2^f from a polynomial, then times 2^n.
#if defined(ATTNKIT_ISA_avx512)
  // n by the 1.5 * 2^23 rounding (an add and a sub on either vector port; vrndscaleps is two
  // uops on port 0 alone, and gives the same n), vscalefps for 2^n. -inf gives n = -inf and
  // f = NaN, NaN stays NaN: the select below picks both results.
  const vfloat n = (x + 12582912.0f) - 12582912.0f;
  const vfloat f = x - n;
#else
  // NaN (and -inf) clamp to -126 too, so that n always fits the exponent field: the result
  // is then picked by the selects below, never from an out-of-range integer conversion.
  const vfloat clamped = x >= -126.0f ? x : vbroadcast(-126.0f);
  const vfloat n = (clamped + 12582912.0f) - 12582912.0f;  // 1.5 * 2^23 rounds to nearest
  const vfloat f = clamped - n;
#endif
  vfloat p;
  if constexpr (kForBf16) {  // 1 + f·q(f): near-minimax relative of degree 4 (error 2.9e-6)
    p = vbroadcast(9.58285294e-03f);
    p = p * f + 5.59064262e-02f;
    p = p * f + 2.40240991e-01f;
    p = p * f + 6.93124175e-01f;
  } else {  // relative minimax of degree 6 on [-0.5, 0.5] (error 2e-9 before rounding)
    p = vbroadcast(1.5353362e-04f);
    p = p * f + 1.3398875e-03f;
    p = p * f + 9.6184369e-03f;
    p = p * f + 5.5503324e-02f;
    p = p * f + 2.4022648e-01f;
    p = p * f + 6.9314718e-01f;
  }
  p = p * f + 1.0f;
#if defined(ATTNKIT_ISA_avx512)
  const vfloat r = (vfloat)_mm512_maskz_scalef_ps(0xFFFF, (__m512)p, (__m512)n);
  return x < -126.0f ? vbroadcast(0.0f) : r;
#else
  const vfloat r = (vfloat)((vint)p + (__builtin_convertvector(n, vint) << 23));
  return x != x ? x : (x < -126.0f ? vbroadcast(0.0f) : r);
#endif
}

// The logit soft-cap c·tanh(s / c) for c > 0 (a normal float; inv_c = 1 / c), and tanh(x) as
// its c = 1 case. With x = s / c: for |x| <= 1, s + s·x²·Q(x²), where 1 + x²·Q(x²) is a
// near-minimax polynomial of degree 7 fitted to tanh(x)/x on [0, 1] (odd, so no |x| or sign
// is needed on that path); above, c·(1 - e) / (1 + e) with e = e^(-2|x|) from vexp2 (no
// cancellation there: e <= e^-2), the sign of s put back. tanh is within 2 ulp over all
// floats (1.05 for |x| <= 1, 1.82 at worst, near 1.0013; tests/cpp/test_kernels.cpp asserts
// 3 for every ISA); with c != 1 the rounding of s / c adds at most half an ulp. ±inf gives
// ±c, NaN stays NaN. The exponential runs only for vectors with a lane above 1.
inline vfloat vsoftcap(vfloat s, vfloat c, vfloat inv_c) {
  const vfloat x = s * inv_c;
  const vfloat t = x * x;
  vfloat q = vbroadcast(-3.5321927862241864e-04f);
  q = q * t + 2.281791530549526e-03f;
  q = q * t - 7.916845381259918e-03f;
  q = q * t + 2.1464411169290543e-02f;
  q = q * t - 5.387076735496521e-02f;
  q = q * t + 1.3332156836986542e-01f;
  q = q * t - 3.3333277702331543e-01f;
  const vint sign = (vint)s & (int32_t)0x80000000;
  const vfloat small = (vfloat)((vint)(s + s * (t * q)) | sign);  // the sign: -0 stays -0
  const vfloat one = vbroadcast(1.0f);
  if (!any_greater(t, one)) return small;  // a NaN lane stays NaN through the polynomial
  const vfloat a = (vfloat)((vint)x & 0x7FFFFFFF);
  const vfloat e = vexp2(a * -2.8853900817779268f);  // e^(-2|x|) = 2^(-2|x| log2 e)
  const vfloat large = (vfloat)((vint)(c * ((one - e) / (one + e))) | sign);
  return t <= one ? small : large;
}
inline vfloat vtanh(vfloat x) { return vsoftcap(x, vbroadcast(1.0f), vbroadcast(1.0f)); }

}  // namespace attnkit::cpu::ATTNKIT_ISA
