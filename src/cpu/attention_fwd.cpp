// Dense (and quantized) attention forward on the CPU: the flash-style tile loop. One task
// is a block of query rows sharing one kv head (the GQA group's heads × a run of query
// positions). Per K/V tile of kKvTile keys it computes Sᵀ = K · Qᵀ (keys × rows, so the
// softmax runs down columns with rows as the SIMD axis), the online softmax, and
// O += P · V. K and V are read in place where their rows allow it (fp32 of unit stride,
// bf16 pairs, bf16 V in split order), else converted once per tile, and used by every row
// of the task. Sᵀ has three sources: the fp32 gemm, bf16 pairs (vdpbf16ps) for bf16 inputs
// on avx512bf16, and int8 codes for sage_attention. P·V is the fp32 gemm, or on avx512bf16
// (bf16 inputs, sage) bf16 pairs with P rounded to bf16. Decode (few rows) runs attend_rows:
// key blocks of one vector with row-major scores. Masks, dropout, splits and the epilogue
// are shared. Score modifiers: the window bounds the keys visited and joins the masks, the
// soft-cap and ALiBi act on each tile before them, the sinks enter in the epilogue. Dense,
// varlen and paged batches are one loop: a task's sequence says where its rows lie. Scores
// never exceed one tile. Compiled once per ISA.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/philox.h"
#include "core/thread_pool.h"
#include "cpu/kernel_table.h"
#include "cpu/kernels.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/dot.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/workspace.h"
#include "cpu/kernels/softmax.h"
#include "ops/attention_params.h"

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

constexpr int64_t kKvTile = 128;    // keys per tile (a multiple of 4: one dropout draw per 4 keys)
constexpr int64_t kMinSplitTiles = 4;      // a kv split covers at least this many tiles
constexpr int64_t kMinParallelTasks = 16;  // fewer row blocks than this: split the keys
constexpr int64_t kPrefetchRows = 32;      // packing asks for the row this far ahead (flat 16..64)
// Keys per decode block (scores, softmax, P·V); 2 and 4 vectors measured slower out of cache.
constexpr int64_t kDecodeKeys = kLanes;
// Query rows per task (heads of a group × positions): a multiple of 16 (the Kᵀ·Q tile's
// columns) and of 6 (the P·V tile's rows on AVX-512), measured best of 48, 64 and 96.
constexpr int64_t kRowTarget = 48;
static_assert(kRowTarget <= kKvTile, "the Q packers stage a task's rows in the K tile's space");
// Whether this variant has the bf16 and int8 dot-product instructions (vdpbf16ps, vpdpbusd).
#if defined(ATTNKIT_ISA_avx512bf16)
constexpr bool kDotProducts = true;
#else
constexpr bool kDotProducts = false;
#endif

// K and V prepared once per call for sage int8 mode (prepare_sage): K smoothed by its
// per-head mean over tokens (softmax is invariant to it; lse is corrected), then int8 with
// one scale per kKvTile keys, stored + 128 as the unsigned operand of vpdpbusd; on
// avx512bf16 also V as bf16 pairs of consecutive keys for vdpbf16ps. Key rows holding a
// NaN or inf are left out of the mean and the tile scales and get zero codes; their logits
// are computed exactly instead (fix_nonfinite_logits), so NaN and inf propagate as in
// exact attention.
struct QuantizedKeys {
  const uint8_t* codes;           // [B][Hkv][Skv][4 * quads]
  const float* scale;             // [B][Hkv][tiles]
  const float* mean;              // [B][Hkv][D]
  const uint32_t* v_pairs;        // [B][Hkv][ceil(Skv / 2)][dv_pad], or null
  const uint8_t* nonfinite;       // [B][Hkv][Skv]: 1 where the key row holds a NaN or inf
  const uint8_t* tile_nonfinite;  // [B][Hkv][tiles]: 1 where any key of the tile does
  int64_t quads, tiles;
};

// One sequence's share of the work: its row blocks (kv heads × head chunks × query blocks,
// in that order) and the key ranges each splits into. Dense attention has B equal ones.
struct Sequence {
  int64_t b, sq, skv;    // queries and keys
  int64_t row0;          // packed row of query 0 (ragged batches; 0 for dense)
  int64_t offset;        // query i aligns to key i + offset (causal: sees keys j <= i + offset)
  int64_t span;          // keys a row block sees from its first visible one (Plan::key_span)
  int64_t q_blocks, kv_splits, kv_split_len;
  int64_t first_row_block, first_task, first_slot;  // slots: partial states (kv_splits > 1)
};

// How one row block runs: the tile loop, or for few rows (decode) key blocks with row-major
// scores (attend_rows); and which operands it reads in place.
struct Mode {
  bool key_blocks;
  int rows_per_vec;             // key blocks: query rows side by side in one vector (dot.h)
  int64_t chunks;               // key blocks: a Q/K row in chunks of kLanes / rows_per_vec elements (bf16: pairs)
  int64_t chunked_row;          // key blocks: chunks × that, the length of a packed K row
  bool pv_bf16;                 // P·V on bf16 pairs: sage int8, and the bf16 tile loop, on avx512bf16
  bool k_in_place;              // K rows used where they are, without packing
  bool v_split_bf16;            // bf16 V rows read in place by the P·V tile; O in split order
};

// How the work splits into tasks, and the per-thread workspace each task uses.
struct Plan {
  int64_t heads_per_task, positions_per_task, head_chunks, row_blocks;
  int64_t tasks, slots;  // tasks: row blocks × their kv splits; slots: tasks of split row blocks
  std::vector<Sequence> seqs;  // heavy first
  int64_t rows_pad, d_pad, dv_pad, workspace_floats, partial_floats;
  bool bf16_dot;                // bf16 inputs on avx512bf16: K·Qᵀ with vdpbf16ps
  bool int8;                    // sage int8 mode: K·Qᵀ on int8 codes
  bool v_in_place;              // fp32 V rows with unit stride need no packing
  Mode tile;                    // row blocks of more rows
  Mode few[kLanes / 2 + 1];     // few[r]: row blocks of r rows, where key blocks pay

  Plan(const AttentionParams& p, bool int8_mode) {
    int8 = int8_mode;
    heads_per_task = p.group < kRowTarget ? p.group : kRowTarget;
    positions_per_task = kRowTarget / heads_per_task;
    if (positions_per_task > p.Sq) positions_per_task = p.Sq;
    if (positions_per_task < 1) positions_per_task = 1;
    head_chunks = (p.group + heads_per_task - 1) / heads_per_task;
    plan_sequences(p);

    const int64_t rows = heads_per_task * positions_per_task;
    rows_pad = round_up(rows, kLanes);
    d_pad = round_up(p.D, kLanes);
    dv_pad = round_up(p.Dv, kLanes);
    // fp8 caches (paged) are widened to fp32 as they are packed: the fp32 paths below.
    bf16_dot = kDotProducts && !int8 && p.dtype == DType::bfloat16 && p.kv_dtype == DType::bfloat16;
    v_in_place = p.kv_dtype == DType::float32 && p.v_stride[3] == 1 && p.Dv == dv_pad;
    tile = make_mode(p, rows, false);
    for (int64_t r = 1; r <= kLanes / 2; ++r) few[r] = make_mode(p, r, !int8 && r <= kMaxDotRows);
    workspace_floats = d_pad * rows_pad            // Qᵀ (or Q rows), scaled
                       + rows_pad * dv_pad         // output accumulators
                       + kKvTile * rows_pad        // Sᵀ, then Pᵀ
                       + kKvTile * d_pad           // K tile (when packed)
                       + kKvTile * dv_pad          // V tile (when packed)
                       + 8 * rows_pad;             // running max, sum, rescale; int8 q scale, sum;
                                                   // sage's row shift; ALiBi slope, distance
    partial_floats = rows_pad * (dv_pad + 2);  // o, m, l of one split
  }

