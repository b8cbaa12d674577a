// Micro-kernel tests, compiled once per ISA (like the kernels) and skipped where this CPU
// lacks the ISA: the register-tiled GEMMs, the SIMD reductions, the key-block dots, the
// vector exp2 and tanh, the online-softmax updates and the dtype conversions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/runtime.h"
#include "attnkit/dtype.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/dot.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_amx.h"
#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/simd.h"
#include "cpu/kernels/softmax.h"

#define ISA_STR2(x) #x
#define ISA_STR(x) ISA_STR2(x)
#define ISA_TEST__(suite, isa, name) TEST(suite##_##isa, name)
#define ISA_TEST_(suite, isa, name) ISA_TEST__(suite, isa, name)
#define ISA_TEST(suite, name) ISA_TEST_(suite, ATTNKIT_ISA, name)

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

bool runnable() {
  const auto isas = attnkit::supported_isas();
  return std::find(isas.begin(), isas.end(), ISA_STR(ATTNKIT_ISA)) != isas.end();
}
#define SKIP_UNLESS_RUNNABLE() \
  if (!runnable()) GTEST_SKIP() << ISA_STR(ATTNKIT_ISA) " not supported on this CPU"

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

using GemmFn = void (*)(int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                       int64_t, bool);

template <int MR, int NV>
void gemm_unbanded(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, int64_t a_step, const float* b,
                   int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm<MR, NV>(m, n, k, a, lda, a_step, b, ldb, c, ldc, accumulate);
}

// Every edge tile of an MR × NV register tiling (run by `run`, gemm<MR, NV> unless given), A
// read row-major or transposed (a_step != 1), accumulating or not, against a float64 reference.
template <int MR, int NV>
void check_gemm(bool a_transposed, GemmFn run = &gemm_unbanded<MR, NV>) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const int64_t block_cols = NV * kLanes;
  for (int64_t m : {int64_t{1}, int64_t{MR - 1}, int64_t{MR}, int64_t{MR + 1}, int64_t{2 * MR + 3}}) {
    if (m < 1) continue;
    for (int64_t n : {int64_t{kLanes}, int64_t{2 * kLanes}, block_cols, block_cols + kLanes, 3 * block_cols - kLanes}) {
      for (int64_t k : {1, 7, 64, 129}) {
        for (bool accumulate : {false, true}) {
          // Padded strides; a(i, p) = a[i * lda + p * a_step].
          const int64_t lda = a_transposed ? 1 : k + 3, a_step = a_transposed ? m + 2 : 1;
          const int64_t ldb = n + kLanes, ldc = n + 2 * kLanes;
          std::vector<float> a((m + 2) * (k + 3)), b(k * ldb), c(m * ldc), c0;
          for (auto& x : a) x = dist(gen);
          for (auto& x : b) x = dist(gen);
          for (auto& x : c) x = dist(gen);
          c0 = c;
          run(m, n, k, a.data(), lda, a_step, b.data(), ldb, c.data(), ldc, accumulate);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < ldc; ++j) {
              if (j >= n) {  // outside the n columns nothing is written
                ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j]);
                continue;
              }
              double ref = accumulate ? c0[i * ldc + j] : 0.0;
              for (int64_t p = 0; p < k; ++p) ref += double(a[i * lda + p * a_step]) * b[p * ldb + j];
              ASSERT_NEAR(c[i * ldc + j], ref, 1e-5 * (k + 1))
                  << MR << "x" << NV << " m=" << m << " n=" << n << " k=" << k << " at (" << i << ", " << j << ")";
            }
          }
        }
      }
    }
  }
}

ISA_TEST(Gemm, TallTilesMatchFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  check_gemm<kTallRows, kTallVecs>(false);
  check_gemm<kTallRows, kTallVecs>(true);
}

ISA_TEST(Gemm, WideTilesMatchFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  check_gemm<kWideRows, kWideVecs>(false);
  check_gemm<kWideRows, kWideVecs>(true);
}

// gemm_wide: on AVX-512 8 × 3 tiles where C has at most 3 vectors of columns (m and n around
// those tiles' edges), the wide tiles beyond; elsewhere the wide tiles throughout.
ISA_TEST(Gemm, GemmWideMatchesFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  check_gemm<8, 3>(false, &gemm_wide);
  check_gemm<8, 3>(true, &gemm_wide);
}

// A banded A (a causal triangle): row i is non-zero at p in [lo(i), hi(i)), both growing
// with i; band(m0, m1) = [lo(m0), hi(m1 - 1)) reaches below 0, past k, or is empty. Each
// tile may read only its band: A holds zeros inside it outside the row's own range and NaN
// outside it (reading there shows), and the result must match the float64 sum over the row.
struct TestBand {
  int64_t lo_slope, lo_shift, hi_slope, hi_shift;
  int64_t lo(int64_t i) const { return lo_slope * i + lo_shift; }
  int64_t hi(int64_t i) const { return hi_slope * i + hi_shift; }
  std::pair<int64_t, int64_t> operator()(int64_t m0, int64_t m1) const { return {lo(m0), hi(m1 - 1)}; }
};
constexpr TestBand kTestBands[] = {{2, -4, 3, 1}, {1, 0, 4, -20}, {0, 3, 0, 1000}};

template <int MR, int NV>
void check_gemm_banded(bool a_transposed) {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (const TestBand& band : kTestBands) {
    for (int64_t m : {int64_t{1}, int64_t{MR + 1}, int64_t{2 * MR + 3}}) {
      for (int64_t n : {int64_t{kLanes}, int64_t{NV * kLanes + kLanes}}) {
        for (int64_t k : {1, 7, 64}) {
          for (bool accumulate : {false, true}) {
            const int64_t lda = a_transposed ? 1 : k + 3, a_step = a_transposed ? m + 2 : 1;
            const int64_t ldb = n + kLanes, ldc = n;
            std::vector<float> a((m + 2) * (k + 3), NAN), b(k * ldb), c(m * ldc), c0;
            for (int64_t i = 0; i < m; ++i) {
              const int64_t m0 = i / MR * MR;
              const auto [p0, p1] = band(m0, std::min(m, m0 + MR));
              for (int64_t p = std::max<int64_t>(p0, 0); p < std::min(p1, k); ++p) {
                a[i * lda + p * a_step] = p >= band.lo(i) && p < band.hi(i) ? dist(gen) : 0.0f;
              }
            }
            for (auto& x : b) x = dist(gen);
            for (auto& x : c) x = dist(gen);
            c0 = c;
            gemm<MR, NV>(m, n, k, a.data(), lda, a_step, b.data(), ldb, c.data(), ldc, accumulate, band);
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                double ref = accumulate ? c0[i * ldc + j] : 0.0;
                for (int64_t p = std::max<int64_t>(band.lo(i), 0); p < std::min(band.hi(i), k); ++p) {
                  ref += double(a[i * lda + p * a_step]) * b[p * ldb + j];
                }
                ASSERT_NEAR(c[i * ldc + j], ref, 1e-5 * (k + 1))
                    << MR << "x" << NV << " m=" << m << " n=" << n << " k=" << k << " at (" << i << ", " << j << ")";
              }
            }
          }
        }
      }
    }
  }
}

ISA_TEST(Gemm, BandedTilesReadOnlyTheirBand) {
  SKIP_UNLESS_RUNNABLE();
  check_gemm_banded<kTallRows, kTallVecs>(false);
  check_gemm_banded<kTallRows, kTallVecs>(true);
  check_gemm_banded<kWideRows, kWideVecs>(false);
}

// The bf16-B overload: B's rows read in place as bf16 (NaN-padded beyond n, so reading past
// n shows), C's columns in split order (split_bf16_column); NaN-poisoned C must be fully
// written, and C's padding columns and the row after the last stay untouched. gemm<MR, NV>
// tiles 2·kLanes columns at a time in NV / 2 pairs of vectors (one pair where NV is 3).
template <int MR, int NV>
void check_gemm_split_bf16(bool a_transposed) {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t m : {int64_t{1}, int64_t{MR - 1}, int64_t{MR}, int64_t{MR + 1}, int64_t{2 * MR + 3}}) {
    if (m < 1) continue;
    for (int64_t n : {2 * kLanes, 4 * kLanes, 6 * kLanes, 10 * kLanes}) {
      for (int64_t k : {1, 7, 64, 129}) {
        for (bool accumulate : {false, true}) {
          const int64_t lda = a_transposed ? 1 : k + 3, a_step = a_transposed ? m + 2 : 1;
          const int64_t ldb = n + kLanes + 1, ldc = n + 2 * kLanes;  // odd ldb: unaligned rows
          std::vector<float> a((m + 2) * (k + 3), NAN), c((m + 1) * ldc), c0;
          std::vector<uint16_t> b(k * ldb, 0xFFFF);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t p = 0; p < k; ++p) a[i * lda + p * a_step] = dist(gen);
          }
          for (int64_t p = 0; p < k; ++p) {
            for (int64_t d = 0; d < n; ++d) b[p * ldb + d] = float_to_bfloat16(dist(gen));
          }
          for (int64_t i = 0; i < m + 1; ++i) {
            for (int64_t j = 0; j < ldc; ++j) c[i * ldc + j] = i < m && j < n && !accumulate ? NAN : dist(gen);
          }
          c0 = c;
          gemm<MR, NV>(m, n, k, a.data(), lda, a_step, b.data(), ldb, c.data(), ldc, accumulate);
          for (int64_t i = 0; i < m + 1; ++i) {
            for (int64_t j = n; j < ldc; ++j) ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j]) << "(" << i << ", " << j << ")";
            for (int64_t d = 0; d < n && i == m; ++d) ASSERT_EQ(c[i * ldc + d], c0[i * ldc + d]) << "row m, " << d;
            for (int64_t d = 0; d < n && i < m; ++d) {
              const int64_t j = split_bf16_column(d);
              double ref = accumulate ? c0[i * ldc + j] : 0.0;
              for (int64_t p = 0; p < k; ++p) ref += double(a[i * lda + p * a_step]) * bfloat16_to_float(b[p * ldb + d]);
              ASSERT_NEAR(c[i * ldc + j], ref, 1e-5 * (k + 1)) << MR << "x" << NV << " m=" << m << " n=" << n
                                                                << " k=" << k << " acc=" << accumulate << " at (" << i
                                                                << ", " << d << ")";
            }
          }
        }
      }
    }
  }
}

