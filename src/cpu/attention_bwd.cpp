// Dense attention backward on the CPU (FlashAttention-2's algorithm), in three passes:
//  1. per query head (b, h): the row terms c = f·D - dlse with D = rowsum(dO∘O) and f the
//     share of the softmax left by the sink (1 without sinks), the sink's gradient, and Q
//     and dO packed once in the layouts the gemms read;
//  2. one task per run of key blocks of one (batch, kv head): per block of kKeyBlock keys
//     (K, V packed once) it visits every query block of the group's heads in a fixed order,
//     recomputing S = Q·Kᵀ·scale (+ soft-cap, ALiBi, window, mask, causal), E = exp(S - lse)
//     and P = f·E, then dV += Pᵀ·dO, dP = dO·Vᵀ, dS = E∘(f·dP - c) (times the soft-cap's
//     derivative), dK += dSᵀ·Q (dK, dV stay in the task's buffers), and a partial
//     dQ += dS·K in the split's own float32 rows;
//  3. per query head: the splits' partial dQs summed in split order.
// The split depends on the shapes only, so the gradients are bit-identical for any thread
// count. Dropout regenerates the forward's keep mask (detail::dropout_bits per 4 keys). All
// products run on the shared gemm tiles; for bf16 inputs on avx512bf16 all five run on bf16
// pairs (vdpbf16ps): S and dP exactly (products of the bf16 inputs), dV, dK and dQ with P
// and dS rounded to bf16 (as the forward rounds P for P·V, and FlashAttention does). On
// avx512amx they run on AMX tiles, dV and dK as their transposes dVᵀ += dOᵀ·P and dKᵀ +=
// Qᵀ·dS, so that P and dS (made in query-row pairs) and Qᵀ, dOᵀ (made once, in pass 1) are
// tile operands as they are. Compiled once per ISA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "core/philox.h"
#include "core/scratch.h"
#include "core/thread_pool.h"
#include "cpu/kernel_table.h"
#include "cpu/kernels.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_amx.h"
#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/softmax.h"
#include "cpu/kernels/workspace.h"
#include "ops/attention_backward_params.h"

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

// Keys and query rows per block: whole register tiles at D = Dv = 128 for every product (S
// and dP in 4 × 6-vector tiles, the others in 6 × 4). kKeyBlock is a multiple of kLanes and
// of 4 (one dropout draw per 4 keys), the row blocks even (query-row pairs). 192 keys halve
// the passes over the query rows' Q and dO (streamed from L3 per key block) against 96,
// measured ~5-10% faster at shape A; the key block's state (~0.7 MiB) stays in L2.
constexpr int64_t kKeyBlock = 192;
// Query rows per block on bf16 pairs: dV and dK add a whole row block per load and store of
// their accumulators, so longer blocks spend less on them. vdpbf16ps (Z4, shape A, in one
// process against 96: 0.97-0.98 of the time at 1 and 2 threads); AMX tiles (X7, shape A, 1
// thread: ~2.5% faster than 96).
constexpr int64_t kRowBlock = 192;
constexpr int64_t kTileRowBlock = 192;
// fp32 products take query blocks of 64 rows (their operands' share of L1 and L2 smaller):
// X6, shape A, 1 thread ~3% faster than 96; bf16 pairs (AMX) ~5% slower at 64.
constexpr int64_t kFp32RowBlock = 64;
constexpr int64_t kMaxRowBlock = std::max({kRowBlock, kTileRowBlock, kFp32RowBlock});
static_assert(kRowBlock % 2 == 0 && kFp32RowBlock % 2 == 0, "row blocks start on row pairs");
// Key blocks packed and run together: each query block visits them one after the other, so
// its partial dQ rows (and its Q and dO) are read from L3 once per group, not once per key
// block (the dQ rows' L3 round trips alone took ~9% of the call at shape A). Two blocks'
// state (K, Kᵀ, Vᵀ, dK, dV: ~1 MiB in fp32) already fills Zen 4's 1 MiB L2, so more per group
// cost no more L2 misses and save query-side traffic: 4 against 2 (Z4, shape A, in one
// process) 0.98 / 0.97 of the time at 1 / 2 threads in fp32, 0.98-0.99 in bf16; 6 the same
// as 4, all 11 no better than 2, 1 slower (1.04 / 1.08); varlen batches unchanged.
constexpr int64_t kKeyBlocksTogether = 4;
constexpr int64_t kScoreRows = 32;  // rows of S and dP made and consumed at a time (even)
// Rows of S and dP (and E, dropped P, tanh) held at once: on bf16 pairs one chunk's, reused by
// the next (so they stay in L1; ~4% at shape A on X7); in fp32 the row block's, which the
// gradient products read.
constexpr int64_t kScoreBufferRows = std::max(kScoreRows, kFp32RowBlock);

// Query-row pairs per slab of Qᵀ and dOᵀ (AMX tiles: one tile's depth), so row blocks start
// at multiples of 2 · kSlabPairs rows there.
constexpr int64_t kSlabPairs = 16;
static_assert(kTileRowBlock % (2 * kSlabPairs) == 0, "query blocks start on slabs");
static_assert(kScoreRows % 2 == 0, "S and dP chunks start on row pairs");
// Row pairs of P and dS held: a row block's, up to whole tiles of pairs.
constexpr int64_t kPairRows = (kMaxRowBlock / 2 + kSlabPairs - 1) / kSlabPairs * kSlabPairs;
// Fewer (batch, kv head) pairs than this: split the keys. Each split adds partial dQ rows
// that a pass sums, so splits cost; 8 keeps two threads busy with four tasks each (shape A's
// 8 pairs run unsplit: bf16 0.96-0.98x the time of 16 tasks at 1 and 2 threads on X7). A
// constant, not the thread count: the splits fix dQ's summation order.
constexpr int64_t kMinTasks = 8;
#if defined(ATTNKIT_ISA_avx512bf16)
constexpr bool kDotProducts = true;  // vdpbf16ps
#else
constexpr bool kDotProducts = false;
#endif
#if defined(ATTNKIT_ISA_avx512amx)
constexpr bool kAmx = true;  // tdpbf16ps
static_assert(kSlabPairs == kAmxTile);
#else
constexpr bool kAmx = false;
#endif

// gemm_bf16 where the ISA has it (callers use it only when kDotProducts), each tile over its
// rows' band of pairs. On avx512amx the whole tiles of rows go to AMX tiles (over all pairs)
// where A's pairs are contiguous (a_step 1) and n and the pairs fill whole tiles (the task
// configured them); the last rows, and other shapes, stay on gemm_bf16.
template <int MR, int NV, class Band = NoBand>
void gemm_pairs(int64_t m, int64_t n, int64_t pairs, const uint32_t* a, int64_t lda, int64_t a_step,
                const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate, Band band = {}) {
  int64_t m0 = 0;
#if defined(ATTNKIT_ISA_avx512amx)
  m0 = m / kAmxTile * kAmxTile;
  if (m0 > 0 && n % kAmxTile == 0 && pairs % kAmxTile == 0 && a_step == 1) {
    gemm_amx_bf16(m0, n, pairs, a, lda, b, ldb, c, ldc, accumulate, kAmxTile, band);
  } else {
    m0 = 0;
  }
#endif
#if defined(ATTNKIT_ISA_avx512bf16)
  auto rest_band = [&](int64_t r0, int64_t r1) { return band(m0 + r0, m0 + r1); };
  if (m0 < m) {
    gemm_bf16<MR, NV>(m - m0, n, pairs, a + m0 * lda, lda, a_step, b, ldb, c + m0 * ldc, ldc, accumulate, rest_band);
  }
#else
  (void)m, (void)n, (void)pairs, (void)a, (void)lda, (void)a_step, (void)b, (void)ldb, (void)c, (void)ldc,
      (void)accumulate, (void)band, (void)m0;
#endif
}

