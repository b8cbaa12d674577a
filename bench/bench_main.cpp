// attnkit_bench_kernels: registers each compiled ISA's micro-benchmarks (bench_kernels.cpp)
// that this CPU can run, measures each ISA's single-thread fp32 FMA peak (for pct_peak), then
// runs Google Benchmark. Extra flag: --attnkit_no_peak skips the peak measurement.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "attnkit/runtime.h"

#ifndef ATTNKIT_BENCH_ISA_LIST
#error "ATTNKIT_BENCH_ISA_LIST (X(isa)...) comes from bench/CMakeLists.txt"
#endif

#define X(isa)                               \
  namespace attnkit::bench::isa {            \
  void register_benchmarks(double peak_gflops); \
  }
ATTNKIT_BENCH_ISA_LIST
#undef X

namespace {

struct IsaEntry {
  const char* name;
  void (*register_benchmarks)(double);
};

#define X(isa) IsaEntry{#isa, &attnkit::bench::isa::register_benchmarks},
const IsaEntry kIsas[] = {ATTNKIT_BENCH_ISA_LIST};
#undef X

}  // namespace

int main(int argc, char** argv) {
  bool measure_peak = true;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--attnkit_no_peak") == 0) {
      measure_peak = false;
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;

  const std::vector<std::string> supported = attnkit::supported_isas();
  const std::string saved = attnkit::active_isa();
  int registered = 0;
  for (const IsaEntry& e : kIsas) {
    if (std::find(supported.begin(), supported.end(), e.name) == supported.end()) {
      std::fprintf(stderr, "attnkit_bench_kernels: skipping %s (not supported on this CPU)\n",
                   e.name);
      continue;
    }
    double peak = 0.0;
    if (measure_peak) {
      attnkit::set_isa(e.name);
      peak = attnkit::measure_fma_peak_gflops(1);
      benchmark::AddCustomContext(std::string("fp32_fma_peak_gflops_1thread_") + e.name,
                                  std::to_string(peak));
    }
    e.register_benchmarks(peak);
    ++registered;
  }
  attnkit::set_isa(saved);
  if (registered == 0) {
    std::fprintf(stderr, "attnkit_bench_kernels: no runnable ISA variant\n");
    return 1;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
