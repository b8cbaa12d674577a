// Element loads and stores between the op dtypes and float32, inlined into packing loops.
// bf16 widening is a shift; fp16 uses F16C where the ISA has it; stores round to nearest
// even exactly as attnkit::float_to_* (and torch) do.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attnkit/dtype.h"
#include "attnkit/tensor.h"
#include "cpu/kernels/simd.h"

#if defined(ATTNKIT_ISA_avx2) || defined(ATTNKIT_ISA_avx512)
#include <immintrin.h>
#endif

namespace attnkit::cpu::ATTNKIT_ISA {

template <DType T>
struct Elem;

template <>
struct Elem<DType::float32> {
  using type = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};

template <>
struct Elem<DType::bfloat16> {
  using type = uint16_t;
  static float load(uint16_t x) {
    const uint32_t bits = uint32_t{x} << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static uint16_t store(float x) { return float_to_bfloat16(x); }
};

template <>
struct Elem<DType::float16> {
  using type = uint16_t;
  static float load(uint16_t x) {
#if defined(ATTNKIT_ISA_avx2) || defined(ATTNKIT_ISA_avx512)
    return _cvtsh_ss(x);
#else
    return float16_to_float(x);
#endif
  }
  static uint16_t store(float x) { return float_to_float16(x); }
};

template <>
struct Elem<DType::float8_e4m3fn> {
  using type = uint8_t;
  static float load(uint8_t x) { return float8_e4m3fn_to_float(x); }
};

template <>
struct Elem<DType::float8_e5m2> {
  using type = uint8_t;
  static float load(uint8_t x) { return float8_e5m2_to_float(x); }
};

typedef uint16_t vhalf __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint8_t vbyte __attribute__((vector_size(kLanes)));

// kLanes consecutive 16-bit values zero-extended to 32 bits: one widening load. (GCC 12
// splits __builtin_convertvector into five instructions, and warns inside the unmasked
// _mm512_cvtepu16_epi32.)
inline vuint vload_widened(const uint16_t* p) {
#if defined(ATTNKIT_ISA_avx512)
  return (vuint)_mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(ATTNKIT_ISA_avx2)
  return (vuint)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vuint);
#endif
}

// kLanes consecutive elements widened to float32.
template <DType T>
inline vfloat vload_as_float(const typename Elem<T>::type* p) {
  if constexpr (T == DType::float32) {
    return vload(p);
  } else if constexpr (T == DType::bfloat16) {
    return (vfloat)(vload_widened(p) << 16);  // bf16 is the high half of its float32
  } else if constexpr (T == DType::float8_e4m3fn) {
    // Exponent and mantissa moved into float32's fields, then rebiased (7 -> 127) by an
    // exact multiply by 2^120; e4m3fn subnormals land on float32 subnormals, so this is
    // exact as long as denormals are not flushed (the default). 0x7F/0xFF are NaN.
#if defined(ATTNKIT_ISA_avx512)
    // Two 8-lane widenings (GCC 12 warns inside _mm512_cvtepu8_epi32).
    typedef int32_t v8i __attribute__((vector_size(32)));
    const v8i lo = (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const v8i hi = (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const vint x = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(ATTNKIT_ISA_avx2)
    const vint x = (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
    vbyte b;  // GCC widens this lane by lane; the intrinsics above are one instruction
    std::memcpy(&b, p, sizeof b);
    const vint x = __builtin_convertvector(b, vint);
#endif
    const vint magnitude = x & 0x7F;
    vfloat f = (vfloat)(magnitude << 20) * 0x1p120f;
    f = (vfloat)((vint)f | ((x & 0x80) << 24));
    return magnitude == 0x7F ? vbroadcast(__builtin_nanf("")) : f;
  } else if constexpr (T == DType::float8_e5m2) {
    // e5m2 is the high byte of a float16 with the same value: widen, shift, convert.
#if defined(ATTNKIT_ISA_avx512)
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
    typedef float v8 __attribute__((vector_size(32)));
    const v8 lo = (v8)_mm256_cvtph_ps(_mm256_castsi256_si128(h));
    const v8 hi = (v8)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(ATTNKIT_ISA_avx2)
    const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
    return (vfloat)_mm256_cvtph_ps(h);
#else
    vfloat v;
    for (int i = 0; i < kLanes; ++i) v[i] = Elem<T>::load(p[i]);
    return v;
#endif
  } else {
#if defined(ATTNKIT_ISA_avx512)
    // Two 8-lane F16C conversions (GCC 12 warns inside _mm512_cvtph_ps).
    typedef float v8 __attribute__((vector_size(32)));
    const v8 lo = (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const v8 hi = (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(ATTNKIT_ISA_avx2)
    return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    vfloat v;
    for (int i = 0; i < kLanes; ++i) v[i] = Elem<T>::load(p[i]);
    return v;
#endif
  }
}

// fp8 (e4m3fn, e5m2) -> bf16 bits, exactly: every fp8 value is a bf16 value (3 or 2
// mantissa bits, exponents and subnormals inside bf16's range), so the float32 widening
// has a zero low half; NaN stays NaN, e5m2's infinities stay infinite.
template <DType T>
inline uint16_t fp8_to_bf16_bits(uint8_t x) {
  const float f = Elem<T>::load(x);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

// Rows of fp8 converted to bf16 bits (fp8 caches under bf16 queries: K rows, in order,
// are the pairs along D; V rows are bf16 rows). On AVX-512 a table of the 128 magnitudes'
// bf16 bits in four registers, looked up 32 elements at a time (two vpermt2w, one blend
// on bit 6, the sign or-ed in): about 7 instructions for 32 elements, where the float32
// widening takes about 10 for 16. With AVX512-VBMI (the avx512bf16 and avx512amx variants)
// the bits' high and low bytes in two tables of 128 bytes, looked up 64 elements at a time by
// vpermt2b (one uop, where Intel's vpermt2w is three) and interleaved into words: 7
// instructions for 64 (Zen 4, paged decode on fp8 caches: 0.84-0.94 of the time at one
// thread, the mixed batch M 0.93 at two).
template <DType T>
class Fp8ToBf16 {
 public:
  Fp8ToBf16() {
    static const Table table = [] {
      Table t;
      // Byte i of pairs()' permuted vector: element order[i] of the pair sequence a0 b0 a1 b1
      // ... (row()'s order: bytes 8L.. and 32+8L.. in lane L), whose element k is a's k / 2
      // (byte k / 2 of the first register) or b's (byte k / 2 of the second: index 64 + k / 2).
      for (int i = 0; i < 64; ++i) {
        const int lane = i / 16, within = i % 16;
        const int k = within < 8 ? 8 * lane + within : 32 + 8 * lane + within - 8;
        t.pair_order[i] = static_cast<uint8_t>(k % 2 == 0 ? k / 2 : 64 + k / 2);
      }
      for (int m = 0; m < 128; ++m) {
        t.bits[m] = fp8_to_bf16_bits<T>(static_cast<uint8_t>(m));
        t.high[m] = static_cast<uint8_t>(t.bits[m] >> 8), t.low[m] = static_cast<uint8_t>(t.bits[m]);
      }
      return t;
    }();
    bits_ = table.bits, pair_order_ = table.pair_order;
#if defined(ATTNKIT_ISA_avx512)
    for (int t = 0; t < 4; ++t) table_[t] = _mm512_load_si512(table.bits + 32 * t);
#endif
#if defined(__AVX512VBMI__)
    for (int t = 0; t < 2; ++t) {
      high_[t] = _mm512_load_si512(table.high + 64 * t), low_[t] = _mm512_load_si512(table.low + 64 * t);
    }
#endif
  }

  // dst[i] = bf16 bits of src[i * stride] · 2^exponent for i < n (the vector path at
  // stride 1). The scaling adds to the exponent field of every finite nonzero value, exact
  // where the results stay normal: |exponent| <= kMaxExponent for either fp8 format.
  static constexpr int kMaxExponent = 100;
  void row(const uint8_t* src, int64_t stride, int64_t n, uint16_t* dst, int exponent = 0) const {
    int64_t i = 0;
    const uint16_t shift = static_cast<uint16_t>(exponent * 128);  // the exponent field's unit, mod 2^16
#if defined(__AVX512VBMI__)
    // Source bytes 8L .. 8L+7 and 32+8L .. 32+8L+7 into 128-bit lane L, so that the in-lane
    // byte interleaves give elements 0-31 (low halves) and 32-63 (high halves) in order.
    const __m512i order = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 31, 30, 29, 28, 27, 26, 25, 24,  //
                                          55, 54, 53, 52, 51, 50, 49, 48, 23, 22, 21, 20, 19, 18, 17, 16,  //
                                          47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12, 11, 10, 9, 8,    //
                                          39, 38, 37, 36, 35, 34, 33, 32, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i sign_byte = _mm512_set1_epi8(static_cast<char>(0x80));
    // Finite nonzero magnitudes take the exponent: bf16 magnitudes 1 .. kMaxFiniteMagnitude's, by
    // m - 1 below the latter, unsigned (the table is monotone, magnitude 0 is 0).
    const __m512i magnitude_bits = _mm512_set1_epi16(0x7FFF), one = _mm512_set1_epi16(1);
    const __m512i finite_max_bits = _mm512_set1_epi16(static_cast<short>(bits_[kMaxFiniteMagnitude]));
    const __m512i word_shift = _mm512_set1_epi16(static_cast<short>(shift));
    auto scaled = [&](__m512i w) {
      const __m512i m = _mm512_sub_epi16(_mm512_and_si512(w, magnitude_bits), one);
      return _mm512_mask_add_epi16(w, _mm512_cmplt_epu16_mask(m, finite_max_bits), w, word_shift);
    };
    for (; stride == 1 && i + 64 <= n; i += 64) {
      // (the zero-masking form: GCC 12 warns inside the unmasked intrinsic)
      const __m512i x = _mm512_maskz_permutexvar_epi8(~__mmask64{0}, order, _mm512_loadu_si512(src + i));
      const __m512i low = _mm512_permutex2var_epi8(low_[0], x, low_[1]);  // indices' low 7 bits
      // the high byte | (x & 0x80): the sign from bit 7
      const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high_[0], x, high_[1]), x, sign_byte, 0xF8);
      __m512i first = _mm512_unpacklo_epi8(low, high), second = _mm512_unpackhi_epi8(low, high);
      if (exponent) first = scaled(first), second = scaled(second);
      _mm512_storeu_si512(dst + i, first);
      _mm512_storeu_si512(dst + i + 32, second);
    }
#endif
#if defined(ATTNKIT_ISA_avx512)
    const __m512i sign_bit = _mm512_set1_epi16(static_cast<short>(0x8000)), bit6 = _mm512_set1_epi16(0x40);
    const __m512i low7 = _mm512_set1_epi16(0x7F), finite_max = _mm512_set1_epi16(kMaxFiniteMagnitude);
    const __m512i vshift = _mm512_set1_epi16(static_cast<short>(shift));
    for (; stride == 1 && i + 32 <= n; i += 32) {
      const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
      // permutex2var reads the index's low 6 bits: magnitudes 0-63 from the first pair of
      // registers, 64-127 from the second.
      const __m512i low = _mm512_permutex2var_epi16(table_[0], x, table_[1]);
      const __m512i high = _mm512_permutex2var_epi16(table_[2], x, table_[3]);
      __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, bit6), low, high);
      if (exponent) {  // magnitudes 1 .. kMaxFiniteMagnitude: m - 1 below it, unsigned
        const __mmask32 scaled = _mm512_cmplt_epu16_mask(_mm512_sub_epi16(_mm512_and_si512(x, low7), _mm512_set1_epi16(1)),
                                                         finite_max);
        magnitude = _mm512_mask_add_epi16(magnitude, scaled, magnitude, vshift);
      }
      // magnitude | ((x << 8) & 0x8000): the sign from bit 7
      const __m512i bf16 = _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(x, 8), sign_bit, 0xF8);
      _mm512_storeu_si512(dst + i, bf16);
    }
#endif
    // The tail from the table itself (reading table_'s registers through a uint16_t pointer
    // broke strict aliasing: garbage where the object was a temporary).
    for (; i < n; ++i) {
      const uint8_t x = src[i * stride];
      const int m = x & 0x7F;
      const uint16_t magnitude = bits_[m] + (m >= 1 && m <= kMaxFiniteMagnitude ? shift : 0);
      dst[i] = static_cast<uint16_t>(magnitude | (x & 0x80) << 8);
    }
  }

  // Whether pairs() has a vector path (VBMI), where it beats row() and an interleave pass.
#if defined(__AVX512VBMI__)
  static constexpr bool kVectorPairs = true;
#else
  static constexpr bool kVectorPairs = false;
#endif

  // dst[i] = the bf16 bits of a[i] | those of b[i] << 16 for i < n (b null: zero high
  // halves): two rows of unit stride straight into pairs of rows, as a P·V B operand takes
  // V. With VBMI one permute gathers 32 elements of each row in pair order, then row()'s
  // lookups: no bf16 rows written and read back.
  void pairs(const uint8_t* a, const uint8_t* b, int64_t n, uint32_t* dst) const {
    int64_t i = 0;
#if defined(__AVX512VBMI__)
    const __m512i order = _mm512_load_si512(pair_order_), sign_byte = _mm512_set1_epi8(static_cast<char>(0x80));
    constexpr __mmask64 kHalf = 0xFFFFFFFFu;  // 32 bytes
    for (; i + 32 <= n; i += 32) {
      const __m512i av = _mm512_maskz_loadu_epi8(kHalf, a + i);
      const __m512i bv = b ? _mm512_maskz_loadu_epi8(kHalf, b + i) : _mm512_setzero_si512();
      const __m512i x = _mm512_permutex2var_epi8(av, order, bv);
      const __m512i low = _mm512_permutex2var_epi8(low_[0], x, low_[1]);
      const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high_[0], x, high_[1]), x, sign_byte, 0xF8);
      _mm512_storeu_si512(dst + i, _mm512_unpacklo_epi8(low, high));
      _mm512_storeu_si512(dst + i + 16, _mm512_unpackhi_epi8(low, high));
    }
#endif
    for (; i < n; ++i) dst[i] = uint32_t{word(a[i])} | (b ? uint32_t{word(b[i])} << 16 : 0u);
  }

