// Run-time choice of the CPU kernel variant (instruction set).
#pragma once

#include "cpu/kernel_table.h"

namespace attnkit::detail {

// The table of the active ISA (chosen at first use; see runtime.h for the overrides).
const cpu::KernelTable& kernels();
const cpu::ProbeTable& probes();
// The loop measuring `instruction`'s peak: the active variant's fp32 FMA loop (its width);
// for the others the first runnable variant's, where the CPU runs it; else an empty loop.
cpu::PeakLoop peak_loop(cpu::PeakLoop cpu::ProbeTable::*instruction);
// Whether decode over grouped kv heads reads ahead into L2 (AttentionParams::l2_read_ahead):
// on AMD family 25 (Zen 4), or as ATTNKIT_READ_AHEAD says ("l2" or "next"; read at each
// call, so tests run both ways on every machine; another value is reported once).
bool l2_read_ahead();

}  // namespace attnkit::detail
