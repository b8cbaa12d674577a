// The attention forward's task: one row block (query rows sharing a kv head) over one
// range of its keys. This file holds what every driver shares: the row block's rows and
// keys, the kv-split merge and the epilogue (write_out); the member functions of the
// drivers are defined in tile_loop.h, decode.h, bf16_pairs.h, scores.h and sage_int8.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/attention/plan.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_dot.h"

namespace attnkit::cpu::ATTNKIT_ISA::fwd {

// TK is the dtype of K and V: T's, or float8 for paged caches (widened as they are packed).
template <DType T, DType TK = T>
class AttentionTask {
  using E = typename Elem<T>::type;
  using EK = typename Elem<TK>::type;

 public:
  // v_pairs: bf16 V as key pairs (prepare_v_pairs) where plan.v_pairs, else null.
  AttentionTask(const AttentionParams& p, const Plan& plan, const QuantizedKeys* kq = nullptr,
                const uint32_t* v_pairs = nullptr)
      : p_(p), plan_(plan), kq_(kq), v_pairs_(kq ? kq->v_pairs : v_pairs) {}

  // Row block `index` of the sequence it belongs to.
  RowBlock row_block(const Sequence& s, int64_t index) const {
    // Consecutive tasks share a kv head, so its K and V stay in cache between them (cycling
    // through all heads instead streamed shape A's 16 MB of fp32 K and V from memory and
    // measured 7-20% slower); within a head, heavy first: the last query blocks (most keys
    // under a causal mask) come first.
    const int64_t local = index - s.first_row_block;
    const int64_t per_kv = s.q_blocks * plan_.head_chunks;
    const int64_t qb = s.q_blocks - 1 - local % per_kv / plan_.head_chunks;
    const int64_t chunk = local % per_kv % plan_.head_chunks;
    RowBlock rb;
    rb.b = s.b, rb.kvh = local / per_kv;
    rb.row0 = s.row0, rb.skv = s.skv, rb.offset = s.offset;
    rb.i0 = qb * plan_.positions_per_task;
    rb.nq = s.sq - rb.i0 < plan_.positions_per_task ? s.sq - rb.i0 : plan_.positions_per_task;
    rb.h0 = rb.kvh * p_.group + chunk * plan_.heads_per_task;
    const int64_t nh_left = (rb.kvh + 1) * p_.group - rb.h0;
    rb.nh = nh_left < plan_.heads_per_task ? nh_left : plan_.heads_per_task;
    rb.rows = rb.nh * rb.nq;
    rb.cols = plan_.amx || plan_.int8 ? plan_.rows_pad : round_up(rb.rows, kLanes);
    rb.mode = &plan_.mode(rb.rows);
    rb.scale = p_.scale * (p_.k_scale ? p_.k_scale[rb.kvh * p_.k_scale_stride] : 1.0f);
    rb.v_scale = p_.v_scale ? p_.v_scale[rb.kvh * p_.v_scale_stride] : 1.0f;
    return rb;
  }

  // Row r of the block's queries: head h0 + r / nq at position i0 + r % nq.
  const E* q_row(const RowBlock& rb, int64_t r) const {
    return static_cast<const E*>(p_.q) + rb.b * p_.q_stride[0] + (rb.h0 + r / rb.nq) * p_.q_stride[1] +
           (rb.row0 + rb.i0 + r % rb.nq) * p_.q_stride[2];
  }
  // Asks for row r + kQueryRowsAhead of the block's queries (unit element stride): the packers
  // read each row once, and a short sequence's rows are not in L1 or L2 (varlen, 64 sequences
  // of 8-128 tokens, D 32: up to 12% of the time waited on them).
  void prefetch_q_ahead(const RowBlock& rb, int64_t r) const {
    if (r + kQueryRowsAhead < rb.rows && p_.q_stride[3] == 1)
      prefetch_bytes(q_row(rb, r + kQueryRowsAhead), 0, int64_t{sizeof(E)} * p_.D);
  }

