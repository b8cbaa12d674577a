// The sparse MLA prefill contracts: the general op (any head count, padded internally) and
// SGLang's strict q8kv8 contract on top of it. All checks in a fixed order, then a plain
// SparseMlaParams for the kernels.
#include "attnkit/sparse_mla.h"

#include <cmath>
#include <string>

#include "attnkit/error.h"
#include "core/dispatch.h"
#include "ops/checks.h"
#include "ops/sparse_mla_params.h"

namespace attnkit {
namespace {

using detail::check_no_overlap;
using detail::check_output;
using detail::fail;

constexpr const char* kStrictOp = "sparse_mla_q8kv8_prefill_fwd";

float read_scale(const std::optional<TensorView>& t, const char* name, bool required, DType dtype) {
  if (!t) {
    if (required) fail(name, " is required for ", dtype_name(dtype), " inputs (a float32 scalar)");
    return 1.0f;
  }
  detail::check_view(*t, name);
  if (t->dtype != DType::float32 || t->numel() != 1) {
    fail(name, " must be a float32 tensor with one element, got ", dtype_name(t->dtype), " of shape ",
         t->shape_str());
  }
  const float value = *static_cast<const float*>(t->data);
  if (!std::isfinite(value)) fail(name, " must be finite, got ", value);
  return value;
}

}  // namespace

void sparse_mla_prefill_fwd(const SparseMlaArgs& a) {
  // 1. Ranks.
  detail::check_rank(a.q, "q", 3, "[s_q, h_q, d_qk]");
  detail::check_rank(a.kv, "kv", 3, "[s_kv, h_kv, d_qk]");
  detail::check_rank(a.indices, "indices", 3, "[s_q, h_kv, topk]");
  detail::check_sizes_nonnegative(a.q, "q");
  detail::check_sizes_nonnegative(a.kv, "kv");
  detail::check_sizes_nonnegative(a.indices, "indices");

  // 2. Dtypes.
  const DType dtype = a.q.dtype;
  if (dtype != DType::bfloat16 && dtype != DType::float8_e4m3fn) {
    fail("q must be bfloat16 or float8_e4m3fn, got ", dtype_name(dtype));
  }
  if (a.kv.dtype != dtype) fail("kv must have q's dtype ", dtype_name(dtype), ", got ", dtype_name(a.kv.dtype));
  if (a.indices.dtype != DType::int32) fail("indices must be int32, got ", dtype_name(a.indices.dtype));

  // 3. Sizes.
  const int64_t s_q = a.q.shape[0], h_q = a.q.shape[1], d_qk = a.q.shape[2];
  const int64_t s_kv = a.kv.shape[0], h_kv = a.kv.shape[1], topk = a.indices.shape[2];
  if (h_q < 1) fail("q must have at least one head, got h_q=", h_q);
  if (d_qk < 1) fail("q head dim d_qk must be positive, got ", d_qk);
  if (h_kv != 1) fail("kv must have one head (h_kv=1), got ", h_kv);
  if (a.kv.shape[2] != d_qk) fail("kv d_qk must match q d_qk=", d_qk, ", got ", a.kv.shape[2]);
  if (a.indices.shape[0] != s_q || a.indices.shape[1] != h_kv || topk < 1) {
    fail("indices must have shape (", s_q, ", ", h_kv, ", topk) with topk >= 1, got ", a.indices.shape_str());
  }
  if (a.d_v < 1 || a.d_v > d_qk) fail("d_v must be in [1, d_qk=", d_qk, "], got ", a.d_v);

  // 4. Scales, sink and top-k lengths.
  const bool fp8 = dtype == DType::float8_e4m3fn;
  const float q_scale = read_scale(a.q_scale, "q_scale", fp8, dtype);
  const float kv_scale = read_scale(a.kv_scale, "kv_scale", fp8, dtype);
  // Checked as the kernel uses it, in float32, and so is the logit scale it folds into Q.
  const float sm_scale = detail::check_float32_scale(a.sm_scale, "sm_scale");
  if (!std::isfinite(sm_scale * q_scale * kv_scale)) {
    fail("sm_scale * q_scale * kv_scale must be finite in float32, got ", a.sm_scale, " * ", q_scale, " * ", kv_scale);
  }
  if (a.attn_sink) {
    const TensorView& s = *a.attn_sink;
    detail::check_view(s, "attn_sink");
    if (s.rank != 1 || s.shape[0] != h_q || s.dtype != DType::float32) {
      fail("attn_sink must be float32 of shape [", h_q, "] (h_q), got ", dtype_name(s.dtype), " of shape ",
           s.shape_str());
    }
  }
  if (a.topk_length) {
    const TensorView& t = *a.topk_length;
    detail::check_view(t, "topk_length");
    if (t.rank != 1 || t.shape[0] != s_q || t.dtype != DType::int32) {
      fail("topk_length must be int32 of shape [", s_q, "] (s_q), got ", dtype_name(t.dtype), " of shape ",
           t.shape_str());
    }
  }

  // 5. Outputs: shapes, dtypes, contiguity, no aliasing among them or with an input.
  check_output(a.out, "out", DType::bfloat16, {s_q, h_q, a.d_v});
  check_output(a.max_logits, "max_logits", DType::float32, {s_q, h_q});
  check_output(a.lse, "lse", DType::float32, {s_q, h_q});
  const std::pair<const TensorView*, const char*> outputs[] = {
      {&a.out, "out"}, {&a.max_logits, "max_logits"}, {&a.lse, "lse"}};
  for (int i = 0; i < 3; ++i) {
    for (int j = i + 1; j < 3; ++j) check_no_overlap(*outputs[i].first, outputs[i].second, *outputs[j].first, outputs[j].second);
    for (const auto& [input, name] : {std::pair{&a.q, "q"}, {&a.kv, "kv"}, {&a.indices, "indices"}}) {
      check_no_overlap(*outputs[i].first, outputs[i].second, *input, name);
    }
    for (const auto& [input, name] : {std::pair{&a.q_scale, "q_scale"}, {&a.kv_scale, "kv_scale"},
                                      {&a.attn_sink, "attn_sink"}, {&a.topk_length, "topk_length"}}) {
      if (*input) check_no_overlap(*outputs[i].first, outputs[i].second, **input, name);
    }
  }

  SparseMlaParams p{};
  p.dtype = dtype;
  p.q = a.q.data;
  p.kv = a.kv.data;
  p.indices = static_cast<const int32_t*>(a.indices.data);
  p.out = static_cast<uint16_t*>(a.out.data);
  p.max_logits = static_cast<float*>(a.max_logits.data);
  p.lse = static_cast<float*>(a.lse.data);
  for (int d = 0; d < 3; ++d) p.q_stride[d] = a.q.strides[d];
  p.kv_stride[0] = a.kv.strides[0], p.kv_stride[1] = a.kv.strides[2];
  p.indices_stride[0] = a.indices.strides[0], p.indices_stride[1] = a.indices.strides[2];
  if (a.topk_length) {
    p.topk_length = static_cast<const int32_t*>(a.topk_length->data);
    p.topk_length_stride = a.topk_length->strides[0];
  }
  if (a.attn_sink) {
    p.attn_sink = static_cast<const float*>(a.attn_sink->data);
    p.attn_sink_stride = a.attn_sink->strides[0];
  }
  p.s_q = s_q, p.s_kv = s_kv, p.h_q = h_q, p.d_qk = d_qk, p.d_v = a.d_v, p.topk = topk;
  p.q_scale = q_scale, p.kv_scale = kv_scale;
  p.logit_scale = sm_scale * q_scale * kv_scale;
  if (s_q == 0) return;
  detail::kernels().sparse_mla_fwd(p);
}

void sparse_mla_q8kv8_prefill_fwd(const SparseMlaArgs& a) {
  // SGLang's checks, in its order and with its key messages.
  if (a.q.dtype != DType::float8_e4m3fn) fail("q must be float8_e4m3fn, got ", dtype_name(a.q.dtype));
  if (a.kv.dtype != DType::float8_e4m3fn) fail("kv must be float8_e4m3fn, got ", dtype_name(a.kv.dtype));
  detail::check_rank(a.q, "q", 3, "[s_q, h_q, d_qk]");
  detail::check_rank(a.kv, "kv", 3, "[s_kv, h_kv, d_qk]");
  detail::check_rank(a.indices, "indices", 3, "[s_q, h_kv, topk]");
  if (!a.q.is_contiguous()) fail("q must be contiguous");
  if (!a.kv.is_contiguous()) fail("kv must be contiguous");
  if (!a.indices.is_contiguous()) fail("indices must be contiguous");
  const int64_t s_q = a.q.shape[0], h_q = a.q.shape[1], d_qk = a.q.shape[2], h_kv = a.kv.shape[1];
  if (a.kv.shape[2] != d_qk) fail("kv d_qk must match q d_qk=", d_qk, ", got ", a.kv.shape[2]);
  if (h_q <= 0 || h_q % 64 != 0) fail(kStrictOp, " requires h_q padded to a positive multiple of 64, got ", h_q);
  if (h_kv != 1) fail(kStrictOp, " requires h_kv=1, got ", h_kv);
  if (d_qk != 512 && d_qk != 576) fail(kStrictOp, " supports d_qk=512/576, got ", d_qk);
  if (a.indices.shape[0] != s_q || a.indices.shape[1] != h_kv) {
    fail("indices must have shape (", s_q, ", ", h_kv, ", topk), got ", a.indices.shape_str());
  }
  if (a.indices.dtype != DType::int32) fail("indices must be int32, got ", dtype_name(a.indices.dtype));
  const int64_t topk = a.indices.shape[2];
  if (topk <= 0 || topk % 128 != 0) fail(kStrictOp, " requires topk to be a positive multiple of 128, got ", topk);
  if (a.d_v != 512) fail(kStrictOp, " requires d_v=512, got ", a.d_v);
  if (!a.q_scale) fail(kStrictOp, " requires q_scale (a float32 tensor with one element)");
  if (!a.kv_scale) fail(kStrictOp, " requires kv_scale (a float32 tensor with one element)");
  if (a.attn_sink && !a.topk_length) fail(kStrictOp, " requires topk_length when attn_sink is given");
  if (a.topk_length) {
    const TensorView& t = *a.topk_length;
    detail::check_view(t, "topk_length");
    if (t.rank != 1 || t.shape[0] != s_q || t.dtype != DType::int32) {
      fail("topk_length must be int32 of shape [", s_q, "] (s_q), got ", dtype_name(t.dtype), " of shape ",
           t.shape_str());
    }
    const auto* len = static_cast<const int32_t*>(t.data);
    for (int64_t s = 0; s < s_q; ++s) {
      const int32_t n = len[s * t.strides[0]];
      if (n < 0 || n > topk) fail("topk_length values must be in [0, topk=", topk, "], got ", n, " at row ", s);
    }
  }
  sparse_mla_prefill_fwd(a);
}

}  // namespace attnkit
