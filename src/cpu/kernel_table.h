// The entry points each ISA variant of the CPU kernels provides. Every file listed in
// ATTNKIT_KERNEL_SOURCES is compiled once per ISA into namespace attnkit::cpu::<isa>;
// src/core/dispatch.cpp picks one table at load.
#pragma once

#include <cstdint>
#include <span>

namespace attnkit {
struct AttentionParams;
struct SparseMlaParams;
struct MergeStatesParams;
struct MlaDecodeParams;
struct V32QuantizeParams;
struct IndexerParams;
struct TopkParams;
struct AttentionBackwardParams;
}

namespace attnkit::cpu {

struct KernelTable {
  const char* isa;
  void (*attention_fwd)(const AttentionParams& params);
  // Whether every row block of the call would run key blocks (decode: few query rows per kv
  // head); decided by the shapes alone.
  bool (*attention_decodes)(const AttentionParams& params);
  void (*sparse_mla_fwd)(const SparseMlaParams& params);
  void (*sage_int8_fwd)(const AttentionParams& params, bool pv_int8);  // pv_int8: mode int8_pv_int8
  void (*merge_states)(const MergeStatesParams& params);
  void (*mla_decode_fwd)(const MlaDecodeParams& params);
  void (*v32_quantize)(const V32QuantizeParams& params);
  void (*indexer_logits)(const IndexerParams& params);
  void (*topk_select)(const TopkParams& params);
  // Independent problems of one dtype (a dense call; the sequences of a varlen call).
  void (*attention_bwd)(std::span<const AttentionBackwardParams> problems);
};

// Loops the benchmark uses to measure the machine (src/cpu/machine_probe.cpp). A peak loop
// does iters * flops_per_iter operations; a null loop: the variant lacks the instruction.
struct PeakLoop {
  float (*loop)(int64_t iters) = nullptr;
  int64_t flops_per_iter = 0;
};
struct ProbeTable {
  float (*read_sum)(const float* data, int64_t n);
  PeakLoop fp32_fma;  // vfmadd231ps at the variant's vector width
  PeakLoop bf16_dot;  // vdpbf16ps
  PeakLoop int8_dot;  // vpdpbusd
  PeakLoop fp16_fma;  // vfmadd231ph (AVX512-FP16; run only where the CPU has it)
  PeakLoop amx_bf16;  // tdpbf16ps (AMX tiles; the avx512amx variant)
  PeakLoop amx_int8;  // tdpbusd (AMX tiles; the avx512amx variant)
};

#define ATTNKIT_DECLARE_ISA(isa)            \
  namespace isa {                           \
  extern const KernelTable kernel_table;    \
  extern const ProbeTable probe_table;      \
  }
ATTNKIT_DECLARE_ISA(generic)
ATTNKIT_DECLARE_ISA(avx2)
ATTNKIT_DECLARE_ISA(avx512)
ATTNKIT_DECLARE_ISA(avx512bf16)
ATTNKIT_DECLARE_ISA(avx512amx)
#undef ATTNKIT_DECLARE_ISA

}  // namespace attnkit::cpu
