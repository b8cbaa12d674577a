// Sparse MLA prefill on the CPU: the shared tile loop (sparse_mla_tile.h) over flat kv rows
// [s_kv, d_qk] of q's dtype, each query row's slots taken from its indices. As in FlashMLA's
// prefill, P·V runs in bf16 where vdpbf16ps exists (P rounded to bf16). Compiled per ISA.
#include <cstdint>

#include "attnkit/dtype.h"
#include "cpu/kernels.h"
#include "cpu/sparse_mla_tile.h"
#include "ops/sparse_mla_params.h"

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {

using sparse_tile::kBf16Dot;

template <DType T>
struct FlatRows {
  using E = typename Elem<T>::type;
  using Slot = int32_t;
  const SparseMlaParams& p;
  int64_t capacity = p.topk;
  const Fp8ToBf16<DType::float8_e4m3fn> to_bf16{};  // built once per call (the fp8 rows')

  const E* row(int32_t slot) const { return static_cast<const E*>(p.kv) + int64_t{slot} * p.kv_stride[0]; }
  // The bytes read ahead per row: its own where its columns are contiguous, else none (a
  // strided row's span is mostly other rows' bytes: a column stride of s_kv made it s_kv
  // times the row, read line by line per gathered row).
  int64_t row_bytes() const { return p.kv_stride[1] == 1 ? int64_t{sizeof(E)} * p.d_qk : 0; }

  const void* q_row(int64_t s) const { return static_cast<const E*>(p.q) + s * p.q_stride[0]; }

  // The row's valid slots in order: 0 <= idx < s_kv and t < topk_length[s]. Listing them
  // makes -1 tails and topk_length identical, and keeps every gathered tile full.
  int64_t list(int64_t s, int32_t* slots) const {
    int64_t limit = p.topk;
    if (p.topk_length) {
      const int64_t len = p.topk_length[s * p.topk_length_stride];
      limit = len < 0 ? 0 : (len < limit ? len : limit);
    }
    const int32_t* idx = p.indices + s * p.indices_stride[0];
    int64_t n = 0;
    for (int64_t t = 0; t < limit; ++t) {
      const int32_t i = idx[t * p.indices_stride[1]];
      if (i >= 0 && i < p.s_kv) slots[n++] = i;
    }
    return n;
  }

  uint32_t touch(int32_t slot) const { return touch_lines(row(slot), row_bytes()); }
  void prefetch(int32_t slot, Cache level) const { prefetch_bytes(row(slot), 0, row_bytes(), level); }

  // fp32 rows (dst) without kBf16Dot, else bf16 rows only (bf16 copied, fp8 converted exactly).
  void load(int32_t slot, float* dst, uint16_t* bf16) const {
    const E* src = row(slot);
    if constexpr (!kBf16Dot) {
      load_row<T>(src, p.kv_stride[1], p.d_qk, 1.0f, dst);
    } else if constexpr (T == DType::bfloat16) {
      sparse_tile::copy_bf16_row(src, p.kv_stride[1], p.d_qk, bf16);
    } else {
      to_bf16.row(src, p.kv_stride[1], p.d_qk, bf16);
    }
  }
};

template <DType T>
void run_flat(const SparseMlaParams& p) {
  sparse_tile::run<T>(p, FlatRows<T>{p});
}

}  // namespace

void sparse_mla_fwd(const SparseMlaParams& p) {
  if (p.dtype == DType::bfloat16) return run_flat<DType::bfloat16>(p);
  run_flat<DType::float8_e4m3fn>(p);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
