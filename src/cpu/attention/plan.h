// The attention forward's plan: how a call's rows split into row blocks and tasks (per
// sequence, heavy first, keys split where a row block alone holds much of the work), how
// each row block runs (Mode: the tile loop or decode's key blocks, operands in place or
// packed), the per-thread workspace, and where K/V rows lie (KvRows: strided or paged).
// Shared by the tile loop (tile_loop.h) and decode (decode.h); see task.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/kernels/dot.h"
#include "cpu/kernels/simd.h"
#include "cpu/kernels/workspace.h"
#include "ops/attention_params.h"

namespace attnkit::cpu::ATTNKIT_ISA::fwd {

constexpr int64_t kKvTile = 128;           // keys per tile (a multiple of 4: one dropout draw per 4 keys)
constexpr int64_t kMinSplitTiles = 4;      // a kv split covers at least this many tiles
constexpr int64_t kMinParallelTasks = 16;  // fewer row blocks than this: split the keys
constexpr int64_t kPrefetchRows = 32;      // packing asks for the row this far ahead (flat 16..64)
constexpr int64_t kQueryRowsAhead = 8;     // Q's packers ask for the row this far ahead
// Keys per decode block (scores, softmax, P·V); 2 and 4 vectors measured slower out of cache.
constexpr int64_t kDecodeKeys = kLanes;
// Query rows per task (heads of a group × positions): a multiple of 16 (the Kᵀ·Q tile's
// columns) and of 6 (the P·V tile's rows on AVX-512), measured best of 48, 64 and 96.
constexpr int64_t kRowTarget = 48;
// On AMX tiles: 64 rows (4 tiles), so both products run in 2 × 2 blocks of tiles; 48 left a
// lone row or column of tiles whose 2 accumulator chains ran at about half the rate (the
// products of a 64-row tile measured 0.23 ns per score, of a 48-row one 0.33).
constexpr int64_t kAmxRowTarget = 64;
// Decode over kv heads that lie side by side in memory (paged caches, packed varlen K/V): one
// task runs up to this many kv heads' row blocks through the same key blocks, so each block
// of the cache is read once, in address order, instead of once per kv head with a stride.
constexpr int64_t kDecodeKvHeads = 16;
static_assert(kRowTarget <= kKvTile && kAmxRowTarget <= kKvTile,
              "the Q packers stage a task's rows in the K tile's space");
// Whether this variant has the bf16 and int8 dot-product instructions (vdpbf16ps, vpdpbusd).
#if defined(ATTNKIT_ISA_avx512bf16)
constexpr bool kDotProducts = true;
#else
constexpr bool kDotProducts = false;
#endif
// Whether this variant has AMX tiles for the tile loop's products on bf16 pairs (gemm_amx.h).
#if defined(ATTNKIT_ISA_avx512amx)
constexpr bool kAmxTiles = true;
#else
constexpr bool kAmxTiles = false;
#endif
// Keys per tile of the bf16 tile loop on AMX tiles: P·V's accumulators are loaded and stored
// per tile, and 256 keys halved that traffic (the product measured 5.7 against 6.6 ns per
// tile instruction at 128); 512 took bf16 prefill another 3-5% (machine X7, shapes V, A).
constexpr int64_t kAmxKvTile = 512;
static_assert(kAmxKvTile % kKvTile == 0, "sage's kKvTile-key tiles tile the AMX tiles");
// Rows of Sᵀ: AMX writes whole tiles of 16 keys, so a tile's last keys may fill one past it.
constexpr int64_t kScoreRows = kAmxTiles ? kAmxKvTile + 16 : kKvTile;
// Keys of one slab of V's prepared pairs on AMX tiles (Plan::v_slabs): one tile's depth, 16
// pairs. Row blocks of such calls start their keys on a slab border.
constexpr int64_t kVSlabKeys = 32;
// V's prepared pairs of one kv head of skv keys: whole slabs, or ceil(skv / 2) pair rows.
inline int64_t prepared_v_pairs(int64_t skv, bool slabs) {
  return slabs ? (skv + kVSlabKeys - 1) / kVSlabKeys * kVSlabKeys / 2 : (skv + 1) / 2;
}

// K and V prepared once per call for sage int8 mode (prepare_sage): K smoothed by its
// per-head mean over tokens (softmax is invariant to it; lse is corrected), then int8 with
// one scale per key, stored + 128 as the unsigned operand of vpdpbusd; on
// avx512bf16 also V as bf16 pairs of consecutive keys for vdpbf16ps (on AMX tiles as Vᵀ's
// slabs, Plan::v_slabs, as dense calls prepare them). Key rows holding a
// NaN or inf are left out of the mean and get zero codes; their logits
// are computed exactly instead (fix_nonfinite_logits), so NaN and inf propagate as in
// exact attention.
struct QuantizedKeys {
  const uint8_t* codes;           // [B][Hkv][Skv][4 * quads]
  const float* scale;             // [B][Hkv][Skv]: per key
  const float* mean;              // [B][Hkv][D]
  const uint32_t* v_pairs;        // [B][Hkv][prepared_v_pairs(Skv, v_slabs)][dv_pad], or null
  const uint8_t* nonfinite;       // [B][Hkv][Skv]: 1 where the key row holds a NaN or inf
  const uint8_t* tile_nonfinite;  // [B][Hkv][tiles]: 1 where any key of the tile does
  int64_t quads, tiles;
  // Sage int8_pv_int8 only (else null): V smoothed by its per-channel mean over tokens and
  // quantised to s8 per tile and channel, as quads of 4 consecutive keys (the s8 operand of
  // vpdpbusd), with the rows holding a NaN or inf, and each tile's outlier row, flagged and
  // left at zero codes (their products are added exactly instead, add_exact_values).
  const uint32_t* v_codes;      // [B][Hkv][ceil(Skv / 4)][dv_pad]
  const float* v_scale;         // [B][Hkv][tiles][dv_pad]: per kKvTile keys and channel
  const float* v_mean;          // [B][Hkv][dv_pad]
  const uint8_t* v_exact;       // [B][Hkv][Skv]: 1 where the row's products are exact
  const uint8_t* v_tile_exact;  // [B][Hkv][tiles]: 1 where any row of the tile's are
};

// One sequence's share of the work: its row blocks (kv heads × head chunks × query blocks,
// in that order) and the key ranges each splits into. Dense attention has B equal ones.
struct Sequence {
  int64_t b, sq, skv;  // queries and keys
  int64_t row0;        // packed row of query 0 (ragged batches; 0 for dense)
  int64_t offset;      // query i aligns to key i + offset (causal: sees keys j <= i + offset)
  int64_t span;        // keys a row block sees from its first visible one (Plan::key_span)
  int64_t q_blocks, kv_splits, kv_split_len;
  int64_t kv_heads_per_task;  // row blocks of this many kv heads share a task (decode, Plan::group_kv_heads)
  int64_t first_row_block, first_task, first_slot;  // slots: partial states (kv_splits > 1)
};

// How one row block runs: the tile loop, or for few rows (decode) key blocks with row-major
// scores (attend_rows); and which operands it reads in place.
struct Mode {
  bool key_blocks;
  bool qk_pairs;        // key blocks: Q·Kᵀ on bf16 pairs (vdpbf16ps): bf16 K, or an fp8 cache converted
  int rows_per_vec;     // key blocks: query rows side by side in one vector (dot.h)
  int64_t chunks;       // key blocks: a Q/K row in chunks of kLanes / rows_per_vec elements (bf16: pairs)
  int64_t chunked_row;  // key blocks: chunks × that, the length of a packed K row
  bool pv_bf16;         // P·V on bf16 pairs: sage int8, and the bf16 tile loop, on avx512bf16
  bool k_in_place;      // K rows used where they are, without packing
  bool v_split_bf16;    // P·V on bf16 V rows (in place; an fp8 cache's converted per key block, in
                        // decode) by the split-bf16 tile; O in split order
  bool pv_row_pairs;    // key blocks: P·V on bf16 pairs, V's rows interleaved in registers
                        // (gemm_bf16_row_pairs; an fp8 cache's converted); O in pair order
  bool amx_tiles;       // key blocks: both products of qk_pairs's inputs on AMX tiles (avx512amx):
                        // Sᵀ of 16 keys from K's rows, P·V from V's rows (whole tiles of 32
                        // columns); O in split order
};

// How the work splits into tasks, and the per-thread workspace each task uses.
struct Plan {
  int64_t heads_per_task, positions_per_task, head_chunks, row_blocks;
  int64_t tasks, slots;        // tasks: row blocks × their kv splits; slots: tasks of split row blocks
  std::vector<Sequence> seqs;  // heavy first
  int64_t rows_pad, d_pad, dv_pad, workspace_floats, partial_floats;
  int64_t k_floats;          // the K tile's space (AMX also stages P's rows there)
  int64_t v_floats;          // the V tile's space: kKvTile rows, or key_tile / 2 pairs (AMX)
  int64_t key_tile;          // keys per tile of the tile loop: kKvTile, or kAmxKvTile (on AMX tiles)
  bool fp8_cache;            // K and V in a float8 cache (e4m3, e5m2)
  bool bf16_dot;             // bf16 inputs (or fp8_pairs) on avx512bf16: K·Qᵀ with vdpbf16ps
  bool fp8_pairs;            // bf16 queries over an fp8 cache on avx512bf16: its K and V rows
                             // converted exactly to bf16 pairs (vdpbf16ps, AMX tiles)
  bool int8;                 // sage int8 mode: K·Qᵀ on int8 codes
  bool pv_int8;              // sage int8_pv_int8 mode: P·V on u8 P and s8 V codes too
  bool v_in_place;           // fp32 V rows with unit stride need no packing
  bool v_pairs;              // bf16 V prepared as key pairs once per call (prepare_v_pairs)
  bool v_slabs;              // on AMX tiles those pairs as Vᵀ in slabs of kVSlabKeys keys, the tile
                             // loop accumulating Oᵀ += Vᵀ · Pᵀ (pv_amx_slabs)
  int64_t v_pairs_per_head;  // the prepared pairs of one kv head (whole slabs with v_slabs)
  bool amx;                  // the tile loop's products on AMX tiles (avx512amx): bf16 pairs' and
                             // sage's; kAmxKvTile keys per tile, kAmxRowTarget rows per block
  bool group_kv_heads;       // decode tasks run several kv heads (kDecodeKvHeads): they lie side by side
  int64_t head_state_floats;  // one kv head's decode state in such a task (Workspace::head)
  Mode tile;                 // row blocks of more rows
  Mode few[kLanes / 2 + 1];  // few[r]: row blocks of r rows, where key blocks pay

