// The C++ API of the dense-attention backward: directional derivatives of the forward
// (central differences in double of <attention(q, k, v), dout>) against <grad, u> on every
// ISA with GQA, causal and a shape past the key and row blocks; typed errors; gradients
// fully written. The varlen backward: each sequence's gradients are the dense backward's on
// its rows (bit for bit), empty sequences give zeros, typed errors.
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

// Packed [rows, H, D] rows r0 .. r1 as a dense [1, H, r1 - r0, D] view (BHSD strides).
TensorView sequence_rows(float* base, int64_t r0, int64_t r1, int64_t h, int64_t d) {
  return TensorView(base + r0 * h * d, DType::float32, {1, h, r1 - r0, d}, {0, d, h * d, 1});
}

TEST(AttentionBackwardApi, VarlenIsTheDenseBackwardPerSequence) {
  const int64_t hq = 4, hkv = 2, d = 20, dv = 12;
  std::vector<int32_t> cu_q = {0, 9, 9, 40, 40}, cu_k = {0, 30, 35, 70, 70};  // queries but no keys last
  cu_q.back() = 43;
  const int64_t tq = cu_q.back(), tk = cu_k.back();
  std::mt19937 gen(3);
  std::normal_distribution<float> dist;
  std::vector<float> q(tq * hq * d), k(tk * hkv * d), v(tk * hkv * dv), dout(tq * hq * dv), sinks(hq);
  for (auto* t : {&q, &k, &v, &dout, &sinks})
    for (auto& x : *t) x = dist(gen);
  std::vector<float> out(tq * hq * dv), lse(tq * hq);
  VarlenAttentionArgs f;
  f.q = TensorView(q.data(), DType::float32, {tq, hq, d});
  f.k = TensorView(k.data(), DType::float32, {tk, hkv, d});
  f.v = TensorView(v.data(), DType::float32, {tk, hkv, dv});
  f.cu_seqlens_q = TensorView(cu_q.data(), DType::int32, {5});
  f.cu_seqlens_k = TensorView(cu_k.data(), DType::int32, {5});
  f.out = TensorView(out.data(), DType::float32, {tq, hq, dv});
  f.lse = TensorView(lse.data(), DType::float32, {tq, hq});
  f.causal = true, f.window_left = 11;
  f.sinks = TensorView(sinks.data(), DType::float32, {hq});
  varlen_attention(f);

  std::vector<float> dq(q.size(), NAN), dk(k.size(), NAN), dvv(v.size(), NAN), dsinks(hq, NAN);
  VarlenAttentionBackwardArgs b;
  b.q = f.q, b.k = f.k, b.v = f.v, b.cu_seqlens_q = f.cu_seqlens_q, b.cu_seqlens_k = f.cu_seqlens_k;
  b.out = f.out, b.lse = *f.lse, b.causal = true, b.window_left = 11, b.sinks = f.sinks;
  b.dout = TensorView(dout.data(), DType::float32, {tq, hq, dv});
  b.dq = TensorView(dq.data(), DType::float32, {tq, hq, d});
  b.dk = TensorView(dk.data(), DType::float32, {tk, hkv, d});
  b.dv = TensorView(dvv.data(), DType::float32, {tk, hkv, dv});
  b.dsinks = TensorView(dsinks.data(), DType::float32, {hq});
  varlen_attention_backward(b);

  std::vector<double> dsinks_sum(hq, 0.0);
  for (int s = 0; s < 4; ++s) {
    const int64_t q0 = cu_q[s], q1 = cu_q[s + 1], k0 = cu_k[s], k1 = cu_k[s + 1];
    if (q1 == q0 || k1 == k0) {  // zeros: no query reads these keys, or these queries see no key
      for (int64_t i = k0 * hkv * d; q1 == q0 && i < k1 * hkv * d; ++i) EXPECT_EQ(dk[i], 0.0f) << s;
      for (int64_t i = k0 * hkv * dv; q1 == q0 && i < k1 * hkv * dv; ++i) EXPECT_EQ(dvv[i], 0.0f) << s;
      for (int64_t i = q0 * hq * d; k1 == k0 && i < q1 * hq * d; ++i) EXPECT_EQ(dq[i], 0.0f) << s;
      continue;
    }
    std::vector<float> gq(q.size(), NAN), gk(k.size(), NAN), gv(v.size(), NAN), gs(hq, NAN);
    AttentionBackwardArgs a;
    a.q = sequence_rows(q.data(), q0, q1, hq, d), a.k = sequence_rows(k.data(), k0, k1, hkv, d);
    a.v = sequence_rows(v.data(), k0, k1, hkv, dv), a.out = sequence_rows(out.data(), q0, q1, hq, dv);
    a.lse = TensorView(lse.data() + q0 * hq, DType::float32, {1, hq, q1 - q0}, {0, 1, hq});
    a.dout = sequence_rows(dout.data(), q0, q1, hq, dv);
    a.dq = sequence_rows(gq.data(), q0, q1, hq, d), a.dk = sequence_rows(gk.data(), k0, k1, hkv, d);
    a.dv = sequence_rows(gv.data(), k0, k1, hkv, dv);
    a.causal = Causal::bottom_right, a.enable_gqa = true, a.window_left = 11, a.sinks = f.sinks;
    a.dsinks = TensorView(gs.data(), DType::float32, {hq});
    attention_backward(a);
    for (int64_t i = q0 * hq * d; i < q1 * hq * d; ++i) ASSERT_EQ(dq[i], gq[i]) << "dq, sequence " << s;
    for (int64_t i = k0 * hkv * d; i < k1 * hkv * d; ++i) ASSERT_EQ(dk[i], gk[i]) << "dk, sequence " << s;
    for (int64_t i = k0 * hkv * dv; i < k1 * hkv * dv; ++i) ASSERT_EQ(dvv[i], gv[i]) << "dv, sequence " << s;
    for (int64_t h = 0; h < hq; ++h) dsinks_sum[h] += gs[h];
  }
  for (int64_t h = 0; h < hq; ++h) EXPECT_EQ(dsinks[h], static_cast<float>(dsinks_sum[h])) << h;

  b.dlse = TensorView(lse.data(), DType::float32, {tq, hq + 1});  // (shape only: never read)
  try {
    varlen_attention_backward(b);
    FAIL() << "expected attnkit::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dlse must have lse's shape [43, 4]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace attnkit
