// Argument-check helpers shared by the op contracts (see checks.h).
#include "ops/checks.h"

#include <algorithm>
#include <cstdint>

namespace attnkit::detail {

void check_rank(const TensorView& t, const char* name, int rank, const std::string& dims) {
  if (t.rank != rank) {
    fail(name, " must be a ", rank, "-d tensor ", dims, ", got ", t.rank, "-d ", t.shape_str());
  }
}

void check_sizes_nonnegative(const TensorView& t, const char* name) {
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] < 0) fail(name, " sizes must be non-negative, got ", t.shape_str());
  }
}

void broadcast_strides(const TensorView& t, const char* name, std::initializer_list<int64_t> target,
                       const char* target_desc, int64_t* strides_out) {
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

void check_writable_layout(const TensorView& t, const char* name) {
  if (t.numel() == 0) return;  // nothing is written
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] > 1 && t.strides[d] == 0) {
      fail(name, " must not have overlapping elements, got stride 0 in dim ", d, " of shape ",
           t.shape_str());
    }
  }
}

namespace {
struct Span {
  uintptr_t begin, end;  // [begin, end) in bytes; empty when begin == end
};
Span span_of(const TensorView& t) {
  if (t.numel() == 0 || t.data == nullptr) return {0, 0};
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

void check_no_overlap(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name) {
  const Span x = span_of(a), y = span_of(b);
  if (x.begin < x.end && y.begin < y.end && x.begin < y.end && y.begin < x.end) {
    fail(a_name, " must not alias ", b_name, " (their memory overlaps)");
  }
}

}  // namespace attnkit::detail
