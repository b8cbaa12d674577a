// Oracle-free tests of the dtype layer (src/core/dtype.cpp): every narrow bit pattern is
// checked against a from-first-principles decoding, float32 -> narrow rounding is checked
// at every midpoint between adjacent representable values, plus hand-checked values, the
// NaN encodings PyTorch 2.13 uses, dtype names/sizes and cast()'s errors.
// tests/python/test_dtype.py compares the same functions against torch and ml_dtypes.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/dtype.h"
#include "attnkit/error.h"
#include "attnkit/tensor.h"

namespace attnkit {
namespace {

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }
float from_bits(uint32_t b) { return std::bit_cast<float>(b); }

// One narrow format, seen through attnkit's scalar conversions.
struct Fmt {
  const char* name;
  int exp_bits;
  int man_bits;
  bool has_inf;  // e4m3fn: no inf, only S.1111.111 is NaN
  float (*widen)(uint32_t);
  uint32_t (*narrow)(float);

  int total_bits() const { return 1 + exp_bits + man_bits; }
  uint32_t num_codes() const { return uint32_t{1} << total_bits(); }
  uint32_t sign_bit() const { return uint32_t{1} << (exp_bits + man_bits); }
  uint32_t exp_ones() const { return (uint32_t{1} << exp_bits) - 1; }
  uint32_t man_ones() const { return (uint32_t{1} << man_bits) - 1; }
  bool is_nan(uint32_t code) const {
    const uint32_t e = (code >> man_bits) & exp_ones(), m = code & man_ones();
    return e == exp_ones() && (has_inf ? m != 0 : m == man_ones());
  }
  bool is_inf(uint32_t code) const {
    return has_inf && (code & ~sign_bit()) == exp_ones() << man_bits;
  }
  // Largest finite positive code.
  uint32_t max_code() const {
    return has_inf ? (exp_ones() << man_bits) - 1 : (exp_ones() << man_bits | man_ones()) - 1;
  }
  // IEEE-style decoding in double arithmetic, independent of the code under test.
  double reference_value(uint32_t code) const {
    const int bias = (1 << (exp_bits - 1)) - 1;
    const bool neg = code & sign_bit();
    const int e = static_cast<int>((code >> man_bits) & exp_ones());
    const int m = static_cast<int>(code & man_ones());
    double v;
    if (is_nan(code)) return std::numeric_limits<double>::quiet_NaN();
    if (is_inf(code)) {
      v = std::numeric_limits<double>::infinity();
    } else if (e == 0) {
      v = std::ldexp(static_cast<double>(m), 1 - bias - man_bits);
    } else {
      v = std::ldexp(static_cast<double>((1 << man_bits) + m), e - bias - man_bits);
    }
    return neg ? -v : v;
  }
};

const Fmt kFormats[] = {
    {"float16", 5, 10, true, [](uint32_t c) { return float16_to_float(static_cast<uint16_t>(c)); },
     [](float x) -> uint32_t { return float_to_float16(x); }},
    {"bfloat16", 8, 7, true,
     [](uint32_t c) { return bfloat16_to_float(static_cast<uint16_t>(c)); },
     [](float x) -> uint32_t { return float_to_bfloat16(x); }},
    {"float8_e4m3fn", 4, 3, false,
     [](uint32_t c) { return float8_e4m3fn_to_float(static_cast<uint8_t>(c)); },
     [](float x) -> uint32_t { return float_to_float8_e4m3fn(x); }},
    {"float8_e5m2", 5, 2, true,
     [](uint32_t c) { return float8_e5m2_to_float(static_cast<uint8_t>(c)); },
     [](float x) -> uint32_t { return float_to_float8_e5m2(x); }},
};

class FormatTest : public ::testing::TestWithParam<Fmt> {};

INSTANTIATE_TEST_SUITE_P(AllFormats, FormatTest, ::testing::ValuesIn(kFormats),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- narrow -> float32, every bit pattern

TEST_P(FormatTest, EveryCodeWidensExactly) {
  const Fmt& f = GetParam();
  for (uint32_t code = 0; code < f.num_codes(); ++code) {
    const float x = f.widen(code);
    const bool neg = code & f.sign_bit();
    ASSERT_EQ(std::signbit(x), neg) << f.name << " code " << code;
    if (f.is_nan(code)) {
      ASSERT_TRUE(std::isnan(x)) << f.name << " code " << code;
    } else {
      // Exact: float32 holds every value, so compare the doubles for equality.
      ASSERT_EQ(static_cast<double>(x), f.reference_value(code)) << f.name << " code " << code;
    }
  }
}

TEST_P(FormatTest, EveryNonNanCodeRoundTrips) {
  const Fmt& f = GetParam();
  for (uint32_t code = 0; code < f.num_codes(); ++code) {
    if (f.is_nan(code)) continue;
    ASSERT_EQ(f.narrow(f.widen(code)), code) << f.name << " code " << code;
  }
}

TEST_P(FormatTest, NanStaysNan) {
  const Fmt& f = GetParam();
  int nans = 0;
  for (uint32_t code = 0; code < f.num_codes(); ++code) {
    if (!f.is_nan(code)) continue;
    ++nans;
    const uint32_t back = f.narrow(f.widen(code));
    ASSERT_TRUE(f.is_nan(back)) << f.name << " code " << code << " -> " << back;
  }
  EXPECT_EQ(nans, f.has_inf ? 2 * static_cast<int>(f.man_ones()) : 2);
  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu,
                       0xFFFFFFFFu, 0x7FA00000u, 0x7FC02000u}) {
    EXPECT_TRUE(f.is_nan(f.narrow(from_bits(nan)))) << f.name << " from " << nan;
  }
}