  // Task = (row blocks, kv split): the row block of one kv head, or in decode those of
  // kv_heads_per_task kv heads (same queries' positions and keys). Without splits it writes
  // the output directly; with splits it leaves each row block's unnormalised state in its
  // slot of `partial` for merge().
  void run(int64_t task, float* workspace, float* partial) const {
    const Sequence& s = plan_.sequence_of_task(task);
    const int64_t local = task - s.first_task, split = local % s.kv_splits, unit = local / s.kv_splits;
    const int64_t per_kv = s.q_blocks * plan_.head_chunks;  // row blocks per kv head
    const int64_t kvh0 = unit / per_kv * s.kv_heads_per_task, block_in_head = unit % per_kv;
    const int64_t kv_heads = std::min(s.kv_heads_per_task, p_.Hkv - kvh0);
    RowBlock rbs[kDecodeKvHeads];
    for (int64_t i = 0; i < kv_heads; ++i) rbs[i] = row_block(s, s.first_row_block + (kvh0 + i) * per_kv + block_in_head);
    const KeyRange keys = visible_keys(rbs[0]);  // the same for every kv head
    const int64_t split_begin = keys.begin + split * s.kv_split_len;
    const int64_t end = std::max(split_begin, std::min(split_begin + s.kv_split_len, keys.end));
    const Workspace w(workspace, plan_, p_);
    if (kv_heads == 1) {
      attend(rbs[0], split_begin, end, w);
    } else {
      attend_kv_heads(rbs, kv_heads, split_begin, end, w);
    }
    for (int64_t i = 0; i < kv_heads; ++i) {
      const Workspace wh = kv_heads == 1 ? w : w.head(i);
      if (s.kv_splits == 1) {
        write_out(rbs[i], wh.o, wh.m, wh.l, w.v);
        continue;
      }
      const int64_t row_block_local = (kvh0 + i) * per_kv + block_in_head;
      float* slot = partial + (s.first_slot + row_block_local * s.kv_splits + split) * plan_.partial_floats;
      std::memcpy(slot, wh.o, sizeof(float) * rbs[i].rows * plan_.dv_pad);
      std::memcpy(slot + plan_.rows_pad * plan_.dv_pad, wh.m, sizeof(float) * rbs[i].rows);
      std::memcpy(slot + plan_.rows_pad * (plan_.dv_pad + 1), wh.l, sizeof(float) * rbs[i].rows);
    }
  }

  // Combines the kv splits of one row block: with M = max_s m_s, the row's sum is
  // Σ_s l_s e^(m_s - M) and its output Σ_s o_s e^(m_s - M), exactly as one pass would.
  // Row blocks without splits were written by run().
  void merge(int64_t row_block_index, float* workspace, const float* partial) const {
    const Sequence& s = plan_.sequence_of_row_block(row_block_index);
    if (s.kv_splits == 1) return;
    const RowBlock rb = row_block(s, row_block_index);
    Workspace w(workspace, plan_, p_);
    const int64_t dv_pad = plan_.dv_pad, rows_pad = plan_.rows_pad, splits = s.kv_splits;
    const float* first =
        partial + (s.first_slot + (row_block_index - s.first_row_block) * splits) * plan_.partial_floats;
    for (int64_t r = 0; r < rb.rows; ++r) {
      float mx = -INFINITY;
      for (int64_t k = 0; k < splits; ++k) {
        const float ms = first[k * plan_.partial_floats + rows_pad * dv_pad + r];
        mx = ms > mx ? ms : mx;
      }
      float* o = w.o + r * dv_pad;
      std::memset(o, 0, sizeof(float) * dv_pad);
      float l = 0.0f;
      // No split moved the max (no visible key, or only NaN scores, which never win the max):
      // weigh against 0 as the online softmax does, so a NaN sum still reaches l.
      const float m_ref = mx == -INFINITY ? 0.0f : mx;
      for (int64_t k = 0; k < splits; ++k) {
        const float* slot = first + k * plan_.partial_floats;
        const float factor = std::exp(slot[rows_pad * dv_pad + r] - m_ref);
        l += slot[rows_pad * (dv_pad + 1) + r] * factor;
        const vfloat f = vbroadcast(factor);
        for (int64_t d = 0; d < dv_pad; d += kLanes)
          vstore(o + d, vload(o + d) + vload(slot + r * dv_pad + d) * f);
      }
      w.m[r] = mx;
      w.l[r] = l;
    }
    write_out(rb, w.o, w.m, w.l, w.v);
  }