  // The mode of a row block of `rows` rows: key blocks where they pay (decode rows, and the
  // last positions of a sequence), else the tile loop.
  const Mode& mode(int64_t rows) const { return 2 * rows <= kLanes && few[rows].key_blocks ? few[rows] : tile; }

  // The sequence (and its row block) of a task or row block: the last one starting at or before it.
  const Sequence& sequence_of_task(int64_t task) const {
    return *(std::upper_bound(seqs.begin(), seqs.end(), task,
                              [](int64_t t, const Sequence& s) { return t < s.first_task; }) - 1);
  }
  const Sequence& sequence_of_row_block(int64_t rb) const {
    return *(std::upper_bound(seqs.begin(), seqs.end(), rb,
                              [](int64_t r, const Sequence& s) { return r < s.first_row_block; }) - 1);
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
      s.kv_splits = 1;
      if (total_work > 0) {
        const int64_t want = (row_work(s) * kMinParallelTasks + total_work - 1) / total_work;
        const int64_t most = s.span / (kMinSplitTiles * kKvTile);
        s.kv_splits = std::max<int64_t>(1, std::min(want, most));
      }
      s.kv_split_len = round_up((s.span + s.kv_splits - 1) / s.kv_splits, kKvTile);
      const int64_t n = p.Hkv * head_chunks * s.q_blocks;
      s.first_row_block = row_blocks, s.first_task = tasks, s.first_slot = slots;
      row_blocks += n;
      tasks += n * s.kv_splits;
      if (s.kv_splits > 1) slots += n * s.kv_splits;
    }
  }
  int64_t row_work(const Sequence& s) const { return s.span * std::min(s.sq, positions_per_task); }

  // The most keys a row block of the sequence sees from its first visible one (run() splits
  // from there): all of them, or with a window the window's reach.
  int64_t key_span(const AttentionParams& p, const Sequence& s) const {
    if (p.window_left < 0) return s.skv;
    const int64_t right = p.causal ? 0 : (p.window_right >= 0 ? p.window_right : s.skv);
    const int64_t most_keys = p.window_left + positions_per_task + right + kKvTile;  // + visible_keys' rounding
    return most_keys < s.skv ? most_keys : s.skv;
  }

  Mode make_mode(const AttentionParams& p, int64_t rows, bool key_blocks) const {
    Mode m;
    m.key_blocks = key_blocks;
    // bf16 inputs round P to bf16 for P·V, as FlashAttention and torch do: the products
    // and sums stay fp32, and vdpbf16ps runs it at nearly twice the fp32 FMA rate. Decode
    // is bound by its reads, so it keeps P in fp32.
    m.pv_bf16 = kDotProducts && (int8 || (bf16_dot && !key_blocks));
    const int64_t elems = bf16_dot ? (p.D + 1) / 2 : p.D;  // per Q/K row: fp32, or bf16 pairs
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
      m.k_in_place = p.k_stride[3] == 1 && pairs_aligned && p.D % 2 == 0 && whole_chunks;
    } else {
      m.k_in_place = p.kv_dtype == DType::float32 && p.k_stride[3] == 1 && whole_chunks;
    }
    m.v_split_bf16 = p.kv_dtype == DType::bfloat16 && p.v_stride[3] == 1 && p.Dv % (2 * kLanes) == 0 && !m.pv_bf16;
    return m;
  }
};

struct Workspace {
  float *qt, *o, *st, *k, *v, *m, *l, *alpha, *q_scale;
  int32_t* q_sum;
  float *shift, *slope, *dist;  // per row: sage's q·mean (soft-cap only); ALiBi's slope, a - j0
  Workspace(float* base, const Plan& plan, const AttentionParams& p) {
    qt = base;
    o = qt + plan.d_pad * plan.rows_pad;
    st = o + plan.rows_pad * plan.dv_pad;
    k = st + kKvTile * plan.rows_pad;
    v = k + kKvTile * plan.d_pad;
    m = v + kKvTile * plan.dv_pad;
    l = m + plan.rows_pad;
    alpha = l + plan.rows_pad;
    q_scale = alpha + plan.rows_pad;
    q_sum = reinterpret_cast<int32_t*>(q_scale + plan.rows_pad);
    shift = reinterpret_cast<float*>(q_sum + plan.rows_pad);
    slope = shift + plan.rows_pad;
    dist = slope + plan.rows_pad;
  }
};

// The rows of one task: heads h0 .. h0+nh-1 of kv head kvh, positions i0 .. i0+nq-1 of
// sequence b (its query 0 at packed row row0). Row r is head h0 + r / nq at position
// i0 + r % nq. The sequence has skv keys; causal: position i sees keys j <= i + offset.
// scale multiplies q·k (the softmax scale times the cache's k_scale), v_scale the output.
struct RowBlock {
  int64_t b, kvh, h0, nh, i0, nq, rows;
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

