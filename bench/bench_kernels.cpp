// Micro-benchmarks of the CPU micro-kernels in isolation, compiled once per ISA (like the
// kernels themselves) into attnkit::bench::<isa>. Shapes are one attention tile as
// src/cpu/attention_fwd.cpp uses them (64 keys × 64 query rows, D = Dv = 128):
//   gemm_qk/<tile>   Sᵀ = K · Qᵀ    m=64  n=64  k=128, A row-major
//   gemm_pv/<tile>   O += P · V     m=64  n=128 k=64, A read transposed (from Sᵀ), accumulating
//   gemm_pv_rowmajor/<tile>         the same with A row-major, for comparison
//   online_softmax_tile             64 keys × 64 rows of transposed scores
//   attention_tile                  gemm_qk (wide) + softmax + rescale + gemm_pv (tall)
// <tile> is the register tile: "wide" (kWideRows × kWideVecs, meant for Kᵀ·Q) or "tall"
// (kTallRows × kTallVecs, meant for P·V); each gemm runs with both, to compare.
// Counters: FLOPS (useful FLOP/s: 2·m·n·k per gemm), pct_peak (of this ISA's fp32 FMA peak
// on one thread, measured at start-up), scores/s for the softmax.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "cpu/kernels/gemm.h"
#include "cpu/kernels/simd.h"
#include "cpu/kernels/softmax.h"

#define ATTNKIT_BENCH_STR2(x) #x
#define ATTNKIT_BENCH_STR(x) ATTNKIT_BENCH_STR2(x)

namespace attnkit::bench::ATTNKIT_ISA {
namespace {

using namespace attnkit::cpu::ATTNKIT_ISA;
using Clock = std::chrono::steady_clock;

constexpr int64_t kKeys = 64, kRows = 64, kD = 128, kDv = 128;

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;

// 64-byte aligned, filled with uniform [-1, 1) values (never zeros).
Buffer random_buffer(int64_t n, uint32_t seed) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
  Buffer b(static_cast<float*>(std::aligned_alloc(64, bytes)));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) b[i] = dist(gen);
  return b;
}

// Adds FLOPS (rate) and pct_peak (of the measured single-thread fp32 FMA peak).
void report_flops(benchmark::State& state, double flops_per_iter, double seconds,
                  double peak_gflops) {
  const double total = flops_per_iter * static_cast<double>(state.iterations());
  state.counters["FLOPS"] = benchmark::Counter(total, benchmark::Counter::kIsRate);
  if (peak_gflops > 0 && seconds > 0) {
    state.counters["pct_peak"] = 100.0 * total / seconds / (peak_gflops * 1e9);
  }
}

