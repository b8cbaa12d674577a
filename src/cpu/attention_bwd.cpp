// Dense attention backward on the CPU (FlashAttention-2's algorithm). One task is a run of
// key blocks of one (batch, kv head); per block of kKeyBlock keys it visits every query
// block of the group's heads, in a fixed order, recomputing S = Q·Kᵀ·scale (+ mask, causal)
// and P = exp(S - lse), then dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P∘(dP - D) with D = rowsum(dO∘O),
// dK += dSᵀ·Q·scale and a partial dQ += dS·K in the task's own float32 buffer. The partial
// dQs are summed in split order afterwards, so the gradients are bit-identical for any
// thread count (the split depends on the shapes only). Dropout regenerates the forward's
// keep mask (detail::dropout_bits per 4 keys). All products run on the shared gemm tiles;
// for bf16 inputs on avx512bf16, S and dP (products of the bf16 inputs, so exact in pairs)
// run on bf16 pairs (vdpbf16ps), and dV, dK on pairs with P and dS rounded to bf16 (dQ stays
// fp32). Compiled once per ISA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/philox.h"
#include "core/thread_pool.h"
#include "cpu/kernel_table.h"
#include "cpu/kernels.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/softmax.h"
#include "cpu/kernels/workspace.h"
#include "ops/attention_backward_params.h"

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

constexpr int64_t kKeyBlock = 64;  // keys per block: a multiple of kLanes and of 4 (dropout draws)
constexpr int64_t kRowBlock = 64;  // query rows per block
constexpr int64_t kMinTasks = 16;  // fewer (batch, kv head) pairs than this: split the keys
#if defined(ATTNKIT_ISA_avx512bf16)
constexpr bool kDotProducts = true;  // vdpbf16ps
#else
constexpr bool kDotProducts = false;
#endif

// How the keys split into tasks, and the per-thread workspace.
struct BackwardPlan {
  int64_t key_blocks, splits, blocks_per_split, tasks, d_pad, dv_pad, workspace_floats;

  explicit BackwardPlan(const AttentionParams& p) {
    key_blocks = (p.Skv + kKeyBlock - 1) / kKeyBlock;
    const int64_t heads = p.B * p.Hkv;
    const int64_t want = heads > 0 ? (kMinTasks + heads - 1) / heads : 1;
    splits = std::max<int64_t>(1, std::min(want, key_blocks));
    blocks_per_split = key_blocks > 0 ? (key_blocks + splits - 1) / splits : 0;
    if (key_blocks > 0) splits = (key_blocks + blocks_per_split - 1) / blocks_per_split;
    tasks = heads * splits;
    d_pad = round_up(p.D, kLanes);
    dv_pad = round_up(p.Dv, kLanes);
    workspace_floats = 2 * kKeyBlock * d_pad          // K rows, Kᵀ
                       + 2 * kKeyBlock * dv_pad       // V rows, Vᵀ
                       + kKeyBlock * (d_pad + dv_pad)  // dK, dV accumulators
                       + kRowBlock * (d_pad + dv_pad)  // Q, dO
                       + 3 * kRowBlock * kKeyBlock     // P, dP then dS, dropped P
                       + 2 * kRowBlock + dv_pad        // lse, D, one O row
                       + (kKeyBlock + kRowBlock) * (d_pad + dv_pad)   // bf16 pairs of Kᵀ, Vᵀ, Q, dO
                       + kRowBlock / 2 * (2 * kKeyBlock + d_pad + dv_pad);  // row pairs of P, dS, dO, Q
  }
};