 private:
  uint16_t word(uint8_t x) const { return static_cast<uint16_t>(bits_[x & 0x7F] | (x & 0x80) << 8); }

  struct alignas(64) Table {
    uint16_t bits[128];         // bf16 bits of the fp8 magnitudes 0..127
    uint8_t high[128], low[128];  // their high and low bytes
    uint8_t pair_order[64];       // pairs()' permutation
  };
  // The largest finite magnitude's code: e4m3fn's 0x7F is NaN, e5m2's 0x7C and up inf / NaN.
  static constexpr int kMaxFiniteMagnitude = T == DType::float8_e4m3fn ? 0x7E : 0x7B;
  const uint16_t* bits_;  // Table::bits
  const uint8_t* pair_order_;  // Table::pair_order
#if defined(ATTNKIT_ISA_avx512)
  __m512i table_[4];
#endif
#if defined(__AVX512VBMI__)
  __m512i high_[2], low_[2];
#endif
};

// dst[i] = load(src[i * stride]) * scale for i < n.
template <DType T>
inline void load_row(const typename Elem<T>::type* src, int64_t stride, int64_t n, float scale,
                     float* dst) {
  if (stride == 1) {
    const vfloat vs = vbroadcast(scale);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vload_as_float<T>(src + i) * vs);
    for (; i < n; ++i) dst[i] = Elem<T>::load(src[i]) * scale;
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = Elem<T>::load(src[i * stride]) * scale;
  }
}