  Plan(const AttentionParams& p, bool int8_mode, bool pv_int8_mode = false) {
    int8 = int8_mode;
    pv_int8 = pv_int8_mode;
    // The tile loop on AMX tiles: bf16 inputs, bf16 queries over an fp8 cache (fp8_pairs), and
    // sage (int8 Q·Kᵀ; P·V on bf16 pairs, or u8 × s8 codes in int8_pv_int8).
    const bool bf16_inputs = p.dtype == DType::bfloat16 && p.kv_dtype == DType::bfloat16;
    // fp8 caches (paged) under bf16 queries convert exactly to bf16 pairs (fp8_pairs): the
    // tile loop's K and V tiles (bf16_dot, on AMX tiles too) and decode's K rows. Else they
    // are widened to fp32 as they are packed.
    fp8_cache = p.kv_dtype == DType::float8_e4m3fn || p.kv_dtype == DType::float8_e5m2;
    fp8_pairs = kDotProducts && !int8 && p.dtype == DType::bfloat16 && fp8_cache;
    amx = kAmxTiles && (int8 || bf16_inputs || fp8_pairs);
    const int64_t row_target = amx ? kAmxRowTarget : kRowTarget;
    heads_per_task = p.group < row_target ? p.group : row_target;
    positions_per_task = row_target / heads_per_task;
    if (positions_per_task > p.Sq) positions_per_task = p.Sq;
    if (positions_per_task < 1) positions_per_task = 1;
    head_chunks = (p.group + heads_per_task - 1) / heads_per_task;

    const int64_t rows = heads_per_task * positions_per_task;
    rows_pad = round_up(rows, kLanes);
    d_pad = round_up(p.D, kLanes);
    dv_pad = round_up(p.Dv, kLanes);
    bf16_dot = kDotProducts && !int8 && (bf16_inputs || fp8_pairs);
    v_in_place = p.kv_dtype == DType::float32 && p.v_stride[3] == 1 && p.Dv == dv_pad;
    // Where each key's rows of all kv heads lie within one key stride: paged caches in
    // FlashAttention's layout, packed (varlen) K/V, dense K/V in [B, S, H, D] order.
    auto heads_inside_key = [&](const int64_t* stride, int64_t cols) {
      return stride[1] > 0 && stride[3] == 1 && (p.Hkv - 1) * stride[1] + cols <= stride[2];
    };
    group_kv_heads = p.Hkv > 1 && heads_inside_key(p.k_stride, p.D) && heads_inside_key(p.v_stride, p.Dv);
    tile = make_mode(p, rows, false);
    // Dense calls whose kv heads serve more than one task's rows: else each V tile is
    // interleaved into pairs about once anyway.
    v_pairs = tile.pv_bf16 && !int8 && !p.block_table && !p.kv_begin && p.Sq * p.group > row_target;
    v_slabs = amx && (v_pairs || (int8 && !pv_int8));  // sage int8's V pairs too (prepare_sage)
    v_pairs_per_head = prepared_v_pairs(p.Skv, v_slabs);
    key_tile = amx ? kAmxKvTile : kKvTile;  // multiples of sage's kKvTile-key tiles
    k_floats = std::max(kKvTile * d_pad, amx ? rows_pad * key_tile / 2 : 0);
    v_floats = std::max(kKvTile, key_tile / 2) * dv_pad;
    for (int64_t r = 1; r <= kLanes / 2; ++r) few[r] = make_mode(p, r, !int8 && r <= kMaxDotRows);
    int64_t qt_floats = 0;  // Q grouped for dot_key_block (dot.h's group_rows)
    for (int64_t r = 1; r <= kLanes / 2; ++r) {
      if (few[r].amx_tiles) {  // Qᵀ as whole tiles of pairs
        qt_floats = std::max(qt_floats, round_up((p.D + 1) / 2, kLanes) * r);
      } else if (few[r].key_blocks) {
        qt_floats = std::max(qt_floats, (r + few[r].rows_per_vec - 1) / few[r].rows_per_vec * few[r].chunks * kLanes);
      }
    }
    head_state_floats = 3 * kLanes + kMaxDotRows * dv_pad + qt_floats;  // m, l, alpha, O, Q
    plan_sequences(p);
    workspace_floats = d_pad * rows_pad        // Qᵀ (or Q rows), scaled
                       + rows_pad * dv_pad     // output accumulators
                       + kScoreRows * rows_pad  // Sᵀ, then Pᵀ
                       + k_floats              // K tile (when packed)
                       + v_floats              // V tile (when packed, or as pairs)
                       + 8 * rows_pad          // running max, sum, rescale; int8 q scale, sum;
                                               // sage's row shift; ALiBi slope, distance
                       + dv_pad * rows_pad;    // output accumulators transposed (tile loop)
    if (pv_int8) workspace_floats += p_code_floats() + rows_pad * dv_pad + 3 * rows_pad;  // P codes, P·V, P scale, top P, its key
    if (group_kv_heads) workspace_floats += kDecodeKvHeads * head_state_floats;
    partial_floats = rows_pad * (dv_pad + 2);  // o, m, l of one split
  }

