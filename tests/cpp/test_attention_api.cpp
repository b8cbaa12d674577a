// The C++ API of dense attention: results against a float64 reference on every ISA,
// typed errors (attnkit::Error) with informative messages, and outputs fully written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"

namespace attnkit {
namespace {

struct Case {
  int64_t B = 2, Hq = 4, Hkv = 2, Sq = 37, Skv = 70, D = 24, Dv = 40;
};

// float64 reference in BHSD with GQA and bottom-right causal masking.
std::vector<double> reference(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                              const std::vector<float>& v) {
  std::vector<double> out(c.B * c.Hq * c.Sq * c.Dv, 0.0);
  const double scale = 1.0 / std::sqrt(double(c.D));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h) {
      const int64_t kvh = h / (c.Hq / c.Hkv);
      for (int64_t i = 0; i < c.Sq; ++i) {
        std::vector<double> s(c.Skv, -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j <= std::min(c.Skv - 1, i + c.Skv - c.Sq); ++j) {
          double dot = 0;
          for (int64_t d = 0; d < c.D; ++d)
            dot += double(q[((b * c.Hq + h) * c.Sq + i) * c.D + d]) * k[((b * c.Hkv + kvh) * c.Skv + j) * c.D + d];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (auto& x : s) sum += (x = std::exp(x - mx));
        for (int64_t j = 0; j < c.Skv; ++j)
          for (int64_t d = 0; d < c.Dv; ++d)
            out[((b * c.Hq + h) * c.Sq + i) * c.Dv + d] += s[j] / sum * v[((b * c.Hkv + kvh) * c.Skv + j) * c.Dv + d];
      }
    }
  return out;
}

TEST(AttentionApi, MatchesReferenceOnEveryIsa) {
  const Case c;
  std::mt19937 gen(11);
  std::normal_distribution<float> dist;
  std::vector<float> q(c.B * c.Hq * c.Sq * c.D), k(c.B * c.Hkv * c.Skv * c.D), v(c.B * c.Hkv * c.Skv * c.Dv);
  for (auto* t : {&q, &k, &v})
    for (auto& x : *t) x = dist(gen);
  const std::vector<double> ref = reference(c, q, k, v);
  const std::string saved = active_isa();
  for (const std::string& isa : supported_isas()) {
    set_isa(isa);
    std::vector<float> out(ref.size(), NAN);
    AttentionArgs a;
    a.q = TensorView(q.data(), DType::float32, {c.B, c.Hq, c.Sq, c.D});
    a.k = TensorView(k.data(), DType::float32, {c.B, c.Hkv, c.Skv, c.D});
    a.v = TensorView(v.data(), DType::float32, {c.B, c.Hkv, c.Skv, c.Dv});
    a.out = TensorView(out.data(), DType::float32, {c.B, c.Hq, c.Sq, c.Dv});
    a.causal = Causal::bottom_right;
    a.enable_gqa = true;
    attention(a);
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(out[i], ref[i], 2e-5) << isa << " at " << i;
  }
  set_isa(saved);
}

TEST(AttentionApi, InvalidArgumentsThrowTypedErrors) {
  std::vector<float> buf(4096, 1.0f), out(4096);
  AttentionArgs a;
  a.q = TensorView(buf.data(), DType::float32, {1, 12, 4, 8});
  a.k = TensorView(buf.data(), DType::float32, {1, 8, 4, 8});
  a.v = TensorView(buf.data(), DType::float32, {1, 8, 4, 8});
  a.out = TensorView(out.data(), DType::float32, {1, 12, 4, 8});
  auto message = [&] {
    try {
      attention(a);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message().find("enable_gqa"), std::string::npos);
  a.enable_gqa = true;
  EXPECT_EQ(message(), "GQA/MQA requires query heads to be a multiple of KV heads, got q_heads=12 and kv_heads=8");
  a.k = TensorView(buf.data(), DType::float32, {1, 4, 4, 8});
  a.v = TensorView(buf.data(), DType::float32, {1, 4, 4, 8});
  a.out = TensorView(buf.data(), DType::float32, {1, 12, 4, 8});
  EXPECT_EQ(message(), "out must not alias q (their memory overlaps)");
  a.out = TensorView(out.data(), DType::bfloat16, {1, 12, 4, 8});
  EXPECT_EQ(message(), "out must have q's dtype float32, got bfloat16");
  a.out = TensorView(out.data(), DType::float32, {1, 12, 4, 8});
  a.dropout_p = 1.0;
  EXPECT_EQ(message(), "dropout_p must be in [0, 1), got 1");
  a.dropout_p = 0.0;
  EXPECT_EQ(message(), "no error");
  EXPECT_THROW(set_isa("sse9"), Error);

  // Score modifiers.
  a.window_left = -2;
  EXPECT_EQ(message(), "window left must be -1 (unbounded) or >= 0, got -2");
  a.window_left = 3, a.window_right = -5;
  EXPECT_EQ(message(), "window right must be -1 (unbounded) or >= 0, got -5");
  a.window_right = 0;
  a.softcap = 0.0;
  EXPECT_EQ(message(), "softcap must be a finite number > 0 (a normal float32), got 0");
  a.softcap = 30.0;
  std::vector<float> heads(24, 0.5f);
  a.alibi_slopes = TensorView(heads.data(), DType::float32, {2, 12});
  EXPECT_EQ(message(), "alibi_slopes must be float32 of shape [12] ([Hq]) or [1, 12] ([B, Hq]), got float32 of shape [2, 12]");
  a.alibi_slopes = TensorView(heads.data(), DType::float32, {1, 12});
  a.sinks = TensorView(heads.data(), DType::bfloat16, {12});
  EXPECT_EQ(message(), "sinks must be float32 of shape [12] ([Hq]), got bfloat16 of shape [12]");
  a.sinks = TensorView(heads.data(), DType::float32, {12});
  EXPECT_EQ(message(), "no error");
}

// A sink of +inf takes all the probability (out = 0) and one of -inf none (out as without);
// lse never includes it.
TEST(AttentionApi, SinksJoinTheDenominatorOnly) {
  std::vector<float> q(2 * 3 * 8, 0.25f), kv(2 * 5 * 8), out(2 * 3 * 8, NAN), plain(2 * 3 * 8, NAN);
  std::vector<float> lse(6, NAN), plain_lse(6, NAN), sinks = {INFINITY, -INFINITY};
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = std::sin(float(i));
  AttentionArgs a;
  a.q = TensorView(q.data(), DType::float32, {1, 2, 3, 8});
  a.k = a.v = TensorView(kv.data(), DType::float32, {1, 2, 5, 8});
  a.out = TensorView(plain.data(), DType::float32, {1, 2, 3, 8});
  a.lse = TensorView(plain_lse.data(), DType::float32, {1, 2, 3});
  attention(a);
  a.out = TensorView(out.data(), DType::float32, {1, 2, 3, 8});
  a.lse = TensorView(lse.data(), DType::float32, {1, 2, 3});
  a.sinks = TensorView(sinks.data(), DType::float32, {2});
  attention(a);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(out[i], 0.0f) << i;
  for (int i = 24; i < 48; ++i) EXPECT_EQ(out[i], plain[i]) << i;
  for (int i = 0; i < 6; ++i) EXPECT_EQ(lse[i], plain_lse[i]) << i;
}

// The benchmark's peak probes and the default-variant rule (tests/python/test_dispatch_paths.py
// checks the rule against /proc/cpuinfo and every forced variant against float64).
TEST(Runtime, PeakProbesAndIsaRule) {
  EXPECT_EQ(peak_instructions(),
            (std::vector<std::string>{"fp32 FMA", "vdpbf16ps", "vpdpbusd", "fp16 FMA", "tdpbf16ps", "tdpbusd"}));
  try {
    measure_peak_gflops("fma", 1);
    ADD_FAILURE() << "no error for an unknown instruction";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "instruction must be one of \"fp32 FMA\", \"vdpbf16ps\", \"vpdpbusd\", \"fp16 FMA\", "
              "\"tdpbf16ps\", \"tdpbusd\", got \"fma\"");
  }
  EXPECT_THROW(measure_peak_gflops("vpdpbusd", 0), Error);
  EXPECT_GT(measure_peak_gflops("fp32 FMA", 1), 1.0);
  const std::vector<std::string> isas = supported_isas();
  const bool bf16 = std::find(isas.begin(), isas.end(), "avx512bf16") != isas.end();
  EXPECT_EQ(bf16, std::find(isas.begin(), isas.end(), "avx512vnni") != isas.end());
  EXPECT_EQ(bf16, measure_peak_gflops("vpdpbusd", 1) > 1.0);
  const bool amx = std::find(isas.begin(), isas.end(), "avx512amx") != isas.end();
  EXPECT_EQ(amx, measure_peak_gflops("tdpbf16ps", 1) > 1.0);
  EXPECT_EQ(amx, measure_peak_gflops("tdpbusd", 1) > 1.0);
  if (amx) {
    EXPECT_EQ(isas.front(), "avx512amx");
  }
  EXPECT_EQ(isa_rule().rfind(isas.front() + ":", 0), 0u) << isa_rule();
}

}  // namespace
}  // namespace attnkit