 private:
  // The query at position i is aligned to key position i + key_offset: the causal limit, the
  // window and ALiBi's distance all measure from there.
  int64_t key_offset(const RowBlock& rb) const { return rb.offset; }

  // Keys [begin, end) that some row of the block can see: up to the causal limit or the
  // window's right edge of its last row, from the window's left edge of its first row
  // rounded down to a multiple of 4 (one dropout draw covers 4 keys), for sage to a tile
  // border (its K scales and V pairs are per tile), with V's slabs to a slab border. Keys
  // outside are never visited, so a window costs O(Sq · window).
  KeyRange visible_keys(const RowBlock& rb) const {
    const int64_t first = rb.i0 + key_offset(rb), last = first + rb.nq - 1;  // aligned positions
    const int64_t align = plan_.int8 ? kKvTile : plan_.v_slabs ? kVSlabKeys : 4;
    KeyRange keys{0, rb.skv};
    if (p_.causal && last + 1 < keys.end) keys.end = last + 1;
    if (p_.window_right >= 0 && last + p_.window_right + 1 < keys.end) keys.end = last + p_.window_right + 1;
    if (p_.window_left >= 0 && first - p_.window_left > 0)
      keys.begin = (first - p_.window_left) / align * align;
    if (keys.end < keys.begin) keys.end = keys.begin;
    return keys;
  }

  // The K (or V) rows of the block's sequence and kv head.
  KvRows<EK> kv_rows(const void* data, const int64_t* stride, const RowBlock& rb) const {
    const EK* base = static_cast<const EK*>(data) + rb.kvh * stride[1];
    if (p_.block_table) {
      return KvRows<EK>::paged(base, stride[2], p_.block_table + rb.b * p_.block_table_stride, p_.block_size, stride[0]);
    }
    const int64_t first = p_.kv_begin ? p_.kv_begin[rb.b] : 0;
    return {base + rb.b * stride[0] + first * stride[2], stride[2]};
  }

  // out = o / (l + e^(sink - m)) (times the cache's v_scale) in the output dtype (the sink
  // term only with sinks), and lse = m + log(l), without the sink as in sparse MLA (-inf for
  // rows that saw no key; their out is 0, sink or not). scratch holds Dv floats.
  void write_out(const RowBlock& rb, const float* o_acc, const float* m, const float* ls,
                 float* scratch) const {
    E* out = static_cast<E*>(p_.out);
    // Sage int8's m and l are of the logits smoothed by q·mean, unless the soft-cap put it back.
    const bool shifted = kq_ && p_.softcap == 0.0f && (p_.lse || p_.sinks);
    for (int64_t r = 0; r < rb.rows; ++r) {
      const int64_t h = rb.h0 + r / rb.nq, i = rb.i0 + r % rb.nq;
      const float l = ls[r];
      const float shift = shifted ? lse_shift(rb, h, i) : 0.0f;
      float denom = l;
      if (p_.sinks && l > 0.0f) denom += std::exp(p_.sinks[h * p_.sinks_stride] - (m[r] + shift));
      const float inv =
          (denom > 0.0f ? 1.0f / denom : (l == 0.0f ? 0.0f : denom)) * rb.v_scale;  // denom is NaN or >= 1
      const float* o = o_acc + r * plan_.dv_pad;
      const int64_t row = rb.row0 + i;  // packed row (ragged batches), else the position
      E* dst = out + rb.b * p_.out_stride[0] + h * p_.out_stride[1] + row * p_.out_stride[2];
      if (rb.mode->v_split_bf16 || rb.mode->amx_tiles) {  // split order back to column order
        unsplit_bf16_row(o, p_.Dv, scratch);
        o = scratch;
      }
#if defined(ATTNKIT_ISA_avx512bf16)
      if (rb.mode->pv_row_pairs) {
        unpair_bf16_row(o, p_.Dv, scratch);
        o = scratch;
      }
#endif
      if (plan_.pv_int8) o = unquantize_pv(rb, o, l, scratch);
      // Sage's P·V on bf16 pairs rounds float16 V up past 65504 (65440 to 65536), which out,
      // a convex combination of V, never exceeds: saturate rather than store inf.
      if constexpr (T == DType::float16) {
        if (kq_) store_row_float16_saturated(o, inv, p_.Dv, dst, p_.out_stride[3]);
        else store_row<T>(o, inv, p_.Dv, dst, p_.out_stride[3]);
      } else {
        store_row<T>(o, inv, p_.Dv, dst, p_.out_stride[3]);
      }
      if (p_.lse) {
        p_.lse[rb.b * p_.lse_stride[0] + h * p_.lse_stride[1] + row * p_.lse_stride[2]] =
            l == 0.0f ? -INFINITY : m[r] + std::log(l) + shift;
      }
    }
  }