// fp32 -> bf16 bits in the low half of each lane: round to nearest even, overflow to inf,
// NaN lanes to nan_bits. (Vector extensions: GCC 12 warns inside the masked AVX-512 shift
// intrinsics.)
inline vuint round_to_bf16_bits(vfloat x, uint32_t nan_bits) {
  const vuint u = (vuint)x;
  const vuint rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? vuint{} + nan_bits : rounded;
}

inline constexpr uint32_t kBf16QuietNan = 0x7FC0;  // bf16 pairs of P and V: NaN stays NaN

// (lo[i], hi[i]) rounded to bf16 as round_to_bf16_bits(·, kBf16QuietNan) in lane i, lo in
// the low half; for the softmax's P (and the backward's dS). With AVX512_BF16 one conversion
// and one permute: a NaN stays a NaN (sign and payload kept, quieted) and subnormal inputs
// (|x| < 2^-126) flush to zero: the forward's P never is one (vexp2 returns 0 below 2^-126);
// the backward's P with a sink and its dS can be, and lose under 1.2e-38 each.
#if defined(ATTNKIT_ISA_avx512bf16)
// Words 0..15 and 16..31 interleaved: word i to lane i's low half, word 16 + i to its high half.
inline vuint interleave_bf16_halves(__m512i both) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return (vuint)_mm512_permutexvar_epi16(order, both);
}
#endif

