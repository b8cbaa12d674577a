// The online-softmax update (FlashAttention's running max and sum). Scores stay in the
// natural domain (so an additive mask such as finfo.min cannot overflow when scaled);
// exp(x) is computed as exp2(x · log2 e) after the max is subtracted.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/kernels/convert.h"
#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA {

inline constexpr float kLog2e = 1.4426950408889634f;

// Folds one tile of transposed scores into the rows' running max m and sum l. The tile is
// st[j * ld + r] for keys j < n_keys and rows r < n_rows (a multiple of kLanes), -inf where
// masked, so each vector holds one key for kLanes rows and no horizontal reduction is
// needed. Overwrites the tile with P = e^(s - m_new) and writes alpha[r] = e^(m - m_new),
// the factor by which row r's output accumulator must be rescaled.
// Up to 4 vectors of rows go down the keys together: their max and sum chains are
// independent, so they overlap (one vector at a time was bound by those chains' latency);
// each row's arithmetic and summation order are those of one vector alone.
// kBf16Pairs: the bf16 P·V's form. The tile holds unscaled scores s and `scale` > 0 is
// applied here: the max is taken over s and then scaled (the same value as the max of the
// scaled scores, rounding being monotonic), and P = 2^(s·(scale·log2 e) - m·log2 e) is one
// FMA from s, as FlashAttention's exp2 with a folded scale (the two rounded constants move
// the row's reference, which cancels in O / l, and the scale by an ulp); at scale 1 (scores
// that come scaled: sage's) P = 2^((s - m)·log2 e), which no finite s overflows. P comes out
// rounded to bf16 and paired along the keys in place (pair row i of keys 2i, 2i + 1, as
// pair_rows_bf16; an odd last key pairs with zero); the sums keep the fp32 P.
// kLazyMax: a row's reference max moves only when the tile's beats it by more than
// kLazyMaxSlack (else P may reach e^kLazyMaxSlack = 256, exact in fp32), so alpha is 1 and
// the output's rescale is skipped for almost every tile after a row's first
// (FlashAttention-4's conditional rescaling, with its threshold). The cost in bf16: a row's
// largest P is no longer exactly 1, so it rounds like the others (measured on causal bf16
// rows with peaked scores: rms error +10%, max error up to +45%, within bf16's tolerance).
// m stays the reference the sums and outputs are relative to, so lse, sinks and split
// merges are unchanged. Sums and outputs may reach 256× their exact-max values, so only V
// entries within 2^8 of the float range (beyond ~1e36) could overflow where they would not.
inline constexpr float kLazyMaxSlack = 5.545177444479562f;  // ln 256
// The largest |m| the bf16 pairs form folds into one FMA: its reference's rounding moves a
// row's exponents by at most 2^10 · 2^-24 · log2 e ≈ 1e-4 there (P by 0.006%).
inline constexpr float kFoldedMaxRef = 1024.0f;
template <int G, bool kBf16Pairs, bool kLazyMax = false>
inline void online_softmax_rows_of(float* st, int64_t n_keys, int64_t ld, float scale, float* m, float* l,
                                   float* alpha) {
  auto score = [&](int64_t j, int g) { return vload(st + j * ld + g * kLanes); };
  vfloat m_old[G], m_new[G], m_ref[G], sum[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) m_old[g] = vload(m + g * kLanes), m_new[g] = vbroadcast(-INFINITY);
  for (int64_t j = 0; j < n_keys; ++j) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) m_new[g] = vmax(m_new[g], score(j, g));
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) m_new[g] = vmax(m_old[g], kBf16Pairs ? m_new[g] * vbroadcast(scale) : m_new[g]);
  if constexpr (kLazyMax) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) m_new[g] = m_new[g] > m_old[g] + kLazyMaxSlack ? m_new[g] : m_old[g];
  }
  // Rows that have seen no visible key yet keep m = -inf; exponentiate them against 0
  // so that P = e^-inf = 0 rather than NaN.
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) m_ref[g] = m_new[g] == -INFINITY ? vfloat{} : m_new[g], sum[g] = vfloat{};
  if constexpr (kBf16Pairs) {
    const vfloat scale_log2e = vbroadcast(scale * kLog2e), log2e = vbroadcast(kLog2e);
    vfloat neg_ref_log2e[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) neg_ref_log2e[g] = m_ref[g] * -kLog2e;
    auto pairs = [&](auto p_of) {
      for (int64_t j = 0; j < n_keys; j += 2) {
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const vfloat lo = p_of(j, g);
          const vfloat hi = j + 1 < n_keys ? p_of(j + 1, g) : vfloat{};
          sum[g] += lo;
          sum[g] += hi;
          const vuint pair = bf16_pairs(lo, hi);
          std::memcpy(st + j / 2 * ld + g * kLanes, &pair, sizeof pair);  // rows j, j + 1 are read
        }
      }
    };
    // The folded form's reference -m·log2e is rounded to fp32: off by up to |m|·2^-24, which
    // shifts every exponent of the row alike (it cancels in O / l) but past |m| ~ 1e9 reaches
    // 2^±126 (P 0 or inf for every key: the row came out NaN). Rows that large take the scaled
    // scores rounded first (the contraction kept out), as the unfused softmax does.
    bool large = false;
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) large |= any_greater((vfloat)((vint)m_ref[g] & 0x7FFFFFFF), vbroadcast(kFoldedMaxRef));
    if (scale == 1.0f) {
      pairs([&](int64_t j, int g) { return vexp2<true>((score(j, g) - m_ref[g]) * log2e); });
    } else if (large) {
      const vfloat vscale = vbroadcast(scale);
      pairs([&](int64_t j, int g) {
        vfloat scaled = score(j, g) * vscale;
        asm("" : "+v"(scaled));  // rounded to fp32, not fused into the subtraction
        return vexp2<true>((scaled - m_ref[g]) * log2e);
      });
    } else {
      pairs([&](int64_t j, int g) { return vexp2<true>(score(j, g) * scale_log2e + neg_ref_log2e[g]); });
    }
  } else {
    for (int64_t j = 0; j < n_keys; ++j) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const vfloat p = vexp2((score(j, g) - m_ref[g]) * kLog2e);
        vstore(st + j * ld + g * kLanes, p);
        sum[g] += p;
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const vfloat a = vexp2((m_old[g] - m_ref[g]) * kLog2e);
    vstore(alpha + g * kLanes, a);
    vstore(l + g * kLanes, vload(l + g * kLanes) * a + sum[g]);
    vstore(m + g * kLanes, m_new[g]);
  }
}
template <bool kBf16Pairs, bool kLazyMax = false>
inline void online_softmax_tile_of(float* st, int64_t n_keys, int64_t ld, int64_t n_rows, float scale, float* m,
                                   float* l, float* alpha) {
  int64_t r = 0;
  for (; r + 4 * kLanes <= n_rows; r += 4 * kLanes)
    online_softmax_rows_of<4, kBf16Pairs, kLazyMax>(st + r, n_keys, ld, scale, m + r, l + r, alpha + r);
  switch ((n_rows - r) / kLanes) {
    case 3:
      return online_softmax_rows_of<3, kBf16Pairs, kLazyMax>(st + r, n_keys, ld, scale, m + r, l + r, alpha + r);
    case 2:
      return online_softmax_rows_of<2, kBf16Pairs, kLazyMax>(st + r, n_keys, ld, scale, m + r, l + r, alpha + r);
    case 1:
      return online_softmax_rows_of<1, kBf16Pairs, kLazyMax>(st + r, n_keys, ld, scale, m + r, l + r, alpha + r);
  }
}
// With the lazy max unless the caller needs m to be the true running max (exact_max: sparse
// MLA's max_logits); in fp32 a largest P of up to 256 instead of 1 costs no precision.
inline void online_softmax_tile(float* st, int64_t n_keys, int64_t ld, int64_t n_rows, float* m, float* l,
                                float* alpha, bool exact_max = false) {
  if (exact_max) return online_softmax_tile_of<false>(st, n_keys, ld, n_rows, 1.0f, m, l, alpha);
  online_softmax_tile_of<false, true>(st, n_keys, ld, n_rows, 1.0f, m, l, alpha);
}
// The kBf16Pairs form: st holds unscaled scores, scale > 0 and finite; P as bf16 pairs of keys,
// with the lazy max (the output's rescale is skipped for almost every tile: 4-5% of the bf16
// tile loop's time on Zen 5) unless the caller needs m to be the true running max
// (exact_max: sparse MLA's max_logits).
inline void online_softmax_tile_bf16_pairs(float* st, int64_t n_keys, int64_t ld, int64_t n_rows, float scale,
                                           float* m, float* l, float* alpha, bool exact_max = false) {
  if (exact_max) return online_softmax_tile_of<true>(st, n_keys, ld, n_rows, scale, m, l, alpha);
  online_softmax_tile_of<true, true>(st, n_keys, ld, n_rows, scale, m, l, alpha);
}

