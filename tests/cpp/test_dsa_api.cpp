// The C++ API of the DSA ops: the sparse decode over the V3.2 fp8 cache (split-KV included)
// and the indexer logits against double-precision restatements on every ISA, bit-identical
// results across thread counts, top-k order, and typed errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"

namespace {

constexpr int64_t kNope = 512, kRope = 64, kDqk = 576, kDv = 512, kToken = 656;

// Restores the ISA and thread count a test changes.
struct RuntimeGuard {
  std::string isa = attnkit::active_isa();
  int threads = attnkit::get_num_threads();
  ~RuntimeGuard() {
    attnkit::set_isa(isa);
    attnkit::set_num_threads(threads);
  }
};

// One V3.2 token as doubles: 512 fp8 values times their 128-value tile's scale, 64 bf16 rope.
std::vector<double> dequant_token(const uint8_t* t) {
  std::vector<double> v(kDqk);
  for (int64_t d = 0; d < kNope; ++d) {
    float scale;
    std::memcpy(&scale, t + kNope + d / 128 * 4, 4);
    v[d] = double{attnkit::float8_e4m3fn_to_float(t[d])} * scale;
  }
  for (int64_t d = 0; d < kRope; ++d) {
    uint16_t bits;
    std::memcpy(&bits, t + kNope + 16 + 2 * d, 2);
    v[kNope + d] = attnkit::bfloat16_to_float(bits);
  }
  return v;
}

struct SparseDecodeCase {
  int64_t b = 1, h = 16, topk = 1024, page = 64, blocks = 40;  // topk 1024 at batch 1: 2 splits
  std::vector<uint8_t> cache;
  std::vector<uint16_t> q;
  std::vector<int32_t> indices;

  explicit SparseDecodeCase(unsigned seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal;
    std::vector<float> values(blocks * page * kDqk);
    for (auto& x : values) x = normal(gen);
    cache.assign(blocks * page * kToken, 0);
    attnkit::quantize_v32_kv(attnkit::TensorView(values.data(), attnkit::DType::float32, {blocks * page, kDqk}),
                             attnkit::TensorView(cache.data(), attnkit::DType::uint8, {blocks * page, kToken}));
    q.resize(b * h * kDqk);
    for (auto& x : q) x = attnkit::float_to_bfloat16(0.5f * normal(gen));
    std::vector<int32_t> slots(blocks * page);
    for (int64_t i = 0; i < blocks * page; ++i) slots[i] = static_cast<int32_t>(i);
    std::shuffle(slots.begin(), slots.end(), gen);
    indices.assign(slots.begin(), slots.begin() + b * topk);
    for (int64_t i = 0; i < b * topk; i += 13) indices[i] = -1;  // invalid slots are skipped
  }

