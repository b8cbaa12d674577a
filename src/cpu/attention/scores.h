// What acts on a tile of scores between Q·Kᵀ and the softmax, for every driver: the
// soft-cap and ALiBi (apply_score_mods), the causal limit, the window and the user mask
// (apply_masks); and dropout on the probabilities after it (apply_dropout).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/philox.h"
#include "cpu/attention/task.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA::fwd {

// The causal limit, the window and the user mask on the scores, as -inf or an additive bias.
template <DType T, DType TK>
void AttentionTask<T, TK>::apply_masks(const RowBlock& rb, int64_t j0, int64_t bc, const Scores& st) const {
  const int64_t first = rb.i0 + key_offset(rb), last = first + rb.nq - 1;  // aligned positions
  const bool causal_cut = p_.causal && j0 + bc - 1 > first;
  const bool left_cut = p_.window_left >= 0 && j0 < last - p_.window_left;
  const bool right_cut = p_.window_right >= 0 && j0 + bc - 1 > first + p_.window_right;
  if (!causal_cut && !left_cut && !right_cut && !p_.mask) return;
  auto clamp = [bc](int64_t x) { return x < 0 ? 0 : (x < bc ? x : bc); };
  for (int64_t r = 0; r < rb.rows; ++r) {
    const int64_t h = rb.h0 + r / rb.nq, i = rb.i0 + r % rb.nq, a = i + key_offset(rb);
    int64_t lo = 0, visible = bc;  // keys j0 + [lo, visible) pass the causal limit and the window
    if (causal_cut) visible = clamp(a - j0 + 1);
    if (right_cut && clamp(a + p_.window_right - j0 + 1) < visible)
      visible = clamp(a + p_.window_right - j0 + 1);
    if (left_cut) lo = clamp(a - p_.window_left - j0);
    if (lo > visible) lo = visible;
    for (int64_t jj = 0; jj < lo; ++jj) st.at(r, jj) = -INFINITY;
    for (int64_t jj = visible; jj < bc; ++jj) st.at(r, jj) = -INFINITY;
    if (p_.mask) {
      const int64_t row_off = rb.b * p_.mask_stride[0] + h * p_.mask_stride[1] + i * p_.mask_stride[2];
      for (int64_t jj = lo; jj < visible; ++jj) {
        st.at(r, jj) += load_mask(p_.mask_dtype, p_.mask, row_off + (j0 + jj) * p_.mask_stride[3]);
      }
    }
  }
}

// The logit soft-cap, s -> c·tanh(s / c), then the ALiBi bias -slope·|a - j| on a tile of
// scores (before the masks). Sage int8 keeps its logits smoothed by q·mean, which the
// soft-cap does not commute with: there it is added back first (and not again in write_out).
// Row-major (decode) tiles are done in whole vectors of keys; the caller masks the lanes
// past bc afterwards.
template <DType T, DType TK>
void AttentionTask<T, TK>::apply_score_mods(const RowBlock& rb, int64_t j0, int64_t bc, const Scores& st,
                                            const Workspace& w) const {
  // Locals, not p_'s fields: stores to the tile could alias them, which would reload them per vector.
  const float softcap = p_.softcap;
  const float* const slopes = p_.alibi_slopes;
  if (softcap == 0.0f && !slopes) return;
  const bool transposed = st.row_stride == 1;  // Sᵀ of the tile loop, rows along the lanes
  const int64_t rows = transposed ? rb.cols : rb.rows;
  if (slopes) {  // per row (head hh, position i0 + ii): its slope, and a - j0 (exact in float below 2^24)
    for (int64_t hh = 0, r = 0; hh < rb.nh; ++hh) {
      const float slope = slopes[rb.b * p_.alibi_stride[0] + (rb.h0 + hh) * p_.alibi_stride[1]];
      for (int64_t ii = 0; ii < rb.nq; ++ii, ++r) {
        w.slope[r] = slope;
        w.dist[r] = static_cast<float>(rb.i0 + ii + key_offset(rb) - j0);
      }
    }
    for (int64_t r = rb.rows; r < rows; ++r) w.slope[r] = 0.0f, w.dist[r] = 0.0f;  // padding rows
  }
  const bool shifted = kq_ && softcap != 0.0f;
  const vfloat cap = vbroadcast(softcap), inv_cap = vbroadcast(1.0f / softcap);
  auto modify = [=](vfloat s, vfloat slope, vfloat dist) {
    if (softcap != 0.0f) s = vsoftcap(s, cap, inv_cap);
    if (slopes) s -= slope * (vfloat)((vint)dist & 0x7FFFFFFF);  // slope·|a - j|
    return s;
  };
  if (transposed) {
    const int64_t ld = st.key_stride;
    for (int64_t r = 0; r < rows; r += kLanes) {
      const vfloat slope = slopes ? vload(w.slope + r) : vfloat{},
                   dist0 = slopes ? vload(w.dist + r) : vfloat{};
      const vfloat shift = shifted ? vload(w.shift + r) : vfloat{};
      for (int64_t j = 0; j < bc; ++j) {
        float* s = st.s + j * ld + r;
        vstore(s, modify(shifted ? vload(s) + shift : vload(s), slope, dist0 - static_cast<float>(j)));
      }
    }
    return;
  }
  vfloat lane{};
  for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
  for (int64_t r = 0; r < rows; ++r) {
    const vfloat slope = vbroadcast(slopes ? w.slope[r] : 0.0f);
    const vfloat dist0 = vbroadcast(slopes ? w.dist[r] : 0.0f) - lane;
    for (int64_t j = 0; j < bc; j += kLanes) {
      float* s = st.s + r * st.row_stride + j;
      vstore(s, modify(vload(s), slope, dist0 - static_cast<float>(j)));
    }
  }
}

// Zeroes dropped probabilities and scales kept ones by 1 / (1 - p); the row sums already
// hold the undropped softmax, which normalises the output as in SDPA.
template <DType T, DType TK>
void AttentionTask<T, TK>::apply_dropout(const RowBlock& rb, int64_t j0, int64_t bc, const Scores& pt) const {
  const uint32_t threshold = detail::dropout_threshold(p_.dropout_p);
  const float keep_scale = 1.0f / (1.0f - p_.dropout_p);
  for (int64_t r = 0; r < rb.rows; ++r) {
    const int64_t h = rb.h0 + r / rb.nq, i = rb.i0 + r % rb.nq;
    for (int64_t jj = 0; jj < bc; jj += 4) {  // j0 is a multiple of 4: one draw per 4 keys
      const auto bits = detail::dropout_bits(p_.seed, rb.b, h, i, j0 + jj);
      for (int64_t k = 0; k < 4 && jj + k < bc; ++k) {
        float& pr = pt.at(r, jj + k);
        pr = bits[k] >= threshold ? pr * keep_scale : 0.0f;
      }
    }
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA::fwd
