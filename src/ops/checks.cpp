// Argument-check helpers shared by the op contracts (see checks.h).
#include "ops/checks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace attnkit::detail {

float check_float32_scale(double value, const char* name) {
  if (!std::isfinite(value)) fail(name, " must be finite, got ", value);
  const float rounded = static_cast<float>(value);
  if (!std::isfinite(rounded)) fail(name, " must be finite, got ", value, " (inf in float32, the precision the kernels use)");
  return rounded;
}

void check_view(const TensorView& t, const char* name) {
  if (t.rank < 0 || t.rank > kMaxRank) fail(name, " must have 0 to ", kMaxRank, " dims, got rank ", t.rank);
  if (t.data != nullptr) return;
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] == 0) return;  // empty: nothing is addressed
  }
  fail(name, " has no data (a null pointer) for its shape ", t.shape_str());
}

void check_rank(const TensorView& t, const char* name, int rank, const std::string& dims) {
  check_view(t, name);
  if (t.rank != rank) {
    fail(name, " must be a ", rank, "-d tensor ", dims, ", got ", t.rank, "-d ", t.shape_str());
  }
}

void check_sizes_nonnegative(const TensorView& t, const char* name) {
  check_view(t, name);
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] < 0) fail(name, " sizes must be non-negative, got ", t.shape_str());
  }
  int64_t count = 1;
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] == 0) return;  // empty, whatever the other sizes
  }
  for (int d = 0; d < t.rank; ++d) {
    if (__builtin_mul_overflow(count, t.shape[d], &count)) {
      fail(name, " of shape ", t.shape_str(), " has more elements than int64 counts (the count overflows int64)");
    }
  }
}

void broadcast_strides(const TensorView& t, const char* name, std::initializer_list<int64_t> target,
                       const char* target_desc, int64_t* strides_out) {
  check_view(t, name);
  const int n = static_cast<int>(target.size());
  if (t.rank > n) {
    fail(name, " must have at most ", n, " dims (broadcastable to ", target_desc, "), got ",
         t.rank, "-d ", t.shape_str());
  }
  check_sizes_nonnegative(t, name);
  const int64_t* want = target.begin();
  for (int d = 0; d < n; ++d) {
    const int src = d - (n - t.rank);
    if (src < 0) {
      strides_out[d] = 0;
    } else if (t.shape[src] == want[d]) {
      strides_out[d] = want[d] == 1 ? 0 : t.strides[src];
    } else if (t.shape[src] == 1) {
      strides_out[d] = 0;
    } else {
      std::string want_str = "[";
      for (int i = 0; i < n; ++i) want_str += (i ? ", " : "") + std::to_string(want[i]);
      fail(name, " of shape ", t.shape_str(), " is not broadcastable to ", target_desc, " = ",
           want_str, "]");
    }
  }
}

namespace {

std::string strides_str(const TensorView& t) {
  std::string s = "[";
  for (int d = 0; d < t.rank; ++d) s += (d ? ", " : "") + std::to_string(t.strides[d]);
  return s + "]";
}

// Checks that every element offset (sums of index · stride) and its byte offset fit in
// int64: Σ (size - 1) · |stride|. Sizes are non-negative and the view non-empty.
void check_reach(const TensorView& t, const char* name) {
  int64_t reach = 0, bytes;
  for (int d = 0; d < t.rank; ++d) {
    int64_t term;
    if (t.strides[d] == INT64_MIN || __builtin_mul_overflow(t.shape[d] - 1, std::abs(t.strides[d]), &term) ||
        __builtin_add_overflow(reach, term, &reach)) {
      fail(name, " strides ", strides_str(t), " with shape ", t.shape_str(), " reach beyond int64 elements");
    }
  }
  if (__builtin_mul_overflow(reach + 1, static_cast<int64_t>(dtype_size(t.dtype)), &bytes)) {
    fail(name, " strides ", strides_str(t), " with shape ", t.shape_str(), " reach beyond int64 bytes");
  }
}

// Views up to this many elements whose dims are not nested are checked element by element.
constexpr int64_t kMaxEnumeratedElements = int64_t{1} << 22;

struct Dim {
  int64_t stride, size;  // |stride| > 0, size > 1
};

// Whether dims are nested: sorted by stride, each stride beyond the reach of all the smaller
// ones. Then every index addresses its own element; every ordinary layout (permuted, sliced,
// reversed) is nested. The reaches fit: callers bound them by check_reach.
bool nested(Dim* dims, int n) {
  for (int i = 1; i < n; ++i) {  // insertion sort (std::sort on 6 elements trips GCC 12's -Warray-bounds)
    for (int j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j) std::swap(dims[j], dims[j - 1]);
  }
  int64_t reach = 0;
  for (int i = 0; i < n; ++i) {
    if (dims[i].stride <= reach) return false;
    reach += (dims[i].size - 1) * dims[i].stride;
  }
  return true;
}

}  // namespace