ISA_TEST(Gemm, SplitBf16TallTilesMatchFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  check_gemm_split_bf16<kTallRows, kTallVecs>(false);
  check_gemm_split_bf16<kTallRows, kTallVecs>(true);
}

ISA_TEST(Gemm, SplitBf16WideTilesMatchFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  check_gemm_split_bf16<kWideRows, kWideVecs>(false);
  check_gemm_split_bf16<kWideRows, kWideVecs>(true);
}

// Split order within each 2·kLanes block: even columns in the first vector, odd in the second.
ISA_TEST(Gemm, SplitBf16ColumnIsAPermutation) {
  SKIP_UNLESS_RUNNABLE();
  for (int64_t n : {2 * kLanes, 4 * kLanes, 10 * kLanes}) {
    std::vector<int> seen(n, 0);
    for (int64_t d = 0; d < n; ++d) {
      const int64_t j = split_bf16_column(d);
      ASSERT_TRUE(j >= 0 && j < n) << d;
      EXPECT_EQ(j / (2 * kLanes), d / (2 * kLanes)) << d;  // stays in its block
      ++seen[j];
    }
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(seen[j], 1) << "n=" << n << " column " << j;
  }
  EXPECT_EQ(split_bf16_column(1), kLanes);
  EXPECT_EQ(split_bf16_column(2 * kLanes + 3), 3 * kLanes + 1);
}

ISA_TEST(Exp2, AccurateAndExactAtTheEdges) {
  SKIP_UNLESS_RUNNABLE();
  float worst = 0.0f;
  for (float x = -126.0f; x <= 0.0f; x += 0.00731f) {
    const float got = vexp2(vbroadcast(x))[0];
    const double ref = std::exp2(double(x));
    worst = std::max(worst, float(std::fabs(got - ref) / ref));
  }
  EXPECT_LT(worst, 1.2e-7f) << worst;  // about 1 ulp (the polynomial alone: 2e-9)
  EXPECT_EQ(vexp2(vbroadcast(0.0f))[0], 1.0f);
  EXPECT_EQ(vexp2(vbroadcast(-INFINITY))[0], 0.0f);
  EXPECT_EQ(vexp2(vbroadcast(-127.5f))[0], 0.0f);
  EXPECT_TRUE(std::isnan(vexp2(vbroadcast(NAN))[0]));
}

// The bf16 softmax's form: 3e-6 relative up to the lazy max's 2^8 and beyond, the same edges.
ISA_TEST(Exp2, ForBf16WithinItsBoundAndExactAtTheEdges) {
  SKIP_UNLESS_RUNNABLE();
  float worst = 0.0f;
  for (float x = -126.0f; x <= 16.0f; x += 0.00731f) {
    const float got = vexp2<true>(vbroadcast(x))[0];
    const double ref = std::exp2(double(x));
    worst = std::max(worst, float(std::fabs(got - ref) / ref));
  }
  EXPECT_LT(worst, 3.2e-6f) << worst;  // the polynomial alone: 2.9e-6
  EXPECT_GT(worst, 1e-6f) << worst;    // and not the accurate form
  EXPECT_EQ(vexp2<true>(vbroadcast(0.0f))[0], 1.0f);
  EXPECT_EQ(vexp2<true>(vbroadcast(-INFINITY))[0], 0.0f);
  EXPECT_EQ(vexp2<true>(vbroadcast(-127.5f))[0], 0.0f);
  EXPECT_TRUE(std::isnan(vexp2<true>(vbroadcast(NAN))[0]));
}

// vtanh against tanh in double over every 61st float of both signs (all exponents, the
// |x| = 1 branch border, subnormals), lanes mixed so that vectors take either branch and
// both at once; error in units of the float result's last place.
ISA_TEST(Tanh, WithinThreeUlpOverAllFloats) {
  SKIP_UNLESS_RUNNABLE();
  double worst = 0.0;
  float worst_x = 0.0f;
  vfloat x{};
  int lane = 0;
  auto check = [&]() {
    const vfloat got = vtanh(x);
    for (int i = 0; i < kLanes; ++i) {
      const double ref = std::tanh(double(x[i]));
      const float ref32 = float(ref);
      const double ulp = std::nextafter(std::fabs(ref32), INFINITY) - std::fabs(ref32);
      const double err = std::fabs(double(got[i]) - ref) / ulp;
      if (err > worst) worst = err, worst_x = x[i];
    }
  };
  for (uint32_t bits = 0; bits < 0x7F800000u; bits += 61) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    x[lane] = lane % 3 == 1 ? -f : f;
    if (lane % 5 == 4) x[lane] = 0.5f * x[lane];  // pulls some lanes under 1 next to large ones
    if (++lane == kLanes) check(), lane = 0;
  }
  EXPECT_LT(worst, 3.0) << "worst at x = " << worst_x;
  for (float v : {0.0f, 1.0f, -1.0f, 20.0f, -20.0f}) {
    EXPECT_NEAR(vtanh(vbroadcast(v))[0], std::tanh(v), 2e-7f) << v;
  }
  EXPECT_EQ(vtanh(vbroadcast(INFINITY))[0], 1.0f);
  EXPECT_EQ(vtanh(vbroadcast(-INFINITY))[0], -1.0f);
  EXPECT_TRUE(std::signbit(vtanh(vbroadcast(-0.0f))[0]));
  EXPECT_TRUE(std::isnan(vtanh(vbroadcast(NAN))[0]));
  vfloat mixed = vbroadcast(0.25f);
  mixed[0] = NAN, mixed[1] = 3.0f;
  const vfloat m = vtanh(mixed);
  EXPECT_TRUE(std::isnan(m[0]));
  EXPECT_NEAR(m[1], std::tanh(3.0f), 2e-7f);
}

// vsoftcap(s, c, 1/c) = c·tanh(s / c) for caps around real models' (Gemma 2: 50 and 30,
// Grok: 30) and small ones, on scores from 1e-6 to 1e4 of both signs: within 3.5 ulp of
// the result (tanh's 2 and the rounding of s / c).
ISA_TEST(Tanh, SoftcapWithinFourUlp) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(5);
  std::uniform_real_distribution<double> exponent(-6.0, 4.0);
  for (float c : {0.5f, 1.0f, 7.5f, 30.0f, 50.0f}) {
    double worst = 0.0;
    for (int trial = 0; trial < 20000; ++trial) {
      vfloat s;
      for (int i = 0; i < kLanes; ++i) s[i] = float((i % 2 ? -1.0 : 1.0) * std::pow(10.0, exponent(gen)));
      const vfloat got = vsoftcap(s, vbroadcast(c), vbroadcast(1.0f / c));
      for (int i = 0; i < kLanes; ++i) {
        const double ref = double(c) * std::tanh(double(s[i]) / double(c));
        const float ref32 = float(ref);
        const double ulp = std::nextafter(std::fabs(ref32), INFINITY) - std::fabs(ref32);
        worst = std::max(worst, std::fabs(double(got[i]) - ref) / ulp);
      }
    }
    EXPECT_LT(worst, 3.5) << "c = " << c;
    EXPECT_EQ(vsoftcap(vbroadcast(INFINITY), vbroadcast(c), vbroadcast(1.0f / c))[0], c);
    EXPECT_EQ(vsoftcap(vbroadcast(-INFINITY), vbroadcast(c), vbroadcast(1.0f / c))[0], -c);
  }
}

// Lane j of transpose_sum is the sum of v[j]'s lanes; every value differs, so a lane or
// vector permutation changes some sum. Tolerance: the sum order differs from the reference.
ISA_TEST(Simd, TransposeSumSumsEachVector) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(13);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int trial = 0; trial < 100; ++trial) {
    vfloat v[kLanes], v0[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      for (int i = 0; i < kLanes; ++i) v[j][i] = dist(gen) * float(1 + j + kLanes * i);
      v0[j] = v[j];
    }
    const vfloat got = transpose_sum(v);
    for (int j = 0; j < kLanes; ++j) {
      double ref = 0.0, mag = 0.0;
      for (int i = 0; i < kLanes; ++i) ref += v0[j][i], mag += std::fabs(v0[j][i]);
      ASSERT_NEAR(got[j], ref, 1e-6 * mag) << "trial " << trial << " lane " << j;
    }
  }
}

