// The serving contracts (include/attnkit/serving.h): varlen and paged attention and the KV
// cache writer. Each checks every argument in one fixed order (ranks, dtypes, sizes, head
// counts, scales, the index arrays' values, outputs and aliasing), then fills the dense
// kernel's AttentionParams with a ragged batch: the same tile loop runs every sequence.
// The index arrays are read here once and copied (the kernel reads the copies), so a block
// table entry past a sequence's length is never read. varlen's backward takes the forward's
// checks, then its gradients', and runs the dense backward kernel on each sequence's rows.
#include "attnkit/serving.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/error.h"
#include "core/dispatch.h"
#include "core/kv_cache.h"
#include "ops/attention_backward_params.h"
#include "ops/attention_params.h"
#include "ops/checks.h"
#include "ops/score_mods.h"

namespace attnkit {
namespace {

using detail::check_no_overlap;
using detail::fail;
using detail::is_attention_dtype;
using detail::kMaxHeadDim;

bool is_float8(DType t) { return t == DType::float8_e4m3fn || t == DType::float8_e5m2; }

int32_t int32_at(const TensorView& t, int64_t i) { return static_cast<const int32_t*>(t.data)[i * t.strides[0]]; }

void check_int32(const TensorView& t, const char* name) {
  if (t.dtype != DType::int32) fail(name, " must be int32, got ", dtype_name(t.dtype));
}

// cu_seqlens: int32 [B + 1] = 0, ..., total, non-decreasing; returned as a vector.
std::vector<int32_t> read_cu_seqlens(const TensorView& cu, const char* name, int64_t batch, int64_t total,
                                     const char* total_desc) {
  if (cu.shape[0] != batch + 1) {
    fail(name, " must have B + 1 = ", batch + 1, " elements, got ", cu.shape[0]);
  }
  std::vector<int32_t> values(batch + 1);
  for (int64_t i = 0; i <= batch; ++i) values[i] = int32_at(cu, i);
  if (values[0] != 0) fail(name, "[0] must be 0, got ", values[0]);
  for (int64_t i = 1; i <= batch; ++i) {
    if (values[i] < values[i - 1]) {
      fail(name, " must be non-decreasing, got ", name, "[", i, "]=", values[i], " < ", name, "[", i - 1,
           "]=", values[i - 1]);
    }
  }
  if (values[batch] != total) fail(name, "[B] must equal ", total_desc, "=", total, ", got ", values[batch]);
  return values;
}

int64_t longest(const std::vector<int32_t>& cu) {
  int64_t most = 0;
  for (size_t i = 1; i < cu.size(); ++i) most = std::max<int64_t>(most, cu[i] - cu[i - 1]);
  return most;
}

void check_heads(int64_t hq, int64_t hkv) {
  if (hkv < 1 || hq % hkv != 0) {
    fail("GQA/MQA requires query heads to be a multiple of KV heads, got q_heads=", hq, " and kv_heads=", hkv);
  }
}

double checked_scale(const std::optional<double>& scale, int64_t d) {
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d));
  detail::check_float32_scale(s, "scale");
  return s;
}

// A dequantisation scale: float32, one value ([] or [1]) or one per kv head ([Hkv]), each
// finite and positive. Returns the stride between kv heads (0 for one value).
int64_t check_kv_scale(const TensorView& t, const char* name, int64_t hkv) {
  detail::check_view(t, name);
  if (t.dtype != DType::float32) fail(name, " must be float32, got ", dtype_name(t.dtype));
  const bool one = t.rank == 0 || (t.rank == 1 && t.shape[0] == 1);
  if (!one && !(t.rank == 1 && t.shape[0] == hkv)) {
    fail(name, " must have shape [] or [1] (per tensor) or [Hkv] = [", hkv, "] (per kv head), got ", t.shape_str());
  }
  const int64_t stride = one ? 0 : t.strides[0];
  for (int64_t h = 0; h < (one ? 1 : hkv); ++h) {
    const float x = static_cast<const float*>(t.data)[h * stride];
    if (!(std::isfinite(x) && x > 0.0f)) fail(name, " must be finite and positive, got ", x, " (kv head ", h, ")");
  }
  return stride;
}

