// Process-wide runtime settings: threads, the CPU instruction set in use, build facts.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace attnkit {

// Threads used by every op. Default: ATTNKIT_NUM_THREADS, else all cores (a value that is
// not an integer in [1, 1024] is reported once on stderr and the default used). Neither call
// waits for a running op: a new count takes effect at the next op. After fork() the child
// starts its own pool at its first op.
void set_num_threads(int n);
int get_num_threads();

// Stopping a running op (the Python binding turns Ctrl-C into this). While a poll is
// installed on a thread, each op called on that thread calls poll(context) from that thread
// between its tasks and while it waits for another thread's op, about every 50 ms. When
// poll returns true the op starts no further task, waits for the running ones and throws
// Interrupted: the outputs then hold results where finished tasks wrote them and their
// previous contents elsewhere (which parts is unspecified). Tasks are blocks of output rows
// (a whole head for sage fp4), so an op stops within about one task's time. Ops on a thread
// without a poll pay nothing for this. The poll must not throw.
class Interrupted : public std::runtime_error {
 public:
  Interrupted() : std::runtime_error("attnkit: the op was interrupted") {}
};
class ScopedInterruptPoll {
 public:
  ScopedInterruptPoll(bool (*poll)(void* context), void* context);  // nullptr: none
  ~ScopedInterruptPoll();                                          // restores the previous one
  ScopedInterruptPoll(const ScopedInterruptPoll&) = delete;
  ScopedInterruptPoll& operator=(const ScopedInterruptPoll&) = delete;

 private:
  bool (*previous_poll_)(void*);
  void* previous_context_;
};

// Kernel variants by instruction set. The one fastest on this CPU is chosen at load: the
// widest it supports, except that on Intel family-6 CPUs (Sapphire/Emerald Rapids, ...),
// whose vdpbf16ps runs at half the fp32 FMA rate, avx512vnni comes before avx512bf16 (see
// isa_rule); avx512amx comes first where the CPU and the OS allow AMX tiles.
// ATTNKIT_ISA=avx512amx|avx512bf16|avx512vnni|avx512|avx2|generic overrides it (a value
// naming no variant runnable here is reported once on stderr and the default used), and so
// does set_isa. An op reads the choice once when it starts, so set_isa never affects a
// running op. avx512bf16 is avx512 plus vdpbf16ps for bf16 inputs (exact bf16 products, fp32
// sums) and vpdpbusd for int8 Sage; avx512vnni is avx512 (bf16 converted to fp32 for FMAs)
// with avx512bf16's int8 Sage; both need a CPU with AVX512_BF16 and AVX512_VNNI. avx512amx
// runs the bf16 tile loop's Q·Kᵀ and P·V, the bf16 backward's products and sage's (int8
// Q·Kᵀ, bf16 P·V) on AMX tiles (tdpbf16ps, tdpbusd: the same exact products and fp32 or
// int32 sums) and the rest as the best variant without AMX.
std::string active_isa();
std::vector<std::string> supported_isas();  // built and runnable here, best first
void set_isa(const std::string& name);       // throws Error if not supported here
std::string isa_rule();  // the default variant and why, e.g. "avx512bf16: AuthenticAMD family 26 ..."

// This machine's limits on `threads` pool threads (1 <= threads <= get_num_threads()).
// measure_peak_gflops: the rate of one instruction in independent chains, in GFLOP/s (GOP/s
// for vpdpbusd), counting 2 per multiply-add: "fp32 FMA" (vfmadd231ps at the active ISA's
// width, 2 per fp32 lane), "vdpbf16ps" (4 per fp32 lane: 2 bf16 products), "vpdpbusd" (8 per
// int32 lane: 4 u8 × s8 products), "fp16 FMA" (vfmadd231ph, 2 per fp16 lane), and AMX's
// "tdpbf16ps" / "tdpbusd" (peak_instructions() lists them all); 0 where this CPU or build
// lacks the instruction; throws Error for another name. The read rate streams a
// buffer far larger than the last-level cache.
std::vector<std::string> peak_instructions();
double measure_peak_gflops(const std::string& instruction, int threads);
double measure_fma_peak_gflops(int threads);  // measure_peak_gflops("fp32 FMA", threads)
double measure_read_bandwidth_gbs(int threads);

std::string version();
std::string build_info();    // compiler and the ISAs compiled in
std::string cpu_features();  // the CPU features this machine reports

}  // namespace attnkit
