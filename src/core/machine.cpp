// Measures this machine's peak per instruction (fp32 FMA, vdpbf16ps, vpdpbusd, fp16 FMA) and
// read bandwidth with the variants' probe loops, on a given number of pool threads (see
// attnkit/runtime.h).
#include <chrono>
#include <cstdlib>
#include <memory>
#include <vector>

#include "attnkit/error.h"
#include "attnkit/runtime.h"
#include "core/dispatch.h"
#include "core/thread_pool.h"

namespace attnkit {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void check_threads(int threads) {
  if (threads < 1 || threads > detail::num_threads()) {
    throw Error("threads must be in [1, get_num_threads()=" + std::to_string(detail::num_threads()) +
                "], got " + std::to_string(threads));
  }
}

// Calibrate one thread to ~10 ms, then run every thread for the same count; the best of 20
// runs is the peak (interference only ever slows a run down, and on a shared machine short
// runs more often find the cores free).
double measure_loop_gflops(int threads, float (*loop)(int64_t), int64_t flops_per_iter) {
  int64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = Clock::now();
    loop(iters);
    if (seconds_since(t0) > 0.01 || iters > (int64_t{1} << 40)) break;
    iters *= 2;
  }
  std::vector<float> sink(threads);
  double best = 0.0;
  for (int rep = 0; rep < 20; ++rep) {
    auto body = [&](int64_t task, int) { sink[task] = loop(iters); };
    const auto t0 = Clock::now();
    detail::parallel_for(threads, threads, body);
    const double flops = static_cast<double>(iters) * flops_per_iter * threads;
    best = std::max(best, flops / seconds_since(t0) / 1e9);
  }
  return best;
}

}  // namespace

namespace {

struct PeakInstruction {
  const char* name;
  cpu::PeakLoop cpu::ProbeTable::*loop;
};
constexpr PeakInstruction kPeakInstructions[] = {{"fp32 FMA", &cpu::ProbeTable::fp32_fma},
                                                 {"vdpbf16ps", &cpu::ProbeTable::bf16_dot},
                                                 {"vpdpbusd", &cpu::ProbeTable::int8_dot},
                                                 {"fp16 FMA", &cpu::ProbeTable::fp16_fma},
                                                 {"tdpbf16ps", &cpu::ProbeTable::amx_bf16},
                                                 {"tdpbusd", &cpu::ProbeTable::amx_int8}};

}  // namespace

std::vector<std::string> peak_instructions() {
  std::vector<std::string> names;
  for (const PeakInstruction& p : kPeakInstructions) names.push_back(p.name);
  return names;
}

double measure_peak_gflops(const std::string& instruction, int threads) {
  for (const PeakInstruction& p : kPeakInstructions) {
    if (instruction != p.name) continue;
    check_threads(threads);
    const cpu::PeakLoop loop = detail::peak_loop(p.loop);
    return loop.loop ? measure_loop_gflops(threads, loop.loop, loop.flops_per_iter) : 0.0;
  }
  std::string names;
  for (const PeakInstruction& p : kPeakInstructions) names += (names.empty() ? "\"" : ", \"") + std::string(p.name) + "\"";
  throw Error("instruction must be one of " + names + ", got \"" + instruction + "\"");
}

double measure_fma_peak_gflops(int threads) { return measure_peak_gflops("fp32 FMA", threads); }

double measure_read_bandwidth_gbs(int threads) {
  check_threads(threads);
  const cpu::ProbeTable& probe = detail::probes();
  constexpr int64_t kFloats = int64_t{64} << 20;  // 256 MiB: far beyond the last-level cache
  std::unique_ptr<float, decltype(&std::free)> data(
      static_cast<float*>(std::aligned_alloc(64, kFloats * sizeof(float))), &std::free);
  if (!data) throw std::bad_alloc();
  const int64_t per_thread = kFloats / threads / 64 * 64;
  std::vector<float> sink(threads);
  auto fill = [&](int64_t t, int) {
    for (int64_t i = 0; i < per_thread; ++i) data.get()[t * per_thread + i] = 1.0f;
  };
  detail::parallel_for(threads, threads, fill);  // first touch by the reading thread
  double best = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    auto body = [&](int64_t t, int) { sink[t] = probe.read_sum(data.get() + t * per_thread, per_thread); };
    const auto t0 = Clock::now();
    detail::parallel_for(threads, threads, body);
    best = std::max(best, static_cast<double>(per_thread * threads) * sizeof(float) / seconds_since(t0) / 1e9);
  }
  return best;
}

}  // namespace attnkit
