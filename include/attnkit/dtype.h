// Scalar conversions between float32 and attnkit's narrow types, bit-exact with PyTorch
// 2.13's .to() on x86 CPUs (and with ml_dtypes wherever the two agree): round-to-nearest-
// even, infinities, overflow (e4m3fn saturates to ±448 as torch does), subnormals and NaN
// encodings. tests/python/test_dtype.py lists where torch and ml_dtypes differ.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attnkit/tensor.h"

namespace attnkit {

float float16_to_float(uint16_t bits);
uint16_t float_to_float16(float x);
float bfloat16_to_float(uint16_t bits);
uint16_t float_to_bfloat16(float x);
float float8_e4m3fn_to_float(uint8_t bits);
uint8_t float_to_float8_e4m3fn(float x);
float float8_e5m2_to_float(uint8_t bits);
uint8_t float_to_float8_e5m2(float x);

// Element-wise cast of n contiguous elements from src (src_dtype) to dst (dst_dtype),
// through float32. Integer and boolean destinations are not supported (throws Error).
void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n);

}  // namespace attnkit