TEST_P(FormatTest, SignedZerosAndInfinities) {
  const Fmt& f = GetParam();
  EXPECT_EQ(f.narrow(0.0f), 0u);
  EXPECT_EQ(f.narrow(-0.0f), f.sign_bit());
  EXPECT_EQ(bits_of(f.widen(0)), 0u);
  EXPECT_EQ(bits_of(f.widen(f.sign_bit())), 0x80000000u);
  const float inf = std::numeric_limits<float>::infinity();
  const uint32_t pos_overflow = f.has_inf ? f.max_code() + 1 : f.max_code();  // e4m3fn saturates
  EXPECT_EQ(f.narrow(inf), pos_overflow);
  EXPECT_EQ(f.narrow(-inf), pos_overflow | f.sign_bit());
  EXPECT_EQ(f.narrow(std::numeric_limits<float>::max()), pos_overflow);
  EXPECT_EQ(f.narrow(-std::numeric_limits<float>::max()), pos_overflow | f.sign_bit());
}

// ---- float32 -> narrow rounding, at and around every midpoint

// For every pair of adjacent finite codes a < b (same sign), the midpoint rounds to the
// even code, one float32 ulp below rounds to a, one above to b; and just above the largest
// finite value the overflow rule applies. Midpoints of all four formats are exact floats.
TEST_P(FormatTest, RoundsToNearestEvenAtEveryMidpoint) {
  const Fmt& f = GetParam();
  for (uint32_t sign : {0u, f.sign_bit()}) {
    for (uint32_t a = 0; a <= f.max_code(); ++a) {
      const uint32_t ca = a | sign;
      const double va = f.reference_value(ca);
      ASSERT_EQ(f.narrow(static_cast<float>(va)), ca) << f.name << " exact " << ca;
      uint32_t cb;
      double vb;
      if (a < f.max_code()) {
        cb = (a + 1) | sign;
        vb = f.reference_value(cb);
      } else {
        // Overflow threshold: the virtual next value, one spacing above max (max and its
        // predecessor share a binade). Beyond max: inf, or max again for e4m3fn.
        vb = va + (va - f.reference_value((a - 1) | sign));
        cb = f.has_inf ? (f.max_code() + 1) | sign : ca;
      }
      const float mid = static_cast<float>((va + vb) / 2);
      ASSERT_EQ(static_cast<double>(mid), (va + vb) / 2) << "midpoint not exact";
      const float toward_a = std::nextafter(mid, static_cast<float>(va));
      const float toward_b = std::nextafter(mid, static_cast<float>(vb));
      const uint32_t even = (a % 2 == 0) ? ca : cb;
      ASSERT_EQ(f.narrow(mid), even) << f.name << " midpoint after code " << ca;
      ASSERT_EQ(f.narrow(toward_a), ca) << f.name << " below midpoint after " << ca;
      ASSERT_EQ(f.narrow(toward_b), cb) << f.name << " above midpoint after " << ca;
    }
  }
}

