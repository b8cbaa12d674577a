// The fuzz driver's DeepSeek sparse attention calls: the sparse MLA prefill (both
// contracts), FlashMLA's decode, the V3.2 quantiser, the lightning indexer's logits (flat,
// compressed, fused with top-k, paged) and top-k with its transforms. Caches and index
// arrays hold valid values and, sometimes, wrong ones; cache rows no valid index refers to
// hold NaN where the inputs are finite, so a kernel that reads one shows it in its output.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_dsa.h"

namespace attnkit_fuzz {
namespace {

constexpr int64_t kV32Token = 656, kV32Nope = 512, kV32Rope = 64, kV32Tile = 128;

uint8_t* element_ptr(const TensorView& t, int64_t i) {
  return static_cast<uint8_t*>(t.data) + elem_offset(t, i) * static_cast<int64_t>(attnkit::dtype_size(t.dtype));
}

// Element i (row-major) of a float32 view.
void put_float(const TensorView& t, int64_t i, float x) { std::memcpy(element_ptr(t, i), &x, 4); }
float get_float(const TensorView& t, int64_t i) {
  float x;
  std::memcpy(&x, element_ptr(t, i), 4);
  return x;
}

// A scale for fp8 values: finite and positive mostly, else 0, negative, huge or not finite
// (bad is set for the values the ops must reject).
float pick_scale(Rng& rng, bool& bad) {
  const float x = rng.chance(0.8) ? static_cast<float>(std::fabs(rng.normal()) + 0.1)
                                  : rng.pick<float>({0.0f, -0.5f, NAN, INFINITY, -INFINITY, 1e30f});
  bad = bad || !std::isfinite(x);
  return x;
}

// Whether the view's elements are distinct (no dim of size > 1 broadcast by a zero stride;
// Call::make's other layouts are nested): only then can some of its rows be poisoned alone.
bool distinct(const TensorView& t) {
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] > 1 && t.strides[d] == 0) return false;
  }
  return true;
}

// lse (+inf where the row saw no key: FlashMLA's convention) and max_logits (-inf there).
void expect_stats(const RowRef& want, double lse, std::optional<double> max_logit, const std::string& what) {
  expect_near(lse, want.lse == -INFINITY ? INFINITY : want.lse, lse_tol(want), what + " lse");
  if (max_logit) expect_near(*max_logit, want.max, lse_tol(want), what + " max_logits");
}

// ---- sparse MLA prefill

bool sparse_scales_moderate(const attnkit::SparseMlaArgs& a) {
  for (const auto* s : {&a.q_scale, &a.kv_scale}) {
    if (*s && !(std::fabs(get_float(**s, 0)) < 100)) return false;
  }
  return std::fabs(a.sm_scale) < 100;
}

}  // namespace

