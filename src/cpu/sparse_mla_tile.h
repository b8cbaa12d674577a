// The sparse MLA tile loop, shared by the prefill (flat kv rows, sparse_mla_fwd.cpp) and the
// decode (paged caches, dsa_decode_fwd.cpp) drivers. A task is one query row and a block of
// its heads: a row source lists the row's valid KV rows once, then they are gathered
// kSlotTile rows at a time, dequantised to fp32 once per (query, tile) and shared by every
// head of the block as both K (all d_qk columns) and V (the first d_v). Per tile:
// Sᵀ = KV · Qᵀ, the online softmax, O += P · V, with the same micro-kernels as dense
// attention. Included by per-ISA sources only.
//
// A row source Rows provides: Slot (how a listed row is named), capacity (the most rows
// list() writes), list(s, slots) -> the valid rows of query row s in order, q_row(s) -> the
// base of q row s (heads by q_stride[1], columns by q_stride[2]), and load(slot, dst, bf16):
// the row's d_qk values dequantised, into dst (fp32) where dst is not null and as bf16 where
// bf16 is not null (they must be exact in bf16 there), touch(slot): one byte of every cache
// line of the row (see load_ahead), and prefetch(slot, level): every line of the row into L2
// (a tile ahead, see scores_reading_ahead) or L1 (a few rows ahead of the gather).
//
// On avx512bf16 both products run on vdpbf16ps from the bf16 rows alone (dst is null), with
// FlashMLA's numerics: P rounded to bf16 and the tile's V rows paired along keys; l stays the
// sum of the unrounded P. On avx512amx the same two products on the same bf16 pairs run on AMX
// tiles (tdpbf16ps; vdpbf16ps is half the fp32 FMA rate on those Xeons), over whole tiles:
// gathered rows, heads and pairs padded to multiples of 16 with zeros.
//
// Split-KV: a single query row (decode at batch 1) has its listed rows cut into fixed
// ranges of Plan::split_slots, run as separate tasks into partial (O, m, l), then merged
// exactly through their maxima (the lse merge). The cut depends on the shape only (s_q and
// the row capacity), never on the thread count, so results are bit-identical for any count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attnkit/dtype.h"
#include "core/thread_pool.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_amx.h"
#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/softmax.h"
#include "cpu/kernels/workspace.h"
#include "ops/sparse_mla_params.h"

namespace attnkit::cpu::ATTNKIT_ISA::sparse_tile {

#if defined(ATTNKIT_ISA_avx512amx)
constexpr bool kAmx = true;
constexpr int64_t kWholeTile = kAmxTile;  // AMX products take whole tiles: 16 rows, 16 pairs
static_assert(kAmxTile == kLanes);
#else
constexpr bool kAmx = false;
constexpr int64_t kWholeTile = 1;
#endif
// Gathered kv rows per tile: the more, the fewer loads and stores of P·V's accumulators (O,
// 128 heads × 512 floats, from L2) per product. Off AMX, 128 against 64 on Zen 4 (sparse
// decode, in one process): 0.91-0.99 of the time at batches 1, 8, 64 and 1 or 2 threads; 192
// the same as 128 (and 512-slot splits are no longer whole tiles).
constexpr int64_t kSlotTile = kAmx ? 256 : 128;
constexpr int64_t kHeadBlock = 128; // heads per task (all of DeepSeek-V3.2's per rank)
// Smaller head blocks where the (query, split, head block) tasks are fewer than the threads,
// or fewer than this many per thread and not a whole number per thread (so that no thread
// idles while another runs a last task).
constexpr int64_t kTasksPerThread = 2;
// Split-KV aims at this many (query row, split) pairs, each split at least kMinSplitSlots long
// (each split re-packs Qᵀ, stalls on its first tile's rows and writes a partial O of h_q · d_v
// floats to merge), so only a single query row splits (in 2 where its rows allow). Sparse
// decode, topk 2048, Zen 4, in one process, 1 / 2 threads: 4 against 16 (batch 2 in 2 splits,
// not 4: 0.94 / 0.97 of the time; batch 4 none, not 4: 0.91 / 0.91; batch 8 none, not 2:
// 0.97 / 0.94), then 2 against 4 (batch 1 in 2 splits of 128 heads, not 4: 0.98 / 0.98;
// batch 2 none: 0.98 / 0.95; batch 3 none, in 64-head blocks at 2 threads: 0.99).
constexpr int64_t kSplitTarget = 2;
constexpr int64_t kMinSplitSlots = 512;
constexpr int64_t kMergeHeads = 16;  // heads per split-KV merge task
// The gather prefetches the row this many rows ahead into L1: its first loads (a V3.2
// token's scale line, its rope lines) otherwise waited on L2 or beyond (sparse decode, Zen 4,
// in one process: 0.985-0.996 of the time at batches 1, 8, 64 and 1 or 2 threads; 8 the
// same; the bf16 prefill 1.006, fastest call 0.992).
constexpr int64_t kGatherAhead = 4;
// On avx512bf16, Sᵀ = KV · Qᵀ runs on bf16 pairs with vdpbf16ps: bf16 and fp8 values are
// exact in bf16, so the products are exact and only the fp32 summation order changes.
#if defined(ATTNKIT_ISA_avx512bf16)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

struct Plan {
  int64_t splits, split_slots, head_block, head_blocks, tasks, rows_pad, d_pad, dv_pad, d_pairs, kv_ld;
  int64_t workspace_floats;

