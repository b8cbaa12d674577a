// The DSA op contracts (FlashMLA's flash_mla_with_kvcache and its V3.2 quantiser, DeepGEMM's
// indexer logits, top-k and its transforms): every
// check in a fixed order, then a plain parameter block for the kernels (src/cpu/dsa_*.cpp).
#include "attnkit/dsa.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <vector>

#include "attnkit/error.h"
#include "core/dispatch.h"
#include "ops/checks.h"
#include "ops/dsa_params.h"

namespace attnkit {
namespace {

using detail::check_no_overlap;
using detail::check_output;
using detail::fail;

void check_int32_vector(const TensorView& t, const char* name, int64_t n, const char* what) {
  detail::check_view(t, name);
  if (t.rank != 1 || t.shape[0] != n || t.dtype != DType::int32) {
    fail(name, " must be int32 of shape [", n, "] (", what, "), got ", dtype_name(t.dtype), " of shape ", t.shape_str());
  }
}

bool is_byte_dtype(DType d) { return d == DType::uint8 || d == DType::int8 || d == DType::float8_e4m3fn; }

}  // namespace

void flash_mla_with_kvcache(const MlaDecodeArgs& a) {
  // 1. q and the cache: ranks, dtypes, sizes.
  detail::check_rank(a.q, "q", 4, "[batch_size, seq_len_q, num_heads_q, head_dim]");
  detail::check_rank(a.k_cache, "k_cache", 4, "[num_blocks, page_block_size, num_heads_k, head_dim]");
  detail::check_sizes_nonnegative(a.q, "q");
  detail::check_sizes_nonnegative(a.k_cache, "k_cache");
  if (a.q.dtype != DType::bfloat16) fail("q must be bfloat16, got ", dtype_name(a.q.dtype));
  const int64_t b = a.q.shape[0], s_q = a.q.shape[1], h_q = a.q.shape[2], d_qk = a.q.shape[3];
  const int64_t num_blocks = a.k_cache.shape[0], page = a.k_cache.shape[1], h_kv = a.k_cache.shape[2];
  const bool sparse = a.indices.has_value();
  if (h_q < 1) fail("q must have at least one head, got num_heads_q=", h_q);
  if (s_q < 1) fail("q must have seq_len_q >= 1, got ", s_q);
  if (page < 1) fail("k_cache page_block_size must be positive, got ", page);
  if (h_kv != 1) {
    fail(sparse ? "Currently only MQA (i.e. h_kv == 1) is supported for sparse decoding"
                : "Only one kv head (MLA, h_kv == 1) is supported for dense decoding",
         ", got num_heads_k=", h_kv);
  }
  if (sparse && !a.is_fp8_kvcache) fail("is_fp8_kvcache must be True when sparse attention is enabled");
  if (sparse && a.causal) fail("causal must be False when sparse attention is enabled");
  if (a.is_fp8_kvcache) {
    if (!is_byte_dtype(a.k_cache.dtype)) {
      fail("key must have dtype fp8_e4m3fn, int8 or uint8 when is_fp8_kvcache is True, got ", dtype_name(a.k_cache.dtype));
    }
    if (d_qk != kV32Nope + kV32Rope) fail("Only head_size_k == 576 is supported for the V3.2 fp8 cache, got q head_dim ", d_qk);
    if (a.k_cache.shape[3] != kV32TokenBytes) {
      fail("k_cache must hold ", kV32TokenBytes, "-byte V3.2 tokens (512 fp8 + 4 fp32 scales + 64 bf16), got head_dim ",
           a.k_cache.shape[3]);
    }
    if (a.k_cache.strides[3] != 1 || (page > 1 && a.k_cache.strides[1] != kV32TokenBytes)) {
      fail("The whole block must be contiguous when is_fp8_cache is True for kv cache (token stride ", kV32TokenBytes,
           " bytes, byte stride 1), got strides ", a.k_cache.strides[1], ", ", a.k_cache.strides[3]);
    }
  } else {
    if (a.k_cache.dtype != DType::bfloat16) fail("k_cache must be bfloat16 (or is_fp8_kvcache=True), got ", dtype_name(a.k_cache.dtype));
    if (a.k_cache.shape[3] != d_qk) fail("k_cache head_dim must match q head_dim=", d_qk, ", got ", a.k_cache.shape[3]);
  }
  if (sparse && a.head_dim_v != kV32Nope) fail("Only head_size_v == 512 is supported for sparse decoding, got ", a.head_dim_v);
  if (a.head_dim_v < 1 || a.head_dim_v > d_qk) fail("head_dim_v must be in [1, head_dim=", d_qk, "], got ", a.head_dim_v);

  // 2. Scale and sink.
  const double scale = a.softmax_scale ? *a.softmax_scale : 1.0 / std::sqrt(static_cast<double>(d_qk));
  const float logit_scale = detail::check_float32_scale(scale, "softmax_scale");
  if (a.attn_sink) {
    const TensorView& s = *a.attn_sink;
    detail::check_view(s, "attn_sink");
    if (s.rank != 1 || s.shape[0] != h_q || s.dtype != DType::float32) {
      fail("attn_sink must be float32 of shape [", h_q, "] (num_heads_q), got ", dtype_name(s.dtype), " of shape ", s.shape_str());
    }
  }

  MlaDecodeParams p{};
  // 3. The rows: indices and topk_length (sparse), or block_table and cache_seqlens (dense).
  if (sparse) {
    const TensorView& idx = *a.indices;
    detail::check_view(idx, "indices");
    if (idx.rank != 3 || idx.shape[0] != b || idx.shape[1] != s_q || idx.shape[2] < 1 || idx.dtype != DType::int32) {
      fail("indices must be int32 of shape [", b, ", ", s_q, ", topk] (batch_size, seq_len_q, topk >= 1), got ",
           dtype_name(idx.dtype), " of shape ", idx.shape_str());
    }
    p.indices = static_cast<const int32_t*>(idx.data);
    for (int d = 0; d < 3; ++d) p.indices_stride[d] = idx.strides[d];
    p.topk = p.max_rows = idx.shape[2];
    if (a.topk_length) {
      check_int32_vector(*a.topk_length, "topk_length", b, "batch_size");
      p.topk_length = static_cast<const int32_t*>(a.topk_length->data);
      p.topk_length_stride = a.topk_length->strides[0];
    }
  } else {
    if (a.topk_length) fail("topk_length is only used with indices (sparse decoding)");
    if (!a.block_table || !a.cache_seqlens) fail("block_table and cache_seqlens are required without indices (dense decoding)");
    const TensorView& bt = *a.block_table;
    detail::check_view(bt, "block_table");
    if (bt.rank != 2 || bt.shape[0] != b || bt.dtype != DType::int32) {
      fail("block_table must be int32 of shape [", b, ", max_blocks] (batch_size), got ", dtype_name(bt.dtype), " of shape ",
           bt.shape_str());
    }
    check_int32_vector(*a.cache_seqlens, "cache_seqlens", b, "batch_size");
    const auto* table = static_cast<const int32_t*>(bt.data);
    const auto* lens = static_cast<const int32_t*>(a.cache_seqlens->data);
    const int64_t lens_stride = a.cache_seqlens->strides[0];
    for (int64_t i = 0; i < b; ++i) {
      const int64_t len = lens[i * lens_stride];
      if (len < 0 || len > bt.shape[1] * page) {
        fail("cache_seqlens[", i, "] must be in [0, max_blocks · page_block_size = ", bt.shape[1] * page, "], got ", len);
      }
      for (int64_t j = 0; j < (len + page - 1) / page; ++j) {
        const int32_t block = table[i * bt.strides[0] + j * bt.strides[1]];
        if (block < 0 || block >= num_blocks) {
          fail("block_table[", i, ", ", j, "] = ", block, " is out of range [0, num_blocks=", num_blocks, ")");
        }
      }
      if (len > p.max_rows) p.max_rows = len;
    }
    p.block_table = table;
    p.block_table_stride[0] = bt.strides[0], p.block_table_stride[1] = bt.strides[1];
    p.cache_seqlens = lens, p.cache_seqlens_stride = lens_stride;
    p.causal = a.causal;
  }

  // 4. Outputs.
  check_output(a.out, "out", DType::bfloat16, {b, s_q, h_q, a.head_dim_v});
  check_output(a.lse, "lse", DType::float32, {b, s_q, h_q});
  check_no_overlap(a.out, "out", a.lse, "lse");
  for (const TensorView* o : {&a.out, &a.lse}) {
    const char* name = o == &a.out ? "out" : "lse";
    check_no_overlap(*o, name, a.q, "q");
    check_no_overlap(*o, name, a.k_cache, "k_cache");
    for (const auto& [input, in_name] : {std::pair{&a.block_table, "block_table"}, {&a.cache_seqlens, "cache_seqlens"},
                                         {&a.indices, "indices"}, {&a.attn_sink, "attn_sink"}, {&a.topk_length, "topk_length"}}) {
      if (*input) check_no_overlap(*o, name, **input, in_name);
    }
  }

  SparseMlaParams& t = p.tile;
  t.dtype = DType::bfloat16;
  t.q = a.q.data;
  t.q_stride[1] = a.q.strides[2], t.q_stride[2] = a.q.strides[3];
  t.out = static_cast<uint16_t*>(a.out.data);
  t.lse = static_cast<float*>(a.lse.data);
  if (a.attn_sink) {
    t.attn_sink = static_cast<const float*>(a.attn_sink->data);
    t.attn_sink_stride = a.attn_sink->strides[0];
  }
  t.s_q = b * s_q, t.h_q = h_q, t.d_qk = d_qk, t.d_v = a.head_dim_v, t.topk = p.max_rows;
  t.q_scale = t.kv_scale = 1.0f;
  t.logit_scale = logit_scale;
  p.batch = b, p.s_q = s_q;
  p.q_batch_stride = a.q.strides[0], p.q_seq_stride = a.q.strides[1];
  p.v32_fp8 = a.is_fp8_kvcache;
  p.cache = a.k_cache.data;
  p.block_stride = a.k_cache.strides[0], p.token_stride = a.k_cache.strides[1], p.dim_stride = a.k_cache.strides[3];
  p.page_block_size = page, p.num_blocks = num_blocks;
  if (b == 0) return;
  detail::kernels().mla_decode_fwd(p);
}

void quantize_v32_kv(const TensorView& kv, const TensorView& dst) {
  detail::check_rank(kv, "kv", 2, "[num_tokens, 576]");
  detail::check_sizes_nonnegative(kv, "kv");
  if (kv.dtype != DType::bfloat16 && kv.dtype != DType::float32) fail("kv must be bfloat16 or float32, got ", dtype_name(kv.dtype));
  if (kv.shape[1] != kV32Nope + kV32Rope) fail("kv must have ", kV32Nope + kV32Rope, " columns (512 nope + 64 rope), got ", kv.shape[1]);
  check_output(dst, "dst", DType::uint8, {kv.shape[0], kV32TokenBytes});
  check_no_overlap(dst, "dst", kv, "kv");
  V32QuantizeParams p{kv.data, kv.dtype == DType::bfloat16, kv.shape[0], kv.strides[0], kv.strides[1],
                      static_cast<uint8_t*>(dst.data), kV32TokenBytes};
  detail::kernels().v32_quantize(p);
}

namespace {

// A float32 [rows, width] output with a unit last stride.
void check_logits(const TensorView& t, const char* name, int64_t rows, int64_t width) {
  if (t.rank != 2 || t.shape[0] != rows || t.shape[1] != width || t.dtype != DType::float32) {
    fail(name, " must be float32 of shape [", rows, ", ", width, "], got ", dtype_name(t.dtype), " of shape ", t.shape_str());
  }
  if (rows > 0 && width > 1 && t.strides[1] != 1) fail(name, " must have a contiguous last dim, got stride ", t.strides[1]);
  detail::check_writable_layout(t, name);
}

void check_head_dim(int64_t d) {
  if (d != 32 && d != 64 && d != 128) fail("q head dim D must be 32, 64 or 128, got ", d);
}

}  // namespace

void fp8_mqa_logits(const IndexerLogitsArgs& a) {
  detail::check_rank(a.q, "q", 3, "[seq_len, num_heads, head_dim]");
  detail::check_rank(a.kv, "kv", 2, "[seq_len_kv, head_dim]");
  detail::check_sizes_nonnegative(a.q, "q");
  detail::check_sizes_nonnegative(a.kv, "kv");
  if (a.q.dtype != DType::float8_e4m3fn) fail("q must be float8_e4m3fn, got ", dtype_name(a.q.dtype));
  if (a.kv.dtype != DType::float8_e4m3fn) fail("kv must be float8_e4m3fn, got ", dtype_name(a.kv.dtype));
  const int64_t T = a.q.shape[0], H = a.q.shape[1], D = a.q.shape[2], S = a.kv.shape[0];
  if (H < 1) fail("q must have at least one head, got num_heads=", H);
  check_head_dim(D);
  if (a.kv.shape[1] != D) fail("kv head dim must match q head dim=", D, ", got ", a.kv.shape[1]);
  detail::check_view(a.kv_scale, "kv_scale");
  detail::check_view(a.weights, "weights");
  if (a.kv_scale.rank != 1 || a.kv_scale.shape[0] != S || a.kv_scale.dtype != DType::float32) {
    fail("kv_scale must be float32 of shape [", S, "] (seq_len_kv), got ", dtype_name(a.kv_scale.dtype), " of shape ",
         a.kv_scale.shape_str());
  }
  if (a.weights.rank != 2 || a.weights.shape[0] != T || a.weights.shape[1] != H || a.weights.dtype != DType::float32) {
    fail("weights must be float32 of shape [", T, ", ", H, "] (seq_len, num_heads), got ", dtype_name(a.weights.dtype),
         " of shape ", a.weights.shape_str());
  }
  check_int32_vector(a.ks, "cu_seq_len_k_start", T, "seq_len");
  check_int32_vector(a.ke, "cu_seq_len_k_end", T, "seq_len");
  if (a.max_seqlen_k < 0) fail("max_seqlen_k must be >= 0, got ", a.max_seqlen_k);
  const bool compressed = a.max_seqlen_k > 0;
  if (compressed && a.clean_logits) fail("max_seqlen_k > 0 (compressed logits) requires clean_logits=False");
  if (a.logits.has_value() == a.topk_indices.has_value()) fail("exactly one of logits and topk_indices must be given");
  const int64_t width = compressed ? a.max_seqlen_k : S;

  IndexerParams p{};
  p.q = static_cast<const uint8_t*>(a.q.data);
  p.q_stride[0] = 0, p.q_stride[1] = a.q.strides[0], p.q_stride[2] = a.q.strides[1], p.q_stride[3] = a.q.strides[2];
  p.weights = static_cast<const float*>(a.weights.data);
  p.weights_stride[0] = a.weights.strides[0], p.weights_stride[1] = a.weights.strides[1];
  p.rows = T, p.rows_per_batch = T > 0 ? T : 1, p.h = H, p.d = D;
  p.lo = static_cast<const int32_t*>(a.ks.data), p.lo_stride = a.ks.strides[0];
  p.hi = static_cast<const int32_t*>(a.ke.data), p.hi_stride[0] = 0, p.hi_stride[1] = a.ke.strides[0];
  p.num_keys = S;
  p.k = static_cast<const uint8_t*>(a.kv.data), p.k_row_stride = a.kv.strides[0], p.k_col_stride = a.kv.strides[1];
  p.k_scale = static_cast<const float*>(a.kv_scale.data), p.k_scale_stride = a.kv_scale.strides[0];
  p.compressed = compressed, p.clean = a.clean_logits;
  const TensorView* out;
  if (a.logits) {
    check_logits(*a.logits, "logits", T, width);
    p.logits = static_cast<float*>(a.logits->data), p.logits_stride = a.logits->strides[0], p.width = width;
    out = &*a.logits;
  } else {
    const TensorView& o = *a.topk_indices;
    detail::check_view(o, "topk_indices");
    if (o.rank != 2 || o.shape[0] != T || o.shape[1] < 1 || o.dtype != DType::int32 || !o.is_contiguous()) {
      fail("topk_indices must be a contiguous int32 [", T, ", topk >= 1] tensor, got ", dtype_name(o.dtype), " of shape ",
           o.shape_str());
    }
    if (compressed) fail("max_seqlen_k applies to logits, not to the fused top-k");
    // Offsets count from ks[t] as given, so a negative start moves them up: they must fit int32.
    for (int64_t t = 0; t < T; ++t) {
      const int64_t ks = static_cast<const int32_t*>(a.ks.data)[t * a.ks.strides[0]];
      const int64_t ke = std::min<int64_t>(static_cast<const int32_t*>(a.ke.data)[t * a.ke.strides[0]], S);
      if (std::max<int64_t>(ks, 0) < ke && ke - 1 - ks > INT32_MAX) {
        fail("cu_seq_len_k_start[", t, "] = ", ks, ": the fused top-k's offsets from it (up to ", ke - 1 - ks,
             ") must fit int32");
      }
    }
    p.topk_out = static_cast<int32_t*>(o.data), p.topk_stride = o.strides[0], p.topk = o.shape[1];
    out = &o;
  }
  const char* out_name = a.logits ? "logits" : "topk_indices";
  for (const auto& [in, name] : {std::pair{&a.q, "q"}, {&a.kv, "kv"}, {&a.kv_scale, "kv_scale"}, {&a.weights, "weights"},
                                 {&a.ks, "cu_seq_len_k_start"}, {&a.ke, "cu_seq_len_k_end"}}) {
    check_no_overlap(*out, out_name, *in, name);
  }
  if (T == 0) return;
  detail::kernels().indexer_logits(p);
}

void fp8_paged_mqa_logits(const PagedIndexerLogitsArgs& a) {
  detail::check_rank(a.q, "q", 4, "[batch_size, next_n, num_heads, head_dim]");
  detail::check_rank(a.kv_cache, "kv_cache", 4, "[num_blocks, block_kv, 1, head_dim + 4]");
  detail::check_sizes_nonnegative(a.q, "q");
  detail::check_sizes_nonnegative(a.kv_cache, "kv_cache");
  if (a.q.dtype != DType::float8_e4m3fn) fail("q must be float8_e4m3fn, got ", dtype_name(a.q.dtype));
  if (!is_byte_dtype(a.kv_cache.dtype)) fail("kv_cache must be uint8 (or int8 / float8_e4m3fn bytes), got ", dtype_name(a.kv_cache.dtype));
  const int64_t B = a.q.shape[0], next_n = a.q.shape[1], H = a.q.shape[2], D = a.q.shape[3];
  const int64_t num_blocks = a.kv_cache.shape[0], page = a.kv_cache.shape[1];
  if (next_n < 1) fail("q must have next_n >= 1, got ", next_n);
  if (H < 1) fail("q must have at least one head, got num_heads=", H);
  check_head_dim(D);
  if (page < 1) fail("kv_cache block_kv must be positive, got ", page);
  if (a.kv_cache.shape[2] != 1 || a.kv_cache.shape[3] != D + 4) {
    fail("kv_cache must have shape [num_blocks, block_kv, 1, ", D + 4, "] (head_dim + 4 bytes per token), got ",
         a.kv_cache.shape_str());
  }
  if (a.kv_cache.strides[3] != 1 || (page > 1 && a.kv_cache.strides[1] != D + 4)) {
    fail("kv_cache pages must be contiguous (token stride ", D + 4, ", byte stride 1), got strides ", a.kv_cache.strides[1],
         ", ", a.kv_cache.strides[3]);
  }
  const int64_t rows = B * next_n;
  detail::check_view(a.weights, "weights");
  if (a.weights.rank != 2 || a.weights.shape[0] != rows || a.weights.shape[1] != H || a.weights.dtype != DType::float32) {
    fail("weights must be float32 of shape [", rows, ", ", H, "] (batch_size · next_n, num_heads), got ",
         dtype_name(a.weights.dtype), " of shape ", a.weights.shape_str());
  }
  const TensorView& cl = a.context_lens;
  detail::check_view(cl, "context_lens");
  const bool two_d = cl.rank == 2 && cl.shape[0] == B && cl.shape[1] == next_n;
  const bool one_d = cl.rank == 1 && cl.shape[0] == B && next_n == 1;
  if ((!two_d && !one_d) || cl.dtype != DType::int32) {
    fail("context_lens must be int32 of shape [", B, ", ", next_n, "] (batch_size, next_n), got ", dtype_name(cl.dtype),
         " of shape ", cl.shape_str());
  }
  const TensorView& bt = a.block_table;
  detail::check_view(bt, "block_table");
  if (bt.rank != 2 || bt.shape[0] != B || bt.dtype != DType::int32) {
    fail("block_table must be int32 of shape [", B, ", max_blocks], got ", dtype_name(bt.dtype), " of shape ", bt.shape_str());
  }
  if (a.max_context_len < 0) fail("max_context_len must be >= 0, got ", a.max_context_len);
  check_logits(a.logits, "logits", rows, a.max_context_len);
  for (const auto& [in, name] : {std::pair{&a.q, "q"}, {&a.kv_cache, "kv_cache"}, {&a.weights, "weights"},
                                 {&a.context_lens, "context_lens"}, {&a.block_table, "block_table"}}) {
    check_no_overlap(a.logits, "logits", *in, name);
  }
  const auto* lens = static_cast<const int32_t*>(cl.data);
  const auto* table = static_cast<const int32_t*>(bt.data);
  const int64_t ls0 = cl.strides[0], ls1 = two_d ? cl.strides[1] : 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t longest = 0;
    for (int64_t n = 0; n < next_n; ++n) {
      const int64_t len = lens[b * ls0 + n * ls1];
      if (len < 0 || len > a.max_context_len || len > bt.shape[1] * page) {
        fail("context_lens[", b, ", ", n, "] must be in [0, min(max_context_len=", a.max_context_len,
             ", max_blocks · block_kv=", bt.shape[1] * page, ")], got ", len);
      }
      longest = std::max(longest, len);
    }
    for (int64_t j = 0; j < (longest + page - 1) / page; ++j) {
      const int32_t block = table[b * bt.strides[0] + j * bt.strides[1]];
      if (block < 0 || block >= num_blocks) {
        fail("block_table[", b, ", ", j, "] = ", block, " is out of range [0, num_blocks=", num_blocks, ")");
      }
    }
  }
  IndexerParams p{};
  p.q = static_cast<const uint8_t*>(a.q.data);
  for (int d = 0; d < 4; ++d) p.q_stride[d] = a.q.strides[d];
  p.weights = static_cast<const float*>(a.weights.data);
  p.weights_stride[0] = a.weights.strides[0], p.weights_stride[1] = a.weights.strides[1];
  p.rows = rows, p.rows_per_batch = next_n, p.h = H, p.d = D;
  p.hi = lens, p.hi_stride[0] = ls0, p.hi_stride[1] = ls1;
  p.cache = static_cast<const uint8_t*>(a.kv_cache.data), p.block_stride = a.kv_cache.strides[0], p.page = page;
  p.block_table = table, p.block_table_stride[0] = bt.strides[0], p.block_table_stride[1] = bt.strides[1];
  p.logits = static_cast<float*>(a.logits.data), p.logits_stride = a.logits.strides[0], p.width = a.max_context_len;
  p.clean = a.clean_logits;
  if (rows == 0) return;
  detail::kernels().indexer_logits(p);
}