// One key block's K and V as the products read them, and its dK and dV accumulators.
struct PackedKeys {
  float *k, *v, *kt, *vt, *dk, *dv;        // fp32 rows of K, V; Kᵀ, Vᵀ; dK, dV (with tiles dKᵀ, dVᵀ)
  uint32_t *kt_pairs, *vt_pairs, *k_rows;  // pairs along D (Dv) of Kᵀ (Vᵀ); key pairs of K
  static int64_t floats(int64_t d_pad, int64_t dv_pad) { return 4 * kKeyBlock * (d_pad + dv_pad); }
  // Lays the block out from base; returns the end.
  float* place(float* base, int64_t dp, int64_t dvp) {
    const int64_t kb = kKeyBlock;
    k = base, v = k + kb * dp, kt = v + kb * dvp, vt = kt + kb * dp, dk = vt + kb * dvp, dv = dk + kb * dp;
    kt_pairs = reinterpret_cast<uint32_t*>(dv + kb * dvp), vt_pairs = kt_pairs + kb * dp / 2;
    k_rows = vt_pairs + kb * dvp / 2;
    return base + floats(dp, dvp);
  }
};

// How the keys split into tasks, the per-thread workspace and the per-head prepared data.
struct BackwardPlan {
  bool pairs;  // bf16 pairs for every product
  // On AMX tiles (pairs on avx512amx), dVᵀ and dKᵀ are accumulated (A = dOᵀ and Qᵀ in slabs);
  // else dV and dK (B = dO and Q in query-row pairs).
  bool tiles;
  bool q_in_place, dout_in_place;
  std::vector<int64_t> dq_offset;  // split s's partial dQ rows start at dq_offset[s] floats
  int64_t key_blocks, splits, blocks_per_split, tasks, d_pad, dv_pad, d_pairs, dv_pairs, rows16;
  int64_t row_pairs_pad, row_align;
  int64_t row_block;  // query rows per block: kTileRowBlock, kRowBlock or kFp32RowBlock
  int64_t workspace_floats, prepared_floats;

  BackwardPlan(const AttentionBackwardParams& bp, bool use_pairs) : pairs(use_pairs), tiles(use_pairs && kAmx) {
    const AttentionParams& p = bp.fwd;
    key_blocks = (p.Skv + kKeyBlock - 1) / kKeyBlock;
    const int64_t heads = p.B * p.Hkv;
    const int64_t want = heads > 0 ? (kMinTasks + heads - 1) / heads : 1;
    splits = std::max<int64_t>(1, std::min(want, key_blocks));
    blocks_per_split = key_blocks > 0 ? (key_blocks + splits - 1) / splits : 0;
    if (key_blocks > 0) splits = (key_blocks + blocks_per_split - 1) / blocks_per_split;
    tasks = heads * splits;
    d_pad = round_up(p.D, kLanes);
    dv_pad = round_up(p.Dv, kLanes);
    d_pairs = (p.D + 1) / 2, dv_pairs = (p.Dv + 1) / 2;
    rows16 = round_up(p.Sq, 16);
    row_pairs_pad = round_up((p.Sq + 1) / 2, tiles ? kSlabPairs : 1);
    row_align = tiles ? 2 * kSlabPairs : 2;
    row_block = tiles ? kTileRowBlock : pairs ? kRowBlock : kFp32RowBlock;
    workspace_floats = kKeyBlocksTogether * PackedKeys::floats(d_pad, dv_pad)
                       + 4 * kScoreBufferRows * kKeyBlock     // E, dP then dS, dropped P, tanh
                       + 2 * kPairRows * kKeyBlock            // row pairs of P and dS
                       + kMaxRowBlock * kKeyBlock / 2         // dS pairs along the keys
                       + 2 * dv_pad                     // a dO row and an O row
                       + kSlabPairs * (d_pad + dv_pad);  // a slab of Q's and dO's row pairs
    // Q and dO are read in place where they already have a gemm's layout: bf16 pairs along D
    // (contiguous rows of even length), or fp32 rows of whole vectors.
    auto in_place = [&](const int64_t* stride, int64_t n) {
      if (stride[3] != 1) return false;
      return pairs ? n % 2 == 0 && stride[2] % 2 == 0 : p.dtype == DType::float32 && n % kLanes == 0;
    };
    q_in_place = in_place(p.q_stride, p.D), dout_in_place = in_place(bp.dout_stride, p.Dv);
    const int64_t q_floats = q_in_place ? 0 : p.Sq * (pairs ? d_pairs : d_pad);
    const int64_t dout_floats = dout_in_place ? 0 : p.Sq * (pairs ? dv_pairs : dv_pad);
    const int64_t row_pairs_floats = pairs ? row_pairs_pad * (d_pad + dv_pad) : 0;
    prepared_floats = 3 * rows16 + round_up(q_floats + dout_floats + row_pairs_floats, 16);
    // Split s writes dQ rows from first_row(s) on (causal: the later key blocks' queries).
    dq_offset.resize(splits + 1);
    dq_offset[0] = 0;
    for (int64_t s = 0; s < splits; ++s) dq_offset[s + 1] = dq_offset[s] + p.B * p.Hq * (p.Sq - first_row(p, s)) * d_pad;
  }

  // The query rows [first, end) that can see some key of j0 .. j0+bc-1 (the causal limit and
  // the window), first rounded down to row_align (query-row pairs, or slabs, start there).
  std::pair<int64_t, int64_t> rows_of(const AttentionParams& p, int64_t j0, int64_t bc) const {
    int64_t first = 0, end = p.Sq;
    // Aligned query a = i + offset sees keys up to a (causal) or a + window_right.
    if (p.causal) first = j0 - p.causal_offset;
    else if (p.window_right >= 0) first = j0 - p.window_right - p.causal_offset;
    if (p.window_left >= 0) end = std::min(end, round_up(j0 + bc + p.window_left - p.causal_offset, 2));
    first = std::clamp<int64_t>(first, 0, p.Sq) / row_align * row_align;
    return {first, std::max(first, end)};
  }
  int64_t first_row(const AttentionParams& p, int64_t split) const {
    return rows_of(p, split * blocks_per_split * kKeyBlock, kKeyBlock).first;
  }
};

struct BackwardWorkspace {
  PackedKeys keys[kKeyBlocksTogether];
  float *e, *ds, *pd, *t, *pack;
  uint32_t* slab;              // kSlabPairs row pairs of Q, then of dO, being transposed
  uint32_t *p_rows, *ds_rows;  // query-row pairs of P and dS
  uint16_t* ds_keys;           // dS in bf16: pairs along the keys
  BackwardWorkspace(float* base, const BackwardPlan& plan) {
    const int64_t dvp = plan.dv_pad, kb = kKeyBlock, sb = kScoreBufferRows * kb;
    for (PackedKeys& packed : keys) base = packed.place(base, plan.d_pad, dvp);
    e = base;
    ds = e + sb, pd = ds + sb, t = pd + sb;
    p_rows = reinterpret_cast<uint32_t*>(t + sb), ds_rows = p_rows + kPairRows * kb;
    ds_keys = reinterpret_cast<uint16_t*>(ds_rows + kPairRows * kb);
    pack = reinterpret_cast<float*>(ds_keys + kMaxRowBlock * kb);
    slab = reinterpret_cast<uint32_t*>(pack + 2 * dvp);
  }
};

// Rows [..][kKeyBlock] of S (then E), dP (then dS), the dropped P and tanh for a chunk of a
// row block, its first row at offset 0: on bf16 pairs the same kScoreRows rows serve every
// chunk (still in L1 for the next), in fp32 each chunk has its own (the products read them).
struct ScoreRows {
  float *e, *ds, *pd, *t;
};

