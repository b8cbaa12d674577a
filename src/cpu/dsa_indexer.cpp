// DSA's lightning indexer and top-k on the CPU. Indexer logits: a task is a block of query
// rows (all their heads, rows·heads ~ 128 columns, 512 on AMX) and a chunk of keys; per tile
// of 64 keys Sᵀ = K · Qᵀ runs on the shared register tiles (vdpbf16ps on avx512bf16: e4m3
// values are exact in bf16, so products are exact and only fp32 summation order differs from
// exact) or on AMX tiles (avx512amx: S = Q · Kᵀ, or Sᵀ for one-row blocks), then each
// (key, row) reduces Σ_h w·ReLU(s) · k_scale. Top-k orders candidates by (value
// desc, index asc) packed into one 64-bit key, so selection is exact, deterministic and
// independent of how rows or keys were split; the fused indexer keeps a bounded candidate
// buffer per row (streaming) instead of a row of logits. Compiled per ISA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attnkit/dtype.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_amx.h"
#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/workspace.h"
#include "ops/dsa_params.h"

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

constexpr int64_t kKeyTile = 64;      // keys per Sᵀ tile
constexpr int64_t kKeyChunk = 8192;   // keys per task when logits are written (amortises packing Qᵀ)
constexpr int64_t kMaxD = 128;        // head dims 32, 64, 128 (the op's contract)
#if defined(ATTNKIT_ISA_avx512bf16)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif
#if defined(ATTNKIT_ISA_avx512amx)
constexpr bool kAmx = true;  // S or Sᵀ on AMX tiles (D in {32, 64, 128}: whole tiles of pairs)
#else
constexpr bool kAmx = false;
#endif
// rows · padded heads per task (Qᵀ columns): a register tile's width, or on AMX more, so that
// each key tile's conversion serves more rows (IL on the Xeon: 128 -> 512 columns, 107 -> 82 ms)
constexpr int64_t kBlockColumns = kAmx ? 512 : 128;

// --- top-k selection ------------------------------------------------------------------------

// Ascending keys = descending value, then ascending index (-0 and +0 are one value). -inf and
// NaN are never candidates.
inline uint64_t order_key(float v, uint32_t index) {
  if (v == 0.0f) v = 0.0f;
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // monotone in v
  return (uint64_t{~u} << 32) | index;
}
inline bool selectable(float v) { return v > -INFINITY; }  // false for -inf and NaN

constexpr int kDigitBits = 11;  // radix digits of the sort and the selection below
constexpr uint32_t kDigits = 1u << kDigitBits;

// Sorts keys by their bits from low_bit up, equal ones kept in their order: LSD radix, 11 bits
// a pass, where a comparison sort took a third of a top-k's time. low_bit 32 sorts by value
// alone (top-k's candidates come in index order, so ties stay index-ascending).
void radix_sort(std::vector<uint64_t>& keys, std::vector<uint64_t>& spare, int low_bit) {
  spare.resize(keys.size());
  for (int shift = low_bit; shift < 64; shift += kDigitBits) {
    std::vector<uint32_t> start(kDigits + 1, 0);
    for (const uint64_t key : keys) ++start[(key >> shift & (kDigits - 1)) + 1];
    if (*std::max_element(start.begin(), start.end()) == keys.size()) continue;  // one digit: in order
    for (uint32_t d = 1; d <= kDigits; ++d) start[d] += start[d - 1];
    for (const uint64_t key : keys) spare[start[key >> shift & (kDigits - 1)]++] = key;
    keys.swap(spare);
  }
}

// Moves the k smallest of the (distinct) keys to the front, in no order, and returns the k-th
// smallest (1 <= k <= size): 11-bit digits from the top, each splitting the keys that share
// the k-th's higher digits into those below, at and above its digit by a histogram and a
// branch-free scatter (std::nth_element's comparisons of random keys mispredict: it took
// ~10% of the fused indexer).
uint64_t select_smallest(std::vector<uint64_t>& keys, std::vector<uint64_t>& spare, int64_t k) {
  spare.resize(keys.size());
  int64_t lo = 0, hi = static_cast<int64_t>(keys.size());  // the keys sharing the k-th's digits so far
  for (int shift = 64 - kDigitBits; hi - lo > 1; shift = std::max(shift - kDigitBits, 0)) {
    uint32_t count[kDigits] = {};
    for (int64_t i = lo; i < hi; ++i) ++count[keys[i] >> shift & (kDigits - 1)];
    int64_t below = lo;
    uint32_t digit = 0;
    while (below + count[digit] < k) below += count[digit++];
    int64_t at[3] = {lo, below, below + count[digit]};
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t d = keys[i] >> shift & (kDigits - 1);
      spare[at[(d >= digit) + (d > digit)]++] = keys[i];
    }
    std::copy(spare.begin() + lo, spare.begin() + hi, keys.begin() + lo);
    lo = below, hi = below + count[digit];
    if (shift == 0) break;
  }
  return keys[k - 1];
}