// c[m][n] (+)= a · b[k][n]; a is [m][k] (row-major) or, with a_transposed, [k][m].
template <int MR, int NV>
void bm_gemm(benchmark::State& state, int64_t m, int64_t n, int64_t k, bool a_transposed,
             bool accumulate, double peak_gflops) {
  Buffer a = random_buffer(m * k, 1), b = random_buffer(k * n, 2), c = random_buffer(m * n, 3);
  const int64_t lda = a_transposed ? 1 : k, a_step = a_transposed ? m : 1;
  // Keep C bounded while accumulating: scale B so each call adds O(1e-3).
  if (accumulate) {
    for (int64_t i = 0; i < k * n; ++i) b[i] *= 1e-3f;
  }
  const auto t0 = Clock::now();
  for (auto _ : state) {
    gemm<MR, NV>(m, n, k, a.get(), lda, a_step, b.get(), n, c.get(), n, accumulate);
    benchmark::DoNotOptimize(c.get());
    benchmark::ClobberMemory();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  report_flops(state, 2.0 * m * n * k, seconds, peak_gflops);
}

// Scores in the log2 domain, st[j * ld + r]: roughly what Q·Kᵀ·scale·log2(e) produces.
Buffer score_tile(uint32_t seed) {
  Buffer st = random_buffer(kKeys * kRows, seed);
  for (int64_t i = 0; i < kKeys * kRows; ++i) st[i] *= 4.0f;
  return st;
}

void bm_softmax_tile(benchmark::State& state) {
  Buffer st = score_tile(4), m = random_buffer(kRows, 5), l = random_buffer(kRows, 6),
         alpha = random_buffer(kRows, 7);
  for (int64_t r = 0; r < kRows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  // Each call overwrites the tile with P in (0, 1]; later calls see those values. The work
  // does not depend on the values (no data-dependent branches, no denormals).
  for (auto _ : state) {
    online_softmax_tile(st.get(), kKeys, kRows, kRows, m.get(), l.get(), alpha.get());
    benchmark::DoNotOptimize(st.get());
    benchmark::DoNotOptimize(alpha.get());
    benchmark::ClobberMemory();
  }
  state.counters["scores/s"] = benchmark::Counter(
      static_cast<double>(kKeys * kRows) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
}

// One kv tile of the fused forward kernel: Sᵀ = K · Qᵀ, online softmax over the tile,
// rescale of the output rows, O += P · V (P read transposed from Sᵀ).
void bm_attention_tile(benchmark::State& state, double peak_gflops) {
  Buffer k = random_buffer(kKeys * kD, 8), qt = random_buffer(kD * kRows, 9),
         v = random_buffer(kKeys * kDv, 10), o = random_buffer(kRows * kDv, 11),
         st = random_buffer(kKeys * kRows, 12), m = random_buffer(kRows, 13),
         l = random_buffer(kRows, 14), alpha = random_buffer(kRows, 15);
  for (int64_t r = 0; r < kRows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  for (int64_t i = 0; i < kD * kRows; ++i) qt[i] *= 0.4f;  // scores of order a few units
  const auto t0 = Clock::now();
  for (auto _ : state) {
    gemm<kWideRows, kWideVecs>(kKeys, kRows, kD, k.get(), kD, 1, qt.get(), kRows, st.get(), kRows,
                               false);
    online_softmax_tile(st.get(), kKeys, kRows, kRows, m.get(), l.get(), alpha.get());
    for (int64_t r = 0; r < kRows; ++r) {
      if (alpha[r] != 1.0f) scale_row(o.get() + r * kDv, kDv, alpha[r]);
    }
    gemm<kTallRows, kTallVecs>(kRows, kDv, kKeys, st.get(), 1, kRows, v.get(), kDv, o.get(), kDv,
                               true);
    benchmark::DoNotOptimize(o.get());
    benchmark::ClobberMemory();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  report_flops(state, 2.0 * kKeys * kRows * (kD + kDv), seconds, peak_gflops);
}

}  // namespace

// Registers this ISA's benchmarks as "<isa>/<name>"; peak_gflops is this ISA's measured
// single-thread fp32 FMA peak (0 if unknown).
void register_benchmarks(double peak_gflops) {
  const std::string isa = ATTNKIT_BENCH_STR(ATTNKIT_ISA);
  const std::string wide = "wide" + std::to_string(kWideRows) + "x" + std::to_string(kWideVecs);
  const std::string tall = "tall" + std::to_string(kTallRows) + "x" + std::to_string(kTallVecs);
  auto gemms = [&](const std::string& tile, auto fn) {
    benchmark::RegisterBenchmark((isa + "/gemm_qk/" + tile + "/m64_n64_k128").c_str(), fn, kKeys,
                                 kRows, kD, false, false, peak_gflops);
    benchmark::RegisterBenchmark((isa + "/gemm_pv/" + tile + "/m64_n128_k64").c_str(), fn, kRows,
                                 kDv, kKeys, true, true, peak_gflops);
    benchmark::RegisterBenchmark((isa + "/gemm_pv_rowmajor/" + tile + "/m64_n128_k64").c_str(),
                                 fn, kRows, kDv, kKeys, false, true, peak_gflops);
  };
  gemms(wide, bm_gemm<kWideRows, kWideVecs>);
  gemms(tall, bm_gemm<kTallRows, kTallVecs>);
  benchmark::RegisterBenchmark((isa + "/online_softmax_tile/keys64_rows64").c_str(),
                               bm_softmax_tile);
  benchmark::RegisterBenchmark((isa + "/attention_tile/keys64_rows64_d128").c_str(),
                               bm_attention_tile, peak_gflops);
}

}  // namespace attnkit::bench::ATTNKIT_ISA
