// Run-time choice of the CPU kernel variant (instruction set).
#pragma once

#include "cpu/kernel_table.h"

namespace attnkit::detail {

// The table of the active ISA (chosen at first use; see runtime.h for the overrides).
const cpu::KernelTable& kernels();
const cpu::ProbeTable& probes();

}  // namespace attnkit::detail