bool fuzz_sparse_mla(Call& c, bool strict) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.3);  // finite inputs are compared with the reference
  const DType dtype = strict || rng.chance(0.5) ? DType::float8_e4m3fn : DType::bfloat16;
  int64_t s_q = rng.pick<int64_t>({0, 1, 2, 3, 5, 8}), s_kv = rng.pick<int64_t>({0, 1, 2, 7, 64, 65, 200, 513});
  int64_t h_q = strict ? 64 * rng.range(1, 2) : rng.pick<int64_t>({1, 2, 3, 15, 16, 17, 64, 128});
  int64_t d_qk = strict ? rng.pick<int64_t>({512, 576}) : rng.pick<int64_t>({1, 8, 17, 64, 65, 128, 576});
  int64_t d_v = strict ? 512 : rng.range(1, d_qk);
  int64_t topk = strict ? 128 * rng.range(1, 2) : rng.pick<int64_t>({1, 2, 7, 63, 64, 65, 128, 129, 256});
  if (strict && s_q * h_q * topk > 2 * 64 * 128) h_q = 64, topk = 128, s_q = std::min<int64_t>(s_q, 2);
  while (!strict && s_q * h_q * topk * d_qk > (int64_t{6} << 20)) {
    topk = std::max<int64_t>(1, topk / 2), h_q = std::max<int64_t>(1, h_q / 2);
  }
  const int perturb = rng.chance(0.2) ? static_cast<int>(rng.range(0, 5)) : -1;
  if (perturb == 0) d_v = d_qk + 1, c.require_error("d_v > d_qk");
  c.log << (strict ? "sparse_mla_q8kv8_prefill_fwd" : "sparse_mla_prefill_fwd") << " s_q=" << s_q << " s_kv=" << s_kv
        << " h_q=" << h_q << " d_qk=" << d_qk << " d_v=" << d_v << " topk=" << topk << "\n";
  attnkit::SparseMlaArgs a;
  // Outputs must be contiguous, and so must the strict contract's inputs: mostly so.
  const double plain = strict ? 0.9 : 0.5;
  a.q = c.make("q", dtype, {s_q, h_q, d_qk}, Call::Kind::input, 0.0, plain);
  a.kv = c.make("kv", perturb == 1 ? DType::bfloat16 : dtype, {s_kv, 1, d_qk}, Call::Kind::input, 0.0, plain);
  // Indices: valid rows, -1, out of range, INT_MIN/INT_MAX.
  a.indices = c.make("indices", DType::int32, {s_q, 1, topk}, Call::Kind::input, 0.0, plain);
  for (int64_t i = 0; i < s_q * topk; ++i) {
    const int64_t u = rng.range(0, 99);
    int64_t x = u < 70 && s_kv > 0 ? rng.range(0, s_kv - 1)
                : u < 85          ? -1
                                  : rng.pick<int64_t>({s_kv, INT32_MIN, INT32_MAX, -2, static_cast<int32_t>(rng.bits())});
    put_int(a.indices, i, x);
  }
  bool bad_scale = false;
  const bool fp8 = dtype == DType::float8_e4m3fn;
  if (fp8 || rng.chance(0.3)) {
    if (!(perturb == 2)) {
      a.q_scale = c.make("q_scale", DType::float32, {1}, Call::Kind::input);
      put_float(*a.q_scale, 0, pick_scale(rng, bad_scale));
    }
    a.kv_scale = c.make("kv_scale", DType::float32, rng.chance(0.5) ? std::vector<int64_t>{1} : std::vector<int64_t>{},
                        Call::Kind::input);
    put_float(*a.kv_scale, 0, pick_scale(rng, bad_scale));
  }
  a.sm_scale = rng.chance(0.8) ? 1.0 / std::sqrt(static_cast<double>(d_qk))
                               : rng.pick<double>({0.0, -0.3, NAN, INFINITY, 1e39, 1e30});
  if (!std::isfinite(static_cast<float>(a.sm_scale))) bad_scale = true;
  if (rng.chance(0.4)) a.attn_sink = c.make("attn_sink", DType::float32, {h_q}, Call::Kind::input);
  if (rng.chance(0.5)) {
    a.topk_length = c.make("topk_length", DType::int32, {s_q}, Call::Kind::input);
    for (int64_t i = 0; i < s_q; ++i) {
      put_int(*a.topk_length, i, rng.chance(0.85) ? rng.range(0, topk)
                                                  : rng.pick<int64_t>({-1, topk + 1, INT32_MIN, INT32_MAX}));
    }
  }
  // Slot t of row s: its kv row, or -1 where the slot is invalid (from the values in memory).
  auto slot_row = [&](int64_t s, int64_t t) -> int64_t {
    if (a.topk_length && t >= get_int(*a.topk_length, s)) return -1;
    const int64_t idx = get_int(a.indices, s * topk + t);
    return idx >= 0 && idx < s_kv ? idx : -1;
  };
  if (!c.specials && distinct(a.kv)) {  // NaN in every kv row no valid slot uses
    std::vector<bool> used(s_kv, false);
    for (int64_t s = 0; s < s_q; ++s) {
      for (int64_t t = 0; t < topk; ++t) {
        if (slot_row(s, t) >= 0) used[slot_row(s, t)] = true;
      }
    }
    for (int64_t j = 0; j < s_kv; ++j) {
      for (int64_t e = 0; !used[j] && e < d_qk; ++e) store_value(a.kv.dtype, element_ptr(a.kv, j * d_qk + e), NAN, rng);
    }
  }
  const bool alias_out = perturb == 3 && s_q * h_q > 0 && d_v >= 2;  // out's block holds max_logits' bytes
  a.out = c.make("out", DType::bfloat16, {s_q, h_q, perturb == 4 ? d_v + 1 : d_v}, Call::Kind::output, 0.05, 0.9);
  if (alias_out) {
    a.max_logits = c.alias("max_logits", c.last(), {s_q, h_q}, DType::float32);
    c.require_error("max_logits aliases out");
  } else {
    a.max_logits = c.make("max_logits", DType::float32, {s_q, h_q}, Call::Kind::output, 0.05, 0.9);
  }
  a.lse = c.make("lse", DType::float32, {s_q, h_q}, Call::Kind::output, 0.05, 0.9);
  a.d_v = d_v;
  // Non-finite scales must be an Error (unless an earlier check of the contract fails first,
  // which is an Error too; a missing required scale is also an Error).
  if (bad_scale) c.require_error("a non-finite scale");
  maybe_null_data(c, {&a.q, &a.kv, &a.indices, opt(a.q_scale), opt(a.kv_scale),
                      opt(a.attn_sink), opt(a.topk_length), &a.out,
                      &a.max_logits, &a.lse});
  c.log << "  sm_scale=" << a.sm_scale << "\n";
  const bool ok = c.run([&] {
    if (strict) attnkit::sparse_mla_q8kv8_prefill_fwd(a);
    else attnkit::sparse_mla_prefill_fwd(a);
  });
  if (!ok || c.specials || !sparse_scales_moderate(a)) return ok;
  // Three (row, head) pairs against the semantics of python/attnkit/sparse_mla.py.
  const double qs = a.q_scale ? get_float(*a.q_scale, 0) : 1.0, ks = a.kv_scale ? get_float(*a.kv_scale, 0) : 1.0;
  const double logit_scale = static_cast<float>(a.sm_scale) * qs * ks;
  for (int probe = 0; probe < 3 && s_q * h_q > 0; ++probe) {
    const int64_t s = rng.range(0, s_q - 1), h = rng.range(0, h_q - 1);
    const RowRef want = attend_row(
        topk, d_v, [&](int64_t t) { return slot_row(s, t) >= 0; },
        [&](int64_t t) {
          double dot = 0;
          for (int64_t e = 0; e < d_qk; ++e) dot += at(a.q, {s, h, e}) * at(a.kv, {slot_row(s, t), 0, e});
          return dot * logit_scale;
        },
        [&](int64_t t, int64_t e) { return at(a.kv, {slot_row(s, t), 0, e}) * ks; },
        a.attn_sink ? std::optional<double>(at(*a.attn_sink, {h})) : std::nullopt);
    const std::string what = "row " + std::to_string(s) + " head " + std::to_string(h);
    expect_row(want, [&](int64_t e) { return at(a.out, {s, h, e}); }, std::nullopt, DType::bfloat16, what);
    expect_stats(want, at(a.lse, {s, h}), at(a.max_logits, {s, h}), what);
  }
  return true;
}


// ---- FlashMLA's decode and the V3.2 quantiser

namespace {

// A V3.2 token (512 e4m3 values, 4 float32 tile scales, 64 bf16 rope values): finite values
// with finite scales (powers of two as the quantiser writes them, or any), or all NaN.
void write_v32_token(uint8_t* token, Rng& rng, bool nan) {
  for (int64_t e = 0; e < kV32Nope; ++e) {
    token[e] = nan ? 0x7F : attnkit::float_to_float8_e4m3fn(static_cast<float>(4 * rng.normal()));
  }
  for (int64_t tile = 0; tile < kV32Nope / kV32Tile; ++tile) {
    const float scale = nan ? NAN : std::ldexp(rng.chance(0.7) ? 1.0f : 1.37f, static_cast<int>(rng.range(-9, 1)));
    std::memcpy(token + kV32Nope + 4 * tile, &scale, 4);
  }
  for (int64_t e = 0; e < kV32Rope; ++e) {
    const uint16_t bits = nan ? uint16_t{0x7FC0} : attnkit::float_to_bfloat16(static_cast<float>(rng.normal()));
    std::memcpy(token + kV32Nope + 16 + 2 * e, &bits, 2);
  }
}

// Value e of a V3.2 token as the decode reads it: e4m3 × its tile's scale in float32,
// rounded to bf16 (FlashMLA's dequantisation), or the bf16 rope value.
double v32_value(const uint8_t* token, int64_t e) {
  if (e < kV32Nope) {
    float scale;
    std::memcpy(&scale, token + kV32Nope + 4 * (e / kV32Tile), 4);
    const float x = attnkit::float8_e4m3fn_to_float(token[e]) * scale;
    return attnkit::bfloat16_to_float(attnkit::float_to_bfloat16(x));
  }
  uint16_t bits;
  std::memcpy(&bits, token + kV32Nope + 16 + 2 * (e - kV32Nope), 2);
  return attnkit::bfloat16_to_float(bits);
}

}  // namespace

