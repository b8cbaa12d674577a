// TensorView helpers: construction, element counts, contiguity, printing.
#include <string>

#include "attnkit/error.h"
#include "attnkit/tensor.h"

namespace attnkit {

namespace {

[[noreturn]] void throw_too_large(const TensorView& t) {
  throw Error("TensorView: the element count of shape " + t.shape_str() + " overflows int64");
}

// a * b, or an Error naming the shape when that overflows int64.
int64_t checked_mul(int64_t a, int64_t b, const TensorView& t) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw_too_large(t);
  return r;
}

void set_shape(TensorView& t, std::initializer_list<int64_t> shape) {
  if (shape.size() > kMaxRank) throw Error("TensorView: rank " + std::to_string(shape.size()) + " exceeds 6");
  t.rank = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) t.shape[d++] = s;
}

}  // namespace

TensorView::TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape)
    : data(data), dtype(dtype) {
  set_shape(*this, shape);
  // Row-major strides. They must fit in int64 unless the view is empty (then nothing is
  // addressed, and the strides of the dims before the overflow stay 0).
  const bool empty = numel() == 0;
  int64_t stride = 1;
  for (int d = rank - 1; d >= 0; --d) {
    strides[d] = stride;
    if (d == 0) break;
    int64_t next;
    if (__builtin_mul_overflow(stride, this->shape[d], &next)) {
      if (!empty) throw_too_large(*this);
      break;
    }
    stride = next;
  }
}

TensorView::TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape,
                       std::initializer_list<int64_t> strides)
    : data(data), dtype(dtype) {
  if (strides.size() != shape.size()) {
    throw Error("TensorView: got " + std::to_string(shape.size()) + " sizes but " +
                std::to_string(strides.size()) + " strides");
  }
  set_shape(*this, shape);
  int d = 0;
  for (int64_t s : strides) this->strides[d++] = s;
}

namespace {
[[noreturn]] void throw_bad_rank(const TensorView& t) {
  throw Error("TensorView: rank " + std::to_string(t.rank) + " is outside [0, " + std::to_string(kMaxRank) + "]");
}
}  // namespace

int64_t TensorView::numel() const {
  if (rank < 0 || rank > kMaxRank) throw_bad_rank(*this);
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) {
    if (shape[d] == 0) return 0;  // empty, whatever the other sizes
  }
  for (int d = 0; d < rank; ++d) n = checked_mul(n, shape[d], *this);
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // numpy gives empty arrays arbitrary (often 0) strides
  int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::shape_str() const {
  if (rank < 0 || rank > kMaxRank) return "(rank " + std::to_string(rank) + ", outside [0, " + std::to_string(kMaxRank) + "])";
  std::string s = "[";
  for (int d = 0; d < rank; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

}  // namespace attnkit