  // Sage int8_pv_int8's P codes of one tile: u8 quads [key_tile / 4][rows_pad], then on AMX
  // tiles those transposed (the A operand of tdpbusd), on ISAs without int8 products the codes
  // as floats [key_tile][rows_pad].
  int64_t p_code_floats() const { return (key_tile / 4 + (amx ? key_tile / 4 : key_tile)) * rows_pad; }

  // The mode of a row block of `rows` rows: key blocks where they pay (decode rows, and the
  // last positions of a sequence), else the tile loop.
  const Mode& mode(int64_t rows) const {
    return 2 * rows <= kLanes && few[rows].key_blocks ? few[rows] : tile;
  }

  // Whether every row block runs key blocks (a decode call); sequences without queries have none.
  bool decodes_only() const {
    return std::all_of(seqs.begin(), seqs.end(), [&](const Sequence& s) { return s.sq == 0 || decodes(s); });
  }

  // The sequence (and its row block) of a task or row block: the last one starting at or before it.
  const Sequence& sequence_of_task(int64_t task) const {
    return *(std::upper_bound(seqs.begin(), seqs.end(), task,
                              [](int64_t t, const Sequence& s) { return t < s.first_task; }) -
             1);
  }
  const Sequence& sequence_of_row_block(int64_t rb) const {
    return *(std::upper_bound(seqs.begin(), seqs.end(), rb,
                              [](int64_t r, const Sequence& s) { return r < s.first_row_block; }) -
             1);
  }

