// The AMX micro-kernel of avx512amx: C (+)= A · B on tiles, the reduction axis packed in
// 32-bit elements as for gemm_dot.h's instructions: bf16 pairs (tdpbf16ps: a 16 × 16 fp32
// tile adds, per output, 16 pair products; products exact and sums in fp32, as vdpbf16ps)
// or u8 × s8 quads (tdpbusd: int32 sums, exact, as vpdpbusd). On the Xeon with AMX seen
// here tdpbf16ps runs about 15 times the fp32 FMA rate, so next to it the softmax's vector
// work is what costs.
// gemm_amx's shapes are whole tiles: M and N multiples of 16, K a multiple of 16 pairs
// (callers pad); decode's kernels (below) size their tiles to its few rows. Only the
// avx512amx variant compiles it.
#pragma once

#if defined(ATTNKIT_ISA_avx512amx)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/kernels/tiling.h"

namespace attnkit::cpu::ATTNKIT_ISA {

inline constexpr int64_t kAmxTile = 16;  // rows of every tile, and fp32 columns or pairs per row

// ldtilecfg reads the 64-byte configuration through a pointer GCC 12 does not see read: where
// amx_configure was inlined into a new caller it dropped the zeroing of the unused (reserved)
// bytes as dead stores, and ldtilecfg faulted on what was left there. The barrier makes every
// store of the configuration land first.
inline void load_tile_config(const uint8_t* config) {
  asm volatile("" : : "r"(config) : "memory");
  _tile_loadconfig(config);
}

// All eight tiles as 16 rows × 64 bytes. The configuration is per thread and other code on
// the thread (another library's AMX kernels) may change it, so every driver that uses the
// tiles loads it before its first tile instruction.
inline void amx_configure() {
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    config[16 + 2 * t] = 64;  // bytes per row (little-endian uint16)
    config[48 + t] = 16;      // rows
  }
  load_tile_config(config);
}

// tdpbf16ps into fp32 outputs, tdpbusd into int32 ones (the intrinsics take tile numbers
// as literals).
#define ATTNKIT_AMX_DP(c, a, b) \
  {                             \
    if constexpr (kInt8) {      \
      _tile_dpbusd(c, a, b);    \
    } else {                    \
      _tile_dpbf16ps(c, a, b);  \
    }                           \
  }

// One block of up to 2 × 2 output tiles over the reduction's elements [p_begin, p_end) (whole
// tiles): tiles 0-3 accumulate, 4-5 hold A, 6-7 B.
template <class Out, bool kTwoRows, bool kTwoCols>
void amx_block(int64_t p_begin, int64_t p_end, const uint32_t* a, int64_t lda, int64_t a_kstep, const uint32_t* b,
               int64_t ldb, Out* c, int64_t ldc, bool accumulate) {
  constexpr bool kInt8 = std::is_same_v<Out, int32_t>;
  const int64_t sa = lda * 4, sb = ldb * 4, sc = ldc * 4;  // strides in bytes
  Out* c1 = c + kAmxTile * ldc;
  if (accumulate) {
    _tile_loadd(0, c, sc);
    if constexpr (kTwoCols) _tile_loadd(1, c + kAmxTile, sc);
    if constexpr (kTwoRows) _tile_loadd(2, c1, sc);
    if constexpr (kTwoRows && kTwoCols) _tile_loadd(3, c1 + kAmxTile, sc);
  } else {
    _tile_zero(0);
    if constexpr (kTwoCols) _tile_zero(1);
    if constexpr (kTwoRows) _tile_zero(2);
    if constexpr (kTwoRows && kTwoCols) _tile_zero(3);
  }
  for (int64_t p = p_begin; p < p_end; p += kAmxTile) {
    const uint32_t* ap = a + p / kAmxTile * a_kstep;
    _tile_loadd(4, ap, sa);
    _tile_loadd(6, b + p * ldb, sb);
    if constexpr (kTwoCols) _tile_loadd(7, b + p * ldb + kAmxTile, sb);
    ATTNKIT_AMX_DP(0, 4, 6)
    if constexpr (kTwoCols) ATTNKIT_AMX_DP(1, 4, 7)
    if constexpr (kTwoRows) {
      _tile_loadd(5, ap + kAmxTile * lda, sa);
      ATTNKIT_AMX_DP(2, 5, 6)
      if constexpr (kTwoCols) ATTNKIT_AMX_DP(3, 5, 7)
    }
  }
  _tile_stored(0, c, sc);
  if constexpr (kTwoCols) _tile_stored(1, c + kAmxTile, sc);
  if constexpr (kTwoRows) _tile_stored(2, c1, sc);
  if constexpr (kTwoRows && kTwoCols) _tile_stored(3, c1 + kAmxTile, sc);
}

