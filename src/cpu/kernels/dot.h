// Row-dot micro-kernel for score tiles with very few query rows (decode): each key row is
// dotted with each query row along the head dimension (the SIMD axis), converting the
// key's dtype on load. Where Kᵀ·Q would pad a handful of rows to a full vector, this
// does only the useful multiply-adds.
#pragma once

#include <array>
#include <cstdint>
#include <utility>

#include "cpu/kernels/convert.h"
#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA {

inline constexpr int kMaxDotRows = 8;
inline constexpr int64_t kPrefetchRows = 32;  // measured flat from 16 to 64 rows

// c[j * ldc + r] = Σ_p a[j * lda + p] · b[r * ldb + p] for j < m, r < R, p < k. a rows
// hold k elements of dtype T (unit stride); b rows are fp32.
template <DType T, int R>
void dot_rows(int64_t m, int64_t k, const typename Elem<T>::type* a, int64_t lda, const float* b,
              int64_t ldb, float* c, int64_t ldc) {
  const int64_t k_vec = k / kLanes * kLanes;
  for (int64_t j = 0; j < m; ++j) {
    const typename Elem<T>::type* arow = a + j * lda;
    // Decode streams K from memory: ask for the row kPrefetchRows ahead.
    prefetch_bytes(arow, kPrefetchRows * lda * int64_t{sizeof(*arow)}, k * int64_t{sizeof(*arow)});
    vfloat acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = vfloat{};
    for (int64_t p = 0; p < k_vec; p += kLanes) {
      const vfloat av = vload_as_float<T>(arow + p);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] += av * vload(b + r * ldb + p);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float sum = hsum(acc[r]);
      for (int64_t p = k_vec; p < k; ++p) sum += Elem<T>::load(arow[p]) * b[r * ldb + p];
      c[j * ldc + r] = sum;
    }
  }
}

template <DType T, int... R>
constexpr auto dot_rows_table(std::integer_sequence<int, R...>) {
  return std::array{&dot_rows<T, R + 1>...};
}

// dot_rows for R = rows (1 <= rows <= kMaxDotRows).
template <DType T>
void dot_rows(int64_t rows, int64_t m, int64_t k, const typename Elem<T>::type* a, int64_t lda,
              const float* b, int64_t ldb, float* c, int64_t ldc) {
  static constexpr auto table = dot_rows_table<T>(std::make_integer_sequence<int, kMaxDotRows>{});
  table[rows - 1](m, k, a, lda, b, ldb, c, ldc);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
