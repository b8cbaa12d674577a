// The dtype layer: names and sizes of attnkit's element types, scalar conversions between
// float32 and the narrow float formats (fp16, bf16, fp8 e4m3fn, fp8 e5m2), and the bulk
// cast() used when packing operands and by attnkit._C.cast.
//
// The oracle is PyTorch 2.13's CPU .to() on x86 with AVX2/AVX512 (its default dispatch
// there), matched bit for bit, including where it departs from plain IEEE narrowing or
// from ml_dtypes:
//   * float32 -> e4m3fn saturates: finite overflow and +-inf become +-448 (0x7E|sign);
//     only NaN becomes NaN (0x7F|sign).  ml_dtypes gives NaN on overflow instead.
//   * float32 -> bfloat16 turns every NaN into 0xFFFF (torch's vectorised kernel; its
//     scalar c10 fallback, used only at ATEN_CPU_CAPABILITY=default, gives 0x7FC0).
//   * float32 -> fp16 keeps the NaN sign and top payload bits and sets the quiet bit
//     (the F16C vcvtps2ph result); fp8 NaNs become 0x7F|sign.
//   * fp16 / e5m2 / e4m3fn -> float32 keep the NaN sign and payload and set the quiet
//     bit; bfloat16 -> float32 is a plain shift, so its signalling NaNs stay signalling.
// Everything else is IEEE round-to-nearest-even with gradual underflow.
//
// All conversions work on the integer bit patterns only, so they do not depend on the
// floating-point environment (rounding mode, FTZ/DAZ) that kernels may change.
#include "attnkit/dtype.h"

#include <array>
#include <bit>
#include <cstring>
#include <string>
#include <type_traits>

#include "attnkit/error.h"

namespace attnkit {
namespace {

// ---- one description per narrow format; the conversions below are generic over it.

enum class Overflow : uint8_t {
  to_inf,    // magnitudes that round above the largest finite value become +-inf
  saturate,  // ... become +-max finite (e4m3fn, which has no inf)
};

enum class NanOut : uint8_t {
  quiet_payload,  // sign | all-ones exponent | quiet bit | top payload bits (fp16)
  max_mantissa,   // sign | all-ones exponent | all-ones mantissa (fp8)
  all_ones,       // every bit set, whatever the input sign (bfloat16)
};

struct Format {
  int exp_bits;
  int man_bits;
  bool has_inf;  // false: all-ones exponent is finite except for the all-ones mantissa (NaN)
  Overflow overflow;
  NanOut nan_out;
  bool widen_quiets_nan;  // float32 result of a NaN gets the quiet bit set
};

constexpr Format kFloat16{5, 10, true, Overflow::to_inf, NanOut::quiet_payload, true};
constexpr Format kBFloat16{8, 7, true, Overflow::to_inf, NanOut::all_ones, false};
constexpr Format kE4M3FN{4, 3, false, Overflow::saturate, NanOut::max_mantissa, true};
constexpr Format kE5M2{5, 2, true, Overflow::to_inf, NanOut::max_mantissa, true};

constexpr uint32_t kF32Sign = 0x80000000u;
constexpr uint32_t kF32Inf = 0x7F800000u;
constexpr uint32_t kF32Quiet = 0x00400000u;
constexpr uint32_t kF32ManMask = 0x007FFFFFu;

// x / 2^s rounded to nearest, ties to even; s in [1, 31].
constexpr uint32_t shift_right_rne(uint32_t x, int s) {
  const uint32_t half_minus_one = (uint32_t{1} << (s - 1)) - 1;
  const uint32_t odd = (x >> s) & 1;  // adding it turns an exact tie upward only when odd
  return (x + half_minus_one + odd) >> s;
}

// float32 -> narrow format, returned in the low 1 + E + M bits.
template <Format F>
constexpr uint32_t narrow(float x) {
  constexpr int M = F.man_bits;
  constexpr int drop = 23 - M;  // float32 mantissa bits that do not fit
  constexpr uint32_t bias = (uint32_t{1} << (F.exp_bits - 1)) - 1;
  constexpr uint32_t exp_ones = (uint32_t{1} << F.exp_bits) - 1;
  constexpr uint32_t man_ones = (uint32_t{1} << M) - 1;
  constexpr uint32_t sign_bit = uint32_t{1} << (F.exp_bits + M);
  constexpr uint32_t inf_code = exp_ones << M;
  constexpr uint32_t nan_code = inf_code | man_ones;
  constexpr uint32_t max_finite = F.has_inf ? inf_code - 1 : nan_code - 1;

  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits & kF32Sign) ? sign_bit : 0;
  const uint32_t mag = bits & ~kF32Sign;

