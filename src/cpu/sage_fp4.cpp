// SageAttention3 (sageattn3_blackwell) forward numerics, emulated in double precision with
// the kernel's float32 roundings where it has them (docs/sage_fp4.md, §n below):
// K smoothed by its token mean (§2.1); Q smoothed per 128-row block with the mean's
// product added back to the scores (§2.2); Q, K (along D) and V (along tokens) quantised
// to NVFP4 — E2M1 values with one E4M3 scale per 16 elements (§1.3); per 128×128 tile,
// key tiles in reverse order, P quantised with the two-level scaling (§3). Written for
// clarity, not speed: one thread per (batch, head), scalar loops.
#include "cpu/sage_fp4.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attnkit/dtype.h"
#include "core/thread_pool.h"

namespace attnkit::cpu {
namespace {

constexpr int64_t kBlock = 16;   // NVFP4 micro-block
constexpr int64_t kTile = 128;   // query rows and keys per tile; sequences pad to it
constexpr double kE2m1Max = 6.0, kE4m3Max = 448.0, kPScale = 448.0 * 6.0;

// Round a >= 0 to the binary grid with `mant_bits` fraction bits and minimum normal
// exponent `min_exp`, ties to even (the current rounding mode is round-to-nearest-even).
double round_to_grid(double a, int min_exp, int mant_bits) {
  if (a == 0.0) return 0.0;
  int e;
  std::frexp(a, &e);
  e = e - 1 < min_exp ? min_exp : e - 1;
  const double ulp = std::ldexp(1.0, e - mant_bits);
  return std::nearbyint(a / ulp) * ulp;
}

// E2M1: ±{0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at ±6 (§1.1); NaN propagates.
double round_e2m1(double x) {
  if (std::isnan(x)) return x;
  const double a = std::fmin(std::fabs(x), kE2m1Max);
  return std::copysign(std::fmin(round_to_grid(a, 0, 1), kE2m1Max), x);
}

// E4M3 (e4m3fn), saturating at ±448 (§1.2); NaN propagates.
double round_e4m3(double x) {
  if (std::isnan(x)) return x;
  const double a = std::fmin(std::fabs(x), 2 * kE4m3Max);
  return std::copysign(std::fmin(round_to_grid(a, -6, 3), kE4m3Max), x);
}

// Replaces x[i * stride] (n = 16 elements) by its NVFP4 dequantised value: amax and the
// scale in float32 like the kernel, s = E4M3(amax / 6), value = E2M1(x / s) (§1.3).
void fake_quant_block(double* x, int64_t stride) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) {
    const float v = static_cast<float>(x[i * stride]);
    if (std::fabs(v) > amax) amax = std::fabs(v);
  }
  const float s = static_cast<float>(round_e4m3(static_cast<double>(amax / 6.0f)));
  const float inv = s == 0.0f ? 0.0f : 1.0f / s;
  for (int64_t i = 0; i < kBlock; ++i) {
    const float y = static_cast<float>(x[i * stride]) * inv;
    x[i * stride] = round_e2m1(y) * s;
  }
}

struct Head {
  int64_t rows_pad, keys_pad, d;
  std::vector<double> q, k, v, delta;  // [rows_pad][d], [keys_pad][d] x2, [rows_pad/128][keys_pad]
};

template <class Load>
void load(std::vector<double>& dst, int64_t rows, int64_t d, int64_t rows_pad, Load element) {
  dst.assign(rows_pad * d, 0.0);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < d; ++c) dst[i * d + c] = element(i, c);
}

double element(const AttentionParams& p, const void* base, const int64_t* stride, int64_t b, int64_t h, int64_t i,
               int64_t c) {
  const int64_t off = b * stride[0] + h * stride[1] + i * stride[2] + c * stride[3];
  switch (p.dtype) {
    case DType::bfloat16: return bfloat16_to_float(static_cast<const uint16_t*>(base)[off]);
    case DType::float16: return float16_to_float(static_cast<const uint16_t*>(base)[off]);
    default: return static_cast<const float*>(base)[off];
  }
}

