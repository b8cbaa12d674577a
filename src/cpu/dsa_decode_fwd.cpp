// MLA decode on the CPU over a paged cache, sparse (FlashMLA's indices) or dense (a block
// table): new row sources for the shared sparse MLA tile loop (sparse_mla_tile.h). A row is
// either a 656-byte V3.2 fp8 token (dequantised to bf16 as FlashMLA does: fp8 · tile scale,
// rounded to bf16, exact for power-of-two scales) or a bf16 row. As in FlashMLA, P·V runs in
// bf16 too where vdpbf16ps exists (P rounded to bf16). Also the V3.2 quantiser.
// Compiled per ISA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attnkit/dtype.h"
#include "cpu/kernels.h"
#include "cpu/sparse_mla_tile.h"
#include "ops/dsa_params.h"

namespace attnkit::cpu::ATTNKIT_ISA {
namespace {


// Slots are element offsets of a row in the cache (bytes for fp8, bf16 elements else).
class PagedRows {
 public:
  using Slot = int64_t;
  explicit PagedRows(const MlaDecodeParams& p) : p_(p), capacity(p.max_rows) {}

  const void* q_row(int64_t s) const {
    return static_cast<const uint16_t*>(p_.tile.q) + s / p_.s_q * p_.q_batch_stride + s % p_.s_q * p_.q_seq_stride;
  }

  int64_t list(int64_t s, int64_t* slots) const {
    const int64_t b = s / p_.s_q, i = s % p_.s_q;
    int64_t n = 0;
    if (p_.indices) {
      int64_t limit = p_.topk;
      if (p_.topk_length) limit = std::clamp<int64_t>(p_.topk_length[b * p_.topk_length_stride], 0, limit);
      const int32_t* idx = p_.indices + b * p_.indices_stride[0] + i * p_.indices_stride[1];
      const int64_t slots_in_cache = p_.num_blocks * p_.page_block_size;
      for (int64_t t = 0; t < limit; ++t) {
        const int64_t slot = idx[t * p_.indices_stride[2]];
        if (slot >= 0 && slot < slots_in_cache) slots[n++] = offset(slot / p_.page_block_size, slot % p_.page_block_size);
      }
      return n;
    }
    int64_t len = p_.cache_seqlens[b * p_.cache_seqlens_stride];
    if (p_.causal) len = std::max<int64_t>(0, len - p_.s_q + i + 1);
    const int32_t* table = p_.block_table + b * p_.block_table_stride[0];
    for (int64_t t = 0; t < len; ++t) {
      slots[n++] = offset(table[t / p_.page_block_size * p_.block_table_stride[1]], t % p_.page_block_size);
    }
    return n;
  }

  void load(int64_t slot, float* dst, uint16_t* bf16) const {
    if (p_.v32_fp8) return load_v32(static_cast<const uint8_t*>(p_.cache) + slot, dst, bf16);
    const uint16_t* src = static_cast<const uint16_t*>(p_.cache) + slot;
    if (dst) load_row<DType::bfloat16>(src, p_.dim_stride, p_.tile.d_qk, 1.0f, dst);
    if (bf16) sparse_tile::copy_bf16_row(src, p_.dim_stride, p_.tile.d_qk, bf16);
  }

  uint32_t touch(int64_t slot) const { return touch_lines(token(slot), token_bytes()); }
  void prefetch(int64_t slot, Cache level) const { prefetch_bytes(token(slot), 0, token_bytes(), level); }

  const MlaDecodeParams& p_;
  int64_t capacity;

 private:
  // A token's bytes in the cache (slot: its offset in the cache's elements, bytes or bf16).
  const void* token(int64_t slot) const {
    if (p_.v32_fp8) return static_cast<const uint8_t*>(p_.cache) + slot;
    return static_cast<const uint16_t*>(p_.cache) + slot;
  }
  // The bytes read ahead per token: none where a bf16 cache's columns are strided (as FlatRows).
  int64_t token_bytes() const {
    if (p_.v32_fp8) return kV32TokenBytes;
    return p_.dim_stride == 1 ? 2 * p_.tile.d_qk : 0;
  }