  if (mag > kF32Inf) {  // NaN
    if constexpr (F.nan_out == NanOut::quiet_payload) {
      return sign | inf_code | (uint32_t{1} << (M - 1)) | ((mag & kF32ManMask) >> drop);
    } else if constexpr (F.nan_out == NanOut::max_mantissa) {
      return sign | nan_code;
    } else {
      return sign_bit | nan_code;
    }
  }

  uint32_t code;
  if (mag >= (128 - bias) << 23) {
    // Normal in the target (or too large, inf included): rebias the exponent in place and
    // round the mantissa; a carry out of the mantissa correctly bumps the exponent.
    code = shift_right_rne(mag - ((127 - bias) << 23), drop);
  } else {
    // Subnormal in the target: the result is significand * 2^(e - 150) measured in units
    // of the target's smallest subnormal, 2^(1 - bias - M), rounded once.
    uint32_t e = mag >> 23;
    uint32_t significand = mag & kF32ManMask;
    if (e != 0) {
      significand |= uint32_t{1} << 23;
    } else {
      e = 1;  // float32 subnormals share the exponent of the smallest normal
    }
    const int shift = static_cast<int>(151 - bias - M - e);  // always > drop
    // significand < 2^24, so any shift past 25 leaves less than half a unit: zero.
    code = shift > 25 ? 0 : shift_right_rne(significand, shift);
  }
  if (code > max_finite) {
    code = F.overflow == Overflow::to_inf ? inf_code : max_finite;
  }
  return sign | code;
}

// narrow format (low 1 + E + M bits of code) -> float32 bits; always exact.
template <Format F>
constexpr uint32_t widen_bits(uint32_t code) {
  constexpr int M = F.man_bits;
  constexpr int drop = 23 - M;
  constexpr uint32_t bias = (uint32_t{1} << (F.exp_bits - 1)) - 1;
  constexpr uint32_t exp_ones = (uint32_t{1} << F.exp_bits) - 1;
  constexpr uint32_t man_ones = (uint32_t{1} << M) - 1;
  constexpr uint32_t sign_bit = uint32_t{1} << (F.exp_bits + M);

  const uint32_t sign = (code & sign_bit) ? kF32Sign : 0;
  uint32_t e = (code >> M) & exp_ones;
  uint32_t m = code & man_ones;

  if (e == exp_ones && (F.has_inf || m == man_ones)) {  // inf or NaN
    if (F.has_inf && m == 0) return sign | kF32Inf;
    return sign | kF32Inf | (m << drop) | (F.widen_quiets_nan ? kF32Quiet : 0);
  }
  if (e == 0) {
    if (m == 0) return sign;
    if constexpr (F.exp_bits == 8) {
      return sign | (m << drop);  // same exponent range as float32: stays subnormal
    } else {
      // Every subnormal of a narrower exponent range is a float32 normal: shift the
      // leading one into the implicit-bit position and lower the exponent to match.
      const int k = std::countl_zero(m) - (31 - M);
      m = (m << k) & man_ones;
      return sign | ((127 - bias + 1 - k) << 23) | (m << drop);
    }
  }
  return sign | ((e + 127 - bias) << 23) | (m << drop);
}

// fp8 has only 256 codes: widen through a compile-time table, one load per element.
template <Format F>
constexpr std::array<uint32_t, 256> make_widen_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t code = 0; code < 256; ++code) table[code] = widen_bits<F>(code);
  return table;
}
constexpr auto kE4M3FNTable = make_widen_table<kE4M3FN>();
constexpr auto kE5M2Table = make_widen_table<kE5M2>();

