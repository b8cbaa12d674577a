// The flash-style tile loop: per tile of kKvTile keys (kAmxKvTile on AMX tiles), Sᵀ = K · Qᵀ (keys × rows, so the
// softmax runs down columns with rows as the SIMD axis), the modifiers and masks, the
// online softmax, and O += P · V. K and V are read in place where their rows allow it
// (fp32 of unit stride, bf16 pairs, bf16 V in split order), else converted once per tile,
// and used by every row of the task. Sᵀ has three sources: the fp32 gemm, bf16 pairs
// (bf16_pairs.h) and sage's int8 codes (sage_int8.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/attention/task.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_amx.h"
#include "cpu/kernels/softmax.h"
#include "cpu/kernels/workspace.h"

namespace attnkit::cpu::ATTNKIT_ISA::fwd {

// Runs keys [begin, end) through the tile loop, leaving the rows' state in w.o, w.m, w.l.
template <DType T, DType TK>
void AttentionTask<T, TK>::attend(const RowBlock& rb, int64_t begin, int64_t end, const Workspace& w) const {
  if (rb.mode->key_blocks) return attend_rows(rb, begin, end, w);
#if defined(ATTNKIT_ISA_avx512amx)
  if (plan_.amx || plan_.int8) amx_configure();  // sage's Q·Kᵀ runs on tiles in both int8 modes
#endif
  const int64_t ld = plan_.rows_pad;
  const Scores scores{w.st, ld, 1};
  const KvRows<EK> krows = kv_rows(p_.k, p_.k_stride, rb), vrows = kv_rows(p_.v, p_.v_stride, rb);
  if (end - begin <= plan_.key_tile) prefetch_key_tile(krows, vrows, begin, end);
  if (plan_.int8) {
    pack_q_int8(rb, w);
  } else if (plan_.bf16_dot) {
    pack_qt_pairs(rb, w);
  } else {
    pack_qt(rb, w);
  }
  const bool transposed = o_transposed(rb);
  if (transposed) {
    std::memset(w.ot, 0, sizeof(float) * plan_.dv_pad * ld);
  } else {
    std::memset(w.o, 0, sizeof(float) * (plan_.amx ? ld : rb.rows) * plan_.dv_pad);  // AMX writes whole tiles
  }
  for (int64_t r = 0; r < ld; ++r) w.m[r] = -INFINITY, w.l[r] = 0.0f;

  // P·V on bf16 pairs with nothing between the scores and the softmax but -inf masks: the
  // softmax writes P as bf16 pairs, and for bf16 pairs applies the scale (masks commute with a
  // positive one); sage's logits come scaled.
  const bool scale_fuses = plan_.int8 || (plan_.bf16_dot && rb.scale > 0.0f && rb.scale < INFINITY);
  const bool fused_pairs = scale_fuses && rb.mode->pv_bf16 && p_.softcap == 0.0f && !p_.alibi_slopes && !p_.mask &&
                           p_.dropout_p == 0.0f;
  const float softmax_scale = plan_.int8 ? 1.0f : rb.scale;
  const int64_t key_tile = plan_.key_tile;
  for (int64_t j0 = begin; j0 < end; j0 += key_tile) {
    const int64_t bc = end - j0 < key_tile ? end - j0 : key_tile;
    if (plan_.int8) {  // Sᵀ = K · Qᵀ on int8 codes, dequantised
      qk_int8(rb, j0, bc, w);
      fix_nonfinite_logits(rb, j0, bc, w);
    } else if (plan_.bf16_dot) {  // Sᵀ = K · Qᵀ on bf16 pairs, then the scale
      qk_bf16(rb, krows, j0, bc, w);
      if (!fused_pairs) scale_row(w.st, bc * ld, rb.scale);
    } else if (rb.mode->k_in_place) {  // Sᵀ = K · Qᵀ, a gemm per run of rows at one stride
      krows.for_each_run(j0, bc, [&](const EK* k, int64_t first, int64_t n) {
        gemm_wide(n, rb.cols, p_.D, reinterpret_cast<const float*>(k), krows.stride, 1, w.qt, ld, w.st + first * ld,
                  ld, false);
      });
    } else {
      pack_rows(krows, j0, bc, p_.k_stride[3], p_.D, p_.D, w.k);
      gemm_wide(bc, rb.cols, p_.D, w.k, p_.D, 1, w.qt, ld, w.st, ld, false);
    }
    apply_score_mods(rb, j0, bc, scores, w);
    apply_masks(rb, j0, bc, scores);
    if (fused_pairs) {
      online_softmax_tile_bf16_pairs(w.st, bc, ld, rb.cols, softmax_scale, w.m, w.l, w.alpha);
      if (j0 != begin) rescale_output(rb, w);  // the first tile's O is zero
      pv_bf16(rb, vrows, j0, bc, true, w);
      continue;
    }
    if (plan_.pv_int8) {  // the softmax writing P as u8 codes, u8 P · s8 V, the rescale folded in (sage_int8.h)
      pv_int8(rb, j0, bc, w);
      continue;
    }
    online_softmax_tile(w.st, bc, ld, rb.cols, w.m, w.l, w.alpha);
    if (j0 != begin) rescale_output(rb, w);
    if (p_.dropout_p > 0.0f) apply_dropout(rb, j0, bc, scores);
    if (rb.mode->pv_bf16) {
      pv_bf16(rb, vrows, j0, bc, false, w);
    } else {
      accumulate_pv(rb, vrows, j0, bc, scores, w);
    }
  }
  if (transposed) transpose_matrix(w.ot, ld, plan_.dv_pad, rb.cols, w.o, plan_.dv_pad);
}

// A key range of one tile (a short sequence's) is read right after Q's pack: its K and V rows
// (those of unit element stride the tile reads from the inputs: not sage's codes, not V's
// prepared pairs) are asked for into L2 first. Varlen, 64 sequences of 8-128 tokens (Zen 4,
// one thread, with Q's rows read ahead): 0.84 (bf16) / 0.86 (fp32) of the time at D 32,
// 0.96 / 0.98 at D 128; into L1, bf16 0.87 / 0.98 and fp32 no gain.
template <DType T, DType TK>
void AttentionTask<T, TK>::prefetch_key_tile(const KvRows<EK>& krows, const KvRows<EK>& vrows, int64_t begin,
                                             int64_t end) const {
  const int64_t k_bytes = plan_.int8 || p_.k_stride[3] != 1 ? 0 : int64_t{sizeof(EK)} * p_.D;
  const int64_t v_bytes = plan_.pv_int8 || v_pairs_ || p_.v_stride[3] != 1 ? 0 : int64_t{sizeof(EK)} * p_.Dv;
  for (int64_t j = begin; j < end; ++j) {
    prefetch_bytes(krows.row(j), 0, k_bytes, Cache::l2);
    prefetch_bytes(vrows.row(j), 0, v_bytes, Cache::l2);
  }
}

// Whether the tile loop accumulates Oᵀ [dv_pad][rows_pad] (in w.ot; attend transposes it
// into w.o at the end) rather than O: where V can be the broadcast operand of P·V (fp32 V,
// and bf16 V as key pairs outside sage), Oᵀ += Vᵀ · Pᵀ has the shape of Sᵀ = K · Qᵀ (rows
// along the lanes, V rows read once in address order) and runs 7-8% faster than O's tall
// tiles. The products and their order per output are the same, so the results too. On AMX
// tiles Oᵀ where V's pairs are prepared as Vᵀ's slabs (pv_amx_slabs: Pᵀ's pairs are then the
// B operand as the softmax wrote them), else O (P's rows transposed per tile).
template <DType T, DType TK>
bool AttentionTask<T, TK>::o_transposed(const RowBlock& rb) const {
  if (rb.mode->key_blocks || plan_.pv_int8) return false;
  if (plan_.amx) return plan_.v_slabs;
  return !plan_.int8 && (rb.mode->pv_bf16 || !rb.mode->v_split_bf16);
}

// O *= alpha, row by row, where the running max moved.
template <DType T, DType TK>
void AttentionTask<T, TK>::rescale_output(const RowBlock& rb, const Workspace& w) const {
  if (o_transposed(rb)) {  // Oᵀ's columns times alpha, unless no row's max moved
    const int64_t ld = plan_.rows_pad;
    bool moved = false;
    for (int64_t r = 0; r < rb.rows; ++r) moved |= w.alpha[r] != 1.0f;
    if (!moved) return;
    for (int64_t c = 0; c < rb.cols; c += kLanes) {
      const vfloat a = vload(w.alpha + c);
      for (int64_t d = 0; d < plan_.dv_pad; ++d) vstore(w.ot + d * ld + c, vload(w.ot + d * ld + c) * a);
    }
    return;
  }
  for (int64_t r = 0; r < rb.rows; ++r) {
    if (w.alpha[r] != 1.0f) scale_row(w.o + r * plan_.dv_pad, plan_.dv_pad, w.alpha[r]);
  }
}

// O += P · V for keys j0 .. j0+bc-1, V read in place (bf16 in split order, fp32 of unit
// stride), converted to bf16 (fp8 in decode) or packed.
template <DType T, DType TK>
void AttentionTask<T, TK>::accumulate_pv(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc,
                                         const Scores& p, const Workspace& w) const {
  // Keys first .. first + n - 1 of the tile. Decode takes whole-row tiles (V read in
  // address order), the tile loop tall ones.
  auto gemm_pv = [&](const auto* v, int64_t ldv, int64_t first, int64_t n) {
    const float* pf = p.s + first * p.key_stride;
    if (o_transposed(rb)) {  // Oᵀ += Vᵀ · Pᵀ (V is fp32 here)
      if constexpr (std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(v)>>, float>) {
        gemm_wide(plan_.dv_pad, rb.cols, n, v, 1, ldv, pf, p.key_stride, w.ot, plan_.rows_pad, true);
      }
    } else if (rb.mode->key_blocks) {
      gemm<kRowRows, kRowVecs>(rb.rows, plan_.dv_pad, n, pf, p.row_stride, p.key_stride, v, ldv, w.o,
                               plan_.dv_pad, true);
    } else {
      gemm<kTallRows, kTallVecs>(rb.rows, plan_.dv_pad, n, pf, p.row_stride, p.key_stride, v, ldv, w.o,
                                 plan_.dv_pad, true);
    }
  };
  if constexpr (sizeof(EK) == 1) {  // an fp8 cache's rows converted exactly to bf16 (Fp8ToBf16)
    if (rb.mode->v_split_bf16) {
      uint16_t* rows = reinterpret_cast<uint16_t*>(w.v);
      stage_bf16_rows(vrows, j0, bc, rows);
      return gemm_pv(static_cast<const uint16_t*>(rows), p_.Dv, 0, bc);
    }
  }
  if (rb.mode->v_split_bf16 || plan_.v_in_place) {  // a gemm per run of rows at one stride
    vrows.for_each_run(j0, bc, [&](const EK* v, int64_t first, int64_t n) {
      if constexpr (TK == DType::bfloat16 || TK == DType::float32) gemm_pv(v, vrows.stride, first, n);
    });
  } else {
    pack_rows(vrows, j0, bc, p_.v_stride[3], p_.Dv, plan_.dv_pad, w.v);
    gemm_pv(static_cast<const float*>(w.v), plan_.dv_pad, 0, bc);
  }
}

// Qᵀ [D][rows_pad] (its first rb.cols columns), pre-multiplied by the softmax scale; padding
// rows are zero. Rows are converted into w.k (free until the first key tile), then transposed.
template <DType T, DType TK>
void AttentionTask<T, TK>::pack_qt(const RowBlock& rb, const Workspace& w) const {
  const int64_t lds = plan_.d_pad;
  std::memset(w.k, 0, sizeof(float) * rb.cols * lds);
  for (int64_t r = 0; r < rb.rows; ++r) {
    prefetch_q_ahead(rb, r);
    load_row<T>(q_row(rb, r), p_.q_stride[3], p_.D, rb.scale, w.k + r * lds);
  }
  transpose_matrix(w.k, lds, rb.cols, lds, w.qt, plan_.rows_pad);
}

// bf16 or fp8 V rows j0 .. j0+n-1 as bf16 rows [n][Dv] (an fp8 cache's converted exactly,
// convert_fp8_rows), any element stride.
template <DType T, DType TK>
void AttentionTask<T, TK>::stage_bf16_rows(const KvRows<EK>& vrows, int64_t j0, int64_t n, uint16_t* rows) const {
  const int64_t col_stride = p_.v_stride[3];
  if constexpr (sizeof(EK) == 1) {
    convert_fp8_rows(vrows, col_stride, p_.Dv, j0, n, p_.Dv, rows);
  } else {
    vrows.for_each_run(j0, n, [&](const EK* src, int64_t first, int64_t count) {
      for (int64_t j = 0; j < count; ++j) {
        const EK* row = src + j * vrows.stride;
        uint16_t* dst = rows + (first + j) * p_.Dv;
        for (int64_t d = 0; d < p_.Dv; ++d) std::memcpy(dst + d, row + d * col_stride, sizeof(uint16_t));
      }
    });
  }
}

// K or V rows j0 .. j0+n-1 of `cols` elements converted to fp32 [n][ld], zero-padded to
// ld columns.
template <DType T, DType TK>
void AttentionTask<T, TK>::pack_rows(const KvRows<EK>& rows, int64_t j0, int64_t n, int64_t col_stride,
                                     int64_t cols, int64_t ld, float* dst) {
  rows.for_each_run(j0, n, [&](const EK* src, int64_t first, int64_t count) {
    for (int64_t j = 0; j < count; ++j) {
      if (rows.in_page(j0 + first + j, kPrefetchRows))
        prefetch_bytes(src, (j + kPrefetchRows) * rows.stride * int64_t{sizeof(EK)}, cols * int64_t{sizeof(EK)});
      float* row = dst + (first + j) * ld;
      load_row<TK>(src + j * rows.stride, col_stride, cols, 1.0f, row);
      for (int64_t c = cols; c < ld; ++c) row[c] = 0.0f;
    }
  });
}

}  // namespace attnkit::cpu::ATTNKIT_ISA::fwd
