// Micro-benchmarks of the CPU micro-kernels in isolation, compiled once per ISA (like the
// kernels themselves) into attnkit::bench::<isa>, each called exactly as
// src/cpu/attention_fwd.cpp calls it (D = Dv = 128).
// Prefill: one kv tile of kKvTile = 128 keys for one task of kRowTarget = 48 query rows.
//   gemm_qk/fp32/<wide>             Sᵀ = K · Qᵀ   m=128 n=48 k=128, K row-major read in place
//   gemm_qk/bf16/<wide>             the same on bf16 pairs (gemm_bf16, k_pairs=64); avx512bf16
//   gemm_pv/fp32/<wide>             Oᵀ += Vᵀ · Pᵀ m=128 n=48 k=128, V rows broadcast (lda=1,
//                                   a_step=128), Pᵀ rows from Sᵀ, accumulating
//   gemm_pv/split_bf16/<tall>       O += P · V    m=48 n=128 k=128, P read transposed from Sᵀ
//                                   (lda=1, a_step=48), V rows in bf16 read in place (split order)
//   gemm_pv/bf16/<wide>             Oᵀ += Vᵀ · Pᵀ on bf16 pairs of keys (gemm_bf16, k_pairs=64): P
//                                   and V already paired; avx512bf16
//   online_softmax_tile             128 keys × 48 rows of transposed scores
//   attention_tile/fp32             gemm_qk (fp32) + softmax + rescale + gemm_pv (fp32)
//   attention_tile/bf16             gemm_qk (bf16) + softmax with the scale and P's bf16
//                                   pairs (online_softmax_tile_bf16_pairs) + rescale + gemm_pv
//                                   (bf16) on V pairs prepared once per call, the bf16-input
//                                   path; avx512bf16
// Decode: one block of kLanes keys for 4 query rows (scores row-major, keys along the lanes);
// registered where the op takes that path for 4 rows (2·rows <= kLanes: not on generic).
//   decode/dot_key_block/fp32       S = Q · Kᵀ    4 rows × kLanes keys × 128, K in place
//   decode/dot_key_block/bf16       the same on bf16 pairs (k_pairs=64); avx512bf16
//   decode/online_softmax_rows      4 rows × kLanes keys
//   decode/gemm_pv/fp32/<row>       O += P · V    m=4 n=128 k=kLanes, P row-major (lda=kLanes,
//                                   a_step=1), accumulating
//   decode/gemm_pv/split_bf16/<row> the same with V rows in bf16, read in place (split order)
// <wide> is the register tile kWideRows × kWideVecs (bf16 pairs: kDotWideRows × kDotWideVecs),
// <tall> kTallRows × kTallVecs, <row> kRowRows × kRowVecs (split bf16: rounded down to whole
// pairs of vectors), as the op uses them.
// Data: the prefill tile's operands (64 KB of fp32 K, 64 KB of V) stay cache-resident, as a
// tile does in the op while every row of the task uses it. The decode K and V span 64 blocks
// read in rotation (512 KB of fp32 K on AVX-512): out of L1 but L2-resident, so this is not a
// memory-streaming measurement (the op streams K and V from memory, prefetched into L2; the
// Dc row of `python -m attnkit.bench` measures that).
// Counters: FLOPS (useful FLOP/s: 2·m·n·k per gemm, 2·rows·keys·D per dot block), pct_peak
// (of this ISA's fp32 FMA peak on one thread, measured at start-up; vdpbf16ps does twice the
// multiply-adds of an fp32 FMA, so bf16 rows may exceed 100), scores/s for the softmaxes.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <type_traits>

#include "attnkit/dtype.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/dot.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/simd.h"
#include "cpu/kernels/softmax.h"

#define ATTNKIT_BENCH_STR2(x) #x
#define ATTNKIT_BENCH_STR(x) ATTNKIT_BENCH_STR2(x)

