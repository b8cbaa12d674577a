// Dense attention forward on the CPU: the flash-style tile loop. One task is a block of
// query rows sharing one kv head (the GQA group's heads × a run of query positions). Per
// K/V tile of kKvTile keys it computes Sᵀ = K · Qᵀ (keys × rows, so the softmax runs down
// columns with rows as the SIMD axis), the online softmax, and O += P · V. fp32 K and V
// with unit inner stride are read in place; other dtypes are converted once per tile and
// used by every row of the task. Scores never exceed one tile. Compiled once per ISA.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/philox.h"
#include "core/thread_pool.h"
#include "cpu/kernel_table.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/softmax.h"
#include "ops/attention_params.h"

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

constexpr int64_t kKvTile = 64;     // keys per tile
// Query rows per task (heads of a group × positions): a multiple of 16 (the Kᵀ·Q tile's
// columns) and of 6 (the P·V tile's rows on AVX-512), measured best of 48, 64 and 96.
constexpr int64_t kRowTarget = 48;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// How the work splits into tasks, and the per-thread workspace each task uses.
struct Plan {
  int64_t heads_per_task, positions_per_task, head_chunks, q_blocks, tasks;
  int64_t rows_pad, dv_pad, workspace_floats;
  bool k_in_place, v_in_place;  // fp32 rows with unit stride need no packing

  explicit Plan(const AttentionParams& p) {
    heads_per_task = p.group < kRowTarget ? p.group : kRowTarget;
    positions_per_task = kRowTarget / heads_per_task;
    if (positions_per_task > p.Sq) positions_per_task = p.Sq;
    head_chunks = (p.group + heads_per_task - 1) / heads_per_task;
    q_blocks = (p.Sq + positions_per_task - 1) / positions_per_task;
    tasks = p.B * p.Hkv * head_chunks * q_blocks;
    rows_pad = round_up(heads_per_task * positions_per_task, kLanes);
    dv_pad = round_up(p.Dv, kLanes);
    k_in_place = p.dtype == DType::float32 && p.k_stride[3] == 1;
    v_in_place = p.dtype == DType::float32 && p.v_stride[3] == 1 && p.Dv == dv_pad;
    workspace_floats = p.D * rows_pad              // Qᵀ, scaled
                       + rows_pad * dv_pad         // output accumulators
                       + kKvTile * rows_pad        // Sᵀ, then Pᵀ
                       + kKvTile * p.D             // K tile (when packed)
                       + kKvTile * dv_pad          // V tile (when packed)
                       + 3 * rows_pad;             // running max, sum, rescale factors
  }
};

struct Workspace {
  float *qt, *o, *st, *k, *v, *m, *l, *alpha;
  Workspace(float* base, const Plan& plan, const AttentionParams& p) {
    qt = base;
    o = qt + p.D * plan.rows_pad;
    st = o + plan.rows_pad * plan.dv_pad;
    k = st + kKvTile * plan.rows_pad;
    v = k + kKvTile * p.D;
    m = v + kKvTile * plan.dv_pad;
    l = m + plan.rows_pad;
    alpha = l + plan.rows_pad;
  }
};

template <DType T>
class AttentionTask {
  using E = typename Elem<T>::type;

 public:
  AttentionTask(const AttentionParams& p, const Plan& plan) : p_(p), plan_(plan) {}

