// The merge_attention_states contract: every check in a fixed order (ranks, dtypes, shapes,
// outputs), then a plain MergeStatesParams for the kernel.
#include "attnkit/merge.h"

#include <string>

#include "attnkit/error.h"
#include "core/dispatch.h"
#include "ops/checks.h"
#include "ops/merge_params.h"

namespace attnkit {
namespace {

using detail::fail;

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.rank != b.rank) return false;
  for (int d = 0; d < a.rank; ++d) {
    if (a.shape[d] != b.shape[d] || (a.shape[d] > 1 && a.strides[d] != b.strides[d])) return false;
  }
  return true;
}

std::string row_shape_str(const TensorView& out) {
  std::string s = "[";
  for (int d = 0; d + 1 < out.rank; ++d) s += (d ? ", " : "") + std::to_string(out.shape[d]);
  return s + "]";
}

void check_lse_shape(const TensorView& lse, const char* name, const TensorView& out_a) {
  bool ok = lse.rank == out_a.rank - 1;
  for (int d = 0; ok && d < lse.rank; ++d) ok = lse.shape[d] == out_a.shape[d];
  if (!ok) {
    fail(name, " must have out_a's shape without its last dim, ", row_shape_str(out_a), ", got ",
         lse.shape_str());
  }
  if (lse.dtype != DType::float32) fail(name, " must be float32, got ", dtype_name(lse.dtype));
}

// An output may be exactly one of the allowed inputs (an in-place merge); any other overlap
// with an input or the other output is an error.
void check_output_aliasing(const TensorView& t, const char* name,
                           std::initializer_list<std::pair<const TensorView*, const char*>> others,
                           std::initializer_list<const TensorView*> may_be) {
  for (const auto& [other, other_name] : others) {
    bool allowed = false;
    for (const TensorView* m : may_be) allowed |= m == other && same_view(t, *other);
    if (!allowed) detail::check_no_overlap(t, name, *other, other_name);
  }
}

}  // namespace

void merge_attention_states(const MergeStatesArgs& a) {
  // 1. Ranks and sizes.
  if (a.out_a.rank < 2) {
    fail("out_a must have at least 2 dims [..., Dv] (e.g. [T, H, Dv] or [B, H, S, Dv]), got ", a.out_a.rank,
         "-d ", a.out_a.shape_str());
  }
  for (const auto& [t, name] : {std::pair{&a.out_a, "out_a"}, {&a.out_b, "out_b"}, {&a.out, "out"},
                                {&a.lse_a, "lse_a"}, {&a.lse_b, "lse_b"}, {&a.lse_out, "lse_out"}}) {
    detail::check_sizes_nonnegative(*t, name);
  }

  // 2. Dtypes of the outputs of attention.
  for (const auto& [t, name] : {std::pair{&a.out_a, "out_a"}, {&a.out_b, "out_b"}, {&a.out, "out"}}) {
    if (!detail::is_attention_dtype(t->dtype)) {
      fail(name, " must be float32, float16 or bfloat16, got ", dtype_name(t->dtype));
    }
  }

  // 3. Shapes: out_b and out as out_a; every lse as out_a without Dv.
  for (const auto& [t, name] : {std::pair{&a.out_b, "out_b"}, {&a.out, "out"}}) {
    bool ok = t->rank == a.out_a.rank;
    for (int d = 0; ok && d < t->rank; ++d) ok = t->shape[d] == a.out_a.shape[d];
    if (!ok) fail(name, " must have out_a's shape ", a.out_a.shape_str(), ", got ", t->shape_str());
  }
  check_lse_shape(a.lse_a, "lse_a", a.out_a);
  check_lse_shape(a.lse_b, "lse_b", a.out_a);
  check_lse_shape(a.lse_out, "lse_out", a.out_a);

  // 4. Outputs: each element written once; no aliasing except exact in-place views.
  detail::check_writable_layout(a.out, "out");
  detail::check_writable_layout(a.lse_out, "lse_out");
  check_output_aliasing(a.out, "out",
                        {{&a.out_a, "out_a"}, {&a.out_b, "out_b"}, {&a.lse_a, "lse_a"}, {&a.lse_b, "lse_b"},
                         {&a.lse_out, "lse_out"}},
                        {&a.out_a, &a.out_b});
  check_output_aliasing(a.lse_out, "lse_out",
                        {{&a.out_a, "out_a"}, {&a.out_b, "out_b"}, {&a.lse_a, "lse_a"}, {&a.lse_b, "lse_b"}},
                        {&a.lse_a, &a.lse_b});

  MergeStatesParams p{};
  p.row_dims = a.out_a.rank - 1;
  p.rows = 1;
  for (int d = 0; d < p.row_dims; ++d) {
    p.row_shape[d] = a.out_a.shape[d];
    p.rows *= a.out_a.shape[d];
    p.lse_a_stride[d] = a.lse_a.strides[d];
    p.lse_b_stride[d] = a.lse_b.strides[d];
    p.lse_out_stride[d] = a.lse_out.strides[d];
  }
  p.d_v = a.out_a.shape[p.row_dims];
  for (int d = 0; d <= p.row_dims; ++d) {
    p.out_a_stride[d] = a.out_a.strides[d];
    p.out_b_stride[d] = a.out_b.strides[d];
    p.out_stride[d] = a.out.strides[d];
  }
  p.dtype_a = a.out_a.dtype, p.dtype_b = a.out_b.dtype, p.dtype_out = a.out.dtype;
  p.out_a = a.out_a.data, p.out_b = a.out_b.data, p.out = a.out.data;
  p.lse_a = static_cast<const float*>(a.lse_a.data);
  p.lse_b = static_cast<const float*>(a.lse_b.data);
  p.lse_out = static_cast<float*>(a.lse_out.data);
  if (p.rows == 0) return;
  detail::kernels().merge_states(p);
}

}  // namespace attnkit
