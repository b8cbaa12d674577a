// Loops that measure this machine's limits for the benchmark: independent fp32 FMAs at
// the ISA's full vector width (the compute peak), vdpbf16ps where the ISA has it, and a
// streaming read (the bandwidth).
// Compiled once per ISA like the kernels, so the peak matches the variant in use.
#include <cstdint>

#include "cpu/kernel_table.h"
#include "cpu/kernels/simd.h"

#if defined(ATTNKIT_ISA_avx512bf16)
#include <immintrin.h>
#endif

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

// kChains independent FMA chains hide the FMA latency; returns a value that depends on all
// of them so the loop cannot be removed. Does iters * kChains * kLanes FMAs.
constexpr int kChains = 12;

float fma_loop(int64_t iters) {
  vfloat acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = vbroadcast(0.001f * static_cast<float>(c));
  const vfloat mul = vbroadcast(0.999999f), add = vbroadcast(1e-7f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * mul + add;
  }
  vfloat sum{};
  for (int c = 0; c < kChains; ++c) sum += acc[c];
  return hsum(sum);
}

float read_sum(const float* data, int64_t n) {
  vfloat s0{}, s1{}, s2{}, s3{};
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    s0 += vload(data + i);
    s1 += vload(data + i + kLanes);
    s2 += vload(data + i + 2 * kLanes);
    s3 += vload(data + i + 3 * kLanes);
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += data[i];
  return hsum(s0 + s1 + s2 + s3) + tail;
}

#if defined(ATTNKIT_ISA_avx512bf16)
// The same with vdpbf16ps: each of kChains accumulators takes 32 bf16 multiply-adds per
// instruction (the indexer's and sparse MLA's Sᵀ = K · Qᵀ run on it).
float bf16_dot_loop(int64_t iters) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(0.001f * static_cast<float>(c));
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = (__m512bh)_mm512_set1_epi32(0x33D633D6);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  return hsum((vfloat)sum);
}
constexpr auto kBf16DotLoop = &bf16_dot_loop;
constexpr int64_t kBf16DotFlops = kChains * 32 * 2;
#else
constexpr float (*kBf16DotLoop)(int64_t) = nullptr;
constexpr int64_t kBf16DotFlops = 0;
#endif

}  // namespace

const ProbeTable probe_table = {&fma_loop, &read_sum, kChains * kLanes * 2, kBf16DotLoop, kBf16DotFlops};

}  // namespace attnkit::cpu::ATTNKIT_ISA