// The k best of a stream of (value, index), indices ascending, with a buffer of 2k keys: when
// it fills, the k best are kept and the k-th becomes the bar a new candidate must pass.
class StreamingTopk {
 public:
  explicit StreamingTopk(int64_t k) : k_(k), bar_(UINT64_MAX) { keys_.reserve(std::min<int64_t>(2 * k, 4096)); }
  // Values v[0 .. n) with indices first, first + 1, ..., after every index pushed so far: those
  // past the bar's value (a later index loses a tie) are picked by lane masks, then pushed
  // (pushing every value cost the fused indexer more time than its logits).
  void push_run(const float* v, int64_t n, uint32_t first) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (uint32_t pass = lanes_greater(vload(v + i), vbroadcast(bar_value_)); pass != 0; pass &= pass - 1) {
        const int64_t j = i + __builtin_ctz(pass);
        push(v[j], first + static_cast<uint32_t>(j));
      }
    }
    for (; i < n; ++i) push(v[i], first + static_cast<uint32_t>(i));
  }
  // The selected indices, best first; returns how many (<= k).
  int64_t finish(uint32_t* out) {
    if (static_cast<int64_t>(keys_.size()) > k_) shrink();
    radix_sort(keys_, spare_, 0);
    for (size_t i = 0; i < keys_.size(); ++i) out[i] = static_cast<uint32_t>(keys_[i]);
    return static_cast<int64_t>(keys_.size());
  }

 private:
  void push(float v, uint32_t index) {
    if (!selectable(v)) return;
    const uint64_t key = order_key(v, index);
    if (key >= bar_) return;
    keys_.push_back(key);
    if (static_cast<int64_t>(keys_.size()) == 2 * k_) shrink();
  }
  void shrink() {
    bar_ = select_smallest(keys_, spare_, k_);
    bar_value_ = value_of(bar_);
    keys_.resize(k_);
  }
  // The value an order key was made from (+0 for either zero).
  static float value_of(uint64_t key) {
    const uint32_t u = ~static_cast<uint32_t>(key >> 32);
    const uint32_t bits = (u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  int64_t k_;
  uint64_t bar_;
  float bar_value_ = -INFINITY;  // every selectable value passes until the buffer first fills
  std::vector<uint64_t> keys_, spare_;
};

// --- indexer logits -------------------------------------------------------------------------

struct RowBlock {
  int64_t r0, nr;   // rows r0 .. r0+nr-1, all in one batch entry
  int64_t lo, hi;   // union of their key ranges
};

class Indexer {
 public:
  explicit Indexer(const IndexerParams& p) : p_(p) {
    hpad_ = round_up(p.h, kLanes);
    const int64_t rows_per_block = std::max<int64_t>(1, kBlockColumns / hpad_);
    d_pairs_ = (p.d + 1) / 2;
    for (int64_t b0 = 0; b0 < p.rows; b0 += p.rows_per_batch) {
      for (int64_t r0 = b0; r0 < b0 + p.rows_per_batch; r0 += rows_per_block) {
        RowBlock blk{r0, std::min(rows_per_block, b0 + p.rows_per_batch - r0), INT64_MAX, 0};
        for (int64_t r = r0; r < r0 + blk.nr; ++r) {
          int64_t lo, hi;
          range(r, lo, hi);
          if (lo < hi) blk.lo = std::min(blk.lo, lo), blk.hi = std::max(blk.hi, hi);
        }
        if (blk.lo >= blk.hi) blk.lo = blk.hi = 0;
        blocks_.push_back(blk);
      }
    }
    cols_ = rows_per_block * hpad_;
    workspace_floats_ = cols_ * (kBf16Dot ? d_pairs_ : p.d)      // Q (pack_q)
                        + cols_                                  // weights by column
                        + kKeyTile * std::max(cols_, 2 * hpad_)  // Sᵀ, or on AMX two rows' S
                        + kKeyTile * (kBf16Dot ? d_pairs_ : p.d)  // the key tile
                        + kKeyTile                               // its scales
                        + kKeyTile * rows_per_block              // its logits by block row
                        + (kAmx ? d_pairs_ * kKeyTile : 0);      // the key tile's pairs (S = Q · Kᵀ)
  }

  // Row r's first key as given (ks, unclipped): compressed columns and fused top-k offsets
  // count from it.
  int64_t origin(int64_t r) const { return p_.lo ? p_.lo[r * p_.lo_stride] : 0; }

  // The valid keys [lo, hi) of row r.
  void range(int64_t r, int64_t& lo, int64_t& hi) const {
    const int64_t b = r / p_.rows_per_batch, i = r % p_.rows_per_batch;
    lo = origin(r);
    hi = p_.hi[b * p_.hi_stride[0] + i * p_.hi_stride[1]];
    if (!p_.cache) lo = std::max<int64_t>(lo, 0), hi = std::min(hi, p_.num_keys);
  }

  void run() const {
    const int threads = detail::num_threads();
    AlignedBuffer<float> workspace(workspace_floats_ * threads);
    if (!p_.logits) {  // fused top-k: one task per block, the whole span
      auto body = [&](int64_t t, int thread) { fused_task(blocks_[t], workspace.data + workspace_floats_ * thread); };
      detail::parallel_for(static_cast<int64_t>(blocks_.size()), threads, body);
      return;
    }
    std::vector<std::pair<int64_t, int64_t>> tasks;  // (block, first key)
    for (size_t b = 0; b < blocks_.size(); ++b) {
      int64_t k0 = blocks_[b].lo;
      do tasks.emplace_back(b, k0); while ((k0 += kKeyChunk) < blocks_[b].hi);
    }
    auto body = [&](int64_t t, int thread) {
      logits_task(blocks_[tasks[t].first], tasks[t].second, workspace.data + workspace_floats_ * thread);
    };
    detail::parallel_for(static_cast<int64_t>(tasks.size()), threads, body);
  }

 private:
  struct Scratch {
    float *qt, *wcol, *st, *kt, *kscale;  // Q (as pack_q lays it out), weights, S, the key tile, its scales
    float* sums;                          // the key tile's logits by block row [rows][kKeyTile]
    uint32_t* k_pairs;                    // AMX, S = Q · Kᵀ: the key tile's pairs [d_pairs][kKeyTile]
  };
  Scratch carve(float* w) const {
    Scratch s;
    s.qt = w;
    s.wcol = s.qt + cols_ * (kBf16Dot ? d_pairs_ : p_.d);
    s.st = s.wcol + cols_;
    s.kt = s.st + kKeyTile * std::max(cols_, 2 * hpad_);
    s.kscale = s.kt + kKeyTile * (kBf16Dot ? d_pairs_ : p_.d);
    s.sums = s.kscale + kKeyTile;
    s.k_pairs = reinterpret_cast<uint32_t*>(s.sums + kKeyTile * (cols_ / hpad_));
    return s;
  }

  // The block's Q by column c = row · hpad + head (pad columns zero) as its product reads it
  // (AMX: one row's Qᵀ in bf16 pairs [d_pairs][hpad] (Sᵀ = K · Qᵀ), or rows of pairs
  // [cols][d_pairs] (S = Q · Kᵀ); vdpbf16ps: Qᵀ in pairs [d_pairs][cols]; else Qᵀ [d][cols]),
  // and the weights by column.
  void pack_q(const RowBlock& blk, const Scratch& s) const {
    const Fp8ToBf16<DType::float8_e4m3fn> to_bf16;
    uint32_t* q_pairs = reinterpret_cast<uint32_t*>(s.qt);
    std::memset(q_pairs, 0, sizeof(float) * cols_ * (kBf16Dot ? d_pairs_ : p_.d));
    std::memset(s.wcol, 0, sizeof(float) * cols_);
    for (int64_t t = 0; t < blk.nr; ++t) {
      const int64_t r = blk.r0 + t;
      const uint8_t* qr = p_.q + r / p_.rows_per_batch * p_.q_stride[0] + r % p_.rows_per_batch * p_.q_stride[1];
      for (int64_t h = 0; h < p_.h; ++h) {
        const int64_t c = t * hpad_ + h;
        s.wcol[c] = p_.weights[r * p_.weights_stride[0] + h * p_.weights_stride[1]];
        const uint8_t* qh = qr + h * p_.q_stride[2];
        if (kAmx && !keys_as_rows()) {  // an odd D's pad half stays zero
          to_bf16.row(qh, p_.q_stride[3], p_.d, reinterpret_cast<uint16_t*>(q_pairs + c * d_pairs_));
        } else if constexpr (kBf16Dot) {
          uint32_t pairs[kMaxD / 2] = {};
          to_bf16.row(qh, p_.q_stride[3], p_.d, reinterpret_cast<uint16_t*>(pairs));
          const int64_t ld = kAmx ? hpad_ : cols_;
          for (int64_t dp = 0; dp < d_pairs_; ++dp) q_pairs[dp * ld + c] = pairs[dp];
        } else {
          float row[kMaxD];
          load_row<DType::float8_e4m3fn>(qh, p_.q_stride[3], p_.d, 1.0f, row);
          for (int64_t d = 0; d < p_.d; ++d) s.qt[d * cols_ + c] = row[d];
        }
      }
    }
#if defined(ATTNKIT_ISA_avx512amx)
    amx_configure();  // once per task, before its first tile
#endif
  }

  // On AMX, calls with one query row per batch entry (decode with next_n = 1) compute Sᵀ =
  // K · Qᵀ: K's bf16 rows as loaded are the A operand, and the head sums come out across lanes
  // (lane_sums); blocks of more rows compute S = Q · Kᵀ, the key tile transposed into pairs
  // once for all of them (IP, one row: Sᵀ 15.9 -> 11.0 ms with the keys in cache; IL, 8 rows:
  // Sᵀ ~10% slower). Decided per call, not per block, so that a call's rows all sum in one order.
  bool keys_as_rows() const { return kAmx && p_.rows_per_batch == 1; }

  // Up to n keys from key j whose rows lie one after another (d bytes apart, elements
  // adjacent): the rest of j's page in a paged cache, all n in a contiguous flat K, else one;
  // returns the first row.
  const uint8_t* key_run(int64_t b, int64_t j, int64_t n, int64_t& run) const {
    if (!p_.cache) {
      const bool rows_adjacent = p_.k_row_stride == p_.d && p_.k_col_stride == 1;
      run = rows_adjacent ? n : 1;
      return p_.k + j * p_.k_row_stride;
    }
    const int32_t block = p_.block_table[b * p_.block_table_stride[0] + j / p_.page * p_.block_table_stride[1]];
    run = std::min(n, p_.page - j % p_.page);
    return p_.cache + block * p_.block_stride + j % p_.page * p_.d;
  }
  // The scales of the run of keys from j whose first row is at row.
  void run_scales(const uint8_t* row, int64_t j, int64_t run, float* scales) const {
    if (!p_.cache) {
      for (int64_t i = 0; i < run; ++i) scales[i] = p_.k_scale[(j + i) * p_.k_scale_stride];
      return;
    }
    const int64_t in_page = j % p_.page;  // the page's scales follow its page·d values
    std::memcpy(scales, row + (p_.page - in_page) * p_.d + in_page * 4, sizeof(float) * run);
  }

  // Keys [k0, k0 + n) into the key tile (bf16 rows, converted exactly by table lookups: from
  // fp32 they took a fifth of the paged indexer's time; or fp32 rows) and their scales, a run
  // of adjacent rows at a time (per key, the page lookup and the call took ~10% of IP).
  void load_keys(int64_t b, int64_t k0, int64_t n, const Scratch& s) const {
    const Fp8ToBf16<DType::float8_e4m3fn> to_bf16;
    const int64_t col_stride = p_.cache ? 1 : p_.k_col_stride;
    for (int64_t j = 0, run; j < n; j += run) {
      const uint8_t* src = key_run(b, k0 + j, n - j, run);
      if (kBf16Dot && p_.d % 2 == 0 && col_stride == 1) {  // the tile's rows are adjacent too
        to_bf16.row(src, 1, run * p_.d, reinterpret_cast<uint16_t*>(s.kt) + j * p_.d);
      } else {
        for (int64_t i = 0; i < run; ++i) load_key(to_bf16, src + i * p_.d, col_stride, j + i, s);
      }
      run_scales(src, k0 + j, run, s.kscale + j);  // after the values (read first: ~4% slower on IP)
    }
  }
  void load_key(const Fp8ToBf16<DType::float8_e4m3fn>& to_bf16, const uint8_t* src, int64_t col_stride, int64_t j,
                const Scratch& s) const {
    if constexpr (kBf16Dot) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(s.kt) + j * 2 * d_pairs_;
      to_bf16.row(src, col_stride, p_.d, dst);
      if (p_.d % 2) dst[p_.d] = 0;
    } else {
      load_row<DType::float8_e4m3fn>(src, col_stride, p_.d, 1.0f, s.kt + j * p_.d);
    }
  }

  // The key tile's logits of the block's nr rows: sums[t][j] = Σ_h w·ReLU(s) · k_scale for key
  // j < n (the block's empty columns are never computed: e.g. one decode row per sequence).
  // On AMX, one-row calls (keys_as_rows): the row's Sᵀ [keys][heads] on tiles, then per key the
  // weighted ReLU over its heads, summed across lanes 16 keys at a time (relu_dot_keys);
  // more rows: per row its S [heads][keys] on tiles (the next row's issued before this row's
  // vector work, into the other of two buffers), then the reduction over heads along the
  // keys, so that no horizontal sum is needed and S stays in L1 (the whole block's S at
  // once, 128 KiB at IL, went through L2). On vdpbf16ps on the scores in registers
  // (gemm_bf16_relu_dot); else over a stored Sᵀ [n][cols].
  void tile_logits(int64_t n, const Scratch& s, int64_t nr) const {
#if defined(ATTNKIT_ISA_avx512amx)
    const int64_t n_pad = round_up(n, kAmxTile);
    std::memset(s.kt + n * d_pairs_, 0, sizeof(float) * (n_pad - n) * d_pairs_);
    if (keys_as_rows()) {
      gemm_amx_bf16(n_pad, hpad_, d_pairs_, reinterpret_cast<const uint32_t*>(s.kt), d_pairs_,
                    reinterpret_cast<const uint32_t*>(s.qt), hpad_, s.st, hpad_, false);
      relu_dot_keys(s.st, n_pad, s.wcol, s.sums);
      scale_sums(n, nr, s);
      return;
    }
    transpose_matrix(s.kt, d_pairs_, n_pad, d_pairs_, reinterpret_cast<float*>(s.k_pairs), kKeyTile);
    auto scores = [&](int64_t t) {  // row t's S into one of two buffers
      const uint32_t* q_rows = reinterpret_cast<const uint32_t*>(s.qt) + t * hpad_ * d_pairs_;
      gemm_amx_bf16(hpad_, n_pad, d_pairs_, q_rows, d_pairs_, s.k_pairs, kKeyTile, s.st + t % 2 * hpad_ * kKeyTile,
                    kKeyTile, false);
    };
    scores(0);
    for (int64_t t = 0; t < nr; ++t) {
      if (t + 1 < nr) scores(t + 1);
      const float* st = s.st + t % 2 * hpad_ * kKeyTile;
      float* sums = s.sums + t * kKeyTile;
      switch (n_pad / kLanes) {  // the key vectors side by side: independent sums
        case 4: relu_dot_heads<4>(st, s.wcol + t * hpad_, sums); break;
        case 3: relu_dot_heads<3>(st, s.wcol + t * hpad_, sums); break;
        case 2: relu_dot_heads<2>(st, s.wcol + t * hpad_, sums); break;
        default: relu_dot_heads<1>(st, s.wcol + t * hpad_, sums);
      }
    }
#elif defined(ATTNKIT_ISA_avx512bf16)
    for (int64_t t = 0; t < nr; ++t) {
      float* sums = s.sums + t * kKeyTile;
      std::memset(sums, 0, sizeof(float) * n);
      gemm_bf16_relu_dot<kTallRows, kTallVecs>(n, hpad_, d_pairs_, reinterpret_cast<const uint32_t*>(s.kt), d_pairs_,
                                               reinterpret_cast<const uint32_t*>(s.qt) + t * hpad_, cols_,
                                               s.wcol + t * hpad_, sums);
    }
#else
    gemm<kTallRows, kTallVecs>(n, nr * hpad_, p_.d, s.kt, p_.d, 1, s.qt, cols_, s.st, cols_, false);
    for (int64_t j = 0; j < n; ++j) {
      const float* row = s.st + j * cols_;
      for (int64_t t = 0; t < nr; ++t) {
        vfloat acc{};
        for (int64_t c = t * hpad_; c < (t + 1) * hpad_; c += kLanes) {
          const vfloat v = vload(row + c);
          acc += (v < 0.0f ? vfloat{} : v) * vload(s.wcol + c);  // ReLU, NaN kept
        }
        s.sums[t * kKeyTile + j] = hsum(acc);
      }
    }
#endif
    scale_sums(n, nr, s);
  }

  void scale_sums(int64_t n, int64_t nr, const Scratch& s) const {
    for (int64_t t = 0; t < nr; ++t) {
      float* sums = s.sums + t * kKeyTile;
      for (int64_t j = 0; j < n; ++j) sums[j] *= s.kscale[j];
    }
  }

#if defined(ATTNKIT_ISA_avx512amx)
  // sums[j] = Σ_h ReLU(st[h][j]) · w[h] (NaN kept) for the first NV vectors of keys of S's rows.
  template <int NV>
  void relu_dot_heads(const float* st, const float* w, float* sums) const {
    vfloat acc[NV] = {};
    for (int64_t h = 0; h < p_.h; ++h) {
      const vfloat wh = vbroadcast(w[h]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const vfloat x = vload(st + h * kKeyTile + v * kLanes);
        acc[v] += (x < 0.0f ? vfloat{} : x) * wh;
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(sums + v * kLanes, acc[v]);
  }
  // sums[j] = Σ_h ReLU(st[j][h]) · w[h] (NaN kept) for the n_pad keys of Sᵀ's rows (hpad apart).
  void relu_dot_keys(const float* st, int64_t n_pad, const float* w, float* sums) const {
    for (int64_t j0 = 0; j0 < n_pad; j0 += kLanes) {
      vfloat acc[kLanes] = {};
      for (int64_t h = 0; h < hpad_; h += kLanes) {
        const vfloat wh = vload(w + h);
#pragma GCC unroll 16
        for (int j = 0; j < kLanes; ++j) {
          const vfloat x = vload(st + (j0 + j) * hpad_ + h);
          acc[j] += (x < 0.0f ? vfloat{} : x) * wh;
        }
      }
      vstore(sums + j0, lane_sums(acc));
    }
  }
#endif

  void logits_task(const RowBlock& blk, int64_t k0, float* w) const {
    const Scratch s = carve(w);
    const int64_t b = blk.r0 / p_.rows_per_batch;
    const int64_t k1 = std::min(k0 + kKeyChunk, blk.hi);
    int64_t lo[kBlockColumns], hi[kBlockColumns];
    for (int64_t t = 0; t < blk.nr; ++t) range(blk.r0 + t, lo[t], hi[t]);
    if (p_.clean && k0 == blk.lo) {  // the first chunk also cleans what lies outside the span
      for (int64_t t = 0; t < blk.nr; ++t) {
        float* out = p_.logits + (blk.r0 + t) * p_.logits_stride;
        for (int64_t j = 0; j < p_.width; ++j) {
          if (j < blk.lo || j >= blk.hi) out[j] = -INFINITY;
        }
      }
    }
    if (k0 >= k1) return;
    pack_q(blk, s);
    for (int64_t t0 = k0; t0 < k1; t0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, k1 - t0);
      load_keys(b, t0, n, s);
      tile_logits(n, s, blk.nr);
      for (int64_t t = 0; t < blk.nr; ++t) {
        // Key j of the row's range goes to column j - shift (inside [0, width)); with clean
        // logits and uncompressed rows the tile's other keys' columns get -inf.
        float* row = p_.logits + (blk.r0 + t) * p_.logits_stride;
        const int64_t shift = p_.compressed ? origin(blk.r0 + t) : 0, t1 = t0 + n;
        const int64_t a = std::max({lo[t], t0, shift}), e = std::min({hi[t], t1, p_.width + shift});
        if (a < e) std::memcpy(row + a - shift, s.sums + t * kKeyTile + a - t0, sizeof(float) * (e - a));
        if (p_.clean && !p_.compressed) {
          const int64_t c1 = std::max(t0, std::min(t1, p_.width));  // the tile's columns: [t0, c1)
          std::fill(row + t0, row + std::clamp(lo[t], t0, c1), -INFINITY);
          std::fill(row + std::clamp(hi[t], t0, c1), row + c1, -INFINITY);
        }
      }
    }
  }

  void fused_task(const RowBlock& blk, float* w) const {
    const Scratch s = carve(w);
    const int64_t b = blk.r0 / p_.rows_per_batch;
    int64_t lo[kBlockColumns], hi[kBlockColumns];
    std::vector<StreamingTopk> best;
    for (int64_t t = 0; t < blk.nr; ++t) range(blk.r0 + t, lo[t], hi[t]), best.emplace_back(p_.topk);
    if (blk.lo < blk.hi) pack_q(blk, s);
    for (int64_t t0 = blk.lo; t0 < blk.hi; t0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, blk.hi - t0);
      load_keys(b, t0, n, s);
      tile_logits(n, s, blk.nr);
      for (int64_t t = 0; t < blk.nr; ++t) {
        const int64_t a = std::max(lo[t], t0), e = std::min(hi[t], t0 + n);
        if (a < e) best[t].push_run(s.sums + t * kKeyTile + a - t0, e - a, static_cast<uint32_t>(a - origin(blk.r0 + t)));
      }
    }
    std::vector<uint32_t> picked(p_.topk);
    for (int64_t t = 0; t < blk.nr; ++t) {
      const int64_t n = best[t].finish(picked.data());
      int32_t* out = p_.topk_out + (blk.r0 + t) * p_.topk_stride;
      for (int64_t i = 0; i < p_.topk; ++i) out[i] = i < n ? static_cast<int32_t>(picked[i]) : -1;
    }
  }

  const IndexerParams& p_;
  int64_t hpad_, d_pairs_, cols_, workspace_floats_;
  std::vector<RowBlock> blocks_;
};