// One query head's prepared data (pass 1), read by every key block.
struct PreparedHead {
  float *lse, *c, *f;
  const float* q;                        // fp32 rows [Sq][q_ld], q_ld >= d_pad, in place or packed
  const float* dout;                     // [Sq][dout_ld]
  const uint32_t *q_pairs, *dout_pairs;  // bf16 pairs along D (Dv), rows q_ld (dout_ld) pairs apart
  // Q and dO in query-row pairs (element (i, c) pairs rows 2i and 2i + 1 of column c): rows
  // [row_pairs_pad][d_pad] ([..][dv_pad]), dK's and dV's B operands; with tiles, Qᵀ and dOᵀ
  // in slabs of kSlabPairs row pairs, each [d_pad][kSlabPairs], dKᵀ's and dVᵀ's A operands.
  uint32_t *q_row_pairs, *dout_row_pairs;
  int64_t q_ld, dout_ld;
  // The head's packed Q and dO (null where read in place).
  float* q_packed = nullptr;
  float* dout_packed = nullptr;
  PreparedHead(float* base, const BackwardPlan& plan, const AttentionBackwardParams& bp, int64_t b, int64_t h) {
    const AttentionParams& p = bp.fwd;
    lse = base, c = lse + plan.rows16, f = c + plan.rows16;
    float* rest = f + plan.rows16;
    const int64_t q_width = plan.pairs ? plan.d_pairs : plan.d_pad, dout_width = plan.pairs ? plan.dv_pairs : plan.dv_pad;
    const int64_t elem = p.dtype == DType::float32 ? 4 : 2;
    const char* q_in = static_cast<const char*>(p.q) + (b * p.q_stride[0] + h * p.q_stride[1]) * elem;
    const char* dout_in = static_cast<const char*>(bp.dout) + (b * bp.dout_stride[0] + h * bp.dout_stride[1]) * elem;
    if (plan.q_in_place) {
      q = reinterpret_cast<const float*>(q_in), q_ld = plan.pairs ? p.q_stride[2] / 2 : p.q_stride[2];
    } else {
      q = q_packed = rest, q_ld = q_width, rest += p.Sq * q_width;
    }
    if (plan.dout_in_place) {
      dout = reinterpret_cast<const float*>(dout_in), dout_ld = plan.pairs ? bp.dout_stride[2] / 2 : bp.dout_stride[2];
    } else {
      dout = dout_packed = rest, dout_ld = dout_width, rest += p.Sq * dout_width;
    }
    q_pairs = reinterpret_cast<const uint32_t*>(q), dout_pairs = reinterpret_cast<const uint32_t*>(dout);
    q_row_pairs = reinterpret_cast<uint32_t*>(rest), dout_row_pairs = q_row_pairs + plan.row_pairs_pad * plan.d_pad;
  }
};

template <DType T>
class Backward {
  using E = typename Elem<T>::type;

 public:
  Backward(const AttentionBackwardParams& bp, const BackwardPlan& plan, float* prepared, float* dq_partial,
           float* dsink_partial)
      : bp_(bp), p_(bp.fwd), plan_(plan), prepared_(prepared), dq_partial_(dq_partial),
        dsink_partial_(dsink_partial) {}

  // Pass 1 for query head bh = b·Hq + h: lse, c, f, the sink's gradient share, Q and dO packed.
  void prepare(int64_t bh, float* workspace) const {
    const int64_t b = bh / p_.Hq, h = bh % p_.Hq;
    const PreparedHead ph = head(b, h);
    const BackwardWorkspace w(workspace, plan_);
    float* g = w.pack;                   // the dO row
    float* o = w.pack + plan_.dv_pad;    // the O row
    const E* q = static_cast<const E*>(p_.q) + b * p_.q_stride[0] + h * p_.q_stride[1];
    const E* dout = static_cast<const E*>(bp_.dout) + b * bp_.dout_stride[0] + h * bp_.dout_stride[1];
    const E* out = static_cast<const E*>(p_.out) + b * p_.out_stride[0] + h * p_.out_stride[1];
    const float sink = p_.sinks ? p_.sinks[h * p_.sinks_stride] : 0.0f;
    double dsink = 0.0;
    for (int64_t i = 0; i < p_.Sq; ++i) {
      if (i + kRowsAhead < p_.Sq) {
        read_ahead(dout + i * bp_.dout_stride[2], bp_.dout_stride[2], bp_.dout_stride[3], p_.Dv);
        read_ahead(out + i * p_.out_stride[2], p_.out_stride[2], p_.out_stride[3], p_.Dv);
        if (plan_.pairs) read_ahead(q + i * p_.q_stride[2], p_.q_stride[2], p_.q_stride[3], p_.D);
      }
      load_row<T>(dout + i * bp_.dout_stride[2], bp_.dout_stride[3], p_.Dv, 1.0f, g);
      std::memset(g + p_.Dv, 0, sizeof(float) * (plan_.dv_pad - p_.Dv));
      load_row<T>(out + i * p_.out_stride[2], p_.out_stride[3], p_.Dv, 1.0f, o);
      std::memset(o + p_.Dv, 0, sizeof(float) * (plan_.dv_pad - p_.Dv));
      vfloat acc{};
      for (int64_t d = 0; d < plan_.dv_pad; d += kLanes) acc += vload(g + d) * vload(o + d);
      float delta = 0.0f;
      for (int l = 0; l < kLanes; ++l) delta += acc[l];
      const float lse = p_.lse[b * p_.lse_stride[0] + h * p_.lse_stride[1] + i * p_.lse_stride[2]];
      const float dlse =
          bp_.dlse ? bp_.dlse[b * bp_.dlse_stride[0] + h * bp_.dlse_stride[1] + i * bp_.dlse_stride[2]] : 0.0f;
      // With a sink, P = f·e^(S - lse), f = 1 / (1 + e^(sink - lse)) (lse excludes the sink);
      // the sink's own probability is 1 - f, with dP = 0 (it has no value row).
      float f = 1.0f;
      if (p_.sinks && lse != -INFINITY) {
        f = 1.0f / (1.0f + std::exp(sink - lse));
        dsink -= double{1.0f - f} * delta;
      }
      ph.lse[i] = lse, ph.f[i] = f;
      // lse's own gradient adds dlse·e^(S - lse) to dS: dS = e^(S - lse)·(f·dP - (f·D - dlse)).
      ph.c[i] = f * delta - dlse;
      if (plan_.pairs) {
        if (ph.q_packed) {
          pair_rows(q + i * p_.q_stride[2], p_.q_stride[2], p_.q_stride[3], 1, p_.D,
                    reinterpret_cast<uint32_t*>(ph.q_packed) + i * plan_.d_pairs);
        }
        if (ph.dout_packed) {
          pair_rows(dout + i * bp_.dout_stride[2], bp_.dout_stride[2], bp_.dout_stride[3], 1, p_.Dv,
                    reinterpret_cast<uint32_t*>(ph.dout_packed) + i * plan_.dv_pairs);
        }
        if (i % 2 == 1 || i == p_.Sq - 1) pair_query_rows(ph, q, dout, i / 2, w);
      } else {
        if (ph.q_packed) {
          load_row<T>(q + i * p_.q_stride[2], p_.q_stride[3], p_.D, 1.0f, ph.q_packed + i * plan_.d_pad);
          std::memset(ph.q_packed + i * plan_.d_pad + p_.D, 0, sizeof(float) * (plan_.d_pad - p_.D));
        }
        if (ph.dout_packed) std::memcpy(ph.dout_packed + i * plan_.dv_pad, g, sizeof(float) * plan_.dv_pad);
      }
    }
    if (dsink_partial_) dsink_partial_[bh] = static_cast<float>(dsink);
  }