  // The tile loop (tile_loop.h): Sᵀ = K · Qᵀ per tile of kKvTile keys, rows along the lanes.
  void attend(const RowBlock& rb, int64_t begin, int64_t end, const Workspace& w) const;
  bool o_transposed(const RowBlock& rb) const;
  void rescale_output(const RowBlock& rb, const Workspace& w) const;
  void accumulate_pv(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc, const Scores& p,
                     const Workspace& w) const;
  void pack_qt(const RowBlock& rb, const Workspace& w) const;
  void prefetch_key_tile(const KvRows<EK>& krows, const KvRows<EK>& vrows, int64_t begin, int64_t end) const;
  static void pack_rows(const KvRows<EK>& rows, int64_t j0, int64_t n, int64_t col_stride, int64_t cols,
                        int64_t ld, float* dst);
  void stage_bf16_rows(const KvRows<EK>& vrows, int64_t j0, int64_t n, uint16_t* rows) const;

  // Decode (decode.h): key blocks of one vector, row-major scores.
  void attend_rows(const RowBlock& rb, int64_t begin, int64_t end, const Workspace& w) const;
  bool attend_again_apart(const RowBlock& rb, const Workspace& w) const;
  void attend_kv_heads(const RowBlock* rbs, int64_t kv_heads, int64_t begin, int64_t end, const Workspace& w) const;
  void start_rows(const RowBlock& rb, const Workspace& w) const;
  // st_t: on AMX tiles (Mode::amx_tiles), the block's Sᵀ computed ahead (scores_ahead); else null.
  // v_apart: on AMX tiles, V's even and odd columns staged apart (pv_rows_amx).
  // v_staged / k_staged: on AMX tiles over an fp8 cache, the block's V / K rows in bf16
  // (convert_fp8_rows), else null.
  // read_ahead: over several kv heads with p.l2_read_ahead, this visit's share of a later
  // block to prefetch into L2 (attend_kv_heads), else null.
  struct ReadAhead;
  void attend_key_block(const RowBlock& rb, const KvRows<EK>& krows, const KvRows<EK>& vrows, int64_t j0,
                        int64_t end, bool prefetch, bool v_apart, const Workspace& w, const float* st_t,
                        const uint16_t* v_staged, const ReadAhead* read_ahead = nullptr) const;
  void scores_ahead(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t end, const Workspace& w,
                    float* st_t, const uint16_t* k_staged) const;
  void convert_fp8_rows(const KvRows<EK>& rows, int64_t col_stride, int64_t cols, int64_t j0, int64_t n,
                        int64_t width, uint16_t* dst) const;
  float* scores_t(const Workspace& w, int64_t slot) const;
  static void prefetch_rows(const KvRows<EK>& rows, int64_t first, int64_t end, int64_t cols);
  static void touch_key_block(const KvRows<EK>& krows, const KvRows<EK>& vrows, int64_t k_span, int64_t v_span,
                              int64_t j0, int64_t end, bool loads);
  static void prefetch_share(const KvRows<EK>& krows, const KvRows<EK>& vrows, int64_t k_span, int64_t v_span,
                             int64_t j0, int64_t end, int64_t i, int64_t kv_heads);
  void qk_key_block(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t n, float* s, int64_t lds,
                    const Workspace& w) const;
  void pack_q_rows(const RowBlock& rb, const Workspace& w) const;