// transpose_segments<G>: afterwards segment n of v[r] is what segment r of v[n] was.
template <int G>
void check_transpose_segments() {
  constexpr int seg = kLanes / G;
  vfloat v[G], v0[G];
  for (int r = 0; r < G; ++r) {
    for (int i = 0; i < kLanes; ++i) v[r][i] = float(100 * r + i);
    v0[r] = v[r];
  }
  transpose_segments<G>(v);
  for (int r = 0; r < G; ++r) {
    for (int i = 0; i < kLanes; ++i) ASSERT_EQ(v[r][i], v0[i / seg][r * seg + i % seg]) << "G=" << G << " r=" << r << " lane " << i;
  }
}
ISA_TEST(Simd, TransposeSegments) {
  SKIP_UNLESS_RUNNABLE();
  check_transpose_segments<1>();
  if constexpr (kMaxRowsPerVector >= 2) check_transpose_segments<2>();
  if constexpr (kMaxRowsPerVector >= 4) check_transpose_segments<4>();
}

// transpose_matrix over several blocks each way, with row strides wider than the matrix:
// every element lands at its transposed place, and nothing else in dst is written.
ISA_TEST(Simd, TransposeMatrixMovesEveryElement) {
  SKIP_UNLESS_RUNNABLE();
  const int64_t rows = 3 * kLanes, cols = 2 * kLanes, lds = cols + kLanes, ld = rows + 5;
  std::vector<float> src(rows * lds), dst(cols * ld + 1, -1.0f);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i);
  transpose_matrix(src.data(), lds, rows, cols, dst.data(), ld);
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < ld; ++r) {
      const float want = r < rows ? src[r * lds + c] : -1.0f;
      ASSERT_EQ(dst[c * ld + r], want) << "row " << r << " col " << c;
    }
  }
  EXPECT_EQ(dst[cols * ld], -1.0f);
}

#if defined(ATTNKIT_ISA_avx512)
// lane_sums: lane i is the sum of vector i's lanes. Small integers (exact in any order), each
// vector's lanes and each vector's total distinct, so a lane taken from the wrong vector or
// summed twice shows.
ISA_TEST(Simd, LaneSumsSumEachVector) {
  SKIP_UNLESS_RUNNABLE();
  vfloat v[kLanes];
  for (int r = 0; r < kLanes; ++r) {
    for (int i = 0; i < kLanes; ++i) v[r][i] = float((r * 37 + i * 11) % 23 + (i == r ? 100 * r : 0));
  }
  const vfloat sums = lane_sums(v);
  for (int r = 0; r < kLanes; ++r) {
    float want = 0.0f;
    for (int i = 0; i < kLanes; ++i) want += v[r][i];
    ASSERT_EQ(sums[r], want) << "vector " << r;
  }
}
#endif

ISA_TEST(Simd, AnyGreaterComparesLanewise) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(17);
  std::normal_distribution<float> dist;
  vfloat b;
  for (int i = 0; i < kLanes; ++i) b[i] = dist(gen);
  const vfloat nan = vbroadcast(NAN);
  EXPECT_FALSE(any_greater(b, b));                    // equal lanes
  EXPECT_FALSE(any_greater(b - 1.0f, b));             // all smaller
  EXPECT_TRUE(any_greater(b + 1.0f, b));              // all greater
  EXPECT_FALSE(any_greater(nan, b));                  // NaN compares false ...
  EXPECT_FALSE(any_greater(b, nan));
  EXPECT_FALSE(any_greater(nan, nan));
  EXPECT_FALSE(any_greater(vbroadcast(INFINITY), vbroadcast(INFINITY)));
  EXPECT_TRUE(any_greater(vbroadcast(-FLT_MAX), vbroadcast(-INFINITY)));
  for (int i = 0; i < kLanes; ++i) {
    vfloat a = b;
    a[i] = std::nextafter(b[i], INFINITY);  // one lane greater by one ulp
    EXPECT_TRUE(any_greater(a, b)) << "lane " << i;
    EXPECT_FALSE(any_greater(b, a)) << "lane " << i;
    a = b - 1.0f;
    a[i] = b[i] + 1.0f;
    a[(i + 1) % kLanes] = NAN;  // ... but does not hide a greater lane elsewhere
    EXPECT_TRUE(any_greater(a, b)) << "lane " << i;
    EXPECT_EQ(lanes_greater(a, b), 1u << i) << "lane " << i;  // and names it
    a[i] = NAN;
    EXPECT_FALSE(any_greater(a, b)) << "lane " << i;
  }
}

// The row groupings a decode block can take on this ISA, and key-row lengths (elements, or
// bf16 pairs) for each: one chunk, a few, an odd count, and 16 chunks (Q held in registers).
std::vector<int> row_groupings() {
  std::vector<int> gs;
  for (int g = 1; g <= kMaxRowsPerVector; g *= 2) gs.push_back(g);
  return gs;
}
std::vector<int64_t> key_lengths(int g) {
  const int64_t seg = kLanes / g;
  return {seg, 2 * seg, 5 * seg, 16 * seg, 128};
}

// dot_key_block over every grouping on padded strides: keys and q are NaN past k (reading
// them shows), s is NaN inside [rows][kLanes] (must be fully written) and a sentinel
// elsewhere (must stay).
ISA_TEST(Dot, KeyBlockMatchesFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(19);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int g : row_groupings()) {
    for (int64_t rows = 1; rows <= kMaxDotRows; ++rows) {
      for (int64_t k : key_lengths(g)) {
        const int64_t ldk = k + 3, ldq = k + 5, lds = kLanes + 3, chunks = k / (kLanes / g);
        std::vector<float> keys(kLanes * ldk, NAN), q(rows * ldq, NAN), s((rows + 1) * lds, 12345.0f);
        std::vector<float> qg((rows + g) * (k + kLanes), NAN);
        for (int64_t j = 0; j < kLanes; ++j) {
          for (int64_t p = 0; p < k; ++p) keys[j * ldk + p] = dist(gen);
        }
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t p = 0; p < k; ++p) q[r * ldq + p] = dist(gen);
          for (int64_t j = 0; j < kLanes; ++j) s[r * lds + j] = NAN;
        }
        group_rows(g, rows, k, q.data(), ldq, chunks, qg.data());
        dot_key_block(g, rows, chunks, keys.data(), ldk, qg.data(), s.data(), lds);
        for (int64_t r = 0; r < rows + 1; ++r) {
          for (int64_t j = 0; j < lds; ++j) {
            const std::string at = "g=" + std::to_string(g) + " rows=" + std::to_string(rows) + " k=" + std::to_string(k) +
                                   " at (" + std::to_string(r) + ", " + std::to_string(j) + ")";
            if (r == rows || j >= kLanes) {
              ASSERT_EQ(s[r * lds + j], 12345.0f) << at;
              continue;
            }
            double ref = 0.0, mag = 0.0;
            for (int64_t p = 0; p < k; ++p) {
              const double t = double(keys[j * ldk + p]) * q[r * ldq + p];
              ref += t, mag += std::fabs(t);
            }
            ASSERT_NEAR(s[r * lds + j], ref, 1e-6 * mag) << at;
          }
        }
      }
    }
  }
}

// group_rows: lane r * S + i of vector (b * chunks + c) is element c * S + i of row b * g + r,
// zero past the rows and past the columns; nothing past the grouped size is written.
ISA_TEST(Dot, GroupRowsLayout) {
  SKIP_UNLESS_RUNNABLE();
  for (int g : row_groupings()) {
    const int64_t seg = kLanes / g;
    for (int64_t rows : {1, 3, kMaxDotRows}) {
      for (int64_t cols : {seg - 1, 3 * seg, 3 * seg + 1}) {
        if (cols < 1) continue;
        const int64_t ldq = cols + 2, chunks = (cols + seg - 1) / seg, blocks = (rows + g - 1) / g;
        std::vector<float> q(rows * ldq);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t e = 0; e < ldq; ++e) q[r * ldq + e] = e < cols ? float(1000 * r + e + 1) : NAN;
        }
        std::vector<float> qg(blocks * chunks * kLanes + 7, -1.0f);
        group_rows(g, rows, cols, q.data(), ldq, chunks, qg.data());
        for (int64_t b = 0; b < blocks; ++b) {
          for (int64_t c = 0; c < chunks; ++c) {
            for (int64_t lane = 0; lane < kLanes; ++lane) {
              const int64_t r = b * g + lane / seg, e = c * seg + lane % seg;
              const float want = r < rows && e < cols ? float(1000 * r + e + 1) : 0.0f;
              ASSERT_EQ(qg[(b * chunks + c) * kLanes + lane], want) << "g=" << g << " rows=" << rows << " cols=" << cols;
            }
          }
        }
        for (int64_t i = blocks * chunks * kLanes; i < int64_t(qg.size()); ++i) ASSERT_EQ(qg[i], -1.0f);
      }
    }
  }
}