bool fuzz_mla_decode(Call& c) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.15);
  const bool sparse = rng.chance(0.5), fp8 = sparse || rng.chance(0.4);
  const int64_t b = rng.pick<int64_t>({0, 1, 1, 2, 3}), s_q = rng.pick<int64_t>({1, 1, 2, 3});
  int64_t h_q = rng.pick<int64_t>({1, 2, 3, 16, 17, 43, 64});
  int64_t d_qk = fp8 ? 576 : rng.pick<int64_t>({1, 8, 17, 64, 128, 576});
  int64_t head_dim_v = sparse ? 512 : fp8 && rng.chance(0.6) ? 512 : rng.range(1, d_qk);
  const int64_t page = rng.pick<int64_t>({1, 2, 3, 16, 61, 64});
  const int64_t topk = rng.pick<int64_t>({1, 2, 7, 64, 65, 128, 200});
  std::vector<int64_t> lens(b);
  for (int64_t& len : lens) len = rng.pick<int64_t>({0, 1, 3, 64, 65, 130, 300});
  int64_t rows_per_query = sparse ? topk : 1;
  for (int64_t len : lens) rows_per_query = std::max(rows_per_query, len);
  while (b * s_q * h_q * rows_per_query * d_qk > (int64_t{3} << 20) && h_q > 1) h_q /= 2;
  int64_t max_blocks = 0;
  for (int64_t len : lens) max_blocks = std::max(max_blocks, (len + page - 1) / page);
  max_blocks += rng.range(0, 1);
  const int64_t num_blocks = std::max<int64_t>(1, sparse ? rng.range(1, 8) : max_blocks * std::max<int64_t>(b, 1) / 2 + 1);
  const int perturb = rng.chance(0.25) ? static_cast<int>(rng.range(0, 11)) : -1;
  c.log << "flash_mla_with_kvcache b=" << b << " s_q=" << s_q << " h_q=" << h_q << " d_qk=" << d_qk
        << " head_dim_v=" << head_dim_v << " page=" << page << " num_blocks=" << num_blocks
        << (sparse ? " sparse topk=" + std::to_string(topk) : " dense") << (fp8 ? " fp8" : " bf16") << "\n";
  attnkit::MlaDecodeArgs a;
  a.is_fp8_kvcache = fp8;
  if (perturb == 0) head_dim_v = rng.pick<int64_t>({0, d_qk + 1, sparse ? 511 : -1}), c.require_error("head_dim_v");
  a.head_dim_v = head_dim_v;
  a.q = c.make("q", DType::bfloat16, {b, s_q, h_q, perturb == 1 ? d_qk + 1 : d_qk}, Call::Kind::input);
  if (perturb == 1) c.require_error("q head_dim != the cache's");
  // The cache: tokens of one page contiguous when fp8 (any block stride: pages padded).
  const int64_t width = fp8 ? kV32Token : d_qk, page_alloc = page + (fp8 ? rng.range(0, 2) : 0);
  const DType cache_dtype = fp8 ? rng.pick({DType::uint8, DType::int8, DType::float8_e4m3fn}) : DType::bfloat16;
  a.k_cache = c.make("k_cache", perturb == 2 ? (fp8 ? DType::bfloat16 : DType::float32) : cache_dtype,
                     {num_blocks, page_alloc, perturb == 3 ? 2 : 1, width}, Call::Kind::input, 0.0, fp8 ? 1.0 : 0.5);
  if (perturb == 2) c.require_error("k_cache dtype");
  if (perturb == 3) c.require_error("two kv heads");
  a.k_cache.shape[1] = page;
  auto token = [&](int64_t slot) {  // the cache row of a slot id (block · page + offset)
    return static_cast<uint8_t*>(a.k_cache.data) +
           (slot / page * a.k_cache.strides[0] + slot % page * a.k_cache.strides[1]) *
               static_cast<int64_t>(attnkit::dtype_size(a.k_cache.dtype));
  };
  auto cache_value = [&](int64_t slot, int64_t e) {
    return fp8 ? v32_value(token(slot), e) : at(a.k_cache, {slot / page, slot % page, 0, e});
  };
  // The rows each (batch, query) uses: sparse slots, or the first lens[b] tokens (causal: fewer).
  if (sparse) {
    a.indices = c.make("indices", DType::int32, {b, s_q, topk}, Call::Kind::input, 0.0, 0.7);
    for (int64_t i = 0; i < b * s_q * topk; ++i) {
      const int64_t u = rng.range(0, 99);
      put_int(*a.indices, i, u < 70 ? rng.range(0, num_blocks * page - 1)
                             : u < 85 ? -1
                                      : rng.pick<int64_t>({num_blocks * page, INT32_MIN, INT32_MAX, -2}));
    }
    if (rng.chance(0.5)) {
      a.topk_length = c.make("topk_length", DType::int32, {b}, Call::Kind::input);
      for (int64_t i = 0; i < b; ++i) put_int(*a.topk_length, i, rng.chance(0.85) ? rng.range(0, topk) : rng.pick<int64_t>({-1, topk + 5}));
    }
    if (perturb == 4) a.causal = true, c.require_error("causal with indices");
  } else {
    a.block_table = c.make("block_table", DType::int32, {b, max_blocks}, Call::Kind::input, 0.0, 0.7);
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t j = 0; j < max_blocks; ++j) {
        int64_t id = j * page < lens[i] ? rng.range(0, num_blocks - 1) : rng.pick<int64_t>({-1, num_blocks, 0});
        if (perturb == 4 && j == 0 && lens[i] > 0) id = rng.pick<int64_t>({-1, num_blocks}), c.require_error("block id");
        put_int(*a.block_table, i * max_blocks + j, id);
      }
    }
    a.cache_seqlens = c.make("cache_seqlens", DType::int32, {b}, Call::Kind::input);
    for (int64_t i = 0; i < b; ++i) {
      int64_t len = lens[i];
      if (perturb == 5 && i == 0) len = rng.pick<int64_t>({-1, max_blocks * page + 1}), c.require_error("cache_seqlens");
      put_int(*a.cache_seqlens, i, len);
    }
    a.causal = rng.chance(0.5);
    if (perturb == 6) a.topk_length = c.make("topk_length", DType::int32, {b}, Call::Kind::input), c.require_error("topk_length without indices");
  }
  if (!sparse && perturb == 7) a.block_table.reset(), c.require_error("no block_table");
  auto used_rows = [&](int64_t bi, int64_t i) {
    std::vector<int64_t> rows;
    if (sparse) {
      int64_t limit = topk;
      if (a.topk_length) limit = std::clamp<int64_t>(get_int(*a.topk_length, bi), 0, topk);
      for (int64_t t = 0; t < limit; ++t) {
        const int64_t slot = get_int(*a.indices, (bi * s_q + i) * topk + t);
        if (slot >= 0 && slot < num_blocks * page) rows.push_back(slot);
      }
      return rows;
    }
    int64_t n = get_int(*a.cache_seqlens, bi);
    if (a.causal) n = std::max<int64_t>(0, n - s_q + i + 1);
    for (int64_t t = 0; t < n; ++t) rows.push_back(get_int(*a.block_table, bi * max_blocks + t / page) * page + t % page);
    return rows;
  };
  // Tokens: all written (fp8); those no valid row uses NaN where the inputs are finite.
  const bool valid_rows = !c.must_fail && (sparse || a.block_table);
  std::set<int64_t> used;
  if (valid_rows) {
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t i = 0; i < s_q; ++i) {
        for (int64_t slot : used_rows(bi, i)) used.insert(slot);
      }
    }
  }
  const bool poison_unused = valid_rows && !c.specials && distinct(a.k_cache);
  for (int64_t slot = 0; slot < num_blocks * page; ++slot) {
    const bool nan = poison_unused && !used.count(slot);
    if (fp8) write_v32_token(token(slot), rng, nan || (c.specials && rng.chance(0.02)));
    for (int64_t e = 0; !fp8 && nan && e < d_qk; ++e) {
      store_value(DType::bfloat16, const_cast<uint8_t*>(element(a.k_cache, {slot / page, slot % page, 0, e})), NAN, rng);
    }
  }
  if (fp8 && perturb == 8 && page > 1) a.k_cache.strides[1] += 1, c.require_error("token stride != 656");
  if (rng.chance(0.4)) a.attn_sink = c.make("attn_sink", DType::float32, {perturb == 9 ? h_q + 1 : h_q}, Call::Kind::input);
  if (perturb == 9 && a.attn_sink) c.require_error("attn_sink shape");
  if (rng.chance(0.3)) {
    a.softmax_scale = rng.pick<double>({0.05, 1.0, -0.3, 0.0, NAN, INFINITY, 1e39});
    if (!std::isfinite(static_cast<float>(*a.softmax_scale))) c.require_error("softmax_scale not finite in float32");
  }
  const bool alias = perturb == 10 && b * s_q * h_q > 0 && head_dim_v >= 2;
  a.out = c.make("out", DType::bfloat16, {b, s_q, h_q, head_dim_v}, Call::Kind::output, 0.05, 0.9);
  if (alias) {
    a.lse = c.alias("lse", c.last(), {b, s_q, h_q}, DType::float32);
    c.require_error("lse aliases out");
  } else {
    a.lse = c.make("lse", perturb == 11 ? DType::float16 : DType::float32, {b, s_q, h_q}, Call::Kind::output, 0.05, 0.9);
    if (perturb == 11) c.require_error("lse float16");
  }
  maybe_null_data(c, {&a.q, &a.k_cache, opt(a.indices), opt(a.block_table),
                      opt(a.cache_seqlens), opt(a.topk_length),
                      opt(a.attn_sink), &a.out, &a.lse});
  if (!c.run([&] { attnkit::flash_mla_with_kvcache(a); })) return false;
  if (c.specials || (a.softmax_scale && std::fabs(*a.softmax_scale) > 100)) return true;
  // Three (batch, query, head) rows against python/attnkit/dsa.py's semantics.
  const double scale = static_cast<float>(a.softmax_scale ? *a.softmax_scale : 1.0 / std::sqrt(static_cast<double>(d_qk)));
  for (int probe = 0; probe < 3 && b * s_q * h_q > 0; ++probe) {
    const int64_t bi = rng.range(0, b - 1), i = rng.range(0, s_q - 1), h = rng.range(0, h_q - 1);
    const std::vector<int64_t> rows = used_rows(bi, i);
    const RowRef want = attend_row(
        static_cast<int64_t>(rows.size()), head_dim_v, [](int64_t) { return true; },
        [&](int64_t j) {
          double dot = 0;
          for (int64_t e = 0; e < d_qk; ++e) dot += at(a.q, {bi, i, h, e}) * cache_value(rows[j], e);
          return dot * scale;
        },
        [&](int64_t j, int64_t e) { return cache_value(rows[j], e); },
        a.attn_sink ? std::optional<double>(at(*a.attn_sink, {h})) : std::nullopt);
    const std::string what = "batch " + std::to_string(bi) + " query " + std::to_string(i) + " head " + std::to_string(h);
    expect_row(want, [&](int64_t e) { return at(a.out, {bi, i, h, e}); }, std::nullopt, DType::bfloat16, what);
    expect_stats(want, at(a.lse, {bi, i, h}), std::nullopt, what);
  }
  return true;
}