void check_writable_layout(const TensorView& t, const char* name) {
  check_view(t, name);
  if (t.numel() == 0) return;  // nothing is written
  check_reach(t, name);
  Dim dims[kMaxRank];
  int n = 0;
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] <= 1) continue;
    if (t.strides[d] == 0) {
      fail(name, " must not have overlapping elements, got stride 0 in dim ", d, " of shape ", t.shape_str());
    }
    dims[n++] = {std::abs(t.strides[d]), t.shape[d]};
  }
  if (nested(dims, n)) return;
  // Otherwise the offsets decide (shape [2, 3] with strides [3, 2] is not nested, yet distinct).
  const int64_t count = t.numel();
  if (count > kMaxEnumeratedElements) {
    fail(name, " with strides ", strides_str(t), " and shape ", t.shape_str(),
         " is not nested (each |stride| beyond the reach of the smaller ones) and too large (", count,
         " elements) to prove its elements distinct; pass a contiguous ", name);
  }
  std::vector<int64_t> offsets(count);
  for (int64_t i = 0; i < count; ++i) {
    int64_t rest = i, offset = 0;
    for (int d = t.rank - 1; d >= 0; --d) {
      offset += rest % t.shape[d] * t.strides[d];
      rest /= t.shape[d];
    }
    offsets[i] = offset;
  }
  std::sort(offsets.begin(), offsets.end());
  if (std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end()) {
    fail(name, " must not have overlapping elements, got strides ", strides_str(t), " with shape ", t.shape_str(),
         " (two indices address the same element)");
  }
}

namespace {
struct Span {
  uintptr_t begin, end;  // [begin, end) in bytes; empty when begin == end
};
Span span_of(const TensorView& t, const char* name) {
  check_view(t, name);
  if (t.numel() == 0) return {0, 0};
  check_reach(t, name);  // so that none of the sums below overflows
  int64_t lo = 0, hi = 0;
  for (int d = 0; d < t.rank; ++d) {
    const int64_t reach = (t.shape[d] - 1) * t.strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  const int64_t item = static_cast<int64_t>(dtype_size(t.dtype));
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  return {base + static_cast<uintptr_t>(lo * item), base + static_cast<uintptr_t>((hi + 1) * item)};
}
}  // namespace

namespace {
// Whether a and b, whose spans overlap, are interleaved without a common element: views of one
// layout (dtype size, shape, strides) whose offset δ from a to b, taken as one more dim of
// size 2, keeps the dims nested, e.g. a paged cache's K and V as kv[:, 0] and kv[:, 1]. Their
// union is then a view with distinct elements. Dims of size 1 or stride 0 repeat elements
// without adding any, so they are left out.
bool interleaved(const TensorView& a, const TensorView& b) {
  const int64_t item = static_cast<int64_t>(dtype_size(a.dtype));
  if (dtype_size(b.dtype) != dtype_size(a.dtype) || a.rank != b.rank) return false;
  const int64_t bytes = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data) - reinterpret_cast<uintptr_t>(a.data));
  if (bytes % item != 0) return false;
  Dim dims[kMaxRank + 1];
  int n = 0;
  for (int d = 0; d < a.rank; ++d) {
    if (a.shape[d] != b.shape[d] || a.strides[d] != b.strides[d]) return false;
    if (a.shape[d] > 1 && a.strides[d] != 0) dims[n++] = {std::abs(a.strides[d]), a.shape[d]};
  }
  dims[n++] = {std::abs(bytes / item), 2};
  return nested(dims, n);
}
}  // namespace

void check_no_overlap(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name) {
  const Span x = span_of(a, a_name), y = span_of(b, b_name);
  if (x.begin < x.end && y.begin < y.end && x.begin < y.end && y.begin < x.end && !interleaved(a, b)) {
    fail(a_name, " must not alias ", b_name, " (their memory overlaps)");
  }
}

void check_output(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape) {
  check_view(t, name);
  bool ok = t.rank == static_cast<int>(shape.size());
  for (int d = 0; ok && d < t.rank; ++d) ok = t.shape[d] == shape.begin()[d];
  if (!ok) {
    std::string want = "[";
    for (int64_t s : shape) want += (want.size() > 1 ? ", " : "") + std::to_string(s);
    fail(name, " must have shape ", want, "], got ", t.shape_str());
  }
  if (t.dtype != dtype) fail(name, " must be ", dtype_name(dtype), ", got ", dtype_name(t.dtype));
  if (!t.is_contiguous()) fail(name, " must be contiguous");
}

void check_like(const TensorView& t, const char* name, const TensorView& like, const char* like_name) {
  check_view(t, name);
  if (t.rank != like.rank) {
    fail(name, " must be a ", like.rank, "-d tensor with ", like_name, "'s shape ", like.shape_str(), ", got ", t.rank,
         "-d");
  }
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] != like.shape[d]) {
      fail(name, " must have ", like_name, "'s shape ", like.shape_str(), ", got ", t.shape_str());
    }
  }
  if (t.dtype != like.dtype) {
    fail(name, " must have ", like_name, "'s dtype ", dtype_name(like.dtype), ", got ", dtype_name(t.dtype));
  }
}

void check_gradients(const NamedViews& grads, const NamedViews& inputs) {
  for (const auto& [g, name] : grads) check_writable_layout(*g, name);
  for (size_t g = 0; g < grads.size(); ++g) {
    for (const auto& [input, input_name] : inputs) check_no_overlap(*grads[g].first, grads[g].second, *input, input_name);
    for (size_t other = g + 1; other < grads.size(); ++other) {
      check_no_overlap(*grads[g].first, grads[g].second, *grads[other].first, grads[other].second);
    }
  }
}

void check_dsinks(const std::optional<TensorView>& sinks, const std::optional<TensorView>& dsinks, int64_t hq) {
  if (sinks && !dsinks) fail("dsinks must be given with sinks (float32 [", hq, "]), got None");
  if (!sinks && dsinks) fail("dsinks must be None without sinks, got a tensor");
  if (dsinks && (dsinks->dtype != DType::float32 || dsinks->rank != 1 || dsinks->shape[0] != hq)) {
    fail("dsinks must be float32 of shape [", hq, "] (sinks' shape), got ", dtype_name(dsinks->dtype), " of shape ",
         dsinks->shape_str());
  }
}

}  // namespace attnkit::detail