  void run(std::vector<uint16_t>& out, std::vector<float>& lse) {
    out.assign(b * h * kDv, 0xFFFF);  // NaN: every value must be written
    lse.assign(b * h, std::nanf(""));
    attnkit::MlaDecodeArgs a;
    a.q = attnkit::TensorView(q.data(), attnkit::DType::bfloat16, {b, 1, h, kDqk});
    a.k_cache = attnkit::TensorView(cache.data(), attnkit::DType::uint8, {blocks, page, 1, kToken});
    a.head_dim_v = kDv;
    a.is_fp8_kvcache = true;
    a.indices = attnkit::TensorView(indices.data(), attnkit::DType::int32, {b, 1, topk});
    a.out = attnkit::TensorView(out.data(), attnkit::DType::bfloat16, {b, 1, h, kDv});
    a.lse = attnkit::TensorView(lse.data(), attnkit::DType::float32, {b, 1, h});
    attnkit::flash_mla_with_kvcache(a);
  }
};

TEST(DsaApi, SparseDecodeMatchesDoubleOnEveryIsa) {
  RuntimeGuard guard;
  SparseDecodeCase c(3);
  std::vector<std::vector<double>> kv;
  for (int64_t t = 0; t < c.topk; ++t) {
    if (c.indices[t] >= 0) kv.push_back(dequant_token(c.cache.data() + int64_t{c.indices[t]} * kToken));
  }
  const double scale = 1.0 / std::sqrt(double(kDqk));
  for (const std::string& isa : attnkit::supported_isas()) {
    attnkit::set_isa(isa);
    std::vector<uint16_t> out;
    std::vector<float> lse;
    c.run(out, lse);
    for (int64_t hh = 0; hh < c.h; ++hh) {
      std::vector<double> s(kv.size());
      double m = -INFINITY;
      for (size_t j = 0; j < kv.size(); ++j) {
        double dot = 0;
        for (int64_t d = 0; d < kDqk; ++d) dot += attnkit::bfloat16_to_float(c.q[hh * kDqk + d]) * kv[j][d];
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      double l = 0;
      for (auto& x : s) l += (x = std::exp(x - m));
      EXPECT_NEAR(lse[hh], m + std::log(l), 1e-4 * (1 + std::abs(m))) << isa << " head " << hh;
      for (int64_t d = 0; d < kDv; ++d) {
        double want = 0, mag = 0;
        for (size_t j = 0; j < kv.size(); ++j) want += s[j] * kv[j][d], mag += s[j] * std::abs(kv[j][d]);
        want /= l, mag /= l;
        // bf16 rounding of out, and of P before P·V (FlashMLA's numerics): 2^-8 · Σp|V| / Σp
        const double got = attnkit::bfloat16_to_float(out[hh * kDv + d]);
        EXPECT_NEAR(got, want, 1.6e-2 * std::abs(want) + std::ldexp(mag, -8) + 1e-6) << isa << " head " << hh;
      }
    }
  }
}

TEST(DsaApi, SparseDecodeBitIdenticalAcrossThreadCounts) {
  RuntimeGuard guard;
  SparseDecodeCase c(4);
  std::vector<uint16_t> out1, out;
  std::vector<float> lse1, lse;
  attnkit::set_num_threads(1);
  c.run(out1, lse1);
  for (int threads : {2, 3, 5}) {
    attnkit::set_num_threads(threads);
    c.run(out, lse);
    EXPECT_EQ(out, out1) << threads << " threads";
    EXPECT_EQ(std::memcmp(lse.data(), lse1.data(), sizeof(float) * lse.size()), 0) << threads << " threads";
  }
}

TEST(DsaApi, SparseDecodeErrorsAreTyped) {
  SparseDecodeCase c(5);
  std::vector<uint16_t> out(c.b * c.h * kDv);
  std::vector<float> lse(c.b * c.h), q32(c.b * c.h * kDqk);
  attnkit::MlaDecodeArgs a;
  a.q = attnkit::TensorView(q32.data(), attnkit::DType::float32, {c.b, 1, c.h, kDqk});  // must be bf16
  a.k_cache = attnkit::TensorView(c.cache.data(), attnkit::DType::uint8, {c.blocks, c.page, 1, kToken});
  a.is_fp8_kvcache = true;
  a.indices = attnkit::TensorView(c.indices.data(), attnkit::DType::int32, {c.b, 1, c.topk});
  a.out = attnkit::TensorView(out.data(), attnkit::DType::bfloat16, {c.b, 1, c.h, kDv});
  a.lse = attnkit::TensorView(lse.data(), attnkit::DType::float32, {c.b, 1, c.h});
  EXPECT_THROW(attnkit::flash_mla_with_kvcache(a), attnkit::Error);
  a.q = attnkit::TensorView(c.q.data(), attnkit::DType::bfloat16, {c.b, 1, c.h, kDqk});
  a.indices = attnkit::TensorView(c.indices.data(), attnkit::DType::int32, {c.b, 2, c.topk / 2});  // s_q 2 != 1
  EXPECT_THROW(attnkit::flash_mla_with_kvcache(a), attnkit::Error);
  a.indices = attnkit::TensorView(c.indices.data(), attnkit::DType::int32, {c.b, 1, c.topk});
  a.k_cache = attnkit::TensorView(c.cache.data(), attnkit::DType::uint8, {c.blocks, c.page, 1, 600});  // not 656
  EXPECT_THROW(attnkit::flash_mla_with_kvcache(a), attnkit::Error);
}

TEST(DsaApi, IndexerLogitsMatchDoubleOnEveryIsa) {
  RuntimeGuard guard;
  const int64_t T = 5, H = 7, D = 64, S = 300;
  std::mt19937 gen(9);
  std::normal_distribution<float> normal;
  std::vector<uint8_t> q(T * H * D), k(S * D);
  for (auto& x : q) x = attnkit::float_to_float8_e4m3fn(4 * normal(gen));
  for (auto& x : k) x = attnkit::float_to_float8_e4m3fn(4 * normal(gen));
  std::vector<float> k_scale(S), w(T * H);
  for (auto& x : k_scale) x = 0.01f + 0.001f * std::abs(normal(gen));
  for (auto& x : w) x = normal(gen);
  std::vector<int32_t> ks(T), ke(T);
  for (int64_t t = 0; t < T; ++t) ks[t] = static_cast<int32_t>(7 * t), ke[t] = static_cast<int32_t>(S - 11 * t);
  for (const std::string& isa : attnkit::supported_isas()) {
    attnkit::set_isa(isa);
    std::vector<float> logits(T * S, std::nanf(""));
    attnkit::IndexerLogitsArgs a;
    a.q = attnkit::TensorView(q.data(), attnkit::DType::float8_e4m3fn, {T, H, D});
    a.kv = attnkit::TensorView(k.data(), attnkit::DType::float8_e4m3fn, {S, D});
    a.kv_scale = attnkit::TensorView(k_scale.data(), attnkit::DType::float32, {S});
    a.weights = attnkit::TensorView(w.data(), attnkit::DType::float32, {T, H});
    a.ks = attnkit::TensorView(ks.data(), attnkit::DType::int32, {T});
    a.ke = attnkit::TensorView(ke.data(), attnkit::DType::int32, {T});
    a.logits = attnkit::TensorView(logits.data(), attnkit::DType::float32, {T, S});
    attnkit::fp8_mqa_logits(a);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t s = 0; s < S; ++s) {
        const float got = logits[t * S + s];
        if (s < ks[t] || s >= ke[t]) {
          EXPECT_EQ(got, -INFINITY) << isa;
          continue;
        }
        double want = 0, mag = 0;
        for (int64_t hh = 0; hh < H; ++hh) {
          double dot = 0, dot_abs = 0;
          for (int64_t d = 0; d < D; ++d) {
            const double x = double{attnkit::float8_e4m3fn_to_float(q[(t * H + hh) * D + d])} *
                             attnkit::float8_e4m3fn_to_float(k[s * D + d]);
            dot += x, dot_abs += std::abs(x);
          }
          want += w[t * H + hh] * std::max(dot, 0.0);
          mag += std::abs(w[t * H + hh]) * dot_abs;
        }
        // float32 sums of exact products (bf16 pairs or fp32 FMAs): a few ulps of the magnitude
        EXPECT_NEAR(got, want * k_scale[s], 1e-5 * mag * k_scale[s] + 1e-12) << isa << " t " << t << " s " << s;
      }
    }
  }
  std::vector<float> logits(T * S);
  attnkit::IndexerLogitsArgs bad;
  bad.q = attnkit::TensorView(q.data(), attnkit::DType::float8_e4m3fn, {T, H, 48});  // D not in {32, 64, 128}
  bad.kv = attnkit::TensorView(k.data(), attnkit::DType::float8_e4m3fn, {S, 48});
  bad.kv_scale = attnkit::TensorView(k_scale.data(), attnkit::DType::float32, {S});
  bad.weights = attnkit::TensorView(w.data(), attnkit::DType::float32, {T, H});
  bad.ks = attnkit::TensorView(ks.data(), attnkit::DType::int32, {T});
  bad.ke = attnkit::TensorView(ke.data(), attnkit::DType::int32, {T});
  bad.logits = attnkit::TensorView(logits.data(), attnkit::DType::float32, {T, S});
  EXPECT_THROW(attnkit::fp8_mqa_logits(bad), attnkit::Error);
}

TEST(DsaApi, TopkOrdersByValueThenIndex) {
  const int64_t N = 2, L = 10, K = 4;
  std::vector<float> logits = {1, 3, 3, -INFINITY, 2, std::nanf(""), 3, 0, 0, 0,
                               5, 5, 5, 5, 5, 5, 5, 5, 5, 5};
  std::vector<int32_t> lengths = {10, 3}, out(N * K, 77);
  attnkit::TopkArgs a;
  a.logits = attnkit::TensorView(logits.data(), attnkit::DType::float32, {N, L});
  a.lengths = attnkit::TensorView(lengths.data(), attnkit::DType::int32, {N});
  a.topk = K;
  a.out = attnkit::TensorView(out.data(), attnkit::DType::int32, {N, K});
  attnkit::topk_transform(a);
  EXPECT_EQ(out, (std::vector<int32_t>{1, 2, 6, 4, 0, 1, 2, -1}));
  a.topk = 0;
  EXPECT_THROW(attnkit::topk_transform(a), attnkit::Error);
}

}  // namespace