// The keys of a row's selectable values that may be among its k best: those in the bins of
// the keys' top kBinBits bits up to a bar bin, a superset of the top k (exact) when it holds
// at least k keys, and far fewer than the row on real logits. The bar comes from a histogram
// of every kSampleStep-th vector of the row, aimed at 1.25 k keys; where the bins up to it
// hold fewer than k, from the whole row's histogram (the exact bin of the k-th best). Bins
// are computed kLanes values at a time (-inf and NaN go to a bin past the last).
constexpr int kBinBits = 11;
constexpr uint32_t kNoBin = 1u << kBinBits;
constexpr int64_t kSampleStep = 8;

inline vuint bins_of(vfloat v) {
  v = v == 0.0f ? vfloat{} : v;                                   // -0 -> +0
  const vuint u = (vuint)v;
  const vuint ordered = (u >> 31) != 0 ? ~u : (u | 0x80000000u);  // as order_key
  const vuint bin = ~ordered >> (32 - kBinBits);
  return v > -INFINITY ? bin : vuint{} + kNoBin;
}

inline uint32_t bin_of(float v) {
  return selectable(v) ? static_cast<uint32_t>(order_key(v, 0) >> (64 - kBinBits)) : kNoBin;
}

// The first bin (best first) at which the count of the selectable values in every step-th
// run of kLanes values reaches `want` (the last bin if it never does).
uint32_t bar_bin(const float* row, int64_t stride, int64_t len, int64_t step, int64_t want) {
  // kHistograms copies, lane i counting into copy i % kHistograms: a value's bin is often
  // the last one's, and one copy's increments of the same count wait on each other (Zen 4:
  // the histogram took half of a top-k 2048 of 65536 values). The bins go through memory
  // (scalar loads: lane extracts were slower), the counts are 32-bit (lengths are int32).
  constexpr int kHistograms = 4;
  constexpr int64_t kBins = kNoBin + 1;
  std::vector<uint32_t> hist(kHistograms * kBins, 0);
  for (int64_t t0 = 0; t0 < len; t0 += step * kLanes) {
    if (stride == 1 && t0 + kLanes <= len) {
      uint32_t bins[kLanes];
      const vuint v = bins_of(vload(row + t0));
      std::memcpy(bins, &v, sizeof bins);
      for (int i = 0; i < kLanes; ++i) ++hist[i % kHistograms * kBins + bins[i]];
    } else {
      for (int64_t t = t0; t < std::min(len, t0 + kLanes); ++t) ++hist[bin_of(row[t * stride])];
    }
  }
  for (int c = 1; c < kHistograms; ++c) {
    for (int64_t bin = 0; bin < kBins; ++bin) hist[bin] += hist[c * kBins + bin];
  }
  uint32_t bin = 0;
  for (int64_t seen = 0; bin < kNoBin - 1 && seen + hist[bin] < want; ++bin) seen += hist[bin];
  return bin;
}