// Two tiles of transposed scores (keys × rows) folded one after the other give each row's
// exact softmax statistics, and the first tile's P rescaled by alpha matches the final max.
// With the lazy max (the default) m is a reference within the slack below the true max, and
// l and P are relative to it; row 4's max moves past the slack in tile 2, row 5's stays within.
ISA_TEST(OnlineSoftmax, TwoTilesEqualOneSoftmax) {
  SKIP_UNLESS_RUNNABLE();
  const int64_t rows = 2 * kLanes, ld = rows + kLanes, keys = 13;
  std::mt19937 gen(3);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> s(2 * keys * ld);
  for (auto& x : s) x = dist(gen);
  s[5 * ld + 1] = -INFINITY;                                   // one masked key of row 1
  for (int64_t j = 0; j < 2 * keys; ++j) s[j * ld + 2] = -INFINITY;  // row 2 sees nothing
  for (int64_t j = 0; j < keys; ++j) s[j * ld + 3] = -INFINITY;      // row 3 only in tile 2
  s[(keys + 4) * ld + 4] = 30.0f;                                     // row 4: far past the slack
  s[(keys + 4) * ld + 5] = s[ld + 5] + 0.5f * kLazyMaxSlack;         // row 5: within it
  for (int64_t j = 0; j < 2 * keys; ++j) {
    if (j != 1 && j != keys + 4) s[j * ld + 5] = std::min(s[j * ld + 5], s[ld + 5]);
  }
  for (bool exact_max : {true, false}) {
    std::vector<float> t = s, m(rows, -INFINITY), l(rows, 0.0f), alpha(rows);
    online_softmax_tile(t.data(), keys, ld, rows, m.data(), l.data(), alpha.data(), exact_max);
    const std::vector<float> m_first = m;
    online_softmax_tile(t.data() + keys * ld, keys, ld, rows, m.data(), l.data(), alpha.data(), exact_max);
    for (int64_t r = 0; r < rows; ++r) {
      double mx = -INFINITY, sum = 0.0;
      for (int64_t j = 0; j < 2 * keys; ++j) mx = std::max(mx, double(s[j * ld + r]));
      if (r == 2) {
        EXPECT_EQ(m[r], -INFINITY);
        EXPECT_EQ(l[r], 0.0f);
        for (int64_t j = 0; j < 2 * keys; ++j) EXPECT_EQ(t[j * ld + r], 0.0f);
        continue;
      }
      if (exact_max || r == 4) {
        EXPECT_EQ(m[r], float(mx)) << r;
      } else {
        EXPECT_LE(m[r], float(mx)) << r;
        EXPECT_GE(m[r], float(mx) - kLazyMaxSlack) << r;
      }
      if (!exact_max && r == 5) {
        EXPECT_EQ(m[r], m_first[r]) << r;  // kept: no rescale
      }
      for (int64_t j = 0; j < 2 * keys; ++j) sum += std::exp(double(s[j * ld + r]) - m[r]);
      EXPECT_NEAR(l[r], sum, 1e-5 * sum) << r;
      for (int64_t j = 0; j < keys; ++j) {
        const double want = std::exp(double(s[j * ld + r]) - m[r]);
        EXPECT_NEAR(t[j * ld + r] * alpha[r], want, 1e-6 * std::max(1.0, want)) << r;
      }
    }
    EXPECT_EQ(t[5 * ld + 1], 0.0f);
  }
}

// The bf16-pairs form of the tile update against the separate passes it replaces (Sᵀ *=
// scale, online_softmax_tile_of with the same lazy or exact max, pair_rows_bf16): the same max, each P rounded
// to bf16 and paired in place identically (up to the last bit: the scale is folded into
// the exponent's FMA), the sums within rounding; for 1..5 vectors of rows (the groups of 4
// and their tails), an odd key count, masked keys, a row that sees nothing, and a running
// max below the tile's by less (kept) and by more (moved) than the lazy slack.
ISA_TEST(OnlineSoftmax, Bf16PairsMatchSeparatePasses) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(21);
  std::normal_distribution<float> dist(0.0f, 20.0f);
  const float scale = 0.0883883f;
  int kept = 0, moved = 0;  // rows of running max 1.5 whose max the lazy slack kept / moved
  for (bool exact_max : {false, true}) {
    for (int64_t vecs : {1, 3, 4, 5}) {
      for (int64_t keys : {1, 6, 13}) {
        const int64_t rows = vecs * kLanes, ld = rows;
        std::vector<float> s(keys * ld);
        for (auto& x : s) x = dist(gen);
        s[(keys - 1) * ld + 1] = -INFINITY;                        // a masked key of row 1
        for (int64_t j = 0; j < keys; ++j) s[j * ld + 2] = -INFINITY;  // row 2 sees nothing
        s[(keys / 2) * ld + 3] = 10.0f / scale;  // row 3's max moves past the slack
        std::vector<float> a = s, b = s, ma(rows), la(rows, 2.0f), aa(rows), lb = la, ab(rows);
        for (int64_t r = 0; r < rows; ++r) ma[r] = r % 2 ? 1.5f : -20.0f;
        std::vector<float> mb = ma;
        for (auto& x : a) x *= scale;
        if (exact_max) {
          online_softmax_tile(a.data(), keys, ld, rows, ma.data(), la.data(), aa.data(), true);
        } else {
          online_softmax_tile_of<false, true>(a.data(), keys, ld, rows, 1.0f, ma.data(), la.data(), aa.data());
        }
        pair_rows_bf16(a.data(), keys, ld, reinterpret_cast<uint32_t*>(a.data()));
        online_softmax_tile_bf16_pairs(b.data(), keys, ld, rows, scale, mb.data(), lb.data(), ab.data(), exact_max);
        for (int64_t r = 0; r < rows; ++r) {
          if (!exact_max) (mb[r] == 1.5f ? kept : moved) += r % 2;
          ASSERT_EQ(mb[r], ma[r]) << vecs << " " << keys << " row " << r;
          ASSERT_EQ(ab[r], aa[r]) << vecs << " " << keys << " row " << r;
          // the fused form's exp2 is to 3e-6 (vexp2<true>), its scale and reference an ulp off
          ASSERT_NEAR(lb[r], la[r], 4e-6f * la[r]) << vecs << " " << keys << " row " << r;
          for (int64_t i = 0; i < (keys + 1) / 2; ++i) {
            uint32_t pa, pb;
            std::memcpy(&pa, &a[i * ld + r], 4);
            std::memcpy(&pb, &b[i * ld + r], 4);
            for (int half : {0, 16}) {  // each bf16 at most one unit in the last place apart
              const int32_t da = (pa >> half) & 0xFFFF, db = (pb >> half) & 0xFFFF;
              ASSERT_LE(std::abs(da - db), 1) << vecs << " " << keys << " row " << r << " pair " << i;
            }
            if (r == 2) {
              ASSERT_EQ(pb, 0u);
            }
          }
        }
      }
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(moved, 0);
}

// A NaN score never wins the running max: the max stays that of the other scores (so exp2
// never sees s - max > 0, whose exponent would overflow on avx2/generic), and the row's sum
// is NaN. Scores 3, NaN, 0.5 down the keys, in both layouts.
ISA_TEST(Softmax, NanScoreNeverWinsTheMax) {
  SKIP_UNLESS_RUNNABLE();
  const float keys[3] = {3.0f, NAN, 0.5f};
  std::vector<float> st(3 * kLanes), m(kLanes, -INFINITY), l(kLanes, 0.0f), alpha(kLanes);
  for (int j = 0; j < 3; ++j)
    for (int r = 0; r < kLanes; ++r) st[j * kLanes + r] = keys[j];
  online_softmax_tile(st.data(), 3, kLanes, kLanes, m.data(), l.data(), alpha.data());
  for (int r = 0; r < kLanes; ++r) {
    EXPECT_EQ(m[r], 3.0f) << "row " << r;
    EXPECT_TRUE(std::isnan(l[r])) << "row " << r;
    EXPECT_EQ(st[r], 1.0f) << "row " << r;  // e^(3 - 3)
  }
  std::vector<float> s(kLanes, -INFINITY);
  for (int j = 0; j < 3; ++j) s[j] = keys[j];
  float mr = -INFINITY, lr = 0.0f, ar;
  online_softmax_rows(s.data(), kLanes, kLanes, 1, &mr, &lr, &ar);
  EXPECT_EQ(mr, 3.0f);
  EXPECT_TRUE(std::isnan(lr));
  EXPECT_EQ(s[0], 1.0f);
}

// Row-major scores for online_softmax_rows: rows × two tiles of kKeys keys, row r at r * ld
// (tile 2 at + kKeys), with the cases the single-compare shortcut must get right.
constexpr int64_t kSoftmaxRows = 9, kKeys = 2 * kLanes, kSoftmaxLd = 2 * kKeys + 3;
std::vector<float> softmax_rows_scores() {
  std::mt19937 gen(23);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> s(kSoftmaxRows * kSoftmaxLd);
  for (auto& x : s) x = dist(gen);
  auto at = [&](int64_t r, int64_t j) -> float& { return s[r * kSoftmaxLd + j]; };
  at(1, kKeys + 5) = 40.0f;                                        // max moves in tile 2
  at(2, 3) = 40.0f;                                                // max stays in tile 2
  for (int64_t j = 0; j < 2 * kKeys; ++j) at(3, j) = -INFINITY;    // row 3 sees nothing
  for (int64_t j = 0; j < kKeys; ++j) at(4, j) = -INFINITY;        // row 4 only in tile 2
  at(5, 2) = at(5, kKeys + 1) = at(5, 2 * kKeys - 1) = -INFINITY;  // masked keys
  at(6, 7) = at(6, kKeys + 9) = 40.0f;                             // tile 2 ties the max
  at(7, 2 * kKeys - 1) = 40.0f;                                    // moves in the last lane only
  return s;
}

// Two row-major tiles folded one after the other give each row's running statistics after
// each tile; P = e^(s - m_new), alpha = e^(m_old - m_new), exactly 1 where the max stays.
// Padding, the row after the last and m/l/alpha past n_rows stay untouched.
ISA_TEST(OnlineSoftmax, RowsTwoTilesEqualOneSoftmax) {
  SKIP_UNLESS_RUNNABLE();
  const int64_t rows = kSoftmaxRows, ld = kSoftmaxLd;
  const std::vector<float> s = softmax_rows_scores();
  std::vector<float> t = s, m(rows + 1, -INFINITY), l(rows + 1, 0.0f), alpha(rows + 1, NAN);
  t.resize((rows + 1) * ld, 7.0f);
  m[rows] = l[rows] = alpha[rows] = 7.0f;
  std::vector<double> m_ref(rows, -INFINITY);
  for (int tile = 0; tile < 2; ++tile) {
    std::fill(alpha.begin(), alpha.begin() + rows, NAN);
    online_softmax_rows(t.data() + tile * kKeys, kKeys, ld, rows, m.data(), l.data(), alpha.data());
    for (int64_t r = 0; r < rows; ++r) {
      const double m_old = m_ref[r];
      for (int64_t j = tile * kKeys; j < (tile + 1) * kKeys; ++j) m_ref[r] = std::max(m_ref[r], double(s[r * ld + j]));
      EXPECT_EQ(m[r], float(m_ref[r])) << "tile " << tile << " row " << r;
      if (m_ref[r] == -INFINITY) {  // nothing visible yet: no NaN anywhere
        EXPECT_EQ(l[r], 0.0f) << r;
        EXPECT_TRUE(alpha[r] >= 0.0f && alpha[r] <= 1.0f) << r;
        for (int64_t j = tile * kKeys; j < (tile + 1) * kKeys; ++j) EXPECT_EQ(t[r * ld + j], 0.0f) << r;
        continue;
      }
      double sum = 0.0;
      for (int64_t j = 0; j < (tile + 1) * kKeys; ++j) sum += std::exp(double(s[r * ld + j]) - m_ref[r]);
      EXPECT_NEAR(l[r], sum, 1e-5 * sum) << "tile " << tile << " row " << r;
      if (m_ref[r] == m_old) {
        EXPECT_EQ(alpha[r], 1.0f) << "tile " << tile << " row " << r;
      } else {
        EXPECT_NEAR(alpha[r], std::exp(m_old - m_ref[r]), 1e-6) << "tile " << tile << " row " << r;
      }
      for (int64_t j = tile * kKeys; j < (tile + 1) * kKeys; ++j) {
        EXPECT_NEAR(t[r * ld + j], std::exp(double(s[r * ld + j]) - m_ref[r]), 1e-6) << "tile " << tile << " row " << r;
        if (s[r * ld + j] == -INFINITY) {
          EXPECT_EQ(t[r * ld + j], 0.0f) << r << ", " << j;
        }
      }
    }
  }
  for (int64_t r = 0; r < rows + 1; ++r) {
    for (int64_t j = r < rows ? 2 * kKeys : 0; j < ld; ++j) EXPECT_EQ(t[r * ld + j], r < rows ? s[r * ld + j] : 7.0f);
  }
  EXPECT_EQ(m[rows], 7.0f);
  EXPECT_EQ(l[rows], 7.0f);
  EXPECT_EQ(alpha[rows], 7.0f);
}

// The row-major update agrees with the transposed one on the same scores: same m, l within
// 1e-6 relative (the sum order differs), P and alpha alike (alpha only where a key was seen:
// a row with none has alpha 1 here and 0 there, both harmless as its l and output are 0).
ISA_TEST(OnlineSoftmax, RowsAgreeWithTransposedTile) {
  SKIP_UNLESS_RUNNABLE();
  const int64_t rows = kSoftmaxRows, ld = kSoftmaxLd, ldt = (rows + kLanes - 1) / kLanes * kLanes;
  std::vector<float> s = softmax_rows_scores(), st(2 * kKeys * ldt, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < 2 * kKeys; ++j) st[j * ldt + r] = s[r * ld + j];
  }
  std::vector<float> m(ldt, -INFINITY), l(ldt, 0.0f), alpha(ldt), mt = m, lt = l, alphat = alpha;
  for (int tile = 0; tile < 2; ++tile) {
    online_softmax_rows(s.data() + tile * kKeys, kKeys, ld, rows, m.data(), l.data(), alpha.data());
    online_softmax_tile(st.data() + tile * kKeys * ldt, kKeys, ldt, ldt, mt.data(), lt.data(), alphat.data(), true);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(m[r], mt[r]) << "tile " << tile << " row " << r;
      EXPECT_NEAR(l[r], lt[r], 1e-6 * lt[r]) << "tile " << tile << " row " << r;
      if (m[r] != -INFINITY) {
        EXPECT_NEAR(alpha[r], alphat[r], 1e-7) << "tile " << tile << " row " << r;
      }
      for (int64_t j = tile * kKeys; j < (tile + 1) * kKeys; ++j) EXPECT_NEAR(s[r * ld + j], st[j * ldt + r], 1e-7) << r;
    }
  }
}

