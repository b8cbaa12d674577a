// Process-wide runtime settings: threads, the CPU instruction set in use, build facts.
#pragma once

#include <string>
#include <vector>

namespace attnkit {

// Threads used by every op. Default: ATTNKIT_NUM_THREADS, else all cores.
void set_num_threads(int n);
int get_num_threads();

// Kernel variants by instruction set. The best one this CPU supports is chosen at load;
// ATTNKIT_ISA=avx512bf16|avx512|avx2|generic overrides it, and so does set_isa.
// avx512bf16 differs from avx512 only for bf16 attention, whose Q·Kᵀ it computes with
// vdpbf16ps (exact bf16 products, fp32 sums); P·V stays in fp32 as everywhere else.
std::string active_isa();
std::vector<std::string> supported_isas();  // built and runnable here, best first
void set_isa(const std::string& name);       // throws Error if not supported here

// This machine's limits, measured with the active ISA on `threads` pool threads
// (1 <= threads <= get_num_threads()): the fp32 FMA rate and the streaming read rate.
double measure_fma_peak_gflops(int threads);
// The vdpbf16ps rate (bf16 pairs, fp32 sums) where the active ISA has it (avx512bf16), else 0.
double measure_bf16_dot_peak_gflops(int threads);
double measure_read_bandwidth_gbs(int threads);

std::string version();
std::string build_info();  // compiler, ISAs compiled in, CPU features seen
std::string cpu_features();

}  // namespace attnkit