// Rounding is monotone and lands on a neighbour: over a dense sweep of positive float32
// (and their negations) codes never decrease, and the result is within half a unit.
TEST_P(FormatTest, RoundingIsMonotoneAndNearest) {
  const Fmt& f = GetParam();
  uint32_t prev = 0;
  for (uint64_t b = 0; b <= 0x7F800000u; b += 1021) {
    const float x = from_bits(static_cast<uint32_t>(b));
    const uint32_t code = f.narrow(x);
    ASSERT_GE(code, prev) << f.name << " at float bits " << b;
    ASSERT_EQ(f.narrow(-x), code | f.sign_bit()) << f.name << " at float bits " << b;
    prev = code;
    if (f.is_inf(code) || code == f.max_code()) continue;  // overflow region
    const double v = f.widen(code);
    // The neighbours of the chosen code are no closer than it is.
    if (code > 0) {
      ASSERT_LE(std::fabs(v - x), std::fabs(f.widen(code - 1) - x)) << b;
    }
    ASSERT_LE(std::fabs(v - x), std::fabs(f.widen(code + 1) - x)) << b;
  }
}

// ---- hand-checked values

TEST(Float8E4M3FN, KnownValues) {
  EXPECT_EQ(float_to_float8_e4m3fn(1.0f), 0x38);
  EXPECT_EQ(float_to_float8_e4m3fn(448.0f), 0x7E);  // max finite
  EXPECT_EQ(float_to_float8_e4m3fn(-448.0f), 0xFE);
  EXPECT_EQ(float_to_float8_e4m3fn(256.0f), 0x78);  // exponent 1111 is finite in e4m3fn
  EXPECT_EQ(float8_e4m3fn_to_float(0x78), 256.0f);
  EXPECT_EQ(float8_e4m3fn_to_float(0x7E), 448.0f);
  // PyTorch 2.13 saturates: beyond 448, inf included, gives +-448 (ml_dtypes gives NaN).
  EXPECT_EQ(float_to_float8_e4m3fn(464.0f), 0x7E);  // tie, even
  EXPECT_EQ(float_to_float8_e4m3fn(470.0f), 0x7E);
  EXPECT_EQ(float_to_float8_e4m3fn(480.0f), 0x7E);
  EXPECT_EQ(float_to_float8_e4m3fn(1e30f), 0x7E);
  EXPECT_EQ(float_to_float8_e4m3fn(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(float_to_float8_e4m3fn(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(float_to_float8_e4m3fn(std::nanf("")), 0x7F);
  EXPECT_EQ(float_to_float8_e4m3fn(-std::nanf("")), 0xFF);
  // Subnormals: smallest 2^-9, largest 7 * 2^-9, smallest normal 2^-6.
  EXPECT_EQ(float8_e4m3fn_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(float8_e4m3fn_to_float(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(float8_e4m3fn_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(float_to_float8_e4m3fn(std::ldexp(1.0f, -10)), 0x00);          // tie, even
  EXPECT_EQ(float_to_float8_e4m3fn(std::ldexp(1.0f, -10) * 1.0001f), 0x01);
  EXPECT_EQ(float_to_float8_e4m3fn(std::ldexp(3.0f, -10)), 0x02);          // tie, even
  EXPECT_EQ(float_to_float8_e4m3fn(std::ldexp(1.0f, -149)), 0x00);         // float32 subnormal
  EXPECT_EQ(float_to_float8_e4m3fn(-std::ldexp(1.0f, -149)), 0x80);
  EXPECT_EQ(float_to_float8_e4m3fn(1.0625f), 0x38);  // 1 + 1/16: tie, even
  EXPECT_EQ(float_to_float8_e4m3fn(1.1875f), 0x3A);  // 1 + 3/16: tie, even (up)
  // NaN widens with sign, all-ones payload.
  EXPECT_EQ(bits_of(float8_e4m3fn_to_float(0x7F)), 0x7FF00000u);
  EXPECT_EQ(bits_of(float8_e4m3fn_to_float(0xFF)), 0xFFF00000u);
}

TEST(Float8E5M2, KnownValues) {
  EXPECT_EQ(float_to_float8_e5m2(1.0f), 0x3C);
  EXPECT_EQ(float_to_float8_e5m2(57344.0f), 0x7B);  // max finite
  EXPECT_EQ(float_to_float8_e5m2(std::nextafter(61440.0f, 0.0f)), 0x7B);
  EXPECT_EQ(float_to_float8_e5m2(61440.0f), 0x7C);  // tie between 57344 and 2^16: even = inf
  EXPECT_EQ(float_to_float8_e5m2(-61440.0f), 0xFC);
  EXPECT_EQ(float_to_float8_e5m2(65536.0f), 0x7C);
  EXPECT_EQ(float_to_float8_e5m2(std::numeric_limits<float>::infinity()), 0x7C);
  EXPECT_EQ(float8_e5m2_to_float(0x7C), std::numeric_limits<float>::infinity());
  EXPECT_EQ(float8_e5m2_to_float(0xFC), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(float8_e5m2_to_float(0x01), std::ldexp(1.0f, -16));  // smallest subnormal
  EXPECT_EQ(float8_e5m2_to_float(0x04), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(float_to_float8_e5m2(std::ldexp(1.0f, -17)), 0x00);  // tie, even
  EXPECT_EQ(float_to_float8_e5m2(std::ldexp(3.0f, -17)), 0x02);  // tie, even
  EXPECT_EQ(float_to_float8_e5m2(std::ldexp(1.0f, -17) * 1.0001f), 0x01);
  // NaN: torch gives 0x7F|sign (ml_dtypes 0x7E|sign); widening sets the quiet bit.
  EXPECT_EQ(float_to_float8_e5m2(std::nanf("")), 0x7F);
  EXPECT_EQ(float_to_float8_e5m2(-std::nanf("")), 0xFF);
  EXPECT_EQ(float_to_float8_e5m2(from_bits(0x7F800001u)), 0x7F);
  EXPECT_EQ(bits_of(float8_e5m2_to_float(0x7D)), 0x7FE00000u);
  EXPECT_EQ(bits_of(float8_e5m2_to_float(0x7E)), 0x7FC00000u);
  EXPECT_EQ(bits_of(float8_e5m2_to_float(0x7F)), 0x7FE00000u);
  EXPECT_EQ(bits_of(float8_e5m2_to_float(0xFD)), 0xFFE00000u);
}

TEST(Float16, KnownValues) {
  EXPECT_EQ(float_to_float16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_float16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_float16(65504.0f), 0x7BFF);  // max finite
  EXPECT_EQ(float_to_float16(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(float_to_float16(65520.0f), 0x7C00);  // tie between max and 2^16: even = inf
  EXPECT_EQ(float_to_float16(-65520.0f), 0xFC00);
  EXPECT_EQ(float16_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(float16_to_float(0x03FF), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(float16_to_float(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(float_to_float16(std::ldexp(1.0f, -25)), 0x0000);  // tie, even
  EXPECT_EQ(float_to_float16(std::ldexp(3.0f, -25)), 0x0002);  // tie, even
  EXPECT_EQ(float_to_float16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(float_to_float16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // tie, even
  EXPECT_EQ(float_to_float16(1.0f + std::ldexp(3.0f, -11)), 0x3C02);      // tie, even (up)
  EXPECT_EQ(float_to_float16(2048.0f + 1.0f), 0x6800);                    // 2049 -> 2048
  EXPECT_EQ(float_to_float16(2048.0f + 3.0f), 0x6802);                    // 2051 -> 2052
  // NaN: sign and top payload bits kept, quiet bit set (torch / F16C).
  EXPECT_EQ(float_to_float16(from_bits(0x7FC00000u)), 0x7E00);
  EXPECT_EQ(float_to_float16(from_bits(0xFFC00000u)), 0xFE00);
  EXPECT_EQ(float_to_float16(from_bits(0x7F800001u)), 0x7E00);
  EXPECT_EQ(float_to_float16(from_bits(0x7FA00000u)), 0x7F00);
  EXPECT_EQ(float_to_float16(from_bits(0x7FC02000u)), 0x7E01);
  EXPECT_EQ(float_to_float16(from_bits(0xFFFFFFFFu)), 0xFFFF);
  EXPECT_EQ(bits_of(float16_to_float(0x7C01)), 0x7FC02000u);  // signalling -> quiet
  EXPECT_EQ(bits_of(float16_to_float(0x7E00)), 0x7FC00000u);
  EXPECT_EQ(bits_of(float16_to_float(0xFE00)), 0xFFC00000u);
  EXPECT_EQ(bits_of(float16_to_float(0x7FFF)), 0x7FFFE000u);
}

TEST(BFloat16, KnownValues) {
  EXPECT_EQ(float_to_bfloat16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bfloat16(-1.0f), 0xBF80);
  EXPECT_EQ(float_to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);  // tie, even
  EXPECT_EQ(float_to_bfloat16(1.0f + std::ldexp(3.0f, -8)), 0x3F82);  // tie, even (up)
  EXPECT_EQ(float_to_bfloat16(from_bits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7F7F0000u)), 0x7F7F);  // max finite
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7F7F8000u)), 0x7F80);  // tie: even = inf
  EXPECT_EQ(float_to_bfloat16(std::numeric_limits<float>::max()), 0x7F80);
  // Subnormals are float32 subnormals with the low 16 bits cleared.
  EXPECT_EQ(bits_of(bfloat16_to_float(0x0001)), 0x00010000u);
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00008000u)), 0x0000);  // tie, even
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00018000u)), 0x0002);  // tie, even
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00008001u)), 0x0001);
  EXPECT_EQ(float_to_bfloat16(from_bits(0x007FFFFFu)), 0x0080);  // rounds up to min normal
  // NaN: torch 2.13's vectorised kernel writes 0xFFFF for every NaN, whatever its sign.
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7FC00000u)), 0xFFFF);
  EXPECT_EQ(float_to_bfloat16(from_bits(0xFFC00000u)), 0xFFFF);
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7F800001u)), 0xFFFF);
  // Widening is a plain shift: signalling NaNs stay signalling.
  EXPECT_EQ(bits_of(bfloat16_to_float(0x7F81)), 0x7F810000u);
  EXPECT_EQ(bits_of(bfloat16_to_float(0xFFC0)), 0xFFC00000u);
}