bool fuzz_quantize_v32(Call& c) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.3);
  const int64_t n = rng.pick<int64_t>({0, 1, 2, 3, 17});
  const int perturb = rng.chance(0.2) ? static_cast<int>(rng.range(0, 4)) : -1;
  c.log << "quantize_v32_kv n=" << n << "\n";
  const DType dtype = perturb == 0 ? DType::float16 : rng.pick({DType::bfloat16, DType::float32});
  if (perturb == 0) c.require_error("kv float16");
  const TensorView kv = c.make("kv", dtype, {n, perturb == 1 ? 575 : 576}, Call::Kind::input);
  if (perturb == 1) c.require_error("575 columns");
  Tensor& kv_tensor = c.last();
  TensorView dst;
  if (perturb == 2 && Call::fits(kv_tensor, {n, kV32Token}, DType::uint8)) {
    dst = c.alias("dst", kv_tensor, {n, kV32Token}, DType::uint8);
    c.require_error("dst aliases kv");
  } else {
    dst = c.make("dst", perturb == 3 ? DType::int32 : DType::uint8, {n, perturb == 4 ? 655 : kV32Token},
                 Call::Kind::output, 0.05, 0.9);
    if (perturb == 3 || perturb == 4) c.require_error("dst dtype or shape");
  }
  TensorView kv_arg = kv, dst_arg = dst;
  maybe_null_data(c, {&kv_arg, &dst_arg});
  if (!c.run([&] { attnkit::quantize_v32_kv(kv_arg, dst_arg); })) return false;
  // Every byte against FlashMLA's quantiser (tests/quant.py, float32 arithmetic): per tile
  // scale = 2^ceil(log2(max(amax / 448, 1e-4))), value e4m3(x / scale); rope bf16.
  for (int64_t r = 0; r < n; ++r) {
    uint8_t want[kV32Token];
    for (int64_t tile = 0; tile < kV32Nope / kV32Tile; ++tile) {
      float amax = 0.0f;
      for (int64_t e = tile * kV32Tile; e < (tile + 1) * kV32Tile; ++e) {
        amax = std::max(amax, std::fabs(static_cast<float>(at(kv, {r, e}))));
      }
      const float scale = std::exp2(std::ceil(std::log2(std::max(amax / 448.0f, 1e-4f))));
      for (int64_t e = tile * kV32Tile; e < (tile + 1) * kV32Tile; ++e) {
        want[e] = attnkit::float_to_float8_e4m3fn(static_cast<float>(at(kv, {r, e})) / scale);
      }
      std::memcpy(want + kV32Nope + 4 * tile, &scale, 4);
    }
    for (int64_t e = 0; e < kV32Rope; ++e) {
      const uint16_t bits = attnkit::float_to_bfloat16(static_cast<float>(at(kv, {r, kV32Nope + e})));
      std::memcpy(want + kV32Nope + 16 + 2 * e, &bits, 2);
    }
    for (int64_t byte = 0; byte < kV32Token; ++byte) {
      ++g_compared;
      const uint8_t got = *element(dst, {r, byte});
      if (got != want[byte]) {
        throw Failure{"token " + std::to_string(r) + " byte " + std::to_string(byte) + ": got " + std::to_string(got) +
                      ", FlashMLA's quantiser " + std::to_string(want[byte])};
      }
    }
  }
  return true;
}