namespace attnkit::bench::ATTNKIT_ISA {
namespace {

using namespace attnkit::cpu::ATTNKIT_ISA;
using Clock = std::chrono::steady_clock;

// attention_fwd.cpp: kKvTile keys per tile, kRowTarget rows per task (already a multiple of
// kLanes, so rows_pad = 48), kDecodeKeys = kLanes keys per decode block.
constexpr int64_t kKeys = 128, kRows = 48, kD = 128, kDv = 128, kPairs = kD / 2;
constexpr int64_t kDecodeRows = 4, kDecodeBlocks = 64;  // a power of two (rotation mask)
// Scores of order a few units, roughly what Q·Kᵀ·scale produces: |s| ~ 1.5.
constexpr float kScoreScale = 0.4f;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
using Buffer = std::unique_ptr<T[], FreeDeleter>;

// 64-byte aligned, filled with uniform [-1, 1) values times scale (never zeros).
Buffer<float> random_buffer(int64_t n, uint32_t seed, float scale = 1.0f) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
  Buffer<float> b(static_cast<float*>(std::aligned_alloc(64, bytes)));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) b[i] = dist(gen) * scale;
  return b;
}

// The same rounded to bf16 (as the op's bf16 inputs arrive): n values, read as n / 2 pairs
// by the dot products.
Buffer<uint16_t> random_bf16(int64_t n, uint32_t seed, float scale = 1.0f) {
  const Buffer<float> f = random_buffer(n, seed, scale);
  const size_t bytes = (static_cast<size_t>(n) * sizeof(uint16_t) + 63) / 64 * 64;
  Buffer<uint16_t> b(static_cast<uint16_t*>(std::aligned_alloc(64, bytes)));
  for (int64_t i = 0; i < n; ++i) b[i] = float_to_bfloat16(f[i]);
  return b;
}
// fp32 or bf16 values, as the benchmark's V type asks.
template <class T>
Buffer<T> random_values(int64_t n, uint32_t seed, float scale) {
  if constexpr (std::is_same_v<T, float>) {
    return random_buffer(n, seed, scale);
  } else {
    return random_bf16(n, seed, scale);
  }
}

