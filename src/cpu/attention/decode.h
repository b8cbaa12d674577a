// Decode: row blocks of few rows (kLanes / 2 at most) run key blocks of kDecodeKeys keys
// with row-major scores (keys along the lanes, no padded rows): dot_key_block for Q·Kᵀ,
// whole-row P·V tiles (on avx512amx over grouped kv heads: both products on AMX tiles,
// bf16_pairs.h), K and V read in address order with software prefetch where it pays
// (TimedChoice).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/attention/task.h"
#include "cpu/kernels/dot.h"
#include "cpu/kernels/softmax.h"

namespace attnkit::cpu::ATTNKIT_ISA::fwd {

// Decode's ways of bringing K and V in differ in speed from machine to machine and, on this
// VM, from process to process with the memory's state: at one thread Dc took 1.6 ms with the
// hardware prefetchers alone in some processes and 4-5.5 ms in others, 2.3-4 ms with software
// prefetches in both. So each task times two ways on alternate runs of blocks after a
// warm-up and keeps the faster: 1.7 ms and 3.9 ms in those states. Timing only; results
// never depend on it.
class TimedChoice {
 public:
  // Whether the task's block number `block` (from 0) takes the first way: yes through the
  // warm-up, then alternate runs of kRun blocks (even runs yes), then the faster way.
  bool first(int64_t block) {
    if (block >= kDecide) return chosen_;
    if (block < kWarmup) return true;
    return (block - kWarmup) / kRun % 2 == 0;
  }
  // Called when block number `block` is done: times the alternate runs.
  void done(int64_t block) {
    if (block < kWarmup - 1 || block >= kDecide) return;
    const auto now = std::chrono::steady_clock::now();
    if (block >= kWarmup) spent_[(block - kWarmup) / kRun % 2] += now - last_;
    last_ = now;
    if (block == kDecide - 1) chosen_ = spent_[0] <= spent_[1];
  }