// ---- the lightning indexer's logits and top-k

namespace {

// Logits against the double reference Σ_h w·ReLU(q·k)·k_scale: float32 sums of exact e4m3
// products, a few float32 ulps of the magnitude Σ_h |w|·Σ_d|q k|·|k_scale| (tests/python's
// LOGITS_RTOL / LOGITS_ATOL).
struct LogitRef {
  double value = 0, mag = 0;
};
LogitRef indexer_logit(int64_t heads, int64_t dim, const std::function<double(int64_t, int64_t)>& q,
                       const std::function<double(int64_t)>& k, double k_scale,
                       const std::function<double(int64_t)>& weight) {
  LogitRef r;
  for (int64_t h = 0; h < heads; ++h) {
    double dot = 0, mag = 0;
    for (int64_t d = 0; d < dim; ++d) dot += q(h, d) * k(d), mag += std::fabs(q(h, d) * k(d));
    r.value += weight(h) * std::max(dot, 0.0) * k_scale;
    r.mag += std::fabs(weight(h)) * mag * std::fabs(k_scale);
  }
  return r;
}
void expect_logit(double got, const LogitRef& want, const std::string& what) {
  expect_near(got, want.value, 1e-5 * (want.mag + 1) + 1e-5 * std::fabs(want.value), what);
}

// An element outside a row's keys: -inf when the op cleans, else still its poison.
void expect_outside(const TensorView& logits, int64_t row, int64_t col, bool clean, const std::string& what) {
  const uint8_t* p = element(logits, {row, col});
  float x;
  std::memcpy(&x, p, 4);
  if (clean ? x != -INFINITY : !Call::is_poison(DType::float32, p)) {
    throw Failure{what + ": row " + std::to_string(row) + " column " + std::to_string(col) + " is outside its keys, got " +
                  std::to_string(x) + (clean ? " (want -inf)" : " (want it unwritten)")};
  }
}

// Row r's top-k (value desc, then index asc; -inf and NaN never chosen) of values(t), t < n,
// mapped by slot(t); -1 fills.
std::vector<int64_t> top_k(int64_t n, int64_t k, const std::function<float(int64_t)>& values,
                           const std::function<int64_t(int64_t)>& slot) {
  std::vector<std::pair<float, int64_t>> cand;
  for (int64_t t = 0; t < n; ++t) {
    const float v = values(t);
    if (v > -INFINITY) cand.push_back({v, t});
  }
  std::sort(cand.begin(), cand.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first > y.first : x.second < y.second;
  });
  std::vector<int64_t> out(k, -1);
  for (int64_t j = 0; j < k && j < static_cast<int64_t>(cand.size()); ++j) out[j] = slot(cand[j].second);
  return out;
}

void expect_indices(const TensorView& out, int64_t row, const std::vector<int64_t>& want, const std::string& what) {
  for (size_t j = 0; j < want.size(); ++j) {
    ++g_compared;
    const int64_t got = get_int(out, row * static_cast<int64_t>(want.size()) + static_cast<int64_t>(j));
    if (got != want[j]) {
      throw Failure{what + ": row " + std::to_string(row) + " position " + std::to_string(j) + ": got " +
                    std::to_string(got) + ", the reference " + std::to_string(want[j])};
    }
  }
}

