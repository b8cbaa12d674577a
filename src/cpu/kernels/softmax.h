// The online-softmax update (FlashAttention's running max and sum). Scores stay in the
// natural domain (so an additive mask such as finfo.min cannot overflow when scaled);
// exp(x) is computed as exp2(x · log2 e) after the max is subtracted.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA {

inline constexpr float kLog2e = 1.4426950408889634f;

// Folds one tile of transposed scores into the rows' running max m and sum l. The tile is
// st[j * ld + r] for keys j < n_keys and rows r < n_rows (a multiple of kLanes), -inf where
// masked, so each vector holds one key for kLanes rows and no horizontal reduction is
// needed. Overwrites the tile with P = e^(s - m_new) and writes alpha[r] = e^(m - m_new),
// the factor by which row r's output accumulator must be rescaled.
inline void online_softmax_tile(float* st, int64_t n_keys, int64_t ld, int64_t n_rows, float* m,
                                float* l, float* alpha) {
  for (int64_t r = 0; r < n_rows; r += kLanes) {
    const vfloat m_old = vload(m + r);
    vfloat m_new = m_old;
    for (int64_t j = 0; j < n_keys; ++j) m_new = vmax(m_new, vload(st + j * ld + r));
    // Rows that have seen no visible key yet keep m = -inf; exponentiate them against 0
    // so that P = e^-inf = 0 rather than NaN.
    const vfloat m_ref = m_new == -INFINITY ? vfloat{} : m_new;
    vfloat sum{};
    for (int64_t j = 0; j < n_keys; ++j) {
      const vfloat p = vexp2((vload(st + j * ld + r) - m_ref) * kLog2e);
      vstore(st + j * ld + r, p);
      sum += p;
    }
    const vfloat a = vexp2((m_old - m_ref) * kLog2e);
    vstore(alpha + r, a);
    vstore(l + r, vload(l + r) * a + sum);
    vstore(m + r, m_new);
  }
}

// The same update for a row-major tile s[r * ld + j], keys j < n_keys (a multiple of
// kLanes) along the lanes, for rows r < n_rows. Usually no key beats the running max:
// then one compare replaces the horizontal max, and alpha is exactly 1.
inline void online_softmax_rows(float* s, int64_t n_keys, int64_t ld, int64_t n_rows, float* m, float* l,
                                float* alpha) {
  for (int64_t r = 0; r < n_rows; ++r) {
    float* row = s + r * ld;
    const vfloat m_old = vbroadcast(m[r]);
    vfloat mx = m_old;
    for (int64_t j = 0; j < n_keys; j += kLanes) mx = vmax(mx, vload(row + j));
    const bool moved = any_greater(mx, m_old);
    const float m_new = moved ? hmax(mx) : m[r];
    const vfloat m_ref = vbroadcast(m_new == -INFINITY ? 0.0f : m_new);  // as in the tile version
    vfloat sum{};
    for (int64_t j = 0; j < n_keys; j += kLanes) {
      const vfloat p = vexp2((vload(row + j) - m_ref) * kLog2e);
      vstore(row + j, p);
      sum += p;
    }
    const float a = moved ? vexp2((m_old - m_ref) * kLog2e)[0] : 1.0f;
    alpha[r] = a;
    l[r] = l[r] * a + hsum(sum);
    m[r] = m_new;
  }
}

// row[0, n) *= factor (n a multiple of kLanes).
inline void scale_row(float* row, int64_t n, float factor) {
  const vfloat f = vbroadcast(factor);
  for (int64_t j = 0; j < n; j += kLanes) vstore(row + j, vload(row + j) * f);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
