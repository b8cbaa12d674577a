// Reliability of the C++ API (issue 12): NaN and inf in q and k propagate through int8
// sage_attention exactly as through exact attention; sizes and strides whose offsets
// overflow int64, self-overlapping outputs, null data (also of the index arrays and scales
// the checks read) and ranks outside [0, 6] are errors;
// scales are checked in float32;
// empty K/V may have a null data pointer (dense and varlen); bf16 K may start at an odd element.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"

namespace attnkit {
namespace {

std::string error_of(void (*op)(const AttentionArgs&), const AttentionArgs& a) {
  try {
    op(a);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

std::vector<float> randn(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<float> x(n);
  for (auto& v : x) v = dist(gen);
  return x;
}

void sage_op(const AttentionArgs& a) {
  SageArgs s;
  s.q = a.q, s.k = a.k, s.v = a.v, s.out = a.out, s.lse = a.lse, s.causal = a.causal, s.scale = a.scale;
  sage_attention(s);
}

// Restores the ISA active before the test.
struct IsaGuard {
  std::string saved = active_isa();
  ~IsaGuard() { set_isa(saved); }
};

TEST(Reliability, ElementCountOverflowIsAnError) {
  const int64_t big = int64_t{1} << 40;
  float x = 0.0f;
  EXPECT_THROW(TensorView(&x, DType::float32, {big, big}), Error);
  const TensorView strided(&x, DType::float32, {big, big}, {0, 0});  // a broadcast view: fine to build
  try {
    (void)strided.numel();
    ADD_FAILURE() << "numel() of [2^40, 2^40] returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("overflows int64"), std::string::npos) << e.what();
  }
  // Empty views stay empty whatever the other sizes.
  EXPECT_EQ(TensorView(&x, DType::float32, {0, big, big}).numel(), 0);
  EXPECT_EQ(TensorView(&x, DType::float32, {big, big, 0}, {0, 0, 0}).numel(), 0);

  // A q broadcast to a huge shape reaches the op as an Error, not as wrapped arithmetic.
  std::vector<float> buf(64, 1.0f), out(64);
  AttentionArgs a;
  a.q = a.k = a.v = a.out = TensorView(buf.data(), DType::float32, {big, big, 1, 8}, {0, 0, 0, 1});
  EXPECT_EQ(error_of(attention, a),
            "q of shape [1099511627776, 1099511627776, 1, 8] has more elements than int64 counts (the count "
            "overflows int64)");
  // Strides whose offsets overflow int64.
  a.q = TensorView(buf.data(), DType::float32, {1, 1, 3, 8}, {0, 0, int64_t{1} << 62, 1});
  a.k = a.v = TensorView(buf.data(), DType::float32, {1, 1, 1, 8});
  a.out = TensorView(out.data(), DType::float32, {1, 1, 3, 8});
  EXPECT_EQ(error_of(attention, a), "q strides [0, 0, 4611686018427387904, 1] with shape [1, 1, 3, 8] reach beyond int64 elements");
}

TEST(Reliability, SelfOverlappingOutIsRejected) {
  std::vector<float> q = randn(2 * 2 * 8, 1), k = randn(2 * 5 * 8, 2), v = randn(2 * 5 * 4, 3);
  std::vector<float> out(256, NAN);
  AttentionArgs a;
  a.q = TensorView(q.data(), DType::float32, {1, 2, 2, 8});
  a.k = TensorView(k.data(), DType::float32, {1, 2, 5, 8});
  a.v = TensorView(v.data(), DType::float32, {1, 2, 5, 4});
  // Heads one element apart over rows of 4: out[h=1][i][d] is out[h=0][i][d+1].
  a.out = TensorView(out.data(), DType::float32, {1, 2, 2, 4}, {64, 1, 4, 1});
  for (auto op : {attention, sage_op}) {
    const std::string msg = error_of(op, a);
    EXPECT_NE(msg.find("out must not have overlapping elements"), std::string::npos) << msg;
  }
  AttentionArgs b = a;
  std::vector<float> lse(64, NAN), out_ok(64);
  b.out = TensorView(out_ok.data(), DType::float32, {1, 2, 2, 4});
  b.lse = TensorView(lse.data(), DType::float32, {1, 2, 2}, {0, 1, 1});  // lse[h=1][0] is lse[h=0][1]
  EXPECT_NE(error_of(attention, b).find("lse must not have overlapping elements"), std::string::npos)
      << error_of(attention, b);

  // Not nested (stride 3 is within the reach 2 · 2 of the stride-2 dim) but distinct
  // (offsets 0 2 4 3 5 7): accepted, with the values of a contiguous out.
  a.v = TensorView(v.data(), DType::float32, {1, 2, 5, 3});
  std::vector<float> ref(2 * 2 * 3), odd(16, NAN);
  a.out = TensorView(ref.data(), DType::float32, {1, 2, 2, 3});
  attention(a);
  a.out = TensorView(odd.data(), DType::float32, {1, 2, 2, 3}, {0, 8, 3, 2});
  attention(a);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 2; ++i)
      for (int d = 0; d < 3; ++d) EXPECT_EQ(odd[h * 8 + i * 3 + d * 2], ref[(h * 2 + i) * 3 + d]);
}

// A view an op reads or writes has a rank in [0, 6] and, unless it is empty, data: a null
// pointer was read (q, out) or taken for "not given" (lse, mask, sinks, alibi_slopes).
TEST(Reliability, NullDataAndBadRanksAreErrors) {
  std::vector<float> q = randn(16, 2), out(16), lse(2), mask(4, 0.0f), per_head(1, 0.5f);
  AttentionArgs a;
  a.q = a.k = a.v = TensorView(q.data(), DType::float32, {1, 1, 2, 8});
  a.out = TensorView(out.data(), DType::float32, {1, 1, 2, 8});
  a.lse = TensorView(lse.data(), DType::float32, {1, 1, 2});
  a.attn_mask = TensorView(mask.data(), DType::float32, {1, 1, 2, 2});
  a.sinks = TensorView(per_head.data(), DType::float32, {1});
  a.alibi_slopes = TensorView(per_head.data(), DType::float32, {1});
  EXPECT_EQ(error_of(attention, a), "no error");
  auto without_data = [&](TensorView& t, const std::string& message) {
    void* saved = t.data;
    t.data = nullptr;
    EXPECT_EQ(error_of(attention, a), message);
    t.data = saved;
  };
  without_data(a.q, "q has no data (a null pointer) for its shape [1, 1, 2, 8]");
  without_data(a.out, "out has no data (a null pointer) for its shape [1, 1, 2, 8]");
  without_data(*a.lse, "lse has no data (a null pointer) for its shape [1, 1, 2]");
  without_data(*a.attn_mask, "attn_mask has no data (a null pointer) for its shape [1, 1, 2, 2]");
  without_data(*a.sinks, "sinks has no data (a null pointer) for its shape [1]");
  without_data(*a.alibi_slopes, "alibi_slopes has no data (a null pointer) for its shape [1]");
  for (const int rank : {7, 2000, -1}) {
    const int saved = a.attn_mask->rank;
    a.attn_mask->rank = rank;
    EXPECT_EQ(error_of(attention, a), "attn_mask must have 0 to 6 dims, got rank " + std::to_string(rank));
    a.attn_mask->rank = saved;
  }
  EXPECT_EQ(error_of(attention, a), "no error");

  std::vector<float> state(16), lse_state(2);
  MergeStatesArgs m;
  m.out_a = m.out_b = TensorView(q.data(), DType::float32, {2, 1, 8});
  m.lse_a = m.lse_b = TensorView(lse.data(), DType::float32, {2, 1});
  m.out = TensorView(state.data(), DType::float32, {2, 1, 8});
  m.lse_out = TensorView(nullptr, DType::float32, {2, 1});
  try {
    merge_attention_states(m);
    ADD_FAILURE() << "a null lse_out was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "lse_out has no data (a null pointer) for its shape [2, 1]");
  }
}

// Index arrays and scales whose values the checks read (lengths, cache_seqlens, key ranges,
// kv scales, the sparse scales) were read before their data pointer was checked (SEGV).
TEST(Reliability, ValidatedValuesWithoutDataAreErrors) {
  auto error = [](auto op) -> std::string {
    try {
      op();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  std::vector<float> logits(8, 1.0f);
  std::vector<int32_t> out(4), lengths(2, 2);
  TopkArgs t;
  t.logits = TensorView(logits.data(), DType::float32, {2, 4});
  t.lengths = TensorView(nullptr, DType::int32, {2});
  t.topk = 2;
  t.out = TensorView(out.data(), DType::int32, {2, 2});
  EXPECT_EQ(error([&] { topk_transform(t); }), "lengths has no data (a null pointer) for its shape [2]");
  t.lengths = TensorView(lengths.data(), DType::int32, {2});
  t.page_table = TensorView(nullptr, DType::int32, {2, 1});
  t.page_size = 4;
  EXPECT_EQ(error([&] { topk_transform(t); }), "page_table has no data (a null pointer) for its shape [2, 1]");

  std::vector<float> kv(2 * 8), cache(4 * 8);
  std::vector<int32_t> slots = {0, 1};
  AppendKvCacheArgs ap;
  ap.k = ap.v = TensorView(kv.data(), DType::float32, {2, 1, 8});
  ap.k_cache = TensorView(cache.data(), DType::float32, {2, 2, 1, 8});
  ap.v_cache = TensorView(cache.data() + 0, DType::float32, {2, 2, 1, 8});
  ap.slot_mapping = TensorView(slots.data(), DType::int32, {2});
  ap.k_scale = TensorView(nullptr, DType::float32, {1});
  EXPECT_EQ(error([&] { append_kv_cache(ap); }), "k_scale has no data (a null pointer) for its shape [1]");

  std::vector<uint16_t> q(1 * 1 * 2 * 8), bf16_cache(2 * 4 * 8), mla_out(2 * 8);
  std::vector<int32_t> table = {0}, seqlens = {3};
  std::vector<float> mla_lse(2);
  MlaDecodeArgs m;
  m.q = TensorView(q.data(), DType::bfloat16, {1, 1, 2, 8});
  m.k_cache = TensorView(bf16_cache.data(), DType::bfloat16, {2, 4, 1, 8});
  m.block_table = TensorView(table.data(), DType::int32, {1, 1});
  m.cache_seqlens = TensorView(nullptr, DType::int32, {1});
  m.head_dim_v = 8;
  m.out = TensorView(mla_out.data(), DType::bfloat16, {1, 1, 2, 8});
  m.lse = TensorView(mla_lse.data(), DType::float32, {1, 1, 2});
  EXPECT_EQ(error([&] { flash_mla_with_kvcache(m); }), "cache_seqlens has no data (a null pointer) for its shape [1]");
  m.cache_seqlens = TensorView(seqlens.data(), DType::int32, {1});
  m.block_table = TensorView(nullptr, DType::int32, {1, 1});
  EXPECT_EQ(error([&] { flash_mla_with_kvcache(m); }), "block_table has no data (a null pointer) for its shape [1, 1]");

  std::vector<uint8_t> fp8(2 * 32, 0x38);
  std::vector<float> scale(2, 1.0f), weights(1, 1.0f);
  std::vector<int32_t> ke = {2}, topk(1);
  IndexerLogitsArgs ix;
  ix.q = TensorView(fp8.data(), DType::float8_e4m3fn, {1, 1, 32});
  ix.kv = TensorView(fp8.data(), DType::float8_e4m3fn, {2, 32});
  ix.kv_scale = TensorView(scale.data(), DType::float32, {2});
  ix.weights = TensorView(weights.data(), DType::float32, {1, 1});
  ix.ks = TensorView(nullptr, DType::int32, {1});
  ix.ke = TensorView(ke.data(), DType::int32, {1});
  ix.topk_indices = TensorView(topk.data(), DType::int32, {1, 1});
  EXPECT_EQ(error([&] { fp8_mqa_logits(ix); }), "cu_seq_len_k_start has no data (a null pointer) for its shape [1]");

  SparseMlaArgs sp;
  std::vector<uint16_t> sq(16 * 8), skv(4 * 8), sout(16 * 8);
  std::vector<int32_t> idx = {0, 1};
  std::vector<float> sml(16), slse(16);
  sp.q = TensorView(sq.data(), DType::bfloat16, {1, 16, 8});
  sp.kv = TensorView(skv.data(), DType::bfloat16, {4, 1, 8});
  sp.indices = TensorView(idx.data(), DType::int32, {1, 1, 2});
  sp.sm_scale = 0.3;
  sp.d_v = 8;
  sp.q_scale = TensorView(nullptr, DType::float32, {1});
  sp.out = TensorView(sout.data(), DType::bfloat16, {1, 16, 8});
  sp.max_logits = TensorView(sml.data(), DType::float32, {1, 16});
  sp.lse = TensorView(slse.data(), DType::float32, {1, 16});
  EXPECT_EQ(error([&] { sparse_mla_prefill_fwd(sp); }), "q_scale has no data (a null pointer) for its shape [1]");
}

TEST(Reliability, ScalesAreCheckedInFloat32) {
  std::vector<float> q = randn(32, 1), out(32);
  AttentionArgs a;
  a.q = a.k = a.v = TensorView(q.data(), DType::float32, {1, 1, 4, 8});
  a.out = TensorView(out.data(), DType::float32, {1, 1, 4, 8});
  a.scale = 1e39;  // finite in double, inf in float32
  for (auto op : {attention, sage_op}) {
    EXPECT_EQ(error_of(op, a), "scale must be finite, got 1e+39 (inf in float32, the precision the kernels use)");
  }
  a.scale = 3e38;
  EXPECT_EQ(error_of(attention, a), "no error");
}

// A small sparse MLA call: fp8 q/kv codes of 1.0, one valid index per row.
struct SparseCase {
  std::vector<uint8_t> q = std::vector<uint8_t>(2 * 2 * 16, 0x38), kv = std::vector<uint8_t>(3 * 16, 0x38);
  std::vector<int32_t> idx = {0, 2};
  std::vector<uint16_t> out = std::vector<uint16_t>(2 * 2 * 8);
  std::vector<float> max_logits = std::vector<float>(4), lse = std::vector<float>(4);
  float q_scale = 0.5f, kv_scale = 0.25f;
  SparseMlaArgs args() {
    SparseMlaArgs a;
    a.q = TensorView(q.data(), DType::float8_e4m3fn, {2, 2, 16});
    a.kv = TensorView(kv.data(), DType::float8_e4m3fn, {3, 1, 16});
    a.indices = TensorView(idx.data(), DType::int32, {2, 1, 1});
    a.sm_scale = 0.25;
    a.d_v = 8;
    a.q_scale = TensorView(&q_scale, DType::float32, {1});
    a.kv_scale = TensorView(&kv_scale, DType::float32, {1});
    a.out = TensorView(out.data(), DType::bfloat16, {2, 2, 8});
    a.max_logits = TensorView(max_logits.data(), DType::float32, {2, 2});
    a.lse = TensorView(lse.data(), DType::float32, {2, 2});
    return a;
  }
};

std::string sparse_error(const SparseMlaArgs& a) {
  try {
    sparse_mla_prefill_fwd(a);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Reliability, SparseMlaScalesMustBeFinite) {
  SparseCase c;
  EXPECT_EQ(sparse_error(c.args()), "no error");
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    c.q_scale = bad;
    EXPECT_NE(sparse_error(c.args()).find("q_scale must be finite"), std::string::npos) << sparse_error(c.args());
    c.q_scale = 0.5f, c.kv_scale = bad;
    EXPECT_NE(sparse_error(c.args()).find("kv_scale must be finite"), std::string::npos) << sparse_error(c.args());
    c.kv_scale = 0.25f;
  }
  SparseMlaArgs a = c.args();
  a.sm_scale = 1e39;
  EXPECT_EQ(sparse_error(a), "sm_scale must be finite, got 1e+39 (inf in float32, the precision the kernels use)");
  a.sm_scale = 3e38;
  c.q_scale = 1e30f;
  a.q_scale = TensorView(&c.q_scale, DType::float32, {1});
  EXPECT_NE(sparse_error(a).find("sm_scale * q_scale * kv_scale must be finite"), std::string::npos) << sparse_error(a);
}

// Empty K/V with a null data pointer and non-zero strides (an empty torch tensor): every row
// sees no key, so out is 0 and lse -inf, on every ISA and for sage.
TEST(Reliability, EmptyKeysWithNullData) {
  IsaGuard guard;
  std::vector<float> q = randn(2 * 3 * 8, 4);
  for (const std::string& isa : supported_isas()) {
    set_isa(isa);
    for (auto op : {attention, sage_op}) {
      std::vector<float> out(2 * 3 * 4, NAN), lse(6, NAN);
      AttentionArgs a;
      a.q = TensorView(q.data(), DType::float32, {1, 2, 3, 8});
      a.k = TensorView(nullptr, DType::float32, {1, 2, 0, 8}, {16, 8, 8, 1});
      a.v = TensorView(nullptr, DType::float32, {1, 2, 0, 4}, {8, 4, 4, 1});
      a.out = TensorView(out.data(), DType::float32, {1, 2, 3, 4});
      a.lse = TensorView(lse.data(), DType::float32, {1, 2, 3});
      op(a);
      for (float x : out) EXPECT_EQ(x, 0.0f) << isa;
      for (float x : lse) EXPECT_EQ(x, -INFINITY) << isa;
    }
  }
}

// The same for varlen_attention with no keys at all (total_k = 0, null k and v with a
// non-zero head stride): found by the fuzz driver, UBSan reported the kernel forming an
// offset from the null pointer.
TEST(Reliability, VarlenEmptyKeysWithNullData) {
  IsaGuard guard;
  std::vector<float> q = randn(3 * 2 * 8, 5);
  std::vector<int32_t> cu_q = {0, 1, 3}, cu_k = {0, 0, 0};
  for (const std::string& isa : supported_isas()) {
    set_isa(isa);
    for (bool causal : {false, true}) {
      std::vector<float> out(3 * 2 * 4, NAN), lse(3 * 2, NAN);
      VarlenAttentionArgs a;
      a.q = TensorView(q.data(), DType::float32, {3, 2, 8});
      a.k = TensorView(nullptr, DType::float32, {0, 2, 8}, {-16, -8, 1});
      a.v = TensorView(nullptr, DType::float32, {0, 2, 4}, {8, 4, 1});
      a.cu_seqlens_q = TensorView(cu_q.data(), DType::int32, {3});
      a.cu_seqlens_k = TensorView(cu_k.data(), DType::int32, {3});
      a.out = TensorView(out.data(), DType::float32, {3, 2, 4});
      a.lse = TensorView(lse.data(), DType::float32, {3, 2});
      a.causal = causal;
      varlen_attention(a);
      for (float x : out) EXPECT_EQ(x, 0.0f) << isa;
      for (float x : lse) EXPECT_EQ(x, -INFINITY) << isa;
    }
  }
}

// The backward with no queries (Sq = 0, found by the fuzzer): q, out, dout and dq are empty
// with null data and arbitrary strides (negative ones included); nothing may be formed from
// them, and dK and dV come out zero.
TEST(Reliability, BackwardEmptyQueriesWithNullData) {
  IsaGuard guard;
  std::vector<float> k = randn(2 * 31 * 8, 7), v = randn(2 * 31 * 8, 8);
  std::vector<float> lse_storage(1);
  for (const std::string& isa : supported_isas()) {
    set_isa(isa);
    std::vector<float> dk(k.size(), NAN), dv(v.size(), NAN);
    AttentionBackwardArgs a;
    a.q = TensorView(nullptr, DType::float32, {2, 3, 0, 8}, {-1, 2, 0, 3});
    a.k = TensorView(k.data(), DType::float32, {2, 1, 31, 8});
    a.v = TensorView(v.data(), DType::float32, {2, 1, 31, 8});
    a.out = TensorView(nullptr, DType::float32, {2, 3, 0, 8}, {-1, 2, 0, 3});
    a.lse = TensorView(lse_storage.data(), DType::float32, {2, 3, 0});
    a.dout = TensorView(nullptr, DType::float32, {2, 3, 0, 8}, {-1, 2, 0, 3});
    a.dq = TensorView(nullptr, DType::float32, {2, 3, 0, 8});
    a.dk = TensorView(dk.data(), DType::float32, {2, 1, 31, 8});
    a.dv = TensorView(dv.data(), DType::float32, {2, 1, 31, 8});
    a.enable_gqa = true;
    attention_backward(a);
    for (float x : dk) EXPECT_EQ(x, 0.0f) << isa;
    for (float x : dv) EXPECT_EQ(x, 0.0f) << isa;
  }
}

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = float_to_bfloat16(x[i]);
  return r;
}

// bf16 K (and Q, V) starting at an odd element, as numpy's k[..., 1:] gives: the same bits
// as from an aligned copy (vdpbf16ps reads K pairs in place; under UBSan a misaligned
// uint32_t read was reported here).
TEST(Reliability, Bf16InputsAtOddElements) {
  IsaGuard guard;
  const int64_t S = 130, D = 32;
  const std::vector<uint16_t> base = to_bf16(randn(S * D + 1, 5)), vals = to_bf16(randn(S * D + 1, 6));
  for (const std::string& isa : supported_isas()) {
    set_isa(isa);
    for (auto op : {attention, sage_op}) {
      for (int64_t sq : {int64_t{1}, S}) {
        std::vector<uint16_t> out_odd(sq * D), out_even(sq * D);
        AttentionArgs a;
        a.q = TensorView(const_cast<uint16_t*>(base.data()) + 1, DType::bfloat16, {1, 1, sq, D});
        a.k = TensorView(const_cast<uint16_t*>(base.data()) + 1, DType::bfloat16, {1, 1, S, D});
        a.v = TensorView(const_cast<uint16_t*>(vals.data()) + 1, DType::bfloat16, {1, 1, S, D});
        a.out = TensorView(out_odd.data(), DType::bfloat16, {1, 1, sq, D});
        op(a);
        std::vector<uint16_t> k(base.begin() + 1, base.end()), v(vals.begin() + 1, vals.end());
        a.k = TensorView(k.data(), DType::bfloat16, {1, 1, S, D});
        a.q = TensorView(k.data(), DType::bfloat16, {1, 1, sq, D});
        a.v = TensorView(v.data(), DType::bfloat16, {1, 1, S, D});
        a.out = TensorView(out_even.data(), DType::bfloat16, {1, 1, sq, D});
        op(a);
        EXPECT_EQ(out_odd, out_even) << isa << " Sq=" << sq;
      }
    }
  }
}

// NaN and inf in q or k: int8 sage_attention must give NaN, ±inf and finite values at the
// same positions as exact attention (out and lse), on every ISA, for prefill and decode
// (key splits), with and without causal masking. Exact attention itself must follow the
// float64 rule: a row whose visible logits include a NaN or +inf is NaN; -inf logits drop
// their key; a row with only -inf logits is 0 with lse -inf.
struct NonfiniteCase {
  const char* what;
  int64_t Sq, Skv;
  bool causal;
  void (*inject)(std::vector<float>& q, std::vector<float>& k, int64_t Sq, int64_t Skv, int64_t D);
};

TEST(Reliability, SageNonfiniteMatchesExactAttention) {
  IsaGuard guard;
  const int64_t H = 2, D = 24, Dv = 16;
  const NonfiniteCase cases[] = {
      {"NaN in one k element", 60, 200, false, [](auto&, auto& k, auto, auto, auto D) { k[(7) * D + 3] = NAN; }},
      {"NaN in k under causal", 60, 200, true, [](auto&, auto& k, auto, auto, auto D) { k[(150) * D + 3] = NAN; }},
      {"+inf in one k element", 60, 200, false, [](auto&, auto& k, auto, auto, auto D) { k[130 * D] = INFINITY; }},
      {"NaN in one q element", 60, 200, false, [](auto& q, auto&, auto, auto, auto D) { q[5 * D + 1] = NAN; }},
      {"inf in q, all logits -inf", 60, 200, false,
       [](auto& q, auto& k, auto, auto Skv, auto D) {
         q[9 * D] = -INFINITY;
         for (int64_t j = 0; j < 2 * Skv; ++j) k[j * D] = std::fabs(k[j * D]) + 0.5f;  // both heads
       }},
      {"huge finite k", 60, 200, false, [](auto&, auto& k, auto, auto, auto D) { k[11 * D + 2] = 3e38f; }},
      {"decode: NaN in k", 1, 3000, false, [](auto&, auto& k, auto, auto, auto D) { k[2500 * D + 5] = NAN; }},
      {"decode: NaN in q", 1, 3000, false, [](auto& q, auto&, auto, auto, auto D) { q[0] = NAN; }},
  };
  for (const NonfiniteCase& c : cases) {
    std::vector<float> q = randn(H * c.Sq * D, 7), k = randn(H * c.Skv * D, 8), v = randn(H * c.Skv * Dv, 9);
    c.inject(q, k, c.Sq, c.Skv, D);
    // The float64 rule for exact attention, on head 0 and 1 (H = Hkv).
    std::vector<int> row_state(H * c.Sq);  // 0 finite, 1 NaN, 2 no key (out 0, lse -inf)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < c.Sq; ++i) {
        bool nan = false, live = false;
        for (int64_t j = 0; j < c.Skv; ++j) {
          if (c.causal && j > i + c.Skv - c.Sq) break;
          double s = 0;
          for (int64_t d = 0; d < D; ++d) s += double(q[(h * c.Sq + i) * D + d]) * k[(h * c.Skv + j) * D + d];
          nan = nan || std::isnan(s) || s == INFINITY;
          live = live || s > -INFINITY;
        }
        row_state[h * c.Sq + i] = nan ? 1 : (live ? 0 : 2);
      }
    }
    for (const std::string& isa : supported_isas()) {
      set_isa(isa);
      std::vector<float> out[2], lse[2];
      for (int which = 0; which < 2; ++which) {
        out[which].assign(H * c.Sq * Dv, 1234.0f);
        lse[which].assign(H * c.Sq, 1234.0f);
        AttentionArgs a;
        a.q = TensorView(q.data(), DType::float32, {1, H, c.Sq, D});
        a.k = TensorView(k.data(), DType::float32, {1, H, c.Skv, D});
        a.v = TensorView(v.data(), DType::float32, {1, H, c.Skv, Dv});
        a.out = TensorView(out[which].data(), DType::float32, {1, H, c.Sq, Dv});
        a.lse = TensorView(lse[which].data(), DType::float32, {1, H, c.Sq});
        a.causal = c.causal ? Causal::bottom_right : Causal::none;
        (which == 0 ? attention : sage_op)(a);
      }
      for (int64_t r = 0; r < H * c.Sq; ++r) {
        const float exact_lse = lse[0][r], sage_lse = lse[1][r];
        const int state = row_state[r];
        ASSERT_EQ(std::isnan(exact_lse), state == 1) << c.what << " " << isa << " row " << r << " lse " << exact_lse;
        ASSERT_EQ(exact_lse == -INFINITY, state == 2) << c.what << " " << isa << " row " << r;
        ASSERT_EQ(std::isnan(sage_lse), std::isnan(exact_lse)) << c.what << " " << isa << " row " << r;
        ASSERT_EQ(std::isinf(sage_lse), std::isinf(exact_lse)) << c.what << " " << isa << " row " << r;
        for (int64_t d = 0; d < Dv; ++d) {
          const float e = out[0][r * Dv + d], s = out[1][r * Dv + d];
          ASSERT_EQ(std::isnan(e), state == 1) << c.what << " " << isa << " row " << r;
          if (state == 2) {
            ASSERT_EQ(e, 0.0f) << c.what << " " << isa << " row " << r;
          }
          ASSERT_EQ(std::isnan(s), std::isnan(e)) << c.what << " " << isa << " row " << r << " d " << d;
          ASSERT_EQ(std::isinf(s), std::isinf(e)) << c.what << " " << isa << " row " << r << " d " << d;
          if (state == 2) {
            ASSERT_EQ(s, 0.0f) << c.what << " " << isa << " row " << r;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attnkit