  // capacity: the most rows one query row lists.
  Plan(const SparseMlaParams& p, int threads, int64_t capacity) {
    // Split-KV (see the header): from the shape only, ranges of whole tiles.
    const int64_t by_rows = (kSplitTarget + p.s_q - 1) / p.s_q;
    const int64_t by_slots = capacity / kMinSplitSlots;
    splits = std::max<int64_t>(1, std::min(by_rows, by_slots));
    split_slots = round_up((std::max<int64_t>(capacity, 1) + splits - 1) / splits, kSlotTile);
    splits = (std::max<int64_t>(capacity, 1) + split_slots - 1) / split_slots;
    head_block = p.h_q < kHeadBlock ? p.h_q : kHeadBlock;
    // Too few tasks, or few and uneven over the threads: smaller head blocks keep the threads
    // busy, but no smaller than needed (each block regathers the row's kv tiles, and narrow
    // Qᵀ tiles run slower); each head's numbers do not depend on the blocking, so results
    // stay bit-identical.
    auto too_few = [&](int64_t block) {
      const int64_t n = p.s_q * splits * ((p.h_q + block - 1) / block);
      return n < threads || (n < kTasksPerThread * threads && n % threads != 0);
    };
    while (head_block > 16 && too_few(head_block)) head_block /= 2;
    head_blocks = (p.h_q + head_block - 1) / head_block;
    tasks = p.s_q * splits * head_blocks;
    rows_pad = round_up(head_block, kLanes);
    d_pad = round_up(p.d_qk, kLanes);
    dv_pad = round_up(p.d_v, kLanes);  // <= d_pad: V columns are read from the kv tile
    d_pairs = (p.d_qk + 1) / 2;
    kv_ld = kBf16Dot ? round_up(d_pairs, kLanes) : d_pairs;  // whole 16 × 16 blocks (pack_qt, AMX tiles)
    workspace_floats = qt_floats(p) + rows_pad * dv_pad + kSlotTile * rows_pad + scratch_floats()
                       + (kBf16Dot ? kSlotTile * kv_ld + kSlotTile / 2 * dv_pad : 0) + 3 * rows_pad;
  }