 private:
  static constexpr int64_t kWarmup = 4, kRun = 4, kDecide = kWarmup + 8 * kRun;
  std::chrono::steady_clock::time_point last_;
  std::chrono::steady_clock::duration spent_[2] = {};  // in runs of the first, the second way
  bool chosen_ = true;
};

// Decode: few rows, so scores are row-major (keys along the lanes, no padded rows), in
// blocks of kDecodeKeys keys computed kLanes keys at a time (on AMX tiles a block ahead).
// K and V are read in address order (dot_key_block, whole-row P·V tiles), with software
// prefetch where it pays.
template <DType T, DType TK>
void AttentionTask<T, TK>::attend_rows(const RowBlock& rb, int64_t begin, int64_t end,
                                       const Workspace& w) const {
  for (const bool v_apart : {false, true}) {
    start_rows(rb, w);
    const KvRows<EK> krows = kv_rows(p_.k, p_.k_stride, rb), vrows = kv_rows(p_.v, p_.v_stride, rb);
    TimedChoice prefetch;  // software prefetch, or the hardware prefetchers alone
    const bool ahead = rb.mode->amx_tiles;
    if (ahead) scores_ahead(rb, krows, begin, end, w, scores_t(w, 0), nullptr);
    for (int64_t j0 = begin; j0 < end; j0 += kDecodeKeys) {
      const int64_t block = (j0 - begin) / kDecodeKeys;
      if (ahead) scores_ahead(rb, krows, j0 + kDecodeKeys, end, w, scores_t(w, (block + 1) % 2), nullptr);
      attend_key_block(rb, krows, vrows, j0, end, prefetch.first(block), v_apart, w,
                       ahead ? scores_t(w, block % 2) : nullptr, nullptr);
      prefetch.done(block);
    }
    if (v_apart || !attend_again_apart(rb, w)) return;
  }
}

// Decode on AMX tiles reads V's rows in place, each tile's products pairing a key's P with
// two columns (pv_rows_amx), so a non-finite V value makes its partner column NaN too
// (0 · inf). Where a row's O holds a NaN (rare: NaN or infinite inputs), the range is
// attended again with V's even and odd columns staged apart, which gives each column its
// own products only.
template <DType T, DType TK>
bool AttentionTask<T, TK>::attend_again_apart(const RowBlock& rb, const Workspace& w) const {
  if (!rb.mode->amx_tiles) return false;
  vint nan = {};  // lanes where some row's O held a NaN (Dv is whole vectors here)
  for (int64_t r = 0; r < rb.rows; ++r) {
    for (int64_t d = 0; d < p_.Dv; d += kLanes) {
      const vfloat o = vload(w.o + r * plan_.dv_pad + d);
      nan |= o != o;
    }
  }
  for (int i = 0; i < kLanes; ++i) {
    if (nan[i]) return true;
  }
  return false;
}

// Decode on AMX tiles: Sᵀ of the key block from j0 (none at or past `end`) into st_t, a step
// ahead of its softmax, so the tile products of the next step (block, or kv head) run while
// this one's softmax runs on vectors: on the Xeon with AMX (P16 bf16 with K and V in L2, one
// thread) 9.3 ms with Sᵀ computed in its own step, 8.4-9.0 ahead.
template <DType T, DType TK>
void AttentionTask<T, TK>::scores_ahead(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t end,
                                        const Workspace& w, float* st_t, const uint16_t* k_staged) const {
  if constexpr (kAmxTiles) {
    if (j0 < end) qk_tiles_amx(rb, krows, j0, end - j0 < kDecodeKeys ? end - j0 : kDecodeKeys, w, st_t, k_staged);
  }
}

// Decode on AMX tiles: the two Sᵀ buffers (16 keys × up to kMaxDotRows rows) of the steps in
// flight, after V's staged bf16 rows (twice, with V's columns apart) in w.v (kKvTile rows of
// dv_pad floats).
template <DType T, DType TK>
float* AttentionTask<T, TK>::scores_t(const Workspace& w, int64_t slot) const {
  static_assert(kDecodeKeys * kLanes + 2 * kDecodeKeys * kMaxDotRows <= kKvTile * kLanes,
                "V's rows and both buffers fit in w.v at the smallest dv_pad");
  return w.v + kDecodeKeys * plan_.dv_pad + slot * kDecodeKeys * kMaxDotRows;
}

// Share `share` of `shares` of the K and V rows of the key block from j0 (attend_kv_heads),
// prefetched into L2 in kParts parts over one head's visit to a block: before it and after its
// Q·Kᵀ. All at once, the prefetches filled the miss queues and the visit's compute waited
// behind them (Zen 4, one thread: a quarter of the decode's samples on the prefetch
// instructions); in two parts paged decode took 0.72-0.73 of the time (bf16, block size 16
// and 128; 0.81-0.85 at two threads).
template <DType T, DType TK>
struct AttentionTask<T, TK>::ReadAhead {
  static constexpr int kParts = 2;
  const KvRows<EK>& krows;
  const KvRows<EK>& vrows;
  int64_t k_span, v_span, j0, end, share, shares;
  void part(int k) const {
    prefetch_share(krows, vrows, k_span, v_span, j0, end, kParts * share + k, kParts * shares);
  }
};

// Decode over the row blocks of several kv heads whose K/V rows lie side by side (paged
// caches, packed K/V): each key block for every head in turn, so the block's rows of all
// heads are read together rather than each head's with a stride of Hkv rows; each head
// keeps its state in w.head(i). The heads' visits to a block are not in address order,
// which the hardware prefetchers do not follow, so the task reads ahead in address order,
// one request per cache line, in one of two ways:
//  - p.l2_read_ahead (the machine's rule, core/dispatch.cpp: AMD Zen 4): the block after
//    next by software prefetches into L2, a share of its keys at each head's turn, spread
//    over the turn (ReadAhead). On Zen 4
//    (16 sequences of 2102-3902 keys, 8 kv heads, block size 16 and 128, bf16 and fp8
//    caches) 0.64-0.86 of the time of the other way at one thread, 0.72-0.86 at two. On
//    Zen 5 the other way took 10-30% less time (bf16 at block size 16 and 128, fp8 at 16;
//    fp8 at 128 the same). Timing the two ways on runs of blocks within a task (TimedChoice)
//    picked the wrong one on Zen 4, and its trials cost more than the choice gained.
//  - else the next block's K and V rows of all heads, before the heads' visits: by loads or
//    by software prefetches into L1, whichever the task times faster (TimedChoice); on the
//    Xeon with AMX (X7) 2-6% less time than the loads alone. Prefetching the whole block at
//    once, or share-wise with loads, measured no faster than no read-ahead (Zen 5); a pure
//    read of those blocks in the heads' order ran at 19 GB/s, in address order at 28 (Zen 5,
//    one thread).
template <DType T, DType TK>
void AttentionTask<T, TK>::attend_kv_heads(const RowBlock* rbs, int64_t kv_heads, int64_t begin, int64_t end,
                                           const Workspace& w) const {
  KvRows<EK> krows[kDecodeKvHeads], vrows[kDecodeKvHeads];
  for (int64_t i = 0; i < kv_heads; ++i) {
    krows[i] = kv_rows(p_.k, p_.k_stride, rbs[i]), vrows[i] = kv_rows(p_.v, p_.v_stride, rbs[i]);
    krows[i].read_ahead = vrows[i].read_ahead = p_.l2_read_ahead;
  }
  // Key j's K (V) rows of all the task's heads: this many bytes from the first head's (between
  // the first's and the last's; the heads share one block table, see Plan::group_kv_heads).
  const int64_t k_span = (krows[kv_heads - 1].base - krows[0].base + p_.D) * int64_t{sizeof(EK)};
  const int64_t v_span = (vrows[kv_heads - 1].base - vrows[0].base + p_.Dv) * int64_t{sizeof(EK)};
  for (const bool v_apart : {false, true}) {
    for (int64_t i = 0; i < kv_heads; ++i) start_rows(rbs[i], w.head(i));
    TimedChoice loads;  // without p.l2_read_ahead: the next block by loads, or by prefetches into L1
    touch_key_block(krows[0], vrows[0], k_span, v_span, begin, end, true);
    const bool ahead = rbs[0].mode->amx_tiles;  // every head's row block has the same rows
    // An fp8 cache on AMX tiles: each step's K and V rows converted to bf16 a step before its
    // tiles read them, into two slots each by turns, so that no tile load waits on the stores
    // that wrote its operand (X7, paged decode: P128 0.93-0.95 of the time, P16 unchanged;
    // a block ahead, all heads' rows, measured slower). Step s is head s % kv_heads at key
    // block s / kv_heads.
    const bool staged = ahead && sizeof(EK) == 1 && !v_apart;
    const int64_t k_width = 2 * round_up((p_.D + 1) / 2, kLanes);  // K rows as whole tiles of pairs
    auto key_of = [&](int64_t s) { return begin + s / kv_heads * kDecodeKeys; };
    auto k_slot = [&](int64_t s) { return reinterpret_cast<uint16_t*>(w.k) + s % 2 * kDecodeKeys * k_width; };
    auto v_slot = [&](int64_t s) { return reinterpret_cast<uint16_t*>(w.v) + s % 2 * kDecodeKeys * p_.Dv; };
    auto stage = [&](int64_t s, bool k) {  // rows past `end` zero
      if (!staged || key_of(s) >= end) return;
      const int64_t i = s % kv_heads, bc = std::min(end - key_of(s), kDecodeKeys), width = k ? k_width : p_.Dv;
      uint16_t* dst = k ? k_slot(s) : v_slot(s);
      if (k) convert_fp8_rows(krows[i], p_.k_stride[3], p_.D, key_of(s), bc, width, dst);
      else convert_fp8_rows(vrows[i], p_.v_stride[3], p_.Dv, key_of(s), bc, width, dst);
      std::fill(dst + bc * width, dst + kDecodeKeys * width, uint16_t{0});
    };
    stage(0, true), stage(1, true), stage(0, false);
    if (ahead) scores_ahead(rbs[0], krows[0], begin, end, w.head(0), scores_t(w, 0), staged ? k_slot(0) : nullptr);
    int64_t step = 0;  // (key block, head) in the order they run
    for (int64_t j0 = begin; j0 < end; j0 += kDecodeKeys) {
      const int64_t block = (j0 - begin) / kDecodeKeys;
      if (!p_.l2_read_ahead) touch_key_block(krows[0], vrows[0], k_span, v_span, j0 + kDecodeKeys, end, loads.first(block));
      for (int64_t i = 0; i < kv_heads; ++i, ++step) {
        // (the first block, loaded above; the second with it)
        if (p_.l2_read_ahead && block == 0) {
          prefetch_share(krows[0], vrows[0], k_span, v_span, j0 + kDecodeKeys, end, i, kv_heads);
        }
        const ReadAhead read_ahead{krows[0], vrows[0], k_span, v_span, j0 + 2 * kDecodeKeys, end, i, kv_heads};
        if (ahead) {
          const bool last = i + 1 == kv_heads;
          const int64_t next = last ? 0 : i + 1;
          scores_ahead(rbs[next], krows[next], last ? j0 + kDecodeKeys : j0, end, w.head(next),
                       scores_t(w, (step + 1) % 2), staged ? k_slot(step + 1) : nullptr);
          stage(step + 2, true);
        }
        attend_key_block(rbs[i], krows[i], vrows[i], j0, end, false, v_apart, w.head(i),
                         ahead ? scores_t(w, step % 2) : nullptr, staged ? v_slot(step) : nullptr,
                         p_.l2_read_ahead ? &read_ahead : nullptr);
        stage(step + 1, false);
      }
      loads.done(block);
    }
    bool again = false;
    for (int64_t i = 0; i < kv_heads; ++i) again = again || attend_again_apart(rbs[i], w.head(i));
    if (v_apart || !again) return;
  }
}

// Decode over several kv heads: the K rows, then the V rows, of keys j0 .. j0 + kDecodeKeys - 1
// (those before `end`), k_span / v_span bytes each from krows' / vrows' row, one load (or
// software prefetch into L1) per line.
template <DType T, DType TK>
void AttentionTask<T, TK>::touch_key_block(const KvRows<EK>& krows, const KvRows<EK>& vrows, int64_t k_span,
                                           int64_t v_span, int64_t j0, int64_t end, bool loads) {
  const int64_t j1 = std::min(end, j0 + kDecodeKeys);
  if (!loads) {
    for (int64_t j = j0; j < j1; ++j) prefetch_bytes(krows.row(j), 0, k_span);
    for (int64_t j = j0; j < j1; ++j) prefetch_bytes(vrows.row(j), 0, v_span);
    return;
  }
  uint32_t sum = 0;
  for (int64_t j = j0; j < j1; ++j) sum += touch_lines(krows.row(j), k_span);
  for (int64_t j = j0; j < j1; ++j) sum += touch_lines(vrows.row(j), v_span);
  asm volatile("" : : "r"(sum));  // keeps the loads
}

// Decode over several kv heads: share i of kv_heads of the K and V rows of the key block from
// j0 (the keys before `end`), k_span / v_span bytes each (as touch_key_block), by software
// prefetches into L2.
template <DType T, DType TK>
void AttentionTask<T, TK>::prefetch_share(const KvRows<EK>& krows, const KvRows<EK>& vrows, int64_t k_span,
                                          int64_t v_span, int64_t j0, int64_t end, int64_t i, int64_t kv_heads) {
  const int64_t keys = std::clamp<int64_t>(end - j0, 0, kDecodeKeys);
  for (int64_t j = j0 + i * keys / kv_heads; j < j0 + (i + 1) * keys / kv_heads; ++j) {
    prefetch_bytes(krows.row(j), 0, k_span, Cache::l2);
    prefetch_bytes(vrows.row(j), 0, v_span, Cache::l2);
  }
}

// Rows j0 .. j0+n-1 of an fp8 cache's `rows` (cols values, col_stride apart) converted
// exactly to bf16 rows of `width` values at dst, zero past cols: K as bf16 pairs along D, or
// the decode's K and V rows staged for AMX tiles. The row kPrefetchRows ahead of each, where
// it lies in the same page, is prefetched as pack_rows does (without it the K loads stalled
// and shape P128 took 1.3x the fp32 path's time), unless the caller reads the rows ahead
// into L2 (KvRows::read_ahead): on Zen 4 those prefetches into L1 then competed with the
// read-ahead, and the loads here stalled on misses (without them P128 fp8 took 0.66-0.71 of
// the time at one thread, 0.60-0.69 at two; P16 fp8 0.94-0.95).
template <DType T, DType TK>
void AttentionTask<T, TK>::convert_fp8_rows(const KvRows<EK>& rows, int64_t col_stride, int64_t cols, int64_t j0,
                                            int64_t n, int64_t width, uint16_t* dst) const {
  if constexpr (sizeof(EK) == 1) {
    const Fp8ToBf16<TK> convert;
    rows.for_each_run(j0, n, [&](const EK* src, int64_t first, int64_t count) {
      for (int64_t j = first; j < first + count; ++j, src += rows.stride) {
        if (!rows.read_ahead && rows.in_page(j0 + j, kPrefetchRows)) prefetch_bytes(src, kPrefetchRows * rows.stride, cols);
        convert.row(src, col_stride, cols, dst + j * width);
        std::fill(dst + j * width + cols, dst + (j + 1) * width, uint16_t{0});
      }
    });
  }
}

// Decode: Q packed, O zero, the softmax state empty.
template <DType T, DType TK>
void AttentionTask<T, TK>::start_rows(const RowBlock& rb, const Workspace& w) const {
  if (rb.mode->amx_tiles) {
    if constexpr (kAmxTiles) start_rows_amx(rb, w);
  } else if (rb.mode->qk_pairs) {
    pack_q_row_pairs(rb, w);
  } else {
    pack_q_rows(rb, w);
  }
  std::memset(w.o, 0, sizeof(float) * rb.rows * plan_.dv_pad);
  for (int64_t r = 0; r < rb.rows; ++r) w.m[r] = -INFINITY, w.l[r] = 0.0f;
}

// Decode: the key block from j0 (kDecodeKeys keys, fewer before `end`): scores, modifiers,
// masks, the online softmax and O += P · V.
template <DType T, DType TK>
void AttentionTask<T, TK>::attend_key_block(const RowBlock& rb, const KvRows<EK>& krows, const KvRows<EK>& vrows,
                                            int64_t j0, int64_t end, bool prefetch, bool v_apart,
                                            const Workspace& w, const float* st_t,
                                            const uint16_t* v_staged, const ReadAhead* read_ahead) const {
  const int64_t ld = kDecodeKeys;
  const Scores scores{w.st, 1, ld};
  const int64_t bc = end - j0 < kDecodeKeys ? end - j0 : kDecodeKeys;
  const int64_t width = round_up(bc, kLanes);
  // This block's V rows into L2 before its Q·Kᵀ, the next block's K rows before its P·V:
  // each about half a block ahead of use (of the orders tried, the best across memory
  // states: the next block's K and V, two blocks ahead, part of each row, key by key).
  if (prefetch) prefetch_rows(vrows, j0, end, p_.Dv);
  if (read_ahead) read_ahead->part(0);
  if (rb.mode->amx_tiles) {
    if constexpr (kAmxTiles) take_scores_amx(rb, st_t, w);
  } else {
    for (int64_t c = 0; c < bc; c += kLanes) {
      qk_key_block(rb, krows, j0 + c, bc - c < kLanes ? bc - c : kLanes, w.st + c, ld, w);
    }
  }
  if (read_ahead) read_ahead->part(1);
  apply_score_mods(rb, j0, bc, scores, w);  // before the padding: the soft-cap would lift its -inf
  for (int64_t r = 0; r < rb.rows; ++r) {   // keys past the block's end
    for (int64_t j = bc; j < width; ++j) w.st[r * ld + j] = -INFINITY;
  }
  apply_masks(rb, j0, bc, scores);
  online_softmax_rows(w.st, width, ld, rb.rows, w.m, w.l, w.alpha);
  rescale_output(rb, w);
  if (p_.dropout_p > 0.0f) apply_dropout(rb, j0, bc, scores);
  // (On AMX tiles the next block's Sᵀ is already under way: the block after it.)
  if (prefetch) prefetch_rows(krows, j0 + (rb.mode->amx_tiles ? 2 : 1) * kDecodeKeys, end, p_.D);
  if (rb.mode->amx_tiles) {
    if constexpr (kAmxTiles) pv_rows_amx(rb, vrows, j0, bc, v_apart, w, v_staged);
  } else if (rb.mode->pv_row_pairs) {
    pv_row_pairs(rb, vrows, j0, bc, w);
  } else {
    accumulate_pv(rb, vrows, j0, bc, scores, w);
  }
}

// Decode: rows first .. first + kDecodeKeys - 1 (those before `end`) of `cols` elements
// into L2.
template <DType T, DType TK>
void AttentionTask<T, TK>::prefetch_rows(const KvRows<EK>& rows, int64_t first, int64_t end, int64_t cols) {
  const int64_t n = end - first < kDecodeKeys ? end - first : kDecodeKeys;
  rows.for_each_run(first, n < 0 ? 0 : n, [&](const EK* src, int64_t, int64_t count) {
    for (int64_t j = 0; j < count; ++j) {
      prefetch_bytes(src, j * rows.stride * int64_t{sizeof(EK)}, cols * int64_t{sizeof(EK)}, Cache::l2);
    }
  });
}

// Decode: s[r * lds + j] = K[j0 + j] · Q[r] for n <= kLanes keys (lanes past n are left
// for the caller to mask): in place (when the keys lie at one stride) or packed, fp32 or
// bf16 pairs.
template <DType T, DType TK>
void AttentionTask<T, TK>::qk_key_block(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t n,
                                        float* s, int64_t lds, const Workspace& w) const {
  const bool in_place = rb.mode->k_in_place && n == kLanes && krows.run_end(j0, j0 + n) == j0 + n;
  if (rb.mode->qk_pairs) {
    qk_rows_bf16(rb, krows, j0, n, in_place, s, lds, w);
  } else if (in_place) {
    dot_key_block(rb.mode->rows_per_vec, rb.rows, rb.mode->chunks,
                  reinterpret_cast<const float*>(krows.row(j0)), krows.stride, w.qt, s, lds);
  } else {  // whole chunks of kLanes zero-padded rows
    const int64_t ld = rb.mode->chunked_row;
    pack_rows(krows, j0, n, p_.k_stride[3], p_.D, ld, w.k);
    std::memset(w.k + n * ld, 0, sizeof(float) * (kLanes - n) * ld);
    dot_key_block(rb.mode->rows_per_vec, rb.rows, rb.mode->chunks, w.k, ld, w.qt, s, lds);
  }
}

// Decode: Q rows pre-multiplied by the softmax scale, grouped for dot_key_block into w.qt (via w.k).
template <DType T, DType TK>
void AttentionTask<T, TK>::pack_q_rows(const RowBlock& rb, const Workspace& w) const {
  for (int64_t r = 0; r < rb.rows; ++r)
    load_row<T>(q_row(rb, r), p_.q_stride[3], p_.D, rb.scale, w.k + r * p_.D);
  group_rows(rb.mode->rows_per_vec, rb.rows, p_.D, w.k, p_.D, rb.mode->chunks, w.qt);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA::fwd