// Appends the keys of the row's values in bins 0 .. bar, in index order.
void collect(const float* row, int64_t stride, int64_t len, uint32_t bar, std::vector<uint64_t>& keys) {
  int64_t t = 0;
  if (stride == 1) {
    const vuint vbar = vuint{} + bar;
    for (; t + kLanes <= len; t += kLanes) {
      for (uint32_t pass = lanes_at_most(bins_of(vload(row + t)), vbar); pass != 0; pass &= pass - 1) {
        const int64_t i = t + __builtin_ctz(pass);
        keys.push_back(order_key(row[i], static_cast<uint32_t>(i)));
      }
    }
  }
  for (; t < len; ++t) {
    if (bin_of(row[t * stride]) <= bar) keys.push_back(order_key(row[t * stride], static_cast<uint32_t>(t)));
  }
}

void select_candidates(const float* row, int64_t stride, int64_t len, int64_t k, std::vector<uint64_t>& keys) {
  keys.reserve(std::min(len, 2 * k));
  if (len <= 4 * k) return collect(row, stride, len, kNoBin - 1, keys);
  const uint32_t bar = bar_bin(row, stride, len, kSampleStep, (k + k / 4) / kSampleStep + 16);
  collect(row, stride, len, bar, keys);
  if (static_cast<int64_t>(keys.size()) >= k || bar == kNoBin - 1) return;  // (the latter: every selectable value)
  keys.clear();
  collect(row, stride, len, bar_bin(row, stride, len, 1, k), keys);
}

}  // namespace

