// Element loads and stores between the op dtypes and float32, inlined into packing loops.
// bf16 widening is a shift; fp16 uses F16C where the ISA has it; stores round to nearest
// even exactly as attnkit::float_to_* (and torch) do.
#pragma once

#include <cstdint>
#include <cstring>

#include "attnkit/dtype.h"
#include "attnkit/tensor.h"
#include "cpu/kernels/simd.h"

#if defined(ATTNKIT_ISA_avx2) || defined(ATTNKIT_ISA_avx512)
#include <immintrin.h>
#endif

namespace attnkit::cpu::ATTNKIT_ISA {

template <DType T>
struct Elem;

template <>
struct Elem<DType::float32> {
  using type = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};

template <>
struct Elem<DType::bfloat16> {
  using type = uint16_t;
  static float load(uint16_t x) {
    const uint32_t bits = uint32_t{x} << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static uint16_t store(float x) { return float_to_bfloat16(x); }
};

template <>
struct Elem<DType::float16> {
  using type = uint16_t;
  static float load(uint16_t x) {
#if defined(ATTNKIT_ISA_avx2) || defined(ATTNKIT_ISA_avx512)
    return _cvtsh_ss(x);
#else
    return float16_to_float(x);
#endif
  }
  static uint16_t store(float x) { return float_to_float16(x); }
};

// dst[i] = load(src[i * stride]) * scale for i < n.
template <DType T>
inline void load_row(const typename Elem<T>::type* src, int64_t stride, int64_t n, float scale,
                     float* dst) {
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) dst[i] = Elem<T>::load(src[i]) * scale;
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = Elem<T>::load(src[i * stride]) * scale;
  }
}

// Loads one mask element as an additive bias (bool false -> -inf).
inline float load_mask(DType dtype, const void* base, int64_t offset) {
  switch (dtype) {
    case DType::boolean:
      return static_cast<const uint8_t*>(base)[offset] ? 0.0f : -__builtin_inff();
    case DType::float16:
      return Elem<DType::float16>::load(static_cast<const uint16_t*>(base)[offset]);
    case DType::bfloat16:
      return Elem<DType::bfloat16>::load(static_cast<const uint16_t*>(base)[offset]);
    default:
      return static_cast<const float*>(base)[offset];
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