bool fuzz_flat_logits(Call& c) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.15);
  const int64_t T = rng.pick<int64_t>({0, 1, 2, 3, 7, 17}), S = rng.pick<int64_t>({0, 1, 2, 5, 31, 64, 65, 200, 600});
  int64_t H = rng.pick<int64_t>({1, 2, 3, 8, 32, 64}), D = rng.pick<int64_t>({32, 64, 128});
  while (T * H * S * D > (int64_t{2} << 20) && H > 1) H /= 2;
  const int mode = static_cast<int>(rng.range(0, 2));  // logits, compressed logits, fused top-k
  const int perturb = rng.chance(0.25) ? static_cast<int>(rng.range(0, 6)) : -1;
  c.log << "fp8_mqa_logits T=" << T << " S=" << S << " H=" << H << " D=" << D << " mode=" << mode << "\n";
  attnkit::IndexerLogitsArgs a;
  a.q = c.make("q", perturb == 0 ? DType::bfloat16 : DType::float8_e4m3fn, {T, H, perturb == 1 ? D + 16 : D},
               Call::Kind::input);
  if (perturb == 0 || perturb == 1) c.require_error("q dtype or head dim");
  a.kv = c.make("kv", DType::float8_e4m3fn, {S, D}, Call::Kind::input);
  a.kv_scale = c.make("kv_scale", DType::float32, {perturb == 2 ? S + 1 : S}, Call::Kind::input);
  if (perturb == 2) c.require_error("kv_scale shape");
  a.weights = c.make("weights", DType::float32, {T, H}, Call::Kind::input);
  a.ks = c.make("ks", DType::int32, {T}, Call::Kind::input);
  a.ke = c.make("ke", DType::int32, {T}, Call::Kind::input);
  for (int64_t t = 0; t < T; ++t) {  // ranges clipped to [0, S) by the op
    const int64_t ks = rng.chance(0.8) ? rng.range(0, S) : rng.range(-3, S + 2);
    put_int(a.ks, t, ks);
    put_int(a.ke, t, rng.chance(0.8) ? rng.range(ks, S) : ks + rng.range(-2, S + 3));
  }
  const int64_t width = mode == 1 ? rng.range(1, S + 3) : S;
  a.clean_logits = mode == 1 ? perturb == 3 : rng.chance(0.5);
  if (mode == 1) a.max_seqlen_k = width;
  if (mode == 1 && perturb == 3) c.require_error("compressed logits with clean_logits");
  const int64_t topk = rng.pick<int64_t>({1, 2, 5, 64, 700});
  if (mode == 2) {
    a.topk_indices = c.make("topk_indices", DType::int32, {T, topk}, Call::Kind::output, 0.05, 0.9);
    if (perturb == 4) a.logits = c.make("logits", DType::float32, {T, width}, Call::Kind::output), c.require_error("both outputs");
  } else if (perturb != 4) {
    a.logits = c.make("logits", DType::float32, {T, perturb == 5 ? width + 1 : width}, Call::Kind::output, 0.05, 0.7);
    c.last().partly_written = !a.clean_logits;
    if (perturb == 5) c.require_error("logits shape");
  } else {
    c.require_error("no output");
  }
  if (perturb == 6) a.max_seqlen_k = -1, c.require_error("max_seqlen_k < 0");
  maybe_null_data(c, {&a.q, &a.kv, &a.kv_scale, &a.weights, &a.ks, &a.ke, opt(a.logits),
                      opt(a.topk_indices)});
  if (!c.run([&] { attnkit::fp8_mqa_logits(a); })) return false;
  auto key_range = [&](int64_t t) {
    return std::pair{std::max<int64_t>(get_int(a.ks, t), 0), std::min<int64_t>(get_int(a.ke, t), S)};
  };
  auto logit = [&](int64_t t, int64_t s) {
    return indexer_logit(
        H, D, [&](int64_t h, int64_t d) { return at(a.q, {t, h, d}); }, [&](int64_t d) { return at(a.kv, {s, d}); },
        at(a.kv_scale, {s}), [&](int64_t h) { return at(a.weights, {t, h}); });
  };
  if (a.logits) {  // every row's outside; three rows' keys against the reference
    std::set<int64_t> probes;
    for (int i = 0; i < 3 && T > 0; ++i) probes.insert(rng.range(0, T - 1));
    for (int64_t t = 0; t < T; ++t) {
      const auto [lo, hi] = key_range(t);
      for (int64_t col = 0; col < width; ++col) {
        const int64_t s = mode == 1 ? get_int(a.ks, t) + col : col;
        if (s < lo || s >= hi) {
          expect_outside(*a.logits, t, col, a.clean_logits, "fp8_mqa_logits");
        } else if (!c.specials && probes.count(t)) {
          expect_logit(at(*a.logits, {t, col}), logit(t, s), "logits[" + std::to_string(t) + ", " + std::to_string(col) + "]");
        }
      }
    }
    return true;
  }
  // The fused top-k is the top-k of the op's own logits (bit for bit), as offsets from ks.
  std::vector<float> logits(T * S);
  attnkit::IndexerLogitsArgs full = a;
  full.topk_indices.reset();
  full.clean_logits = true;
  full.logits = TensorView(logits.data(), DType::float32, {T, S});
  attnkit::fp8_mqa_logits(full);
  for (int64_t t = 0; t < T; ++t) {
    const auto [lo, hi] = key_range(t);
    const int64_t ks = get_int(a.ks, t);
    const std::vector<int64_t> want = top_k(
        std::max<int64_t>(hi - lo, 0), topk, [&](int64_t i) { return logits[t * S + lo + i]; },
        [&](int64_t i) { return lo + i - ks; });
    expect_indices(*a.topk_indices, t, want, "fp8_mqa_logits' fused top-k");
  }
  return true;
}

