// The KV cache writer's loop (see kv_cache.h): one element conversion per value, compiled
// for each (source, cache) dtype pair so the inner loop has no dtype switch.
#include "core/kv_cache.h"

#include <cmath>
#include <cstring>

#include "attnkit/dtype.h"

namespace attnkit::detail {
namespace {

template <DType D>
struct Codec;
template <>
struct Codec<DType::float32> {
  using type = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
template <>
struct Codec<DType::float16> {
  using type = uint16_t;
  static float load(uint16_t x) { return float16_to_float(x); }
  static uint16_t store(float x) { return float_to_float16(x); }
};
template <>
struct Codec<DType::bfloat16> {
  using type = uint16_t;
  static float load(uint16_t x) { return bfloat16_to_float(x); }
  static uint16_t store(float x) { return float_to_bfloat16(x); }
};
template <>
struct Codec<DType::float8_e4m3fn> {  // has no inf: the conversion itself saturates
  using type = uint8_t;
  static uint8_t store(float x) { return float_to_float8_e4m3fn(x); }
};
template <>
struct Codec<DType::float8_e5m2> {  // has inf: clamp first so that overflow saturates
  using type = uint8_t;
  static uint8_t store(float x) {
    return float_to_float8_e5m2(std::isnan(x) ? x : std::fmax(-57344.0f, std::fmin(x, 57344.0f)));
  }
};

template <DType S, DType D>
void copy_tokens(const KvWrite& w) {
  using In = typename Codec<S>::type;
  using Out = typename Codec<D>::type;
  const In* src = static_cast<const In*>(w.src);
  Out* dst = static_cast<Out*>(w.dst);
  for (int64_t t = 0; t < w.tokens; ++t) {
    if (w.slot[t] < 0) continue;
    const int64_t block = w.slot[t] / w.block_size, offset = w.slot[t] % w.block_size;
    for (int64_t h = 0; h < w.heads; ++h) {
      const float scale = w.scale ? w.scale[h * w.scale_stride] : 1.0f;
      const In* in = src + t * w.src_stride[0] + h * w.src_stride[1];
      Out* out = dst + block * w.dst_stride[0] + offset * w.dst_stride[1] + h * w.dst_stride[2];
      for (int64_t d = 0; d < w.dim; ++d) {
        const float x = Codec<S>::load(in[d * w.src_stride[2]]);
        out[d * w.dst_stride[3]] = Codec<D>::store(x / scale);  // x / 1 is exact
      }
    }
  }
}

template <DType S>
void copy_from(const KvWrite& w) {
  switch (w.dst_dtype) {
    case DType::float16: return copy_tokens<S, DType::float16>(w);
    case DType::bfloat16: return copy_tokens<S, DType::bfloat16>(w);
    case DType::float8_e4m3fn: return copy_tokens<S, DType::float8_e4m3fn>(w);
    case DType::float8_e5m2: return copy_tokens<S, DType::float8_e5m2>(w);
    default: return copy_tokens<S, DType::float32>(w);
  }
}

}  // namespace

void write_kv(const KvWrite& w) {
  switch (w.src_dtype) {
    case DType::float16: return copy_from<DType::float16>(w);
    case DType::bfloat16: return copy_from<DType::bfloat16>(w);
    default: return copy_from<DType::float32>(w);
  }
}

}  // namespace attnkit::detail