  // Row pair rp of Q and dO (rows 2rp and 2rp + 1, or 2rp and zeros) into the head's query-row
  // pairs: straight into their rows, or with tiles, into the slab being built, transposed into
  // place once whole (or at the last row pair, zero-padded).
  void pair_query_rows(const PreparedHead& ph, const E* q, const E* dout, int64_t rp,
                       const BackwardWorkspace& w) const {
    if constexpr (T == DType::bfloat16) {
      const int64_t dp = plan_.d_pad, dvp = plan_.dv_pad, at = rp % kSlabPairs;
      const bool second = 2 * rp + 1 < p_.Sq, last = 2 * rp + 2 >= p_.Sq;
      const E* q0 = q + 2 * rp * p_.q_stride[2];
      const E* dout0 = dout + 2 * rp * bp_.dout_stride[2];
      uint32_t* q_dst = plan_.tiles ? w.slab + at * dp : ph.q_row_pairs + rp * dp;
      uint32_t* dout_dst = plan_.tiles ? w.slab + kSlabPairs * dp + at * dvp : ph.dout_row_pairs + rp * dvp;
      interleave_bf16_rows(q0, second ? q0 + p_.q_stride[2] : nullptr, p_.q_stride[3], p_.D, dp, q_dst);
      interleave_bf16_rows(dout0, second ? dout0 + bp_.dout_stride[2] : nullptr, bp_.dout_stride[3], p_.Dv, dvp,
                           dout_dst);
      if (!plan_.tiles || (at < kSlabPairs - 1 && !last)) return;
      std::memset(q_dst + dp, 0, sizeof(uint32_t) * (kSlabPairs - 1 - at) * dp);
      std::memset(dout_dst + dvp, 0, sizeof(uint32_t) * (kSlabPairs - 1 - at) * dvp);
      const int64_t slab = rp / kSlabPairs;
      transpose_matrix(reinterpret_cast<const float*>(w.slab), dp, kSlabPairs, dp,
                       reinterpret_cast<float*>(ph.q_row_pairs + slab * kSlabPairs * dp), kSlabPairs);
      transpose_matrix(reinterpret_cast<const float*>(w.slab + kSlabPairs * dp), dvp, kSlabPairs, dvp,
                       reinterpret_cast<float*>(ph.dout_row_pairs + slab * kSlabPairs * dvp), kSlabPairs);
    }
  }

  // Pass 2, task t: key blocks of split t / heads of (batch, kv head) t % heads. Split-major,
  // so the heaviest tasks (causal: the first split's, which see the most query rows) are
  // handed out first and the lighter ones even out the threads' ends.
  void run(int64_t t, float* workspace) const {
    const BackwardWorkspace w(workspace, plan_);
#if defined(ATTNKIT_ISA_avx512amx)
    if (plan_.tiles) amx_configure();  // once per task: ldtilecfg waits for every tile op before it
#endif
    const int64_t heads = p_.B * p_.Hkv, split = t / heads, kv_head = t % heads;
    const int64_t b = kv_head / p_.Hkv, kvh = kv_head % p_.Hkv;
    const int64_t kb_begin = split * plan_.blocks_per_split;
    const int64_t kb_end = std::min(plan_.key_blocks, kb_begin + plan_.blocks_per_split);
    const int64_t first_row = plan_.first_row(p_, split);
    if (kb_begin >= kb_end && first_row < p_.Sq) {  // no keys (Skv = 0): dQ is zero
      for (int64_t h = kvh * p_.group; h < (kvh + 1) * p_.group; ++h) {
        std::memset(dq_row(split, b, h, first_row), 0, sizeof(float) * (p_.Sq - first_row) * plan_.d_pad);
      }
    }
    for (int64_t kb0 = kb_begin; kb0 < kb_end; kb0 += kKeyBlocksTogether) {
      const int64_t together = std::min(kKeyBlocksTogether, kb_end - kb0);
      int64_t j0[kKeyBlocksTogether], bc[kKeyBlocksTogether];
      for (int64_t g = 0; g < together; ++g) {
        j0[g] = (kb0 + g) * kKeyBlock, bc[g] = std::min(kKeyBlock, p_.Skv - j0[g]);
        const PackedKeys& keys = w.keys[g];
        pack_kv(b, kvh, j0[g], bc[g], keys);
        zero_grads(keys, bc[g]);
      }
      // The rows any of the blocks sees: from the first block's first row to the last block's
      // end (both grow with the keys); a block given rows it does not see adds zeros.
      const int64_t i_begin = plan_.rows_of(p_, j0[0], bc[0]).first;
      const int64_t i_end = plan_.rows_of(p_, j0[together - 1], bc[together - 1]).second;
      // The split's first key block writes its partial dQ rows (it visits rows first_row(split)
      // .. i_end - 1; the rest, which a left window keeps from them, start at zero); later ones add.
      const bool first = kb0 == kb_begin;
      for (int64_t h = kvh * p_.group; h < (kvh + 1) * p_.group; ++h) {
        const PreparedHead ph = head(b, h);
        if (first && i_end < p_.Sq) {
          std::memset(dq_row(split, b, h, i_end), 0, sizeof(float) * (p_.Sq - i_end) * plan_.d_pad);
        }
        for (int64_t i0 = i_begin; i0 < i_end; i0 += plan_.row_block) {
          for (int64_t g = 0; g < together; ++g) {
            block(b, h, ph, i0, std::min(plan_.row_block, i_end - i0), j0[g], bc[g], dq_row(split, b, h, i0),
                  first && g == 0, w.keys[g], w);
          }
        }
      }
      for (int64_t g = 0; g < together; ++g) {
        const PackedKeys& keys = w.keys[g];
        const float* dk = keys.dk;
        const float* dv = keys.dv;
        if (plan_.tiles) {  // dKᵀ and dVᵀ back to rows, into K's and V's fp32 rows (done with)
          const int64_t width = key_width(bc[g]);
          transpose_matrix(keys.dk, kKeyBlock, plan_.d_pad, width, keys.k, plan_.d_pad);
          transpose_matrix(keys.dv, kKeyBlock, plan_.dv_pad, width, keys.v, plan_.dv_pad);
          dk = keys.k, dv = keys.v;
        }
        store_rows(dk, plan_.d_pad, p_.D, p_.scale, static_cast<E*>(bp_.dk), bp_.dk_stride, b, kvh, j0[g], bc[g]);
        store_rows(dv, plan_.dv_pad, p_.Dv, 1.0f, static_cast<E*>(bp_.dv), bp_.dv_stride, b, kvh, j0[g], bc[g]);
      }
    }
  }

  // Pass 3 for query head bh: dq = the splits' partial sums added in split order, times scale.
  void reduce_dq(int64_t bh, float* workspace) const {
    const int64_t b = bh / p_.Hq, h = bh % p_.Hq;
    float* sum = workspace;
    for (int64_t i = 0; i < p_.Sq; ++i) {
      std::memset(sum, 0, sizeof(float) * plan_.d_pad);
      for (int64_t s = 0; s < plan_.splits; ++s) {
        if (i < plan_.first_row(p_, s)) continue;  // never written
        const float* part = dq_row(s, b, h, i);
        for (int64_t d = 0; d < plan_.d_pad; d += kLanes) vstore(sum + d, vload(sum + d) + vload(part + d));
      }
      E* dst = static_cast<E*>(bp_.dq) + b * bp_.dq_stride[0] + h * bp_.dq_stride[1] + i * bp_.dq_stride[2];
      store_row<T>(sum, p_.scale, p_.D, dst, bp_.dq_stride[3]);
    }
  }

 private:
  PreparedHead head(int64_t b, int64_t h) const {
    return PreparedHead(prepared_ + (b * p_.Hq + h) * plan_.prepared_floats, plan_, bp_, b, h);
  }

  // Row i of split s's partial dQ (d_pad floats) for batch b, query head h: split s holds
  // rows first_row(s) .. Sq-1 of each head.
  float* dq_row(int64_t s, int64_t b, int64_t h, int64_t i) const {
    const int64_t first = plan_.first_row(p_, s);
    return dq_partial_ + plan_.dq_offset[s] + ((b * p_.Hq + h) * (p_.Sq - first) + i - first) * plan_.d_pad;
  }

  // The keys of a block of bc that the products read: its first key_width(bc), whole vectors
  // (they stop at the last key a row sees, rounded up to a vector). A short block (a short
  // sequence of a varlen batch) packs and zeroes only those, not all kKeyBlock.
  static int64_t key_width(int64_t bc) { return round_up(bc, kLanes); }