struct BackwardWorkspace {
  float *k, *kt, *v, *vt, *dk, *dv, *q, *dout, *p, *ds, *pd, *lse, *delta, *o_row;
  uint32_t *kt_pairs, *vt_pairs, *q_pairs, *dout_pairs;  // bf16 pairs along D (Dv), avx512bf16
  uint32_t *p_rows, *ds_rows, *dout_rows, *q_rows;        // bf16 pairs of query rows, avx512bf16
  BackwardWorkspace(float* base, const BackwardPlan& plan) {
    const int64_t dp = plan.d_pad, dvp = plan.dv_pad;
    k = base, kt = k + kKeyBlock * dp, v = kt + kKeyBlock * dp, vt = v + kKeyBlock * dvp;
    dk = vt + kKeyBlock * dvp, dv = dk + kKeyBlock * dp;
    q = dv + kKeyBlock * dvp, dout = q + kRowBlock * dp;
    p = dout + kRowBlock * dvp, ds = p + kRowBlock * kKeyBlock, pd = ds + kRowBlock * kKeyBlock;
    lse = pd + kRowBlock * kKeyBlock, delta = lse + kRowBlock, o_row = delta + kRowBlock;
    kt_pairs = reinterpret_cast<uint32_t*>(o_row + dvp), vt_pairs = kt_pairs + kKeyBlock * dp;
    q_pairs = vt_pairs + kKeyBlock * dvp, dout_pairs = q_pairs + kRowBlock * dp;
    p_rows = dout_pairs + kRowBlock * dvp, ds_rows = p_rows + kRowBlock / 2 * kKeyBlock;
    dout_rows = ds_rows + kRowBlock / 2 * kKeyBlock, q_rows = dout_rows + kRowBlock / 2 * dvp;
  }
};

template <DType T>
class BackwardTask {
  using E = typename Elem<T>::type;
  static constexpr bool kPairs = kDotProducts && T == DType::bfloat16;  // S and dP on bf16 pairs

 public:
  BackwardTask(const AttentionBackwardParams& bp, const BackwardPlan& plan, float* dq_partial)
      : bp_(bp), p_(bp.fwd), plan_(plan), dq_partial_(dq_partial) {}

  // Task t: key blocks of split t % splits of (batch, kv head) t / splits.
  void run(int64_t t, float* workspace) const {
    const BackwardWorkspace w(workspace, plan_);
    const int64_t split = t % plan_.splits, head = t / plan_.splits;
    const int64_t b = head / p_.Hkv, kvh = head % p_.Hkv;
    float* dq_part = dq_rows(split, b, kvh * p_.group);
    if (p_.Sq > 0) std::memset(dq_part, 0, sizeof(float) * p_.group * p_.Sq * plan_.d_pad);
    const int64_t kb_end = std::min(plan_.key_blocks, (split + 1) * plan_.blocks_per_split);
    for (int64_t kb = split * plan_.blocks_per_split; kb < kb_end; ++kb) {
      const int64_t j0 = kb * kKeyBlock, bc = std::min(kKeyBlock, p_.Skv - j0);
      pack_kv(b, kvh, j0, bc, w);
      std::memset(w.dk, 0, sizeof(float) * kKeyBlock * (plan_.d_pad + plan_.dv_pad));  // dK and dV
      for (int64_t h = kvh * p_.group; h < (kvh + 1) * p_.group; ++h) {
        // Causal: query i sees key j0 (and so any of the block) only from i = j0 - offset on.
        const int64_t i_first = p_.causal ? std::max<int64_t>(0, j0 - p_.causal_offset) : 0;
        for (int64_t i0 = i_first; i0 < p_.Sq; i0 += kRowBlock) {
          float* dq_block = dq_part + ((h - kvh * p_.group) * p_.Sq + i0) * plan_.d_pad;
          block(b, h, i0, std::min(kRowBlock, p_.Sq - i0), j0, bc, dq_block, w);
        }
      }
      store_rows(w.dk, plan_.d_pad, p_.D, p_.scale, static_cast<E*>(bp_.dk), bp_.dk_stride, b, kvh, j0, bc);
      store_rows(w.dv, plan_.dv_pad, p_.Dv, 1.0f, static_cast<E*>(bp_.dv), bp_.dv_stride, b, kvh, j0, bc);
    }
  }

  // dq for (batch, head) bh: the splits' partial sums added in split order, times scale.
  void reduce_dq(int64_t bh, float* workspace) const {
    const int64_t b = bh / p_.Hq, h = bh % p_.Hq;
    float* sum = workspace;
    for (int64_t i = 0; i < p_.Sq; ++i) {
      const float* first = dq_rows(0, b, h) + i * plan_.d_pad;
      std::memcpy(sum, first, sizeof(float) * plan_.d_pad);
      for (int64_t s = 1; s < plan_.splits; ++s) {
        const float* part = dq_rows(s, b, h) + i * plan_.d_pad;
        for (int64_t d = 0; d < plan_.d_pad; d += kLanes) vstore(sum + d, vload(sum + d) + vload(part + d));
      }
      E* dst = static_cast<E*>(bp_.dq) + b * bp_.dq_stride[0] + h * bp_.dq_stride[1] + i * bp_.dq_stride[2];
      store_row<T>(sum, p_.scale, p_.D, dst, bp_.dq_stride[3]);
    }
  }