// Running max and sum of rows that have seen no key yet.
struct SoftmaxState {
  Buffer<float> m, l, alpha;
  explicit SoftmaxState(int64_t rows)
      : m(random_buffer(rows, 100)), l(random_buffer(rows, 101)), alpha(random_buffer(rows, 102)) {
    for (int64_t r = 0; r < rows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  }
};

// Adds FLOPS (rate) and pct_peak (of the measured single-thread fp32 FMA peak).
void report_flops(benchmark::State& state, double flops_per_iter, double seconds,
                  double peak_gflops) {
  const double total = flops_per_iter * static_cast<double>(state.iterations());
  state.counters["FLOPS"] = benchmark::Counter(total, benchmark::Counter::kIsRate);
  if (peak_gflops > 0 && seconds > 0) {
    state.counters["pct_peak"] = 100.0 * total / seconds / (peak_gflops * 1e9);
  }
}
void report_scores(benchmark::State& state, int64_t scores_per_iter) {
  state.counters["scores/s"] = benchmark::Counter(
      static_cast<double>(scores_per_iter) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
}

// Runs body() once per iteration and reports flops_per_iter useful FLOPs each.
template <class Body>
void time_flops(benchmark::State& state, double flops_per_iter, double peak_gflops, Body body) {
  const auto t0 = Clock::now();
  for (auto _ : state) body();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  report_flops(state, flops_per_iter, seconds, peak_gflops);
}

// ---- Prefill: one kv tile of one task ----

// Sᵀ[128][48] = K[128][128] · Qᵀ[128][48], K rows read where they are (lda = D).
void bm_gemm_qk(benchmark::State& state, double peak_gflops) {
  const Buffer<float> k = random_buffer(kKeys * kD, 1), qt = random_buffer(kD * kRows, 2, kScoreScale);
  Buffer<float> st = random_buffer(kKeys * kRows, 3);
  time_flops(state, 2.0 * kKeys * kRows * kD, peak_gflops, [&] {
    gemm<kWideRows, kWideVecs>(kKeys, kRows, kD, k.get(), kD, 1, qt.get(), kRows, st.get(), kRows, false);
    benchmark::DoNotOptimize(st.get());
    benchmark::ClobberMemory();
  });
}

// fp32 V: Oᵀ[128][48] += Vᵀ · Pᵀ, V[128][128] broadcast (lda = 1, a_step = 128), Pᵀ = Sᵀ[128][48]
// (the tile loop's o_transposed). bf16 V in split order: O[48][128] += P · V, P read from
// Sᵀ (lda = 1, a_step = 48). V is scaled so that each call adds O(1e-2) and O stays bounded.
template <class V>
void bm_gemm_pv(benchmark::State& state, double peak_gflops) {
  const Buffer<float> st = random_buffer(kKeys * kRows, 4);
  Buffer<float> o = random_buffer(kRows * kDv, 5);
  const Buffer<V> v = random_values<V>(kKeys * kDv, 6, 1e-3f);
  time_flops(state, 2.0 * kRows * kDv * kKeys, peak_gflops, [&] {
    if constexpr (std::is_same_v<V, float>) {
      gemm<kWideRows, kWideVecs>(kDv, kRows, kKeys, v.get(), 1, kDv, st.get(), kRows, o.get(), kRows, true);
    } else {
      gemm<kTallRows, kTallVecs>(kRows, kDv, kKeys, st.get(), 1, kRows, v.get(), kDv, o.get(), kDv, true);
    }
    benchmark::DoNotOptimize(o.get());
    benchmark::ClobberMemory();
  });
}

void bm_softmax_tile(benchmark::State& state) {
  Buffer<float> st = random_buffer(kKeys * kRows, 7, 4.0f);
  SoftmaxState sm(kRows);
  // Each call overwrites the tile with P in (0, 1]; later calls see those values. The work
  // does not depend on the values (no data-dependent branches, no denormals).
  for (auto _ : state) {
    online_softmax_tile(st.get(), kKeys, kRows, kRows, sm.m.get(), sm.l.get(), sm.alpha.get());
    benchmark::DoNotOptimize(st.get());
    benchmark::DoNotOptimize(sm.alpha.get());
    benchmark::ClobberMemory();
  }
  report_scores(state, kKeys * kRows);
}

// Oᵀ[kDv][rows] *= alpha by columns unless no row's max moved, as the tile loop's rescale_output.
void rescale_columns(float* ot, const float* alpha, int64_t rows) {
  bool moved = false;
  for (int64_t r = 0; r < rows; ++r) moved |= alpha[r] != 1.0f;
  if (!moved) return;
  for (int64_t c = 0; c < rows; c += kLanes) {
    const vfloat a = vload(alpha + c);
    for (int64_t d = 0; d < kDv; ++d) vstore(ot + d * rows + c, vload(ot + d * rows + c) * a);
  }
}

// One kv tile of the fused forward kernel, fp32 inputs: Sᵀ = K · Qᵀ (Q pre-scaled), online
// softmax over the tile, rescale of the output, Oᵀ += Vᵀ · Pᵀ (Pᵀ = Sᵀ, V rows broadcast).
// Sᵀ is recomputed each call, so after the first the running max stays and alpha is 1.
void bm_attention_tile(benchmark::State& state, double peak_gflops) {
  const Buffer<float> k = random_buffer(kKeys * kD, 8), qt = random_buffer(kD * kRows, 9, kScoreScale),
                      v = random_buffer(kKeys * kDv, 10);
  Buffer<float> o = random_buffer(kRows * kDv, 11), st = random_buffer(kKeys * kRows, 12);
  SoftmaxState sm(kRows);
  time_flops(state, 2.0 * kKeys * kRows * (kD + kDv), peak_gflops, [&] {
    gemm<kWideRows, kWideVecs>(kKeys, kRows, kD, k.get(), kD, 1, qt.get(), kRows, st.get(), kRows, false);
    online_softmax_tile(st.get(), kKeys, kRows, kRows, sm.m.get(), sm.l.get(), sm.alpha.get());
    rescale_columns(o.get(), sm.alpha.get(), kRows);
    gemm<kWideRows, kWideVecs>(kDv, kRows, kKeys, v.get(), 1, kDv, st.get(), kRows, o.get(), kRows, true);
    benchmark::DoNotOptimize(o.get());
    benchmark::ClobberMemory();
  });
}

#if defined(ATTNKIT_ISA_avx512bf16)
// bf16 values read as pairs (element 2i low, 2i+1 high).
const uint32_t* as_pairs(const Buffer<uint16_t>& b) { return reinterpret_cast<const uint32_t*>(b.get()); }

// Sᵀ[128][48] = K · Qᵀ on bf16 pairs: K rows [128][64 pairs] in place, Qᵀ as [64 pairs][48].
void bm_gemm_qk_bf16(benchmark::State& state, double peak_gflops) {
  const Buffer<uint16_t> k = random_bf16(kKeys * kD, 13), qt = random_bf16(kD * kRows, 14);
  Buffer<float> st = random_buffer(kKeys * kRows, 15);
  time_flops(state, 2.0 * kKeys * kRows * kD, peak_gflops, [&] {
    gemm_bf16<kDotWideRows, kDotWideVecs>(kKeys, kRows, kPairs, as_pairs(k), kPairs, 1, as_pairs(qt), kRows,
                                          st.get(), kRows, false);
    benchmark::DoNotOptimize(st.get());
    benchmark::ClobberMemory();
  });
}

// Oᵀ[128][48] += Vᵀ · Pᵀ on bf16 pairs of keys: V as [64 pairs][128] broadcast (lda = 1,
// a_step = 128), Pᵀ as [64 pairs][48], values as in bm_gemm_pv.
void bm_gemm_pv_bf16(benchmark::State& state, double peak_gflops) {
  const Buffer<uint16_t> pt = random_bf16(kKeys * kRows, 31), v = random_bf16(kKeys * kDv, 32, 1e-3f);
  Buffer<float> o = random_buffer(kRows * kDv, 33);
  time_flops(state, 2.0 * kRows * kDv * kKeys, peak_gflops, [&] {
    gemm_bf16<kDotWideRows, kDotWideVecs>(kDv, kRows, kKeys / 2, as_pairs(v), 1, kDv, as_pairs(pt), kRows, o.get(),
                                          kRows, true);
    benchmark::DoNotOptimize(o.get());
    benchmark::ClobberMemory();
  });
}

// One kv tile of the bf16-input path on this ISA (qk_bf16, pv_bf16): Sᵀ = K · Qᵀ on pairs,
// the softmax scaling Sᵀ and pairing P in place, rescale, Oᵀ += Vᵀ · Pᵀ on pairs (V's key
// pairs are prepared once per call, outside the tile).
void bm_attention_tile_bf16(benchmark::State& state, double peak_gflops) {
  const Buffer<uint16_t> k = random_bf16(kKeys * kD, 16), qt = random_bf16(kD * kRows, 17),
                         v = random_bf16(kKeys * kDv, 18);
  Buffer<float> o = random_buffer(kRows * kDv, 19), st = random_buffer(kKeys * kRows, 20);
  const Buffer<float> v_pairs = random_buffer(kKeys / 2 * kDv, 21);  // as uint32_t pairs
  uint32_t* vp = reinterpret_cast<uint32_t*>(v_pairs.get());
  for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
    const uint16_t* a = v.get() + 2 * jp * kDv;
    interleave_bf16_rows(a, a + kDv, 1, kDv, kDv, vp + jp * kDv);
  }
  SoftmaxState sm(kRows);
  uint32_t* pp = reinterpret_cast<uint32_t*>(st.get());
  time_flops(state, 2.0 * kKeys * kRows * (kD + kDv), peak_gflops, [&] {
    gemm_bf16<kDotWideRows, kDotWideVecs>(kKeys, kRows, kPairs, as_pairs(k), kPairs, 1, as_pairs(qt), kRows,
                                          st.get(), kRows, false);
    online_softmax_tile_bf16_pairs(st.get(), kKeys, kRows, kRows, kScoreScale, sm.m.get(), sm.l.get(),
                                   sm.alpha.get());
    rescale_columns(o.get(), sm.alpha.get(), kRows);
    gemm_bf16<kDotWideRows, kDotWideVecs>(kDv, kRows, kKeys / 2, vp, 1, kDv, pp, kRows, o.get(), kRows, true);
    benchmark::DoNotOptimize(o.get());
    benchmark::ClobberMemory();
  });
}
#endif

// ---- Decode: one block of kLanes keys for 4 rows; K and V rotate through 64 blocks ----

constexpr int64_t kDecodeKeys = kLanes;

// Query rows per vector in the decode key block, and the chunks of a 128-element row (bf16:
// of its 64 pairs), as attention_fwd.cpp's plan picks them.
const int kDecodeGroup = rows_per_vector(kDecodeRows, kD), kDecodePairGroup = rows_per_vector(kDecodeRows, kPairs);
const int64_t kDecodeChunks = kD / (kLanes / kDecodeGroup), kDecodePairChunks = kPairs / (kLanes / kDecodePairGroup);

// s[4][kLanes] = Q[4][128] · Kᵀ, K rows in place (ldk = D) as the next block each call.
void bm_dot_key_block(benchmark::State& state, double peak_gflops) {
  const Buffer<float> k = random_buffer(kDecodeBlocks * kDecodeKeys * kD, 21),
                      q = random_buffer(kDecodeRows * kD, 22, kScoreScale);
  Buffer<float> qg = random_buffer(kDecodeRows * kD + kLanes * kD, 22);
  group_rows(kDecodeGroup, kDecodeRows, kD, q.get(), kD, kDecodeChunks, qg.get());
  Buffer<float> s = random_buffer(kDecodeRows * kDecodeKeys, 23);
  int64_t block = 0;
  time_flops(state, 2.0 * kDecodeRows * kDecodeKeys * kD, peak_gflops, [&] {
    dot_key_block(kDecodeGroup, kDecodeRows, kDecodeChunks, k.get() + block * kDecodeKeys * kD, kD, qg.get(), s.get(),
                  kDecodeKeys);
    block = (block + 1) & (kDecodeBlocks - 1);
    benchmark::DoNotOptimize(s.get());
    benchmark::ClobberMemory();
  });
}

#if defined(ATTNKIT_ISA_avx512bf16)
// The same on bf16 pairs: K rows [64 pairs] in place (pairs_pad = 64), Q rows as pairs.
void bm_dot_key_block_bf16(benchmark::State& state, double peak_gflops) {
  const Buffer<uint16_t> k = random_bf16(kDecodeBlocks * kDecodeKeys * kD, 24),
                         q = random_bf16(kDecodeRows * kD, 25);
  Buffer<uint16_t> qg = random_bf16(2 * (kDecodeRows * kPairs + kLanes * kPairs), 25);
  group_rows(kDecodePairGroup, kDecodeRows, kPairs, as_pairs(q), kPairs, kDecodePairChunks, reinterpret_cast<uint32_t*>(qg.get()));
  Buffer<float> s = random_buffer(kDecodeRows * kDecodeKeys, 26);
  int64_t block = 0;
  time_flops(state, 2.0 * kDecodeRows * kDecodeKeys * kD, peak_gflops, [&] {
    dot_key_block_bf16(kDecodePairGroup, kDecodeRows, kDecodePairChunks, as_pairs(k) + block * kDecodeKeys * kPairs, kPairs,
                       as_pairs(qg), s.get(), kDecodeKeys);
    block = (block + 1) & (kDecodeBlocks - 1);
    benchmark::DoNotOptimize(s.get());
    benchmark::ClobberMemory();
  });
}
#endif

void bm_softmax_rows(benchmark::State& state) {
  Buffer<float> s = random_buffer(kDecodeRows * kDecodeKeys, 27, 4.0f);
  SoftmaxState sm(kDecodeRows);
  // Each call overwrites the block with P in (0, 1], below the running max set by the first
  // call, so the steady state is the common decode case: no key beats the running max
  // (no horizontal max, alpha = 1).
  for (auto _ : state) {
    online_softmax_rows(s.get(), kDecodeKeys, kDecodeKeys, kDecodeRows, sm.m.get(), sm.l.get(), sm.alpha.get());
    benchmark::DoNotOptimize(s.get());
    benchmark::DoNotOptimize(sm.alpha.get());
    benchmark::ClobberMemory();
  }
  report_scores(state, kDecodeRows * kDecodeKeys);
}

// O[4][128] += P[4][kLanes] · V[kLanes][128], P row-major (lda = kLanes, a_step = 1), V the
// next block each call, fp32 or bf16 in split order, scaled as in bm_gemm_pv.
template <class V>
void bm_decode_pv(benchmark::State& state, double peak_gflops) {
  const Buffer<float> p = random_buffer(kDecodeRows * kDecodeKeys, 28);
  Buffer<float> o = random_buffer(kDecodeRows * kDv, 29);
  const Buffer<V> v = random_values<V>(kDecodeBlocks * kDecodeKeys * kDv, 30, 1e-3f);
  int64_t block = 0;
  time_flops(state, 2.0 * kDecodeRows * kDv * kDecodeKeys, peak_gflops, [&] {
    gemm<kRowRows, kRowVecs>(kDecodeRows, kDv, kDecodeKeys, p.get(), kDecodeKeys, 1,
                               v.get() + block * kDecodeKeys * kDv, kDv, o.get(), kDv, true);
    block = (block + 1) & (kDecodeBlocks - 1);
    benchmark::DoNotOptimize(o.get());
    benchmark::ClobberMemory();
  });
}

}  // namespace

