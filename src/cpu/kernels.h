// The op loops every ISA variant defines (in attnkit::cpu::<isa>), gathered into its
// KernelTable by src/cpu/kernel_table.cpp.
#pragma once

#include <span>

#include "cpu/kernel_table.h"

namespace attnkit::cpu::ATTNKIT_ISA {

void attention_fwd(const AttentionParams& params);
bool attention_decodes(const AttentionParams& params);
void sparse_mla_fwd(const SparseMlaParams& params);
void sage_int8_fwd(const AttentionParams& params, bool pv_int8);
void merge_states(const MergeStatesParams& params);
void mla_decode_fwd(const MlaDecodeParams& params);
void v32_quantize(const V32QuantizeParams& params);
void indexer_logits(const IndexerParams& params);
void topk_select(const TopkParams& params);
void attention_bwd(std::span<const AttentionBackwardParams> problems);

}  // namespace attnkit::cpu::ATTNKIT_ISA