  // K and V rows j0 .. j0+bc-1 as fp32 rows, zero-padded to key_width(bc) rows, and
  // transposed (bf16 pairs of both, and K's rows in key pairs, where pairs are used).
  void pack_kv(int64_t b, int64_t kvh, int64_t j0, int64_t bc, const PackedKeys& keys) const {
    const E* k = static_cast<const E*>(p_.k) + b * p_.k_stride[0] + kvh * p_.k_stride[1];
    const E* v = static_cast<const E*>(p_.v) + b * p_.v_stride[0] + kvh * p_.v_stride[1];
    const int64_t width = key_width(bc);
    pack_rows(k + j0 * p_.k_stride[2], p_.k_stride[2], p_.k_stride[3], bc, width, p_.D, plan_.d_pad, keys.k);
    pack_rows(v + j0 * p_.v_stride[2], p_.v_stride[2], p_.v_stride[3], bc, width, p_.Dv, plan_.dv_pad, keys.v);
    transpose_matrix(keys.k, plan_.d_pad, width, plan_.d_pad, keys.kt, kKeyBlock);
    transpose_matrix(keys.v, plan_.dv_pad, width, plan_.dv_pad, keys.vt, kKeyBlock);
    if (plan_.pairs) {  // exact: the values are bf16 already
      pair_rows_bf16(keys.kt, p_.D, kKeyBlock, keys.kt_pairs, width);
      pair_rows_bf16(keys.vt, p_.Dv, kKeyBlock, keys.vt_pairs, width);
      pair_rows_bf16(keys.k, width, plan_.d_pad, keys.k_rows);
    }
  }

  // dK and dV of a block of bc keys zero where the products add to them: the first
  // key_width(bc) rows (with tiles, columns of dKᵀ and dVᵀ).
  void zero_grads(const PackedKeys& keys, int64_t bc) const {
    const int64_t width = key_width(bc);
    if (!plan_.tiles) {
      std::memset(keys.dk, 0, sizeof(float) * width * plan_.d_pad);
      std::memset(keys.dv, 0, sizeof(float) * width * plan_.dv_pad);
      return;
    }
    for (int64_t d = 0; d < plan_.d_pad; ++d) std::memset(keys.dk + d * kKeyBlock, 0, sizeof(float) * width);
    for (int64_t d = 0; d < plan_.dv_pad; ++d) std::memset(keys.dv + d * kKeyBlock, 0, sizeof(float) * width);
  }

  // n bf16 rows as pairs along the row, (n_cols + 1) / 2 per row: the bits as stored where
  // the row is contiguous and even, else element by element (an odd last column pairs with 0).
  static void pair_rows(const E* src, int64_t row_stride, int64_t col_stride, int64_t n, int64_t n_cols,
                        uint32_t* dst) {
    const int64_t pairs = (n_cols + 1) / 2;
    for (int64_t r = 0; r < n; ++r) {
      const E* row = src + r * row_stride;
      uint32_t* out = dst + r * pairs;
      if (col_stride == 1 && n_cols % 2 == 0) {
        std::memcpy(out, row, sizeof(uint32_t) * pairs);
        continue;
      }
      for (int64_t c = 0; c < pairs; ++c) {
        const uint32_t lo = row[2 * c * col_stride];
        const uint32_t hi = 2 * c + 1 < n_cols ? row[(2 * c + 1) * col_stride] : 0u;
        out[c] = lo | hi << 16;
      }
    }
  }

  // Asks for the row kRowsAhead rows after `row` (of unit element stride): the passes read
  // the rows of Q, dO, O, K and V once each, in order, and a short sequence's lie in no cache.
  static void read_ahead(const E* row, int64_t row_stride, int64_t col_stride, int64_t cols) {
    if (col_stride == 1) prefetch_bytes(row, kRowsAhead * row_stride * int64_t{sizeof(E)}, cols * int64_t{sizeof(E)});
  }
  static constexpr int64_t kRowsAhead = 8;

  // n rows (row_stride apart, elements col_stride apart) of `cols` elements into dst
  // [rows][ld], zero beyond: rows n .. rows-1 and columns cols .. ld-1.
  static void pack_rows(const E* src, int64_t row_stride, int64_t col_stride, int64_t n, int64_t rows,
                        int64_t cols, int64_t ld, float* dst) {
    for (int64_t r = 0; r < n; ++r) {
      if (r + kRowsAhead < n) read_ahead(src + r * row_stride, row_stride, col_stride, cols);
      load_row<T>(src + r * row_stride, col_stride, cols, 1.0f, dst + r * ld);
      std::memset(dst + r * ld + cols, 0, sizeof(float) * (ld - cols));
    }
    if (rows > n) std::memset(dst + n * ld, 0, sizeof(float) * (rows - n) * ld);
  }

  // Accumulated fp32 rows [n][ld] times scale stored to rows j0 .. j0+n-1 of a dK or dV gradient.
  void store_rows(const float* src, int64_t ld, int64_t cols, float scale, E* dst, const int64_t* stride,
                  int64_t b, int64_t kvh, int64_t j0, int64_t n) const {
    E* base = dst + b * stride[0] + kvh * stride[1];
    for (int64_t j = 0; j < n; ++j) {
      store_row<T>(src + j * ld, scale, cols, base + (j0 + j) * stride[2], stride[3]);
    }
  }

  // E = exp(S - lse) for the block's rows and its first nk keys (a multiple of kLanes), S =
  // Q·Kᵀ·scale with the modifiers and masks: 0 where masked, past the block, or in rows that
  // saw no key (lse = -inf; their output was 0). With the soft-cap, sr.t keeps tanh(s / cap)
  // for its derivative.
  void scores(int64_t b, int64_t h, const PreparedHead& ph, int64_t i0, int64_t r_begin, int64_t r_end, int64_t j0,
              int64_t bc, int64_t nk, const ScoreRows& sr) const {
    const float softcap = p_.softcap;
    const float slope = p_.alibi_slopes ? p_.alibi_slopes[b * p_.alibi_stride[0] + h * p_.alibi_stride[1]] : 0.0f;
    const vfloat scale = vbroadcast(p_.scale), cap = vbroadcast(softcap), inv_cap = vbroadcast(1.0f / softcap);
    vfloat lane{};
    for (int l = 0; l < kLanes; ++l) lane[l] = static_cast<float>(l);
    for (int64_t r = r_begin; r < r_end; ++r) {
      float* s = sr.e + (r - r_begin) * kKeyBlock;
      float* t = sr.t + (r - r_begin) * kKeyBlock;
      const int64_t i = i0 + r, a = i + p_.causal_offset;  // the aligned query position
      const float lse = ph.lse[i];
      if (lse == -INFINITY) {
        std::memset(s, 0, sizeof(float) * nk);
        if (softcap != 0.0f) std::memset(t, 0, sizeof(float) * nk);
        continue;
      }
      const auto [lo, hi] = visible_keys(a, j0, bc);
      if (softcap == 0.0f && !p_.alibi_slopes && !p_.mask) {  // one pass
        const vfloat scale_log2e = vbroadcast(p_.scale * kLog2e), neg_lse_log2e = vbroadcast(lse * -kLog2e);
        for (int64_t jj = 0; jj < nk; jj += kLanes) {
          const vfloat key = lane + static_cast<float>(jj);
          vstore(s + jj, visible_exp(vload(s + jj), scale_log2e, neg_lse_log2e, key, lo, hi));
        }
        continue;
      }
      const vfloat vlse = vbroadcast(lse), dist0 = vbroadcast(static_cast<float>(a - j0)) - lane;
      for (int64_t jj = 0; jj < nk; jj += kLanes) {
        vfloat x = vload(s + jj) * scale;
        if (softcap != 0.0f) {
          x = vsoftcap(x, cap, inv_cap);
          vstore(t + jj, x * inv_cap);
        }
        if (p_.alibi_slopes) {  // -slope·|a - j| (a - j exact in float below 2^24)
          x -= slope * (vfloat)((vint)(dist0 - static_cast<float>(jj)) & 0x7FFFFFFF);
        }
        vstore(s + jj, x);
      }
      if (p_.mask) {
        const int64_t off = b * p_.mask_stride[0] + h * p_.mask_stride[1] + i * p_.mask_stride[2];
        for (int64_t jj = lo; jj < hi; ++jj) s[jj] += load_mask(p_.mask_dtype, p_.mask, off + (j0 + jj) * p_.mask_stride[3]);
      }
      for (int64_t jj = 0; jj < lo; ++jj) s[jj] = -INFINITY;
      for (int64_t jj = hi; jj < nk; ++jj) s[jj] = -INFINITY;
      for (int64_t jj = 0; jj < nk; jj += kLanes) vstore(s + jj, vexp2((vload(s + jj) - vlse) * kLog2e));
    }
  }

