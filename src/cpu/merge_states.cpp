// merge_attention_states' kernel: each row's two weights from the lse pair (in double),
// then the row combined in float32 chunks with the vector loads/stores of convert.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/thread_pool.h"
#include "cpu/kernels.h"
#include "cpu/kernels/convert.h"
#include "ops/merge_params.h"

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

constexpr int64_t kChunk = 512;  // columns per pass: two float32 chunks stay in L1

// dst[i] = float(src[offset + i * stride]) * scale, for i < n.
void load_scaled(DType dtype, const void* base, int64_t offset, int64_t stride, int64_t n, float scale,
                 float* dst) {
  switch (dtype) {
    case DType::float32:
      return load_row<DType::float32>(static_cast<const float*>(base) + offset, stride, n, scale, dst);
    case DType::float16:
      return load_row<DType::float16>(static_cast<const uint16_t*>(base) + offset, stride, n, scale, dst);
    default:
      return load_row<DType::bfloat16>(static_cast<const uint16_t*>(base) + offset, stride, n, scale, dst);
  }
}

void store(DType dtype, const float* src, int64_t n, void* base, int64_t offset, int64_t stride) {
  switch (dtype) {
    case DType::float32:
      return store_row<DType::float32>(src, 1.0f, n, static_cast<float*>(base) + offset, stride);
    case DType::float16:
      return store_row<DType::float16>(src, 1.0f, n, static_cast<uint16_t*>(base) + offset, stride);
    default:
      return store_row<DType::bfloat16>(src, 1.0f, n, static_cast<uint16_t*>(base) + offset, stride);
  }
}

struct RowOffsets {
  int64_t a = 0, b = 0, out = 0, lse_a = 0, lse_b = 0, lse_out = 0;
};

RowOffsets row_offsets(const MergeStatesParams& p, int64_t row) {
  RowOffsets o;
  for (int d = p.row_dims - 1; d >= 0; --d) {
    const int64_t i = row % p.row_shape[d];
    row /= p.row_shape[d];
    o.a += i * p.out_a_stride[d], o.b += i * p.out_b_stride[d], o.out += i * p.out_stride[d];
    o.lse_a += i * p.lse_a_stride[d], o.lse_b += i * p.lse_b_stride[d], o.lse_out += i * p.lse_out_stride[d];
  }
  return o;
}

void merge_row(const MergeStatesParams& p, int64_t row) {
  const RowOffsets o = row_offsets(p, row);
  const double la = p.lse_a[o.lse_a], lb = p.lse_b[o.lse_b];
  const int64_t dv = p.d_v, col_a = p.out_a_stride[p.row_dims], col_b = p.out_b_stride[p.row_dims],
                col_out = p.out_stride[p.row_dims];
  alignas(64) float fa[kChunk], fb[kChunk];
  // Weights relative to the larger lse; a part equal to the max weighs 1, so ±inf need no
  // inf - inf. Neither part visible (both -inf): the empty row of attention.
  const double m = std::max(la, lb);
  double ca = 0.0, cb = 0.0, lse = -std::numeric_limits<double>::infinity();
  if (std::isnan(la) || std::isnan(lb)) {
    ca = cb = lse = std::numeric_limits<double>::quiet_NaN();
  } else if (m != -std::numeric_limits<double>::infinity()) {
    const double wa = la == m ? 1.0 : std::exp(la - m), wb = lb == m ? 1.0 : std::exp(lb - m);
    lse = m + std::log1p(std::min(wa, wb));  // one weight is 1
    ca = wa / (wa + wb), cb = wb / (wa + wb);
  }
  p.lse_out[o.lse_out] = static_cast<float>(lse);
  const auto fca = static_cast<float>(ca), fcb = static_cast<float>(cb);
  for (int64_t c = 0; c < dv; c += kChunk) {
    const int64_t n = std::min(kChunk, dv - c);
    if (fca != 0.0f) {
      load_scaled(p.dtype_a, p.out_a, o.a + c * col_a, col_a, n, fca, fa);
    } else {
      std::fill(fa, fa + n, 0.0f);  // a weighs nothing: never read (it may hold anything)
    }
    if (fcb != 0.0f) {
      load_scaled(p.dtype_b, p.out_b, o.b + c * col_b, col_b, n, fcb, fb);
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) vstore(fa + i, vload(fa + i) + vload(fb + i));
      for (; i < n; ++i) fa[i] += fb[i];
    }
    store(p.dtype_out, fa, n, p.out, o.out + c * col_out, col_out);
  }
}

}  // namespace

void merge_states(const MergeStatesParams& p) {
  // About 64K elements per task: enough to amortise a task, small enough to balance.
  const int64_t rows_per_task = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(p.d_v, 1));
  const int64_t tasks = (p.rows + rows_per_task - 1) / rows_per_task;
  auto body = [&](int64_t t, int) {
    const int64_t end = std::min(p.rows, (t + 1) * rows_per_task);
    for (int64_t r = t * rows_per_task; r < end; ++r) merge_row(p, r);
  };
  detail::parallel_for(tasks, tasks > 1 ? detail::num_threads() : 1, body);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