 private:
  // Sequences heavy first (a stable sort: dense keeps batch order), each row block's keys
  // split where it alone holds more than 1/kMinParallelTasks of the work (decode: too few
  // row blocks to keep the threads busy), at least kMinSplitTiles tiles per split; the
  // partial softmax states are merged exactly. The split depends on the shapes only, never
  // on the thread count, so results are bit-identical for any number of threads.
  void plan_sequences(const AttentionParams& p) {
    seqs.resize(p.B);
    int64_t total_work = 0;  // Σ over row blocks of rows × keys
    for (int64_t b = 0; b < p.B; ++b) {
      Sequence& s = seqs[b];
      s.b = b;
      s.row0 = p.q_begin ? p.q_begin[b] : 0;
      s.sq = p.q_begin ? p.q_begin[b + 1] - p.q_begin[b] : p.Sq;
      s.skv = p.kv_begin ? p.kv_begin[b + 1] - p.kv_begin[b] : (p.kv_len ? p.kv_len[b] : p.Skv);
      s.offset = p.q_begin ? s.skv - s.sq : p.causal_offset;  // ragged batches align bottom-right
      s.q_blocks = (s.sq + positions_per_task - 1) / positions_per_task;
      s.span = key_span(p, s);
      total_work += p.Hkv * head_chunks * s.q_blocks * row_work(s);
    }
    std::stable_sort(seqs.begin(), seqs.end(),
                     [](const Sequence& x, const Sequence& y) { return x.sq * x.skv > y.sq * y.skv; });
    row_blocks = tasks = slots = 0;
    for (Sequence& s : seqs) {
      s.kv_heads_per_task = group_kv_heads && decodes(s) ? std::min(p.Hkv, kDecodeKvHeads) : 1;
      s.kv_splits = 1;
      if (total_work > 0) {  // a task holds kv_heads_per_task row blocks' work
        const int64_t want = (s.kv_heads_per_task * row_work(s) * kMinParallelTasks + total_work - 1) / total_work;
        const int64_t most = s.span / (kMinSplitTiles * kKvTile);
        s.kv_splits = std::max<int64_t>(1, std::min(want, most));
      }
      s.kv_split_len = round_up((s.span + s.kv_splits - 1) / s.kv_splits, kKvTile);
      const int64_t n = p.Hkv * head_chunks * s.q_blocks;
      const int64_t kv_groups = (p.Hkv + s.kv_heads_per_task - 1) / s.kv_heads_per_task;
      s.first_row_block = row_blocks, s.first_task = tasks, s.first_slot = slots;
      row_blocks += n;
      tasks += kv_groups * head_chunks * s.q_blocks * s.kv_splits;
      if (s.kv_splits > 1) slots += n * s.kv_splits;
    }
  }
  // Whether every row block of the sequence runs key blocks (decode): one query block and
  // one head chunk of few enough rows.
  bool decodes(const Sequence& s) const {
    const int64_t rows = heads_per_task * s.sq;
    return s.q_blocks == 1 && head_chunks == 1 && 2 * rows <= kLanes && few[rows].key_blocks;
  }
  int64_t row_work(const Sequence& s) const { return s.span * std::min(s.sq, positions_per_task); }