void check_lse(const TensorView& l, int64_t total_q, int64_t hq) {
  if (l.rank != 2 || l.shape[0] != total_q || l.shape[1] != hq) {
    fail("lse must have shape [", total_q, ", ", hq, "] ([total_q, Hq]), got ", l.shape_str());
  }
  if (l.dtype != DType::float32) fail("lse must be float32, got ", dtype_name(l.dtype));
  detail::check_writable_layout(l, "lse");
}

// out and lse must not overlap any input or each other.
void check_outputs_alias(const TensorView& out, const std::optional<TensorView>& lse,
                         std::initializer_list<std::pair<const TensorView*, const char*>> inputs) {
  for (const auto& [input, name] : inputs) {
    check_no_overlap(out, "out", *input, name);
    if (lse) check_no_overlap(*lse, "lse", *input, name);
  }
  if (lse) check_no_overlap(out, "out", *lse, "lse");
}

// [rows, H, D] viewed as the kernel's BHSD strides: batch 0, head, row, element.
void packed_strides(const TensorView& t, int64_t* stride) {
  stride[0] = 0, stride[1] = t.strides[1], stride[2] = t.strides[0], stride[3] = t.strides[2];
}

void run(const AttentionParams& p, int64_t total_q) {
  if (p.B == 0 || p.Hq == 0 || total_q == 0) return;  // nothing to write
  detail::kernels().attention_fwd(p);
}

