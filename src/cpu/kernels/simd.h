// The SIMD vocabulary of the CPU micro-kernels, written once with GCC/Clang vector
// extensions and compiled per ISA: 16 float lanes (zmm) on AVX-512, 8 (ymm) on AVX2,
// 4 (xmm) on the portable path. Each ISA build gets its own namespace (ATTNKIT_ISA).
#pragma once

#include <cstdint>
#include <cstring>

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
// NaN-propagating in the first argument is not needed: a NaN score poisons its row via exp2.
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
inline float hmax(vfloat v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
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

// Asks the caches for bytes [offset, offset + n) of the object at p, one prefetch per 64-byte
// line. Prefetches never fault, so the range may lie past the end of an array; the address
// is formed in integers for that reason.
inline void prefetch_bytes(const void* p, int64_t offset, int64_t n) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(offset);
  for (int64_t byte = 0; byte < n; byte += 64) __builtin_prefetch(reinterpret_cast<const void*>(base + byte));
}

// 2^x for x <= 0 (softmax exponents after max subtraction), relative error ~2 ulp.
// x below -126 gives exactly 0 (so masked -inf scores vanish); NaN stays NaN.
inline vfloat vexp2(vfloat x) {
  const vfloat clamped = x < -126.0f ? vbroadcast(-126.0f) : x;
  // Split x = n + f with n integer, f in [-0.5, 0.5]: 1.5 * 2^23 rounds to nearest.
  const vfloat n = (clamped + 12582912.0f) - 12582912.0f;
  const vfloat f = clamped - n;
  // Taylor series of 2^f = e^(f ln 2) to degree 7 (error < 2e-8 on [-0.5, 0.5]).
  vfloat p = vbroadcast(1.5252734e-05f);
  p = p * f + 1.5403530e-04f;
  p = p * f + 1.3333558e-03f;
  p = p * f + 9.6181291e-03f;
  p = p * f + 5.5504109e-02f;
  p = p * f + 2.4022651e-01f;
  p = p * f + 6.9314718e-01f;
  p = p * f + 1.0f;
  const vint bits = (vint)p + (__builtin_convertvector(n, vint) << 23);
  vfloat r = (vfloat)bits;
  r = x < -126.0f ? vbroadcast(0.0f) : r;
  return x != x ? x : r;
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