  // The most keys a row block of the sequence sees from its first visible one (run() splits
  // from there): all of them, or with a window the window's reach.
  int64_t key_span(const AttentionParams& p, const Sequence& s) const {
    if (p.window_left < 0) return s.skv;
    const int64_t right = p.causal ? 0 : (p.window_right >= 0 ? p.window_right : s.skv);
    const int64_t most_keys =
        p.window_left + positions_per_task + right + kKvTile;  // + visible_keys' rounding
    return most_keys < s.skv ? most_keys : s.skv;
  }

  Mode make_mode(const AttentionParams& p, int64_t rows, bool key_blocks) const {
    Mode m;
    m.key_blocks = key_blocks;
    m.qk_pairs = key_blocks && (bf16_dot || fp8_pairs);
    // bf16 inputs round P to bf16 for P·V, as FlashAttention and torch do: the products
    // and sums stay fp32, and vdpbf16ps runs it at nearly twice the fp32 FMA rate. Decode
    // does too, from V's rows as they lie: half the instructions of the split-bf16 tile's
    // fp32 FMAs, and each V row read once.
    m.pv_bf16 = kDotProducts && ((int8 && !pv_int8) || (bf16_dot && !key_blocks));
    // Decode's products on AMX tiles where the kv heads are grouped (their blocks read in
    // address order before the tiles load them, attend_kv_heads): on the Xeon with AMX (P16,
    // one thread) the vdpbf16ps key blocks took 12.5 ms (bf16) / 19 (fp8) with K and V in L2,
    // the tiles 8.4-9.0 / 14; from memory 28.5 / 27.6 against 25 / 24 ms (the reads and the
    // products barely overlap there). One head at a time ([B, H, S, D] K/V), the tile loads'
    // order (16 rows × 64 bytes at a time) lost the hardware prefetchers: decode Dc took
    // 4.5 ms on tiles against 3.1-3.7 on vdpbf16ps, the same within cache. P·V takes V's rows
    // as they lie, 32 columns per tile (pv_rows_amx), so Dv must fill whole tiles.
    m.amx_tiles = m.qk_pairs && amx && group_kv_heads && p.Dv % (2 * kLanes) == 0;
    m.pv_row_pairs = key_blocks && bf16_dot && p.Dv % 32 == 0 && !m.amx_tiles;
    const int64_t elems = bf16_dot || m.qk_pairs ? (p.D + 1) / 2 : p.D;  // per Q/K row: fp32, or bf16 pairs
    m.rows_per_vec = rows_per_vector(rows, elems);
    const int64_t segment = kLanes / m.rows_per_vec;
    m.chunks = (elems + segment - 1) / segment;
    m.chunked_row = m.chunks * segment;
    // K rows read where they are: fp32 rows of unit stride; for vdpbf16ps, bf16 rows that
    // are whole pairs (every row starts on a pair: even strides; the key block reads whole
    // chunks, so D must fill them there).
    const bool whole_chunks = !key_blocks || elems % segment == 0;
    if (bf16_dot) {
      const bool pairs_aligned = p.k_stride[0] % 2 == 0 && p.k_stride[1] % 2 == 0 && p.k_stride[2] % 2 == 0;
      m.k_in_place = p.kv_dtype == DType::bfloat16 && p.k_stride[3] == 1 && pairs_aligned && p.D % 2 == 0 &&
                     whole_chunks;
    } else {
      m.k_in_place = p.kv_dtype == DType::float32 && p.k_stride[3] == 1 && whole_chunks;
    }
    m.v_split_bf16 = (p.kv_dtype == DType::bfloat16 || (fp8_cache && key_blocks)) && p.v_stride[3] == 1 &&
                     p.Dv % (2 * kLanes) == 0 && !m.pv_bf16 && !m.pv_row_pairs && !m.amx_tiles && !pv_int8;
    return m;
  }
};

struct Workspace {
  float *qt, *o, *st, *k, *v, *m, *l, *alpha, *q_scale;
  int32_t* q_sum;
  float *shift, *slope, *dist;  // per row: sage's q·mean (soft-cap only); ALiBi's slope, a - j0
  float* ot;                               // Oᵀ [dv_pad][rows_pad] (AttentionTask::o_transposed)
  float *p_codes, *pv, *p_scale, *p_top;  // sage int8_pv_int8: P's codes, a tile's P·V; per row P's
  int32_t* p_top_key;                      // scale, its largest value in the tile and that one's key
  Workspace(float* base, const Plan& plan, const AttentionParams& p) {
    qt = base;
    o = qt + plan.d_pad * plan.rows_pad;
    st = o + plan.rows_pad * plan.dv_pad;
    k = st + kScoreRows * plan.rows_pad;
    v = k + plan.k_floats;
    m = v + plan.v_floats;
    l = m + plan.rows_pad;
    alpha = l + plan.rows_pad;
    q_scale = alpha + plan.rows_pad;
    q_sum = reinterpret_cast<int32_t*>(q_scale + plan.rows_pad);
    shift = reinterpret_cast<float*>(q_sum + plan.rows_pad);
    slope = shift + plan.rows_pad;
    dist = slope + plan.rows_pad;
    ot = dist + plan.rows_pad;
    heads = base + plan.workspace_floats - (plan.group_kv_heads ? kDecodeKvHeads * plan.head_state_floats : 0);
    head_state_floats = plan.head_state_floats;
    dv_pad = plan.dv_pad;
    p_codes = pv = p_scale = p_top = nullptr;
    p_top_key = nullptr;
    if (plan.pv_int8) {
      p_codes = ot + plan.dv_pad * plan.rows_pad;
      pv = p_codes + plan.p_code_floats();
      p_scale = pv + plan.rows_pad * plan.dv_pad;
      p_top = p_scale + plan.rows_pad;
      p_top_key = reinterpret_cast<int32_t*>(p_top + plan.rows_pad);
    }
  }