 private:
  // The partial dQ rows [Sq][d_pad] of split s, batch b, query head h.
  float* dq_rows(int64_t s, int64_t b, int64_t h) const {
    return dq_partial_ + ((s * p_.B + b) * p_.Hq + h) * p_.Sq * plan_.d_pad;
  }

  // K and V rows j0 .. j0+bc-1 as fp32 rows, zero-padded to kKeyBlock rows, and transposed.
  void pack_kv(int64_t b, int64_t kvh, int64_t j0, int64_t bc, const BackwardWorkspace& w) const {
    const E* k = static_cast<const E*>(p_.k) + b * p_.k_stride[0] + kvh * p_.k_stride[1];
    const E* v = static_cast<const E*>(p_.v) + b * p_.v_stride[0] + kvh * p_.v_stride[1];
    pack_rows(k + j0 * p_.k_stride[2], p_.k_stride[2], p_.k_stride[3], bc, kKeyBlock, p_.D, plan_.d_pad, 1.0f,
              w.k);
    pack_rows(v + j0 * p_.v_stride[2], p_.v_stride[2], p_.v_stride[3], bc, kKeyBlock, p_.Dv, plan_.dv_pad,
              1.0f, w.v);
    transpose_matrix(w.k, plan_.d_pad, kKeyBlock, plan_.d_pad, w.kt, kKeyBlock);
    transpose_matrix(w.v, plan_.dv_pad, kKeyBlock, plan_.dv_pad, w.vt, kKeyBlock);
    if constexpr (kPairs) {  // exact: the values are bf16 already
      pair_rows_bf16(w.kt, p_.D, kKeyBlock, w.kt_pairs);
      pair_rows_bf16(w.vt, p_.Dv, kKeyBlock, w.vt_pairs);
    }
  }