// The vector widening loads agree bit for bit with the scalar conversions of
// attnkit/dtype.h, for every code of each narrow type (NaN for NaN).
template <DType T, class Bits>
void check_vector_loads(int codes, float (*scalar)(Bits)) {
  std::vector<Bits> src(codes + kLanes);
  for (int c = 0; c < codes + kLanes; ++c) src[c] = static_cast<Bits>(c % codes);
  for (int c = 0; c < codes; c += kLanes) {
    const vfloat v = vload_as_float<T>(src.data() + c);
    for (int i = 0; i < kLanes; ++i) {
      const float want = scalar(src[c + i]);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(v[i])) << "code " << c + i;
      } else {
        uint32_t got_bits, want_bits;
        const float got = v[i];
        std::memcpy(&got_bits, &got, 4);
        std::memcpy(&want_bits, &want, 4);
        ASSERT_EQ(got_bits, want_bits) << "code " << c + i;
      }
    }
  }
}

ISA_TEST(Convert, VectorLoadsMatchScalarConversions) {
  SKIP_UNLESS_RUNNABLE();
  check_vector_loads<DType::float8_e4m3fn, uint8_t>(256, &float8_e4m3fn_to_float);
  check_vector_loads<DType::bfloat16, uint16_t>(65536, &bfloat16_to_float);
  check_vector_loads<DType::float16, uint16_t>(65536, &float16_to_float);
}

// fp8 -> bf16 (decode's K over an fp8 cache) is exact: for every code, in vector and tail
// positions, the bf16 bits widen to the scalar float32 conversion bit for bit (NaN for NaN);
// also times a power of two (the sparse decode's V3.2 tile scales), and two rows at once into
// pairs.
template <DType T>
void check_fp8_to_bf16(float (*scalar)(uint8_t)) {
  const Fp8ToBf16<T> convert;
  for (int64_t n : {256, 256 + 31, 256 + 32 + 5, 7}) {  // whole 64s (VBMI), a 32, tails
    std::vector<uint8_t> src(n);
    for (int64_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>((i * 37 + n) % 256);
    std::vector<uint16_t> dst(n + 1, 0xABCD);
    convert.row(src.data(), 1, n, dst.data());
    EXPECT_EQ(dst[n], 0xABCD) << "wrote past n = " << n;
    std::vector<uint8_t> strided(3 * n, 0xFF);  // every third byte (the scalar path)
    std::vector<uint16_t> dst_strided(n);
    for (int64_t i = 0; i < n; ++i) strided[3 * i] = src[i];
    convert.row(strided.data(), 3, n, dst_strided.data());
    EXPECT_EQ(dst_strided, std::vector<uint16_t>(dst.begin(), dst.begin() + n)) << "stride 3, n = " << n;
    for (int64_t i = 0; i < n; ++i) {
      const float want = scalar(src[i]), got = bfloat16_to_float(dst[i]);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << "code " << int{src[i]};
      } else {
        ASSERT_EQ(bits_of(got), bits_of(want)) << "code " << int{src[i]} << " at " << i << " of " << n;
      }
      ASSERT_EQ(fp8_to_bf16_bits<T>(src[i]), dst[i]) << "code " << int{src[i]};
    }
    // two rows straight into pairs (V's key pairs): row()'s bits, a's low and b's high, or a
    // zero high half without b; nothing written past n
    std::vector<uint8_t> second(n);
    for (int64_t i = 0; i < n; ++i) second[i] = static_cast<uint8_t>((i * 101 + 3 * n + 17) % 256);
    std::vector<uint16_t> second_bits(n);
    convert.row(second.data(), 1, n, second_bits.data());
    for (const bool with_b : {true, false}) {
      std::vector<uint32_t> pairs(n + 1, 0xABCD1234u);
      convert.pairs(src.data(), with_b ? second.data() : nullptr, n, pairs.data());
      EXPECT_EQ(pairs[n], 0xABCD1234u) << "pairs wrote past n = " << n;
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t want = dst[i] | (with_b ? uint32_t{second_bits[i]} << 16 : 0u);
        ASSERT_EQ(pairs[i], want) << "pair " << i << " of " << n << (with_b ? "" : " (no b)");
      }
    }
    // times 2^e: the exact product of every code (zeros, NaN and inf kept), vector and tail
    for (int e : {1, -1, 7, -13, Fp8ToBf16<T>::kMaxExponent, -Fp8ToBf16<T>::kMaxExponent}) {
      std::fill(dst.begin(), dst.end(), 0xABCD);
      convert.row(src.data(), 1, n, dst.data(), e);
      EXPECT_EQ(dst[n], 0xABCD) << "wrote past n = " << n << ", e = " << e;
      for (int64_t i = 0; i < n; ++i) {
        const float want = std::ldexp(scalar(src[i]), e), got = bfloat16_to_float(dst[i]);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(got)) << "code " << int{src[i]} << ", e = " << e;
        } else {
          ASSERT_EQ(bits_of(got), bits_of(want)) << "code " << int{src[i]} << " at " << i << " of " << n << ", e = " << e;
        }
      }
    }
  }
}