// varlen_attention's checks, in their order, and its ragged params; cu_q and cu_k receive
// the copied offsets the params point into.
AttentionParams varlen_params(const VarlenAttentionArgs& a, std::vector<int32_t>& cu_q, std::vector<int32_t>& cu_k) {
  // 1. Ranks.
  detail::check_rank(a.q, "q", 3, "[total_q, Hq, D]");
  detail::check_rank(a.k, "k", 3, "[total_k, Hkv, D]");
  detail::check_rank(a.v, "v", 3, "[total_k, Hkv, Dv]");
  detail::check_rank(a.cu_seqlens_q, "cu_seqlens_q", 1, "[B + 1]");
  detail::check_rank(a.cu_seqlens_k, "cu_seqlens_k", 1, "[B + 1]");
  detail::check_rank(a.out, "out", 3, "[total_q, Hq, Dv]");
  for (const auto* t : {&a.q, &a.k, &a.v, &a.out}) detail::check_sizes_nonnegative(*t, "q, k, v and out");

  // 2. Dtypes.
  if (!is_attention_dtype(a.q.dtype)) fail("q must be float32, float16 or bfloat16, got ", dtype_name(a.q.dtype));
  if (a.k.dtype != a.q.dtype) fail("k must have q's dtype ", dtype_name(a.q.dtype), ", got ", dtype_name(a.k.dtype));
  if (a.v.dtype != a.q.dtype) fail("v must have q's dtype ", dtype_name(a.q.dtype), ", got ", dtype_name(a.v.dtype));
  if (a.out.dtype != a.q.dtype) fail("out must have q's dtype ", dtype_name(a.q.dtype), ", got ", dtype_name(a.out.dtype));
  check_int32(a.cu_seqlens_q, "cu_seqlens_q");
  check_int32(a.cu_seqlens_k, "cu_seqlens_k");

  // 3. Sizes.
  const int64_t total_q = a.q.shape[0], hq = a.q.shape[1], d = a.q.shape[2];
  const int64_t total_k = a.k.shape[0], hkv = a.k.shape[1], dv = a.v.shape[2];
  if (d < 1 || d > kMaxHeadDim) fail("q head dim D must be in [1, 512], got ", d);
  if (a.k.shape[2] != d) fail("k head dim must equal q's D=", d, ", got ", a.k.shape[2]);
  if (dv < 1 || dv > kMaxHeadDim) fail("v head dim Dv must be in [1, 512], got ", dv);
  if (a.v.shape[0] != total_k || a.v.shape[1] != hkv) {
    fail("v must have shape [", total_k, ", ", hkv, ", Dv] (total_k, Hkv from k), got ", a.v.shape_str());
  }
  if (a.cu_seqlens_q.shape[0] < 1) fail("cu_seqlens_q must have B + 1 >= 1 elements, got 0");
  const int64_t batch = a.cu_seqlens_q.shape[0] - 1;
  if (a.out.shape[0] != total_q || a.out.shape[1] != hq || a.out.shape[2] != dv) {
    fail("out must have shape [", total_q, ", ", hq, ", ", dv, "] ([total_q, Hq, Dv]), got ", a.out.shape_str());
  }

  // 4. Heads.
  check_heads(hq, hkv);

  // 5. Scalars.
  const double scale = checked_scale(a.scale, d);

  // 6. The sequences.
  cu_q = read_cu_seqlens(a.cu_seqlens_q, "cu_seqlens_q", batch, total_q, "total_q");
  cu_k = read_cu_seqlens(a.cu_seqlens_k, "cu_seqlens_k", batch, total_k, "total_k");
  const int64_t max_q = longest(cu_q), max_k = longest(cu_k);
  if (a.max_seqlen_q && *a.max_seqlen_q < max_q) {
    fail("max_seqlen_q must be at least the longest query sequence (", max_q, "), got ", *a.max_seqlen_q);
  }
  if (a.max_seqlen_k && *a.max_seqlen_k < max_k) {
    fail("max_seqlen_k must be at least the longest key sequence (", max_k, "), got ", *a.max_seqlen_k);
  }

  // 7. Outputs.
  detail::check_writable_layout(a.out, "out");
  if (a.lse) check_lse(*a.lse, total_q, hq);
  check_outputs_alias(a.out, a.lse,
                      {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.cu_seqlens_q, "cu_seqlens_q"},
                       {&a.cu_seqlens_k, "cu_seqlens_k"}});

  AttentionParams p{};
  p.dtype = p.kv_dtype = a.q.dtype;
  p.l2_read_ahead = detail::l2_read_ahead();
  p.q = a.q.data, p.k = a.k.data, p.v = a.v.data, p.out = a.out.data;
  packed_strides(a.q, p.q_stride);
  packed_strides(a.k, p.k_stride);
  packed_strides(a.v, p.v_stride);
  packed_strides(a.out, p.out_stride);
  if (total_k == 0) {  // no keys: k and v are never read and may be null (zero strides: no offsets from null)
    for (int d4 = 0; d4 < 4; ++d4) p.k_stride[d4] = p.v_stride[d4] = 0;
  }
  if (a.lse) {
    p.lse = static_cast<float*>(a.lse->data);
    p.lse_stride[0] = 0, p.lse_stride[1] = a.lse->strides[1], p.lse_stride[2] = a.lse->strides[0];
  }
  p.B = batch, p.Hq = hq, p.Hkv = hkv, p.Sq = max_q, p.Skv = max_k, p.D = d, p.Dv = dv;
  p.group = hq / hkv;
  p.causal = a.causal;
  p.scale = static_cast<float>(scale);
  p.q_begin = cu_q.data();
  p.kv_begin = cu_k.data();
  detail::check_score_mods({a.window_left, a.window_right, a.softcap, a.alibi_slopes, a.sinks}, batch, hq,
                           max_q + max_k, a.out, a.lse, p);
  return p;
}

// Row `row` of a packed tensor whose rows are `row_stride` elements of `elem` bytes apart.
const void* row_at(const void* base, int64_t row, int64_t row_stride, int64_t elem) {
  return static_cast<const char*>(base) + row * row_stride * elem;
}
void* row_at(void* base, int64_t row, int64_t row_stride, int64_t elem) {
  return static_cast<char*>(base) + row * row_stride * elem;
}