  const E* row(int64_t j) const {
    return pages ? base + pages[j / page_size] * page_stride + j % page_size * stride : base + j * stride;
  }
  // The end of the run of rows that starts at j, at most `end`.
  int64_t run_end(int64_t j, int64_t end) const {
    if (!pages) return end;
    const int64_t page_end = (j / page_size + 1) * page_size;
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

// Decode's software prefetch pays only when memory is slow to answer. On this VM the memory
// state differs from process to process: at one thread Dc took 1.6 ms with the hardware
// prefetchers alone in some processes and 4-5.5 ms in others, 2.3-4 ms with the prefetches
// in both. So each task times both on alternate runs of blocks after a warm-up and keeps
// the faster: 1.7 ms and 3.9 ms in those states. Timing only; results never depend on it.
class PrefetchChooser {
 public:
  // Whether the task's block number `block` (from 0) prefetches: yes through the warm-up,
  // then alternate runs of kRun blocks (even runs yes), then the faster choice.
  bool prefetch(int64_t block) {
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
  std::chrono::steady_clock::duration spent_[2] = {};  // in runs with, without prefetch
  bool chosen_ = true;
};

// TK is the dtype of K and V: T's, or float8 for paged caches (widened as they are packed).
template <DType T, DType TK = T>
class AttentionTask {
  using E = typename Elem<T>::type;
  using EK = typename Elem<TK>::type;

 public:
  AttentionTask(const AttentionParams& p, const Plan& plan, const QuantizedKeys* kq = nullptr)
      : p_(p), plan_(plan), kq_(kq) {}

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

  // Task = (row block, kv split). Without splits it writes the output directly; with
  // splits it leaves its unnormalised state in its slot of `partial` for merge().
  void run(int64_t task, float* workspace, float* partial) const {
    const Sequence& s = plan_.sequence_of_task(task);
    const int64_t local = task - s.first_task;
    const RowBlock rb = row_block(s, s.first_row_block + local / s.kv_splits);
    const int64_t split = local % s.kv_splits;
    Workspace w(workspace, plan_, p_);
    const KeyRange keys = visible_keys(rb);
    const int64_t split_begin = keys.begin + split * s.kv_split_len;
    const int64_t end = split_begin + s.kv_split_len < keys.end ? split_begin + s.kv_split_len : keys.end;
    attend(rb, split_begin, end < split_begin ? split_begin : end, w);
    if (s.kv_splits == 1) {
      write_out(rb, w.o, w.m, w.l, w.v);
      return;
    }
    float* slot = partial + (s.first_slot + local) * plan_.partial_floats;
    std::memcpy(slot, w.o, sizeof(float) * rb.rows * plan_.dv_pad);
    std::memcpy(slot + plan_.rows_pad * plan_.dv_pad, w.m, sizeof(float) * plan_.rows_pad);
    std::memcpy(slot + plan_.rows_pad * (plan_.dv_pad + 1), w.l, sizeof(float) * plan_.rows_pad);
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
    const float* first = partial + (s.first_slot + (row_block_index - s.first_row_block) * splits) * plan_.partial_floats;
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
        for (int64_t d = 0; d < dv_pad; d += kLanes) vstore(o + d, vload(o + d) + vload(slot + r * dv_pad + d) * f);
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
  // rounded down to a multiple of 4 (one dropout draw covers 4 keys), or for sage to a tile
  // border (its K scales and V pairs are per tile). Keys outside are never visited, so a
  // window costs O(Sq · window).
  KeyRange visible_keys(const RowBlock& rb) const {
    const int64_t first = rb.i0 + key_offset(rb), last = first + rb.nq - 1;  // aligned positions
    const int64_t align = plan_.int8 ? kKvTile : 4;
    KeyRange keys{0, rb.skv};
    if (p_.causal && last + 1 < keys.end) keys.end = last + 1;
    if (p_.window_right >= 0 && last + p_.window_right + 1 < keys.end) keys.end = last + p_.window_right + 1;
    if (p_.window_left >= 0 && first - p_.window_left > 0) keys.begin = (first - p_.window_left) / align * align;
    if (keys.end < keys.begin) keys.end = keys.begin;
    return keys;
  }

  // Runs keys [begin, end) through the tile loop, leaving the rows' state in w.o, w.m, w.l.
  void attend(const RowBlock& rb, int64_t begin, int64_t end, const Workspace& w) const {
    if (rb.mode->key_blocks) return attend_rows(rb, begin, end, w);
    const int64_t ld = plan_.rows_pad;
    const Scores scores{w.st, ld, 1};
    if (plan_.int8) {
      pack_q_int8(rb, w);
    } else if (plan_.bf16_dot) {
      pack_qt_pairs(rb, w);
    } else {
      pack_qt(rb, w);
    }
    std::memset(w.o, 0, sizeof(float) * rb.rows * plan_.dv_pad);
    for (int64_t r = 0; r < ld; ++r) w.m[r] = -INFINITY, w.l[r] = 0.0f;

    const KvRows<EK> krows = kv_rows(p_.k, p_.k_stride, rb), vrows = kv_rows(p_.v, p_.v_stride, rb);
    for (int64_t j0 = begin; j0 < end; j0 += kKvTile) {
      const int64_t bc = end - j0 < kKvTile ? end - j0 : kKvTile;
      if (plan_.int8) {  // Sᵀ = K · Qᵀ on int8 codes, dequantised
        qk_int8(rb, j0, bc, w);
        fix_nonfinite_logits(rb, j0, bc, w);
      } else if (plan_.bf16_dot) {  // Sᵀ = K · Qᵀ on bf16 pairs, then the scale
        qk_bf16(rb, krows, j0, bc, w);
      } else if (rb.mode->k_in_place) {  // Sᵀ = K · Qᵀ, a gemm per run of rows at one stride
        krows.for_each_run(j0, bc, [&](const EK* k, int64_t first, int64_t n) {
          gemm<kWideRows, kWideVecs>(n, ld, p_.D, reinterpret_cast<const float*>(k), krows.stride, 1, w.qt, ld,
                                     w.st + first * ld, ld, false);
        });
      } else {
        pack_rows(krows, j0, bc, p_.k_stride[3], p_.D, p_.D, w.k);
        gemm<kWideRows, kWideVecs>(bc, ld, p_.D, w.k, p_.D, 1, w.qt, ld, w.st, ld, false);
      }
      apply_score_mods(rb, j0, bc, scores, w);
      apply_masks(rb, j0, bc, scores);
      online_softmax_tile(w.st, bc, ld, ld, w.m, w.l, w.alpha);
      rescale_output(rb, w);
      if (p_.dropout_p > 0.0f) apply_dropout(rb, j0, bc, scores);
      if (rb.mode->pv_bf16) {
        pv_bf16(rb, vrows, j0, bc, w);
      } else {
        accumulate_pv(rb, vrows, j0, bc, scores, w);
      }
    }
  }

  // The K (or V) rows of the block's sequence and kv head.
  KvRows<EK> kv_rows(const void* data, const int64_t* stride, const RowBlock& rb) const {
    const EK* base = static_cast<const EK*>(data) + rb.kvh * stride[1];
    if (p_.block_table) {
      return {base, stride[2], p_.block_table + rb.b * p_.block_table_stride, p_.block_size, stride[0]};
    }
    const int64_t first = p_.kv_begin ? p_.kv_begin[rb.b] : 0;
    return {base + rb.b * stride[0] + first * stride[2], stride[2]};
  }

  // Decode: few rows, so scores are row-major (keys along the lanes, no padded rows), in
  // blocks of kDecodeKeys keys computed kLanes keys at a time. K and V are read in address
  // order (dot_key_block, whole-row P·V tiles), with software prefetch where it pays.
  void attend_rows(const RowBlock& rb, int64_t begin, int64_t end, const Workspace& w) const {
    const int64_t ld = kDecodeKeys;
    const Scores scores{w.st, 1, ld};
    if (plan_.bf16_dot) {
      pack_q_row_pairs(rb, w);
    } else {
      pack_q_rows(rb, w);
    }
    std::memset(w.o, 0, sizeof(float) * rb.rows * plan_.dv_pad);
    for (int64_t r = 0; r < rb.rows; ++r) w.m[r] = -INFINITY, w.l[r] = 0.0f;

    const KvRows<EK> krows = kv_rows(p_.k, p_.k_stride, rb), vrows = kv_rows(p_.v, p_.v_stride, rb);
    PrefetchChooser chooser;
    for (int64_t j0 = begin; j0 < end; j0 += kDecodeKeys) {
      const int64_t block = (j0 - begin) / kDecodeKeys;
      const bool prefetch = chooser.prefetch(block);
      const int64_t bc = end - j0 < kDecodeKeys ? end - j0 : kDecodeKeys;
      const int64_t width = round_up(bc, kLanes);
      // This block's V rows into L2 before its Q·Kᵀ, the next block's K rows before its P·V:
      // each about half a block ahead of use (of the orders tried, the best across memory
      // states: the next block's K and V, two blocks ahead, part of each row, key by key).
      if (prefetch) prefetch_rows(vrows, j0, end, p_.Dv);
      for (int64_t c = 0; c < bc; c += kLanes) {
        qk_key_block(rb, krows, j0 + c, bc - c < kLanes ? bc - c : kLanes, w.st + c, ld, w);
      }
      apply_score_mods(rb, j0, bc, scores, w);  // before the padding: the soft-cap would lift its -inf
      for (int64_t r = 0; r < rb.rows; ++r) {  // keys past the block's end
        for (int64_t j = bc; j < width; ++j) w.st[r * ld + j] = -INFINITY;
      }
      apply_masks(rb, j0, bc, scores);
      online_softmax_rows(w.st, width, ld, rb.rows, w.m, w.l, w.alpha);
      rescale_output(rb, w);
      if (p_.dropout_p > 0.0f) apply_dropout(rb, j0, bc, scores);
      if (prefetch) prefetch_rows(krows, j0 + kDecodeKeys, end, p_.D);
      accumulate_pv(rb, vrows, j0, bc, scores, w);
      chooser.done(block);
    }
  }

  // Decode: rows first .. first + kDecodeKeys - 1 (those before `end`) of `cols` elements
  // into L2.
  static void prefetch_rows(const KvRows<EK>& rows, int64_t first, int64_t end, int64_t cols) {
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
  void qk_key_block(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t n, float* s, int64_t lds,
                    const Workspace& w) const {
    const bool in_place = rb.mode->k_in_place && n == kLanes && krows.run_end(j0, j0 + n) == j0 + n;
    if (plan_.bf16_dot) {
      qk_rows_bf16(rb, krows, j0, n, in_place, s, lds, w);
    } else if (in_place) {
      dot_key_block(rb.mode->rows_per_vec, rb.rows, rb.mode->chunks, reinterpret_cast<const float*>(krows.row(j0)),
                    krows.stride, w.qt, s, lds);
    } else {  // whole chunks of kLanes zero-padded rows
      const int64_t ld = rb.mode->chunked_row;
      pack_rows(krows, j0, n, p_.k_stride[3], p_.D, ld, w.k);
      std::memset(w.k + n * ld, 0, sizeof(float) * (kLanes - n) * ld);
      dot_key_block(rb.mode->rows_per_vec, rb.rows, rb.mode->chunks, w.k, ld, w.qt, s, lds);
    }
  }

  // O *= alpha, row by row, where the running max moved.
  void rescale_output(const RowBlock& rb, const Workspace& w) const {
    for (int64_t r = 0; r < rb.rows; ++r) {
      if (w.alpha[r] != 1.0f) scale_row(w.o + r * plan_.dv_pad, plan_.dv_pad, w.alpha[r]);
    }
  }

  // O += P · V for keys j0 .. j0+bc-1, V read in place (bf16 in split order, fp32 of unit
  // stride) or packed.
  void accumulate_pv(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc, const Scores& p,
                     const Workspace& w) const {
    // Keys first .. first + n - 1 of the tile. Decode takes whole-row tiles (V read in
    // address order), the tile loop tall ones.
    auto gemm_pv = [&](const auto* v, int64_t ldv, int64_t first, int64_t n) {
      const float* pf = p.s + first * p.key_stride;
      if (rb.mode->key_blocks) {
        gemm<kRowRows, kRowVecs>(rb.rows, plan_.dv_pad, n, pf, p.row_stride, p.key_stride, v, ldv, w.o, plan_.dv_pad,
                                 true);
      } else {
        gemm<kTallRows, kTallVecs>(rb.rows, plan_.dv_pad, n, pf, p.row_stride, p.key_stride, v, ldv, w.o,
                                   plan_.dv_pad, true);
      }
    };
    if (rb.mode->v_split_bf16 || plan_.v_in_place) {  // a gemm per run of rows at one stride
      vrows.for_each_run(j0, bc, [&](const EK* v, int64_t first, int64_t n) {
        if constexpr (TK == DType::bfloat16 || TK == DType::float32) gemm_pv(v, vrows.stride, first, n);
      });
    } else {
      pack_rows(vrows, j0, bc, p_.v_stride[3], p_.Dv, plan_.dv_pad, w.v);
      gemm_pv(static_cast<const float*>(w.v), plan_.dv_pad, 0, bc);
    }
  }

#if defined(ATTNKIT_ISA_avx512bf16)
  static uint32_t pair(uint16_t lo, uint16_t hi) { return uint32_t{lo} | uint32_t{hi} << 16; }

  // Qᵀ as bf16 pairs along D into w.qt: [p][r] = (q[r][2p], q[r][2p+1]), unscaled (the scale is
  // applied to the fp32 scores); odd D ends with a zero, padding rows are zero. Rows are
  // paired into w.k (free until the first key tile), then transposed.
  void pack_qt_pairs(const RowBlock& rb, const Workspace& w) const {
    const int64_t pairs = (p_.D + 1) / 2, lds = round_up(pairs, kLanes);
    uint32_t* rows = reinterpret_cast<uint32_t*>(w.k);
    std::memset(rows, 0, sizeof(uint32_t) * plan_.rows_pad * lds);
    for (int64_t r = 0; r < rb.rows; ++r) {
      pack_pairs(reinterpret_cast<const uint16_t*>(q_row(rb, r)), p_.q_stride[3], rows + r * lds);  // E is bf16 here
    }
    transpose_matrix(w.k, lds, plan_.rows_pad, lds, w.qt, plan_.rows_pad);
  }

  // Sᵀ = K · Qᵀ on bf16 pairs (K rows in place, a gemm per run, or copied as pairs), then
  // Sᵀ *= scale.
  void qk_bf16(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t bc, const Workspace& w) const {
    const int64_t pairs = (p_.D + 1) / 2, ld = plan_.rows_pad;
    const uint32_t* qt = reinterpret_cast<const uint32_t*>(w.qt);
    if (rb.mode->k_in_place) {
      krows.for_each_run(j0, bc, [&](const EK* k, int64_t first, int64_t n) {
        gemm_bf16<kWideRows, kWideVecs>(n, ld, pairs, reinterpret_cast<const uint32_t*>(k), krows.stride / 2, 1, qt,
                                        ld, w.st + first * ld, ld, false);
      });
    } else {
      const uint32_t* keys = pack_key_pairs(krows, j0, bc, pairs, w);
      gemm_bf16<kWideRows, kWideVecs>(bc, ld, pairs, keys, pairs, 1, qt, ld, w.st, ld, false);
    }
    const vfloat scale = vbroadcast(rb.scale);
    for (int64_t i = 0; i < bc * ld; i += kLanes) vstore(w.st + i, vload(w.st + i) * scale);
  }

  // Decode: Q rows as bf16 pairs, unscaled, grouped for dot_key_block_bf16 into w.qt (via w.k).
  void pack_q_row_pairs(const RowBlock& rb, const Workspace& w) const {
    const int64_t pairs = (p_.D + 1) / 2;
    uint32_t* rows = reinterpret_cast<uint32_t*>(w.k);  // free until the first key block
    for (int64_t r = 0; r < rb.rows; ++r) {
      pack_pairs(reinterpret_cast<const uint16_t*>(q_row(rb, r)), p_.q_stride[3], rows + r * pairs);  // E is bf16 here
    }
    group_rows(rb.mode->rows_per_vec, rb.rows, pairs, rows, pairs, rb.mode->chunks, reinterpret_cast<uint32_t*>(w.qt));
  }

  // Decode: s[r * lds + j] = K[j0 + j] · Q[r] on bf16 pairs for n <= kLanes keys, read in
  // place when whole pairs of each row can be loaded as they are, then times the scale.
  void qk_rows_bf16(const RowBlock& rb, const KvRows<EK>& krows, int64_t j0, int64_t n, bool in_place, float* s,
                    int64_t lds, const Workspace& w) const {
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
    dot_key_block_bf16(rb.mode->rows_per_vec, rb.rows, rb.mode->chunks, keys, ldk, reinterpret_cast<const uint32_t*>(w.qt),
                       s, lds);
    const vfloat scale = vbroadcast(rb.scale);
    for (int64_t r = 0; r < rb.rows; ++r) vstore(s + r * lds, vload(s + r * lds) * scale);
  }

  // D elements at src (stride `stride`) as bf16 pairs; odd D ends with a zero.
  void pack_pairs(const uint16_t* src, int64_t stride, uint32_t* dst) const {
    if (stride == 1) {  // whole pairs as they lie (memcpy reads them unaligned)
      std::memcpy(dst, src, sizeof(uint16_t) * (p_.D & ~int64_t{1}));
      if (p_.D % 2) dst[p_.D / 2] = src[p_.D - 1];
      return;
    }
    for (int64_t d = 0; d < p_.D; d += 2) dst[d / 2] = pair(src[d * stride], d + 1 < p_.D ? src[(d + 1) * stride] : 0);
  }

  // K rows j0 .. j0+n-1 as bf16 pairs into w.k, rows of ld pairs (zero past the row's own pairs).
  uint32_t* pack_key_pairs(const KvRows<EK>& krows, int64_t j0, int64_t n, int64_t ld, const Workspace& w) const {
    uint32_t* kp = reinterpret_cast<uint32_t*>(w.k);
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

#else
  void pack_qt_pairs(const RowBlock&, const Workspace&) const {}
  void qk_bf16(const RowBlock&, const KvRows<EK>&, int64_t, int64_t, const Workspace&) const {}
  void pack_q_row_pairs(const RowBlock&, const Workspace&) const {}
  void qk_rows_bf16(const RowBlock&, const KvRows<EK>&, int64_t, int64_t, bool, float*, int64_t,
                    const Workspace&) const {}
#endif

  // Sage int8: Q rows quantised to int8 with one scale per row (the softmax scale folded
  // in), written as Qᵀ quads of s8 for vpdpbusd (or as floats of the codes elsewhere);
  // q_sum[r] = Σ codes corrects the +128 offset of the unsigned K codes. A row holding a
  // NaN or inf keeps zero codes and gets q_scale NaN: fix_nonfinite_logits computes its
  // logits exactly.
  void pack_q_int8(const RowBlock& rb, const Workspace& w) const {
    const int64_t ld = plan_.rows_pad;
    std::memset(w.qt, 0, sizeof(float) * plan_.d_pad * ld);
    for (int64_t r = 0; r < ld; ++r) w.q_scale[r] = 0.0f, w.q_sum[r] = 0;
    for (int64_t r = 0; r < rb.rows; ++r) {
      float* row = w.k;  // free until the first key tile
      load_row<T>(q_row(rb, r), p_.q_stride[3], p_.D, 1.0f, row);
      for (int64_t d = p_.D; d < plan_.d_pad; ++d) row[d] = 0.0f;
      // max |q| on the bits: for sign-cleared floats integer order is float order, and NaN
      // and inf sort above every finite value.
      vint amax_lanes{};
      for (int64_t d = 0; d < plan_.d_pad; d += kLanes) {
        const vint a = (vint)vload(row + d) & 0x7FFFFFFF;
        amax_lanes = a > amax_lanes ? a : amax_lanes;
      }
      int32_t amax_bits = 0;
      for (int i = 0; i < kLanes; ++i) amax_bits = amax_lanes[i] > amax_bits ? amax_lanes[i] : amax_bits;
      if (amax_bits >= 0x7F800000) {  // NaN or inf
        w.q_scale[r] = NAN;
        continue;
      }
      float amax;
      std::memcpy(&amax, &amax_bits, sizeof amax);
      // At least the smallest subnormal: amax / 127 may underflow to 0 for tiny rows.
      const float step = amax > 0.0f ? std::fmax(amax / 127.0f, std::numeric_limits<float>::denorm_min()) : 1.0f;
      w.q_scale[r] = step * p_.scale;
      // codes = row / step rounded to nearest even (|codes| <= 127, so 1.5·2^23 rounds),
      // written over the row.
      int32_t* codes = reinterpret_cast<int32_t*>(row);
      const vfloat vstep = vbroadcast(step);
      vint sums{};
      for (int64_t d = 0; d < plan_.d_pad; d += kLanes) {
        const vint c = __builtin_convertvector((vload(row + d) / vstep + 12582912.0f) - 12582912.0f, vint);
        sums += c;
        std::memcpy(codes + d, &c, sizeof c);
      }
      int32_t sum = 0;
      for (int i = 0; i < kLanes; ++i) sum += sums[i];
      for (int64_t d = 0; d < p_.D; ++d) {
        const int32_t code = codes[d];
#if defined(ATTNKIT_ISA_avx512bf16)
        reinterpret_cast<uint8_t*>(reinterpret_cast<uint32_t*>(w.qt) + d / 4 * ld + r)[d % 4] =
            static_cast<uint8_t>(static_cast<int8_t>(code));
#else
        w.qt[d * ld + r] = static_cast<float>(code);
#endif
      }
      w.q_sum[r] = sum;
    }
    if (p_.softcap != 0.0f) {  // the soft-cap needs the unsmoothed logits (apply_score_mods)
      for (int64_t r = 0; r < ld; ++r) {
        w.shift[r] = r < rb.rows ? lse_shift(rb, rb.h0 + r / rb.nq, rb.i0 + r % rb.nq) : 0.0f;
      }
    }
  }

  // Sᵀ[j][r] = (K codes · Q codes) · q_scale[r] · k_scale[tile]: exact integer dot products
  // (vpdpbusd, or fp32 FMAs on integers below 2^24 elsewhere), then one multiply.
  void qk_int8(const RowBlock& rb, int64_t j0, int64_t bc, const Workspace& w) const {
    const int64_t ld = plan_.rows_pad, quads = kq_->quads, head = rb.b * p_.Hkv + rb.kvh;
    const uint8_t* codes = kq_->codes + (head * p_.Skv + j0) * 4 * quads;
    const float k_scale = kq_->scale[head * kq_->tiles + j0 / kKvTile];
#if defined(ATTNKIT_ISA_avx512bf16)
    int32_t* acc = reinterpret_cast<int32_t*>(w.st);
    gemm_u8s8<kWideRows, kWideVecs>(bc, ld, quads, reinterpret_cast<const uint32_t*>(codes), quads,
                                    reinterpret_cast<const uint32_t*>(w.qt), ld, acc, ld);
    for (int64_t r = 0; r < ld; r += kLanes) {
      vint offset;
      std::memcpy(&offset, w.q_sum + r, sizeof offset);
      offset *= 128;  // Σ (k + 128) q - 128 Σ q = Σ k q
      const vfloat scale = vload(w.q_scale + r) * k_scale;
      for (int64_t j = 0; j < bc; ++j) {
        vint a;
        std::memcpy(&a, acc + j * ld + r, sizeof a);
        vstore(w.st + j * ld + r, __builtin_convertvector(a - offset, vfloat) * scale);
      }
    }
#else
    for (int64_t j = 0; j < bc; ++j) {
      for (int64_t d = 0; d < p_.D; ++d) w.k[j * p_.D + d] = static_cast<float>(int32_t{codes[j * 4 * quads + d]} - 128);
    }
    gemm<kWideRows, kWideVecs>(bc, ld, p_.D, w.k, p_.D, 1, w.qt, ld, w.st, ld, false);
    for (int64_t r = 0; r < ld; r += kLanes) {
      const vfloat scale = vload(w.q_scale + r) * k_scale;
      for (int64_t j = 0; j < bc; ++j) vstore(w.st + j * ld + r, vload(w.st + j * ld + r) * scale);
    }
#endif
  }

  // Sᵀ[j][r] for the keys and query rows holding a NaN or inf (zero codes in qk_int8):
  // scale·q·k in fp32 as exact attention computes it. Each such logit is ±inf or NaN, so
  // the mean K was smoothed by does not matter for it: +inf or NaN poisons the row, -inf
  // drops the key, as in exact attention.
  void fix_nonfinite_logits(const RowBlock& rb, int64_t j0, int64_t bc, const Workspace& w) const {
    const int64_t ld = plan_.rows_pad, head = rb.b * p_.Hkv + rb.kvh;
    const bool any_key = kq_->tile_nonfinite[head * kq_->tiles + j0 / kKvTile];
    const uint8_t* bad_key = kq_->nonfinite + head * p_.Skv + j0;
    const E* kbase = static_cast<const E*>(p_.k) + rb.b * p_.k_stride[0] + rb.kvh * p_.k_stride[1];
    for (int64_t r = 0; r < rb.rows; ++r) {
      const bool bad_row = std::isnan(w.q_scale[r]);
      if (!bad_row && !any_key) continue;
      const E* q = q_row(rb, r);
      for (int64_t j = 0; j < bc; ++j) {
        if (!bad_row && !bad_key[j]) continue;
        const E* k = kbase + (j0 + j) * p_.k_stride[2];
        float s = 0.0f;
        for (int64_t d = 0; d < p_.D; ++d) {
          s += Elem<T>::load(q[d * p_.q_stride[3]]) * p_.scale * Elem<T>::load(k[d * p_.k_stride[3]]);
        }
        w.st[j * ld + r] = s;
      }
    }
  }

  // lse of the unsmoothed logits: subtracting the key mean shifted row (h, i) by q · mean.
  float lse_shift(const RowBlock& rb, int64_t h, int64_t i) const {
    const E* q = static_cast<const E*>(p_.q) + rb.b * p_.q_stride[0] + h * p_.q_stride[1] + i * p_.q_stride[2];
    const float* mean = kq_->mean + (rb.b * p_.Hkv + rb.kvh) * p_.D;
    float dot = 0.0f;
    for (int64_t d = 0; d < p_.D; ++d) dot += Elem<T>::load(q[d * p_.q_stride[3]]) * mean[d];
    return dot * p_.scale;
  }

#if defined(ATTNKIT_ISA_avx512bf16)
  // O += P · V with P rounded to bf16 and both packed as pairs along the keys (vdpbf16ps):
  // Pᵀ is rewritten in place (pair row jp of keys 2jp, 2jp+1). V pairs come from sage's
  // prepared V, or are interleaved here from this tile's bf16 V rows.
  void pv_bf16(const RowBlock& rb, const KvRows<EK>& vrows, int64_t j0, int64_t bc, const Workspace& w) const {
    const int64_t ld = plan_.rows_pad, dv_pad = plan_.dv_pad, pairs = (bc + 1) / 2;
    uint32_t* pp = reinterpret_cast<uint32_t*>(w.st);
    pair_rows_bf16(w.st, bc, ld, pp);
    uint32_t* vp = reinterpret_cast<uint32_t*>(w.v);
    if (!kq_) {  // bf16 V (EK is bf16 here): a lone last key pairs with a zero row (its P is zero too)
      vrows.for_each_run(j0, bc, [&](const EK* v, int64_t first, int64_t n) {
        const uint16_t* a = reinterpret_cast<const uint16_t*>(v);
        for (int64_t j = first; j < first + n; ++j, a += vrows.stride) {
          // The rows of a pair may lie in different pages: a pair's second row that starts
          // a run is added to the pair its first row left half empty.
          uint32_t* dst = vp + j / 2 * dv_pad;  // j counts from the tile's first key
          if (j % 2 == 0) {
            const bool second_here = j + 1 < first + n;
            interleave_bf16_rows(a, second_here ? a + vrows.stride : nullptr, p_.v_stride[3], p_.Dv, dv_pad, dst);
            if (second_here) ++j, a += vrows.stride;
          } else {
            for (int64_t d = 0; d < p_.Dv; ++d) dst[d] |= uint32_t{a[d * p_.v_stride[3]]} << 16;
          }
        }
      });
      gemm_bf16<kTallRows, kTallVecs>(rb.rows, dv_pad, pairs, pp, 1, ld, vp, dv_pad, w.o, dv_pad, true);
      return;
    }
    const int64_t head = rb.b * p_.Hkv + rb.kvh;
    const uint32_t* prepared = kq_->v_pairs + (head * ((p_.Skv + 1) / 2) + j0 / 2) * dv_pad;
    const int64_t full = bc / 2;  // pairs whose two keys are both in the tile
    gemm_bf16<kTallRows, kTallVecs>(rb.rows, dv_pad, full, pp, 1, ld, prepared, dv_pad, w.o, dv_pad, true);
    if (bc % 2) {  // the last key alone: the pair's other key lies past the tile (mask, split)
      for (int64_t d = 0; d < dv_pad; ++d) vp[d] = prepared[full * dv_pad + d] & 0xFFFFu;
      gemm_bf16<kTallRows, kTallVecs>(rb.rows, dv_pad, 1, pp + full * ld, 1, ld, vp, dv_pad, w.o, dv_pad, true);
    }
  }
#else
  void pv_bf16(const RowBlock&, const KvRows<EK>&, int64_t, int64_t, const Workspace&) const {}
#endif

  // Decode: Q rows pre-multiplied by the softmax scale, grouped for dot_key_block into w.qt (via w.k).
  void pack_q_rows(const RowBlock& rb, const Workspace& w) const {
    for (int64_t r = 0; r < rb.rows; ++r) load_row<T>(q_row(rb, r), p_.q_stride[3], p_.D, rb.scale, w.k + r * p_.D);
    group_rows(rb.mode->rows_per_vec, rb.rows, p_.D, w.k, p_.D, rb.mode->chunks, w.qt);
  }

  // Qᵀ [D][rows_pad], pre-multiplied by the softmax scale; padding rows are zero. Rows are
  // converted into w.k (free until the first key tile), then transposed.
  void pack_qt(const RowBlock& rb, const Workspace& w) const {
    const int64_t lds = plan_.d_pad;
    std::memset(w.k, 0, sizeof(float) * plan_.rows_pad * lds);
    for (int64_t r = 0; r < rb.rows; ++r) load_row<T>(q_row(rb, r), p_.q_stride[3], p_.D, rb.scale, w.k + r * lds);
    transpose_matrix(w.k, lds, plan_.rows_pad, lds, w.qt, plan_.rows_pad);
  }

  // n rows of `cols` elements converted to fp32 [n][ld], zero-padded to ld columns.
  // K or V rows j0 .. j0+n-1 of `cols` elements converted to fp32 [n][ld], zero-padded to
  // ld columns.
  static void pack_rows(const KvRows<EK>& rows, int64_t j0, int64_t n, int64_t col_stride, int64_t cols, int64_t ld,
                        float* dst) {
    rows.for_each_run(j0, n, [&](const EK* src, int64_t first, int64_t count) {
      for (int64_t j = 0; j < count; ++j) {
        prefetch_bytes(src, (j + kPrefetchRows) * rows.stride * int64_t{sizeof(EK)}, cols * int64_t{sizeof(EK)});
        float* row = dst + (first + j) * ld;
        load_row<TK>(src + j * rows.stride, col_stride, cols, 1.0f, row);
        for (int64_t c = cols; c < ld; ++c) row[c] = 0.0f;
      }
    });
  }

  // The causal limit, the window and the user mask on the scores, as -inf or an additive bias.
  void apply_masks(const RowBlock& rb, int64_t j0, int64_t bc, const Scores& st) const {
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
      if (right_cut && clamp(a + p_.window_right - j0 + 1) < visible) visible = clamp(a + p_.window_right - j0 + 1);
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
  void apply_score_mods(const RowBlock& rb, int64_t j0, int64_t bc, const Scores& st, const Workspace& w) const {
    // Locals, not p_'s fields: stores to the tile could alias them, which would reload them per vector.
    const float softcap = p_.softcap;
    const float* const slopes = p_.alibi_slopes;
    if (softcap == 0.0f && !slopes) return;
    const bool transposed = st.row_stride == 1;  // Sᵀ of the tile loop, rows along the lanes
    const int64_t rows = transposed ? plan_.rows_pad : rb.rows;
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
        const vfloat slope = slopes ? vload(w.slope + r) : vfloat{}, dist0 = slopes ? vload(w.dist + r) : vfloat{};
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
  void apply_dropout(const RowBlock& rb, int64_t j0, int64_t bc, const Scores& pt) const {
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

  // out = o / (l + e^(sink - m)) (times the cache's v_scale) in the output dtype (the sink
  // term only with sinks), and lse = m + log(l), without the sink as in sparse MLA (-inf for
  // rows that saw no key; their out is 0, sink or not). scratch holds Dv floats.
  void write_out(const RowBlock& rb, const float* o_acc, const float* m, const float* ls, float* scratch) const {
    E* out = static_cast<E*>(p_.out);
    // Sage int8's m and l are of the logits smoothed by q·mean, unless the soft-cap put it back.
    const bool shifted = kq_ && p_.softcap == 0.0f && (p_.lse || p_.sinks);
    for (int64_t r = 0; r < rb.rows; ++r) {
      const int64_t h = rb.h0 + r / rb.nq, i = rb.i0 + r % rb.nq;
      const float l = ls[r];
      const float shift = shifted ? lse_shift(rb, h, i) : 0.0f;
      float denom = l;
      if (p_.sinks && l > 0.0f) denom += std::exp(p_.sinks[h * p_.sinks_stride] - (m[r] + shift));
      const float inv = (denom > 0.0f ? 1.0f / denom : (l == 0.0f ? 0.0f : denom)) * rb.v_scale;  // denom is NaN or >= 1
      const float* o = o_acc + r * plan_.dv_pad;
      const int64_t row = rb.row0 + i;  // packed row (ragged batches), else the position
      E* dst = out + rb.b * p_.out_stride[0] + h * p_.out_stride[1] + row * p_.out_stride[2];
      if (rb.mode->v_split_bf16) {  // back to column order
        unsplit_bf16_row(o, p_.Dv, scratch);
        o = scratch;
      }
      store_row<T>(o, inv, p_.Dv, dst, p_.out_stride[3]);
      if (p_.lse) {
        p_.lse[rb.b * p_.lse_stride[0] + h * p_.lse_stride[1] + row * p_.lse_stride[2]] =
            l == 0.0f ? -INFINITY : m[r] + std::log(l) + shift;
      }
    }
  }

  const AttentionParams& p_;
  const Plan& plan_;
  const QuantizedKeys* kq_;  // sage int8 mode only
};

template <DType T, DType TK = T>
void run_attention(const AttentionParams& p, const QuantizedKeys* kq = nullptr) {
  const int threads = detail::num_threads();
  const Plan plan(p, kq != nullptr);
  AlignedBuffer<float> workspace(plan.workspace_floats * threads);
  AlignedBuffer<float> partial(plan.partial_floats * plan.slots);
  const AttentionTask<T, TK> task(p, plan, kq);
  auto attend = [&](int64_t t, int thread) {
    task.run(t, workspace.data + plan.workspace_floats * thread, partial.data);
  };
  detail::parallel_for(plan.tasks, threads, attend);
  if (plan.slots > 0) {
    auto merge = [&](int64_t rb, int thread) {
      task.merge(rb, workspace.data + plan.workspace_floats * thread, partial.data);
    };
    detail::parallel_for(plan.row_blocks, threads, merge);
  }
}

// Queries of dtype T over K and V of T, or of a float8 paged cache.
template <DType T>
void run_attention_kv(const AttentionParams& p) {
  switch (p.kv_dtype) {
    case DType::float8_e4m3fn: return run_attention<T, DType::float8_e4m3fn>(p);
    case DType::float8_e5m2: return run_attention<T, DType::float8_e5m2>(p);
    default: return run_attention<T>(p);
  }
}

}  // namespace

// Dense, varlen and paged attention: the params say where each sequence's rows lie.
void attention_fwd(const AttentionParams& p) {
  switch (p.dtype) {
    case DType::float16: return run_attention_kv<DType::float16>(p);
    case DType::bfloat16: return run_attention_kv<DType::bfloat16>(p);
    default: return run_attention_kv<DType::float32>(p);
  }
}


namespace {

// Sage int8: one pass over K per (batch, kv head): the mean over its finite rows, then
// int8 codes of (k - mean) with one scale (max |k - mean| / 127) per kKvTile keys; and,
// where P·V runs on bf16 pairs, one pass over V packing consecutive keys into pairs. The
// mean and k - mean are taken in double, so no finite key (up to float's max) overflows;
// rows holding a NaN or inf are flagged and get zero codes (see QuantizedKeys).
template <DType T>
void prepare_sage(const AttentionParams& p, uint8_t* codes, float* scale, float* mean, uint32_t* v_pairs,
                  uint8_t* nonfinite, uint8_t* tile_nonfinite, int64_t quads, int64_t tiles, int64_t dv_pad) {
  using E = typename Elem<T>::type;
  auto body = [&](int64_t head, int) {
    const int64_t b = head / p.Hkv, kvh = head % p.Hkv;
    const E* k = static_cast<const E*>(p.k) + b * p.k_stride[0] + kvh * p.k_stride[1];
    float* mu = mean + head * p.D;
    uint8_t* bad = nonfinite + head * p.Skv;
    AlignedBuffer<float> tile(kKvTile * p.D > 2 * dv_pad ? kKvTile * p.D : 2 * dv_pad);
    AlignedBuffer<double> sum(p.D);
    std::memset(sum.data, 0, sizeof(double) * p.D);
    int64_t finite_rows = 0;
    for (int64_t j = 0; j < p.Skv; ++j) {
      load_row<T>(k + j * p.k_stride[2], p.k_stride[3], p.D, 1.0f, tile.data);
      bool finite = true;
      for (int64_t d = 0; d < p.D; ++d) finite = finite && std::isfinite(tile.data[d]);
      bad[j] = !finite;
      if (!finite) continue;
      ++finite_rows;
      for (int64_t d = 0; d < p.D; ++d) sum.data[d] += tile.data[d];
    }
    for (int64_t d = 0; d < p.D; ++d) mu[d] = finite_rows ? static_cast<float>(sum.data[d] / finite_rows) : 0.0f;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t j0 = t * kKvTile, n = p.Skv - j0 < kKvTile ? p.Skv - j0 : kKvTile;
      double amax = 0.0;
      tile_nonfinite[head * tiles + t] = 0;
      for (int64_t j = 0; j < n; ++j) {
        float* row = tile.data + j * p.D;
        load_row<T>(k + (j0 + j) * p.k_stride[2], p.k_stride[3], p.D, 1.0f, row);
        if (bad[j0 + j]) {
          tile_nonfinite[head * tiles + t] = 1;
          continue;
        }
        for (int64_t d = 0; d < p.D; ++d) {
          const double x = std::fabs(double{row[d]} - mu[d]);
          amax = x > amax ? x : amax;
        }
      }
      const double step = amax > 0.0 ? amax / 127.0 : 1.0;
      scale[head * tiles + t] = static_cast<float>(step);
      for (int64_t j = 0; j < n; ++j) {
        uint8_t* dst = codes + (head * p.Skv + j0 + j) * 4 * quads;
        const float* row = tile.data + j * p.D;
        for (int64_t d = 0; d < 4 * quads; ++d) {  // |x| <= 127
          const double x = d < p.D && !bad[j0 + j] ? (double{row[d]} - mu[d]) / step : 0.0;
          dst[d] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(x)) + 128);
        }
      }
    }
#if defined(ATTNKIT_ISA_avx512bf16)
    const E* v = static_cast<const E*>(p.v) + b * p.v_stride[0] + kvh * p.v_stride[1];
    const int64_t pairs = (p.Skv + 1) / 2;
    for (int64_t jp = 0; jp < pairs; ++jp) {  // rows 2jp and 2jp + 1 of V, zero-padded, as fp32 into tile
      const int64_t n = 2 * jp + 1 < p.Skv ? 2 : 1;
      std::memset(tile.data, 0, sizeof(float) * 2 * dv_pad);
      for (int64_t j = 0; j < n; ++j) {
        load_row<T>(v + (2 * jp + j) * p.v_stride[2], p.v_stride[3], p.Dv, 1.0f, tile.data + j * dv_pad);
      }
      pair_rows_bf16(tile.data, n, dv_pad, v_pairs + (head * pairs + jp) * dv_pad);
    }
#else
    (void)v_pairs;
#endif
  };
  detail::parallel_for(p.B * p.Hkv, detail::num_threads(), body);
}

template <DType T>
void run_sage_int8(const AttentionParams& p) {
  const int64_t quads = (p.D + 3) / 4, tiles = (p.Skv + kKvTile - 1) / kKvTile;
  const int64_t dv_pad = round_up(p.Dv, kLanes);
  AlignedBuffer<uint8_t> codes(p.B * p.Hkv * p.Skv * 4 * quads);
  AlignedBuffer<float> scale(p.B * p.Hkv * tiles), mean(p.B * p.Hkv * p.D);
  AlignedBuffer<uint32_t> v_pairs(kDotProducts ? p.B * p.Hkv * ((p.Skv + 1) / 2) * dv_pad : 0);
  AlignedBuffer<uint8_t> nonfinite(p.B * p.Hkv * p.Skv), tile_nonfinite(p.B * p.Hkv * tiles);
  prepare_sage<T>(p, codes.data, scale.data, mean.data, v_pairs.data, nonfinite.data, tile_nonfinite.data, quads,
                  tiles, dv_pad);
  const QuantizedKeys kq{codes.data,      scale.data,          mean.data, v_pairs.data,
                         nonfinite.data, tile_nonfinite.data, quads,     tiles};
  run_attention<T>(p, &kq);
}

}  // namespace

void sage_int8_fwd(const AttentionParams& p) {
  switch (p.dtype) {
    case DType::float16: return run_sage_int8<DType::float16>(p);
    case DType::bfloat16: return run_sage_int8<DType::bfloat16>(p);
    default: return run_sage_int8<DType::float32>(p);
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