  // Keys j0 + [lo, hi) of the block of bc keys that pass the causal limit and the window for
  // the aligned query position a.
  std::pair<int64_t, int64_t> visible_keys(int64_t a, int64_t j0, int64_t bc) const {
    int64_t lo = 0, hi = bc;
    if (p_.causal) hi = std::min(hi, a - j0 + 1);
    if (p_.window_right >= 0) hi = std::min(hi, a + p_.window_right - j0 + 1);
    if (p_.window_left >= 0) lo = std::max(lo, a - p_.window_left - j0);
    hi = std::max<int64_t>(hi, 0), lo = std::min(lo, hi);
    return {lo, hi};
  }

  // P = dS = 0 in the gradient products' operands for the rows r0 .. r1-1 (r0 even) at the
  // keys k0 .. k1-1, which none of them sees (S and dP were not computed there).
  void zero_hidden_keys(int64_t r0, int64_t r1, int64_t k0, int64_t k1, const BackwardWorkspace& w) const {
    if (k0 >= k1) return;
    auto clear = [&](auto* rows, int64_t n) {
      for (int64_t r = 0; r < n; ++r) std::memset(rows + r * kKeyBlock + k0, 0, sizeof(*rows) * (k1 - k0));
    };
    if (plan_.pairs) {
      clear(w.p_rows + r0 / 2 * kKeyBlock, (r1 - r0 + 1) / 2);
      clear(w.ds_rows + r0 / 2 * kKeyBlock, (r1 - r0 + 1) / 2);
      clear(w.ds_keys + r0 * kKeyBlock, r1 - r0);
    } else {
      clear((p_.dropout_p > 0.0f || p_.sinks ? w.pd : w.e) + r0 * kKeyBlock, r1 - r0);
      clear(w.ds + r0 * kKeyBlock, r1 - r0);
    }
  }

  // E = 2^(S·scale·log2e - lse·log2e) = e^(S·scale - lse) for the keys (block offsets `key`,
  // lanes) in [lo, hi); 0 elsewhere (also where S is NaN there: never read for them).
  static vfloat visible_exp(vfloat s, vfloat scale_log2e, vfloat neg_lse_log2e, vfloat key, int64_t lo,
                            int64_t hi) {
    const vint seen = key >= static_cast<float>(lo) && key < static_cast<float>(hi);
    return (vfloat)((vint)vexp2(s * scale_log2e + neg_lse_log2e) & seen);
  }

  // One query block (head h, rows i0 .. i0+nr-1) against one key block (keys j0 .. j0+bc-1):
  // dQ's partial rows added to, or with dq_first written.
  void block(int64_t b, int64_t h, const PreparedHead& ph, int64_t i0, int64_t nr, int64_t j0, int64_t bc,
             float* dq_part, bool dq_first, const PackedKeys& keys, const BackwardWorkspace& w) const {
    const int64_t dp = plan_.d_pad, dvp = plan_.dv_pad, nr_pairs = (nr + 1) / 2;
    // Keys past the last one any of these rows sees (the causal limit, the right window) have
    // P = dS = 0: the products stop at the first nk keys (nk_pad for S and dP, whole vectors).
    const int64_t nk = visible_keys(i0 + nr - 1 + p_.causal_offset, j0, bc).second;
    if (nk == 0) {
      if (dq_first) std::memset(dq_part, 0, sizeof(float) * nr * dp);
      return;
    }
    const int64_t nk_pad = round_up(nk, kLanes);
    const bool dropout = p_.dropout_p > 0.0f;
    const bool plain = !dropout && !p_.sinks && p_.softcap == 0.0f && !p_.alibi_slopes && !p_.mask;
    // S, dP, P and dS kScoreRows rows at a time, so that the products' S and dP are still in
    // L1 when the vector code reads them.
    for (int64_t r0 = 0; r0 < nr; r0 += kScoreRows) {
      const int64_t r1 = std::min(nr, r0 + kScoreRows);
      // S = Q·Kᵀ and dP = dO·Vᵀ for the keys these rows see (whole vectors)
      const int64_t nk_rows = round_up(visible_keys(i0 + r1 - 1 + p_.causal_offset, j0, bc).second, kLanes);
      const int64_t at = plan_.pairs ? 0 : r0 * kKeyBlock;
      const ScoreRows sr{w.e + at, w.ds + at, w.pd + at, w.t + at};
      float* s = sr.e;
      float* dprob = sr.ds;
      if (plan_.pairs) {
        gemm_pairs<kWideRows, kWideVecs>(r1 - r0, nk_rows, plan_.d_pairs, ph.q_pairs + (i0 + r0) * ph.q_ld, ph.q_ld,
                                         1, keys.kt_pairs, kKeyBlock, s, kKeyBlock, false);
        gemm_pairs<kWideRows, kWideVecs>(r1 - r0, nk_rows, plan_.dv_pairs, ph.dout_pairs + (i0 + r0) * ph.dout_ld,
                                         ph.dout_ld, 1, keys.vt_pairs, kKeyBlock, dprob, kKeyBlock, false);
      } else {
        gemm<kWideRows, kWideVecs>(r1 - r0, nk_rows, p_.D, ph.q + (i0 + r0) * ph.q_ld, ph.q_ld, 1, keys.kt, kKeyBlock,
                                   s, kKeyBlock, false);
        gemm<kWideRows, kWideVecs>(r1 - r0, nk_rows, p_.Dv, ph.dout + (i0 + r0) * ph.dout_ld, ph.dout_ld, 1, keys.vt,
                                   kKeyBlock, dprob, kKeyBlock, false);
      }
      if (plain) {
        p_and_ds_plain(ph, i0, r0, r1, j0, bc, nk_rows, sr, w);
      } else {
        scores(b, h, ph, i0, r0, r1, j0, bc, nk_rows, sr);
        if (dropout) apply_dropout(b, h, i0, r0, r1, j0, nk_rows, sr);
        p_and_ds(ph, i0, r0, r1, nk_rows, sr, w);
      }
      zero_hidden_keys(r0, r1, nk_rows, nk_pad, w);
    }

    // dV += Pᵀ·dO (with tiles dVᵀ += dOᵀ·P), dK += dSᵀ·Q (dKᵀ += Qᵀ·dS) and dQ += dS·K (the
    // last two times scale when stored). Off AMX, each register tile sums only over the rows
    // that see its keys (dV, dK) or the keys its rows see (dQ): the causal triangle's zeros
    // are skipped.
    auto rows = [&](int64_t k0, int64_t k1) {  // of this block, those that see keys j0 + [k0, k1)
      const auto [first, end] = plan_.rows_of(p_, j0 + k0, k1 - k0);
      return std::pair{first - i0, end - i0};
    };
    auto keys_seen = [&](int64_t r0, int64_t r1) {
      const int64_t a0 = i0 + r0 + p_.causal_offset, a1 = i0 + r1 - 1 + p_.causal_offset;
      return std::pair{visible_keys(a0, j0, bc).first, visible_keys(a1, j0, bc).second};
    };
    if (!plan_.pairs) {
      const float* p = (dropout || p_.sinks) ? w.pd : w.e;
      gemm<kTallRows, kTallVecs>(nk, dvp, nr, p, 1, kKeyBlock, ph.dout + i0 * ph.dout_ld, ph.dout_ld, keys.dv, dvp,
                                 true, rows);
      gemm<kTallRows, kTallVecs>(nk, dp, nr, w.ds, 1, kKeyBlock, ph.q + i0 * ph.q_ld, ph.q_ld, keys.dk, dp, true, rows);
      gemm<kTallRows, kTallVecs>(nr, dp, nk, w.ds, kKeyBlock, 1, keys.k, dp, dq_part, dp, !dq_first, keys_seen);
      return;
    }
    auto row_pairs = [&](int64_t k0, int64_t k1) {
      const auto [first, end] = rows(k0, k1);
      return std::pair{first / 2, (end + 1) / 2};
    };
    auto key_pairs = [&](int64_t r0, int64_t r1) {
      const auto [lo, hi] = keys_seen(r0, r1);
      return std::pair{lo / 2, (hi + 1) / 2};
    };
    if (plan_.tiles) {
#if defined(ATTNKIT_ISA_avx512amx)
      transposed_grads_on_tiles(ph, i0, nr_pairs, nk_pad, keys, w, row_pairs);
#endif
    } else {
      gemm_pairs<kTallRows, kTallVecs>(nk, dvp, nr_pairs, w.p_rows, 1, kKeyBlock, ph.dout_row_pairs + i0 / 2 * dvp,
                                       dvp, keys.dv, dvp, true, row_pairs);
      gemm_pairs<kTallRows, kTallVecs>(nk, dp, nr_pairs, w.ds_rows, 1, kKeyBlock, ph.q_row_pairs + i0 / 2 * dp, dp,
                                       keys.dk, dp, true, row_pairs);
    }
    gemm_pairs<kTallRows, kTallVecs>(nr, dp, (nk + 1) / 2, reinterpret_cast<const uint32_t*>(w.ds_keys), kKeyBlock / 2,
                                     1, keys.k_rows, dp, dq_part, dp, !dq_first, key_pairs);
  }

#if defined(ATTNKIT_ISA_avx512amx)
  // dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS on AMX tiles for the row block at i0 (a slab's start): P and
  // dS are B operands as p_and_ds wrote them (query-row pairs along the keys), dOᵀ and Qᵀ A
  // operands in their slabs, so nothing is transposed per block. The row pairs up to whole
  // tiles are zeroed in P and dS, as are the keys nk .. nk_pad (masked). Each block of keys
  // sums over the row pairs that see them (row_pairs), in whole tiles.
  template <class RowPairs>
  void transposed_grads_on_tiles(const PreparedHead& ph, int64_t i0, int64_t nr_pairs, int64_t nk_pad,
                                 const PackedKeys& keys, const BackwardWorkspace& w, RowPairs row_pairs) const {
    const int64_t dp = plan_.d_pad, dvp = plan_.dv_pad;
    const int64_t k_pairs = round_up(nr_pairs, kAmxTile), slab = i0 / (2 * kSlabPairs);
    std::memset(w.p_rows + nr_pairs * kKeyBlock, 0, sizeof(uint32_t) * (k_pairs - nr_pairs) * kKeyBlock);
    std::memset(w.ds_rows + nr_pairs * kKeyBlock, 0, sizeof(uint32_t) * (k_pairs - nr_pairs) * kKeyBlock);
    gemm_amx_bf16(dvp, nk_pad, k_pairs, ph.dout_row_pairs + slab * kSlabPairs * dvp, kSlabPairs, w.p_rows, kKeyBlock,
                  keys.dv, kKeyBlock, true, kSlabPairs * dvp, NoBand{}, row_pairs);
    gemm_amx_bf16(dp, nk_pad, k_pairs, ph.q_row_pairs + slab * kSlabPairs * dp, kSlabPairs, w.ds_rows, kKeyBlock, keys.dk,
                  kKeyBlock, true, kSlabPairs * dp, NoBand{}, row_pairs);
  }
#endif

