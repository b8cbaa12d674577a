// Sage int8 attention on the tile loop: K prepared once per call (prepare_sage: smoothed
// by its mean, int8 per tile, V as bf16 pairs), Q quantised per row as each task starts,
// Sᵀ = K · Qᵀ on the codes (vpdpbusd, or exact fp32 FMAs on the integers elsewhere), and
// the logits of rows or keys holding NaN or inf computed exactly.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/thread_pool.h"
#include "cpu/attention/task.h"
#include "cpu/kernels/convert.h"
#include "cpu/kernels/gemm.h"
#include "cpu/kernels/gemm_amx.h"
#include "cpu/kernels/gemm_dot.h"
#include "cpu/kernels/workspace.h"

namespace attnkit::cpu::ATTNKIT_ISA::fwd {

// Sage int8: Q rows quantised to int8 with one scale per row (the softmax scale folded
// in), written as Qᵀ quads of s8 for vpdpbusd and tdpbusd (kLanes rows at a time staged
// row-major in w.k, then transposed), or as floats of the codes elsewhere; q_sum[r] = Σ codes
// corrects the +128 offset of the unsigned K codes. A row holding a NaN or inf keeps zero
// codes and gets q_scale NaN: fix_nonfinite_logits computes its logits exactly.
template <DType T, DType TK>
void AttentionTask<T, TK>::pack_q_int8(const RowBlock& rb, const Workspace& w) const {
  const int64_t ld = plan_.rows_pad;
  std::memset(w.qt, 0, sizeof(float) * plan_.d_pad * ld);
  for (int64_t r = 0; r < ld; ++r) w.q_scale[r] = 0.0f, w.q_sum[r] = 0;
#if defined(ATTNKIT_ISA_avx512bf16)
  const int64_t quads_pad = round_up(kq_->quads, kLanes);
  uint32_t* staged = reinterpret_cast<uint32_t*>(w.k);  // [kLanes][quads_pad], then the row
  float* row = w.k + kLanes * quads_pad;
#else
  float* row = w.k;  // free until the first key tile
#endif
  // Row r's codes into Qᵀ (staged on avx512bf16), its scale and code sum.
  auto quantize_row = [&](int64_t r) {
    prefetch_q_ahead(rb, r);
    load_row<T>(q_row(rb, r), p_.q_stride[3], p_.D, 1.0f, row);
    for (int64_t d = p_.D; d < plan_.d_pad; ++d) row[d] = 0.0f;
    // max |q| on the bits: for sign-cleared floats integer order is float order, and NaN
    // and inf sort above every finite value.
    vint amax_lanes{};
    for (int64_t d = 0; d < plan_.d_pad; d += kLanes) {
      const vint a = (vint)vload(row + d) & 0x7FFFFFFF;
      amax_lanes = a > amax_lanes ? a : amax_lanes;
    }
    int32_t amax_bits = 0;
    for (int i = 0; i < kLanes; ++i) amax_bits = amax_lanes[i] > amax_bits ? amax_lanes[i] : amax_bits;
    if (amax_bits >= 0x7F800000) {  // NaN or inf
      w.q_scale[r] = NAN;
      return;
    }
    float amax;
    std::memcpy(&amax, &amax_bits, sizeof amax);
    // At least the smallest subnormal: amax / 127 may underflow to 0 for tiny rows.
    const float step =
        amax > 0.0f ? std::fmax(amax / 127.0f, std::numeric_limits<float>::denorm_min()) : 1.0f;
    w.q_scale[r] = step * p_.scale;
    // codes = row / step rounded to nearest even (|codes| <= 127, so 1.5·2^23 rounds).
    const vfloat vstep = vbroadcast(step);
    vint sums{};
    for (int64_t d = 0; d < plan_.d_pad; d += kLanes) {
      const vint c = __builtin_convertvector((vload(row + d) / vstep + 12582912.0f) - 12582912.0f, vint);
      sums += c;
#if defined(ATTNKIT_ISA_avx512bf16)
      using vbytes = int8_t __attribute__((vector_size(kLanes)));
      const vbytes b = __builtin_convertvector(c, vbytes);
      std::memcpy(reinterpret_cast<int8_t*>(staged + r % kLanes * quads_pad) + d, &b, sizeof b);
#else
      for (int i = 0; i < kLanes && d + i < p_.D; ++i) w.qt[(d + i) * ld + r] = static_cast<float>(c[i]);
#endif
    }
    int32_t sum = 0;
    for (int i = 0; i < kLanes; ++i) sum += sums[i];
    w.q_sum[r] = sum;
  };
  for (int64_t r0 = 0; r0 < rb.rows; r0 += kLanes) {
    const int64_t r1 = std::min(rb.rows, r0 + kLanes);
#if defined(ATTNKIT_ISA_avx512bf16)
    std::memset(staged, 0, sizeof(uint32_t) * kLanes * quads_pad);
#endif
    for (int64_t r = r0; r < r1; ++r) quantize_row(r);
#if defined(ATTNKIT_ISA_avx512bf16)
    transpose_matrix(reinterpret_cast<const float*>(staged), quads_pad, kLanes, quads_pad,
                     reinterpret_cast<float*>(w.qt) + r0, ld);
#endif
  }
  if (p_.softcap != 0.0f) {  // the soft-cap needs the unsmoothed logits (apply_score_mods)
    for (int64_t r = 0; r < ld; ++r) {
      w.shift[r] = r < rb.rows ? lse_shift(rb, rb.h0 + r / rb.nq, rb.i0 + r % rb.nq) : 0.0f;
    }
  }
}

// Sᵀ[j][r] = (K codes · Q codes) · q_scale[r] · k_scale[j]: exact integer dot products
// (tdpbusd, vpdpbusd, or fp32 FMAs on integers below 2^24 elsewhere), then the scales. j0
// lies on a border of K's kKvTile-key tiles (visible_keys); the tile may span several.
template <DType T, DType TK>
void AttentionTask<T, TK>::qk_int8(const RowBlock& rb, int64_t j0, int64_t bc, const Workspace& w) const {
  const int64_t ld = plan_.rows_pad, quads = kq_->quads, head = rb.b * p_.Hkv + rb.kvh;
  const uint8_t* codes = kq_->codes + (head * p_.Skv + j0) * 4 * quads;
  const float* k_scales = kq_->scale + head * p_.Skv + j0;
#if defined(ATTNKIT_ISA_avx512bf16)
  int32_t* acc = reinterpret_cast<int32_t*>(w.st);
  const uint32_t* key_quads = reinterpret_cast<const uint32_t*>(codes);
  const uint32_t* q_quads = reinterpret_cast<const uint32_t*>(w.qt);
#if defined(ATTNKIT_ISA_avx512amx)
  if (quads % kAmxTile == 0) {  // tdpbusd: whole tiles of keys in place, the last ones staged
    const int64_t whole = bc / kAmxTile * kAmxTile;
    if (whole > 0) gemm_amx_u8s8(whole, ld, quads, key_quads, quads, q_quads, ld, acc, ld, false);
    if (whole < bc) {  // into w.k, zero past bc; Sᵀ has room for the tile's whole 16 rows
      uint32_t* staged = reinterpret_cast<uint32_t*>(w.k);
      std::memcpy(staged, key_quads + whole * quads, sizeof(uint32_t) * (bc - whole) * quads);
      std::memset(staged + (bc - whole) * quads, 0, sizeof(uint32_t) * (kAmxTile - (bc - whole)) * quads);
      gemm_amx_u8s8(kAmxTile, ld, quads, staged, quads, q_quads, ld, acc + whole * ld, ld, false);
    }
  } else {
    gemm_u8s8<kWideRows, kWideVecs>(bc, ld, quads, key_quads, quads, q_quads, ld, acc, ld);
  }
#else
  gemm_u8s8<kWideRows, kWideVecs>(bc, ld, quads, key_quads, quads, q_quads, ld, acc, ld);
#endif
  for (int64_t r = 0; r < ld; r += kLanes) {
    vint offset;
    std::memcpy(&offset, w.q_sum + r, sizeof offset);
    offset *= 128;  // Σ (k + 128) q - 128 Σ q = Σ k q
    const vfloat q_scale = vload(w.q_scale + r);
    for (int64_t j = 0; j < bc; ++j) {
      vint a;
      std::memcpy(&a, acc + j * ld + r, sizeof a);
      vstore(w.st + j * ld + r, __builtin_convertvector(a - offset, vfloat) * (q_scale * k_scales[j]));
    }
  }
#else
  for (int64_t j = 0; j < bc; ++j) {
    for (int64_t d = 0; d < p_.D; ++d)
      w.k[j * p_.D + d] = static_cast<float>(int32_t{codes[j * 4 * quads + d]} - 128);
  }
  gemm_wide(bc, ld, p_.D, w.k, p_.D, 1, w.qt, ld, w.st, ld, false);
  for (int64_t r = 0; r < ld; r += kLanes) {
    for (int64_t j = 0; j < bc; ++j) {
      vstore(w.st + j * ld + r, vload(w.st + j * ld + r) * (vload(w.q_scale + r) * k_scales[j]));
    }
  }
#endif
}

// Sᵀ[j][r] for the keys and query rows holding a NaN or inf (zero codes in qk_int8):
// scale·q·k in fp32 as exact attention computes it. Each such logit is ±inf or NaN, so
// the mean K was smoothed by does not matter for it: +inf or NaN poisons the row, -inf
// drops the key, as in exact attention.
template <DType T, DType TK>
void AttentionTask<T, TK>::fix_nonfinite_logits(const RowBlock& rb, int64_t j0, int64_t bc,
                                                const Workspace& w) const {
  const int64_t ld = plan_.rows_pad, head = rb.b * p_.Hkv + rb.kvh;
  bool any_key = false;  // in the tile's kKvTile-key scale tiles
  for (int64_t t = j0 / kKvTile; t * kKvTile < j0 + bc; ++t) {
    any_key = any_key || kq_->tile_nonfinite[head * kq_->tiles + t];
  }
  const uint8_t* bad_key = kq_->nonfinite + head * p_.Skv + j0;
  const E* kbase = static_cast<const E*>(p_.k) + rb.b * p_.k_stride[0] + rb.kvh * p_.k_stride[1];
  for (int64_t r = 0; r < rb.rows; ++r) {
    const bool bad_row = std::isnan(w.q_scale[r]);
    if (!bad_row && !any_key) continue;
    const E* q = q_row(rb, r);
    for (int64_t j = 0; j < bc; ++j) {
      if (!bad_row && !bad_key[j]) continue;
      const E* k = kbase + (j0 + j) * p_.k_stride[2];
      float s = 0.0f;
      for (int64_t d = 0; d < p_.D; ++d) {
        s += Elem<T>::load(q[d * p_.q_stride[3]]) * p_.scale * Elem<T>::load(k[d * p_.k_stride[3]]);
      }
      w.st[j * ld + r] = s;
    }
  }
}

// lse of the unsmoothed logits: subtracting the key mean shifted row (h, i) by q · mean.
template <DType T, DType TK>
float AttentionTask<T, TK>::lse_shift(const RowBlock& rb, int64_t h, int64_t i) const {
  const E* q = static_cast<const E*>(p_.q) + rb.b * p_.q_stride[0] + h * p_.q_stride[1] + i * p_.q_stride[2];
  const float* mean = kq_->mean + (rb.b * p_.Hkv + rb.kvh) * p_.D;
  // By vectors, kChunk elements per load_row: every row's lse and sinks need it (the torch
  // op always returns lse), and the scalar sum's chain of D dependent FMAs cost 4-6% of
  // sage's time at shape A.
  constexpr int64_t kChunk = 4 * kLanes;
  alignas(64) float qs[kChunk];
  vfloat dot{};
  float rest = 0.0f;
  for (int64_t d0 = 0; d0 < p_.D; d0 += kChunk) {
    const int64_t n = std::min(kChunk, p_.D - d0);
    load_row<T>(q + d0 * p_.q_stride[3], p_.q_stride[3], n, 1.0f, qs);
    int64_t d = 0;
    for (; d + kLanes <= n; d += kLanes) dot += vload(qs + d) * vload(mean + d0 + d);
    for (; d < n; ++d) rest += qs[d] * mean[d0 + d];
  }
  return (hsum(dot) + rest) * p_.scale;
}

// Sage int8_pv_int8: the tile's online softmax and O = O · alpha + P · V codes. P (in [0, 1]
// after the max subtraction) is split per row as the softmax writes it
// (online_softmax_tile_u8_quads): its largest value in the tile (the key attention
// concentrates on: a sink, the diagonal) is kept exact in fp32, and the rest is quantised to
// u8 with step (second largest) / 255, so small probabilities next to a dominant one keep
// their precision (on all-MiniLM-L6-v2 this cut the worst head's relative L1 from 0.05 to
// 0.004 in an emulation). A row whose P holds a NaN gets p_scale NaN (exact attention's row
// is NaN too). The sums are exact integers per kKvTile keys (V's scales are per tile and
// channel): tdpbusd, vpdpbusd, or fp32 FMAs on integers below 2^24 (255 · 127 · 128 < 2^23)
// elsewhere, so every ISA gets the same integers; each tile's are dequantised by the row's P
// scale and the tile's V scales into O, which holds Σ p (v - mean) (V's mean is added back
// once, in write_out: unquantize_pv).
template <DType T, DType TK>
void AttentionTask<T, TK>::pv_int8(const RowBlock& rb, int64_t j0, int64_t bc, const Workspace& w) const {
  const int64_t ld = plan_.rows_pad, dv_pad = plan_.dv_pad, head = rb.b * p_.Hkv + rb.kvh;
  const int64_t quads = (bc + 3) / 4;  // of keys: the products' reduction
  const uint32_t* v = kq_->v_codes + (head * ((p_.Skv + 3) / 4) + j0 / 4) * dv_pad;
  // V's scales of the tile holding key j0 + j (key tiles start at tile borders: visible_keys)
  auto v_scale = [&](int64_t j) { return kq_->v_scale + (head * kq_->tiles + (j0 + j) / kKvTile) * dv_pad; };
  const bool exact_values = values_exact(rb, j0, bc);  // add_exact_values reads P
  uint32_t* codes = reinterpret_cast<uint32_t*>(w.p_codes);  // [quads][ld]
  online_softmax_tile_u8_quads(w.st, bc, ld, ld, w.m, w.l, w.alpha, codes, w.p_scale, w.p_top, w.p_top_key,
                               exact_values);
#if defined(ATTNKIT_ISA_avx512amx)
  // tdpbusd: P's quads transposed to rows (the A operand, whole tiles of quads, zero past
  // bc), V's quads in place (QuantizedKeys pads them a tile past the last head); the int32
  // sums of each kKvTile keys (whole AMX tiles of quads) land in w.pv, and O = O · alpha +
  // Σ sums · P scale · the tile's V scales.
  const int64_t quads_pad = round_up(quads, kAmxTile);
  std::memset(codes + quads * ld, 0, sizeof(uint32_t) * (quads_pad - quads) * ld);
  uint32_t* p_rows = codes + quads_pad * ld;  // [ld][quads_pad]
  transpose_matrix(reinterpret_cast<const float*>(codes), ld, quads_pad, ld, reinterpret_cast<float*>(p_rows),
                   quads_pad);
  int32_t* sums = reinterpret_cast<int32_t*>(w.pv);
  static_assert(kKvTile / 4 % kAmxTile == 0, "a tile of keys is whole AMX tiles of quads");
  for (int64_t q0 = 0; q0 < quads_pad; q0 += kKvTile / 4) {
    gemm_amx_u8s8(ld, dv_pad, std::min(kKvTile / 4, quads_pad - q0), p_rows + q0, quads_pad, v + q0 * dv_pad, dv_pad,
                  sums, dv_pad, false);
    const float* vs = v_scale(4 * q0);
    for (int64_t r = 0; r < rb.rows; ++r) {
      const vfloat alpha = vbroadcast(q0 == 0 ? w.alpha[r] : 1.0f), scale = vbroadcast(w.p_scale[r]);
      float* o = w.o + r * dv_pad;
      for (int64_t d = 0; d < dv_pad; d += kLanes) {
        vint s;
        std::memcpy(&s, sums + r * dv_pad + d, sizeof s);
        vstore(o + d, vload(o + d) * alpha + __builtin_convertvector(s, vfloat) * scale * vload(vs + d));
      }
    }
  }
#elif defined(ATTNKIT_ISA_avx512bf16)
  gemm_u8s8_rescale<kTallRows, kTallVecs>(rb.rows, dv_pad, quads, codes, 1, ld, v, dv_pad, w.o, dv_pad, w.alpha,
                                          w.p_scale, v_scale(0));
#endif
#if defined(ATTNKIT_ISA_avx512bf16)
  for (int64_t r = 0; r < rb.rows; ++r) {  // + top P · its key's V codes · their tile's scales
    const int64_t j = w.p_top_key[r];
    const uint32_t* quad = v + j / 4 * dv_pad;
    const float* vs = v_scale(j);
    const int shift = static_cast<int>(24 - 8 * (j % 4));
    const vfloat top = vbroadcast(w.p_top[r]);
    float* o = w.o + r * dv_pad;
    for (int64_t d = 0; d < dv_pad; d += kLanes) {
      vint x;
      std::memcpy(&x, quad + d, sizeof x);
      vstore(o + d, vload(o + d) + top * __builtin_convertvector((x << shift) >> 24, vfloat) * vload(vs + d));
    }
  }
#else
  float* p_floats = w.p_codes + quads * ld;  // the codes as floats [bc][ld]
  for (int64_t j = 0; j < bc; ++j) {         // byte j % 4 of each quad: of P's, then of V's (sign-extended)
    const int shift = static_cast<int>(8 * (j % 4));
    for (int64_t r = 0; r < ld; r += kLanes) {
      vint x;
      std::memcpy(&x, codes + j / 4 * ld + r, sizeof x);
      vstore(p_floats + j * ld + r, __builtin_convertvector((x >> shift) & 0xFF, vfloat));
    }
    const uint32_t* quad = v + j / 4 * dv_pad;
    for (int64_t d = 0; d < dv_pad; d += kLanes) {
      vint x;
      std::memcpy(&x, quad + d, sizeof x);
      vstore(w.v + j * dv_pad + d, __builtin_convertvector((x << (24 - shift)) >> 24, vfloat));
    }
  }
  gemm<kTallRows, kTallVecs>(rb.rows, dv_pad, bc, p_floats, 1, ld, w.v, dv_pad, w.pv, dv_pad, false);
  const float* vs = v_scale(0);  // (key tiles are one tile of V's scales off AMX)
  for (int64_t r = 0; r < rb.rows; ++r) {
    const vfloat alpha = vbroadcast(w.alpha[r]), scale = vbroadcast(w.p_scale[r]), top = vbroadcast(w.p_top[r]);
    const float* vtop = w.v + w.p_top_key[r] * dv_pad;
    float* o = w.o + r * dv_pad;
    for (int64_t d = 0; d < dv_pad; d += kLanes) {
      const vfloat sums = vload(w.pv + r * dv_pad + d) * scale + top * vload(vtop + d);
      vstore(o + d, vload(o + d) * alpha + sums * vload(vs + d));
    }
  }
#endif
  if (exact_values) add_exact_values(rb, j0, bc, w);
}

// Whether some of V rows j0 .. j0+bc-1 of the row block's kv head are exact rows: their
// kKvTile-key scale tiles say so.
template <DType T, DType TK>
bool AttentionTask<T, TK>::values_exact(const RowBlock& rb, int64_t j0, int64_t bc) const {
  const int64_t head = rb.b * p_.Hkv + rb.kvh;
  bool any = false;
  for (int64_t t = j0 / kKvTile; t * kKvTile < j0 + bc; ++t) any = any || kq_->v_tile_exact[head * kq_->tiles + t];
  return any;
}

// The products of the exact V rows (zero codes in pv_int8: rows holding a NaN or inf, and
// outliers), in fp32 on the unquantised P (kept in Sᵀ where values_exact), of v - mean as O
// holds them: inf and NaN reach the output as they do in exact attention (also where P is 0:
// 0 · inf is NaN there too).
template <DType T, DType TK>
void AttentionTask<T, TK>::add_exact_values(const RowBlock& rb, int64_t j0, int64_t bc, const Workspace& w) const {
  const int64_t ld = plan_.rows_pad, dv_pad = plan_.dv_pad, head = rb.b * p_.Hkv + rb.kvh;
  const uint8_t* exact = kq_->v_exact + head * p_.Skv + j0;
  const float* mean = kq_->v_mean + head * dv_pad;
  const E* vbase = static_cast<const E*>(p_.v) + rb.b * p_.v_stride[0] + rb.kvh * p_.v_stride[1];
  float* u = w.pv;  // one V row less the mean (free here)
  for (int64_t j = 0; j < bc; ++j) {
    if (!exact[j]) continue;
    load_row<T>(vbase + (j0 + j) * p_.v_stride[2], p_.v_stride[3], p_.Dv, 1.0f, u);
    for (int64_t d = 0; d < p_.Dv; ++d) u[d] -= mean[d];
    for (int64_t r = 0; r < rb.rows; ++r) {
      const float pr = w.st[j * ld + r];
      for (int64_t d = 0; d < p_.Dv; ++d) w.o[r * dv_pad + d] += pr * u[d];
    }
  }
}

// One row's P·V sums with V's mean added back: o + l · v_mean (Σ p (v - mean) + Σ p · mean
// = Σ p v), into scratch (dv_pad floats).
template <DType T, DType TK>
const float* AttentionTask<T, TK>::unquantize_pv(const RowBlock& rb, const float* o, float l, float* scratch) const {
  const int64_t dv_pad = plan_.dv_pad, head = rb.b * p_.Hkv + rb.kvh;
  const float* mean = kq_->v_mean + head * dv_pad;
  const vfloat vl = vbroadcast(l);
  for (int64_t d = 0; d < dv_pad; d += kLanes) vstore(scratch + d, vload(o + d) + vl * vload(mean + d));
  return scratch;
}

// Double vectors of kLanes / 2 lanes for sage's pre-passes over K and V, which take means
// and differences in double: per element the scalar formulas, so the same bits.
constexpr int kHalf = kLanes / 2;
using vdouble = double __attribute__((vector_size(kHalf * sizeof(double))));
using vhalf_ints = int32_t __attribute__((vector_size(kHalf * sizeof(int32_t))));
inline vdouble widen(const float* x) {
  using vhalf_floats = float __attribute__((vector_size(kHalf * sizeof(float))));
  vhalf_floats f;
  std::memcpy(&f, x, sizeof f);
  return __builtin_convertvector(f, vdouble);
}
inline vdouble vload_double(const double* x) {
  vdouble v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
inline void vstore_double(double* x, vdouble v) { std::memcpy(x, &v, sizeof v); }
// Adding 1.5 · 2^52 rounds |x| < 2^51 to the nearest integer, ties to even.
inline vdouble round_even(vdouble x) {
  const vdouble round = vdouble{} + 6755399441055744.0;
  return (x + round) - round;
}

// A K or V row of n elements into row, zero-padded to ld (a multiple of kLanes); false where
// it holds a NaN or inf.
template <DType T>
bool load_finite_row(const typename Elem<T>::type* src, int64_t stride, int64_t n, int64_t ld, float* row) {
  load_row<T>(src, stride, n, 1.0f, row);
  std::memset(row + n, 0, sizeof(float) * (ld - n));
  vint nonfinite_lanes{};  // exponent bits all ones
  for (int64_t d = 0; d < ld; d += kLanes) nonfinite_lanes |= ((vint)vload(row + d) & 0x7F800000) == 0x7F800000;
  bool finite = true;
  for (int i = 0; i < kLanes; ++i) finite = finite && nonfinite_lanes[i] == 0;
  return finite;
}

// Sage int8_pv_int8: passes over V per (batch, kv head) for the QuantizedKeys' V fields:
// s8 codes of (v - mean) with one scale per tile of kKvTile keys and channel (max |v - mean|
// / 127 over the tile's rows), as quads of 4 consecutive keys, the mean per channel over
// the finite rows of its first skv keys that are not outliers (in double). Keys past skv,
// rows holding a NaN or inf, and each tile's outlier row get zero codes; the last two are
// exact rows (add_exact_values). A tile's outlier (a token with a massive activation) is the
// row whose product, over the channels where its |v - mean| is the tile's largest, of how
// many times it exceeds the next row's is largest, and at least kOutlierRatio. One scale per
// channel over all tokens let one value row 20x the others coarsen every other: relative L1
// 0.032 against the contract's 0.02; per tile 0.025 (300 keys) to 0.015 (4096); with the
// outlier exact 0.011-0.012, as without it.
constexpr double kOutlierRatio = 4.0;
template <DType T>
void prepare_sage_values(const AttentionParams& p, uint32_t* v_codes, float* v_scale, float* v_mean,
                         uint8_t* v_exact, uint8_t* v_tile_exact, int64_t tiles, int64_t dv_pad) {
  using E = typename Elem<T>::type;
  const int64_t vquads = (p.Skv + 3) / 4;
  static_assert(kKvTile % 4 == 0, "a quad of keys lies in one tile");
  auto body = [&](int64_t head, int) {
    const int64_t b = head / p.Hkv, kvh = head % p.Hkv, skv = p.kv_len ? p.kv_len[b] : p.Skv;
    const E* v = static_cast<const E*>(p.v) + b * p.v_stride[0] + kvh * p.v_stride[1];
    auto load = [&](int64_t j, float* row) {
      return load_finite_row<T>(v + j * p.v_stride[2], p.v_stride[3], p.Dv, dv_pad, row);
    };
    uint8_t* exact = v_exact + head * p.Skv;
    float *mean = v_mean + head * dv_pad, *steps = v_scale + head * tiles * dv_pad;
    AlignedBuffer<float> rows(4 * dv_pad);  // a quad's rows, zero past Dv
    // Per channel: the rows' sum; a tile's largest |v - mean|, the next largest and the
    // largest's row.
    AlignedBuffer<double> sum(dv_pad), largest(dv_pad), second(dv_pad), argmax(dv_pad), mean_wide(dv_pad);
    std::memset(sum.data, 0, sizeof(double) * dv_pad);
    std::fill_n(exact, p.Skv, uint8_t{0});
    std::fill_n(v_tile_exact + head * tiles, tiles, uint8_t{0});  // (no tile, and no buffer, for Skv 0)
    int64_t summed_rows = 0;
    auto add_row = [&](const float* row, double sign) {
      for (int64_t d = 0; d < dv_pad; d += kHalf) vstore_double(sum.data + d, vload_double(sum.data + d) + sign * widen(row + d));
    };
    auto take_mean = [&] {
      for (int64_t d = 0; d < dv_pad; ++d) {
        mean[d] = summed_rows && d < p.Dv ? static_cast<float>(sum.data[d] / summed_rows) : 0.0f;
        mean_wide.data[d] = mean[d];
      }
    };
    auto tile_extremes = [&](int64_t t) {  // over the tile's rows that are not exact
      std::memset(largest.data, 0, sizeof(double) * dv_pad);
      std::memset(second.data, 0, sizeof(double) * dv_pad);
      std::fill_n(argmax.data, dv_pad, -1.0);
      for (int64_t j = t * kKvTile; j < std::min(skv, (t + 1) * kKvTile); ++j) {
        if (exact[j]) continue;
        load(j, rows.data);
        const vdouble row = vdouble{} + static_cast<double>(j);
        for (int64_t d = 0; d < dv_pad; d += kHalf) {
          const vdouble x = widen(rows.data + d) - vload_double(mean_wide.data + d), a = x < 0.0 ? -x : x;
          const vdouble m = vload_double(largest.data + d), s = vload_double(second.data + d);
          vstore_double(second.data + d, a > m ? m : (a > s ? a : s));
          vstore_double(argmax.data + d, a > m ? row : vload_double(argmax.data + d));
          vstore_double(largest.data + d, a > m ? a : m);
        }
      }
    };
    auto tile_outlier = [&](int64_t t) -> int64_t {  // -1: none
      double gain[kKvTile] = {};  // log of each row's product of ratios
      for (int64_t d = 0; d < p.Dv; ++d) {
        if (second.data[d] > 0.0 && largest.data[d] > second.data[d]) {
          gain[static_cast<int64_t>(argmax.data[d]) - t * kKvTile] += std::log(largest.data[d] / second.data[d]);
        }
      }
      const int64_t best = std::max_element(gain, gain + kKvTile) - gain;  // the first of equals
      return gain[best] >= std::log(kOutlierRatio) ? t * kKvTile + best : -1;
    };
    auto set_steps = [&](int64_t t, int64_t outlier) {  // at least the smallest subnormal: the division stays finite
      for (int64_t d = 0; d < dv_pad; ++d) {
        const double amax = outlier >= 0 && argmax.data[d] == static_cast<double>(outlier) ? second.data[d] : largest.data[d];
        const float step = static_cast<float>(amax / 127.0);
        steps[t * dv_pad + d] = amax > 0.0 ? std::fmax(step, std::numeric_limits<float>::denorm_min()) : 1.0f;
      }
    };
    for (int64_t j = 0; j < skv; ++j) {
      if (!load(j, rows.data)) {
        exact[j] = 1, v_tile_exact[head * tiles + j / kKvTile] = 1;
        continue;
      }
      ++summed_rows;
      add_row(rows.data, 1.0);
    }
    take_mean();
    bool outliers = false;
    for (int64_t t = 0; t < tiles; ++t) {
      tile_extremes(t);
      const int64_t outlier = tile_outlier(t);
      if (outlier >= 0) {
        exact[outlier] = 1, v_tile_exact[head * tiles + t] = 1, outliers = true;
        load(outlier, rows.data);
        --summed_rows;
        add_row(rows.data, -1.0);
      }
      set_steps(t, outlier);
    }
    if (outliers) {  // the mean without them (a massive row's share of it widened every tile's steps), and the steps again
      take_mean();
      for (int64_t t = 0; t < tiles; ++t) tile_extremes(t), set_steps(t, -1);
    }
    uint32_t* codes = v_codes + head * vquads * dv_pad;
    for (int64_t q = 0; q < vquads; ++q) {  // keys 4q .. 4q + 3: byte t of each word is key 4q + t
      bool live[4];
      for (int t = 0; t < 4; ++t) {
        const int64_t j = 4 * q + t;
        live[t] = j < skv && !exact[j];
        if (live[t]) load(j, rows.data + t * dv_pad);
      }
      const float* step = steps + 4 * q / kKvTile * dv_pad;
      for (int64_t d = 0; d < dv_pad; d += kHalf) {
        const vdouble mu = vload_double(mean_wide.data + d), vstep = widen(step + d);
        vhalf_ints word{};
        for (int t = 0; t < 4; ++t) {
          if (!live[t]) continue;
          vdouble x = round_even((widen(rows.data + t * dv_pad + d) - mu) / vstep);
          x = x > 127.0 ? 127.0 : x;
          x = x < -127.0 ? -127.0 : x;
          word |= (__builtin_convertvector(x, vhalf_ints) & 0xFF) << (8 * t);
        }
        std::memcpy(codes + q * dv_pad + d, &word, sizeof word);
      }
    }
  };
  detail::parallel_for(p.B * p.Hkv, detail::num_threads(), body);
}

// Sage int8: one pass over K per (batch, kv head): the mean over its finite rows, then
// int8 codes of (k - mean) with one scale per key (max |k - mean| / 127 over its row: one
// scale per kKvTile keys, as SageAttention's per-block K, let one large key, or a heavy
// tail, coarsen 127 others: relative L1 0.030-0.059 against the contract's 0.02); and,
// where P·V runs on bf16 pairs, one pass over V packing consecutive keys into pairs. The
// mean and k - mean are taken in double, so no finite key (up to float's max) overflows;
// rows holding a NaN or inf are flagged and get zero codes (see QuantizedKeys).
template <DType T>
void prepare_sage(const AttentionParams& p, uint8_t* codes, float* scale, float* mean, uint32_t* v_pairs,
                  bool v_slabs, uint8_t* nonfinite, uint8_t* tile_nonfinite, int64_t quads, int64_t tiles,
                  int64_t dv_pad) {
  using E = typename Elem<T>::type;
  auto body = [&](int64_t head, int) {
    const int64_t b = head / p.Hkv, kvh = head % p.Hkv, skv = p.kv_len ? p.kv_len[b] : p.Skv;
    const E* k = static_cast<const E*>(p.k) + b * p.k_stride[0] + kvh * p.k_stride[1];
    float* mu = mean + head * p.D;
    uint8_t* bad = nonfinite + head * p.Skv;
    const int64_t ld = round_up(p.D, kLanes);  // K rows staged zero-padded to whole vectors
    AlignedBuffer<float> tile(std::max(ld, (2 + kLanes) * dv_pad));  // a key row, or V's staged pair rows
    AlignedBuffer<double> sum(ld), mu_wide(ld);
    auto load_key = [&](int64_t j, float* row) {
      return load_finite_row<T>(k + j * p.k_stride[2], p.k_stride[3], p.D, ld, row);
    };
    std::memset(sum.data, 0, sizeof(double) * ld);
    int64_t finite_rows = 0;
    for (int64_t j = 0; j < skv; ++j) {
      const bool finite = load_key(j, tile.data);
      bad[j] = !finite;
      if (!finite) continue;
      ++finite_rows;
      for (int64_t d = 0; d < ld; d += kHalf) vstore_double(sum.data + d, vload_double(sum.data + d) + widen(tile.data + d));
    }
    for (int64_t d = 0; d < ld; ++d) {
      if (d < p.D) mu[d] = finite_rows ? static_cast<float>(sum.data[d] / finite_rows) : 0.0f;
      mu_wide.data[d] = d < p.D ? double{mu[d]} : 0.0;
    }
    std::fill_n(tile_nonfinite + head * tiles, tiles, uint8_t{0});  // (no tile, and no buffer, for Skv 0)
    for (int64_t j = 0; j < skv; ++j) {
      uint8_t* dst = codes + (head * p.Skv + j) * 4 * quads;
      scale[head * p.Skv + j] = 1.0f;
      if (bad[j]) {
        tile_nonfinite[head * tiles + j / kKvTile] = 1;
        std::memset(dst, 128, 4 * quads);
        continue;
      }
      float* row = tile.data;
      load_key(j, row);
      vdouble amax_lanes{};
      for (int64_t d = 0; d < ld; d += kHalf) {
        const vdouble x = widen(row + d) - vload_double(mu_wide.data + d);
        const vdouble a = x < 0.0 ? -x : x;
        amax_lanes = a > amax_lanes ? a : amax_lanes;
      }
      double amax = 0.0;
      for (int i = 0; i < kHalf; ++i) amax = amax_lanes[i] > amax ? amax_lanes[i] : amax;
      const double step = amax > 0.0 ? amax / 127.0 : 1.0;
      scale[head * p.Skv + j] = static_cast<float>(step);
      const vdouble vstep = vdouble{} + step;
      for (int64_t d = 0; d < 4 * quads; d += kHalf) {  // |x| <= 127; zero past D
        const vdouble x = round_even((widen(row + d) - vload_double(mu_wide.data + d)) / vstep);
        const vhalf_ints code = __builtin_convertvector(x, vhalf_ints) + 128;
        const auto c = __builtin_convertvector(code, uint8_t __attribute__((vector_size(kHalf))));
        std::memcpy(dst + d, &c, std::min<int64_t>(kHalf, 4 * quads - d));
      }
    }
#if defined(ATTNKIT_ISA_avx512bf16)
    const E* v = static_cast<const E*>(p.v) + b * p.v_stride[0] + kvh * p.v_stride[1];
    const int64_t pairs = v_pairs ? prepared_v_pairs(p.Skv, v_slabs) : 0;  // none for mode int8_pv_int8
    uint32_t* staged = reinterpret_cast<uint32_t*>(tile.data + 2 * dv_pad);  // a slab's pair rows
    for (int64_t jp = 0; jp < pairs; ++jp) {  // rows 2jp and 2jp + 1 of V, zero-padded, as fp32 into tile
      const int64_t n = std::clamp<int64_t>(skv - 2 * jp, 0, 2);
      std::memset(tile.data, 0, sizeof(float) * 2 * dv_pad);
      for (int64_t j = 0; j < n; ++j) {
        load_row<T>(v + (2 * jp + j) * p.v_stride[2], p.v_stride[3], p.Dv, 1.0f, tile.data + j * dv_pad);
      }
      uint32_t* dst = v_pairs + (head * pairs + jp) * dv_pad;
      if (!v_slabs) {
        pair_rows_bf16(tile.data, 2, dv_pad, dst);
        continue;
      }
      static_assert(kVSlabKeys == 2 * kLanes, "a slab is transposed as one kLanes-row block");
      pair_rows_bf16(tile.data, 2, dv_pad, staged + jp % kLanes * dv_pad);
      if (jp % kLanes == kLanes - 1) {
        transpose_matrix(reinterpret_cast<const float*>(staged), dv_pad, kLanes, dv_pad,
                         reinterpret_cast<float*>(dst - (kLanes - 1) * dv_pad), kLanes);
      }
    }
#else
    (void)v_pairs, (void)v_slabs;
#endif
  };
  detail::parallel_for(p.B * p.Hkv, detail::num_threads(), body);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA::fwd