  // bf16 pairs for vdpbf16ps (bf16_pairs.h; empty on variants without it).
  void pack_qt_pairs(const RowBlock& rb, const Workspace& w) const;
  void qk_bf16(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t bc, const Workspace& w) const;
  void pv_bf16(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc, bool p_paired,
               const Workspace& w) const;
  void pv_pairs(const RowBlock& rb, const uint32_t* pp, const uint32_t* vp, int64_t pairs, const Workspace& w) const;
  void interleave_v_tile(const KvRows<EK>& vrows, int64_t j0, int64_t bc, uint32_t* vp, const Workspace& w) const;
  void pack_q_row_pairs(const RowBlock& rb, const Workspace& w) const;
  void qk_rows_bf16(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t n, bool in_place,
                    float* s, int64_t lds, const Workspace& w) const;
  void pv_row_pairs(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc, const Workspace& w) const;
#if defined(ATTNKIT_ISA_avx512bf16)
  static uint32_t pair(uint16_t lo, uint16_t hi);
  void pack_pairs(const uint16_t* src, int64_t stride, uint32_t* dst) const;
  void pair_q_rows(const RowBlock& rb, int64_t ld, uint32_t* rows) const;
  const uint32_t* pair_score_rows(const RowBlock& rb, const Workspace& w) const;
  uint32_t* pack_key_pairs(const KvRows<EK>& krows, int64_t j0, int64_t n, int64_t ld,
                           const Workspace& w) const;
#endif
#if defined(ATTNKIT_ISA_avx512amx)
  void qk_amx(const KvRows<EK>& krows, bool k_in_place, int64_t j0, int64_t bc, const Workspace& w) const;
  void pv_amx(const RowBlock& rb, const KvRows<EK>& vrows, uint32_t* pp, int64_t j0, int64_t bc,
              const Workspace& w) const;
  void pv_amx_slabs(const RowBlock& rb, const uint32_t* pp, int64_t j0, int64_t bc, const Workspace& w) const;
#endif
  // Decode on AMX tiles (bf16_pairs.h; defined on avx512amx only, called under kAmxTiles).
  void start_rows_amx(const RowBlock& rb, const Workspace& w) const;
  void qk_tiles_amx(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t bc, const Workspace& w,
                    float* st_t, const uint16_t* k_staged) const;
  void take_scores_amx(const RowBlock& rb, const float* st_t, const Workspace& w) const;
  void pv_rows_amx(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc, bool v_apart,
                   const Workspace& w, const uint16_t* v_staged) const;

  // Masks, score modifiers and dropout on a tile of scores (scores.h).
  void apply_masks(const RowBlock& rb, int64_t j0, int64_t bc, const Scores& st) const;
  void apply_score_mods(const RowBlock& rb, int64_t j0, int64_t bc, const Scores& st,
                        const Workspace& w) const;
  void apply_dropout(const RowBlock& rb, int64_t j0, int64_t bc, const Scores& pt) const;

  // Sage int8 (sage_int8.h).
  void pack_q_int8(const RowBlock& rb, const Workspace& w) const;
  void qk_int8(const RowBlock& rb, int64_t j0, int64_t bc, const Workspace& w) const;
  void fix_nonfinite_logits(const RowBlock& rb, int64_t j0, int64_t bc, const Workspace& w) const;
  float lse_shift(const RowBlock& rb, int64_t h, int64_t i) const;
  void pv_int8(const RowBlock& rb, int64_t j0, int64_t bc, const Workspace& w) const;
  void add_exact_values(const RowBlock& rb, int64_t j0, int64_t bc, const Workspace& w) const;
  bool values_exact(const RowBlock& rb, int64_t j0, int64_t bc) const;
  const float* unquantize_pv(const RowBlock& rb, const float* o, float l, float* scratch) const;

  const AttentionParams& p_;
  const Plan& plan_;
  const QuantizedKeys* kq_;  // sage int8 mode only
  // V as bf16 key pairs (sage's or dense's), or null: [B][Hkv][ceil(Skv / 2)][dv_pad], or with
  // Plan::v_slabs Vᵀ's slabs [B][Hkv][slab][dv_pad][16 pairs].
  const uint32_t* v_pairs_;
};

}  // namespace attnkit::cpu::ATTNKIT_ISA::fwd