  // P = f·E, dS = E∘(f·dP - c) (dropout: P and dP times keep/(1-p)), times the soft-cap's
  // derivative 1 - tanh², for the block's rows r_begin .. r_end-1 (r_begin even), by pairs of
  // rows. With bf16 pairs they go straight to the three products' operands: P and dS in
  // query-row pairs (dV, dK), dS in bf16 rows (dQ, key pairs along them); else dS (and, with
  // sinks, f·P) as fp32 rows.
  void p_and_ds(const PreparedHead& ph, int64_t i0, int64_t r_begin, int64_t r_end, int64_t nk_pad,
                const ScoreRows& sr, const BackwardWorkspace& w) const {
    const bool dropout = p_.dropout_p > 0.0f, sinks = p_.sinks != nullptr, softcap = p_.softcap != 0.0f;
    const vfloat one = vbroadcast(1.0f);
    for (int64_t r = r_begin; r < r_end; r += 2) {
      const int rows = r_end - r > 1 ? 2 : 1;
      vfloat c[2], f[2];
      for (int k = 0; k < rows; ++k) c[k] = vbroadcast(ph.c[i0 + r + k]), f[k] = vbroadcast(ph.f[i0 + r + k]);
      for (int64_t jj = 0; jj < nk_pad; jj += kLanes) {
        vfloat pv[2] = {}, dsv[2] = {};
        for (int k = 0; k < rows; ++k) {
          const int64_t at = (r - r_begin + k) * kKeyBlock + jj;
          const vfloat ev = vload(sr.e + at);
          dsv[k] = ev * (f[k] * vload(sr.ds + at) - c[k]);
          if (softcap) {
            const vfloat tv = vload(sr.t + at);
            dsv[k] *= one - tv * tv;
          }
          pv[k] = dropout ? vload(sr.pd + at) : ev;
          if (sinks) pv[k] *= f[k];
          if (!plan_.pairs) {
            vstore(sr.ds + at, dsv[k]);
            if (sinks) vstore(sr.pd + at, pv[k]);
          }
        }
        if (plan_.pairs) {
          const vuint p_pair = bf16_pairs(pv[0], pv[1]);
          uint16_t* ds_keys = w.ds_keys + r * kKeyBlock + jj;
          const vuint ds_pair = bf16_pairs_and_rows(dsv[0], dsv[1], ds_keys, rows == 2 ? ds_keys + kKeyBlock : nullptr);
          std::memcpy(w.p_rows + r / 2 * kKeyBlock + jj, &p_pair, sizeof p_pair);
          std::memcpy(w.ds_rows + r / 2 * kKeyBlock + jj, &ds_pair, sizeof ds_pair);
        }
      }
    }
  }