  // The workspace of a task, in order: Qᵀ (scaled fp32, or bf16 pairs [kv_ld][rows_pad] on
  // kBf16Dot), O's accumulators [rows_pad][dv_pad], Sᵀ then Pᵀ [kSlotTile][rows_pad], scratch,
  // on kBf16Dot the gathered rows as bf16 pairs [kSlotTile][kv_ld] and V paired along keys
  // [kSlotTile / 2][dv_pad], then the running max, sum and rescale factors [rows_pad] each.
  int64_t qt_floats(const SparseMlaParams& p) const { return (kBf16Dot ? kv_ld : p.d_qk) * rows_pad; }
  // The gathered rows dequantised to fp32 [kSlotTile][d_pad]; on kBf16Dot only pack_qt's rows
  // [rows_pad][kv_ld] and, on AMX, P's rows for P·V [rows_pad][kSlotTile / 2].
  int64_t scratch_floats() const {
    if (!kBf16Dot) return kSlotTile * d_pad;
    return rows_pad * std::max(kv_ld, kAmx ? kSlotTile / 2 : 0);
  }
  // Merge tasks per (query row, head block): kMergeHeads heads each, so that a batch of one
  // query row merges on every thread (at batch 1 its one merge took ~3% of the call at 2 threads).
  int64_t merge_chunks() const { return (head_block + kMergeHeads - 1) / kMergeHeads; }
  // Split-KV partials are kept per task, rows_pad rows each (AMX writes whole tiles of O).
  int64_t partial_rows(const SparseMlaParams& p) const { return splits > 1 ? p.s_q * splits * head_blocks * rows_pad : 0; }
};

// dst[d] = src[d * stride] for d < n: a row source's bf16 row (stride 1: one copy).
inline void copy_bf16_row(const uint16_t* src, int64_t stride, int64_t n, uint16_t* dst) {
  if (stride == 1) {
    std::memcpy(dst, src, sizeof(uint16_t) * n);
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = src[d * stride];
  }
}

// The split-KV partials of every task (query row, split, head block): O [rows_pad][dv_pad]
// unnormalised, m and l [rows_pad], and each query row's count of listed rows.
struct Partials {
  float *o = nullptr, *m = nullptr, *l = nullptr;
  int64_t* n_valid = nullptr;
};

// TQ: q's dtype.
template <DType TQ, class Rows>
class SparseMlaTask {
  using E = typename Elem<TQ>::type;
  using Slot = typename Rows::Slot;

 public:
  SparseMlaTask(const SparseMlaParams& p, const Plan& plan, const Rows& rows, const Partials& parts)
      : p_(p), plan_(plan), rows_(rows), parts_(parts) {}