ISA_TEST(Convert, Fp8ToBf16IsExact) {
  SKIP_UNLESS_RUNNABLE();
  check_fp8_to_bf16<DType::float8_e4m3fn>(&float8_e4m3fn_to_float);
  check_fp8_to_bf16<DType::float8_e5m2>(&float8_e5m2_to_float);
}

// Float32 values the narrowing stores must round exactly as attnkit/dtype.h does: NaNs, infinities,
// overflow after rounding, subnormals, ties to even either way for bf16 and fp16, and
// values just off the ties.
const std::vector<float>& rounding_cases() {
  static const std::vector<float> cases = [] {
    std::vector<float> v = {NAN, -NAN, INFINITY, -INFINITY, 3.4e38f, -3.4e38f, FLT_MAX, 0.0f, -0.0f, 1.0f,
                            65504.0f, 65519.0f, 65520.0f, -65520.0f, 0x1p-24f, 0x1p-25f, 0x1.8p-24f, 0x1p-14f,
                            1.0f + 0x1p-11f, 1.0f + 0x1.8p-10f, FLT_MIN, -1e-40f};
    for (uint32_t u : {0x7F800001u, 0xFFC00001u, 0x7F7F8000u, 0x7F7F7FFFu, 0x00000001u, 0x00008000u, 0x00018000u,
                       0x807FFFFFu, 0x3F808000u, 0x3F818000u, 0xBF818000u, 0x3F808001u, 0x3F807FFFu, 0xC0FF8000u}) {
      v.push_back(from_bits(u));
    }
    return v;
  }();
  return cases;
}

// store_row<T> for n in vector and tail lengths, stride 1 (the vector path for bf16 and
// fp32) and 3: each dst[i * stride] is bit for bit the scalar conversion of src[i] * scale
// (computed in float), and the elements between and after them stay untouched.
template <DType T, class Bits>
void check_store_row(Bits (*scalar)(float)) {
  using Elem_t = typename Elem<T>::type;
  std::mt19937 gen(29);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  const std::vector<float>& cases = rounding_cases();
  const int64_t n_cases = static_cast<int64_t>(cases.size());
  for (int64_t n : {int64_t{1}, int64_t{kLanes - 1}, int64_t{kLanes}, int64_t{3 * kLanes + 5}}) {
    for (int64_t stride : {1, 3}) {
      for (float scale : {1.0f, -2.0f, 0.3f}) {
        for (int64_t start = 0; start < n_cases; ++start) {  // every case at many positions
          std::vector<float> src(n);
          for (int64_t i = 0; i < n; ++i) src[i] = i % 3 == 2 ? dist(gen) : cases[(start + i) % n_cases];
          std::vector<Elem_t> dst(n * stride + kLanes), dst0;
          for (auto& x : dst) {
            const uint16_t sentinel = 0xDEAD;
            std::memcpy(&x, &sentinel, 2);
          }
          dst0 = dst;
          store_row<T>(src.data(), scale, n, dst.data(), stride);
          for (int64_t i = 0; i < int64_t(dst.size()); ++i) {
            Bits got, want;
            std::memcpy(&got, &dst[i], sizeof got);
            std::memcpy(&want, &dst0[i], sizeof want);
            if (i % stride == 0 && i / stride < n) want = scalar(src[i / stride] * scale);
            ASSERT_EQ(got, want) << "n=" << n << " stride=" << stride << " scale=" << scale << " at " << i
                                 << " src=" << (i % stride == 0 && i / stride < n ? src[i / stride] : 0.0f);
          }
        }
      }
    }
  }
}

uint32_t float_bits(float x) { return bits_of(x); }

ISA_TEST(Convert, StoreRowMatchesScalarConversions) {
  SKIP_UNLESS_RUNNABLE();
  check_store_row<DType::bfloat16, uint16_t>(&float_to_bfloat16);
  check_store_row<DType::float16, uint16_t>(&float_to_float16);
  check_store_row<DType::float32, uint32_t>(&float_bits);
}

// vstore_bf16 on every high half of a float32 with the low halves that decide rounding
// (0, 1, just below, at and just above the tie, all ones), and the rounding cases.
ISA_TEST(Convert, VectorBf16StoreMatchesScalarRounding) {
  SKIP_UNLESS_RUNNABLE();
  std::vector<float> src;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) src.push_back(from_bits(hi << 16 | lo));
  }
  src.insert(src.end(), rounding_cases().begin(), rounding_cases().end());
  src.resize((src.size() + kLanes - 1) / kLanes * kLanes, 1.0f);
  std::vector<uint16_t> dst(src.size() + 1, 0xDEAD);
  for (size_t i = 0; i < src.size(); i += kLanes) vstore_bf16(dst.data() + i, vload(src.data() + i));
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(dst[i], float_to_bfloat16(src[i])) << std::hex << "float bits 0x" << bits_of(src[i]);
  }
  EXPECT_EQ(dst[src.size()], 0xDEAD);
}

// pair_rows_bf16: rows 2i and 2i + 1 rounded as vstore_bf16 rounds (NaN kept a NaN) into
// row i, in place as the op calls it and into a separate buffer; an odd last row pairs with
// zeros.
ISA_TEST(Convert, PairRowsBf16RoundsAndPairs) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(12);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  const int64_t ld = 2 * kLanes;
  for (int64_t n : {1, 2, 5, 8}) {
    std::vector<float> src(n * ld);
    for (auto& x : src) x = dist(gen);
    src[ld - 1] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> in_place = src;
    std::vector<uint32_t> dst((n + 1) / 2 * ld, 0xDEADBEEF);
    pair_rows_bf16(src.data(), n, ld, dst.data());
    pair_rows_bf16(in_place.data(), n, ld, reinterpret_cast<uint32_t*>(in_place.data()));
    for (int64_t i = 0; i < (n + 1) / 2; ++i) {
      for (int64_t c = 0; c < ld; ++c) {
        const uint16_t lo = float_to_bfloat16(src[2 * i * ld + c]);
        const uint16_t hi = 2 * i + 1 < n ? float_to_bfloat16(src[(2 * i + 1) * ld + c]) : 0;
        const uint32_t got = dst[i * ld + c];
        uint32_t got_in_place;
        std::memcpy(&got_in_place, &in_place[i * ld + c], sizeof got_in_place);
        ASSERT_EQ(got, got_in_place) << "n " << n << " row " << i << " col " << c;
        if (lo == 0xFFFF) {  // NaN: any quiet NaN
          ASSERT_EQ(got & 0x7FC0u, 0x7FC0u) << "n " << n << " col " << c;
        } else {
          ASSERT_EQ(got & 0xFFFFu, lo) << "n " << n << " row " << i << " col " << c;
        }
        ASSERT_EQ(got >> 16, hi) << "n " << n << " row " << i << " col " << c;
      }
    }
  }
}

// interleave_bf16_rows: element i of each row into the low / high half of dst[i], for unit
// and wider strides, a missing second row, lengths around the vector width; zero up to
// n_pad and nothing written past it.
ISA_TEST(Convert, InterleaveBf16RowsPairsElements) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(11);
  for (int64_t stride : {1, 3}) {
    for (int64_t n : {1, kLanes - 1, kLanes, kLanes + 1, 3 * kLanes + 5}) {
      for (bool second : {true, false}) {
        std::vector<uint16_t> a(n * stride), b(n * stride);
        for (auto* row : {&a, &b}) {
          for (auto& x : *row) x = static_cast<uint16_t>(gen());
        }
        const int64_t n_pad = n + 7;
        std::vector<uint32_t> dst(n_pad + 1, 0xDEADBEEF);
        interleave_bf16_rows(a.data(), second ? b.data() : nullptr, stride, n, n_pad, dst.data());
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t hi = second ? b[i * stride] : 0u;
          ASSERT_EQ(dst[i], a[i * stride] | hi << 16) << "stride " << stride << " n " << n << " i " << i;
        }
        for (int64_t i = n; i < n_pad; ++i) ASSERT_EQ(dst[i], 0u) << "padding " << i;
        EXPECT_EQ(dst[n_pad], 0xDEADBEEFu);
      }
    }
  }
}

#if defined(ATTNKIT_ISA_avx512bf16)
// c0 + Σ_p a[p] · b[p * ldb] over bf16 pairs in float64, and the sum of the terms' magnitudes.
std::pair<double, double> pairs_dot(const uint32_t* a, const uint32_t* b, int64_t ldb, int64_t pairs, double c0) {
  double ref = c0, mag = std::fabs(c0);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t x = a[p], y = b[p * ldb];
    for (int half = 0; half < 2; ++half) {
      const double prod =
          double(bfloat16_to_float(uint16_t(x >> (16 * half)))) * bfloat16_to_float(uint16_t(y >> (16 * half)));
      ref += prod, mag += std::fabs(prod);
    }
  }
  return {ref, mag};
}