  // scores and p_and_ds in one pass without modifiers, mask, dropout or sinks (f = 1): per
  // pair of rows, P = E and dS = E∘(dP - c) from S and dP, rounded into the three products'
  // operands as p_and_ds writes them on bf16 pairs, else over S and dP.
  void p_and_ds_plain(const PreparedHead& ph, int64_t i0, int64_t r_begin, int64_t r_end, int64_t j0, int64_t bc,
                      int64_t nk_pad, const ScoreRows& sr, const BackwardWorkspace& w) const {
    const vfloat scale_log2e = vbroadcast(p_.scale * kLog2e);
    vfloat lane{};
    for (int l = 0; l < kLanes; ++l) lane[l] = static_cast<float>(l);
    // kMasked: some of the keys 0 .. nk_pad-1 are hidden from a row (or all: lse = -inf);
    // rows that see them all skip the key mask (most blocks of a long causal call).
    auto rows = [&]<int kRows, bool kMasked>(int64_t r, const vfloat* c, const vfloat* neg_lse_log2e,
                                             const int64_t* lo, const int64_t* hi) {
      uint16_t* ds_keys = w.ds_keys + r * kKeyBlock;
      for (int64_t jj = 0; jj < nk_pad; jj += kLanes) {
        const vfloat key = lane + static_cast<float>(jj);
        vfloat e[2] = {}, ds[2] = {};
        for (int k = 0; k < kRows; ++k) {
          const int64_t at = (r - r_begin + k) * kKeyBlock + jj;
          const vfloat s = vload(sr.e + at);
          e[k] = kMasked ? visible_exp(s, scale_log2e, neg_lse_log2e[k], key, lo[k], hi[k])
                         : vexp2(s * scale_log2e + neg_lse_log2e[k]);
          ds[k] = e[k] * (vload(sr.ds + at) - c[k]);
        }
        if (!plan_.pairs) {  // over S and dP
          for (int k = 0; k < kRows; ++k) {
            const int64_t at = (r - r_begin + k) * kKeyBlock + jj;
            vstore(sr.e + at, e[k]), vstore(sr.ds + at, ds[k]);
          }
          continue;
        }
        const vuint p_pair = bf16_pairs(e[0], e[1]);
        const vuint ds_pair =
            bf16_pairs_and_rows(ds[0], ds[1], ds_keys + jj, kRows == 2 ? ds_keys + kKeyBlock + jj : nullptr);
        std::memcpy(w.p_rows + r / 2 * kKeyBlock + jj, &p_pair, sizeof p_pair);
        std::memcpy(w.ds_rows + r / 2 * kKeyBlock + jj, &ds_pair, sizeof ds_pair);
      }
    };
    for (int64_t r = r_begin; r < r_end; r += 2) {
      const int n = r_end - r > 1 ? 2 : 1;
      vfloat c[2], neg_lse_log2e[2];
      int64_t lo[2] = {}, hi[2] = {};
      bool masked = false;
      for (int k = 0; k < n; ++k) {
        const int64_t i = i0 + r + k;
        c[k] = vbroadcast(ph.c[i]), neg_lse_log2e[k] = vbroadcast(ph.lse[i] * -kLog2e);
        if (ph.lse[i] != -INFINITY) std::tie(lo[k], hi[k]) = visible_keys(i + p_.causal_offset, j0, bc);
        masked = masked || lo[k] > 0 || hi[k] < nk_pad;
      }
      if (n == 1) rows.template operator()<1, true>(r, c, neg_lse_log2e, lo, hi);
      else if (masked) rows.template operator()<2, true>(r, c, neg_lse_log2e, lo, hi);
      else rows.template operator()<2, false>(r, c, neg_lse_log2e, lo, hi);
    }
  }

  // The forward's keep mask (one Philox draw per 4 keys of row (b, h, i)) on the first nk
  // keys: sr.pd = E·keep/(1-p) and dP·keep/(1-p) in place.
  void apply_dropout(int64_t b, int64_t h, int64_t i0, int64_t r_begin, int64_t r_end, int64_t j0, int64_t nk,
                     const ScoreRows& sr) const {
    const uint32_t threshold = detail::dropout_threshold(p_.dropout_p);
    const float keep_scale = 1.0f / (1.0f - p_.dropout_p);
    for (int64_t r = r_begin; r < r_end; ++r) {
      for (int64_t jj = 0; jj < nk; jj += 4) {
        const auto bits = detail::dropout_bits(p_.seed, b, h, i0 + r, j0 + jj);
        for (int64_t k = 0; k < 4; ++k) {
          const int64_t at = (r - r_begin) * kKeyBlock + jj + k;
          const bool keep = bits[k] >= threshold;
          sr.pd[at] = keep ? sr.e[at] * keep_scale : 0.0f;
          sr.ds[at] = keep ? sr.ds[at] * keep_scale : 0.0f;
        }
      }
    }
  }

  const AttentionBackwardParams& bp_;
  const AttentionParams& p_;
  const BackwardPlan& plan_;
  float* prepared_;       // [B][Hq][prepared_floats]
  float* dq_partial_;     // per split s: [B][Hq][Sq - first_row(s)][d_pad]
  float* dsink_partial_;  // [B][Hq] or null
};

// One problem's three passes on `threads` threads (1 inside another parallel region: serially
// on the caller), `workspace` holding workspace_floats per thread.
template <DType T>
void run_problem(const AttentionBackwardParams& bp, const BackwardPlan& plan, float* workspace,
                 int64_t workspace_floats, int threads) {
  const AttentionParams& p = bp.fwd;
  detail::LargeScratch prepared_scratch(plan.prepared_floats * p.B * p.Hq * int64_t{sizeof(float)});
  detail::LargeScratch dq_scratch(plan.dq_offset[plan.splits] * int64_t{sizeof(float)});
  float* prepared = static_cast<float*>(prepared_scratch.data());
  float* dq_partial = static_cast<float*>(dq_scratch.data());
  AlignedBuffer<float> dsink_partial(bp.dsinks ? p.B * p.Hq : 0);
  const Backward<T> task(bp, plan, prepared, dq_partial, dsink_partial.data);
  auto prepare = [&](int64_t bh, int thread) { task.prepare(bh, workspace + workspace_floats * thread); };
  detail::parallel_for(p.B * p.Hq, threads, prepare);
  auto key_blocks = [&](int64_t t, int thread) { task.run(t, workspace + workspace_floats * thread); };
  detail::parallel_for(plan.tasks, threads, key_blocks);
  auto reduce = [&](int64_t bh, int thread) { task.reduce_dq(bh, workspace + workspace_floats * thread); };
  detail::parallel_for(p.B * p.Hq, threads, reduce);
  if (bp.dsinks) {  // the sink's gradient summed over the batch, in batch order
    for (int64_t h = 0; h < p.Hq; ++h) {
      float sum = 0.0f;
      for (int64_t b = 0; b < p.B; ++b) sum += dsink_partial.data[b * p.Hq + h];
      bp.dsinks[h * bp.dsinks_stride] = sum;
    }
  }
}

// Problems with less work than this (query rows × keys × query heads) are too small to share
// between threads, three parallel regions each for microseconds of work: where there are
// at least two per thread, they run whole, one per thread, side by side (the short sequences
// of a varlen batch). 2 threads, 256 sequences of 4 tokens: 0.35-0.72 of the time with
// three regions per sequence; 64 of 16 tokens: 0.58-0.90.
constexpr int64_t kSerialWork = 128 * 128 * 32;

template <DType T>
void run_backward(std::span<const AttentionBackwardParams> problems) {
  const int threads = detail::num_threads();
  std::vector<BackwardPlan> plans;
  plans.reserve(problems.size());
  int64_t workspace_floats = 0;
  for (const AttentionBackwardParams& bp : problems) {
    plans.emplace_back(bp, kDotProducts && T == DType::bfloat16);
    workspace_floats = std::max(workspace_floats, plans.back().workspace_floats);
  }
  AlignedBuffer<float> workspace(workspace_floats * threads);
  const int64_t n = static_cast<int64_t>(problems.size());
  auto work = [&](int64_t i) { return problems[i].fwd.B * problems[i].fwd.Hq * problems[i].fwd.Sq * problems[i].fwd.Skv; };
  auto is_small = [&](int64_t i) { return threads > 1 && work(i) < kSerialWork; };
  std::vector<int64_t> small;  // run side by side, the most work first
  for (int64_t i = 0; i < n; ++i) {
    if (is_small(i)) small.push_back(i);
  }
  if (static_cast<int64_t>(small.size()) < 2 * threads) small.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (small.empty() || !is_small(i)) run_problem<T>(problems[i], plans[i], workspace.data, workspace_floats, threads);
  }
  std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) { return work(a) > work(b); });
  auto run_small = [&](int64_t k, int thread) {
    run_problem<T>(problems[small[k]], plans[small[k]], workspace.data + workspace_floats * thread, workspace_floats, 1);
  };
  detail::parallel_for(static_cast<int64_t>(small.size()), threads, run_small);
}

}  // namespace

void attention_bwd(std::span<const AttentionBackwardParams> problems) {
  if (problems.empty()) return;
  switch (problems[0].fwd.dtype) {  // one dtype for all (the sequences of one call)
    case DType::float16: return run_backward<DType::float16>(problems);
    case DType::bfloat16: return run_backward<DType::bfloat16>(problems);
    default: return run_backward<DType::float32>(problems);
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