void topk_transform(const TopkArgs& a) {
  detail::check_rank(a.logits, "logits", 2, "[num_rows, max_len]");
  if (a.logits.dtype != DType::float32) fail("logits must be float32, got ", dtype_name(a.logits.dtype));
  const int64_t N = a.logits.shape[0], L = a.logits.shape[1];
  if (a.topk < 1) fail("topk must be >= 1, got ", a.topk);
  if (a.topk > INT32_MAX) fail("topk must fit int32, got ", a.topk);
  check_int32_vector(a.lengths, "lengths", N, "num_rows");
  if (a.row_starts) check_int32_vector(*a.row_starts, "row_starts", N, "num_rows");
  if (a.offsets && a.page_table) fail("give offsets (ragged) or page_table (paged), not both");
  if (a.row_to_batch && !a.page_table) fail("row_to_batch is only used with page_table");
  check_output(a.out, "out", DType::int32, {N, a.topk});
  const auto* lengths = static_cast<const int32_t*>(a.lengths.data);
  const auto* starts = a.row_starts ? static_cast<const int32_t*>(a.row_starts->data) : nullptr;
  for (int64_t r = 0; r < N; ++r) {
    const int64_t len = lengths[r * a.lengths.strides[0]];
    const int64_t start = starts ? starts[r * a.row_starts->strides[0]] : 0;
    if (start < 0 || len < 0 || start + len > L) {
      fail("row ", r, ": [row_starts, row_starts + lengths) = [", start, ", ", start + len, ") must lie in [0, ", L, ")");
    }
  }
  TopkParams p{};
  p.logits = static_cast<const float*>(a.logits.data);
  p.logits_stride[0] = a.logits.strides[0], p.logits_stride[1] = a.logits.strides[1];
  p.rows = N, p.topk = a.topk;
  p.lengths = lengths, p.lengths_stride = a.lengths.strides[0];
  p.starts = starts, p.starts_stride = a.row_starts ? a.row_starts->strides[0] : 0;
  p.mode = TopkParams::Mode::relative;
  if (a.offsets) {
    check_int32_vector(*a.offsets, "offsets", N, "num_rows");
    p.mode = TopkParams::Mode::ragged;
    p.offsets = static_cast<const int32_t*>(a.offsets->data), p.offsets_stride = a.offsets->strides[0];
    for (int64_t r = 0; r < N; ++r) {
      const int64_t last = int64_t{p.offsets[r * p.offsets_stride]} + lengths[r * p.lengths_stride];
      if (last > INT32_MAX || p.offsets[r * p.offsets_stride] < 0) {
        fail("offsets[", r, "] must be >= 0 with offsets + lengths fitting int32, got ", p.offsets[r * p.offsets_stride]);
      }
    }
  }
  if (a.page_table) {
    const TensorView& pt = *a.page_table;
    detail::check_view(pt, "page_table");
    if (pt.rank != 2 || pt.dtype != DType::int32) {
      fail("page_table must be a 2-d int32 tensor [batches, max_pages], got ", dtype_name(pt.dtype), " of shape ", pt.shape_str());
    }
    if (a.page_size < 1 || a.page_size > INT32_MAX) fail("page_size must be in [1, ", INT32_MAX, "], got ", a.page_size);
    p.mode = TopkParams::Mode::paged;
    p.page_table = static_cast<const int32_t*>(pt.data);
    p.page_table_stride[0] = pt.strides[0], p.page_table_stride[1] = pt.strides[1], p.page = a.page_size;
    if (a.row_to_batch) {
      check_int32_vector(*a.row_to_batch, "row_to_batch", N, "num_rows");
      p.row_to_batch = static_cast<const int32_t*>(a.row_to_batch->data), p.row_to_batch_stride = a.row_to_batch->strides[0];
    } else if (pt.shape[0] != N) {
      fail("page_table must have one row per logits row (", N, ") without row_to_batch, got ", pt.shape[0]);
    }
    std::vector<int64_t> keys_used(pt.shape[0], 0);  // per page-table row: the longest of its rows
    for (int64_t r = 0; r < N; ++r) {
      const int64_t b = p.row_to_batch ? p.row_to_batch[r * p.row_to_batch_stride] : r;
      if (b < 0 || b >= pt.shape[0]) fail("row_to_batch[", r, "] = ", b, " is out of range [0, ", pt.shape[0], ")");
      const int64_t len = lengths[r * p.lengths_stride];
      if (len > pt.shape[1] * a.page_size) {
        fail("lengths[", r, "] = ", len, " exceeds the page table's max_pages · page_size = ", pt.shape[1] * a.page_size);
      }
      keys_used[b] = std::max(keys_used[b], len);
    }
    // Every page a selected key may lie in gives int32 slots page · page_size + offset >= 0.
    for (int64_t b = 0; b < pt.shape[0]; ++b) {
      for (int64_t j = 0; j * a.page_size < keys_used[b]; ++j) {
        const int64_t page = p.page_table[b * p.page_table_stride[0] + j * p.page_table_stride[1]];
        const int64_t last = page * a.page_size + std::min(a.page_size, keys_used[b] - j * a.page_size) - 1;
        if (page < 0 || last > INT32_MAX) {
          fail("page_table[", b, ", ", j, "] = ", page, " must be >= 0 with its slots (page · page_size + offset, up to ",
               last, ") fitting int32");
        }
      }
    }
  }
  p.out = static_cast<int32_t*>(a.out.data), p.out_stride[0] = a.out.strides[0], p.out_stride[1] = a.out.strides[1];
  for (const auto& [in, name] : {std::pair{&a.logits, "logits"}, {&a.lengths, "lengths"}}) check_no_overlap(a.out, "out", *in, name);
  for (const auto& [in, name] : {std::pair{&a.row_starts, "row_starts"}, {&a.offsets, "offsets"}, {&a.page_table, "page_table"},
                                 {&a.row_to_batch, "row_to_batch"}}) {
    if (*in) check_no_overlap(a.out, "out", **in, name);
  }
  if (N == 0) return;
  detail::kernels().topk_select(p);
}

}  // namespace attnkit