inline constexpr float kMinCodedP = 0x1p-120f;
static_assert(255.0f / kMinCodedP < 3.4e38f, "255 / P is finite for every coded P");
// The int8 P·V's form (sage int8_pv_int8): the update of online_softmax_tile with each row's
// P split for u8 × s8 products. The tile's largest P (key top_key[r], the first of equal
// scores) is kept exact in p_top; the rest become u8 codes of step p_scale = (second largest
// P) / 255, rounded to nearest even, the top key's code 0, written as quads of 4 keys:
// codes[q * ld + r], byte t for key 4q + t, zero past n_keys. P is monotonic in s, so the two
// largest P are those of the two largest scores, found in the max pass. A row whose P holds a
// NaN gets p_scale NaN. P stays in st (fp32) only where keep_p. A second largest P below
// kMinCodedP (e^-83 of the row's max or less) would overflow 255 / P: the rest of that row's
// P is then dropped, far below the resolution of its sum l.
template <int G>
inline void online_softmax_rows_u8_quads(float* st, int64_t n_keys, int64_t ld, float* m, float* l, float* alpha,
                                         uint32_t* codes, float* p_scale, float* p_top, int32_t* top_key,
                                         bool keep_p) {
  auto score = [&](int64_t j, int g) { return vload(st + j * ld + g * kLanes); };
  vfloat top[G], second[G], m_new[G], m_ref[G], rest[G], inv[G], sum[G];
  vint key[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) top[g] = second[g] = vbroadcast(-INFINITY), key[g] = vint{};
  for (int64_t j = 0; j < n_keys; ++j) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const vfloat s = score(j, g);
      const vint above = s > top[g];
      second[g] = above ? top[g] : vmax(second[g], s);
      top[g] = above ? s : top[g];
      key[g] = above ? static_cast<int32_t>(j) : key[g];
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    m_new[g] = vmax(vload(m + g * kLanes), top[g]);
    m_ref[g] = m_new[g] == -INFINITY ? vfloat{} : m_new[g];  // as online_softmax_rows_of
    rest[g] = vexp2((second[g] - m_ref[g]) * kLog2e);
    inv[g] = rest[g] >= kMinCodedP ? 255.0f / rest[g] : vfloat{};
    vstore(p_top + g * kLanes, vexp2((top[g] - m_ref[g]) * kLog2e));
    std::memcpy(top_key + g * kLanes, &key[g], sizeof key[g]);
    sum[g] = vfloat{};
  }
  // Key j's code, shifted to byte t of its quad: P · inv rounded to even (adding 1.5 · 2^23),
  // at most 255 (the top key's, zeroed below). P holds no inf, so the sum is NaN exactly
  // where a P is; such a row's codes may spill into other bytes, its output is NaN anyway.
  const vfloat round = vbroadcast(12582912.0f), max_code = vbroadcast(255.0f);
  auto code = [&](int64_t j, int g, int t) {
    const vfloat p = vexp2((score(j, g) - m_ref[g]) * kLog2e);
    sum[g] += p;
    if (keep_p) vstore(st + j * ld + g * kLanes, p);
    const vfloat c = (p * inv[g] + round) - round;
    return __builtin_convertvector(c > max_code ? max_code : c, vint) << (8 * t);
  };
  const int64_t whole = n_keys / 4;
  for (int64_t q = 0; q < whole; ++q) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const int64_t j = 4 * q;
      const vint word = code(j, g, 0) | code(j + 1, g, 1) | code(j + 2, g, 2) | code(j + 3, g, 3);
      std::memcpy(codes + q * ld + g * kLanes, &word, sizeof word);
    }
  }
  if (whole * 4 < n_keys) {
    for (int g = 0; g < G; ++g) {
      vint word{};
      for (int64_t j = whole * 4; j < n_keys; ++j) word |= code(j, g, static_cast<int>(j % 4));
      std::memcpy(codes + whole * ld + g * kLanes, &word, sizeof word);
    }
  }
  for (int64_t r = 0; r < G * kLanes; ++r) {  // the top keys' codes
    reinterpret_cast<uint8_t*>(codes + top_key[r] / 4 * ld + r)[top_key[r] % 4] = 0;
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const vfloat a = vexp2((vload(m + g * kLanes) - m_ref[g]) * kLog2e);
    vstore(alpha + g * kLanes, a);
    vstore(l + g * kLanes, vload(l + g * kLanes) * a + sum[g]);
    vstore(m + g * kLanes, m_new[g]);
    vstore(p_scale + g * kLanes, sum[g] != sum[g] ? vbroadcast(NAN) : rest[g] * (1.0f / 255.0f));
  }
}
inline void online_softmax_tile_u8_quads(float* st, int64_t n_keys, int64_t ld, int64_t n_rows, float* m, float* l,
                                         float* alpha, uint32_t* codes, float* p_scale, float* p_top,
                                         int32_t* top_key, bool keep_p) {
  int64_t r = 0;
  for (; r + 4 * kLanes <= n_rows; r += 4 * kLanes) {
    online_softmax_rows_u8_quads<4>(st + r, n_keys, ld, m + r, l + r, alpha + r, codes + r, p_scale + r, p_top + r,
                                    top_key + r, keep_p);
  }
  // The rest in one call (a task's 48 rows: three vectors at once, whose max passes'
  // dependency chains overlap; one at a time, sage at shape A took 1.03x the time).
  auto rest = [&](auto g) {
    online_softmax_rows_u8_quads<g>(st + r, n_keys, ld, m + r, l + r, alpha + r, codes + r, p_scale + r, p_top + r,
                                    top_key + r, keep_p);
  };
  switch ((n_rows - r) / kLanes) {
    case 3: rest(std::integral_constant<int, 3>{}); break;
    case 2: rest(std::integral_constant<int, 2>{}); break;
    case 1: rest(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// The same update for a row-major tile s[r * ld + j], keys j < n_keys (a multiple of
// kLanes) along the lanes, for rows r < n_rows. Usually no key beats the running max:
// then one compare replaces the horizontal max, and alpha is exactly 1.
inline void online_softmax_rows(float* s, int64_t n_keys, int64_t ld, int64_t n_rows, float* m, float* l,
                                float* alpha) {
  for (int64_t r = 0; r < n_rows; ++r) {
    float* row = s + r * ld;
    const vfloat m_old = vbroadcast(m[r]);
    vfloat mx = m_old;
    for (int64_t j = 0; j < n_keys; j += kLanes) mx = vmax(mx, vload(row + j));
    const bool moved = any_greater(mx, m_old);
    const float m_new = moved ? hmax(mx) : m[r];
    const vfloat m_ref = vbroadcast(m_new == -INFINITY ? 0.0f : m_new);  // as in the tile version
    vfloat sum{};
    for (int64_t j = 0; j < n_keys; j += kLanes) {
      const vfloat p = vexp2((vload(row + j) - m_ref) * kLog2e);
      vstore(row + j, p);
      sum += p;
    }
    const float a = moved ? vexp2((m_old - m_ref) * kLog2e)[0] : 1.0f;
    alpha[r] = a;
    l[r] = l[r] * a + hsum(sum);
    m[r] = m_new;
  }
}

// row[0, n) *= factor (n a multiple of kLanes).
inline void scale_row(float* row, int64_t n, float factor) {
  const vfloat f = vbroadcast(factor);
  for (int64_t j = 0; j < n; j += kLanes) vstore(row + j, vload(row + j) * f);
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