// Spot checks that the generic code encodes what the header comment claims.
static_assert(narrow<kE4M3FN>(448.0f) == 0x7E && narrow<kE4M3FN>(1e9f) == 0x7E);
static_assert(narrow<kE5M2>(57344.0f) == 0x7B && narrow<kE5M2>(61440.0f) == 0x7C);
static_assert(narrow<kFloat16>(65504.0f) == 0x7BFF && narrow<kFloat16>(65520.0f) == 0x7C00);
static_assert(narrow<kBFloat16>(1.0f) == 0x3F80 && widen_bits<kFloat16>(0x0001) == 0x33800000);
static_assert(kE4M3FNTable[0x7F] == 0x7FF00000 && kE5M2Table[0xFD] == 0xFFE00000);

// ---- bulk cast: one loop instantiated per (src, dst) pair, dispatched once per call.

template <DType D>
using Tag = std::integral_constant<DType, D>;

template <class Fn>
void visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::float32: return fn(Tag<DType::float32>{});
    case DType::float16: return fn(Tag<DType::float16>{});
    case DType::bfloat16: return fn(Tag<DType::bfloat16>{});
    case DType::float8_e4m3fn: return fn(Tag<DType::float8_e4m3fn>{});
    case DType::float8_e5m2: return fn(Tag<DType::float8_e5m2>{});
    case DType::int8: return fn(Tag<DType::int8>{});
    case DType::uint8: return fn(Tag<DType::uint8>{});
    case DType::int32: return fn(Tag<DType::int32>{});
    case DType::boolean: return fn(Tag<DType::boolean>{});
    case DType::int64: return fn(Tag<DType::int64>{});
  }
  throw Error("invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

// Integer and bool types: cast() reads them but never writes them.
constexpr bool is_source_only(DType dtype) {
  return dtype == DType::int8 || dtype == DType::uint8 || dtype == DType::int32 ||
         dtype == DType::boolean || dtype == DType::int64;
}

template <DType D>
struct Storage;
template <> struct Storage<DType::float32> { using type = float; };
template <> struct Storage<DType::float16> { using type = uint16_t; };
template <> struct Storage<DType::bfloat16> { using type = uint16_t; };
template <> struct Storage<DType::float8_e4m3fn> { using type = uint8_t; };
template <> struct Storage<DType::float8_e5m2> { using type = uint8_t; };
template <> struct Storage<DType::int8> { using type = int8_t; };
template <> struct Storage<DType::uint8> { using type = uint8_t; };
template <> struct Storage<DType::int32> { using type = int32_t; };
template <> struct Storage<DType::boolean> { using type = uint8_t; };
template <> struct Storage<DType::int64> { using type = int64_t; };

template <DType D>
float to_float(typename Storage<D>::type v) {
  if constexpr (D == DType::float16) return float16_to_float(v);
  else if constexpr (D == DType::bfloat16) return bfloat16_to_float(v);
  else if constexpr (D == DType::float8_e4m3fn) return float8_e4m3fn_to_float(v);
  else if constexpr (D == DType::float8_e5m2) return float8_e5m2_to_float(v);
  else if constexpr (D == DType::boolean) return v != 0 ? 1.0f : 0.0f;  // any nonzero byte: true
  else return static_cast<float>(v);  // float32 itself, and integers (int32 rounds RNE)
}

template <DType D>
typename Storage<D>::type from_float(float x) {
  if constexpr (D == DType::float16) return float_to_float16(x);
  else if constexpr (D == DType::bfloat16) return float_to_bfloat16(x);
  else if constexpr (D == DType::float8_e4m3fn) return float_to_float8_e4m3fn(x);
  else if constexpr (D == DType::float8_e5m2) return float_to_float8_e5m2(x);
  else return x;  // float32 (integer destinations are rejected before dispatch)
}

template <DType S, DType D>
void cast_loop(const void* src, void* dst, size_t n) {
  using SrcT = typename Storage<S>::type;
  using DstT = typename Storage<D>::type;
  const auto* in = static_cast<const unsigned char*>(src);
  auto* out = static_cast<unsigned char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    // memcpy: the buffers need not be aligned for SrcT/DstT; compiles to plain moves.
    SrcT v;
    std::memcpy(&v, in + i * sizeof(SrcT), sizeof(SrcT));
    const DstT r = from_float<D>(to_float<S>(v));
    std::memcpy(out + i * sizeof(DstT), &r, sizeof(DstT));
  }
}

