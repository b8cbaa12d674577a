// Core types every op takes: element types (DType) and a non-owning strided view.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace attnkit {

enum class DType : uint8_t {
  float32,
  float16,
  bfloat16,
  float8_e4m3fn,
  float8_e5m2,
  int8,
  uint8,
  int32,
  boolean,  // one byte, 0 or 1 (numpy/torch bool); used for masks
  int64,    // index arrays (numpy's and torch's default integer)
};

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
// Parses a name as printed by dtype_name ("float32", "bfloat16", ...); throws Error otherwise.
DType dtype_from_name(const std::string& name);

inline constexpr int kMaxRank = 6;

// A non-owning view of an n-d array: pointer, element type, shape and strides counted in
// elements (not bytes). Strides may be zero (broadcast) or arbitrary (non-contiguous).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::float32;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> strides{};

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape);
  // Strided view; strides in elements.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape,
             std::initializer_list<int64_t> strides);

  int64_t size(int dim) const { return shape[dim]; }
  int64_t stride(int dim) const { return strides[dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_str() const;  // "[2, 3, 4]"
};

}  // namespace attnkit