// ---- dtype names and sizes

TEST(DTypeNames, RoundTripAndSizes) {
  struct Row {
    DType dtype;
    const char* name;
    size_t size;
  };
  const Row rows[] = {
      {DType::float32, "float32", 4},        {DType::float16, "float16", 2},
      {DType::bfloat16, "bfloat16", 2},      {DType::float8_e4m3fn, "float8_e4m3fn", 1},
      {DType::float8_e5m2, "float8_e5m2", 1}, {DType::int8, "int8", 1},
      {DType::uint8, "uint8", 1},            {DType::int32, "int32", 4},
      {DType::boolean, "boolean", 1},      {DType::int64, "int64", 8},
  };
  for (const Row& r : rows) {
    EXPECT_STREQ(dtype_name(r.dtype), r.name);
    EXPECT_EQ(dtype_size(r.dtype), r.size) << r.name;
    EXPECT_EQ(dtype_from_name(r.name), r.dtype) << r.name;
  }
}

TEST(DTypeNames, UnknownNameThrows) {
  for (const char* bad : {"foo", "", "Float32", "float", "fp16", "bf16", "float8_e4m3", " int8"}) {
    try {
      dtype_from_name(bad);
      FAIL() << "no error for \"" << bad << "\"";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::string("unknown dtype \"") + bad + "\""), std::string::npos) << msg;
      for (const char* name : {"float32", "float16", "bfloat16", "float8_e4m3fn",
                               "float8_e5m2", "int8", "uint8", "int32", "boolean", "int64"}) {
        EXPECT_NE(msg.find(name), std::string::npos) << msg;
      }
    }
  }
}