// Indexed by DType; "boolean" is the name attnkit's Python layer passes for bool arrays.
constexpr const char* kNames[] = {"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                                  "int8",    "uint8",   "int32",    "boolean", "int64"};
constexpr size_t kSizes[] = {4, 2, 2, 1, 1, 1, 1, 4, 1, 8};
static_assert(sizeof(kSizes) / sizeof(kSizes[0]) == sizeof(kNames) / sizeof(kNames[0]));
constexpr size_t kNumDTypes = sizeof(kNames) / sizeof(kNames[0]);

size_t dtype_index(DType dtype) {
  const auto i = static_cast<size_t>(dtype);
  if (i >= kNumDTypes) throw Error("invalid DType value " + std::to_string(i));
  return i;
}

}  // namespace

// ---- public API

float float16_to_float(uint16_t bits) { return std::bit_cast<float>(widen_bits<kFloat16>(bits)); }
uint16_t float_to_float16(float x) { return static_cast<uint16_t>(narrow<kFloat16>(x)); }
float bfloat16_to_float(uint16_t bits) {
  return std::bit_cast<float>(widen_bits<kBFloat16>(bits));
}
uint16_t float_to_bfloat16(float x) { return static_cast<uint16_t>(narrow<kBFloat16>(x)); }
float float8_e4m3fn_to_float(uint8_t bits) { return std::bit_cast<float>(kE4M3FNTable[bits]); }
uint8_t float_to_float8_e4m3fn(float x) { return static_cast<uint8_t>(narrow<kE4M3FN>(x)); }
float float8_e5m2_to_float(uint8_t bits) { return std::bit_cast<float>(kE5M2Table[bits]); }
uint8_t float_to_float8_e5m2(float x) { return static_cast<uint8_t>(narrow<kE5M2>(x)); }

size_t dtype_size(DType dtype) { return kSizes[dtype_index(dtype)]; }

const char* dtype_name(DType dtype) { return kNames[dtype_index(dtype)]; }

DType dtype_from_name(const std::string& name) {
  for (size_t i = 0; i < kNumDTypes; ++i) {
    if (name == kNames[i]) return static_cast<DType>(i);
  }
  std::string expected;
  for (size_t i = 0; i < kNumDTypes; ++i) {
    if (i) expected += ", ";
    expected += kNames[i];
  }
  throw Error("unknown dtype \"" + name + "\"; expected one of " + expected);
}

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n) {
  dtype_index(src_dtype);  // validates
  if (is_source_only(dst_dtype)) {
    throw Error(std::string("cast: destination dtype ") + dtype_name(dst_dtype) +
                " is not supported; expected a floating-point dtype (float32, float16, "
                "bfloat16, float8_e4m3fn, float8_e5m2)");
  }
  dtype_index(dst_dtype);
  if (n == 0) return;
  if (src_dtype == dst_dtype) {
    // Identity, as torch's .to(same dtype): a round trip through float32 would rewrite
    // NaN payloads (e.g. every bfloat16 NaN would come back as 0xFFFF).
    std::memmove(dst, src, n * dtype_size(src_dtype));
    return;
  }
  visit_dtype(src_dtype, [&](auto s) {
    visit_dtype(dst_dtype, [&](auto d) {
      if constexpr (!is_source_only(decltype(d)::value)) {
        cast_loop<decltype(s)::value, decltype(d)::value>(src, dst, n);
      }
    });
  });
}

}  // namespace attnkit