  void run(int64_t task, float* workspace) const {
    // Heavy first: the last query blocks (most keys under a causal mask) are handed out first.
    const int64_t per_block = p_.B * p_.Hkv * plan_.head_chunks;
    const int64_t qb = plan_.q_blocks - 1 - task / per_block;
    int64_t rest = task % per_block;
    const int64_t chunk = rest % plan_.head_chunks;
    rest /= plan_.head_chunks;
    const int64_t kvh = rest % p_.Hkv, b = rest / p_.Hkv;

    const int64_t i0 = qb * plan_.positions_per_task;
    const int64_t nq = p_.Sq - i0 < plan_.positions_per_task ? p_.Sq - i0 : plan_.positions_per_task;
    const int64_t h0 = kvh * p_.group + chunk * plan_.heads_per_task;
    const int64_t nh_left = (kvh + 1) * p_.group - h0;
    const int64_t nh = nh_left < plan_.heads_per_task ? nh_left : plan_.heads_per_task;
    const int64_t rows = nh * nq;  // row r is head h0 + r / nq, position i0 + r % nq
    const int64_t ld = plan_.rows_pad;
    Workspace w(workspace, plan_, p_);

    pack_qt(b, h0, i0, nh, nq, w.qt);
    std::memset(w.o, 0, sizeof(float) * rows * plan_.dv_pad);
    for (int64_t r = 0; r < ld; ++r) w.m[r] = -INFINITY, w.l[r] = 0.0f;

    int64_t kv_end = p_.Skv;
    if (p_.causal) {
      const int64_t last_visible = i0 + nq - 1 + p_.causal_offset;
      if (last_visible + 1 < kv_end) kv_end = last_visible + 1 < 0 ? 0 : last_visible + 1;
    }
    const E* kbase = static_cast<const E*>(p_.k) + b * p_.k_stride[0] + kvh * p_.k_stride[1];
    const E* vbase = static_cast<const E*>(p_.v) + b * p_.v_stride[0] + kvh * p_.v_stride[1];
    for (int64_t j0 = 0; j0 < kv_end; j0 += kKvTile) {
      const int64_t bc = kv_end - j0 < kKvTile ? kv_end - j0 : kKvTile;
      const float *k, *v;
      int64_t ldk, ldv;
      if (plan_.k_in_place) {
        k = reinterpret_cast<const float*>(kbase + j0 * p_.k_stride[2]), ldk = p_.k_stride[2];
      } else {
        pack_rows(kbase + j0 * p_.k_stride[2], p_.k_stride[2], p_.k_stride[3], bc, p_.D, p_.D, w.k);
        k = w.k, ldk = p_.D;
      }
      if (plan_.v_in_place) {
        v = reinterpret_cast<const float*>(vbase + j0 * p_.v_stride[2]), ldv = p_.v_stride[2];
      } else {
        pack_rows(vbase + j0 * p_.v_stride[2], p_.v_stride[2], p_.v_stride[3], bc, p_.Dv, plan_.dv_pad, w.v);
        v = w.v, ldv = plan_.dv_pad;
      }
      gemm<kWideRows, kWideVecs>(bc, ld, p_.D, k, ldk, 1, w.qt, ld, w.st, ld, false);  // Sᵀ = K·Qᵀ
      apply_masks(b, h0, i0, nq, rows, j0, bc, w.st);
      online_softmax_tile(w.st, bc, ld, ld, w.m, w.l, w.alpha);
      for (int64_t r = 0; r < rows; ++r) {
        if (w.alpha[r] != 1.0f) scale_row(w.o + r * plan_.dv_pad, plan_.dv_pad, w.alpha[r]);
      }
      if (p_.dropout_p > 0.0f) apply_dropout(b, h0, i0, nq, rows, j0, bc, w.st);
      gemm<kTallRows, kTallVecs>(rows, plan_.dv_pad, bc, w.st, 1, ld, v, ldv, w.o, plan_.dv_pad,
                                 true);  // O += P · V
    }
    write_out(b, h0, i0, nq, rows, w);
  }

 private:
  // Qᵀ [D][rows_pad], pre-multiplied by the softmax scale; padding rows are zero.
  void pack_qt(int64_t b, int64_t h0, int64_t i0, int64_t nh, int64_t nq, float* qt) const {
    const E* base = static_cast<const E*>(p_.q) + b * p_.q_stride[0];
    const float scale = p_.scale;
    const int64_t ld = plan_.rows_pad;
    std::memset(qt, 0, sizeof(float) * p_.D * ld);
    for (int64_t hh = 0; hh < nh; ++hh) {
      for (int64_t ii = 0; ii < nq; ++ii) {
        const E* src = base + (h0 + hh) * p_.q_stride[1] + (i0 + ii) * p_.q_stride[2];
        float* dst = qt + hh * nq + ii;
        for (int64_t d = 0; d < p_.D; ++d) dst[d * ld] = Elem<T>::load(src[d * p_.q_stride[3]]) * scale;
      }
    }
  }

  // n rows of `cols` elements converted to fp32 [n][ld], zero-padded to ld columns.
  static void pack_rows(const E* src, int64_t row_stride, int64_t col_stride, int64_t n, int64_t cols,
                        int64_t ld, float* dst) {
    for (int64_t j = 0; j < n; ++j) {
      load_row<T>(src + j * row_stride, col_stride, cols, 1.0f, dst + j * ld);
      for (int64_t c = cols; c < ld; ++c) dst[j * ld + c] = 0.0f;
    }
  }

