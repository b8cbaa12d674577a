// Loops that measure this machine's limits for the benchmark: the peak of each instruction a
// kernel path may run, and a streaming read (the bandwidth). Each peak loop keeps independent
// accumulator chains, at least latency × issue width on the CPUs seen, so it is bound by
// throughput, not latency: 12 for the FMA (4 cycles × 2 ports; 12 + 2 operands still fit
// AVX2's 16 registers), 16 for the dot products (Zen 5 runs vdpbf16ps 2 per cycle with ~6
// cycles of latency: 12 chains measured 484 GFLOP/s per core, 16 chains 518).
// Compiled once per ISA like the kernels: the fp32 FMA loop runs at the variant's vector
// width; vdpbf16ps, vpdpbusd and the fp16 FMA exist in the avx512bf16 variant only, and
// tdpbf16ps and tdpbusd in avx512amx.
#include <cstdint>

#include "cpu/kernel_table.h"
#include "cpu/kernels/simd.h"

#if defined(ATTNKIT_ISA_avx512bf16)
#include <immintrin.h>
#endif
#if defined(ATTNKIT_ISA_avx512amx)
#include "cpu/kernels/gemm_amx.h"
#endif

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

constexpr int kChains = 12;

// vfmadd231ps at the variant's width: 2 FLOPs per fp32 lane.
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
constexpr int kDotChains = 16;

// vdpbf16ps zmm: 16 fp32 lanes, each adding 2 bf16 products: 64 FLOPs per instruction.
float bf16_dot_loop(int64_t iters) {
  __m512 acc[kDotChains];
  for (int c = 0; c < kDotChains; ++c) acc[c] = _mm512_set1_ps(0.001f * static_cast<float>(c));
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = (__m512bh)_mm512_set1_epi32(0x33D633D6);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kDotChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < kDotChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  return hsum((vfloat)sum);
}

// vpdpbusd zmm: 16 int32 lanes, each adding 4 u8 × s8 products (4 MACs = 8 ops): 128 ops per
// instruction. The sums wrap harmlessly; only the rate matters. The accumulators are int32
// vectors: as __m512i (64-bit lanes) GCC 12 copies each one twice per product.
float int8_dot_loop(int64_t iters) {
  using v16si = int __attribute__((vector_size(64)));
  v16si acc[kDotChains];
  for (int c = 0; c < kDotChains; ++c) acc[c] = (v16si)_mm512_set1_epi32(c);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kDotChains; ++c) acc[c] = (v16si)_mm512_dpbusd_epi32((__m512i)acc[c], a, b);
  }
  v16si sum = acc[0];
  for (int c = 1; c < kDotChains; ++c) sum += acc[c];
  float total = 0.0f;
  for (int lane = 0; lane < 16; ++lane) total += static_cast<float>(sum[lane]);
  return total;
}

// vfmadd231ph zmm (AVX512-FP16, Intel Sapphire Rapids and later): 32 fp16 lanes, 2 FLOPs
// each. Compiled for that extension alone; called only where the CPU reports it.
__attribute__((target("avx512fp16"))) float fp16_fma_loop(int64_t iters) {
  __m512h acc[kDotChains];
  for (int c = 0; c < kDotChains; ++c) acc[c] = _mm512_set1_ph(static_cast<_Float16>(0.001f * static_cast<float>(c)));
  const __m512h mul = _mm512_set1_ph(static_cast<_Float16>(0.999f)), add = _mm512_set1_ph(static_cast<_Float16>(1e-4f));
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kDotChains; ++c) acc[c] = _mm512_fmadd_ph(acc[c], mul, add);
  }
  __m512h sum = _mm512_setzero_ph();
  for (int c = 0; c < kDotChains; ++c) sum = _mm512_add_ph(sum, acc[c]);
  alignas(64) _Float16 lanes[32];
  _mm512_store_ph(lanes, sum);
  float total = 0.0f;
  for (_Float16 x : lanes) total += static_cast<float>(x);
  return total;
}

constexpr PeakLoop kBf16Dot = {&bf16_dot_loop, kDotChains * 16 * 2 * 2};
constexpr PeakLoop kInt8Dot = {&int8_dot_loop, kDotChains * 16 * 4 * 2};
constexpr PeakLoop kFp16Fma = {&fp16_fma_loop, kDotChains * 32 * 2};
#else
constexpr PeakLoop kBf16Dot{}, kInt8Dot{}, kFp16Fma{};
#endif

#if defined(ATTNKIT_ISA_avx512amx)
// An AMX instruction on four independent accumulator tiles (its latency is about 4 times
// its issue interval), operands loaded once: tdpbf16ps (16 × 16 fp32 outputs, each adding 16
// bf16 pairs) or tdpbusd (int32 outputs, each adding 16 u8 × s8 quads).
template <bool kInt8>
float amx_loop(int64_t iters) {
  alignas(64) uint16_t ones[16 * 32];
  for (uint16_t& x : ones) x = 0x3F80;  // bf16 1.0; as bytes: 0x80 (128) and 0x3F (63)
  alignas(64) int32_t out[16 * 16];
  amx_configure();
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    if constexpr (kInt8) {  // sums wrap harmlessly; only the rate matters
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 64);
  return static_cast<float>(out[0]);
}
constexpr PeakLoop kAmxBf16 = {&amx_loop<false>, 4 * 16 * 16 * 16 * 2 * 2};
constexpr PeakLoop kAmxInt8 = {&amx_loop<true>, 4 * 16 * 16 * 16 * 4 * 2};
#else
constexpr PeakLoop kAmxBf16{}, kAmxInt8{};
#endif

}  // namespace

const ProbeTable probe_table = {&read_sum, {&fma_loop, kChains * kLanes * 2}, kBf16Dot, kInt8Dot, kFp16Fma,
                                kAmxBf16, kAmxInt8};

}  // namespace attnkit::cpu::ATTNKIT_ISA