inline vuint bf16_pairs(vfloat lo, vfloat hi) {
#if defined(ATTNKIT_ISA_avx512bf16)
  return interleave_bf16_halves((__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));  // lo's in words 0..15
#else
  return round_to_bf16_bits(lo, kBf16QuietNan) | (round_to_bf16_bits(hi, kBf16QuietNan) << 16);
#endif
}

// lo and hi rounded as bf16_pairs does, in two layouts from one conversion: the pairs
// (returned) and the two rows of kLanes bf16 values (written to lo_row, and to hi_row unless
// null). For the backward's dS, which one product reads in pairs of query rows and another
// along the keys.
inline vuint bf16_pairs_and_rows(vfloat lo, vfloat hi, uint16_t* lo_row, uint16_t* hi_row) {
#if defined(ATTNKIT_ISA_avx512bf16)
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
  // The halves by shufflevector: GCC 12 warns inside the 256-bit extract intrinsics.
  const vuint lanes = (vuint)both;
  const auto lo_half = __builtin_shufflevector(lanes, lanes, 0, 1, 2, 3, 4, 5, 6, 7);
  const auto hi_half = __builtin_shufflevector(lanes, lanes, 8, 9, 10, 11, 12, 13, 14, 15);
  std::memcpy(lo_row, &lo_half, sizeof lo_half);
  if (hi_row) std::memcpy(hi_row, &hi_half, sizeof hi_half);
  return interleave_bf16_halves(both);
#else
  const vuint l = round_to_bf16_bits(lo, kBf16QuietNan), h = round_to_bf16_bits(hi, kBf16QuietNan);
  const vhalf rows[2] = {__builtin_convertvector(l, vhalf), __builtin_convertvector(h, vhalf)};
  std::memcpy(lo_row, &rows[0], sizeof rows[0]);
  if (hi_row) std::memcpy(hi_row, &rows[1], sizeof rows[1]);
  return l | h << 16;
#endif
}