// Sequence b of a ragged backward as a dense one of batch 1: its rows of every tensor, its
// lengths and bottom-right alignment, its ALiBi slopes; empty sides with zero strides (their
// data is never read, and may be null, as attention_backward does).
AttentionBackwardParams sequence_view(const AttentionBackwardParams& ragged, const std::vector<int32_t>& cu_q,
                                      const std::vector<int32_t>& cu_k, int64_t b) {
  AttentionBackwardParams s = ragged;
  AttentionParams& f = s.fwd;
  const int64_t q0 = cu_q[b], k0 = cu_k[b], elem = static_cast<int64_t>(dtype_size(f.dtype));
  f.B = 1, f.Sq = cu_q[b + 1] - q0, f.Skv = cu_k[b + 1] - k0;
  f.causal_offset = f.Skv - f.Sq;
  f.q_begin = f.kv_begin = nullptr;
  f.q = row_at(f.q, q0, f.q_stride[2], elem), f.out = row_at(f.out, q0, f.out_stride[2], elem);
  f.k = row_at(f.k, k0, f.k_stride[2], elem), f.v = row_at(f.v, k0, f.v_stride[2], elem);
  f.lse += q0 * f.lse_stride[2];
  s.dout = row_at(s.dout, q0, s.dout_stride[2], elem), s.dq = row_at(s.dq, q0, s.dq_stride[2], elem);
  s.dk = row_at(s.dk, k0, s.dk_stride[2], elem), s.dv = row_at(s.dv, k0, s.dv_stride[2], elem);
  if (s.dlse) s.dlse += q0 * s.dlse_stride[2];
  if (f.alibi_slopes) f.alibi_slopes += b * f.alibi_stride[0], f.alibi_stride[0] = 0;
  if (f.Sq == 0) {
    for (int64_t* st : {f.q_stride, f.out_stride, s.dout_stride, s.dq_stride}) std::fill(st, st + 4, 0);
    std::fill(f.lse_stride, f.lse_stride + 3, 0);
    std::fill(s.dlse_stride, s.dlse_stride + 3, 0);
  }
  if (f.Skv == 0) {
    for (int64_t* st : {f.k_stride, f.v_stride, s.dk_stride, s.dv_stride}) std::fill(st, st + 4, 0);
  }
  return s;
}

}  // namespace

void varlen_attention(const VarlenAttentionArgs& a) {
  std::vector<int32_t> cu_q, cu_k;
  run(varlen_params(a, cu_q, cu_k), a.q.shape[0]);
}

