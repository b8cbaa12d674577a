// The plain parameter blocks the DSA kernels see (src/cpu/dsa_*.cpp), built by src/ops/dsa.cpp.
#pragma once

#include <cstdint>

#include "ops/sparse_mla_params.h"

namespace attnkit {

// FlashMLA's V3.2 fp8 token: 512 e4m3 values, 4 fp32 scales (one per 128), 64 bf16 rope values.
inline constexpr int64_t kV32Nope = 512, kV32Rope = 64, kV32Tile = 128, kV32Tiles = 4;
inline constexpr int64_t kV32TokenBytes = kV32Nope + kV32Tiles * 4 + kV32Rope * 2;  // 656

// MLA decode over a paged cache: query row s of the tile loop is (batch s / s_q, token s % s_q).
struct MlaDecodeParams {
  SparseMlaParams tile;         // q, h_q, d_qk, d_v, logit_scale, sink, out, lse (s_q = batch·s_q)
  int64_t batch, s_q;
  int64_t q_batch_stride, q_seq_stride;
  bool v32_fp8;                 // cache of 656-byte V3.2 tokens, else bf16 [.., d_qk]
  const void* cache;
  int64_t block_stride, token_stride, dim_stride;  // in bytes (fp8) or elements (bf16)
  int64_t page_block_size, num_blocks;
  // Sparse (indices given): the slot t of row (b, i) is indices[b, i, t], valid when
  // 0 <= slot < num_blocks·page_block_size and t < topk_length[b].
  const int32_t* indices;       // or nullptr: dense
  int64_t indices_stride[3], topk;
  const int32_t* topk_length;   // [b] or nullptr
  int64_t topk_length_stride;
  // Dense: tokens t < cache_seqlens[b] (causal: t < seqlen - s_q + i + 1), page
  // block_table[b, t / page_block_size]; every referenced block id is checked in range.
  const int32_t* block_table;
  int64_t block_table_stride[2];
  const int32_t* cache_seqlens;
  int64_t cache_seqlens_stride;
  bool causal;
  int64_t max_rows;             // the most rows one query row lists
};

// src [n, 576] bfloat16 or float32 (rows by src_row_stride, columns by src_col_stride, in
// elements) -> n tokens of the V3.2 layout at dst + i·dst_token_stride bytes.
struct V32QuantizeParams {
  const void* src;
  bool src_bf16;
  int64_t n, src_row_stride, src_col_stride;
  uint8_t* dst;
  int64_t dst_token_stride;
};

// Lightning-indexer logits: logits[r, j] = Σ_h w[r, h] · ReLU(q[r, h] · k[j]) · k_scale[j] for
// keys j in [lo[r], hi[r]), q and k fp8 e4m3. Keys are flat (k + j·k_row_stride, scales
// k_scale[j·k_scale_stride]) or paged (DeepGEMM's index-K cache: page block_table[b, j / page]
// holds page·d fp8 values, then page fp32 scales). Rows of one batch entry share its page table.
struct IndexerParams {
  const uint8_t* q;                // [rows, h, d]: row r at q + r / rows_per_batch · q_stride[0] + r % rows_per_batch · q_stride[1]
  int64_t q_stride[4];             // batch, row in batch, head, dim (elements)
  const float* weights;            // [rows, h]
  int64_t weights_stride[2];
  int64_t rows, rows_per_batch, h, d;
  const int32_t* lo;               // [rows] first key (flat: ks; paged: nullptr, meaning 0)
  int64_t lo_stride;
  const int32_t* hi;               // [rows] end key (flat: ke; paged: context_lens)
  int64_t hi_stride[2];            // flat: [stride, 0]; paged: [batch, row in batch]
  int64_t num_keys;                // flat: keys in k (ranges are clipped to it)
  // flat keys
  const uint8_t* k;
  int64_t k_row_stride, k_col_stride;
  const float* k_scale;
  int64_t k_scale_stride;
  // paged keys
  const uint8_t* cache;            // nullptr: flat
  int64_t block_stride, page;
  const int32_t* block_table;
  int64_t block_table_stride[2];
  // output: logits [rows, width], column j (or j - lo[r] when compressed)
  float* logits;                   // nullptr: fused top-k instead
  int64_t logits_stride, width;
  bool compressed, clean;
  // fused top-k (logits == nullptr): indices [rows, topk] row-relative (j - lo[r]), -1 fill
  int32_t* topk_out;
  int64_t topk_stride, topk;
};

// Top-k of each row of logits over [start, start + length) by (value desc, index asc); -inf and
// NaN are never selected; -1 fills. Output index per mode: row-relative, + offset[r] (ragged),
// or the slot page_table[batch(r), t / page] · page + t % page (paged).
struct TopkParams {
  const float* logits;
  int64_t logits_stride[2], rows, topk;
  const int32_t* lengths;          // [rows]
  int64_t lengths_stride;
  const int32_t* starts;           // [rows] or nullptr
  int64_t starts_stride;
  enum class Mode { relative, ragged, paged } mode;
  const int32_t* offsets;          // ragged [rows]
  int64_t offsets_stride;
  const int32_t* page_table;       // paged [batches, max_pages]
  int64_t page_table_stride[2], page;
  const int32_t* row_to_batch;     // paged [rows] or nullptr (row r -> batch r)
  int64_t row_to_batch_stride;
  int32_t* out;                    // [rows, topk]
  int64_t out_stride[2];
};

}  // namespace attnkit