  // The workspace of kv head i (< kDecodeKvHeads) of a decode task over several
  // (Plan::group_kv_heads): its own Q, O and softmax state; scores and K/V staging shared.
  Workspace head(int64_t i) const {
    Workspace w = *this;
    w.m = heads + i * head_state_floats;
    w.l = w.m + kLanes;
    w.alpha = w.l + kLanes;
    w.o = w.alpha + kLanes;
    w.qt = w.o + kMaxDotRows * dv_pad;
    return w;
  }

 private:
  float* heads;  // Plan::group_kv_heads: kDecodeKvHeads states of Plan::head_state_floats
  int64_t head_state_floats, dv_pad;
};

// The rows of one task: heads h0 .. h0+nh-1 of kv head kvh, positions i0 .. i0+nq-1 of
// sequence b (its query 0 at packed row row0). Row r is head h0 + r / nq at position
// i0 + r % nq. The sequence has skv keys; causal: position i sees keys j <= i + offset.
// scale multiplies q·k (the softmax scale times the cache's k_scale), v_scale the output.
struct RowBlock {
  int64_t b, kvh, h0, nh, i0, nq, rows;
  // Columns of the tile loop's transposed tiles (Qᵀ, Sᵀ, Oᵀ; rows_pad apart): the rows up to
  // a whole vector, so a short block (a short sequence's last) multiplies no padding rows;
  // all rows_pad on AMX tiles and in sage, whose tiles and codes take whole blocks.
  int64_t cols;
  int64_t row0, skv, offset;
  float scale, v_scale;
  const Mode* mode;  // how it runs (Plan::mode)
};

// Where the K (or V) rows of one (sequence, kv head) lie: row j at base + j * stride
// (dense, varlen), or in a paged cache at offset j % page_size of page pages[j / page_size]
// (base + page * page_stride + offset * stride). Rows come in runs at one stride: the whole
// range when contiguous, a page's worth when paged.
template <class E>
struct KvRows {
  const E* base;
  int64_t stride;
  const int32_t* pages = nullptr;  // the sequence's block-table row, or null
  int64_t page_size = 0, page_stride = 0;
  // log2(page_size) where it is a power of two (every engine's block size), else -1: row()
  // runs per key, and a 64-bit division there took ~8% of paged decode's time (Zen 5).
  int page_shift = -1;
  // A caller reads these rows ahead into L2 (decode over kv heads, p.l2_read_ahead): the fp8
  // conversion (convert_fp8_rows) then asks for no row ahead itself.
  bool read_ahead = false;