#undef ATTNKIT_AMX_DP

// c[m][n] (+)= Σ_p a[i][p] ⊙ b[p][n] on packed elements (Out float: bf16 pairs; int32_t: u8
// quads of A with s8 quads of B): A's element (i, p) at a + i * lda + p / 16 * a_kstep + p % 16
// (a_kstep 16: row-major; larger: A in slabs of 16 elements per row, one tile's depth), B
// [k][n] (row p at b + p * ldb), C row-major; strides in elements. m, n multiples of 16, k of
// 16 elements; amx_configure() must have run on this thread. Each block of output tiles sums
// only over the whole tiles of depth its rows' band (A's rows outside it are zero) and its
// columns' band (B's columns likewise) leave: a causal triangle's zero tiles are skipped.
template <class Out, class RowBand = NoBand, class ColBand = NoBand>
void gemm_amx(int64_t m, int64_t n, int64_t k, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
              Out* c, int64_t ldc, bool accumulate, int64_t a_kstep = kAmxTile, RowBand row_band = {},
              ColBand col_band = {}) {
  for (int64_t i = 0; i < m; i += 2 * kAmxTile) {
    const bool two_rows = i + kAmxTile < m;
    const auto [r0, r1] = tile_range(row_band, i, std::min(2 * kAmxTile, m - i), k);
    for (int64_t j = 0; j < n; j += 2 * kAmxTile) {
      const bool two_cols = j + kAmxTile < n;
      const auto [c0, c1] = tile_range(col_band, j, std::min(2 * kAmxTile, n - j), k);
      const int64_t p0 = std::max(r0, c0) / kAmxTile * kAmxTile;
      const int64_t p1 = std::max(p0, std::min(r1, c1) + kAmxTile - 1) / kAmxTile * kAmxTile;
      const uint32_t* ai = a + i * lda;
      const uint32_t* bj = b + j;
      Out* cij = c + i * ldc + j;
      if (two_rows && two_cols) {
        amx_block<Out, true, true>(p0, p1, ai, lda, a_kstep, bj, ldb, cij, ldc, accumulate);
      } else if (two_rows) {
        amx_block<Out, true, false>(p0, p1, ai, lda, a_kstep, bj, ldb, cij, ldc, accumulate);
      } else if (two_cols) {
        amx_block<Out, false, true>(p0, p1, ai, lda, a_kstep, bj, ldb, cij, ldc, accumulate);
      } else {
        amx_block<Out, false, false>(p0, p1, ai, lda, a_kstep, bj, ldb, cij, ldc, accumulate);
      }
    }
  }
}
template <class RowBand = NoBand, class ColBand = NoBand>
void gemm_amx_bf16(int64_t m, int64_t n, int64_t k, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                   float* c, int64_t ldc, bool accumulate, int64_t a_kstep = kAmxTile, RowBand row_band = {},
                   ColBand col_band = {}) {
  gemm_amx<float>(m, n, k, a, lda, b, ldb, c, ldc, accumulate, a_kstep, row_band, col_band);
}
inline void gemm_amx_u8s8(int64_t m, int64_t n, int64_t k, const uint32_t* a, int64_t lda, const uint32_t* b,
                          int64_t ldb, int32_t* c, int64_t ldc, bool accumulate) {
  gemm_amx<int32_t>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

// Decode's tiles (a row block of `rows` <= 16 query rows over key blocks of 16 keys, both
// products on tiles; attention's decode.h): 0 Sᵀ (16 keys × rows), 1 K (16 keys × 16 pairs),
// 2 Qᵀ (16 pairs × rows), 3 and 7 P (rows × 16 keys, as pairs (p, 0) and (0, p)), 4 (and 1)
// V (16 keys × 32 columns), 5 and 6 O (rows × 16 columns). Sized to the rows, so decode's
// few rows cost no padding.
inline void amx_configure_decode(int64_t rows) {
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;  // palette 1
  auto tile = [&](int t, int64_t tile_rows, int64_t bytes) {
    config[16 + 2 * t] = static_cast<uint8_t>(bytes);
    config[48 + t] = static_cast<uint8_t>(tile_rows);
  };
  tile(0, kAmxTile, 4 * rows);
  tile(1, kAmxTile, 64);
  tile(2, kAmxTile, 4 * rows);
  tile(3, rows, 64);
  tile(4, kAmxTile, 64);
  tile(5, rows, 64);
  tile(6, rows, 64);
  tile(7, rows, 64);
  load_tile_config(config);
}

// Decode (amx_configure_decode): st[j][r] = Σ_p k[j][p] ⊙ qt[p][r] for 16 keys on bf16
// pairs: K rows of kp pairs (a multiple of 16) at k_stride bytes, Qᵀ [kp][rows]; st [16][rows].
inline void amx_decode_scores(const uint32_t* k, int64_t k_stride, int64_t kp, const uint32_t* qt,
                              int64_t rows, float* st) {
  _tile_zero(0);
  for (int64_t p = 0; p < kp; p += kAmxTile) {
    _tile_loadd(1, k + p, k_stride);
    _tile_loadd(2, qt + p * rows, 4 * rows);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, st, 4 * rows);
}

// Decode (amx_configure_decode): O += P · V over 16 keys with V's bf16 rows [16][n] as they
// lie (v_stride bytes apart) as the B operand, 32 columns per tile: each block of 32 of O's
// columns comes in split order (gemm.h's split_bf16_column), the even ones from P's rows as
// pairs (p, 0) in `even`, the odd ones from (0, p) in `odd` ([rows][16] each). Where v_odd is
// not null the odd columns' products read it instead (then v holds V with its odd columns
// zeroed and v_odd with its even ones: no 0 · inf products); O [rows][ldo], n a multiple of 32.
inline void amx_decode_pv(const uint32_t* even, const uint32_t* odd, const uint16_t* v, const uint16_t* v_odd,
                          int64_t v_stride, float* o, int64_t ldo, int64_t n) {
  const int64_t so = 4 * ldo;
  _tile_loadd(3, even, 64);
  _tile_loadd(7, odd, 64);
  // One V tile per block of columns, in tiles 4 and 1 by turns (1 is K's, free here), so
  // that a block's load need not wait for the last block's products.
  auto block = [&](int64_t c) {
    _tile_loadd(5, o + c, so);
    _tile_loadd(6, o + c + kAmxTile, so);
    if (c / (2 * kAmxTile) % 2 == 0) {
      _tile_loadd(4, v + c, v_stride);
      _tile_dpbf16ps(5, 3, 4);
      _tile_dpbf16ps(6, 7, 4);
    } else {
      _tile_loadd(1, v + c, v_stride);
      _tile_dpbf16ps(5, 3, 1);
      _tile_dpbf16ps(6, 7, 1);
    }
    _tile_stored(5, o + c, so);
    _tile_stored(6, o + c + kAmxTile, so);
  };
  auto block_apart = [&](int64_t c) {
    _tile_loadd(5, o + c, so);
    _tile_loadd(6, o + c + kAmxTile, so);
    _tile_loadd(4, v + c, v_stride);
    _tile_loadd(1, v_odd + c, v_stride);
    _tile_dpbf16ps(5, 3, 4);
    _tile_dpbf16ps(6, 7, 1);
    _tile_stored(5, o + c, so);
    _tile_stored(6, o + c + kAmxTile, so);
  };
  for (int64_t c = 0; c < n; c += 2 * kAmxTile) v_odd ? block_apart(c) : block(c);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA

#endif  // ATTNKIT_ISA_avx512amx