// vdpbf16ps tiles: bf16 pairs along k, products exact, sums in fp32.
ISA_TEST(GemmBf16, MatchesFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(5);
  std::normal_distribution<float> dist;
  auto bf16 = [&] { return float_to_bfloat16(dist(gen)); };
  for (int64_t m : {1, 3, 4, 9}) {
    for (int64_t n : {16, 48, 112}) {
      for (int64_t pairs : {1, 5, 64}) {
        const int64_t lda = pairs + 1, ldb = n + 16, ldc = n;
        std::vector<uint32_t> a(m * lda), b(pairs * ldb);
        for (auto& x : a) x = bf16() | uint32_t{bf16()} << 16;
        for (auto& x : b) x = bf16() | uint32_t{bf16()} << 16;
        std::vector<float> c(m * ldc, NAN);
        gemm_bf16<kWideRows, kWideVecs>(m, n, pairs, a.data(), lda, 1, b.data(), ldb, c.data(), ldc, false);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            const auto [ref, mag] = pairs_dot(a.data() + i * lda, b.data() + j, ldb, pairs, 0.0);
            ASSERT_NEAR(c[i * ldc + j], ref, 1e-6 * (mag + 1)) << "m=" << m << " n=" << n << " pairs=" << pairs;
          }
        }
      }
    }
  }
}

// The same band contract on pairs (check_gemm_banded): NaN pairs outside each tile's band.
ISA_TEST(GemmBf16, BandedTilesReadOnlyTheirBand) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(6);
  std::normal_distribution<float> dist;
  auto pair = [&] { return float_to_bfloat16(dist(gen)) | uint32_t{float_to_bfloat16(dist(gen))} << 16; };
  constexpr int MR = kTallRows;
  for (const TestBand& band : kTestBands) {
    for (int64_t m : {1, MR + 1, 2 * MR + 3}) {
      for (int64_t pairs : {1, 5, 64}) {
        const int64_t n = 80, lda = pairs + 1, ldb = n + 16, ldc = n;
        std::vector<uint32_t> a(m * lda, 0x7FC07FC0u), b(pairs * ldb);
        for (int64_t i = 0; i < m; ++i) {
          const int64_t m0 = i / MR * MR;
          const auto [p0, p1] = band(m0, std::min<int64_t>(m, m0 + MR));
          for (int64_t p = std::max<int64_t>(p0, 0); p < std::min(p1, pairs); ++p) {
            a[i * lda + p] = p >= band.lo(i) && p < band.hi(i) ? pair() : 0u;
          }
        }
        for (auto& x : b) x = pair();
        std::vector<float> c(m * ldc, NAN);
        gemm_bf16<MR, kTallVecs>(m, n, pairs, a.data(), lda, 1, b.data(), ldb, c.data(), ldc, false, band);
        for (int64_t i = 0; i < m; ++i) {
          const int64_t lo = std::max<int64_t>(band.lo(i), 0), hi = std::max(lo, std::min(band.hi(i), pairs));
          for (int64_t j = 0; j < n; ++j) {
            const auto [ref, mag] = pairs_dot(a.data() + i * lda + lo, b.data() + lo * ldb + j, ldb, hi - lo, 0.0);
            ASSERT_NEAR(c[i * ldc + j], ref, 1e-6 * (mag + 1)) << "m=" << m << " pairs=" << pairs << " row " << i;
          }
        }
      }
    }
  }
}

// Decode's P·V from V's bf16 rows (gemm_bf16_row_pairs): every edge tile (rows around MR,
// column blocks around NV2), unaligned B rows NaN-padded past n (reading past n shows),
// accumulating or not; C's columns in pair order, NaN-poisoned C fully written, C's padding
// columns untouched; unpair_bf16_row puts a row back in column order.
ISA_TEST(GemmBf16RowPairs, MatchesFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(9);
  std::normal_distribution<float> dist;
  auto bf16 = [&] { return float_to_bfloat16(dist(gen)); };
  for (int64_t m : {1, kRowPairRows - 1, kRowPairRows, kRowPairRows + 1, 2 * kRowPairRows + 1}) {
    for (int64_t n : {32, 64, 96, 160}) {
      for (int64_t pairs : {1, 3, 8}) {
        for (bool accumulate : {false, true}) {
          const int64_t lda = pairs + 5, ldb = n + 33, ldc = n + 16;
          std::vector<uint32_t> a(m * lda);
          for (auto& x : a) x = bf16() | uint32_t{bf16()} << 16;
          std::vector<uint16_t> b(2 * pairs * ldb, 0xFFFF);
          for (int64_t j = 0; j < 2 * pairs; ++j) {
            for (int64_t d = 0; d < n; ++d) b[j * ldb + d] = bf16();
          }
          std::vector<float> c(m * ldc), c0;
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < ldc; ++j) c[i * ldc + j] = j < n && !accumulate ? NAN : dist(gen);
          }
          c0 = c;
          gemm_bf16_row_pairs<kRowPairRows, kRowPairVecs>(m, n, pairs, a.data(), lda, b.data(), ldb, c.data(), ldc,
                                                          accumulate);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = n; j < ldc; ++j) ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j]) << "padding " << j;
            std::vector<float> row(n);
            unpair_bf16_row(c.data() + i * ldc, n, row.data());
            for (int64_t d = 0; d < n; ++d) {
              const int64_t at = pair_order_column(d);
              ASSERT_EQ(bits_of(row[d]), bits_of(c[i * ldc + at])) << "unpair, column " << d;
              double ref = accumulate ? c0[i * ldc + at] : 0.0, mag = std::fabs(ref);
              for (int64_t p = 0; p < 2 * pairs; ++p) {
                const double prod =
                    double(bfloat16_to_float(uint16_t(a[i * lda + p / 2] >> (16 * (p % 2))))) *
                    bfloat16_to_float(b[p * ldb + d]);
                ref += prod, mag += std::fabs(prod);
              }
              ASSERT_NEAR(row[d], ref, 1e-6 * (mag + 1))
                  << "m=" << m << " n=" << n << " pairs=" << pairs << " acc=" << accumulate << " (" << i << ", " << d
                  << ")";
            }
          }
        }
      }
    }
  }
}

// The indexer's fused tile (gemm_bf16_relu_dot): out[i] += Σ_c ReLU((A · B)[i][c]) · w[c] over
// every edge tile (rows around MR, columns around NV vectors), strided A and B, against a
// float64 reference; out's entries past m untouched; a NaN product stays NaN (ReLU keeps it).
ISA_TEST(GemmBf16ReluDot, MatchesFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(17);
  std::normal_distribution<float> dist;
  auto bf16 = [&] { return float_to_bfloat16(dist(gen)); };
  for (int64_t m : {1, kTallRows - 1, kTallRows, kTallRows + 1, 2 * kTallRows + 3}) {
    for (int64_t n : {16, 48, 64, 80, 128}) {
      for (int64_t pairs : {1, 7, 64}) {
        const int64_t lda = pairs + 3, ldb = n + 32;
        std::vector<uint32_t> a(m * lda), b(pairs * ldb);
        for (auto& x : a) x = bf16() | uint32_t{bf16()} << 16;
        for (auto& x : b) x = bf16() | uint32_t{bf16()} << 16;
        std::vector<float> w(n), out(m + 1);
        for (auto& x : w) x = dist(gen);
        for (auto& x : out) x = dist(gen);
        const bool with_nan = m > 2 && pairs > 1;
        if (with_nan) a[2 * lda + 1] = 0x7FC07FC0u;  // row 2: every score NaN
        const std::vector<float> out0 = out;
        gemm_bf16_relu_dot<kTallRows, kTallVecs>(m, n, pairs, a.data(), lda, b.data(), ldb, w.data(), out.data());
        EXPECT_EQ(bits_of(out[m]), bits_of(out0[m])) << "past m";
        for (int64_t i = 0; i < m; ++i) {
          if (with_nan && i == 2) {
            ASSERT_TRUE(std::isnan(out[i])) << "m=" << m << " n=" << n;
            continue;
          }
          double ref = out0[i], mag = std::fabs(ref);
          for (int64_t c = 0; c < n; ++c) {
            const auto [dot, dot_mag] = pairs_dot(a.data() + i * lda, b.data() + c, ldb, pairs, 0.0);
            const double term = std::max(dot, 0.0) * w[c];
            ref += term, mag += (dot_mag + 1) * std::fabs(w[c]);
          }
          ASSERT_NEAR(out[i], ref, 1e-6 * (mag + 1)) << "m=" << m << " n=" << n << " pairs=" << pairs << " row " << i;
        }
      }
    }
  }
}

// Pair order within each block of 32 columns: a permutation that stays in its block, as
// vpunpck{l,h}wd interleave within 128-bit lanes.
ISA_TEST(GemmBf16RowPairs, PairOrderColumnIsAPermutation) {
  SKIP_UNLESS_RUNNABLE();
  std::vector<int> seen(96, 0);
  for (int64_t d = 0; d < 96; ++d) {
    const int64_t j = pair_order_column(d);
    ASSERT_TRUE(j >= 0 && j < 96 && j / 32 == d / 32) << d;
    ++seen[j];
  }
  for (int64_t j = 0; j < 96; ++j) EXPECT_EQ(seen[j], 1) << j;
  EXPECT_EQ(pair_order_column(4), 16);
  EXPECT_EQ(pair_order_column(9), 5);
  EXPECT_EQ(pair_order_column(32 + 31), 32 + 31);
}

