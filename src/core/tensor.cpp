// TensorView helpers: construction, element counts, contiguity, printing.
#include <string>

#include "attnkit/error.h"
#include "attnkit/tensor.h"

namespace attnkit {

TensorView::TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape)
    : data(data), dtype(dtype), rank(static_cast<int>(shape.size())) {
  if (rank > kMaxRank) throw Error("TensorView: rank " + std::to_string(rank) + " exceeds 6");
  int d = 0;
  for (int64_t s : shape) this->shape[d++] = s;
  int64_t stride = 1;
  for (d = rank - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= this->shape[d];
  }
}

TensorView::TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape,
                       std::initializer_list<int64_t> strides)
    : TensorView(data, dtype, shape) {
  if (strides.size() != shape.size()) {
    throw Error("TensorView: got " + std::to_string(shape.size()) + " sizes but " +
                std::to_string(strides.size()) + " strides");
  }
  int d = 0;
  for (int64_t s : strides) this->strides[d++] = s;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
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
  std::string s = "[";
  for (int d = 0; d < rank; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

}  // namespace attnkit