TEST(DTypeNames, InvalidEnumThrows) {
  const auto bad = static_cast<DType>(200);
  EXPECT_THROW(dtype_size(bad), Error);
  EXPECT_THROW(dtype_name(bad), Error);
}

// ---- cast()

TEST(Cast, IntegerDestinationThrowsNamingDType) {
  float src[2] = {1.0f, 2.0f};
  int32_t dst[2] = {};
  for (DType d : {DType::int8, DType::uint8, DType::int32, DType::boolean, DType::int64}) {
    try {
      cast(src, DType::float32, dst, d, 2);
      FAIL() << "no error for " << dtype_name(d);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(dtype_name(d)), std::string::npos) << e.what();
    }
    // Rejected even when there is nothing to convert, and from an integer source.
    EXPECT_THROW(cast(src, DType::float32, dst, d, 0), Error);
    EXPECT_THROW(cast(dst, d, dst, d, 2), Error);
  }
}

TEST(Cast, InvalidDTypeThrows) {
  float buf[1] = {};
  EXPECT_THROW(cast(buf, static_cast<DType>(99), buf, DType::float32, 1), Error);
  EXPECT_THROW(cast(buf, DType::float32, buf, static_cast<DType>(99), 1), Error);
}

TEST(Cast, IntegerSourcesConvertLikeStaticCast) {
  std::vector<int8_t> i8;
  for (int v = -128; v <= 127; ++v) i8.push_back(static_cast<int8_t>(v));
  std::vector<float> out(i8.size());
  cast(i8.data(), DType::int8, out.data(), DType::float32, i8.size());
  for (size_t i = 0; i < i8.size(); ++i) EXPECT_EQ(out[i], static_cast<float>(i8[i]));

  std::vector<uint8_t> u8;
  for (int v = 0; v <= 255; ++v) u8.push_back(static_cast<uint8_t>(v));
  out.resize(u8.size());
  cast(u8.data(), DType::uint8, out.data(), DType::float32, u8.size());
  for (size_t i = 0; i < u8.size(); ++i) EXPECT_EQ(out[i], static_cast<float>(u8[i]));

  const int32_t i32[] = {0, -1, 16777216, 16777217, 16777219, -16777219, 2147483647,
                         -2147483647 - 1, 123456789};
  const float expect[] = {0.0f, -1.0f, 16777216.0f, 16777216.0f, 16777220.0f, -16777220.0f,
                          2147483648.0f, -2147483648.0f, 123456792.0f};
  float f32[9];
  cast(i32, DType::int32, f32, DType::float32, 9);
  for (int i = 0; i < 9; ++i) EXPECT_EQ(f32[i], expect[i]) << i32[i];

  // int -> narrow goes through float32 (int32 rounds once there, then again).
  uint16_t h[9];
  cast(i32, DType::int32, h, DType::float16, 9);
  for (int i = 0; i < 9; ++i) EXPECT_EQ(h[i], float_to_float16(expect[i])) << i32[i];
  uint8_t e4[256];
  cast(u8.data(), DType::uint8, e4, DType::float8_e4m3fn, 256);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(e4[i], float_to_float8_e4m3fn(static_cast<float>(i)));

  // bool: any nonzero byte is true (1.0), as torch reads it.
  const uint8_t b[] = {0, 1, 2, 255};
  float fb[4];
  cast(b, DType::boolean, fb, DType::float32, 4);
  EXPECT_EQ(fb[0], 0.0f);
  EXPECT_EQ(fb[1], 1.0f);
  EXPECT_EQ(fb[2], 1.0f);
  EXPECT_EQ(fb[3], 1.0f);
}

