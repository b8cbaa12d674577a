// Dense, varlen, paged and sage int8 attention forward on the CPU: the entry points.
// They plan the call (attention/plan.h) and run its tasks (attention/task.h) on the thread
// pool: the tile loop (attention/tile_loop.h) for row blocks of many rows, key blocks
// (attention/decode.h) for few, with bf16 pairs (attention/bf16_pairs.h) or int8 codes
// (attention/sage_int8.h) for Q·Kᵀ where they apply; masks, modifiers and dropout
// (attention/scores.h), kv splits and the epilogue are shared. Scores never exceed one
// tile. Compiled once per ISA.
#include "core/thread_pool.h"
#include "cpu/attention/bf16_pairs.h"
#include "cpu/attention/decode.h"
#include "cpu/attention/sage_int8.h"
#include "cpu/attention/scores.h"
#include "cpu/attention/task.h"
#include "cpu/attention/tile_loop.h"
#include "cpu/kernel_table.h"
#include "cpu/kernels.h"

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

using fwd::AttentionTask;
using fwd::kDotProducts;
using fwd::kKvTile;
using fwd::Plan;
using fwd::prepare_sage;
using fwd::QuantizedKeys;

// plan: Plan(p, false) for exact attention; sage's, whose pre-pass lays V out for it, with kq.
template <DType T, DType TK = T>
void run_attention(const AttentionParams& p, const Plan& plan, const QuantizedKeys* kq = nullptr) {
  const int threads = detail::num_threads();
  AlignedBuffer<float> workspace(plan.workspace_floats * threads);
  AlignedBuffer<float> partial(plan.partial_floats * plan.slots);
  AlignedBuffer<uint32_t> v_pairs(plan.v_pairs ? p.B * p.Hkv * plan.v_pairs_per_head * plan.dv_pad : 0);
  if constexpr (T == DType::bfloat16 && TK == T) {
    if (plan.v_pairs) fwd::prepare_v_pairs<T>(p, plan, v_pairs.data);
  }
  const AttentionTask<T, TK> task(p, plan, kq, v_pairs.data);
  auto attend = [&](int64_t t, int thread) {
    task.run(t, workspace.data + plan.workspace_floats * thread, partial.data);
  };
  detail::parallel_for(plan.tasks, threads, attend);
  if (plan.slots > 0) {
    auto merge = [&](int64_t rb, int thread) {
      task.merge(rb, workspace.data + plan.workspace_floats * thread, partial.data);
    };
    detail::parallel_for(plan.row_blocks, threads, merge);
  }
}

// Queries of dtype T over K and V of T, or of a float8 paged cache.
template <DType T>
void run_attention_kv(const AttentionParams& p) {
  const Plan plan(p, false);
  switch (p.kv_dtype) {
    case DType::float8_e4m3fn:
      return run_attention<T, DType::float8_e4m3fn>(p, plan);
    case DType::float8_e5m2:
      return run_attention<T, DType::float8_e5m2>(p, plan);
    default:
      return run_attention<T>(p, plan);
  }
}

}  // namespace

// Dense, varlen and paged attention: the params say where each sequence's rows lie.
void attention_fwd(const AttentionParams& p) {
  switch (p.dtype) {
    case DType::float16:
      return run_attention_kv<DType::float16>(p);
    case DType::bfloat16:
      return run_attention_kv<DType::bfloat16>(p);
    default:
      return run_attention_kv<DType::float32>(p);
  }
}

bool attention_decodes(const AttentionParams& p) { return Plan(p, false).decodes_only(); }

namespace {

// pv_int8: mode int8_pv_int8 (V as s8 codes for P·V), else V as bf16 pairs where they apply.
template <DType T>
void run_sage_int8(const AttentionParams& p, bool pv_int8) {
  const int64_t quads = (p.D + 3) / 4, tiles = (p.Skv + kKvTile - 1) / kKvTile;
  const int64_t dv_pad = round_up(p.Dv, kLanes), heads = p.B * p.Hkv;
  AlignedBuffer<uint8_t> codes(heads * p.Skv * 4 * quads);
  AlignedBuffer<float> scale(heads * p.Skv), mean(heads * p.D);
  const Plan plan(p, true, pv_int8);  // V's pairs are laid out as its tile loop reads them
  AlignedBuffer<uint32_t> v_pairs(kDotProducts && !pv_int8 ? heads * plan.v_pairs_per_head * dv_pad : 0);
  AlignedBuffer<uint8_t> nonfinite(heads * p.Skv), tile_nonfinite(heads * tiles);
  prepare_sage<T>(p, codes.data, scale.data, mean.data, pv_int8 ? nullptr : v_pairs.data, plan.v_slabs,
                  nonfinite.data, tile_nonfinite.data, quads, tiles, dv_pad);
  const int64_t v_code_words = heads * ((p.Skv + 3) / 4) * dv_pad;
#if defined(ATTNKIT_ISA_avx512amx)
  const int64_t v_pad_words = kAmxTile * dv_pad;  // P·V reads whole tiles of quads: zero ones past the last head's
#else
  const int64_t v_pad_words = 0;
#endif
  AlignedBuffer<uint32_t> v_codes(pv_int8 ? v_code_words + v_pad_words : 0);
  if (pv_int8) std::memset(v_codes.data + v_code_words, 0, sizeof(uint32_t) * v_pad_words);
  AlignedBuffer<float> v_scale(pv_int8 ? heads * tiles * dv_pad : 0), v_mean(pv_int8 ? heads * dv_pad : 0);
  AlignedBuffer<uint8_t> v_exact(pv_int8 ? heads * p.Skv : 0), v_tile_exact(pv_int8 ? heads * tiles : 0);
  if (pv_int8) {
    fwd::prepare_sage_values<T>(p, v_codes.data, v_scale.data, v_mean.data, v_exact.data,
                                v_tile_exact.data, tiles, dv_pad);
  }
  const QuantizedKeys kq{codes.data,        scale.data,          mean.data,   v_pairs.data,
                         nonfinite.data,    tile_nonfinite.data, quads,       tiles,
                         pv_int8 ? v_codes.data : nullptr,       v_scale.data, v_mean.data,
                         v_exact.data,  v_tile_exact.data};
  run_attention<T>(p, plan, &kq);
}

}  // namespace

void sage_int8_fwd(const AttentionParams& p, bool pv_int8) {
  switch (p.dtype) {
    case DType::float16:
      return run_sage_int8<DType::float16>(p, pv_int8);
    case DType::bfloat16:
      return run_sage_int8<DType::bfloat16>(p, pv_int8);
    default:
      return run_sage_int8<DType::float32>(p, pv_int8);
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