  // Task (query row s, split, head block): without splits it writes the outputs, else its partial.
  void run(int64_t task, float* workspace, Slot* slots) const {
    const int64_t s = task / plan_.head_blocks / plan_.splits;
    const int64_t split = task / plan_.head_blocks % plan_.splits;
    const int64_t h0 = task % plan_.head_blocks * plan_.head_block;
    const int64_t nh = p_.h_q - h0 < plan_.head_block ? p_.h_q - h0 : plan_.head_block;
    const int64_t ld = plan_.rows_pad;
    float* qt = workspace;
    float* o = qt + plan_.qt_floats(p_);
    float* st = o + ld * plan_.dv_pad;
    float* scratch = st + kSlotTile * ld;
    uint32_t* kv_pairs = reinterpret_cast<uint32_t*>(scratch + plan_.scratch_floats());
    uint32_t* v_pairs = kv_pairs + (kBf16Dot ? kSlotTile * plan_.kv_ld : 0);
    float* m = reinterpret_cast<float*>(v_pairs + (kBf16Dot ? kSlotTile / 2 * plan_.dv_pad : 0));
    float* l = m + ld;
    float* alpha = l + ld;
    if (plan_.splits > 1) o = parts_.o + task * ld * plan_.dv_pad;  // tasks are numbered as partials

    const int64_t n_valid = rows_.list(s, slots);
    const int64_t begin = std::min(split * plan_.split_slots, n_valid);
    const int64_t end = std::min(begin + plan_.split_slots, n_valid);
    load_ahead(slots + begin, std::min(kSlotTile, end - begin));
    pack_qt(s, h0, nh, qt, scratch);
#if defined(ATTNKIT_ISA_avx512amx)
    amx_configure();
#endif
    // The tile's softmax in dense attention's fused bf16-pairs pass (softmax.h) where the scale
    // is positive; its lazy max where max_logits is not asked for (it lags the true max).
    const bool fused_pairs = kBf16Dot && p_.logit_scale > 0.0f && p_.logit_scale < INFINITY;
    std::memset(o, 0, sizeof(float) * ld * plan_.dv_pad);
    for (int64_t r = 0; r < ld; ++r) m[r] = -INFINITY, l[r] = 0.0f;
    for (int64_t t0 = begin; t0 < end; t0 += kSlotTile) {
      const int64_t bc = end - t0 < kSlotTile ? end - t0 : kSlotTile;
      gather_rows(slots + t0, bc, scratch, kv_pairs, v_pairs);
      const Slot* next = slots + t0 + bc;
      const int64_t n_next = std::min(kSlotTile, end - t0 - bc);
#if defined(ATTNKIT_ISA_avx512amx)  // Sᵀ = KV · Qᵀ on exact bf16 pairs
      // whole tiles of rows: those past bc are zero (gather_rows), their scores never read
      load_ahead(next, n_next);
      gemm_amx_bf16(round_up(bc, kAmxTile), ld, plan_.kv_ld, kv_pairs, plan_.kv_ld,
                    reinterpret_cast<const uint32_t*>(qt), ld, st, ld, false);
#else
      scores_reading_ahead(bc, qt, scratch, kv_pairs, st, next, n_next);
#endif
#if defined(ATTNKIT_ISA_avx512bf16)  // then the logit scale
      if (fused_pairs) {  // the scale, the softmax and P's bf16 pairs in one pass
        online_softmax_tile_bf16_pairs(st, bc, ld, ld, p_.logit_scale, m, l, alpha, p_.max_logits != nullptr);
      } else {
        const vfloat scale = vbroadcast(p_.logit_scale);
        for (int64_t i = 0; i < bc * ld; i += kLanes) vstore(st + i, vload(st + i) * scale);
      }
#endif
      if (!fused_pairs) online_softmax_tile(st, bc, ld, ld, m, l, alpha, p_.max_logits != nullptr);
      for (int64_t r = 0; r < nh; ++r) {
        if (alpha[r] != 1.0f) scale_row(o + r * plan_.dv_pad, plan_.dv_pad, alpha[r]);
      }
#if defined(ATTNKIT_ISA_avx512bf16)  // O += P · V on bf16 pairs of keys
      uint32_t* p_pairs = reinterpret_cast<uint32_t*>(st);
      if (!fused_pairs) pair_rows_bf16(st, bc, ld, p_pairs);
      const int64_t pairs = (bc + 1) / 2;
#if defined(ATTNKIT_ISA_avx512amx)  // P's rows [ld][kp] from its pairs, both padded with zero pairs
      const int64_t kp = round_up(pairs, kAmxTile);
      std::memset(p_pairs + pairs * ld, 0, sizeof(uint32_t) * (kp - pairs) * ld);
      std::memset(v_pairs + pairs * plan_.dv_pad, 0, sizeof(uint32_t) * (kp - pairs) * plan_.dv_pad);
      uint32_t* p_rows = reinterpret_cast<uint32_t*>(scratch);
      transpose_matrix(st, ld, kp, ld, scratch, kp);
      gemm_amx_bf16(ld, plan_.dv_pad, kp, p_rows, kp, v_pairs, plan_.dv_pad, o, plan_.dv_pad, true);
#else
      gemm_bf16<kTallRows, kTallVecs>(nh, plan_.dv_pad, pairs, p_pairs, 1, ld, v_pairs, plan_.dv_pad, o,
                                      plan_.dv_pad, true);
#endif
#else  // O += P · V
      gemm<kTallRows, kTallVecs>(nh, plan_.dv_pad, bc, st, 1, ld, scratch, plan_.d_pad, o, plan_.dv_pad, true);
#endif
    }
    if (plan_.splits == 1) return write_out(s, h0, nh, n_valid, o, m, l);
    std::memcpy(parts_.m + task * ld, m, sizeof(float) * nh);
    std::memcpy(parts_.l + task * ld, l, sizeof(float) * nh);
    if (split == 0 && h0 == 0) parts_.n_valid[s] = n_valid;
  }