void varlen_attention_backward(const VarlenAttentionBackwardArgs& a) {
  VarlenAttentionArgs fa;
  fa.q = a.q, fa.k = a.k, fa.v = a.v, fa.cu_seqlens_q = a.cu_seqlens_q, fa.cu_seqlens_k = a.cu_seqlens_k;
  fa.out = a.out, fa.lse = a.lse, fa.max_seqlen_q = a.max_seqlen_q, fa.max_seqlen_k = a.max_seqlen_k;
  fa.causal = a.causal, fa.scale = a.scale;
  fa.window_left = a.window_left, fa.window_right = a.window_right, fa.softcap = a.softcap;
  fa.alibi_slopes = a.alibi_slopes, fa.sinks = a.sinks;
  std::vector<int32_t> cu_q, cu_k;
  AttentionBackwardParams p{};
  p.fwd = varlen_params(fa, cu_q, cu_k);  // every forward check, in the forward's words
  const int64_t hq = p.fwd.Hq, total_q = a.q.shape[0];

  detail::check_like(a.dout, "dout", a.out, "out");
  detail::check_like(a.dq, "dq", a.q, "q");
  detail::check_like(a.dk, "dk", a.k, "k");
  detail::check_like(a.dv, "dv", a.v, "v");
  if (a.dlse) {
    const TensorView& l = *a.dlse;
    if (l.rank != 2 || l.shape[0] != total_q || l.shape[1] != hq) {
      fail("dlse must have lse's shape [", total_q, ", ", hq, "] ([total_q, Hq]), got ", l.shape_str());
    }
    if (l.dtype != DType::float32) fail("dlse must be float32, got ", dtype_name(l.dtype));
  }
  detail::check_dsinks(a.sinks, a.dsinks, hq);
  detail::NamedViews grads = {{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}};
  if (a.dsinks) grads.push_back({&*a.dsinks, "dsinks"});
  detail::NamedViews inputs = {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.cu_seqlens_q, "cu_seqlens_q"},
                               {&a.cu_seqlens_k, "cu_seqlens_k"}, {&a.out, "out"}, {&a.lse, "lse"}, {&a.dout, "dout"}};
  if (a.dlse) inputs.push_back({&*a.dlse, "dlse"});
  if (a.alibi_slopes) inputs.push_back({&*a.alibi_slopes, "alibi_slopes"});
  if (a.sinks) inputs.push_back({&*a.sinks, "sinks"});
  detail::check_gradients(grads, inputs);

  p.dout = a.dout.data, p.dq = a.dq.data, p.dk = a.dk.data, p.dv = a.dv.data;
  packed_strides(a.dout, p.dout_stride);
  packed_strides(a.dq, p.dq_stride);
  packed_strides(a.dk, p.dk_stride);
  packed_strides(a.dv, p.dv_stride);
  if (a.dlse) {
    p.dlse = static_cast<const float*>(a.dlse->data);
    p.dlse_stride[0] = 0, p.dlse_stride[1] = a.dlse->strides[1], p.dlse_stride[2] = a.dlse->strides[0];
  }
  // Every non-empty sequence a problem of its own; each sequence's sink gradient into its own
  // row, then summed over the sequences in order.
  const int64_t batch = static_cast<int64_t>(cu_q.size()) - 1;
  std::vector<AttentionBackwardParams> sequences;
  std::vector<float> seq_dsinks(a.dsinks ? batch * hq : 0);
  for (int64_t b = 0; b < batch; ++b) {
    AttentionBackwardParams s = sequence_view(p, cu_q, cu_k, b);
    if (s.fwd.Sq == 0 && s.fwd.Skv == 0) continue;
    if (a.dsinks) s.dsinks = seq_dsinks.data() + b * hq, s.dsinks_stride = 1;
    sequences.push_back(s);
  }
  detail::kernels().attention_bwd(sequences);
  for (int64_t h = 0; a.dsinks && h < hq; ++h) {
    double sum = 0.0;
    for (int64_t b = 0; b < batch; ++b) sum += seq_dsinks[b * hq + h];
    static_cast<float*>(a.dsinks->data)[h * a.dsinks->strides[0]] = static_cast<float>(sum);
  }
}

