// The entry points each ISA variant of the CPU kernels provides. Every file listed in
// ATTNKIT_KERNEL_SOURCES is compiled once per ISA into namespace attnkit::cpu::<isa>;
// src/core/dispatch.cpp picks one table at load.
#pragma once

namespace attnkit {
struct AttentionParams;
}

namespace attnkit::cpu {

struct KernelTable {
  const char* isa;
  void (*attention_fwd)(const AttentionParams& params);
};

namespace generic {
extern const KernelTable kernel_table;
}
namespace avx2 {
extern const KernelTable kernel_table;
}
namespace avx512 {
extern const KernelTable kernel_table;
}

}  // namespace attnkit::cpu