  static KvRows paged(const E* base, int64_t stride, const int32_t* pages, int64_t page_size, int64_t page_stride) {
    const bool pow2 = (page_size & (page_size - 1)) == 0;
    return {base, stride, pages, page_size, page_stride, pow2 ? __builtin_ctzll(static_cast<uint64_t>(page_size)) : -1};
  }
  int64_t page_of(int64_t j) const { return page_shift >= 0 ? j >> page_shift : j / page_size; }
  int64_t in_page_offset(int64_t j) const { return page_shift >= 0 ? j & (page_size - 1) : j % page_size; }

  const E* row(int64_t j) const {
    return pages ? base + pages[page_of(j)] * page_stride + in_page_offset(j) * stride : base + j * stride;
  }
  // Whether row j + ahead lies in the run of row j's page (always when not paged): rows
  // past a page are elsewhere, not the next ones.
  bool in_page(int64_t j, int64_t ahead) const { return !pages || in_page_offset(j) + ahead < page_size; }
  // The end of the run of rows that starts at j, at most `end`.
  int64_t run_end(int64_t j, int64_t end) const {
    if (!pages) return end;
    const int64_t page_end = (page_of(j) + 1) * page_size;
    return page_end < end ? page_end : end;
  }
  // f(first row, index of that row from j0, rows in the run) for each run of [j0, j0 + n).
  template <class F>
  void for_each_run(int64_t j0, int64_t n, F&& f) const {
    for (int64_t j = j0; j < j0 + n;) {
      const int64_t e = run_end(j, j0 + n);
      f(row(j), j - j0, e - j);
      j = e;
    }
  }
};

// Keys [begin, end) of one row block or split.
struct KeyRange {
  int64_t begin, end;
};

// A tile of scores, key j of row r at s[j * key_stride + r * row_stride]: transposed (Sᵀ,
// rows along the lanes) in the tile loop, row-major (keys along the lanes) for decode.
struct Scores {
  float* s;
  int64_t key_stride, row_stride;
  float& at(int64_t r, int64_t j) const { return s[j * key_stride + r * row_stride]; }
};

}  // namespace attnkit::cpu::ATTNKIT_ISA::fwd