// Rows 2i and 2i + 1 of an n-row fp32 matrix (rows of ld floats, ld a multiple of kLanes)
// rounded to bf16 and paired into row i of dst, rows of ld pairs, their first `cols` columns
// (a multiple of kLanes; all ld by default); an odd last row pairs with zeros. dst may be
// src: each vector is read before its place is written.
inline void pair_rows_bf16(const float* src, int64_t n, int64_t ld, uint32_t* dst, int64_t cols = -1) {
  if (cols < 0) cols = ld;
  for (int64_t i = 0; i < (n + 1) / 2; ++i) {
    for (int64_t c = 0; c < cols; c += kLanes) {
      const vfloat lo = vload(src + 2 * i * ld + c);
      const vfloat hi = 2 * i + 1 < n ? vload(src + (2 * i + 1) * ld + c) : vfloat{};
      const vuint pair = round_to_bf16_bits(lo, kBf16QuietNan) | (round_to_bf16_bits(hi, kBf16QuietNan) << 16);
      std::memcpy(dst + i * ld + c, &pair, sizeof pair);
    }
  }
}

// n fp32 values (a multiple of kLanes) rounded to bf16 as pair_rows_bf16 does, consecutive
// ones paired: dst[i] = (src[2i], src[2i + 1]). dst may be src.
inline void pair_values_bf16(const float* src, int64_t n, uint32_t* dst) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const vhalf h = __builtin_convertvector(round_to_bf16_bits(vload(src + i), kBf16QuietNan), vhalf);
    std::memcpy(dst + i / 2, &h, sizeof h);
  }
}