// Every (float src, float dst) pair equals the scalar composition through float32.
TEST(Cast, MatchesScalarFunctionsForEveryPair) {
  std::vector<float> values;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 0x00F1E3D7u) {
    values.push_back(from_bits(static_cast<uint32_t>(b)));
  }
  for (float v : {0.0f, -0.0f, 1.0f, 448.0f, 480.0f, 65520.0f, 61440.0f, 1e-8f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::nanf(""), -std::nanf("")}) {
    values.push_back(v);
  }
  const size_t n = values.size();
  const DType floats[] = {DType::float32, DType::float16, DType::bfloat16, DType::float8_e4m3fn,
                          DType::float8_e5m2};
  auto to_f = [](DType d, const unsigned char* p, size_t i) -> float {
    switch (d) {
      case DType::float16: {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        return float16_to_float(v);
      }
      case DType::bfloat16: {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        return bfloat16_to_float(v);
      }
      case DType::float8_e4m3fn: return float8_e4m3fn_to_float(p[i]);
      case DType::float8_e5m2: return float8_e5m2_to_float(p[i]);
      default: {
        float v;
        std::memcpy(&v, p + 4 * i, 4);
        return v;
      }
    }
  };
  for (DType s : floats) {
    // Source buffer: the values rounded into s.
    std::vector<unsigned char> src(n * dtype_size(s));
    cast(values.data(), DType::float32, src.data(), s, n);
    for (DType d : floats) {
      std::vector<unsigned char> dst(n * dtype_size(d) + 1);  // +1: unaligned below
      unsigned char* out = dst.data() + 1;
      cast(src.data(), s, out, d, n);
      for (size_t i = 0; i < n; ++i) {
        const float x = to_f(s, src.data(), i);
        uint32_t expect;
        switch (d) {
          case DType::float16: expect = float_to_float16(x); break;
          case DType::bfloat16: expect = float_to_bfloat16(x); break;
          case DType::float8_e4m3fn: expect = float_to_float8_e4m3fn(x); break;
          case DType::float8_e5m2: expect = float_to_float8_e5m2(x); break;
          default: expect = bits_of(x); break;
        }
        if (s == d) {  // identity copy, bit for bit
          expect = 0;
          std::memcpy(&expect, src.data() + i * dtype_size(s), dtype_size(s));
        }
        uint32_t got = 0;
        std::memcpy(&got, out + i * dtype_size(d), dtype_size(d));
        ASSERT_EQ(got, expect) << dtype_name(s) << " -> " << dtype_name(d) << " at " << i;
      }
    }
  }
}

TEST(Cast, SameDTypeIsABitCopy) {
  // A round trip through float32 would rewrite these NaN payloads.
  const uint16_t bf[] = {0x7F81, 0xFFC1, 0x3F80, 0x0001};
  uint16_t out[4] = {};
  cast(bf, DType::bfloat16, out, DType::bfloat16, 4);
  EXPECT_EQ(std::memcmp(bf, out, sizeof bf), 0);
  const uint16_t h[] = {0x7C01, 0xFE01, 0x3C00, 0x8001};
  cast(h, DType::float16, out, DType::float16, 4);
  EXPECT_EQ(std::memcmp(h, out, sizeof h), 0);
  cast(h, DType::float16, out, DType::float16, 0);  // n == 0 is a no-op
}

}  // namespace
}  // namespace attnkit
