// Argument-check helpers shared by every op contract in src/ops. Each throws attnkit::Error
// with a message naming the argument, what was expected and what was got.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/error.h"
#include "attnkit/tensor.h"

namespace attnkit::detail {

// The dtypes and head dims of the ops built on the dense kernel (attention, sage, varlen, paged).
inline constexpr int64_t kMaxHeadDim = 512;
inline bool is_attention_dtype(DType t) {
  return t == DType::float32 || t == DType::float16 || t == DType::bfloat16;
}

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream msg;
  (msg << ... << parts);
  throw Error(msg.str());
}

// A scale as the kernels use it, in float32: finite there too (1e39 is finite in double, inf
// in float32). Returns it rounded to float32.
float check_float32_scale(double value, const char* name);

// Every view an op reads or writes: a rank in [0, kMaxRank], and data (not null) unless it
// has no elements. The other helpers here check it first.
void check_view(const TensorView& t, const char* name);

// t must have `rank` dims; `dims` describes them, e.g. "[B, Hq, Sq, D] (layout BHSD)".
void check_rank(const TensorView& t, const char* name, int rank, const std::string& dims);
// Sizes >= 0 and an element count that fits in int64.
void check_sizes_nonnegative(const TensorView& t, const char* name);

// Strides that read t as if broadcast to `target` (numpy rules: dims aligned at the right,
// missing leading dims and size-1 dims broadcast with stride 0). Writes target.size() strides.
void broadcast_strides(const TensorView& t, const char* name, std::initializer_list<int64_t> target,
                       const char* target_desc, int64_t* strides_out);

// An output must not write any element twice: no two indices may address the same element
// (checked exactly), and no offset may overflow int64.
void check_writable_layout(const TensorView& t, const char* name);

// A contiguous output of exactly this dtype and shape.
void check_output(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape);

// a and b must share no element: their address ranges must not overlap, unless they are
// interleaved views of one layout (a paged cache's K and V as kv[:, 0] and kv[:, 1]) that
// provably share none. Other overlapping ranges are refused even where no element is shared.
void check_no_overlap(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name);

// t (a gradient, or dout) must have `like`'s rank, shape and dtype.
void check_like(const TensorView& t, const char* name, const TensorView& like, const char* like_name);

using NamedViews = std::vector<std::pair<const TensorView*, const char*>>;

// A backward's gradients: each writable (check_writable_layout), none overlapping an input or
// another gradient.
void check_gradients(const NamedViews& grads, const NamedViews& inputs);

// The sinks' gradient: given exactly when sinks are, float32 [hq].
void check_dsinks(const std::optional<TensorView>& sinks, const std::optional<TensorView>& dsinks, int64_t hq);

}  // namespace attnkit::detail