// pair_values_bf16: consecutive values rounded as pair_rows_bf16 rounds (NaN a quiet NaN),
// in place as decode calls it and into a separate buffer.
ISA_TEST(Convert, PairValuesBf16RoundsAndPairs) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(13);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  const int64_t n = 3 * kLanes;
  std::vector<float> src(n);
  for (auto& x : src) x = dist(gen);
  src[5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> in_place = src;
  std::vector<uint32_t> dst(n / 2 + 1, 0xDEADBEEF);
  pair_values_bf16(src.data(), n, dst.data());
  pair_values_bf16(in_place.data(), n, reinterpret_cast<uint32_t*>(in_place.data()));
  for (int64_t i = 0; i < n / 2; ++i) {
    uint32_t got_in_place;
    std::memcpy(&got_in_place, &in_place[i], sizeof got_in_place);
    ASSERT_EQ(dst[i], got_in_place) << i;
    for (int half = 0; half < 2; ++half) {
      const uint16_t want = float_to_bfloat16(src[2 * i + half]), got = uint16_t(dst[i] >> (16 * half));
      if (want == 0xFFFF) {
        ASSERT_EQ(got & 0x7FC0u, 0x7FC0u) << i;
      } else {
        ASSERT_EQ(got, want) << i << " " << half;
      }
    }
  }
  EXPECT_EQ(dst[n / 2], 0xDEADBEEFu);
}

#if defined(ATTNKIT_ISA_avx512amx)
// The tile configurations as loaded: sttilecfg reads them back. GCC 12 dropped the zeroing of
// amx_configure's reserved bytes where it was inlined (ldtilecfg then faulted on the stack's
// garbage); the stack is dirtied first so that such garbage would be there.
[[gnu::noinline]] void dirty_stack() {
  volatile uint8_t dirt[4096];
  for (int i = 0; i < 4096; ++i) dirt[i] = static_cast<uint8_t>(0xA5 ^ i);
  (void)dirt[0];
}
[[gnu::noinline]] void configure_tiles() { amx_configure(); }
[[gnu::noinline]] void configure_decode_tiles(int64_t rows) { amx_configure_decode(rows); }

ISA_TEST(GemmAmxBf16, TileConfigurationsLoadAsWritten) {
  SKIP_UNLESS_RUNNABLE();
  dirty_stack();  // the frames of the configuring functions below start in this garbage
  configure_tiles();
  alignas(64) uint8_t got[64];
  _tile_storeconfig(got);
  for (int i = 0; i < 64; ++i) {
    const int want = i == 0 ? 1 : (i >= 16 && i < 32 && i % 2 == 0) ? 64 : (i >= 48 && i < 56) ? 16 : 0;
    ASSERT_EQ(got[i], want) << "byte " << i;
  }
  for (int64_t rows = 1; rows <= 8; ++rows) {
    dirty_stack();
    configure_decode_tiles(rows);
    _tile_storeconfig(got);
    ASSERT_EQ(got[0], 1);
    for (int i = 1; i < 16; ++i) ASSERT_EQ(got[i], 0) << "byte " << i;
    for (int i = 32; i < 48; ++i) ASSERT_EQ(got[i], 0) << "byte " << i;
    for (int i = 56; i < 64; ++i) ASSERT_EQ(got[i], 0) << "byte " << i;
    ASSERT_EQ(got[48 + 3], rows);  // P: rows × 8 key pairs
  }
}

// AMX tiles: every block shape of the 2 × 2 tiling (odd tile counts in m and n), strided
// operands, accumulating or not, against a float64 reference; C's padding columns untouched.
ISA_TEST(GemmAmxBf16, MatchesFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(11);
  std::normal_distribution<float> dist;
  auto bf16 = [&] { return float_to_bfloat16(dist(gen)); };
  amx_configure();
  for (int64_t m : {16, 32, 48, 80}) {
    for (int64_t n : {16, 48, 64}) {
      for (int64_t pairs : {16, 64}) {
        for (bool accumulate : {false, true}) {
          const int64_t lda = pairs + 16, ldb = n + 16, ldc = n + 8;
          std::vector<uint32_t> a(m * lda), b(pairs * ldb);
          for (auto& x : a) x = bf16() | uint32_t{bf16()} << 16;
          for (auto& x : b) x = bf16() | uint32_t{bf16()} << 16;
          std::vector<float> c(m * ldc);
          for (auto& x : c) x = accumulate ? dist(gen) : NAN;
          const std::vector<float> c0 = c;
          gemm_amx_bf16(m, n, pairs, a.data(), lda, b.data(), ldb, c.data(), ldc, accumulate);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < ldc; ++j) {
              const float got = c[i * ldc + j];
              if (j >= n) {  // padding: never written
                ASSERT_EQ(bits_of(got), bits_of(c0[i * ldc + j])) << "padding " << i << "," << j;
                continue;
              }
              const auto [ref, mag] =
                  pairs_dot(a.data() + i * lda, b.data() + j, ldb, pairs, accumulate ? c0[i * ldc + j] : 0.0);
              ASSERT_NEAR(got, ref, 1e-6 * (mag + 1))
                  << "m=" << m << " n=" << n << " pairs=" << pairs << " acc=" << accumulate;
            }
          }
        }
      }
    }
  }
}
#endif

// dot_key_block_bf16 over every grouping: pairs of bf16 (element 2p low, 2p + 1 high)
// dotted exactly, summed in fp32. NaN pairs past k_pairs, NaN-poisoned s inside
// [rows][kLanes], a sentinel outside.
ISA_TEST(Dot, KeyBlockBf16MatchesFloat64Reference) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(31);
  std::normal_distribution<float> dist;
  auto pair = [&] { return float_to_bfloat16(dist(gen)) | uint32_t{float_to_bfloat16(dist(gen))} << 16; };
  auto widen = [](uint32_t x, int half) { return double(bfloat16_to_float(uint16_t(x >> (16 * half)))); };
  for (int g : row_groupings()) {
    for (int64_t rows = 1; rows <= kMaxDotRows; ++rows) {
      for (int64_t k_pairs : key_lengths(g)) {
        const int64_t ldk = k_pairs + 3, ldq = k_pairs + 1, lds = kLanes + 5, chunks = k_pairs / (kLanes / g);
        std::vector<uint32_t> keys(kLanes * ldk, 0xFFFFFFFFu), q(rows * ldq, 0xFFFFFFFFu);
        std::vector<uint32_t> qg((rows + g) * (k_pairs + kLanes), 0xFFFFFFFFu);
        std::vector<float> s((rows + 1) * lds, 12345.0f);
        for (int64_t j = 0; j < kLanes; ++j) {
          for (int64_t p = 0; p < k_pairs; ++p) keys[j * ldk + p] = pair();
        }
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t p = 0; p < k_pairs; ++p) q[r * ldq + p] = pair();
          for (int64_t j = 0; j < kLanes; ++j) s[r * lds + j] = NAN;
        }
        group_rows(g, rows, k_pairs, q.data(), ldq, chunks, qg.data());
        dot_key_block_bf16(g, rows, chunks, keys.data(), ldk, qg.data(), s.data(), lds);
        for (int64_t r = 0; r < rows + 1; ++r) {
          for (int64_t j = 0; j < lds; ++j) {
            const std::string at = "g=" + std::to_string(g) + " rows=" + std::to_string(rows) +
                                   " pairs=" + std::to_string(k_pairs) + " at (" + std::to_string(r) + ", " +
                                   std::to_string(j) + ")";
            if (r == rows || j >= kLanes) {
              ASSERT_EQ(s[r * lds + j], 12345.0f) << at;
              continue;
            }
            double ref = 0.0, mag = 0.0;
            for (int64_t p = 0; p < k_pairs; ++p) {
              for (int half = 0; half < 2; ++half) {
                const double t = widen(keys[j * ldk + p], half) * widen(q[r * ldq + p], half);
                ref += t, mag += std::fabs(t);
              }
            }
            ASSERT_NEAR(s[r * lds + j], ref, 1e-6 * mag) << at;
          }
        }
      }
    }
  }
}

// vpdpbusd tiles: u8 quads of A times s8 quads of B, exact int32 sums.
ISA_TEST(GemmU8S8, MatchesIntegerReference) {
  SKIP_UNLESS_RUNNABLE();
  std::mt19937 gen(9);
  for (int64_t m : {1, 3, 4, 9}) {
    for (int64_t n : {16, 48, 112}) {
      for (int64_t quads : {1, 7, 32}) {
        const int64_t lda = quads + 2, ldb = n + 16, ldc = n;
        std::vector<uint32_t> a(m * lda), b(quads * ldb);
        for (auto& x : a) x = gen();
        for (auto& x : b) x = gen();
        std::vector<int32_t> c(m * ldc, -1);
        gemm_u8s8<kWideRows, kWideVecs>(m, n, quads, a.data(), lda, b.data(), ldb, c.data(), ldc);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            int64_t ref = 0;
            for (int64_t p = 0; p < quads; ++p) {
              for (int byte = 0; byte < 4; ++byte) {
                ref += int64_t{uint8_t(a[i * lda + p] >> (8 * byte))} * int8_t(uint8_t(b[p * ldb + j] >> (8 * byte)));
              }
            }
            ASSERT_EQ(c[i * ldc + j], ref) << "m=" << m << " n=" << n << " quads=" << quads;
          }
        }
      }
    }
  }
}
#endif

// touch_lines: one byte of every 64-byte line and the last byte, summed; no bytes, no reads
// (ASan builds flag a read before the buffer).
ISA_TEST(TouchLines, OneBytePerLineAndNothingForNoBytes) {
  SKIP_UNLESS_RUNNABLE();
  std::vector<uint8_t> bytes(200);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  EXPECT_EQ(touch_lines(bytes.data(), 200), uint32_t{bytes[0]} + bytes[64] + bytes[128] + bytes[192] + bytes[199]);
  EXPECT_EQ(touch_lines(bytes.data(), 1), 2u * bytes[0]);
  std::vector<uint8_t> one(1, 5);
  EXPECT_EQ(touch_lines(one.data(), 0), 0u);
}

}  // namespace
}  // namespace attnkit::cpu::ATTNKIT_ISA
