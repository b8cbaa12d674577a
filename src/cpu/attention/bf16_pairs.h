// bf16 inputs on avx512bf16: Q and K as bf16 pairs along D for Sᵀ = K · Qᵀ with
// vdpbf16ps (tile loop and decode), and P·V on pairs along the keys with P rounded to
// bf16 (the bf16 tile loop and sage). Variants without vdpbf16ps get empty definitions:
// their plans never choose these paths.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/thread_pool.h"
#include "cpu/attention/task.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/dot.h"
#include "cpu/kernels/gemm_amx.h"
#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/workspace.h"

namespace attnkit::cpu::ATTNKIT_ISA::fwd {

#if defined(ATTNKIT_ISA_avx512bf16)
template <DType T, DType TK>
uint32_t AttentionTask<T, TK>::pair(uint16_t lo, uint16_t hi) {
  return uint32_t{lo} | uint32_t{hi} << 16;
}

// Qᵀ as bf16 pairs along D into w.qt: [p][r] = (q[r][2p], q[r][2p+1]), unscaled (the scale is
// applied to the fp32 scores), its first rb.cols columns; odd D ends with a zero, padding rows
// are zero. Rows are paired into w.k (free until the first key tile), then transposed.
template <DType T, DType TK>
void AttentionTask<T, TK>::pack_qt_pairs(const RowBlock& rb, const Workspace& w) const {
  const int64_t pairs = (p_.D + 1) / 2, lds = round_up(pairs, kLanes);
  uint32_t* rows = reinterpret_cast<uint32_t*>(w.k);
  std::memset(rows, 0, sizeof(uint32_t) * rb.cols * lds);
  pair_q_rows(rb, lds, rows);
  transpose_matrix(w.k, lds, rb.cols, lds, w.qt, plan_.rows_pad);
}

// Sᵀ = K · Qᵀ on bf16 pairs (K rows in place, a gemm per run, or copied as pairs), unscaled
// (the caller applies the scale).
template <DType T, DType TK>
void AttentionTask<T, TK>::qk_bf16(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t bc,
                                   const Workspace& w) const {
#if defined(ATTNKIT_ISA_avx512amx)
  if (plan_.amx) return qk_amx(krows, rb.mode->k_in_place, j0, bc, w);
#endif
  const int64_t pairs = (p_.D + 1) / 2, ld = plan_.rows_pad;
  const uint32_t* qt = reinterpret_cast<const uint32_t*>(w.qt);
  if (rb.mode->k_in_place) {
    krows.for_each_run(j0, bc, [&](const EK* k, int64_t first, int64_t n) {
      gemm_bf16<kDotWideRows, kDotWideVecs>(n, rb.cols, pairs, reinterpret_cast<const uint32_t*>(k),
                                            krows.stride / 2, 1, qt, ld, w.st + first * ld, ld, false);
    });
  } else {
    uint32_t* keys = pack_key_pairs(krows, j0, bc, pairs, w);
    gemm_bf16<kDotWideRows, kDotWideVecs>(bc, rb.cols, pairs, keys, pairs, 1, qt, ld, w.st, ld, false);
  }
}

// O += P · V with P rounded to bf16 and both packed as pairs along the keys (vdpbf16ps):
// Pᵀ is rewritten in place (pair row jp of keys 2jp, 2jp+1), unless the softmax already
// did (p_paired). V pairs come from sage's prepared V, or are interleaved here from this
// tile's bf16 V rows.
template <DType T, DType TK>
void AttentionTask<T, TK>::pv_bf16(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc,
                                   bool p_paired, const Workspace& w) const {
  const int64_t ld = plan_.rows_pad, dv_pad = plan_.dv_pad, pairs = (bc + 1) / 2;
  uint32_t* pp = reinterpret_cast<uint32_t*>(w.st);
  if (!p_paired) pair_rows_bf16(w.st, bc, ld, pp, rb.cols);
#if defined(ATTNKIT_ISA_avx512amx)
  if (plan_.amx) return pv_amx(rb, vrows, pp, j0, bc, w);
#endif
  uint32_t* vp = reinterpret_cast<uint32_t*>(w.v);
  if (!v_pairs_) {
    interleave_v_tile(vrows, j0, bc, vp, w);
    pv_pairs(rb, pp, vp, pairs, w);
    return;
  }
  const int64_t head = rb.b * p_.Hkv + rb.kvh;
  const uint32_t* prepared = v_pairs_ + (head * ((p_.Skv + 1) / 2) + j0 / 2) * dv_pad;
  const int64_t full = bc / 2;  // pairs whose two keys are both in the tile
  pv_pairs(rb, pp, prepared, full, w);
  if (bc % 2) {  // the last key alone: the pair's other key lies past the tile (mask, split)
    for (int64_t d = 0; d < dv_pad; ++d) vp[d] = prepared[full * dv_pad + d] & 0xFFFFu;
    pv_pairs(rb, pp + full * ld, vp, 1, w);
  }
}

// bf16 V rows j0 .. j0+bc-1 as pairs of consecutive keys into vp [pairs][dv_pad]; a lone
// last key pairs with a zero row (its P is zero too). An fp8 cache's rows are converted
// exactly: with VBMI and unit stride straight into pairs, else to bf16 rows first, two at a
// time, into w.k (free once Sᵀ is computed).
template <DType T, DType TK>
void AttentionTask<T, TK>::interleave_v_tile(const KvRows<EK>& vrows, int64_t j0, int64_t bc, uint32_t* vp,
                                             const Workspace& w) const {
  const int64_t dv_pad = plan_.dv_pad;
  const int64_t col_stride = sizeof(EK) == 1 ? 1 : p_.v_stride[3];  // of the rows below
  // Row `index` (of the tile) at v, as bf16.
  auto bf16_row = [&](const EK* v, int64_t index) -> const uint16_t* {
    if constexpr (sizeof(EK) == 1) {
      uint16_t* row = reinterpret_cast<uint16_t*>(w.k) + index % 2 * p_.Dv;
      Fp8ToBf16<TK>().row(v, p_.v_stride[3], p_.Dv, row);
      return row;
    } else {
      return reinterpret_cast<const uint16_t*>(v);
    }
  };
  // Rows a and b (or null) of an fp8 cache straight into the pairs at dst, where that has a
  // vector path; false where the rows go through bf16_row instead.
  auto fp8_pairs = [&](const EK* a, const EK* b, uint32_t* dst) {
    if constexpr (sizeof(EK) == 1 && Fp8ToBf16<TK>::kVectorPairs) {
      if (p_.v_stride[3] == 1) {
        Fp8ToBf16<TK>().pairs(a, b, p_.Dv, dst);
        std::memset(dst + p_.Dv, 0, sizeof(uint32_t) * (dv_pad - p_.Dv));
        return true;
      }
    }
    return false;
  };
  vrows.for_each_run(j0, bc, [&](const EK* v, int64_t first, int64_t n) {
    for (int64_t j = first; j < first + n; ++j, v += vrows.stride) {
      // The rows of a pair may lie in different pages: a pair's second row that starts
      // a run is added to the pair its first row left half empty.
      uint32_t* dst = vp + j / 2 * dv_pad;  // j counts from the tile's first key
      if (j % 2 == 0) {
        const bool second_here = j + 1 < first + n;
        const EK* b = second_here ? v + vrows.stride : nullptr;
        if (!fp8_pairs(v, b, dst)) {
          interleave_bf16_rows(bf16_row(v, j), b ? bf16_row(b, j + 1) : nullptr, col_stride, p_.Dv, dv_pad, dst);
        }
        if (second_here) ++j, v += vrows.stride;
      } else {
        const uint16_t* a = bf16_row(v, j);
        for (int64_t d = 0; d < p_.Dv; ++d) dst[d] |= uint32_t{a[d * col_stride]} << 16;
      }
    }
  });
}

#if defined(ATTNKIT_ISA_avx512amx)
// Sᵀ = K · Qᵀ on AMX tiles, 16 keys at a time, unscaled: K rows in place where 16 of them lie
// in one run and their pairs fill whole tiles, else staged as zero-padded pairs in w.k (an
// fp8 cache's converted exactly to bf16). It writes whole tiles, so up to 15 score rows past
// bc (kScoreRows leaves room for them).
template <DType T, DType TK>
void AttentionTask<T, TK>::qk_amx(const KvRows<EK>& krows, bool k_in_place, int64_t j0, int64_t bc,
                                  const Workspace& w) const {
  const int64_t pairs = (p_.D + 1) / 2, kp = round_up(pairs, kAmxTile), ld = plan_.rows_pad;
  const uint32_t* qt = reinterpret_cast<const uint32_t*>(w.qt);  // [kp][ld], zero past D
  const bool in_place = k_in_place && pairs == kp;
  for (int64_t j = 0; j < bc;) {
    const int64_t run = krows.run_end(j0 + j, j0 + bc) - (j0 + j);
    const int64_t whole = in_place ? run / kAmxTile * kAmxTile : 0;
    if (whole > 0) {
      gemm_amx_bf16(whole, ld, kp, reinterpret_cast<const uint32_t*>(krows.row(j0 + j)), krows.stride / 2, qt, ld,
                    w.st + j * ld, ld, false);
      j += whole;
      continue;
    }
    const int64_t n = bc - j < kAmxTile ? bc - j : kAmxTile;
    uint32_t* staged = pack_key_pairs(krows, j0 + j, n, kp, w);
    std::memset(staged + n * kp, 0, sizeof(uint32_t) * (kAmxTile - n) * kp);
    gemm_amx_bf16(kAmxTile, ld, kp, staged, kp, qt, ld, w.st + j * ld, ld, false);
    j += n;
  }
}

// O += P · V on AMX tiles over the tile's key pairs, padded with zero pairs to whole tiles:
// P's rows from its pairs pp [pair][row] transposed into w.k, V's pairs in place from the
// prepared ones for whole tiles of pairs whose keys all lie in this tile, else interleaved
// or copied into w.v (the pair of a lone last key keeps only that key's half).
template <DType T, DType TK>
void AttentionTask<T, TK>::pv_amx(const RowBlock& rb, const KvRows<EK>& vrows, uint32_t* pp, int64_t j0,
                                  int64_t bc, const Workspace& w) const {
  const int64_t ld = plan_.rows_pad, dv_pad = plan_.dv_pad, pairs = (bc + 1) / 2;
  const int64_t kp = round_up(pairs, kAmxTile);
  std::memset(pp + pairs * ld, 0, sizeof(uint32_t) * (kp - pairs) * ld);
  if (plan_.v_slabs) return pv_amx_slabs(rb, pp, j0, bc, w);
  uint32_t* vp = reinterpret_cast<uint32_t*>(w.v);
  if (!v_pairs_) interleave_v_tile(vrows, j0, bc, vp, w);  // first: an fp8 cache's rows pass through w.k
  uint32_t* p_rows = reinterpret_cast<uint32_t*>(w.k);  // [ld][kp]
  transpose_matrix(reinterpret_cast<const float*>(pp), ld, kp, ld, reinterpret_cast<float*>(p_rows), kp);
  if (!v_pairs_) {
    std::memset(vp + pairs * dv_pad, 0, sizeof(uint32_t) * (kp - pairs) * dv_pad);
    gemm_amx_bf16(ld, dv_pad, kp, p_rows, kp, vp, dv_pad, w.o, dv_pad, true);
    return;
  }
  const int64_t head = rb.b * p_.Hkv + rb.kvh;
  const uint32_t* prepared = v_pairs_ + (head * ((p_.Skv + 1) / 2) + j0 / 2) * dv_pad;
  const int64_t in_place = bc / 2 / kAmxTile * kAmxTile;  // whole tiles of pairs of this tile's keys
  if (in_place > 0) gemm_amx_bf16(ld, dv_pad, in_place, p_rows, kp, prepared, dv_pad, w.o, dv_pad, true);
  if (in_place == kp) return;
  const int64_t full = bc / 2;  // pairs whose two keys are both in the tile
  std::memcpy(vp, prepared + in_place * dv_pad, sizeof(uint32_t) * (full - in_place) * dv_pad);
  uint32_t* rest = vp + (full - in_place) * dv_pad;
  if (bc % 2) {  // the last key alone: the pair's other key lies past the tile (mask, split)
    for (int64_t d = 0; d < dv_pad; ++d) rest[d] = prepared[full * dv_pad + d] & 0xFFFFu;
    rest += dv_pad;
  }
  std::memset(rest, 0, sizeof(uint32_t) * (kp - pairs) * dv_pad);
  gemm_amx_bf16(ld, dv_pad, kp - in_place, p_rows + in_place, kp, vp, dv_pad, w.o, dv_pad, true);
}

// Oᵀ += Vᵀ · Pᵀ on AMX tiles (Plan::v_slabs): Pᵀ's pairs pp [pair][row] are the B operand as
// the softmax wrote them (zero past the tile's pairs), Vᵀ's slabs the A operand in place, so
// P needs no transpose (the tile loop transposes Oᵀ once per row block instead: measured
// 7-10% off bf16 prefill). j0 lies on a slab border (visible_keys); a last slab the tile's
// keys fill only in part is copied with its pairs past the tile, and the partner of a lone
// last key, zeroed (those keys may lie past the causal limit or a split and hold anything).
template <DType T, DType TK>
void AttentionTask<T, TK>::pv_amx_slabs(const RowBlock& rb, const uint32_t* pp, int64_t j0, int64_t bc,
                                        const Workspace& w) const {
  const int64_t ld = plan_.rows_pad, dv_pad = plan_.dv_pad, slab = kAmxTile * dv_pad;
  const int64_t head = rb.b * p_.Hkv + rb.kvh;
  const uint32_t* slabs = v_pairs_ + head * plan_.v_pairs_per_head * dv_pad + j0 / kVSlabKeys * slab;
  const int64_t whole = bc / kVSlabKeys;  // slabs whose keys all lie in the tile
  if (whole > 0) gemm_amx_bf16(dv_pad, ld, whole * kAmxTile, slabs, kAmxTile, pp, ld, w.ot, ld, true, slab);
  const int64_t rest = bc - whole * kVSlabKeys;
  if (rest == 0) return;
  const uint32_t* last = slabs + whole * slab;
  uint32_t* staged = reinterpret_cast<uint32_t*>(w.v);
  const int64_t full = rest / 2;  // pairs whose two keys are both in the tile
  for (int64_t d = 0; d < dv_pad; ++d) {
    for (int64_t c = 0; c < kAmxTile; ++c) {
      const uint32_t pair = last[d * kAmxTile + c];
      staged[d * kAmxTile + c] = c < full ? pair : c == full && rest % 2 ? pair & 0xFFFFu : 0u;
    }
  }
  gemm_amx_bf16(dv_pad, ld, kAmxTile, staged, kAmxTile, pp + whole * kAmxTile * ld, ld, w.ot, ld, true);
}

// Decode on AMX tiles (Mode::amx_tiles), before the row block's first key block: the tiles
// configured for its rows, and Qᵀ as bf16 pairs into w.qt [kp][rows] (kp: whole tiles of
// pairs, zero past D), unscaled. Rows are paired into w.k first (free until then).
template <DType T, DType TK>
void AttentionTask<T, TK>::start_rows_amx(const RowBlock& rb, const Workspace& w) const {
  static_assert(kDecodeKeys == kAmxTile, "a key block is one tile of keys");
  amx_configure_decode(rb.rows);
  const int64_t pairs = (p_.D + 1) / 2, kp = round_up(pairs, kAmxTile);
  uint32_t* rows = reinterpret_cast<uint32_t*>(w.k);
  uint32_t* qt = reinterpret_cast<uint32_t*>(w.qt);
  pair_q_rows(rb, pairs, rows);
  for (int64_t q = 0; q < kp; ++q) {
    for (int64_t r = 0; r < rb.rows; ++r) qt[q * rb.rows + r] = q < pairs ? rows[r * pairs + q] : 0u;
  }
}

// Decode on AMX tiles: Sᵀ [16][rows] of the block's bc <= 16 keys into st_t, unscaled (rows
// past bc hold zero scores, for the caller to mask): K's rows in place where the 16 lie in
// one run and their pairs fill whole tiles, else staged as zero-padded pairs in w.k (an fp8
// cache's converted exactly).
template <DType T, DType TK>
void AttentionTask<T, TK>::qk_tiles_amx(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t bc,
                                        const Workspace& w, float* st_t, const uint16_t* k_staged) const {
  const int64_t pairs = (p_.D + 1) / 2, kp = round_up(pairs, kAmxTile);
  const uint32_t* k;
  int64_t k_stride;  // bytes
  if (k_staged) {
    k = reinterpret_cast<const uint32_t*>(k_staged), k_stride = kp * int64_t{sizeof(uint32_t)};
  } else if (rb.mode->k_in_place && pairs == kp && bc == kAmxTile && krows.run_end(j0, j0 + bc) == j0 + bc) {
    k = reinterpret_cast<const uint32_t*>(krows.row(j0)), k_stride = krows.stride * int64_t{sizeof(EK)};
  } else {
    uint32_t* staged = pack_key_pairs(krows, j0, bc, kp, w);
    std::memset(staged + bc * kp, 0, sizeof(uint32_t) * (kAmxTile - bc) * kp);
    k = staged, k_stride = kp * int64_t{sizeof(uint32_t)};
  }
  amx_decode_scores(k, k_stride, kp, reinterpret_cast<const uint32_t*>(w.qt), rb.rows, st_t);
}

// Decode on AMX tiles: the block's scores row-major into w.st (s[r * kDecodeKeys + j] =
// st_t[j][r]), times the scale.
template <DType T, DType TK>
void AttentionTask<T, TK>::take_scores_amx(const RowBlock& rb, const float* st_t, const Workspace& w) const {
  const vint keys = vint{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * static_cast<int>(rb.rows);
  const vfloat scale = vbroadcast(rb.scale);
  for (int64_t r = 0; r < rb.rows; ++r) {
    const __m512i index = (__m512i)(keys + static_cast<int>(r));
    // (the masked form: GCC 12 warns of an uninitialised source inside the plain one)
    const vfloat s = (vfloat)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xFFFF, index, st_t, 4);
    vstore(w.st + r * kDecodeKeys, s * scale);
  }
}

// Decode on AMX tiles: O += P · V for the block's bc keys with V's bf16 rows as the B
// operand as they lie, 16 keys × 32 columns per tile: a tile's products pair key k's P with
// its row's columns 2n and 2n + 1, so P enters twice, as pairs (p, 0) for the even columns
// and (0, p) for the odd ones, and O comes in split order (gemm.h's split_bf16_column;
// write_out restores it): V is not interleaved into key pairs (X7, paged decode P16/P128,
// one thread: 2-8% less time). A non-finite V value would make its column's partner NaN
// too (0 · inf), so with v_apart (attend_again_apart) V's even and odd columns are staged
// apart, each with the other's zeroed. The rows come staged a step ahead (v_staged: an fp8
// cache's, attend_kv_heads), else are read in place (the block's 16 keys one run of
// unit-stride bf16 rows), else staged here as bf16 in w.v (an fp8 cache's converted
// exactly; rows past bc zero).
template <DType T, DType TK>
void AttentionTask<T, TK>::pv_rows_amx(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc,
                                       bool v_apart, const Workspace& w, const uint16_t* v_staged) const {
  uint32_t* even = reinterpret_cast<uint32_t*>(w.st);  // P's rows (kDecodeKeys apart) in place
  uint32_t* odd = even + rb.rows * kDecodeKeys;
  for (int64_t r = 0; r < rb.rows; ++r) {
    const vuint p = round_to_bf16_bits(vload(w.st + r * kDecodeKeys), kBf16QuietNan);
    const vuint p_high = p << 16;
    std::memcpy(even + r * kDecodeKeys, &p, sizeof p);
    std::memcpy(odd + r * kDecodeKeys, &p_high, sizeof p_high);
  }
  const int64_t v_stride = p_.Dv * int64_t{sizeof(uint16_t)};  // of the staged rows, in bytes
  if (v_staged) return amx_decode_pv(even, odd, v_staged, nullptr, v_stride, w.o, plan_.dv_pad, p_.Dv);
  uint16_t* rows = reinterpret_cast<uint16_t*>(w.v);
  if (!v_apart && sizeof(EK) == 2 && p_.v_stride[3] == 1 && bc == kDecodeKeys &&
      vrows.run_end(j0, j0 + bc) == j0 + bc) {
    const uint16_t* v = reinterpret_cast<const uint16_t*>(vrows.row(j0));
    return amx_decode_pv(even, odd, v, nullptr, vrows.stride * int64_t{sizeof(EK)}, w.o, plan_.dv_pad, p_.Dv);
  }
  stage_bf16_rows(vrows, j0, bc, rows);
  std::memset(rows + bc * p_.Dv, 0, sizeof(uint16_t) * (kDecodeKeys - bc) * p_.Dv);
  uint16_t* rows_odd = nullptr;
  if (v_apart) {  // the odd columns into rows_odd, zeroed in rows (Dv is even)
    rows_odd = rows + kDecodeKeys * p_.Dv;
    for (int64_t i = 0; i < kDecodeKeys * p_.Dv; i += 2) rows_odd[i] = 0, rows_odd[i + 1] = rows[i + 1], rows[i + 1] = 0;
  }
  amx_decode_pv(even, odd, rows, rows_odd, v_stride, w.o, plan_.dv_pad, p_.Dv);
}
#endif

// O += P · V over `pairs` key pairs, P pairs [pairs][rows_pad], V pairs [pairs][dv_pad]: as
// Oᵀ += Vᵀ · Pᵀ into w.ot where the tile loop accumulates Oᵀ (o_transposed), else O's tall tiles.
template <DType T, DType TK>
void AttentionTask<T, TK>::pv_pairs(const RowBlock& rb, const uint32_t* pp, const uint32_t* vp, int64_t pairs,
                                    const Workspace& w) const {
  const int64_t ld = plan_.rows_pad, dv_pad = plan_.dv_pad;
  if (o_transposed(rb)) {
    gemm_bf16<kDotWideRows, kDotWideVecs>(dv_pad, rb.cols, pairs, vp, 1, dv_pad, pp, ld, w.ot, ld, true);
  } else {
    gemm_bf16<kTallRows, kTallVecs>(rb.rows, dv_pad, pairs, pp, 1, ld, vp, dv_pad, w.o, dv_pad, true);
  }
}

// Decode: Q rows as bf16 pairs, unscaled, grouped for dot_key_block_bf16 into w.qt (via w.k).
template <DType T, DType TK>
void AttentionTask<T, TK>::pack_q_row_pairs(const RowBlock& rb, const Workspace& w) const {
  const int64_t pairs = (p_.D + 1) / 2;
  uint32_t* rows = reinterpret_cast<uint32_t*>(w.k);  // free until the first key block
  pair_q_rows(rb, pairs, rows);
  group_rows(rb.mode->rows_per_vec, rb.rows, pairs, rows, pairs, rb.mode->chunks,
             reinterpret_cast<uint32_t*>(w.qt));
}

// Decode: s[r * lds + j] = K[j0 + j] · Q[r] on bf16 pairs for n <= kLanes keys, read in
// place when whole pairs of each row can be loaded as they are, then times the scale.
template <DType T, DType TK>
void AttentionTask<T, TK>::qk_rows_bf16(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t n,
                                        bool in_place, float* s, int64_t lds, const Workspace& w) const {
  const uint32_t* keys;
  int64_t ldk;
  if (in_place) {
    keys = reinterpret_cast<const uint32_t*>(krows.row(j0)), ldk = krows.stride / 2;
  } else {  // whole chunks of kLanes zero-padded rows
    const int64_t ld = rb.mode->chunked_row;
    uint32_t* kp = pack_key_pairs(krows, j0, n, ld, w);
    std::memset(kp + n * ld, 0, sizeof(uint32_t) * (kLanes - n) * ld);
    keys = kp, ldk = ld;
  }
  dot_key_block_bf16(rb.mode->rows_per_vec, rb.rows, rb.mode->chunks, keys, ldk,
                     reinterpret_cast<const uint32_t*>(w.qt), s, lds);
  const vfloat scale = vbroadcast(rb.scale);
  for (int64_t r = 0; r < rb.rows; ++r) vstore(s + r * lds, vload(s + r * lds) * scale);
}

// Decode: O += P · V for keys j0 .. j0+bc-1 on bf16 pairs of consecutive keys: P rounded to
// bf16 in place (row r's pairs at the start of its row of scores; keys past bc have P = 0),
// V's rows interleaved in registers (gemm_bf16_row_pairs), read where they lie when the
// block's keys are one run of unit-stride rows in pairs, else staged as bf16 rows in w.v
// (an fp8 cache's converted exactly; a lone last key pairs with a zero row). O comes in
// pair order.
template <DType T, DType TK>
void AttentionTask<T, TK>::pv_row_pairs(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc,
                                        const Workspace& w) const {
  const int64_t lds = kDecodeKeys;
  const uint32_t* pp = pair_score_rows(rb, w);
  const uint16_t* v;
  int64_t ldv;
  if (sizeof(EK) == 2 && bc % 2 == 0 && p_.v_stride[3] == 1 && vrows.run_end(j0, j0 + bc) == j0 + bc) {
    v = reinterpret_cast<const uint16_t*>(vrows.row(j0)), ldv = vrows.stride;  // EK is bf16 here
  } else {
    uint16_t* rows = reinterpret_cast<uint16_t*>(w.v);
    stage_bf16_rows(vrows, j0, bc, rows);
    if (bc % 2) std::memset(rows + bc * p_.Dv, 0, sizeof(uint16_t) * p_.Dv);
    v = rows, ldv = p_.Dv;
  }
  gemm_bf16_row_pairs<kRowPairRows, kRowPairVecs>(rb.rows, p_.Dv, (bc + 1) / 2, pp, lds, v, ldv, w.o,
                                                  plan_.dv_pad, true);
}

// The block's Q rows as bf16 pairs, unscaled: row r at rows + r * ld.
template <DType T, DType TK>
void AttentionTask<T, TK>::pair_q_rows(const RowBlock& rb, int64_t ld, uint32_t* rows) const {
  for (int64_t r = 0; r < rb.rows; ++r) {
    prefetch_q_ahead(rb, r);
    pack_pairs(reinterpret_cast<const uint16_t*>(q_row(rb, r)), p_.q_stride[3], rows + r * ld);  // E is bf16
  }
}

// Decode: P (row-major in w.st) rounded to bf16 and paired in place, row r's pairs at the start
// of its row (keys past the block's end have P = 0).
template <DType T, DType TK>
const uint32_t* AttentionTask<T, TK>::pair_score_rows(const RowBlock& rb, const Workspace& w) const {
  uint32_t* pp = reinterpret_cast<uint32_t*>(w.st);
  for (int64_t r = 0; r < rb.rows; ++r) {
    pair_values_bf16(w.st + r * kDecodeKeys, kDecodeKeys, pp + r * kDecodeKeys);
  }
  return pp;
}

// D elements at src (stride `stride`) as bf16 pairs; odd D ends with a zero.
template <DType T, DType TK>
void AttentionTask<T, TK>::pack_pairs(const uint16_t* src, int64_t stride, uint32_t* dst) const {
  if (stride == 1) {  // whole pairs as they lie (memcpy reads them unaligned)
    std::memcpy(dst, src, sizeof(uint16_t) * (p_.D & ~int64_t{1}));
    if (p_.D % 2) dst[p_.D / 2] = src[p_.D - 1];
    return;
  }
  for (int64_t d = 0; d < p_.D; d += 2)
    dst[d / 2] = pair(src[d * stride], d + 1 < p_.D ? src[(d + 1) * stride] : 0);
}

// K rows j0 .. j0+n-1 as bf16 pairs into w.k (an fp8 cache's converted exactly), rows of ld
// pairs (zero past the row's own pairs).
template <DType T, DType TK>
uint32_t* AttentionTask<T, TK>::pack_key_pairs(const KvRows<EK>& krows, int64_t j0, int64_t n, int64_t ld,
                                               const Workspace& w) const {
  uint32_t* kp = reinterpret_cast<uint32_t*>(w.k);
  if constexpr (sizeof(EK) == 1) {  // odd D ends with a zero
    convert_fp8_rows(krows, p_.k_stride[3], p_.D, j0, n, 2 * ld, reinterpret_cast<uint16_t*>(kp));
    return kp;
  }
  const int64_t pairs = (p_.D + 1) / 2;
  krows.for_each_run(j0, n, [&](const EK* k, int64_t first, int64_t count) {
    const uint16_t* k16 = reinterpret_cast<const uint16_t*>(k);  // EK is bf16 on this path
    for (int64_t j = first; j < first + count; ++j) {
      pack_pairs(k16 + (j - first) * krows.stride, p_.k_stride[3], kp + j * ld);
      std::memset(kp + j * ld + pairs, 0, sizeof(uint32_t) * (ld - pairs));
    }
  });
  return kp;
}

// bf16 V of a dense call as pairs of consecutive keys, once per (batch, kv head), in the
// layout of sage's (QuantizedKeys::v_pairs), or on AMX tiles (Plan::v_slabs) as Vᵀ's slabs:
// every task of the kv head shares them instead of interleaving each V tile itself. Keys
// past the batch's key length are zero.
template <DType T>
void prepare_v_pairs(const AttentionParams& p, const Plan& plan, uint32_t* v_pairs) {
  const int64_t pairs = plan.v_pairs_per_head, dv_pad = plan.dv_pad;
  // Pair rows [jp][dv_pad] (a slab's 16 staged in scratch, then transposed into it).
  auto pair_rows = [&](const uint16_t* v, int64_t skv, int64_t jp0, int64_t n, uint32_t* dst) {
    for (int64_t jp = jp0; jp < jp0 + n; ++jp, dst += dv_pad) {
      const int64_t j = 2 * jp;
      if (j >= skv) {
        std::memset(dst, 0, sizeof(uint32_t) * dv_pad);
        continue;
      }
      interleave_bf16_rows(v + j * p.v_stride[2], j + 1 < skv ? v + (j + 1) * p.v_stride[2] : nullptr,
                           p.v_stride[3], p.Dv, dv_pad, dst);
    }
  };
  const int threads = detail::num_threads();  // read once: the scratch must cover every task's thread
  AlignedBuffer<uint32_t> scratch(plan.v_slabs ? kLanes * dv_pad * threads : 0);
  auto body = [&](int64_t head, int thread) {
    const int64_t b = head / p.Hkv, kvh = head % p.Hkv, skv = p.kv_len ? p.kv_len[b] : p.Skv;
    const uint16_t* v =
        static_cast<const uint16_t*>(p.v) + b * p.v_stride[0] + kvh * p.v_stride[1];  // T is bf16 here
    uint32_t* dst = v_pairs + head * pairs * dv_pad;
    if (!plan.v_slabs) return pair_rows(v, skv, 0, pairs, dst);
    static_assert(kVSlabKeys == 2 * kLanes, "a slab is transposed as one kLanes-row block");
    uint32_t* rows = scratch.data + kLanes * dv_pad * thread;
    for (int64_t jp = 0; jp < pairs; jp += kLanes, dst += kLanes * dv_pad) {
      pair_rows(v, skv, jp, kLanes, rows);
      transpose_matrix(reinterpret_cast<const float*>(rows), dv_pad, kLanes, dv_pad, reinterpret_cast<float*>(dst),
                       kLanes);
    }
  };
  detail::parallel_for(p.B * p.Hkv, threads, body);
}

#else
template <DType T>
void prepare_v_pairs(const AttentionParams&, const Plan&, uint32_t*) {}
template <DType T, DType TK>
void AttentionTask<T, TK>::pack_qt_pairs(const RowBlock&, const Workspace&) const {}
template <DType T, DType TK>
void AttentionTask<T, TK>::qk_bf16(const RowBlock&, const KvRows<EK>&, int64_t, int64_t,
                                   const Workspace&) const {}
template <DType T, DType TK>
void AttentionTask<T, TK>::pv_bf16(const RowBlock&, const KvRows<EK>&, int64_t, int64_t, bool,
                                   const Workspace&) const {}
template <DType T, DType TK>
void AttentionTask<T, TK>::pack_q_row_pairs(const RowBlock&, const Workspace&) const {}
template <DType T, DType TK>
void AttentionTask<T, TK>::qk_rows_bf16(const RowBlock&, const KvRows<EK>&, int64_t, int64_t, bool, float*,
                                        int64_t, const Workspace&) const {}
template <DType T, DType TK>
void AttentionTask<T, TK>::pv_row_pairs(const RowBlock&, const KvRows<EK>&, int64_t, int64_t,
                                        const Workspace&) const {}
#endif

}  // namespace attnkit::cpu::ATTNKIT_ISA::fwd