void paged_attention(const PagedAttentionArgs& a) {
  // 1. Ranks.
  detail::check_rank(a.q, "q", 3, "[total_q, Hq, D]");
  detail::check_rank(a.k_cache, "k_cache", 4, "[num_blocks, block_size, Hkv, D]");
  detail::check_rank(a.v_cache, "v_cache", 4, "[num_blocks, block_size, Hkv, Dv]");
  detail::check_rank(a.block_table, "block_table", 2, "[B, max_blocks]");
  detail::check_rank(a.seq_lens, "seq_lens", 1, "[B]");
  detail::check_rank(a.cu_seqlens_q, "cu_seqlens_q", 1, "[B + 1]");
  detail::check_rank(a.out, "out", 3, "[total_q, Hq, Dv]");
  for (const auto* t : {&a.q, &a.k_cache, &a.v_cache, &a.block_table, &a.out}) {
    detail::check_sizes_nonnegative(*t, "q, k_cache, v_cache, block_table and out");
  }

  // 2. Dtypes.
  const DType dt = a.q.dtype, cache = a.k_cache.dtype;
  if (!is_attention_dtype(dt)) fail("q must be float32, float16 or bfloat16, got ", dtype_name(dt));
  if (cache != dt && !is_float8(cache)) {
    fail("k_cache must have q's dtype ", dtype_name(dt), " or be float8_e4m3fn or float8_e5m2, got ", dtype_name(cache));
  }
  if (a.v_cache.dtype != cache) {
    fail("v_cache must have k_cache's dtype ", dtype_name(cache), ", got ", dtype_name(a.v_cache.dtype));
  }
  check_int32(a.block_table, "block_table");
  check_int32(a.seq_lens, "seq_lens");
  check_int32(a.cu_seqlens_q, "cu_seqlens_q");
  if (a.out.dtype != dt) fail("out must have q's dtype ", dtype_name(dt), ", got ", dtype_name(a.out.dtype));

  // 3. Sizes.
  const int64_t total_q = a.q.shape[0], hq = a.q.shape[1], d = a.q.shape[2];
  const int64_t num_blocks = a.k_cache.shape[0], block_size = a.k_cache.shape[1], hkv = a.k_cache.shape[2];
  const int64_t dv = a.v_cache.shape[3];
  if (d < 1 || d > kMaxHeadDim) fail("q head dim D must be in [1, 512], got ", d);
  if (a.k_cache.shape[3] != d) fail("k_cache head dim must equal q's D=", d, ", got ", a.k_cache.shape[3]);
  if (block_size < 1) fail("block_size (k_cache dim 1) must be at least 1, got ", block_size);
  if (dv < 1 || dv > kMaxHeadDim) fail("v_cache head dim Dv must be in [1, 512], got ", dv);
  if (a.v_cache.shape[0] != num_blocks || a.v_cache.shape[1] != block_size || a.v_cache.shape[2] != hkv) {
    fail("v_cache must have shape [", num_blocks, ", ", block_size, ", ", hkv,
         ", Dv] (num_blocks, block_size, Hkv from k_cache), got ", a.v_cache.shape_str());
  }
  const int64_t batch = a.block_table.shape[0], max_blocks = a.block_table.shape[1];
  if (a.seq_lens.shape[0] != batch) fail("seq_lens must have B=", batch, " elements (block_table's rows), got ", a.seq_lens.shape[0]);
  if (a.out.shape[0] != total_q || a.out.shape[1] != hq || a.out.shape[2] != dv) {
    fail("out must have shape [", total_q, ", ", hq, ", ", dv, "] ([total_q, Hq, Dv]), got ", a.out.shape_str());
  }

  // 4. Heads.
  check_heads(hq, hkv);

  // 5. Scalars and scales.
  const double scale = checked_scale(a.scale, d);
  const int64_t k_scale_stride = a.k_scale ? check_kv_scale(*a.k_scale, "k_scale", hkv) : 0;
  const int64_t v_scale_stride = a.v_scale ? check_kv_scale(*a.v_scale, "v_scale", hkv) : 0;

  // 6. The sequences and the blocks they use (only those; -1 padding past them is fine).
  const std::vector<int32_t> cu_q = read_cu_seqlens(a.cu_seqlens_q, "cu_seqlens_q", batch, total_q, "total_q");
  std::vector<int32_t> lens(batch);
  int64_t used_most = 0, max_k = 0;
  int64_t capacity;  // keys the block table can hold (saturated: huge blocks of a stride-0 cache)
  if (__builtin_mul_overflow(max_blocks, block_size, &capacity)) capacity = INT64_MAX;
  for (int64_t b = 0; b < batch; ++b) {
    lens[b] = int32_at(a.seq_lens, b);
    const int64_t n_q = cu_q[b + 1] - cu_q[b];
    if (lens[b] < n_q) {
      fail("seq_lens[", b, "] must be at least the sequence's query count ", n_q,
           " (cu_seqlens_q[", b + 1, "] - cu_seqlens_q[", b, "]), got ", lens[b]);
    }
    if (lens[b] > capacity) {
      fail("seq_lens[", b, "] must be at most max_blocks * block_size = ", capacity, ", got ", lens[b]);
    }
    used_most = std::max<int64_t>(used_most, (lens[b] + block_size - 1) / block_size);
    max_k = std::max<int64_t>(max_k, lens[b]);
  }
  std::vector<int32_t> blocks(batch * used_most);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t id = static_cast<const int32_t*>(a.block_table.data)[b * a.block_table.strides[0] +
                                                                         i * a.block_table.strides[1]];
      if (id < 0 || id >= num_blocks) {
        fail("block_table[", b, ", ", i, "] must be a block in [0, num_blocks=", num_blocks, ") (sequence ", b,
             " uses its first ", used, " entries), got ", id);
      }
      blocks[b * used_most + i] = id;
    }
  }

  // 7. Outputs.
  detail::check_writable_layout(a.out, "out");
  if (a.lse) check_lse(*a.lse, total_q, hq);
  check_outputs_alias(a.out, a.lse,
                      {{&a.q, "q"}, {&a.k_cache, "k_cache"}, {&a.v_cache, "v_cache"}, {&a.block_table, "block_table"},
                       {&a.seq_lens, "seq_lens"}, {&a.cu_seqlens_q, "cu_seqlens_q"}});
  if (a.k_scale) check_outputs_alias(a.out, a.lse, {{&*a.k_scale, "k_scale"}});
  if (a.v_scale) check_outputs_alias(a.out, a.lse, {{&*a.v_scale, "v_scale"}});

  AttentionParams p{};
  p.dtype = dt;
  p.kv_dtype = cache;
  p.l2_read_ahead = detail::l2_read_ahead();
  p.q = a.q.data, p.k = a.k_cache.data, p.v = a.v_cache.data, p.out = a.out.data;
  packed_strides(a.q, p.q_stride);
  packed_strides(a.out, p.out_stride);
  // Caches: block, kv head, token within the block, element.
  for (auto [view, stride] : {std::pair{&a.k_cache, p.k_stride}, {&a.v_cache, p.v_stride}}) {
    stride[0] = view->strides[0], stride[1] = view->strides[2], stride[2] = view->strides[1], stride[3] = view->strides[3];
  }
  if (a.lse) {
    p.lse = static_cast<float*>(a.lse->data);
    p.lse_stride[0] = 0, p.lse_stride[1] = a.lse->strides[1], p.lse_stride[2] = a.lse->strides[0];
  }
  p.B = batch, p.Hq = hq, p.Hkv = hkv, p.Sq = longest(cu_q), p.Skv = max_k, p.D = d, p.Dv = dv;
  p.group = hq / hkv;
  p.causal = a.causal;
  p.scale = static_cast<float>(scale);
  p.q_begin = cu_q.data();
  p.kv_len = lens.data();
  p.block_table = blocks.data();
  p.block_table_stride = used_most;
  p.block_size = block_size;
  if (a.k_scale) p.k_scale = static_cast<const float*>(a.k_scale->data), p.k_scale_stride = k_scale_stride;
  if (a.v_scale) p.v_scale = static_cast<const float*>(a.v_scale->data), p.v_scale_stride = v_scale_stride;
  detail::check_score_mods({a.window_left, a.window_right, a.softcap, a.alibi_slopes, a.sinks}, batch, hq,
                           p.Sq + max_k, a.out, a.lse, p);
  run(p, total_q);
}