// Registers this ISA's benchmarks as "<isa>/<name>"; peak_gflops is this ISA's measured
// single-thread fp32 FMA peak (0 if unknown).
void register_benchmarks(double peak_gflops) {
  const std::string isa = ATTNKIT_BENCH_STR(ATTNKIT_ISA);
  auto tile = [](const char* kind, int rows, int vecs) {
    return std::string(kind) + std::to_string(rows) + "x" + std::to_string(vecs);
  };
  const std::string wide = tile("wide", kWideRows, kWideVecs), tall = tile("tall", kTallRows, kTallVecs),
                    tall_split = tile("tall", kTallRows, kTallVecs / 2 * 2), row = tile("row", kRowRows, kRowVecs),
                    row_split = tile("row", kRowRows, kRowVecs / 2 * 2);
  const std::string lanes = std::to_string(kLanes);
  auto add = [&](const std::string& name, auto fn, auto... args) {
    benchmark::RegisterBenchmark((isa + "/" + name).c_str(), fn, args...);
  };
  add("gemm_qk/fp32/" + wide + "/m128_n48_k128", bm_gemm_qk, peak_gflops);
#if defined(ATTNKIT_ISA_avx512bf16)
  add("gemm_qk/bf16/" + tile("wide", kDotWideRows, kDotWideVecs) + "/m128_n48_kpairs64", bm_gemm_qk_bf16,
      peak_gflops);
#endif
  add("gemm_pv/fp32/" + wide + "/m128_n48_k128", bm_gemm_pv<float>, peak_gflops);
  add("gemm_pv/split_bf16/" + tall_split + "/m48_n128_k128", bm_gemm_pv<uint16_t>, peak_gflops);
#if defined(ATTNKIT_ISA_avx512bf16)
  add("gemm_pv/bf16/" + tile("wide", kDotWideRows, kDotWideVecs) + "/m128_n48_kpairs64", bm_gemm_pv_bf16,
      peak_gflops);
#endif
  add("online_softmax_tile/keys128_rows48", bm_softmax_tile);
  add("attention_tile/fp32/keys128_rows48_d128", bm_attention_tile, peak_gflops);
#if defined(ATTNKIT_ISA_avx512bf16)
  add("attention_tile/bf16/keys128_rows48_d128", bm_attention_tile_bf16, peak_gflops);
#endif
  // The op's decode path (attend_rows) needs 2·rows <= kLanes; with fewer lanes 4 rows go
  // through the tile loop above.
  if (2 * kDecodeRows <= kLanes) {
    add("decode/dot_key_block/fp32/rows4_keys" + lanes + "_d128", bm_dot_key_block, peak_gflops);
#if defined(ATTNKIT_ISA_avx512bf16)
    add("decode/dot_key_block/bf16/rows4_keys" + lanes + "_kpairs64", bm_dot_key_block_bf16, peak_gflops);
#endif
    add("decode/online_softmax_rows/rows4_keys" + lanes, bm_softmax_rows);
    add("decode/gemm_pv/fp32/" + row + "/m4_n128_k" + lanes, bm_decode_pv<float>, peak_gflops);
    add("decode/gemm_pv/split_bf16/" + row_split + "/m4_n128_k" + lanes, bm_decode_pv<uint16_t>, peak_gflops);
  }
}

}  // namespace attnkit::bench::ATTNKIT_ISA