void indexer_logits(const IndexerParams& p) { Indexer(p).run(); }

void topk_select(const TopkParams& p) {
  const int threads = detail::num_threads();
  auto body = [&](int64_t r, int) {
    const int64_t len = p.lengths[r * p.lengths_stride];
    const int64_t start = p.starts ? p.starts[r * p.starts_stride] : 0;
    // (No row when it is empty: the logits of an [N, 0] tensor may have no data.)
    const float* row = len > 0 ? p.logits + r * p.logits_stride[0] + start * p.logits_stride[1] : nullptr;
    std::vector<uint64_t> keys, spare;
    select_candidates(row, p.logits_stride[1], len, p.topk, keys);
    radix_sort(keys, spare, 32);
    const int64_t n = std::min<int64_t>(p.topk, keys.size());
    int32_t* out = p.out + r * p.out_stride[0];
    for (int64_t i = 0; i < p.topk; ++i) {
      int32_t v = -1;
      if (i < n) {
        const int64_t t = static_cast<uint32_t>(keys[i]);
        if (p.mode == TopkParams::Mode::relative) {
          v = static_cast<int32_t>(t);
        } else if (p.mode == TopkParams::Mode::ragged) {
          v = static_cast<int32_t>(t + p.offsets[r * p.offsets_stride]);
        } else {
          const int64_t b = p.row_to_batch ? p.row_to_batch[r * p.row_to_batch_stride] : r;
          const int64_t page = p.page_table[b * p.page_table_stride[0] + t / p.page * p.page_table_stride[1]];
          v = static_cast<int32_t>(page * p.page + t % p.page);
        }
      }
      out[i * p.out_stride[1]] = v;
    }
  };
  detail::parallel_for(p.rows, threads, body);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