void append_kv_cache(const AppendKvCacheArgs& a) {
  // 1. Ranks.
  detail::check_rank(a.k, "k", 3, "[T, Hkv, D]");
  detail::check_rank(a.v, "v", 3, "[T, Hkv, Dv]");
  detail::check_rank(a.k_cache, "k_cache", 4, "[num_blocks, block_size, Hkv, D]");
  detail::check_rank(a.v_cache, "v_cache", 4, "[num_blocks, block_size, Hkv, Dv]");
  detail::check_rank(a.slot_mapping, "slot_mapping", 1, "[T]");
  for (const auto* t : {&a.k, &a.v, &a.k_cache, &a.v_cache}) detail::check_sizes_nonnegative(*t, "k, v and the caches");

  // 2. Dtypes.
  if (!is_attention_dtype(a.k.dtype)) fail("k must be float32, float16 or bfloat16, got ", dtype_name(a.k.dtype));
  if (a.v.dtype != a.k.dtype) fail("v must have k's dtype ", dtype_name(a.k.dtype), ", got ", dtype_name(a.v.dtype));
  const DType cache = a.k_cache.dtype;
  if (!is_attention_dtype(cache) && !is_float8(cache)) {
    fail("k_cache must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got ", dtype_name(cache));
  }
  if (a.v_cache.dtype != cache) {
    fail("v_cache must have k_cache's dtype ", dtype_name(cache), ", got ", dtype_name(a.v_cache.dtype));
  }
  if (a.slot_mapping.dtype != DType::int32 && a.slot_mapping.dtype != DType::int64) {
    fail("slot_mapping must be int32 or int64, got ", dtype_name(a.slot_mapping.dtype));
  }

  // 3. Sizes.
  const int64_t tokens = a.k.shape[0], hkv = a.k.shape[1], d = a.k.shape[2], dv = a.v.shape[2];
  const int64_t num_blocks = a.k_cache.shape[0], block_size = a.k_cache.shape[1];
  if (a.v.shape[0] != tokens || a.v.shape[1] != hkv) {
    fail("v must have shape [", tokens, ", ", hkv, ", Dv] (T, Hkv from k), got ", a.v.shape_str());
  }
  if (a.k_cache.shape[2] != hkv || a.k_cache.shape[3] != d) {
    fail("k_cache must have shape [num_blocks, block_size, ", hkv, ", ", d, "] (Hkv, D from k), got ",
         a.k_cache.shape_str());
  }
  if (a.v_cache.shape[0] != num_blocks || a.v_cache.shape[1] != block_size || a.v_cache.shape[2] != hkv ||
      a.v_cache.shape[3] != dv) {
    fail("v_cache must have shape [", num_blocks, ", ", block_size, ", ", hkv, ", ", dv,
         "] (num_blocks, block_size from k_cache; Hkv, Dv from v), got ", a.v_cache.shape_str());
  }
  if (a.slot_mapping.shape[0] != tokens) {
    fail("slot_mapping must have T=", tokens, " elements (k's tokens), got ", a.slot_mapping.shape[0]);
  }

  // 4. Scales.
  const int64_t k_scale_stride = a.k_scale ? check_kv_scale(*a.k_scale, "k_scale", hkv) : 0;
  const int64_t v_scale_stride = a.v_scale ? check_kv_scale(*a.v_scale, "v_scale", hkv) : 0;

  // 5. Slots.
  const int64_t slots = num_blocks * block_size;
  std::vector<int64_t> slot(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t off = t * a.slot_mapping.strides[0];
    slot[t] = a.slot_mapping.dtype == DType::int32 ? static_cast<const int32_t*>(a.slot_mapping.data)[off]
                                                   : static_cast<const int64_t*>(a.slot_mapping.data)[off];
    if (slot[t] != -1 && (slot[t] < 0 || slot[t] >= slots)) {
      fail("slot_mapping[", t, "] must be -1 (skip) or a slot in [0, num_blocks * block_size=", slots, "), got ",
           slot[t]);
    }
  }

  // 6. The caches are written: no self-overlap, no aliasing with the inputs or each other.
  detail::check_writable_layout(a.k_cache, "k_cache");
  detail::check_writable_layout(a.v_cache, "v_cache");
  for (const auto& [cache_view, name] : {std::pair{&a.k_cache, "k_cache"}, {&a.v_cache, "v_cache"}}) {
    check_no_overlap(*cache_view, name, a.k, "k");
    check_no_overlap(*cache_view, name, a.v, "v");
    check_no_overlap(*cache_view, name, a.slot_mapping, "slot_mapping");
    if (a.k_scale) check_no_overlap(*cache_view, name, *a.k_scale, "k_scale");
    if (a.v_scale) check_no_overlap(*cache_view, name, *a.v_scale, "v_scale");
  }
  check_no_overlap(a.k_cache, "k_cache", a.v_cache, "v_cache");

  auto write = [&](const TensorView& src, const TensorView& dst, const std::optional<TensorView>& scale,
                   int64_t scale_stride) {
    detail::KvWrite w;
    w.src = src.data, w.src_dtype = src.dtype, w.dst = dst.data, w.dst_dtype = dst.dtype;
    for (int i = 0; i < 3; ++i) w.src_stride[i] = src.strides[i];
    for (int i = 0; i < 4; ++i) w.dst_stride[i] = dst.strides[i];
    w.tokens = tokens, w.heads = hkv, w.dim = src.shape[2], w.block_size = block_size;
    w.slot = slot.data();
    w.scale = scale ? static_cast<const float*>(scale->data) : nullptr;
    w.scale_stride = scale_stride;
    detail::write_kv(w);
  };
  write(a.k, a.k_cache, a.k_scale, k_scale_stride);
  write(a.v, a.v_cache, a.v_scale, v_scale_stride);
}

}  // namespace attnkit