bool fuzz_paged_logits(Call& c) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.15);
  const int64_t B = rng.pick<int64_t>({0, 1, 2, 3}), next_n = rng.pick<int64_t>({1, 1, 2, 3});
  int64_t H = rng.pick<int64_t>({1, 2, 8, 32}), D = rng.pick<int64_t>({32, 64, 128});
  const int64_t page = rng.pick<int64_t>({1, 2, 16, 61, 64});
  std::vector<int64_t> lens(B * next_n);
  int64_t longest = 0;
  for (int64_t& len : lens) len = rng.pick<int64_t>({0, 1, 5, 64, 65, 200}), longest = std::max(longest, len);
  while (B * next_n * H * longest * D > (int64_t{2} << 20) && H > 1) H /= 2;
  const int64_t max_context_len = longest + rng.range(0, 3);
  const int64_t max_blocks = (longest + page - 1) / page + rng.range(0, 1);
  const int64_t num_blocks = std::max<int64_t>(1, max_blocks * B / 2 + rng.range(0, 2));
  const int perturb = rng.chance(0.25) ? static_cast<int>(rng.range(0, 6)) : -1;
  c.log << "fp8_paged_mqa_logits B=" << B << " next_n=" << next_n << " H=" << H << " D=" << D << " page=" << page
        << " num_blocks=" << num_blocks << " max_context_len=" << max_context_len << "\n";
  attnkit::PagedIndexerLogitsArgs a;
  a.q = c.make("q", DType::float8_e4m3fn, {B, next_n, H, D}, Call::Kind::input);
  // The index-K cache: per page, page·D e4m3 values, then page float32 scales; pages padded.
  const int64_t page_alloc = page + rng.range(0, 1);
  a.kv_cache = c.make("kv_cache", rng.pick({DType::uint8, DType::int8, DType::float8_e4m3fn}),
                      {num_blocks, page_alloc, 1, perturb == 0 ? D + 2 : D + 4}, Call::Kind::input, 0.0, 1.0);
  if (perturb == 0) c.require_error("kv_cache head_dim + 2");
  a.kv_cache.shape[1] = page;
  auto block_base = [&](int64_t block) { return static_cast<uint8_t*>(a.kv_cache.data) + block * a.kv_cache.strides[0]; };
  a.weights = c.make("weights", DType::float32, {B * next_n, H}, Call::Kind::input);
  const bool one_d = next_n == 1 && rng.chance(0.3);
  a.context_lens = c.make("context_lens", DType::int32, one_d ? std::vector<int64_t>{B} : std::vector<int64_t>{B, next_n},
                          Call::Kind::input);
  for (int64_t i = 0; i < B * next_n; ++i) put_int(a.context_lens, i, perturb == 1 && i == 0 ? max_context_len + 1 : lens[i]);
  a.block_table = c.make("block_table", DType::int32, {B, max_blocks}, Call::Kind::input, 0.0, 0.7);
  for (int64_t b = 0; b < B; ++b) {  // the pages a batch's rows use in range, the rest anything
    const int64_t pages = (*std::max_element(lens.begin() + b * next_n, lens.begin() + (b + 1) * next_n) + page - 1) / page;
    for (int64_t j = 0; j < max_blocks; ++j) {
      int64_t id = j < pages ? rng.range(0, num_blocks - 1) : rng.pick<int64_t>({-1, num_blocks, 0});
      if (perturb == 2 && j == 0) id = rng.pick<int64_t>({-1, num_blocks});
      put_int(a.block_table, b * max_blocks + j, id);
    }
  }
  // Validity from the values in memory; then NaN in every token no row reads.
  auto len_of = [&](int64_t b, int64_t n) { return get_int(a.context_lens, b * next_n + n); };
  bool valid = true;
  for (int64_t b = 0; b < B; ++b) {
    int64_t batch_longest = 0;
    for (int64_t n = 0; n < next_n; ++n) {
      const int64_t len = len_of(b, n);
      if (len < 0 || len > max_context_len || len > max_blocks * page) valid = false;
      batch_longest = std::max(batch_longest, len);
    }
    for (int64_t j = 0; valid && j < (batch_longest + page - 1) / page; ++j) {
      const int64_t id = get_int(a.block_table, b * max_blocks + j);
      if (id < 0 || id >= num_blocks) valid = false;
    }
  }
  if (!valid) c.require_error("context_lens or block_table values");
  std::set<std::pair<int64_t, int64_t>> used;  // (block, offset)
  for (int64_t b = 0; valid && b < B; ++b) {
    for (int64_t n = 0; n < next_n; ++n) {
      for (int64_t s = 0; s < len_of(b, n); ++s) used.insert({get_int(a.block_table, b * max_blocks + s / page), s % page});
    }
  }
  const int64_t d_cache = a.kv_cache.shape[3] - 4;
  for (int64_t block = 0; perturb != 0 && block < num_blocks; ++block) {
    for (int64_t t = 0; t < page; ++t) {
      const bool nan = valid && !c.specials && !used.count({block, t});
      uint8_t* values = block_base(block) + t * d_cache;
      for (int64_t d = 0; d < d_cache; ++d) values[d] = nan ? 0x7F : attnkit::float_to_float8_e4m3fn(static_cast<float>(rng.normal()));
      const float scale = nan ? NAN : static_cast<float>(std::fabs(rng.normal()) + 0.01);
      std::memcpy(block_base(block) + page * d_cache + 4 * t, &scale, 4);
    }
  }
  a.max_context_len = perturb == 3 ? -1 : max_context_len;
  if (perturb == 3) c.require_error("max_context_len < 0");
  a.clean_logits = rng.chance(0.5);
  a.logits = c.make("logits", DType::float32, {B * next_n, perturb == 4 ? max_context_len + 1 : max_context_len},
                    Call::Kind::output, 0.05, 0.7);
  c.last().partly_written = !a.clean_logits;
  if (perturb == 4) c.require_error("logits shape");
  if (perturb == 5) a.q.dtype = DType::uint8, c.require_error("q uint8");
  maybe_null_data(c, {&a.q, &a.kv_cache, &a.weights, &a.context_lens, &a.block_table, &a.logits});
  if (!c.run([&] { attnkit::fp8_paged_mqa_logits(a); })) return false;
  std::set<int64_t> probes;
  for (int i = 0; i < 3 && B > 0; ++i) probes.insert(rng.range(0, B * next_n - 1));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < next_n; ++n) {
      const int64_t row = b * next_n + n, len = len_of(b, n);
      for (int64_t s = 0; s < max_context_len; ++s) {
        if (s >= len) {
          expect_outside(a.logits, row, s, a.clean_logits, "fp8_paged_mqa_logits");
          continue;
        }
        if (c.specials || !probes.count(row)) continue;
        const uint8_t* base = block_base(get_int(a.block_table, b * max_blocks + s / page));
        float scale;
        std::memcpy(&scale, base + page * D + 4 * (s % page), 4);
        const LogitRef want = indexer_logit(
            H, D, [&](int64_t h, int64_t d) { return at(a.q, {b, n, h, d}); },
            [&](int64_t d) { return attnkit::float8_e4m3fn_to_float(base[s % page * D + d]); }, scale,
            [&](int64_t h) { return at(a.weights, {row, h}); });
        expect_logit(at(a.logits, {row, s}), want, "logits[" + std::to_string(row) + ", " + std::to_string(s) + "]");
      }
    }
  }
  return true;
}

}  // namespace