  // Merge task (query row s, head block, kMergeHeads of its heads) after the splits: O = Σ_i
  // O_i·e^(m_i - M), l = Σ_i l_i·e^(m_i - M), M = max_i m_i, in split order; then the outputs
  // as without splits.
  void merge(int64_t task, float* workspace) const {
    const int64_t chunks = plan_.merge_chunks();
    const int64_t s = task / chunks / plan_.head_blocks, hb = task / chunks % plan_.head_blocks;
    const int64_t r0 = task % chunks * kMergeHeads, h0 = hb * plan_.head_block + r0;  // r0: row in the block
    const int64_t nh = std::min({kMergeHeads, (hb + 1) * plan_.head_block - h0, p_.h_q - h0});
    if (nh <= 0) return;
    const int64_t split_rows = plan_.head_blocks * plan_.rows_pad;  // from one split's partial to the next
    float* o = workspace;
    float* m = o + nh * plan_.dv_pad;
    float* l = m + nh;
    for (int64_t r = 0; r < nh; ++r) {
      const int64_t first = (s * plan_.splits * plan_.head_blocks + hb) * plan_.rows_pad + r0 + r;  // split 0's row
      float mx = -INFINITY;
      for (int64_t i = 0; i < plan_.splits; ++i) mx = std::max(mx, parts_.m[first + i * split_rows]);
      const float m_ref = mx == -INFINITY ? 0.0f : mx;  // as online_softmax_tile: e^-inf = 0
      float* acc = o + r * plan_.dv_pad;
      std::memset(acc, 0, sizeof(float) * plan_.dv_pad);
      float sum = 0.0f;
      for (int64_t i = 0; i < plan_.splits; ++i) {
        const int64_t at = first + i * split_rows;
        const float f = std::exp(parts_.m[at] - m_ref);  // NaN in a split's m reaches l and O
        sum += parts_.l[at] * f;
        const vfloat vf = vbroadcast(f);
        const float* part = parts_.o + at * plan_.dv_pad;
        for (int64_t d = 0; d < plan_.dv_pad; d += kLanes) vstore(acc + d, vload(acc + d) + vload(part + d) * vf);
      }
      m[r] = mx;
      l[r] = sum;
    }
    write_out(s, h0, nh, parts_.n_valid[s], o, m, l);
  }

 private:
  // Qᵀ of heads h0 .. h0+nh-1 (padding heads zero): on the bf16-dot path unscaled bf16 pairs
  // [kv_ld][rows_pad] (exact: bf16 and fp8 values are bf16 values), written as Q's rows of pairs
  // [rows_pad][kv_ld] into `scratch` and transposed in 16 × 16 blocks (element by element, an
  // fp8 q took 15% of the prefill's tile loop on the Xeon); else fp32 [d_qk][rows_pad] scaled by
  // sm_scale · q_scale · kv_scale so that Sᵀ holds the logits, through one row of `scratch`.
  void pack_qt(int64_t s, int64_t h0, int64_t nh, float* qt, float* scratch) const {
    const int64_t ld = plan_.rows_pad;
    const E* base = static_cast<const E*>(rows_.q_row(s)) + h0 * p_.q_stride[1];
    if constexpr (kBf16Dot) {
      const int64_t width = 2 * plan_.kv_ld;  // bf16 values per row
      auto rows = [&](auto load) {  // load(q, dst): q's row as d_qk bf16 values
        for (int64_t r = 0; r < ld; ++r) {
          uint16_t* dst = reinterpret_cast<uint16_t*>(scratch) + r * width;
          const int64_t n = r < nh ? p_.d_qk : 0;
          if (n) load(base + r * p_.q_stride[1], dst);
          std::fill(dst + n, dst + width, uint16_t{0});
        }
      };
      if constexpr (TQ == DType::bfloat16) {
        rows([&](const E* q, uint16_t* dst) { copy_bf16_row(q, p_.q_stride[2], p_.d_qk, dst); });
      } else {
        const Fp8ToBf16<TQ> to_bf16;
        rows([&](const E* q, uint16_t* dst) { to_bf16.row(q, p_.q_stride[2], p_.d_qk, dst); });
      }
      transpose_matrix(scratch, plan_.kv_ld, ld, plan_.kv_ld, qt, ld);
      return;
    }
    std::memset(qt, 0, sizeof(float) * plan_.qt_floats(p_));
    for (int64_t r = 0; r < nh; ++r) {
      load_row<TQ>(base + r * p_.q_stride[1], p_.q_stride[2], p_.d_qk, p_.logit_scale, scratch);
      for (int64_t d = 0; d < p_.d_qk; ++d) qt[d * ld + r] = scratch[d];
    }
  }