// Two bf16 rows as pairs: dst[i] = (a[i], b[i]) for i < n (b null: zeros), zero up to
// n_pad; rows with element stride `stride`. The operand of vdpbf16ps along a key pair.
inline void interleave_bf16_rows(const uint16_t* a, const uint16_t* b, int64_t stride, int64_t n, int64_t n_pad,
                                 uint32_t* dst) {
  int64_t i = 0;
  if (stride == 1) {
    for (; i + kLanes <= n; i += kLanes) {
      const vuint lo = vload_widened(a + i);
      const vuint pair = b ? lo | vload_widened(b + i) << 16 : lo;
      std::memcpy(dst + i, &pair, sizeof pair);
    }
  }
  for (; i < n; ++i) dst[i] = uint32_t{a[i * stride]} | (b ? uint32_t{b[i * stride]} << 16 : 0u);
  for (; i < n_pad; ++i) dst[i] = 0;
}

// kLanes floats rounded to bf16 exactly as attnkit::float_to_bfloat16: every NaN to
// 0xFFFF (torch's vectorised kernel).
inline void vstore_bf16(uint16_t* dst, vfloat x) {
  const vhalf h = __builtin_convertvector(round_to_bf16_bits(x, 0xFFFFu), vhalf);
  std::memcpy(dst, &h, sizeof h);
}

// dst[i * stride] = store(src[i] * scale) for i < n, in T.
template <DType T>
inline void store_row(const float* src, float scale, int64_t n, typename Elem<T>::type* dst, int64_t stride) {
  int64_t i = 0;
  if (stride == 1 && T != DType::float16) {
    const vfloat vs = vbroadcast(scale);
    for (; i + kLanes <= n; i += kLanes) {
      if constexpr (T == DType::bfloat16) {
        vstore_bf16(dst + i, vload(src + i) * vs);
      } else if constexpr (T == DType::float32) {
        vstore(dst + i, vload(src + i) * vs);
      }
    }
  }
  for (; i < n; ++i) dst[i * stride] = Elem<T>::store(src[i] * scale);
}

// store_row for float16 with finite values past float16's range saturated to ±65504
// (inf and NaN stay): for outputs whose exact value is a convex combination of float16
// values, so lies within that range, but whose computation rounded those values up.
inline void store_row_float16_saturated(const float* src, float scale, int64_t n, uint16_t* dst, int64_t stride) {
  constexpr float kMax = 65504.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = src[i] * scale;
    dst[i * stride] = Elem<DType::float16>::store(std::isfinite(x) ? std::clamp(x, -kMax, kMax) : x);
  }
}

// Loads one mask element as an additive bias (bool false -> -inf).
inline float load_mask(DType dtype, const void* base, int64_t offset) {
  switch (dtype) {
    case DType::boolean:
      return static_cast<const uint8_t*>(base)[offset] ? 0.0f : -__builtin_inff();
    case DType::float16:
      return Elem<DType::float16>::load(static_cast<const uint16_t*>(base)[offset]);
    case DType::bfloat16:
      return Elem<DType::bfloat16>::load(static_cast<const uint16_t*>(base)[offset]);
    default:
      return static_cast<const float*>(base)[offset];
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
