// DeepSeek-V3.2 sparse attention (DSA) beyond the prefill: MLA decode over paged caches with
// FlashMLA's flash_mla_with_kvcache contract (sparse over the 656-byte fp8 V3.2 cache, or
// dense over a bf16 or V3.2 cache), the quantiser that writes V3.2 tokens, the lightning
// indexer's logits (DeepGEMM's fp8_mqa_logits / fp8_paged_mqa_logits) and top-k.
#pragma once

#include <cstdint>
#include <optional>

#include "attnkit/tensor.h"

namespace attnkit {

struct MlaDecodeArgs {
  TensorView q;        // [b, s_q, h_q, d_qk] bfloat16, any strides
  // is_fp8_kvcache: [num_blocks, page_block_size, 1, 656] uint8, int8 or float8_e4m3fn bytes
  // (token stride 656, block stride free); else [num_blocks, page_block_size, 1, d_qk] bfloat16.
  TensorView k_cache;
  std::optional<TensorView> block_table;    // [b, max_blocks] int32 (dense; ignored if sparse)
  std::optional<TensorView> cache_seqlens;  // [b] int32 (dense; ignored if sparse)
  int64_t head_dim_v = 512;
  std::optional<double> softmax_scale;      // default d_qk^-0.5
  bool causal = false;
  bool is_fp8_kvcache = false;
  std::optional<TensorView> indices;        // [b, s_q, topk] int32 slot ids: sparse mode
  std::optional<TensorView> attn_sink;      // [h_q] float32
  std::optional<TensorView> topk_length;    // [b] int32 (sparse)
  TensorView out;                           // [b, s_q, h_q, head_dim_v] bfloat16, contiguous
  TensorView lse;                           // [b, s_q, h_q] float32, contiguous
};

// FlashMLA's flash_mla_with_kvcache; semantics in python/attnkit/dsa.py. Throws
// attnkit::Error on invalid arguments.
void flash_mla_with_kvcache(const MlaDecodeArgs& args);

// FlashMLA's V3.2 quantiser: kv [n, 576] bfloat16 or float32 -> dst [n, 656] uint8 (contiguous).
void quantize_v32_kv(const TensorView& kv, const TensorView& dst);

// DeepGEMM's fp8_mqa_logits (the lightning indexer over flat keys):
// logits[t, s] = Σ_h weights[t, h] · ReLU(q[t, h] · kv[s]) · kv_scale[s] for ks[t] <= s < ke[t].
struct IndexerLogitsArgs {
  TensorView q;         // [T, H, D] float8_e4m3fn, D in {32, 64, 128}
  TensorView kv;        // [S, D] float8_e4m3fn
  TensorView kv_scale;  // [S] float32
  TensorView weights;   // [T, H] float32
  TensorView ks, ke;    // [T] int32
  bool clean_logits = true;   // -inf outside [ks, ke) (else those entries are not written)
  int64_t max_seqlen_k = 0;   // > 0: logits [T, max_seqlen_k], column c is key ks[t] + c
  std::optional<TensorView> logits;        // [T, S or max_seqlen_k] float32, last dim contiguous
  std::optional<TensorView> topk_indices;  // instead of logits: the fused top-k [T, topk] int32
};
void fp8_mqa_logits(const IndexerLogitsArgs& args);

// DeepGEMM's fp8_paged_mqa_logits over the index-K cache (per page: page·D fp8 values, then
// page fp32 scales): row (b, n) sees keys [0, context_lens[b, n]).
struct PagedIndexerLogitsArgs {
  TensorView q;             // [B, next_n, H, D] float8_e4m3fn
  TensorView kv_cache;      // [num_blocks, block_kv, 1, D + 4] uint8 / int8 / float8_e4m3fn bytes
  TensorView weights;       // [B·next_n, H] float32
  TensorView context_lens;  // [B, next_n] int32 (or [B] when next_n == 1)
  TensorView block_table;   // [B, max_blocks] int32
  int64_t max_context_len = 0;
  bool clean_logits = false;
  TensorView logits;        // [B·next_n, max_context_len] float32, last dim contiguous
};
void fp8_paged_mqa_logits(const PagedIndexerLogitsArgs& args);

// Top-k of logits[r, row_starts[r] + t] over t < lengths[r], ordered by (value desc, t asc);
// -inf and NaN never selected; -1 fills. Output t, t + offsets[r] (ragged), or the slot
// page_table[row_to_batch[r], t / page_size] · page_size + t % page_size (paged).
struct TopkArgs {
  TensorView logits;   // [N, L] float32
  TensorView lengths;  // [N] int32
  int64_t topk = 0;
  std::optional<TensorView> row_starts;    // [N] int32
  std::optional<TensorView> offsets;       // [N] int32: the ragged transform
  std::optional<TensorView> page_table;    // [batches, max_pages] int32: the paged transform
  int64_t page_size = 1;
  std::optional<TensorView> row_to_batch;  // [N] int32 (paged; default row r -> batch r)
  TensorView out;      // [N, topk] int32
};
void topk_transform(const TopkArgs& args);

}  // namespace attnkit