bool fuzz_indexer_logits(Call& c, bool paged) { return paged ? fuzz_paged_logits(c) : fuzz_flat_logits(c); }

bool fuzz_topk(Call& c) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.3);
  int64_t N = rng.pick<int64_t>({0, 1, 2, 3, 5, 9});
  const int64_t L = rng.pick<int64_t>({0, 1, 2, 7, 64, 65, 300, 2100});
  int64_t topk = rng.pick<int64_t>({1, 2, 3, 8, 64, 100, 300, 2048});
  const int mode = static_cast<int>(rng.range(0, 2));  // row-relative, ragged, paged
  const int perturb = rng.chance(0.25) ? static_cast<int>(rng.range(0, 5)) : -1;
  c.log << "topk_transform N=" << N << " L=" << L << " topk=" << topk << " mode=" << mode << "\n";
  attnkit::TopkArgs a;
  a.logits = c.make("logits", DType::float32, {N, L}, Call::Kind::input);
  const bool ties = rng.chance(0.5);  // few distinct values: the index order decides
  for (int64_t i = 0; i < N * L; ++i) {
    float x = ties ? static_cast<float>(rng.range(-2, 2)) : static_cast<float>(rng.normal());
    if (c.specials && rng.chance(0.1)) x = rng.pick<float>({-INFINITY, NAN, INFINITY, -NAN});
    put_float(a.logits, i, x);
  }
  a.lengths = c.make("lengths", DType::int32, {N}, Call::Kind::input);
  const bool starts = rng.chance(0.5);
  if (starts) a.row_starts = c.make("row_starts", DType::int32, {N}, Call::Kind::input);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t len = rng.range(0, L), start = rng.range(0, L - len);
    put_int(a.lengths, r, perturb == 0 && r == 0 ? rng.pick<int64_t>({-1, L + 1}) : len);
    if (starts) put_int(*a.row_starts, r, start);
  }
  if (mode == 1) {
    a.offsets = c.make("offsets", DType::int32, {N}, Call::Kind::input);
    for (int64_t r = 0; r < N; ++r) put_int(*a.offsets, r, perturb == 1 && r == 0 ? -1 : rng.range(0, 5000));
  }
  int64_t batches = 0, max_pages = 0;
  if (mode == 2) {
    a.page_size = rng.pick<int64_t>({1, 2, 3, 64});
    batches = rng.chance(0.5) ? N : rng.range(1, 3);
    max_pages = (L + a.page_size - 1) / a.page_size + rng.range(0, 1);
    if (batches != N || rng.chance(0.3)) {
      a.row_to_batch = c.make("row_to_batch", DType::int32, {N}, Call::Kind::input);
      for (int64_t r = 0; r < N; ++r) put_int(*a.row_to_batch, r, perturb == 1 && r == 0 ? batches : rng.range(0, batches - 1));
    }
    a.page_table = c.make("page_table", DType::int32, {batches, max_pages}, Call::Kind::input, 0.0, 0.7);
    for (int64_t i = 0; i < batches * max_pages; ++i) {
      put_int(*a.page_table, i, perturb == 2 && i == 0 ? -1 : rng.range(0, 1000));
    }
  }
  if (perturb == 3) a.offsets = a.lengths, a.page_table = a.logits, c.require_error("offsets and page_table");
  if (perturb == 4) topk = 0, c.require_error("topk 0");
  a.topk = topk;
  a.out = c.make("out", DType::int32, {N, std::max<int64_t>(topk, 1)}, Call::Kind::output, 0.05, 0.9);
  // Validity from the values in memory.
  std::vector<int64_t> len(N), start(N);
  bool valid = true;
  std::vector<int64_t> keys_used(batches, 0);
  for (int64_t r = 0; r < N; ++r) {
    len[r] = get_int(a.lengths, r), start[r] = starts ? get_int(*a.row_starts, r) : 0;
    if (len[r] < 0 || start[r] + len[r] > L) valid = false;
    if (mode == 1 && perturb != 3 && get_int(*a.offsets, r) < 0) valid = false;
    if (mode == 2 && perturb != 3) {
      const int64_t b = a.row_to_batch ? get_int(*a.row_to_batch, r) : r;
      if (b < 0 || b >= batches || len[r] > max_pages * a.page_size) valid = false;
      else keys_used[b] = std::max(keys_used[b], len[r]);
    }
  }
  for (int64_t b = 0; mode == 2 && perturb != 3 && b < batches; ++b) {
    for (int64_t j = 0; j * a.page_size < keys_used[b]; ++j) {
      if (get_int(*a.page_table, b * max_pages + j) < 0) valid = false;
    }
  }
  if (!valid) c.require_error("lengths, row_starts, offsets, row_to_batch or page_table values");
  maybe_null_data(c, {&a.logits, &a.lengths, opt(a.row_starts), opt(a.offsets),
                      opt(a.page_table), opt(a.row_to_batch), &a.out});
  if (!c.run([&] { attnkit::topk_transform(a); })) return false;
  for (int64_t r = 0; r < N; ++r) {  // exact: a selection of float32 values
    const std::vector<int64_t> want = top_k(
        len[r], topk, [&](int64_t t) { return get_float(a.logits, r * L + start[r] + t); },
        [&](int64_t t) -> int64_t {
          if (mode == 1) return t + get_int(*a.offsets, r);
          if (mode == 2) {
            const int64_t b = a.row_to_batch ? get_int(*a.row_to_batch, r) : r;
            return get_int(*a.page_table, b * max_pages + t / a.page_size) * a.page_size + t % a.page_size;
          }
          return t;
        });
    expect_indices(a.out, r, want, "topk_transform");
  }
  return true;
}

}  // namespace attnkit_fuzz
