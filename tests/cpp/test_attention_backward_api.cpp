// The C++ API of the dense-attention backward: directional derivatives of the forward
// (central differences in double of <attention(q, k, v), dout>) against <grad, u> on every
// ISA with GQA, causal and a shape past the key and row blocks; typed errors; gradients
// fully written.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"

namespace attnkit {
namespace {

struct Shape {
  int64_t B = 1, Hq = 4, Hkv = 2, Sq = 70, Skv = 131, D = 20, Dv = 12;
};

struct Problem {
  Shape s;
  std::vector<float> q, k, v, out, lse, dout;
  explicit Problem(const Shape& shape) : s(shape) {
    std::mt19937 gen(5);
    std::normal_distribution<float> dist;
    q.resize(s.B * s.Hq * s.Sq * s.D), k.resize(s.B * s.Hkv * s.Skv * s.D);
    v.resize(s.B * s.Hkv * s.Skv * s.Dv);
    dout.resize(s.B * s.Hq * s.Sq * s.Dv);
    for (auto* t : {&q, &k, &v, &dout})
      for (auto& x : *t) x = dist(gen);
    out.resize(dout.size()), lse.resize(s.B * s.Hq * s.Sq);
  }
  AttentionArgs forward_args() {
    AttentionArgs a;
    a.q = TensorView(q.data(), DType::float32, {s.B, s.Hq, s.Sq, s.D});
    a.k = TensorView(k.data(), DType::float32, {s.B, s.Hkv, s.Skv, s.D});
    a.v = TensorView(v.data(), DType::float32, {s.B, s.Hkv, s.Skv, s.Dv});
    a.out = TensorView(out.data(), DType::float32, {s.B, s.Hq, s.Sq, s.Dv});
    a.lse = TensorView(lse.data(), DType::float32, {s.B, s.Hq, s.Sq});
    a.causal = Causal::bottom_right;
    a.enable_gqa = true;
    return a;
  }
  // <attention(q, k, v), dout> in double.
  double loss() {
    attention(forward_args());
    double sum = 0;
    for (size_t i = 0; i < out.size(); ++i) sum += double(out[i]) * dout[i];
    return sum;
  }
};

TEST(AttentionBackwardApi, MatchesDirectionalDerivativesOnEveryIsa) {
  Problem p{Shape{}};
  const std::string saved = active_isa();
  for (const std::string& isa : supported_isas()) {
    set_isa(isa);
    p.loss();  // out and lse of the unperturbed inputs
    std::vector<float> dq(p.q.size(), NAN), dk(p.k.size(), NAN), dv(p.v.size(), NAN);
    AttentionBackwardArgs b;
    const AttentionArgs f = p.forward_args();
    b.q = f.q, b.k = f.k, b.v = f.v, b.out = f.out, b.lse = *f.lse, b.causal = f.causal, b.enable_gqa = true;
    b.dout = TensorView(p.dout.data(), DType::float32, {p.s.B, p.s.Hq, p.s.Sq, p.s.Dv});
    b.dq = TensorView(dq.data(), DType::float32, {p.s.B, p.s.Hq, p.s.Sq, p.s.D});
    b.dk = TensorView(dk.data(), DType::float32, {p.s.B, p.s.Hkv, p.s.Skv, p.s.D});
    b.dv = TensorView(dv.data(), DType::float32, {p.s.B, p.s.Hkv, p.s.Skv, p.s.Dv});
    attention_backward(b);
    std::mt19937 gen(9);
    std::normal_distribution<float> dist;
    for (auto [x, g] : {std::pair{&p.q, &dq}, {&p.k, &dk}, {&p.v, &dv}}) {
      for (float y : *g) ASSERT_TRUE(std::isfinite(y)) << isa << ": a gradient element was not written";
      std::vector<float> u(x->size()), saved_x = *x;
      double predicted = 0;
      for (size_t i = 0; i < u.size(); ++i) predicted += double(u[i] = dist(gen)) * (*g)[i];
      const float eps = 1e-2f;
      for (size_t i = 0; i < u.size(); ++i) (*x)[i] = saved_x[i] + eps * u[i];
      const double plus = p.loss();
      for (size_t i = 0; i < u.size(); ++i) (*x)[i] = saved_x[i] - eps * u[i];
      const double minus = p.loss();
      *x = saved_x;
      const double measured = (plus - minus) / (2 * eps);
      EXPECT_NEAR(predicted, measured, 2e-3 * (1 + std::fabs(measured))) << isa;
    }
  }
  set_isa(saved);
}

TEST(AttentionBackwardApi, TypedErrors) {
  Problem p{Shape{}};
  p.loss();
  const AttentionArgs f = p.forward_args();
  std::vector<float> dq(p.q.size()), dk(p.k.size()), dv(p.v.size());
  AttentionBackwardArgs b;
  b.q = f.q, b.k = f.k, b.v = f.v, b.out = f.out, b.lse = *f.lse, b.causal = f.causal, b.enable_gqa = true;
  b.dout = f.out;
  b.dq = TensorView(dq.data(), DType::float32, {p.s.B, p.s.Hq, p.s.Sq, p.s.D});
  b.dk = TensorView(dk.data(), DType::float32, {p.s.B, p.s.Hkv, p.s.Skv, p.s.D});
  b.dv = TensorView(dv.data(), DType::float32, {p.s.B, p.s.Hkv, p.s.Skv, p.s.Dv - 1});
  try {
    attention_backward(b);
    FAIL() << "expected attnkit::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dv must have v's shape"), std::string::npos) << e.what();
  }
  b.dv = TensorView(dv.data(), DType::float32, {p.s.B, p.s.Hkv, p.s.Skv, p.s.Dv});
  b.dropout_p = 0.1;
  EXPECT_THROW(attention_backward(b), Error);  // dropout without the forward's seed
}

}  // namespace
}  // namespace attnkit
