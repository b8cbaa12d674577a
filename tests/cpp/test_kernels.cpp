// Micro-kernel tests, compiled once per ISA (like the kernels) and skipped where this CPU
// lacks the ISA: the register-tiled GEMM, the vector exp2 and the online-softmax update.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnkit/runtime.h"
#include "attnkit/dtype.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_bf16.h"
#include "cpu/kernels/gemm_int8.h"
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

// Every edge tile of an MR × NV register tiling, A read row-major or transposed
// (a_step != 1), accumulating or not, against a float64 reference.
template <int MR, int NV>
void check_gemm(bool a_transposed) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const int64_t block_cols = NV * kLanes;
  for (int64_t m : {int64_t{1}, int64_t{MR - 1}, int64_t{MR}, int64_t{MR + 1}, int64_t{2 * MR + 3}}) {
    if (m < 1) continue;
    for (int64_t n : {int64_t{kLanes}, block_cols, block_cols + kLanes, 3 * block_cols - kLanes}) {
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
          gemm<MR, NV>(m, n, k, a.data(), lda, a_step, b.data(), ldb, c.data(), ldc, accumulate);
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

ISA_TEST(Exp2, AccurateAndExactAtTheEdges) {
  SKIP_UNLESS_RUNNABLE();
  float worst = 0.0f;
  for (float x = -126.0f; x <= 0.0f; x += 0.00731f) {
    const float got = vexp2(vbroadcast(x))[0];
    const double ref = std::exp2(double(x));
    worst = std::max(worst, float(std::fabs(got - ref) / ref));
  }
  EXPECT_LT(worst, 3e-7f);  // about 2.5 ulp
  EXPECT_EQ(vexp2(vbroadcast(0.0f))[0], 1.0f);
  EXPECT_EQ(vexp2(vbroadcast(-INFINITY))[0], 0.0f);
  EXPECT_EQ(vexp2(vbroadcast(-127.5f))[0], 0.0f);
  EXPECT_TRUE(std::isnan(vexp2(vbroadcast(NAN))[0]));
}

// Two tiles of transposed scores (keys × rows) folded one after the other give each row's
// exact softmax statistics, and the first tile's P rescaled by alpha matches the final max.
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
  std::vector<float> t = s, m(rows, -INFINITY), l(rows, 0.0f), alpha(rows);
  online_softmax_tile(t.data(), keys, ld, rows, m.data(), l.data(), alpha.data());
  online_softmax_tile(t.data() + keys * ld, keys, ld, rows, m.data(), l.data(), alpha.data());
  for (int64_t r = 0; r < rows; ++r) {
    double mx = -INFINITY, sum = 0.0;
    for (int64_t j = 0; j < 2 * keys; ++j) mx = std::max(mx, double(s[j * ld + r]));
    if (r == 2) {
      EXPECT_EQ(m[r], -INFINITY);
      EXPECT_EQ(l[r], 0.0f);
      for (int64_t j = 0; j < 2 * keys; ++j) EXPECT_EQ(t[j * ld + r], 0.0f);
      continue;
    }
    for (int64_t j = 0; j < 2 * keys; ++j) sum += std::exp(double(s[j * ld + r]) - mx);
    EXPECT_EQ(m[r], float(mx)) << r;
    EXPECT_NEAR(l[r], sum, 1e-5 * sum) << r;
    for (int64_t j = 0; j < keys; ++j) {
      EXPECT_NEAR(t[j * ld + r] * alpha[r], std::exp(double(s[j * ld + r]) - mx), 1e-6) << r;
    }
  }
  EXPECT_EQ(t[5 * ld + 1], 0.0f);
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

#if defined(ATTNKIT_ISA_avx512bf16)
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
            double ref = 0.0, mag = 0.0;
            for (int64_t p = 0; p < pairs; ++p) {
              const uint32_t x = a[i * lda + p], y = b[p * ldb + j];
              for (int half = 0; half < 2; ++half) {
                const double prod = double(bfloat16_to_float(uint16_t(x >> (16 * half)))) *
                                    bfloat16_to_float(uint16_t(y >> (16 * half)));
                ref += prod, mag += std::fabs(prod);
              }
            }
            ASSERT_NEAR(c[i * ldc + j], ref, 1e-6 * (mag + 1)) << "m=" << m << " n=" << n << " pairs=" << pairs;
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

}  // namespace
}  // namespace attnkit::cpu::ATTNKIT_ISA