void store(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t c, double x) {
  const int64_t off = b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2] + c * p.out_stride[3];
  const float f = static_cast<float>(x);
  switch (p.dtype) {
    case DType::bfloat16: static_cast<uint16_t*>(p.out)[off] = float_to_bfloat16(f); break;
    case DType::float16: static_cast<uint16_t*>(p.out)[off] = float_to_float16(f); break;
    default: static_cast<float*>(p.out)[off] = f;
  }
}

// Smoothing and quantisation of one (batch, query head) (§2, §1.3).
Head prepare(const AttentionParams& p, int64_t b, int64_t h) {
  const int64_t d = p.D, kvh = h / p.group;
  Head hd;
  hd.d = d;
  hd.rows_pad = (p.Sq + kTile - 1) / kTile * kTile;
  hd.keys_pad = (p.Skv + kTile - 1) / kTile * kTile;
  load(hd.q, p.Sq, d, hd.rows_pad, [&](int64_t i, int64_t c) { return element(p, p.q, p.q_stride, b, h, i, c); });
  load(hd.k, p.Skv, d, hd.keys_pad, [&](int64_t i, int64_t c) { return element(p, p.k, p.k_stride, b, kvh, i, c); });
  load(hd.v, p.Skv, d, hd.keys_pad, [&](int64_t i, int64_t c) { return element(p, p.v, p.v_stride, b, kvh, i, c); });
  for (int64_t c = 0; c < d; ++c) {  // K smoothing over the real tokens, before padding
    double mean = 0.0;
    for (int64_t j = 0; j < p.Skv; ++j) mean += hd.k[j * d + c];
    mean /= static_cast<double>(p.Skv);
    for (int64_t j = 0; j < p.Skv; ++j) hd.k[j * d + c] -= mean;
  }
  const int64_t q_tiles = hd.rows_pad / kTile;
  hd.delta.assign(q_tiles * hd.keys_pad, 0.0);
  std::vector<double> qm(d);
  for (int64_t t = 0; t < q_tiles; ++t) {  // Q smoothing per 128 padded rows; delta = qm · kᵀ
    for (int64_t c = 0; c < d; ++c) {
      double mean = 0.0;
      for (int64_t i = 0; i < kTile; ++i) mean += hd.q[(t * kTile + i) * d + c];
      qm[c] = mean / kTile;
      for (int64_t i = 0; i < kTile; ++i) hd.q[(t * kTile + i) * d + c] -= qm[c];
    }
    for (int64_t j = 0; j < hd.keys_pad; ++j) {
      double s = 0.0;
      for (int64_t c = 0; c < d; ++c) s += qm[c] * hd.k[j * d + c];
      hd.delta[t * hd.keys_pad + j] = s;
    }
  }
  for (int64_t i = 0; i < hd.rows_pad; ++i)
    for (int64_t c = 0; c < d; c += kBlock) fake_quant_block(&hd.q[i * d + c], 1);
  for (int64_t j = 0; j < hd.keys_pad; ++j)
    for (int64_t c = 0; c < d; c += kBlock) fake_quant_block(&hd.k[j * d + c], 1);
  for (int64_t j = 0; j < hd.keys_pad; j += kBlock)
    for (int64_t c = 0; c < d; ++c) fake_quant_block(&hd.v[j * d + c], d);
  return hd;
}