  // Loads a tile's rows (one byte per line) before it is gathered, so that they come from
  // memory all at once: a task's first tile, and on AMX every next one. Gathered rows are
  // random, mostly in memory; the dequantising loop alone keeps only a few lines in flight,
  // and software prefetches of a whole tile at once measured no faster than none on the Zen 5
  // VM (the sparse decode spent 25% of its time in the gather with or without them, 15% with
  // these loads). The loads stall the core until the last line arrives, though (see
  // scores_reading_ahead).
  void load_ahead(const Slot* slots, int64_t n) const {
    uint32_t sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += rows_.touch(slots[j]);
    asm volatile("" : : "r"(sum));  // keeps the loads
  }

  // Sᵀ = KV · Qᵀ (on exact bf16 pairs on kBf16Dot) for the tile's bc gathered rows, one
  // register tile of rows at a time, with the next tile's n_next rows prefetched into L2 a
  // share at a time between them. Spread over the product, the prefetches overlap it where
  // load_ahead's demand loads (which this replaces off AMX) stalled the core for them: Zen 4,
  // in one process, sparse prefill (random rows, 256 query rows) 0.95 of the time, sparse
  // decode batch 8 0.98 (1 thread), batch 1 1.00 (2 threads, its split tasks' first tiles are
  // still loaded ahead).
  void scores_reading_ahead(int64_t bc, const float* qt, const float* kv, const uint32_t* kv_pairs, float* st,
                            const Slot* next, int64_t n_next) const {
    const int64_t ld = plan_.rows_pad, chunks = (bc + kTallRows - 1) / kTallRows;
    const int64_t per_chunk = (n_next + chunks - 1) / chunks;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = c * kTallRows, rows = std::min<int64_t>(kTallRows, bc - r0);
#if defined(ATTNKIT_ISA_avx512bf16)  // (6 × 4 tiles, 24 accumulators: 4 × 4 measured 2-7% slower on Zen 5)
      gemm_bf16<kTallRows, kTallVecs>(rows, ld, plan_.d_pairs, kv_pairs + r0 * plan_.kv_ld, plan_.kv_ld, 1,
                                      reinterpret_cast<const uint32_t*>(qt), ld, st + r0 * ld, ld, false);
      (void)kv;
#else
      gemm<kTallRows, kTallVecs>(rows, ld, p_.d_qk, kv + r0 * plan_.d_pad, plan_.d_pad, 1, qt, ld, st + r0 * ld, ld,
                                 false);
      (void)kv_pairs;
#endif
      for (int64_t j = c * per_chunk; j < std::min(n_next, (c + 1) * per_chunk); ++j) {
        rows_.prefetch(next[j], Cache::l2);
      }
    }
  }