  // The causal limit and the user mask on Sᵀ[j][r], as -inf or an additive bias.
  void apply_masks(int64_t b, int64_t h0, int64_t i0, int64_t nq, int64_t rows, int64_t j0,
                   int64_t bc, float* st) const {
    const bool causal_cut = p_.causal && j0 + bc - 1 > i0 + p_.causal_offset;
    if (!causal_cut && !p_.mask) return;
    const int64_t ld = plan_.rows_pad;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = h0 + r / nq, i = i0 + r % nq;
      int64_t visible = bc;  // keys j0 + [0, visible) pass the causal limit
      if (causal_cut) {
        const int64_t limit = i + p_.causal_offset - j0 + 1;
        visible = limit < 0 ? 0 : (limit < bc ? limit : bc);
      }
      for (int64_t jj = visible; jj < bc; ++jj) st[jj * ld + r] = -INFINITY;
      if (p_.mask) {
        const int64_t row_off = b * p_.mask_stride[0] + h * p_.mask_stride[1] + i * p_.mask_stride[2];
        for (int64_t jj = 0; jj < visible; ++jj) {
          st[jj * ld + r] += load_mask(p_.mask_dtype, p_.mask, row_off + (j0 + jj) * p_.mask_stride[3]);
        }
      }
    }
  }

  // Zeroes dropped probabilities and scales kept ones by 1 / (1 - p); the row sums already
  // hold the undropped softmax, which normalises the output as in SDPA.
  void apply_dropout(int64_t b, int64_t h0, int64_t i0, int64_t nq, int64_t rows, int64_t j0,
                     int64_t bc, float* pt) const {
    const uint32_t threshold = detail::dropout_threshold(p_.dropout_p);
    const float keep_scale = 1.0f / (1.0f - p_.dropout_p);
    const int64_t ld = plan_.rows_pad;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = h0 + r / nq, i = i0 + r % nq;
      for (int64_t jj = 0; jj < bc; jj += 4) {  // j0 is a multiple of 4: one draw per 4 keys
        const auto bits = detail::dropout_bits(p_.seed, b, h, i, j0 + jj);
        for (int64_t k = 0; k < 4 && jj + k < bc; ++k) {
          float& pr = pt[(jj + k) * ld + r];
          pr = bits[k] >= threshold ? pr * keep_scale : 0.0f;
        }
      }
    }
  }

  void write_out(int64_t b, int64_t h0, int64_t i0, int64_t nq, int64_t rows, const Workspace& w) const {
    E* out = static_cast<E*>(p_.out);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = h0 + r / nq, i = i0 + r % nq;
      const float l = w.l[r];
      const float inv = l > 0.0f ? 1.0f / l : (l == 0.0f ? 0.0f : l);  // l is NaN or >= 1
      const float* o = w.o + r * plan_.dv_pad;
      E* dst = out + b * p_.out_stride[0] + h * p_.out_stride[1] + i * p_.out_stride[2];
      for (int64_t d = 0; d < p_.Dv; ++d) dst[d * p_.out_stride[3]] = Elem<T>::store(o[d] * inv);
      if (p_.lse) {
        p_.lse[b * p_.lse_stride[0] + h * p_.lse_stride[1] + i * p_.lse_stride[2]] =
            l == 0.0f ? -INFINITY : w.m[r] + std::log(l);
      }
    }
  }

  const AttentionParams& p_;
  const Plan& plan_;
};

struct AlignedBuffer {
  float* data;
  explicit AlignedBuffer(int64_t floats)
      : data(static_cast<float*>(std::aligned_alloc(64, round_up(floats * sizeof(float), 64)))) {}
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

template <DType T>
void run_attention(const AttentionParams& p) {
  const Plan plan(p);
  const int threads = detail::num_threads();
  AlignedBuffer workspace(plan.workspace_floats * threads);
  if (!workspace.data) throw std::bad_alloc();
  const AttentionTask<T> task(p, plan);
  auto body = [&](int64_t t, int thread) {
    task.run(t, workspace.data + plan.workspace_floats * thread);
  };
  detail::parallel_for(plan.tasks, threads, body);
}

void attention_fwd(const AttentionParams& p) {
  switch (p.dtype) {
    case DType::float16: return run_attention<DType::float16>(p);
    case DType::bfloat16: return run_attention<DType::bfloat16>(p);
    default: return run_attention<DType::float32>(p);
  }
}

}  // namespace

#define ATTNKIT_STR2(x) #x
#define ATTNKIT_STR(x) ATTNKIT_STR2(x)
const KernelTable kernel_table = {ATTNKIT_STR(ATTNKIT_ISA), &attention_fwd};

}  // namespace attnkit::cpu::ATTNKIT_ISA