void attend(const AttentionParams& p, int64_t b, int64_t h) {
  const Head hd = prepare(p, b, h);
  const int64_t d = hd.d;
  const double scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  const int64_t offset = p.causal ? p.causal_offset : 0;
  std::vector<double> s(kTile * kTile), o(kTile * d), m(kTile), l(kTile);
  for (int64_t r0 = 0; r0 < hd.rows_pad; r0 += kTile) {
    int64_t n_tiles = hd.keys_pad / kTile;
    if (p.causal) {
      const int64_t reach = r0 + kTile + offset;  // keys < reach may be visible to the tile
      const int64_t limit = reach <= 0 ? 0 : (reach + kTile - 1) / kTile;
      n_tiles = limit < n_tiles ? limit : n_tiles;
    }
    std::fill(o.begin(), o.end(), 0.0);
    std::fill(m.begin(), m.end(), -INFINITY);
    std::fill(l.begin(), l.end(), 0.0);
    for (int64_t nb = n_tiles - 1; nb >= 0; --nb) {  // key tiles in reverse order (§4)
      const int64_t c0 = nb * kTile;
      for (int64_t i = 0; i < kTile; ++i) {
        double row_max = m[i];
        for (int64_t j = 0; j < kTile; ++j) {
          const int64_t col = c0 + j, row = r0 + i;
          double x = -INFINITY;
          if (col < p.Skv && (!p.causal || col <= row + offset)) {
            x = hd.delta[(r0 / kTile) * hd.keys_pad + col];
            for (int64_t c = 0; c < d; ++c) x += hd.q[row * d + c] * hd.k[col * d + c];
          }
          s[i * kTile + j] = x;
          row_max = x > row_max ? x : row_max;
        }
        // Two-level P (§3): P~ = 2688·2^((s - m)·c) per row; per 16 keys sf = max(P~)/6 in
        // exact arithmetic, values E2M1(P~ / sf) against the unrounded sf, scale E4M3(sf).
        const double alpha = m[i] == -INFINITY ? 0.0 : std::exp2((m[i] - row_max) * scale_log2);
        double tile_sum = 0.0;
        for (int64_t j0 = 0; j0 < kTile; j0 += kBlock) {
          double block_max = -INFINITY;
          for (int64_t j = j0; j < j0 + kBlock; ++j) block_max = s[i * kTile + j] > block_max ? s[i * kTile + j] : block_max;
          const double sf = block_max == -INFINITY ? 0.0 : kE4m3Max * std::exp2((block_max - row_max) * scale_log2);
          const double stored = round_e4m3(sf);
          for (int64_t j = j0; j < j0 + kBlock; ++j) {
            double& x = s[i * kTile + j];
            const double pt = x == -INFINITY ? 0.0 : kPScale * std::exp2((x - row_max) * scale_log2);
            tile_sum += pt;
            x = sf > 0.0 ? round_e2m1(pt / sf) * stored : 0.0;  // dequantised P
          }
        }
        l[i] = l[i] * alpha + tile_sum;
        double* oi = &o[i * d];
        for (int64_t c = 0; c < d; ++c) oi[c] *= alpha;
        for (int64_t j = 0; j < kTile; ++j) {
          const double pj = s[i * kTile + j];
          if (pj == 0.0) continue;
          const double* vj = &hd.v[(c0 + j) * d];
          for (int64_t c = 0; c < d; ++c) oi[c] += pj * vj[c];
        }
        m[i] = row_max;
      }
    }
    for (int64_t i = 0; i < kTile && r0 + i < p.Sq; ++i) {
      const double inv = l[i] == 0.0 || std::isnan(l[i]) ? 0.0 : 1.0 / l[i];
      for (int64_t c = 0; c < d; ++c) store(p, b, h, r0 + i, c, o[i * d + c] * inv);
      if (p.lse) {  // log Σ e^(s·scale) = m·scale + log(l / 2688)
        p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + (r0 + i) * p.lse_stride[2]] =
            l[i] == 0.0 ? -INFINITY : static_cast<float>(m[i] * p.scale + std::log(l[i] / kPScale));
      }
    }
  }
}

}  // namespace

void sage_fp4_fwd(const AttentionParams& p) {
  auto body = [&](int64_t task, int) { attend(p, task / p.Hq, task % p.Hq); };
  detail::parallel_for(p.B * p.Hq, detail::num_threads(), body);
}

}  // namespace attnkit::cpu