  // The listed rows, dequantised (without kv_scale, applied to logits and output instead):
  // on the bf16-dot path as bf16 pairs only (kv_pairs [n][kv_ld], zero past d_qk; on AMX zero
  // rows up to a whole tile), and their first d_v columns as V paired along keys (v_pairs
  // [(n + 1) / 2][dv_pad]) from each two rows just written (in L1: X7, sparse decode 0.98 of
  // the time of a pass over the tile's rows after the Sᵀ product); else as fp32 rows
  // zero-padded to d_pad columns.
  void gather_rows(const Slot* slots, int64_t n, float* kv, uint32_t* kv_pairs, uint32_t* v_pairs) const {
    for (int64_t j = 0; j < n; ++j) {
      if (j + kGatherAhead < n) rows_.prefetch(slots[j + kGatherAhead], Cache::l1);
      if constexpr (kBf16Dot) {
        uint16_t* row = reinterpret_cast<uint16_t*>(kv_pairs + j * plan_.kv_ld);
        rows_.load(slots[j], nullptr, row);
        std::fill(row + p_.d_qk, row + 2 * plan_.kv_ld, uint16_t{0});
        if (j % 2 == 1 || j == n - 1) {  // V paired along keys while the two rows are in L1
          const uint16_t* first = reinterpret_cast<const uint16_t*>(kv_pairs + (j & ~int64_t{1}) * plan_.kv_ld);
          interleave_bf16_rows(first, j % 2 == 1 ? row : nullptr, 1, p_.d_v, plan_.dv_pad, v_pairs + j / 2 * plan_.dv_pad);
        }
      } else {
        float* dst = kv + j * plan_.d_pad;
        rows_.load(slots[j], dst, nullptr);
        for (int64_t d = p_.d_qk; d < plan_.d_pad; ++d) dst[d] = 0.0f;
      }
    }
    if constexpr (kAmx) {
      std::memset(kv_pairs + n * plan_.kv_ld, 0, sizeof(uint32_t) * (round_up(n, kWholeTile) - n) * plan_.kv_ld);
    }
  }

  // out = O · kv_scale / (l + e^(sink - m)); max_logits = m; lse = m + log(l). A row with
  // no valid slot: out 0, max_logits -inf, lse +inf. NaN anywhere in a row reaches all three.
  // max_logits may be null (the decode op does not return it).
  void write_out(int64_t s, int64_t h0, int64_t nh, int64_t n_valid, const float* o, const float* m,
                 const float* l) const {
    for (int64_t r = 0; r < nh; ++r) {
      const int64_t h = h0 + r;
      uint16_t* dst = p_.out + (s * p_.h_q + h) * p_.d_v;
      float* max_logit = p_.max_logits ? p_.max_logits + s * p_.h_q + h : nullptr;
      float* lse = p_.lse + s * p_.h_q + h;
      if (n_valid == 0) {
        std::memset(dst, 0, sizeof(uint16_t) * p_.d_v);  // bf16 +0
        if (max_logit) *max_logit = -INFINITY;
        *lse = INFINITY;
        continue;
      }
      float denom = l[r];
      if (p_.attn_sink) denom += std::exp(p_.attn_sink[h * p_.attn_sink_stride] - m[r]);
      const float factor = p_.kv_scale / denom;
      const float* acc = o + r * plan_.dv_pad;
      store_row<DType::bfloat16>(acc, factor, p_.d_v, dst, 1);
      const bool nan = std::isnan(l[r]);
      if (max_logit) *max_logit = nan ? l[r] : m[r];
      *lse = m[r] + std::log(l[r]);
    }
  }

  const SparseMlaParams& p_;
  const Plan& plan_;
  const Rows& rows_;
  const Partials& parts_;
};

// Runs every (query row, split, head block) task of p over the rows of `rows`, then the merges.
template <DType TQ, class Rows>
void run(const SparseMlaParams& p, const Rows& rows) {
  const int threads = detail::num_threads();
  const Plan plan(p, threads, rows.capacity);
  AlignedBuffer<float> workspace(plan.workspace_floats * threads);
  AlignedBuffer<typename Rows::Slot> slots(rows.capacity * threads);
  const int64_t part_rows = plan.partial_rows(p);
  AlignedBuffer<float> part_o(part_rows * plan.dv_pad), part_ml(2 * part_rows);
  AlignedBuffer<int64_t> n_valid(plan.splits > 1 ? p.s_q : 0);
  const Partials parts{part_o.data, part_ml.data, part_ml.data + part_rows, n_valid.data};
  const SparseMlaTask<TQ, Rows> task(p, plan, rows, parts);
  auto body = [&](int64_t t, int thread) {
    task.run(t, workspace.data + plan.workspace_floats * thread, slots.data + rows.capacity * thread);
  };
  detail::parallel_for(plan.tasks, threads, body);
  if (plan.splits == 1) return;
  auto merge = [&](int64_t t, int thread) { task.merge(t, workspace.data + plan.workspace_floats * thread); };
  detail::parallel_for(p.s_q * plan.head_blocks * plan.merge_chunks(), threads, merge);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA::sparse_tile
