// SageAttention3's FP4 attention numerics on the CPU (sage_attention mode "fp4"): an exact
// emulation for checking quality, not a fast kernel. Spec: docs/sage_fp4.md.
#pragma once

#include "ops/attention_params.h"

namespace attnkit::cpu {

void sage_fp4_fwd(const AttentionParams& params);

}  // namespace attnkit::cpu