  // gemm_bf16 where the ISA has it (kPairs is false elsewhere).
  template <int MR, int NV>
  static void gemm_pairs(int64_t m, int64_t n, int64_t pairs, const uint32_t* a, int64_t lda, int64_t a_step,
                         const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
#if defined(ATTNKIT_ISA_avx512bf16)
    gemm_bf16<MR, NV>(m, n, pairs, a, lda, a_step, b, ldb, c, ldc, accumulate);
#else
    (void)m, (void)n, (void)pairs, (void)a, (void)lda, (void)a_step, (void)b, (void)ldb, (void)c, (void)ldc,
        (void)accumulate;
#endif
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

  // n rows (row_stride apart, elements col_stride apart) of `cols` elements times scale into
  // dst [rows][ld], zero beyond: rows n .. rows-1 and columns cols .. ld-1.
  static void pack_rows(const E* src, int64_t row_stride, int64_t col_stride, int64_t n, int64_t rows,
                        int64_t cols, int64_t ld, float scale, float* dst) {
    for (int64_t r = 0; r < n; ++r) {
      load_row<T>(src + r * row_stride, col_stride, cols, scale, dst + r * ld);
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

  // One query block (head h, rows i0 .. i0+nr-1) against one key block (keys j0 .. j0+bc-1).
  void block(int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0, int64_t bc, float* dq_part,
             const BackwardWorkspace& w) const {
    const int64_t dp = plan_.d_pad, dvp = plan_.dv_pad;
    const E* q = static_cast<const E*>(p_.q) + b * p_.q_stride[0] + h * p_.q_stride[1] + i0 * p_.q_stride[2];
    const E* dout = static_cast<const E*>(bp_.dout) + b * bp_.dout_stride[0] + h * bp_.dout_stride[1] +
                    i0 * bp_.dout_stride[2];
    const E* out =
        static_cast<const E*>(p_.out) + b * p_.out_stride[0] + h * p_.out_stride[1] + i0 * p_.out_stride[2];
    pack_rows(q, p_.q_stride[2], p_.q_stride[3], nr, nr, p_.D, dp, 1.0f, w.q);
    pack_rows(dout, bp_.dout_stride[2], bp_.dout_stride[3], nr, nr, p_.Dv, dvp, 1.0f, w.dout);
    for (int64_t r = 0; r < nr; ++r) {
      load_row<T>(out + r * p_.out_stride[2], p_.out_stride[3], p_.Dv, 1.0f, w.o_row);
      const float* g = w.dout + r * dvp;
      float delta = 0.0f;
      for (int64_t d = 0; d < p_.Dv; ++d) delta += g[d] * w.o_row[d];
      // lse's own gradient adds dlse·P to dS: the same as lowering D by dlse.
      if (bp_.dlse) {
        delta -= bp_.dlse[b * bp_.dlse_stride[0] + h * bp_.dlse_stride[1] + (i0 + r) * bp_.dlse_stride[2]];
      }
      w.delta[r] = delta;
      w.lse[r] = p_.lse[b * p_.lse_stride[0] + h * p_.lse_stride[1] + (i0 + r) * p_.lse_stride[2]];
    }

    // S = Q·Kᵀ·scale, then P = exp(S - lse): 0 where masked, past the block, or in rows
    // that saw no key (lse = -inf; their output was 0).
    const int64_t d_pairs = (p_.D + 1) / 2, dv_pairs = (p_.Dv + 1) / 2;
    if constexpr (kPairs) {
      pair_rows(q, p_.q_stride[2], p_.q_stride[3], nr, p_.D, w.q_pairs);
      gemm_pairs<kTallRows, kTallVecs>(nr, kKeyBlock, d_pairs, w.q_pairs, d_pairs, 1, w.kt_pairs, kKeyBlock,
                                       w.p, kKeyBlock, false);
    } else {
      gemm<kTallRows, kTallVecs>(nr, kKeyBlock, p_.D, w.q, dp, 1, w.kt, kKeyBlock, w.p, kKeyBlock, false);
    }
    const vfloat scale = vbroadcast(p_.scale);
    for (int64_t r = 0; r < nr; ++r) {
      float* s = w.p + r * kKeyBlock;
      for (int64_t jj = 0; jj < kKeyBlock; jj += kLanes) vstore(s + jj, vload(s + jj) * scale);
      const int64_t i = i0 + r;
      int64_t visible = bc;
      if (p_.causal) visible = std::clamp<int64_t>(i + p_.causal_offset - j0 + 1, 0, bc);
      if (p_.mask) {
        const int64_t off = b * p_.mask_stride[0] + h * p_.mask_stride[1] + i * p_.mask_stride[2];
        for (int64_t jj = 0; jj < visible; ++jj) {
          s[jj] += load_mask(p_.mask_dtype, p_.mask, off + (j0 + jj) * p_.mask_stride[3]);
        }
      }
      for (int64_t jj = visible; jj < kKeyBlock; ++jj) s[jj] = -INFINITY;
      const float lse = w.lse[r];
      if (lse == -INFINITY) {
        std::memset(s, 0, sizeof(float) * kKeyBlock);
        continue;
      }
      for (int64_t jj = 0; jj < kKeyBlock; jj += kLanes) {
        vstore(s + jj, vexp2((vload(s + jj) - lse) * kLog2e));
      }
    }

    // dP = dO·Vᵀ; with dropout, the kept P and dP scaled by 1/(1-p), dropped ones zero.
    if constexpr (kPairs) {
      pair_rows(dout, bp_.dout_stride[2], bp_.dout_stride[3], nr, p_.Dv, w.dout_pairs);
      gemm_pairs<kTallRows, kTallVecs>(nr, kKeyBlock, dv_pairs, w.dout_pairs, dv_pairs, 1, w.vt_pairs,
                                       kKeyBlock, w.ds, kKeyBlock, false);
    } else {
      gemm<kTallRows, kTallVecs>(nr, kKeyBlock, p_.Dv, w.dout, dvp, 1, w.vt, kKeyBlock, w.ds, kKeyBlock,
                                 false);
    }
    const float* p_dropped = w.p;
    if (p_.dropout_p > 0.0f) {
      apply_dropout(b, h, i0, nr, j0, w);
      p_dropped = w.pd;
    }
    // dS = P∘(dP - D)
    for (int64_t r = 0; r < nr; ++r) {
      const vfloat delta = vbroadcast(w.delta[r]);
      float* ds = w.ds + r * kKeyBlock;
      const float* pr = w.p + r * kKeyBlock;
      for (int64_t jj = 0; jj < kKeyBlock; jj += kLanes) {
        vstore(ds + jj, vload(pr + jj) * (vload(ds + jj) - delta));
      }
    }

    // dV += P_droppedᵀ·dO, dK += dSᵀ·Q and dQ += dS·K (both times scale when stored). With
    // bf16 pairs, P and dS are rounded to bf16 for dV and dK (as the forward rounds P for
    // P·V, and FlashAttention does): pairs of query rows, the reduction axis.
    if constexpr (kPairs) {
      const int64_t row_pairs = (nr + 1) / 2;
      pair_rows_bf16(p_dropped, nr, kKeyBlock, w.p_rows);
      pair_rows_bf16(w.ds, nr, kKeyBlock, w.ds_rows);
      pair_rows_bf16(w.dout, nr, dvp, w.dout_rows);
      pair_rows_bf16(w.q, nr, dp, w.q_rows);
      gemm_pairs<kTallRows, kTallVecs>(bc, dvp, row_pairs, w.p_rows, 1, kKeyBlock, w.dout_rows, dvp, w.dv,
                                       dvp, true);
      gemm_pairs<kTallRows, kTallVecs>(bc, dp, row_pairs, w.ds_rows, 1, kKeyBlock, w.q_rows, dp, w.dk, dp,
                                       true);
    } else {
      gemm<kTallRows, kTallVecs>(bc, dvp, nr, p_dropped, 1, kKeyBlock, w.dout, dvp, w.dv, dvp, true);
      gemm<kTallRows, kTallVecs>(bc, dp, nr, w.ds, 1, kKeyBlock, w.q, dp, w.dk, dp, true);
    }
    gemm<kTallRows, kTallVecs>(nr, dp, bc, w.ds, kKeyBlock, 1, w.k, dp, dq_part, dp, true);
  }

  // The forward's keep mask (one Philox draw per 4 keys of row (b, h, i)): w.pd = P·keep/(1-p)
  // and dP·keep/(1-p) in place.
  void apply_dropout(int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0,
                     const BackwardWorkspace& w) const {
    const uint32_t threshold = detail::dropout_threshold(p_.dropout_p);
    const float keep_scale = 1.0f / (1.0f - p_.dropout_p);
    for (int64_t r = 0; r < nr; ++r) {
      for (int64_t jj = 0; jj < kKeyBlock; jj += 4) {
        const auto bits = detail::dropout_bits(p_.seed, b, h, i0 + r, j0 + jj);
        for (int64_t k = 0; k < 4; ++k) {
          const int64_t at = r * kKeyBlock + jj + k;
          const bool keep = bits[k] >= threshold;
          w.pd[at] = keep ? w.p[at] * keep_scale : 0.0f;
          w.ds[at] = keep ? w.ds[at] * keep_scale : 0.0f;
        }
      }
    }
  }

  const AttentionBackwardParams& bp_;
  const AttentionParams& p_;
  const BackwardPlan& plan_;
  float* dq_partial_;  // [splits][B][Hq][Sq][d_pad]
};

template <DType T>
void run_backward(const AttentionBackwardParams& bp) {
  const AttentionParams& p = bp.fwd;
  const int threads = detail::num_threads();
  const BackwardPlan plan(p);
  AlignedBuffer<float> workspace(plan.workspace_floats * threads);
  AlignedBuffer<float> dq_partial(plan.splits * p.B * p.Hq * p.Sq * plan.d_pad);
  const BackwardTask<T> task(bp, plan, dq_partial.data);
  auto key_blocks = [&](int64_t t, int thread) {
    task.run(t, workspace.data + plan.workspace_floats * thread);
  };
  detail::parallel_for(plan.tasks, threads, key_blocks);
  auto reduce = [&](int64_t bh, int thread) {
    task.reduce_dq(bh, workspace.data + plan.workspace_floats * thread);
  };
  detail::parallel_for(p.B * p.Hq, threads, reduce);
}

}  // namespace

void attention_bwd(const AttentionBackwardParams& p) {
  switch (p.fwd.dtype) {
    case DType::float16: return run_backward<DType::float16>(p);
    case DType::bfloat16: return run_backward<DType::bfloat16>(p);
    default: return run_backward<DType::float32>(p);
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
