// The C++ API of merge_attention_states: a merge against a double-precision restatement on
// every ISA, in place, the ±inf rows, and a typed error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(MergeApi, MatchesDoubleOnEveryIsa) {
  const int64_t T = 37, H = 3, D = 70;  // D off the vector width, rows over several tasks' worth
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  std::vector<float> a(T * H * D), b(T * H * D), la(T * H), lb(T * H);
  for (auto& x : a) x = normal(gen);
  for (auto& x : b) x = normal(gen);
  for (auto& x : la) x = 3 * normal(gen);
  for (auto& x : lb) x = 3 * normal(gen);
  la[0] = -kInf;  // a saw no key in row 0: b's row exactly
  a[0] = std::numeric_limits<float>::quiet_NaN();
  la[1] = lb[1] = -kInf;  // neither: 0 and -inf
  const std::string original = attnkit::active_isa();
  for (const std::string& isa : attnkit::supported_isas()) {
    attnkit::set_isa(isa);
    std::vector<float> out(T * H * D, std::nanf("")), lse(T * H, std::nanf(""));
    attnkit::MergeStatesArgs args;
    args.out_a = attnkit::TensorView(a.data(), attnkit::DType::float32, {T, H, D});
    args.out_b = attnkit::TensorView(b.data(), attnkit::DType::float32, {T, H, D});
    args.lse_a = attnkit::TensorView(la.data(), attnkit::DType::float32, {T, H});
    args.lse_b = attnkit::TensorView(lb.data(), attnkit::DType::float32, {T, H});
    args.out = attnkit::TensorView(out.data(), attnkit::DType::float32, {T, H, D});
    args.lse_out = attnkit::TensorView(lse.data(), attnkit::DType::float32, {T, H});
    attnkit::merge_attention_states(args);
    for (int64_t r = 0; r < T * H; ++r) {
      if (r == 1) {
        EXPECT_EQ(lse[r], -kInf);
        for (int64_t c = 0; c < D; ++c) EXPECT_EQ(out[r * D + c], 0.0f);
        continue;
      }
      const double m = std::max<double>(la[r], lb[r]);
      const double wa = r == 0 ? 0.0 : std::exp(la[r] - m), wb = std::exp(lb[r] - m);
      EXPECT_NEAR(lse[r], m + std::log(wa + wb), 1e-5) << isa << " row " << r;
      for (int64_t c = 0; c < D; ++c) {
        const double va = r == 0 ? 0.0 : a[r * D + c];
        const double want = (wa * va + wb * b[r * D + c]) / (wa + wb);
        EXPECT_NEAR(out[r * D + c], want, 1e-6 * (1 + std::abs(want))) << isa << " row " << r << " col " << c;
      }
    }
    // In place into a (and la) gives the same bits.
    std::vector<float> acc(a), acc_lse(la);
    args.out_a = args.out = attnkit::TensorView(acc.data(), attnkit::DType::float32, {T, H, D});
    args.lse_a = args.lse_out = attnkit::TensorView(acc_lse.data(), attnkit::DType::float32, {T, H});
    attnkit::merge_attention_states(args);
    for (int64_t i = 0; i < T * H * D; ++i) {
      ASSERT_EQ(std::memcmp(&acc[i], &out[i], 4), 0) << isa << " at " << i;
    }
  }
  attnkit::set_isa(original);
}

TEST(MergeApi, InvalidArgumentsThrowTypedErrors) {
  std::vector<float> x(24), l(6);
  attnkit::MergeStatesArgs args;
  args.out_a = args.out_b = attnkit::TensorView(x.data(), attnkit::DType::float32, {2, 3, 4});
  args.lse_a = args.lse_b = attnkit::TensorView(l.data(), attnkit::DType::float32, {2, 3});
  std::vector<float> out(24), lse(3);
  args.out = attnkit::TensorView(out.data(), attnkit::DType::float32, {2, 3, 4});
  args.lse_out = attnkit::TensorView(lse.data(), attnkit::DType::float32, {3});
  try {
    attnkit::merge_attention_states(args);
    FAIL() << "expected attnkit::Error";
  } catch (const attnkit::Error& e) {
    const std::string want = "lse_out must have out_a's shape without its last dim, [2, 3], got [3]";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

}  // namespace