  int64_t offset(int64_t block, int64_t in_block) const { return block * p_.block_stride + in_block * p_.token_stride; }

  // 512 fp8 values times their tile's scale, rounded to bf16, then the 64 bf16 rope values.
  // bf16 only (the bf16 P·V path) with a power-of-two scale (FlashMLA's quantiser writes
  // those): the table conversion with the scale added to the exponents, exact.
  void load_v32(const uint8_t* token, float* dst, uint16_t* bf16) const {
    float scales[kV32Tiles];
    std::memcpy(scales, token + kV32Nope, sizeof scales);
    for (int64_t tile = 0; tile < kV32Tiles; ++tile) {
      int exponent;
      if (!dst && power_of_two(scales[tile], &exponent)) {
        to_bf16_.row(token + tile * kV32Tile, 1, kV32Tile, bf16 + tile * kV32Tile, exponent);
        continue;
      }
      const vfloat scale = vbroadcast(scales[tile]);
      for (int64_t i = tile * kV32Tile; i < (tile + 1) * kV32Tile; i += kLanes) {
        const vuint bits = round_to_bf16_bits(vload_as_float<DType::float8_e4m3fn>(token + i) * scale, kBf16QuietNan);
        if (dst) vstore(dst + i, (vfloat)(bits << 16));
        if (bf16) {
          const vhalf h = __builtin_convertvector(bits, vhalf);
          std::memcpy(bf16 + i, &h, sizeof h);
        }
      }
    }
    const uint8_t* rope = token + kV32Nope + kV32Tiles * 4;
    uint16_t rope_bits[kV32Rope];
    std::memcpy(rope_bits, rope, sizeof rope_bits);  // 2-byte aligned only by the caller's layout
    if (dst) load_row<DType::bfloat16>(rope_bits, 1, kV32Rope, 1.0f, dst + kV32Nope);
    if (bf16) std::memcpy(bf16 + kV32Nope, rope_bits, sizeof rope_bits);
  }

  // x = 2^exponent with |exponent| <= Fp8ToBf16::kMaxExponent.
  static bool power_of_two(float x, int* exponent) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    *exponent = static_cast<int>(bits >> 23) - 127;
    return (bits & 0x807FFFFFu) == 0 && std::abs(*exponent) <= Fp8ToBf16<DType::float8_e4m3fn>::kMaxExponent;
  }

  const Fp8ToBf16<DType::float8_e4m3fn> to_bf16_;
};

}  // namespace

void mla_decode_fwd(const MlaDecodeParams& p) { sparse_tile::run<DType::bfloat16>(p.tile, PagedRows(p)); }

// FlashMLA's tests/quant.py: per 128-value tile, scale = 2^ceil(log2(max(amax / 448, 1e-4))),
// value = e4m3(x / scale) (round to nearest even); rope values rounded to bf16.
void v32_quantize(const V32QuantizeParams& p) {
  auto value = [&](int64_t row, int64_t d) {
    const int64_t at = row * p.src_row_stride + d * p.src_col_stride;
    return p.src_bf16 ? bfloat16_to_float(static_cast<const uint16_t*>(p.src)[at]) : static_cast<const float*>(p.src)[at];
  };
  for (int64_t row = 0; row < p.n; ++row) {
    uint8_t* token = p.dst + row * p.dst_token_stride;
    for (int64_t tile = 0; tile < kV32Tiles; ++tile) {
      float amax = 0.0f;
      for (int64_t d = tile * kV32Tile; d < (tile + 1) * kV32Tile; ++d) amax = std::max(amax, std::fabs(value(row, d)));
      const float scale = std::exp2(std::ceil(std::log2(std::max(amax / 448.0f, 1e-4f))));
      for (int64_t d = tile * kV32Tile; d < (tile + 1) * kV32Tile; ++d) token[d] = float_to_float8_e4m3fn(value(row, d) / scale);
      std::memcpy(token + kV32Nope + tile * 4, &scale, 4);
    }
    for (int64_t d = 0; d < kV32Rope; ++d) {
      const uint16_t bits = float_to_bfloat16(value(row, kV32Nope + d));
      std::memcpy(token + kV32Nope + kV32Tiles * 4 + 2 * d, &bits, 2);
    }
  }
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
