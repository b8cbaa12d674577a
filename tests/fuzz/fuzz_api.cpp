// A seeded random-call fuzz driver over attnkit's C++ API: attention, sage_attention (int8
// and fp4), the serving ops (varlen_attention and its backward, paged_attention with
// same-dtype and fp8 caches, append_kv_cache), merge_attention_states, attention_backward,
// and the DeepSeek sparse attention ops (fuzz_dsa.cpp: sparse_mla_prefill_fwd and
// sparse_mla_q8kv8_prefill_fwd, flash_mla_with_kvcache, quantize_v32_kv, fp8_mqa_logits,
// fp8_paged_mqa_logits, topk_transform), on every ISA and a few thread counts.
// Shapes include 0, 1, odd sizes and tile edges; strides are contiguous, permuted, padded,
// stepped, negative and zero (inputs), or overlapping and aliasing (outputs, which must then
// be rejected); a view may lose its data pointer. Index arrays (cu_seqlens, seq_lens, block
// tables, slots, sparse indices, key ranges) hold valid values
// and, sometimes, wrong ones; the call's validity is judged from the values actually in
// memory. Every tensor lives in a heap block of exactly its span, so AddressSanitizer sees
// any read or write outside it.
//
// The contract checked per call: it throws attnkit::Error (always, when the call was made
// invalid on purpose: bad index values, scales, shapes, dtypes, overlapping or aliasing
// outputs), or it returns with every output element written (outputs are poisoned with a
// signalling-NaN pattern no kernel writes) and nothing outside them touched; inputs are never
// modified either way. Valid calls on finite inputs are also compared on a few elements with
// a double-precision reference (append_kv_cache, quantize_v32_kv and top-k: every element,
// bit for bit): every op but sage's lossy modes (tests/python compares those). Outputs a
// contract leaves partly unwritten (the indexer's logits with clean_logits=False) are
// checked element by element: written inside the row's keys, untouched outside.
//
//   attnkit_fuzz [--seconds S] [--calls N] [--seed X] [--replay SEED] [--verbose]
// S defaults to ATTNKIT_FUZZ_SECONDS or 120. Each call has its own seed, printed on
// failure (and on a crash, by the signal/sanitizer hooks); --replay SEED reruns that call.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "attnkit/attnkit.h"
#include "fuzz_call.h"
#include "fuzz_dsa.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

namespace {

using namespace attnkit_fuzz;

// The seed of the call in flight, for the crash hooks.
volatile uint64_t g_current_seed = 0;
volatile bool g_in_call = false;

void print_current_seed() {
  if (!g_in_call) return;
  char msg[96];
  const int n = std::snprintf(msg, sizeof msg, "\nattnkit_fuzz: crashed in the call with seed 0x%016llx (--replay it)\n",
                              static_cast<unsigned long long>(g_current_seed));
  if (n > 0) (void)!write(2, msg, static_cast<size_t>(n));
}

void on_signal(int sig) {
  print_current_seed();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// ---- attention and sage_attention

DType attention_dtype(Rng& rng) { return rng.pick({DType::float32, DType::float16, DType::bfloat16}); }

int64_t pick_len(Rng& rng) {
  return rng.pick<int64_t>({0, 1, 1, 2, 3, 5, 7, 16, 17, 31, 47, 48, 49, 64, 95, 127, 128, 129, 200, 257});
}
int64_t pick_head_dim(Rng& rng) {
  return rng.pick<int64_t>({1, 2, 3, 4, 7, 8, 15, 16, 17, 24, 31, 32, 33, 48, 64, 64, 96, 128, 128});
}

// Keeps a call's work bounded (sanitizer builds run ~5-20x slower).
bool too_big(int64_t rows, int64_t keys, int64_t d) { return rows * keys * d > (int64_t{3} << 20); }

enum class Api {
  attention, sage_int8, sage_fp4, sparse_mla, sparse_q8kv8, varlen, paged, append_kv, merge, backward,
  mla_decode, quantize_v32, indexer_logits, paged_indexer_logits, topk
};
const char* api_name(Api a) {
  switch (a) {
    case Api::attention: return "attention";
    case Api::sage_int8: return "sage_attention(int8)";
    case Api::sage_fp4: return "sage_attention(fp4)";
    case Api::sparse_mla: return "sparse_mla_prefill_fwd";
    case Api::sparse_q8kv8: return "sparse_mla_q8kv8_prefill_fwd";
    case Api::varlen: return "varlen_attention";
    case Api::paged: return "paged_attention";
    case Api::append_kv: return "append_kv_cache";
    case Api::merge: return "merge_attention_states";
    case Api::backward: return "attention_backward";
    case Api::mla_decode: return "flash_mla_with_kvcache";
    case Api::quantize_v32: return "quantize_v32_kv";
    case Api::indexer_logits: return "fp8_mqa_logits";
    case Api::paged_indexer_logits: return "fp8_paged_mqa_logits";
    case Api::topk: return "topk_transform";
  }
  return "?";
}

std::vector<int64_t> layout_shape(attnkit::Layout layout, int64_t b, int64_t h, int64_t s, int64_t d) {
  return layout == attnkit::Layout::BHSD ? std::vector<int64_t>{b, h, s, d} : std::vector<int64_t>{b, s, h, d};
}

void check_attention_rows(Call& c, const attnkit::AttentionArgs& a, int64_t Hq, int64_t Hkv, int64_t Sq,
                          int64_t Skv, int64_t D, int64_t Dv);

bool fuzz_attention(Call& c, Api api) {
  Rng& rng = c.rng;
  const bool sage = api != Api::attention, fp4 = api == Api::sage_fp4;
  c.specials = sage || rng.chance(0.2);  // exact attention on finite inputs is compared with a reference
  int64_t B = rng.pick<int64_t>({0, 1, 1, 2, 3}), Hkv = rng.pick<int64_t>({0, 1, 1, 2, 3});
  const int64_t group = rng.pick<int64_t>({1, 1, 2, 3, 4, 8});
  int64_t Hq = Hkv * group;
  int64_t Sq = pick_len(rng), Skv = pick_len(rng);
  if (rng.chance(0.15)) Sq = rng.pick<int64_t>({1, 2, 4}), Skv = rng.pick<int64_t>({600, 1100, 2049});  // decode, key splits
  int64_t D = pick_head_dim(rng), Dv = rng.chance(0.5) ? D : pick_head_dim(rng);
  if (fp4) D = 16 * rng.range(1, 4), Dv = D, Sq = std::min<int64_t>(Sq, 40), Skv = std::min<int64_t>(Skv, 130);
  while (too_big(B * Hq * Sq, Skv, D + Dv)) Sq = (Sq + 1) / 2, Skv = Skv / 2;
  DType dtype = attention_dtype(rng);
  const auto layout = rng.chance(0.7) ? attnkit::Layout::BHSD : attnkit::Layout::BSHD;
  // Invalid on purpose, sometimes: the op must say so (checked only where the contract
  // promises an Error; other perturbations just have to be handled).
  const int perturb = rng.chance(0.25) ? static_cast<int>(rng.range(0, 9)) : -1;
  if (perturb == 0) D = rng.pick<int64_t>({0, 513}), c.require_error("D out of range");
  if (perturb == 1) Hq = Hq + 1;  // not a multiple of Hkv
  c.log << api_name(api) << " B=" << B << " Hq=" << Hq << " Hkv=" << Hkv << " Sq=" << Sq << " Skv=" << Skv
        << " D=" << D << " Dv=" << Dv << " layout=" << (layout == attnkit::Layout::BHSD ? "BHSD" : "BSHD") << "\n";
  attnkit::AttentionArgs a;
  a.layout = layout;
  a.q = c.make("q", dtype, layout_shape(layout, B, Hq, Sq, D), Call::Kind::input);
  const Tensor& q_tensor = c.last();
  a.k = c.make("k", perturb == 2 ? attention_dtype(rng) : dtype, layout_shape(layout, B, Hkv, Skv, D), Call::Kind::input);
  a.v = c.make("v", dtype, layout_shape(layout, B, Hkv, Skv, perturb == 3 ? Dv + 1 : Dv), Call::Kind::input);
  const bool alias_out = perturb == 4 && B * Hq * Sq > 0 && q_tensor.block;
  if (alias_out && D == Dv) {
    a.out = c.alias("out", q_tensor, layout_shape(layout, B, Hq, Sq, Dv), dtype);
    c.require_error("out aliases q");
  } else {
    a.out = c.make("out", dtype, layout_shape(layout, B, Hq, Sq, Dv), Call::Kind::output, 0.1);
  }
  if (rng.chance(0.5)) {
    a.lse = c.make("lse", DType::float32, {B, Hq, Sq}, Call::Kind::output, 0.1);
  }
  a.causal = rng.pick({attnkit::Causal::none, attnkit::Causal::top_left, attnkit::Causal::bottom_right});
  if (rng.chance(0.5)) {
    a.scale = rng.chance(0.8) ? rng.normal() : rng.pick<double>({0.0, -1.0, NAN, INFINITY, 1e39, 3e38});
    if (!std::isfinite(static_cast<float>(*a.scale))) c.require_error("scale not finite in float32");
  }
  a.enable_gqa = Hq != Hkv || rng.chance(0.5);
  if (perturb == 5) a.enable_gqa = false;
  if (!sage) {
    if (rng.chance(0.3)) {
      a.dropout_p = rng.pick<double>({0.1, 0.5, 0.99, perturb == 6 ? 1.0 : 0.25, perturb == 6 ? -0.1 : 0.0});
      if (!(a.dropout_p >= 0 && a.dropout_p < 1)) c.require_error("dropout_p out of range");
      if (rng.chance(0.7)) a.seed = rng.bits();
    }
    if (rng.chance(0.35)) {  // a mask broadcastable to [B, Hq, Sq, Skv]
      std::vector<int64_t> full = {B, Hq, Sq, Skv}, shape;
      const int rank = static_cast<int>(rng.range(1, 4));
      for (int d = 4 - rank; d < 4; ++d) shape.push_back(rng.chance(0.3) ? 1 : full[d]);
      if (perturb == 7 && !shape.empty()) shape.back() += 1;
      const DType mdt = rng.pick({DType::boolean, DType::float32, DType::float16, DType::bfloat16,
                                  perturb == 8 ? DType::int32 : DType::boolean});
      a.attn_mask = c.make("attn_mask", mdt, shape, Call::Kind::input);
    }
  }
  c.log << "  causal=" << static_cast<int>(a.causal) << " scale=" << (a.scale ? std::to_string(*a.scale) : "default")
        << " dropout_p=" << a.dropout_p << " enable_gqa=" << a.enable_gqa << "\n";
  if (sage) {
    attnkit::SageArgs s;
    s.q = a.q, s.k = a.k, s.v = a.v, s.out = a.out, s.lse = a.lse, s.causal = a.causal, s.scale = a.scale;
    s.layout = a.layout;
    s.mode = fp4 ? attnkit::SageMode::fp4 : attnkit::SageMode::int8;
    maybe_null_data(c, {&s.q, &s.k, &s.v, &s.out, opt(s.lse)});
    return c.run([&] { attnkit::sage_attention(s); });
  }
  maybe_null_data(c, {&a.q, &a.k, &a.v, &a.out, opt(a.lse), opt(a.attn_mask)});
  if (!c.run([&] { attnkit::attention(a); })) return false;
  // (a scale of 3e38 overflows the float32 scores, as in every float32 attention)
  if (!c.specials && a.dropout_p == 0 && (!a.scale || std::fabs(*a.scale) < 100)) {
    check_attention_rows(c, a, Hq, Hkv, Sq, Skv, D, Dv);
  }
  return true;
}

// attend_row, with the causal conventions, the mask (bool: visible where set; float: added
// to the scores) broadcast from its trailing dims, GQA and either layout.
void check_attention_rows(Call& c, const attnkit::AttentionArgs& a, int64_t Hq, int64_t Hkv, int64_t Sq,
                          int64_t Skv, int64_t D, int64_t Dv) {
  const int64_t B = a.q.shape[0];
  if (B * Hq * Sq == 0) return;
  const bool bhsd = a.layout == attnkit::Layout::BHSD;
  auto at4 = [&](const TensorView& t, int64_t b, int64_t h, int64_t s, int64_t d) {
    return bhsd ? at(t, {b, h, s, d}) : at(t, {b, s, h, d});
  };
  auto mask_at = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    const TensorView& m = *a.attn_mask;
    const int64_t index[4] = {b, h, i, j};
    int64_t off = 0;
    for (int d = 0; d < m.rank; ++d) off += (m.shape[d] == 1 ? 0 : index[4 - m.rank + d]) * m.strides[d];
    return load_value(m.dtype, static_cast<const uint8_t*>(m.data) + off * static_cast<int64_t>(attnkit::dtype_size(m.dtype)));
  };
  const double scale = static_cast<float>(a.scale ? *a.scale : 1.0 / std::sqrt(static_cast<double>(D)));
  const bool bool_mask = a.attn_mask && a.attn_mask->dtype == DType::boolean;
  for (int probe = 0; probe < 4; ++probe) {
    const int64_t b = c.rng.range(0, B - 1), h = c.rng.range(0, Hq - 1), i = c.rng.range(0, Sq - 1);
    const int64_t g = h / (Hq / Hkv);
    auto visible = [&](int64_t j) {
      if (a.causal == attnkit::Causal::top_left && j > i) return false;
      if (a.causal == attnkit::Causal::bottom_right && j > i + Skv - Sq) return false;
      return !bool_mask || mask_at(b, h, i, j) != 0;
    };
    auto score = [&](int64_t j) {
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += at4(a.q, b, h, i, d) * at4(a.k, b, g, j, d);
      return dot * scale + (a.attn_mask && !bool_mask ? mask_at(b, h, i, j) : 0.0);
    };
    auto value = [&](int64_t j, int64_t e) { return at4(a.v, b, g, j, e); };
    const RowRef want = attend_row(Skv, Dv, visible, score, value, std::nullopt);
    std::optional<double> lse;
    if (a.lse) lse = at(*a.lse, {b, h, i});
    expect_row(want, [&](int64_t e) { return at4(a.out, b, h, i, e); }, lse, a.q.dtype,
               "row (" + std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(i) + ")");
  }
}

// Valid score modifiers for the serving ops, sometimes (invalid ones when bad is set).
struct Mods {
  int64_t left = -1, right = -1;
  std::optional<double> softcap;
  const TensorView* alibi = nullptr;  // [Hq] or [B, Hq]
  const TensorView* sinks = nullptr;  // [Hq]
};
Mods pick_mods(Call& c, int64_t batch, int64_t hq, bool bad) {
  Rng& rng = c.rng;
  Mods m;
  if (rng.chance(0.3)) m.left = rng.pick<int64_t>({0, 1, 3, 17, 100}), m.right = rng.pick<int64_t>({-1, 0, 2, 40});
  if (rng.chance(0.2)) m.softcap = rng.pick<double>({0.5, 5.0, 30.0});
  if (rng.chance(0.2)) {
    m.alibi = &c.make("alibi_slopes", DType::float32,
                      rng.chance(0.5) ? std::vector<int64_t>{hq} : std::vector<int64_t>{batch, hq}, Call::Kind::input);
  }
  if (rng.chance(0.2)) m.sinks = &c.make("sinks", DType::float32, {hq}, Call::Kind::input);
  if (bad) {
    switch (rng.range(0, 3)) {
      case 0: m.left = -2; break;
      case 1: m.softcap = rng.pick<double>({0.0, -1.0, INFINITY, NAN, 1e-39}); break;
      case 2: m.alibi = &c.make("alibi_slopes", DType::float32, {hq + 1}, Call::Kind::input); break;
      default: m.sinks = &c.make("sinks", DType::float16, {hq}, Call::Kind::input); break;
    }
    c.require_error("an invalid score modifier");
  }
  c.log << "  window=(" << m.left << ", " << m.right << ") softcap=" << (m.softcap ? *m.softcap : 0.0)
        << " alibi=" << (m.alibi != nullptr) << " sinks=" << (m.sinks != nullptr) << "\n";
  return m;
}

// A packed sequence's query row i (of sq, over sk keys aligned bottom-right): which keys it
// sees and the score modifiers applied to a scaled score.
struct PackedRow {
  int64_t i, sq, sk;
  bool causal;
  const Mods* mods;
  int64_t b, h;
  bool visible(int64_t j) const {
    const int64_t a = i + sk - sq;
    if (causal && j > a) return false;
    if (mods->left >= 0 && j < a - mods->left) return false;
    if (!causal && mods->right >= 0 && j > a + mods->right) return false;
    return true;
  }
  double modify(double s, int64_t j) const {
    if (mods->softcap) s = *mods->softcap * std::tanh(s / *mods->softcap);
    if (mods->alibi) {
      const double slope = mods->alibi->rank == 1 ? at(*mods->alibi, {h}) : at(*mods->alibi, {b, h});
      s -= slope * static_cast<double>(std::llabs(i + sk - sq - j));
    }
    return s;
  }
  std::optional<double> sink() const {
    return mods->sinks ? std::optional<double>(at(*mods->sinks, {h})) : std::nullopt;
  }
};

int64_t pick_seq_len(Rng& rng) { return rng.pick<int64_t>({0, 1, 1, 2, 3, 5, 16, 17, 47, 48, 49, 64, 100, 129}); }

// cu_seqlens from lengths, written into a fresh int32 (or, perturbed, int64) [count] view.
// Validity is judged later from the values read back (a zero or repeated stride keeps the
// last value written).
TensorView& make_cu(Call& c, const std::string& name, const std::vector<int64_t>& lens, int64_t count, DType dtype) {
  TensorView& t = c.make(name, dtype, {count}, Call::Kind::input, 0.0, 0.7);
  int64_t run = 0;
  for (int64_t i = 0; i < count; ++i) {
    put_int(t, i, run);
    if (i < static_cast<int64_t>(lens.size())) run += lens[i];
  }
  return t;
}

bool cu_valid(const std::vector<int64_t>& cu, int64_t total) {
  if (cu.empty() || cu[0] != 0 || cu.back() != total) return false;
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) return false;
  }
  return true;
}

// Breaks one value of an index array on purpose (returns whether it did).
bool break_cu(Call& c, TensorView& cu) {
  if (cu.shape[0] == 0) return false;
  const int64_t i = c.rng.range(0, cu.shape[0] - 1);
  put_int(cu, i, get_int(cu, i) + c.rng.pick<int64_t>({-1, 1, 1000, -1000}));
  return true;
}

DType pick_float(Rng& rng) { return rng.pick({DType::float32, DType::float16, DType::bfloat16}); }

std::optional<double> pick_softmax_scale(Call& c) {
  if (!c.rng.chance(0.3)) return std::nullopt;  // the default
  const double s = c.rng.chance(0.85) ? c.rng.normal() : c.rng.pick<double>({NAN, INFINITY, 1e39, 0.0});
  if (!std::isfinite(static_cast<float>(s))) c.require_error("scale not finite in float32");
  return s;
}

// ---- varlen_attention

// The backward of the varlen call f (its out and lse computed here, then inputs): gradients
// poisoned and checked fully written, perturbed dout, dq, dk, dlse and dsinks; values are
// checked against float64 in tests/python/test_varlen_backward.py.
bool fuzz_varlen_backward(Call& c, const attnkit::VarlenAttentionArgs& f, Tensor& out_tensor, Tensor& lse_tensor,
                          DType dtype) {
  Rng& rng = c.rng;
  bool forward_ok = true;
  try {
    attnkit::varlen_attention(f);
  } catch (const attnkit::Error&) {
    forward_ok = false;
  }
  out_tensor.output = lse_tensor.output = false;
  if (!forward_ok) c.require_error("the forward rejects these arguments");
  const int perturb = rng.chance(0.3) ? static_cast<int>(rng.range(0, 4)) : -1;
  c.log << "  then varlen_attention_backward\n";
  attnkit::VarlenAttentionBackwardArgs a;
  a.q = f.q, a.k = f.k, a.v = f.v, a.cu_seqlens_q = f.cu_seqlens_q, a.cu_seqlens_k = f.cu_seqlens_k;
  a.out = f.out, a.lse = *f.lse, a.max_seqlen_q = f.max_seqlen_q, a.max_seqlen_k = f.max_seqlen_k;
  a.causal = f.causal, a.scale = f.scale;
  a.window_left = f.window_left, a.window_right = f.window_right, a.softcap = f.softcap;
  a.alibi_slopes = f.alibi_slopes, a.sinks = f.sinks;
  auto shape = [](const TensorView& t) { return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.rank); };
  const DType other = dtype == DType::float32 ? DType::bfloat16 : DType::float32;
  a.dout = c.make("dout", perturb == 0 ? other : dtype, shape(f.out), Call::Kind::input);
  if (perturb == 0) c.require_error("dout's dtype differs");
  std::vector<int64_t> dq_shape = shape(f.q);
  if (perturb == 1) dq_shape[1] += 1, c.require_error("dq's shape differs");
  a.dq = c.make("dq", dtype, dq_shape, Call::Kind::output, 0.05);
  a.dk = c.make("dk", dtype, shape(f.k), Call::Kind::output, 0.05);
  a.dv = c.make("dv", dtype, shape(f.v), Call::Kind::output, 0.05);
  if (rng.chance(0.3)) {
    std::vector<int64_t> dlse_shape = shape(*f.lse);
    if (perturb == 2) dlse_shape[0] += 1, c.require_error("dlse's shape differs");
    a.dlse = c.make("dlse", DType::float32, dlse_shape, Call::Kind::input);
  }
  if (f.sinks && perturb == 3) {
    c.require_error("sinks without dsinks");
  } else if (f.sinks) {
    a.dsinks = c.make("dsinks", DType::float32, shape(*f.sinks), Call::Kind::output, 0.05);
  }
  maybe_null_data(c, {&a.q, &a.k, &a.v, &a.cu_seqlens_q, &a.cu_seqlens_k, &a.out, &a.lse, &a.dout, &a.dq, &a.dk,
                      &a.dv, opt(a.dlse), opt(a.alibi_slopes), opt(a.sinks), opt(a.dsinks)});
  return c.run([&] { attnkit::varlen_attention_backward(a); });
}

bool fuzz_varlen(Call& c) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.2);
  const int64_t B = rng.pick<int64_t>({0, 1, 1, 2, 3, 5});
  const int64_t hkv = rng.chance(0.03) ? 0 : rng.pick<int64_t>({1, 1, 2, 3});
  int64_t hq = hkv * rng.pick<int64_t>({1, 1, 2, 4});
  int64_t d = pick_head_dim(rng);
  const int64_t dv = rng.chance(0.5) ? d : pick_head_dim(rng);
  std::vector<int64_t> q_len(B), k_len(B);
  for (int64_t b = 0; b < B; ++b) q_len[b] = pick_seq_len(rng), k_len[b] = rng.chance(0.4) ? q_len[b] : pick_seq_len(rng);
  auto work = [&] {
    int64_t w = 0;
    for (int64_t b = 0; b < B; ++b) w += q_len[b] * k_len[b];
    return w * std::max<int64_t>(hq, 1) * (d + dv);
  };
  while (work() > (int64_t{2} << 20)) {
    for (int64_t b = 0; b < B; ++b) q_len[b] /= 2, k_len[b] = (k_len[b] + 1) / 2;
  }
  int64_t total_q = 0, total_k = 0;
  for (int64_t b = 0; b < B; ++b) total_q += q_len[b], total_k += k_len[b];
  const DType dtype = pick_float(rng);
  const int perturb = rng.chance(0.3) ? static_cast<int>(rng.range(0, 11)) : -1;
  if (hkv == 0) c.require_error("no kv heads");
  if (perturb == 0) d = rng.pick<int64_t>({0, 513}), c.require_error("D out of range");
  if (perturb == 1 && hkv > 1) hq += 1, c.require_error("Hq not a multiple of Hkv");
  c.log << "varlen_attention B=" << B << " Hq=" << hq << " Hkv=" << hkv << " D=" << d << " Dv=" << dv << " total_q="
        << total_q << " total_k=" << total_k << "\n";
  attnkit::VarlenAttentionArgs a;
  a.q = c.make("q", dtype, {total_q, hq, d}, Call::Kind::input);
  const Tensor& q_tensor = c.last();
  a.k = c.make("k", perturb == 2 ? DType::float32 : dtype, {total_k, hkv, d}, Call::Kind::input);
  if (perturb == 2 && dtype != DType::float32) c.require_error("k's dtype differs");
  a.v = c.make("v", dtype, {total_k, hkv, dv}, Call::Kind::input);
  const DType cu_dtype = perturb == 3 ? DType::int64 : DType::int32;
  if (perturb == 3) c.require_error("cu_seqlens int64");
  a.cu_seqlens_q = make_cu(c, "cu_seqlens_q", q_len, B + 1, cu_dtype);
  a.cu_seqlens_k = make_cu(c, "cu_seqlens_k", k_len, perturb == 4 ? B + 2 : B + 1, DType::int32);
  if (perturb == 4) c.require_error("cu_seqlens_k of B + 2");
  if (perturb == 5 && break_cu(c, rng.chance(0.5) ? a.cu_seqlens_q : a.cu_seqlens_k)) {
    c.log << "  a cu_seqlens value changed\n";
  }
  // What is in memory now decides (a zero or repeated stride, or perturbation 5, may break it).
  std::vector<int64_t> cq(B + 1), ck(a.cu_seqlens_k.shape[0]);
  for (int64_t i = 0; i <= B; ++i) cq[i] = get_int(a.cu_seqlens_q, i);
  for (int64_t i = 0; i < a.cu_seqlens_k.shape[0]; ++i) ck[i] = get_int(a.cu_seqlens_k, i);
  const bool cu_ok = cu_valid(cq, total_q) && static_cast<int64_t>(ck.size()) == B + 1 && cu_valid(ck, total_k);
  if (!cu_ok) c.require_error("cu_seqlens values invalid");
  if (rng.chance(0.3) && cu_ok) {  // max_seqlen hints: at least the longest, or (perturbed) less
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) longest = std::max(longest, cq[b + 1] - cq[b]);
    a.max_seqlen_q = longest + (perturb == 6 && longest > 0 ? -1 : rng.range(0, 3));
    if (perturb == 6 && longest > 0) c.require_error("max_seqlen_q below the longest");
  }
  if (perturb == 7 && Call::fits(q_tensor, {total_q, hq, dv}, dtype)) {
    a.out = c.alias("out", q_tensor, {total_q, hq, dv}, dtype);
    c.require_error("out aliases q");
  } else {
    a.out = c.make("out", dtype, {total_q, hq, dv}, Call::Kind::output, 0.05);
  }
  Tensor& out_tensor = c.last();
  Tensor* lse_tensor = nullptr;
  if (rng.chance(0.6)) {
    a.lse = c.make("lse", DType::float32, {total_q, perturb == 8 ? hq + 1 : hq}, Call::Kind::output, 0.05);
    if (perturb == 8) c.require_error("lse of the wrong shape");
    lse_tensor = &c.last();
  }
  a.causal = rng.chance(0.5);
  a.scale = pick_softmax_scale(c);
  const Mods mods = pick_mods(c, B, hq, perturb == 9);
  a.window_left = mods.left, a.window_right = mods.right, a.softcap = mods.softcap;
  if (mods.alibi) a.alibi_slopes = *mods.alibi;
  if (mods.sinks) a.sinks = *mods.sinks;
  if (lse_tensor && rng.chance(0.35)) return fuzz_varlen_backward(c, a, out_tensor, *lse_tensor, dtype);
  maybe_null_data(c, {&a.q, &a.k, &a.v, &a.cu_seqlens_q, &a.cu_seqlens_k, &a.out, opt(a.lse), opt(a.alibi_slopes),
                      opt(a.sinks)});
  if (!c.run([&] { attnkit::varlen_attention(a); })) return false;
  if (c.specials) return true;
  const double sm = a.scale ? *a.scale : 1.0 / std::sqrt(static_cast<double>(d));
  for (int probe = 0; probe < 3 && total_q * hq > 0; ++probe) {
    const int64_t t = rng.range(0, total_q - 1), h = rng.range(0, hq - 1);
    int64_t b = 0;
    while (cq[b + 1] <= t) ++b;
    const PackedRow row{t - cq[b], cq[b + 1] - cq[b], ck[b + 1] - ck[b], a.causal, &mods, b, h};
    const int64_t kvh = h / (hq / hkv), k0 = ck[b];
    const RowRef want = attend_row(
        row.sk, dv, [&](int64_t j) { return row.visible(j); },
        [&](int64_t j) {
          double s = 0;
          for (int64_t e = 0; e < d; ++e) s += at(a.q, {t, h, e}) * at(a.k, {k0 + j, kvh, e});
          return row.modify(s * sm, j);
        },
        [&](int64_t j, int64_t e) { return at(a.v, {k0 + j, kvh, e}); }, row.sink());
    expect_row(want, [&](int64_t e) { return at(a.out, {t, h, e}); },
               a.lse ? std::optional<double>(at(*a.lse, {t, h})) : std::nullopt, dtype,
               "row " + std::to_string(t) + " head " + std::to_string(h));
  }
  return true;
}

// ---- paged_attention

bool is_float8_type(DType t) { return t == DType::float8_e4m3fn || t == DType::float8_e5m2; }

// A dequantisation scale ([] / [1] / [Hkv]), sometimes not finite and positive.
TensorView* make_kv_scale(Call& c, const std::string& name, int64_t hkv) {
  Rng& rng = c.rng;
  const int kind = static_cast<int>(rng.range(0, 2));
  std::vector<int64_t> shape = kind == 0 ? std::vector<int64_t>{} : kind == 1 ? std::vector<int64_t>{1}
                                                                               : std::vector<int64_t>{hkv};
  TensorView& t = c.make(name, DType::float32, shape, Call::Kind::input);
  const int64_t n = kind == 2 ? hkv : 1;
  for (int64_t h = 0; h < n; ++h) {
    const float x = rng.chance(0.93) ? static_cast<float>(0.25 + std::fabs(rng.normal()))
                                     : rng.pick<float>({0.0f, -1.0f, NAN, INFINITY});
    std::memcpy(const_cast<uint8_t*>(element(t, {h})), &x, 4);
  }
  for (int64_t h = 0; h < n; ++h) {  // read back: a zero stride keeps the last value
    const double x = kind == 0 ? at(t, {}) : at(t, {h});
    if (!(std::isfinite(x) && x > 0)) c.require_error(name + " not finite and positive");
  }
  return &t;
}
double kv_scale_at(const TensorView* t, int64_t h) {
  if (!t) return 1.0;
  return t->rank == 0 ? at(*t, {}) : t->shape[0] == 1 ? at(*t, {0}) : at(*t, {h});
}

bool fuzz_paged(Call& c) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.2);
  const int64_t B = rng.pick<int64_t>({0, 1, 1, 2, 3, 4});
  const int64_t hkv = rng.pick<int64_t>({1, 1, 2, 3});
  int64_t hq = hkv * rng.pick<int64_t>({1, 1, 2, 4});
  int64_t d = pick_head_dim(rng);
  const int64_t dv = rng.chance(0.5) ? d : pick_head_dim(rng);
  const int64_t block_size = rng.pick<int64_t>({1, 2, 3, 16, 17, 32});
  const DType dtype = pick_float(rng);
  const DType cache = rng.chance(0.6) ? dtype : rng.pick({DType::float8_e4m3fn, DType::float8_e5m2});
  std::vector<int64_t> n_q(B), len(B);
  for (int64_t b = 0; b < B; ++b) {
    n_q[b] = rng.pick<int64_t>({0, 1, 1, 1, 2, 5, 17});
    len[b] = n_q[b] + rng.pick<int64_t>({0, 1, 7, 33, 100, 300});
  }
  auto work = [&] {
    int64_t w = 0;
    for (int64_t b = 0; b < B; ++b) w += n_q[b] * len[b];
    return w * hq * (d + dv);
  };
  while (work() > (int64_t{2} << 20)) {
    for (int64_t b = 0; b < B; ++b) len[b] = n_q[b] + (len[b] - n_q[b]) / 2, n_q[b] = (n_q[b] + 1) / 2;
    for (int64_t b = 0; b < B; ++b) len[b] = std::max(len[b], n_q[b]);
  }
  int64_t max_used = 0, total_q = 0;
  for (int64_t b = 0; b < B; ++b) max_used = std::max(max_used, (len[b] + block_size - 1) / block_size), total_q += n_q[b];
  const int64_t max_blocks = max_used + rng.range(0, 2);
  const int64_t num_blocks = std::max<int64_t>(1, max_used * std::max<int64_t>(B, 1) / rng.pick<int64_t>({1, 1, 2})) +
                             rng.range(0, 2);
  const int perturb = rng.chance(0.3) ? static_cast<int>(rng.range(0, 11)) : -1;
  if (perturb == 0) d = rng.pick<int64_t>({0, 513}), c.require_error("D out of range");
  if (perturb == 1 && hkv > 1) hq += 1, c.require_error("Hq not a multiple of Hkv");
  c.log << "paged_attention B=" << B << " Hq=" << hq << " Hkv=" << hkv << " D=" << d << " Dv=" << dv
        << " block_size=" << block_size << " num_blocks=" << num_blocks << " max_blocks=" << max_blocks
        << " cache=" << attnkit::dtype_name(cache) << "\n";
  attnkit::PagedAttentionArgs a;
  a.q = c.make("q", dtype, {total_q, hq, d}, Call::Kind::input);
  const Tensor& q_tensor = c.last();
  a.k_cache = c.make("k_cache", cache, {num_blocks, block_size, hkv, d}, Call::Kind::input);
  const Tensor& k_cache_tensor = c.last();
  a.v_cache = c.make("v_cache", perturb == 2 ? (cache == DType::float32 ? DType::float16 : DType::float32) : cache,
                     {num_blocks, block_size, hkv, dv}, Call::Kind::input);
  if (perturb == 2) c.require_error("v_cache's dtype differs");
  // Block tables: used entries in range (shared or not), the rest -1 or anything.
  a.block_table = c.make("block_table", DType::int32, {B, max_blocks}, Call::Kind::input, 0.0, 0.7);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (len[b] + block_size - 1) / block_size;
    for (int64_t i = 0; i < max_blocks; ++i) {
      int64_t id = i < used ? rng.range(0, num_blocks - 1) : rng.pick<int64_t>({-1, -1, 0, num_blocks, INT32_MIN});
      if (perturb == 3 && i == used - 1) id = rng.pick<int64_t>({-1, num_blocks, INT32_MAX});
      put_int(a.block_table, b * max_blocks + i, id);
    }
  }
  a.seq_lens = c.make("seq_lens", DType::int32, {B}, Call::Kind::input, 0.0, 0.7);
  for (int64_t b = 0; b < B; ++b) {
    int64_t x = len[b];
    if (perturb == 4 && b == 0) x = rng.chance(0.5) ? n_q[b] - 1 : max_blocks * block_size + 1;
    put_int(a.seq_lens, b, x);
  }
  a.cu_seqlens_q = make_cu(c, "cu_seqlens_q", n_q, B + 1, DType::int32);
  if (perturb == 5) break_cu(c, a.cu_seqlens_q);
  // Validity from the values in memory.
  std::vector<int64_t> cq(B + 1), lens(B);
  for (int64_t i = 0; i <= B; ++i) cq[i] = get_int(a.cu_seqlens_q, i);
  bool ok = cu_valid(cq, total_q);
  for (int64_t b = 0; ok && b < B; ++b) {
    lens[b] = get_int(a.seq_lens, b);
    if (lens[b] < cq[b + 1] - cq[b] || lens[b] > max_blocks * block_size) ok = false;
    for (int64_t i = 0; ok && i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t id = get_int(a.block_table, b * max_blocks + i);
      if (id < 0 || id >= num_blocks) ok = false;
    }
  }
  if (!ok) c.require_error("cu_seqlens_q, seq_lens or block_table values invalid");
  TensorView* k_scale = nullptr;
  TensorView* v_scale = nullptr;
  if (is_float8_type(cache) ? rng.chance(0.8) : rng.chance(0.2)) k_scale = make_kv_scale(c, "k_scale", hkv);
  if (is_float8_type(cache) ? rng.chance(0.8) : rng.chance(0.2)) v_scale = make_kv_scale(c, "v_scale", hkv);
  if (k_scale) a.k_scale = *k_scale;
  if (v_scale) a.v_scale = *v_scale;
  const int alias_kind = perturb == 6 ? static_cast<int>(rng.range(0, 1)) : -1;
  if (alias_kind == 0 && Call::fits(q_tensor, {total_q, hq, dv}, dtype)) {
    a.out = c.alias("out", q_tensor, {total_q, hq, dv}, dtype);
    c.require_error("out aliases q");
  } else if (alias_kind == 1 && cache == dtype && Call::fits(k_cache_tensor, {total_q, hq, dv}, dtype)) {
    a.out = c.alias("out", k_cache_tensor, {total_q, hq, dv}, dtype);
    c.require_error("out aliases k_cache");
  } else {
    a.out = c.make("out", dtype, {total_q, hq, dv}, Call::Kind::output, 0.05);
  }
  if (rng.chance(0.6)) {
    a.lse = c.make("lse", perturb == 7 ? DType::float16 : DType::float32, {total_q, hq}, Call::Kind::output, 0.05);
    if (perturb == 7) c.require_error("lse float16");
  }
  a.causal = rng.chance(0.8);
  a.scale = pick_softmax_scale(c);
  const Mods mods = pick_mods(c, B, hq, perturb == 8);
  a.window_left = mods.left, a.window_right = mods.right, a.softcap = mods.softcap;
  if (mods.alibi) a.alibi_slopes = *mods.alibi;
  if (mods.sinks) a.sinks = *mods.sinks;
  maybe_null_data(c, {&a.q, &a.k_cache, &a.v_cache, &a.block_table, &a.seq_lens, &a.cu_seqlens_q, &a.out, opt(a.lse),
                      opt(a.k_scale), opt(a.v_scale), opt(a.alibi_slopes), opt(a.sinks)});
  if (!c.run([&] { attnkit::paged_attention(a); })) return false;
  if (c.specials) return true;
  const double sm = a.scale ? *a.scale : 1.0 / std::sqrt(static_cast<double>(d));
  for (int probe = 0; probe < 3 && total_q * hq > 0; ++probe) {
    const int64_t t = rng.range(0, total_q - 1), h = rng.range(0, hq - 1);
    int64_t b = 0;
    while (cq[b + 1] <= t) ++b;
    const PackedRow row{t - cq[b], cq[b + 1] - cq[b], lens[b], a.causal, &mods, b, h};
    const int64_t kvh = h / (hq / hkv);
    auto key = [&](const TensorView& cache_view, int64_t j, int64_t e) {
      const int64_t block = get_int(a.block_table, b * max_blocks + j / block_size);
      return at(cache_view, {block, j % block_size, kvh, e});
    };
    const double ks = kv_scale_at(k_scale, kvh), vs = kv_scale_at(v_scale, kvh);
    const RowRef want = attend_row(
        row.sk, dv, [&](int64_t j) { return row.visible(j); },
        [&](int64_t j) {
          double s = 0;
          for (int64_t e = 0; e < d; ++e) s += at(a.q, {t, h, e}) * key(a.k_cache, j, e) * ks;
          return row.modify(s * sm, j);
        },
        [&](int64_t j, int64_t e) { return key(a.v_cache, j, e) * vs; }, row.sink());
    expect_row(want, [&](int64_t e) { return at(a.out, {t, h, e}); },
               a.lse ? std::optional<double>(at(*a.lse, {t, h})) : std::nullopt, dtype,
               "row " + std::to_string(t) + " head " + std::to_string(h));
  }
  return true;
}

// ---- append_kv_cache

// The cache's bytes for value x (round to nearest even; float8 saturates, NaN stays NaN).
void encode_cache(DType dtype, float x, uint8_t* p) {
  switch (dtype) {
    case DType::float32: std::memcpy(p, &x, 4); break;
    case DType::float16: {
      const uint16_t h = attnkit::float_to_float16(x);
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::bfloat16: {
      const uint16_t h = attnkit::float_to_bfloat16(x);
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::float8_e4m3fn: *p = attnkit::float_to_float8_e4m3fn(x); break;
    default: *p = attnkit::float_to_float8_e5m2(std::isnan(x) ? x : std::fmax(-57344.0f, std::fmin(x, 57344.0f)));
  }
}

bool fuzz_append(Call& c) {
  Rng& rng = c.rng;
  const int64_t T = rng.pick<int64_t>({0, 1, 2, 3, 7, 16, 33});
  const int64_t hkv = rng.pick<int64_t>({0, 1, 1, 2, 3}), d = pick_head_dim(rng);
  const int64_t dv = rng.chance(0.5) ? d : pick_head_dim(rng);
  const int64_t num_blocks = rng.pick<int64_t>({0, 1, 2, 5}), block_size = rng.pick<int64_t>({1, 2, 3, 16});
  const DType dtype = pick_float(rng);
  const DType cache = rng.pick({DType::float32, DType::float16, DType::bfloat16, DType::float8_e4m3fn,
                                DType::float8_e5m2, dtype});
  const int perturb = rng.chance(0.3) ? static_cast<int>(rng.range(0, 7)) : -1;
  c.log << "append_kv_cache T=" << T << " Hkv=" << hkv << " D=" << d << " Dv=" << dv << " num_blocks=" << num_blocks
        << " block_size=" << block_size << " " << attnkit::dtype_name(dtype) << " -> " << attnkit::dtype_name(cache)
        << "\n";
  attnkit::AppendKvCacheArgs a;
  a.k = c.make("k", dtype, {T, hkv, d}, Call::Kind::input);
  a.v = c.make("v", perturb == 0 ? (dtype == DType::float32 ? DType::bfloat16 : DType::float32) : dtype, {T, hkv, dv},
               Call::Kind::input);
  if (perturb == 0) c.require_error("v's dtype differs");
  const int64_t cache_d = perturb == 1 ? d + 1 : d;
  if (perturb == 1) c.require_error("k_cache's D differs");
  a.k_cache = c.make("k_cache", cache, {num_blocks, block_size, hkv, cache_d}, Call::Kind::in_place, 0.05);
  Tensor& k_cache_tensor = c.last();
  if (perturb == 2 && cache == dtype && Call::fits(k_cache_tensor, {num_blocks, block_size, hkv, dv}, cache)) {
    a.v_cache = c.alias("v_cache", k_cache_tensor, {num_blocks, block_size, hkv, dv}, cache);
    c.last().output = false, c.last().in_place = true;
    c.require_error("v_cache aliases k_cache");
  } else {
    a.v_cache = c.make("v_cache", perturb == 3 ? DType::int8 : cache, {num_blocks, block_size, hkv, dv},
                       Call::Kind::in_place, 0.05);
    if (perturb == 3) c.require_error("v_cache int8");
  }
  const DType slot_dtype = perturb == 4 ? DType::int8 : rng.chance(0.5) ? DType::int32 : DType::int64;
  if (perturb == 4) c.require_error("slot_mapping int8");
  a.slot_mapping = c.make("slot_mapping", slot_dtype, {perturb == 5 ? T + 1 : T}, Call::Kind::input, 0.0, 0.7);
  if (perturb == 5) c.require_error("slot_mapping of T + 1");
  const int64_t slots = num_blocks * block_size;
  if (slot_dtype != DType::int8) {
    for (int64_t t = 0; t < a.slot_mapping.shape[0]; ++t) {
      int64_t s = slots > 0 && rng.chance(0.8) ? rng.range(0, slots - 1) : -1;
      if (perturb == 6 && t == 0) s = rng.pick<int64_t>({slots, -2, INT32_MIN, int64_t{1} << 40});
      if (slot_dtype == DType::int32 && (s < INT32_MIN || s > INT32_MAX)) s = -2;
      put_int(a.slot_mapping, t, s);
    }
  }
  std::vector<int64_t> slot(T, -1);
  for (int64_t t = 0; slot_dtype != DType::int8 && t < std::min(T, a.slot_mapping.shape[0]); ++t) {
    slot[t] = get_int(a.slot_mapping, t);
    if (slot[t] != -1 && (slot[t] < 0 || slot[t] >= slots)) c.require_error("a slot out of range");
  }
  TensorView* k_scale = rng.chance(0.3) ? make_kv_scale(c, "k_scale", hkv) : nullptr;
  TensorView* v_scale = rng.chance(0.3) ? make_kv_scale(c, "v_scale", hkv) : nullptr;
  if (k_scale) a.k_scale = *k_scale;
  if (v_scale) a.v_scale = *v_scale;
  if (perturb == 7 && Call::fits(k_cache_tensor, {T, hkv, d}, cache)) {  // k in k_cache's memory
    a.k = c.alias("k_alias", k_cache_tensor, {T, hkv, d}, cache);
    c.last().output = false;
    c.require_error("k aliases k_cache");
  }
  maybe_null_data(c, {&a.k, &a.v, &a.k_cache, &a.v_cache, &a.slot_mapping, opt(a.k_scale), opt(a.v_scale)});
  if (!c.run([&] { attnkit::append_kv_cache(a); })) return false;
  // Every element of each cache: the last token written to its slot, else unchanged.
  std::vector<int64_t> writer(std::max<int64_t>(slots, 0), -1);
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] >= 0) writer[slot[t]] = t;
  }
  for (int which = 0; which < 2; ++which) {
    const TensorView& src = which ? a.v : a.k;
    const TensorView& dst = which ? a.v_cache : a.k_cache;
    const TensorView* scale = which ? v_scale : k_scale;
    const Tensor* dst_tensor = nullptr;
    for (const auto& t : c.tensors) {
      if (t->view.data == dst.data && t->name == (which ? "v_cache" : "k_cache")) dst_tensor = t.get();
    }
    const int64_t item = static_cast<int64_t>(attnkit::dtype_size(dst.dtype));
    for (int64_t s = 0; s < slots; ++s) {
      for (int64_t h = 0; h < hkv; ++h) {
        for (int64_t e = 0; e < dst.shape[3]; ++e) {
          const uint8_t* got = element(dst, {s / block_size, s % block_size, h, e});
          uint8_t want[8];
          if (writer[s] >= 0) {
            const float x = static_cast<float>(at(src, {writer[s], h, e}));
            encode_cache(dst.dtype, x / static_cast<float>(kv_scale_at(scale, h)), want);
          } else {
            std::memcpy(want, dst_tensor->before.data() + (got - dst_tensor->block->data()), item);
          }
          ++g_compared;
          if (std::memcmp(got, want, item) != 0) {
            throw Failure{std::string(which ? "v_cache" : "k_cache") + " slot " + std::to_string(s) + " head " +
                          std::to_string(h) + " element " + std::to_string(e) +
                          (writer[s] >= 0 ? " differs from token " + std::to_string(writer[s]) : " changed")};
          }
        }
      }
    }
    Call::check_written(*dst_tensor, false);  // nothing outside the cache's view
  }
  return true;
}

// ---- merge_attention_states

bool fuzz_merge(Call& c) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.1);
  int rank = static_cast<int>(rng.range(2, 4));
  std::vector<int64_t> shape;
  for (int d = 0; d + 1 < rank; ++d) shape.push_back(rng.pick<int64_t>({0, 1, 1, 2, 3, 5, 16}));
  shape.push_back(rng.pick<int64_t>({1, 2, 3, 8, 17, 64, 128}));
  while (std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>()) > 40000) shape[0] /= 2;
  std::vector<int64_t> rows(shape.begin(), shape.end() - 1);
  const int perturb = rng.chance(0.3) ? static_cast<int>(rng.range(0, 7)) : -1;
  c.log << "merge_attention_states rank=" << rank << " Dv=" << shape.back() << "\n";
  attnkit::MergeStatesArgs a;
  const DType dt_a = pick_float(rng), dt_b = pick_float(rng);
  a.out_a = c.make("out_a", dt_a, shape, Call::Kind::input);
  Tensor& out_a = c.last();
  std::vector<int64_t> shape_b = shape;
  if (perturb == 0) shape_b.back() += 1, c.require_error("out_b's shape differs");
  a.out_b = c.make("out_b", perturb == 1 ? DType::int32 : dt_b, shape_b, Call::Kind::input);
  if (perturb == 1) c.require_error("out_b int32");
  // lse values: mostly finite, some -inf (a part that saw nothing), +inf, far below, NaN.
  auto make_lse = [&](const std::string& name) -> Tensor& {
    std::vector<int64_t> s = rows;
    if (perturb == 2 && name == "lse_b") s.push_back(1);
    c.make(name, perturb == 3 && name == "lse_a" ? DType::float16 : DType::float32, s, Call::Kind::input);
    Tensor& t = c.last();
    if (t.view.dtype == DType::float32 && t.block) {
      int64_t n = 1;
      for (int64_t x : s) n *= x;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t u = rng.range(0, 99);
        const float x = u < 75 ? static_cast<float>(4 * rng.normal())
                        : u < 88 ? -INFINITY
                        : u < 93 ? -200.0f
                        : u < 97 || !c.specials ? INFINITY
                                                : NAN;
        std::memcpy(static_cast<uint8_t*>(t.view.data) + elem_offset(t.view, i) * 4, &x, 4);
      }
    }
    return t;
  };
  if (perturb == 2) c.require_error("lse_b's shape");
  if (perturb == 3) c.require_error("lse_a float16");
  Tensor& lse_a = make_lse("lse_a");
  a.lse_a = lse_a.view;
  a.lse_b = make_lse("lse_b").view;
  // A part that saw nothing holds anything: NaN into out_b where lse_b is -inf.
  int64_t n_rows = 1;
  for (int64_t x : rows) n_rows *= x;
  bool out_b_broadcast = false;
  for (int d = 0; d < a.out_b.rank; ++d) out_b_broadcast |= a.out_b.shape[d] > 1 && a.out_b.strides[d] == 0;
  if (a.out_b.dtype != DType::int32 && perturb != 0 && perturb != 2 && !out_b_broadcast) {
    for (int64_t r = 0; r < n_rows; ++r) {
      if (load_value(DType::float32, static_cast<const uint8_t*>(a.lse_b.data) + elem_offset(a.lse_b, r) * 4) !=
          -INFINITY)
        continue;
      TensorView row_view = a.out_b;  // element (r, e): row-major index r * Dv + e
      for (int64_t e = 0; e < shape.back(); ++e) {
        store_value(a.out_b.dtype,
                    static_cast<uint8_t*>(row_view.data) +
                        elem_offset(row_view, r * shape.back() + e) * static_cast<int64_t>(attnkit::dtype_size(row_view.dtype)),
                    NAN, rng);
      }
    }
  }
  // Reference before the call (an in-place merge overwrites out_a).
  std::vector<double> va, vb, la, lb;
  const int64_t dvn = shape.back();
  const bool checkable = perturb == -1 || perturb >= 4;
  if (checkable) {
    for (int64_t r = 0; r < n_rows; ++r) {
      la.push_back(load_value(DType::float32, static_cast<const uint8_t*>(a.lse_a.data) + elem_offset(a.lse_a, r) * 4));
      lb.push_back(load_value(DType::float32, static_cast<const uint8_t*>(a.lse_b.data) + elem_offset(a.lse_b, r) * 4));
      for (int64_t e = 0; e < dvn; ++e) {
        va.push_back(load_value(dt_a, static_cast<const uint8_t*>(a.out_a.data) +
                                          elem_offset(a.out_a, r * dvn + e) * static_cast<int64_t>(attnkit::dtype_size(dt_a))));
        vb.push_back(load_value(dt_b, static_cast<const uint8_t*>(a.out_b.data) +
                                          elem_offset(a.out_b, r * dvn + e) * static_cast<int64_t>(attnkit::dtype_size(dt_b))));
      }
    }
  }
  const bool in_place = rng.chance(0.3);
  if (in_place && perturb != 4) {
    a.out = c.same_view("out", out_a);
  } else if (perturb == 4 && out_a.block && n_rows * dvn > 0 &&
             n_rows * dvn * static_cast<int64_t>(attnkit::dtype_size(dt_a)) <= static_cast<int64_t>(out_a.block->size())) {
    // out in out_a's memory, contiguous
    a.out = c.alias("out", out_a, shape, dt_a);
    bool same = a.out.data == a.out_a.data;
    for (int d = 0; d < rank; ++d) same = same && (shape[d] <= 1 || a.out.strides[d] == a.out_a.strides[d]);
    if (same) out_a.in_place = true;  // exactly out_a's view: an in-place merge
    else c.require_error("out overlaps out_a");
  } else {
    a.out = c.make("out", perturb == 5 ? DType::float8_e4m3fn : pick_float(rng), shape, Call::Kind::output, 0.05);
    if (perturb == 5) c.require_error("out float8");
  }
  if (rng.chance(0.3) && perturb != 6) {
    a.lse_out = c.same_view("lse_out", lse_a);
  } else if (perturb == 6 && n_rows > 0 && out_a.block &&
             n_rows * 4 <= static_cast<int64_t>(out_a.block->size())) {
    a.lse_out = c.alias("lse_out", out_a, rows, DType::float32);  // in out_a's memory
    c.require_error("lse_out aliases out_a");
  } else {
    a.lse_out = c.make("lse_out", DType::float32, rows, Call::Kind::output, 0.05);
  }
  maybe_null_data(c, {&a.out_a, &a.lse_a, &a.out_b, &a.lse_b, &a.out, &a.lse_out});
  if (!c.run([&] { attnkit::merge_attention_states(a); })) return false;
  if (!checkable || c.specials) return true;
  const double rel = a.out.dtype == DType::bfloat16 ? 8e-3 : a.out.dtype == DType::float16 ? 1e-3 : 2e-6;
  for (int probe = 0; probe < 4 && n_rows > 0; ++probe) {
    const int64_t r = rng.range(0, n_rows - 1);
    const double m = std::max(la[r], lb[r]);
    double want_lse;
    std::vector<double> want(dvn);
    if (std::isnan(la[r]) || std::isnan(lb[r])) continue;  // a NaN row: not in the finite inputs
    if (m == -INFINITY) {
      want_lse = -INFINITY;
    } else if (m == INFINITY) {
      const bool both = la[r] == INFINITY && lb[r] == INFINITY;
      for (int64_t e = 0; e < dvn; ++e) {
        want[e] = both ? (va[r * dvn + e] + vb[r * dvn + e]) / 2 : la[r] == INFINITY ? va[r * dvn + e] : vb[r * dvn + e];
      }
      want_lse = INFINITY;
    } else {
      const double wa = la[r] == m ? 1.0 : std::exp(la[r] - m), wb = lb[r] == m ? 1.0 : std::exp(lb[r] - m);
      for (int64_t e = 0; e < dvn; ++e) {
        // a part whose weight is 0 in float32 is never read
        const double xa = static_cast<float>(wa / (wa + wb)) == 0 ? 0 : wa * va[r * dvn + e];
        const double xb = static_cast<float>(wb / (wa + wb)) == 0 ? 0 : wb * vb[r * dvn + e];
        want[e] = (xa + xb) / (wa + wb);
      }
      want_lse = m + std::log(wa + wb);
    }
    for (int64_t e = 0; e < dvn; ++e) {
      const double got = load_value(a.out.dtype, static_cast<const uint8_t*>(a.out.data) +
                                                     elem_offset(a.out, r * dvn + e) * static_cast<int64_t>(attnkit::dtype_size(a.out.dtype)));
      expect_near(got, want[e], rel * (1 + std::fabs(want[e])) + 1e-6, "row " + std::to_string(r) + " out");
    }
    const double got_lse = load_value(DType::float32, static_cast<const uint8_t*>(a.lse_out.data) + elem_offset(a.lse_out, r) * 4);
    expect_near(got_lse, want_lse, 1e-5 * (1 + std::fabs(want_lse)), "row " + std::to_string(r) + " lse");
  }
  return true;
}

// ---- attention_backward

bool fuzz_backward(Call& c) {
  Rng& rng = c.rng;
  c.specials = rng.chance(0.15);
  const int64_t B = rng.pick<int64_t>({0, 1, 1, 2}), hkv = rng.pick<int64_t>({0, 1, 1, 2});
  int64_t hq = hkv * rng.pick<int64_t>({1, 1, 2, 3});
  int64_t sq = pick_len(rng), skv = pick_len(rng);
  int64_t d = pick_head_dim(rng);
  const int64_t dv = rng.chance(0.5) ? d : pick_head_dim(rng);
  while (B * hq * sq * skv * (d + dv) > (int64_t{1} << 20)) sq = (sq + 1) / 2, skv /= 2;
  const DType dtype = pick_float(rng);
  const auto layout = rng.chance(0.7) ? attnkit::Layout::BHSD : attnkit::Layout::BSHD;
  const int perturb = rng.chance(0.3) ? static_cast<int>(rng.range(0, 9)) : -1;
  if (perturb == 0) d = rng.pick<int64_t>({0, 513}), c.require_error("D out of range");
  c.log << "attention_backward B=" << B << " Hq=" << hq << " Hkv=" << hkv << " Sq=" << sq << " Skv=" << skv << " D=" << d
        << " Dv=" << dv << " layout=" << (layout == attnkit::Layout::BHSD ? "BHSD" : "BSHD") << "\n";
  attnkit::AttentionArgs f;
  f.layout = layout;
  f.q = c.make("q", dtype, layout_shape(layout, B, hq, sq, d), Call::Kind::input);
  Tensor& q_tensor = c.last();
  f.k = c.make("k", dtype, layout_shape(layout, B, hkv, skv, d), Call::Kind::input);
  f.v = c.make("v", dtype, layout_shape(layout, B, hkv, skv, dv), Call::Kind::input);
  f.causal = rng.pick({attnkit::Causal::none, attnkit::Causal::top_left, attnkit::Causal::bottom_right});
  f.scale = pick_softmax_scale(c);
  f.enable_gqa = hq != hkv || rng.chance(0.5);
  if (rng.chance(0.2)) {
    f.dropout_p = rng.pick<double>({0.1, 0.5});
    if (perturb != 1) f.seed = rng.bits();
    else c.require_error("dropout without the forward's seed");
  }
  if (rng.chance(0.3)) {  // a mask broadcastable to [B, Hq, Sq, Skv]
    std::vector<int64_t> full = {B, hq, sq, skv}, shape;
    for (int dim = static_cast<int>(rng.range(0, 3)); dim < 4; ++dim) shape.push_back(rng.chance(0.3) ? 1 : full[dim]);
    f.attn_mask = c.make("attn_mask", rng.pick({DType::boolean, DType::float32, dtype}), shape, Call::Kind::input);
  }
  // The forward's out and lse, computed here and then inputs of the backward.
  f.out = c.make("out", dtype, layout_shape(layout, B, hq, sq, dv), Call::Kind::output);
  Tensor& out_tensor = c.last();
  f.lse = c.make("lse", DType::float32, {B, hq, sq}, Call::Kind::output);
  Tensor& lse_tensor = c.last();
  bool forward_ok = true;
  try {
    attnkit::attention(f);
  } catch (const attnkit::Error&) {
    forward_ok = false;
  }
  out_tensor.output = lse_tensor.output = false;
  if (!forward_ok) c.require_error("the forward rejects these arguments");
  attnkit::AttentionBackwardArgs a;
  a.q = f.q, a.k = f.k, a.v = f.v, a.out = f.out, a.lse = *f.lse, a.attn_mask = f.attn_mask;
  a.causal = f.causal, a.scale = f.scale, a.dropout_p = f.dropout_p, a.seed = f.seed;
  a.enable_gqa = f.enable_gqa, a.layout = layout;
  a.dout = c.make("dout", perturb == 2 ? (dtype == DType::float32 ? DType::float16 : DType::float32) : dtype,
                  layout_shape(layout, B, hq, sq, dv), Call::Kind::input);
  if (perturb == 2) c.require_error("dout's dtype differs");
  if (perturb == 3 && Call::fits(q_tensor, layout_shape(layout, B, hq, sq, d), dtype)) {
    a.dq = c.alias("dq", q_tensor, layout_shape(layout, B, hq, sq, d), dtype);
    c.require_error("dq aliases q");
  } else {
    a.dq = c.make("dq", dtype, layout_shape(layout, B, perturb == 4 ? hq + 1 : hq, sq, d), Call::Kind::output, 0.05);
    if (perturb == 4) c.require_error("dq's shape differs");
  }
  Tensor& dq_tensor = c.last();
  if (perturb == 5 && Call::fits(dq_tensor, layout_shape(layout, B, hkv, skv, d), dtype)) {
    a.dk = c.alias("dk", dq_tensor, layout_shape(layout, B, hkv, skv, d), dtype);
    c.require_error("dk aliases dq");
  } else {
    a.dk = c.make("dk", perturb == 6 ? DType::int32 : dtype, layout_shape(layout, B, hkv, skv, d), Call::Kind::output,
                  0.05);
    if (perturb == 6) c.require_error("dk int32");
  }
  a.dv = c.make("dv", dtype, layout_shape(layout, B, hkv, skv, dv), Call::Kind::output, 0.05);
  if (rng.chance(0.3)) {
    a.dlse = c.make("dlse", DType::float32, {B, hq, perturb == 7 ? sq + 1 : sq}, Call::Kind::input);
    if (perturb == 7) c.require_error("dlse's shape differs");
  }
  if (perturb == 8) {  // lse not the forward's shape: the forward's check
    a.lse = c.make("lse_bad", DType::float32, {B, hq, sq + 1}, Call::Kind::input);
    c.require_error("lse's shape differs");
  }
  maybe_null_data(c, {&a.q, &a.k, &a.v, &a.out, &a.lse, &a.dout, &a.dq, &a.dk, &a.dv, opt(a.dlse), opt(a.attn_mask),
                      opt(a.alibi_slopes), opt(a.sinks), opt(a.dsinks)});
  if (!c.run([&] { attnkit::attention_backward(a); })) return false;
  if (c.specials || a.dropout_p > 0) return true;  // dropout: written, not compared (its mask is the kernel's)
  // P and dS of one (b, h, i) row against key j, in double from the given out and lse.
  const double sm = a.scale ? *a.scale : 1.0 / std::sqrt(static_cast<double>(d));
  const int64_t group = hkv > 0 ? hq / hkv : 1;
  auto get = [&](const TensorView& t, int64_t b, int64_t h, int64_t s, int64_t e) {
    return layout == attnkit::Layout::BHSD ? at(t, {b, h, s, e}) : at(t, {b, s, h, e});
  };
  auto visible_score = [&](int64_t b, int64_t h, int64_t i, int64_t j, double& s) {
    const int64_t limit = a.causal == attnkit::Causal::top_left ? i : i + skv - sq;
    if (a.causal != attnkit::Causal::none && j > limit) return false;
    s = 0;
    for (int64_t e = 0; e < d; ++e) s += get(a.q, b, h, i, e) * get(a.k, b, h / group, j, e);
    s *= sm;
    if (a.attn_mask) {
      const TensorView& m = *a.attn_mask;
      const int64_t full[4] = {b, h, i, j};
      int64_t off = 0;
      for (int dim = 0; dim < m.rank; ++dim) {
        const int64_t target = 4 - m.rank + dim;
        off += (m.shape[dim] == 1 ? 0 : full[target]) * m.strides[dim];
      }
      const double x = load_value(m.dtype, static_cast<const uint8_t*>(m.data) +
                                               off * static_cast<int64_t>(attnkit::dtype_size(m.dtype)));
      if (m.dtype == DType::boolean) {
        if (x == 0) return false;
      } else {
        s += x;
        if (s == -INFINITY) return false;
      }
    }
    return true;
  };
  struct Term {
    double p = 0, ds = 0, mag_p = 0, mag_ds = 0, smax = 0;
  };
  auto term = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    Term t;
    double s;
    const double lse = at(a.lse, {b, h, i});
    if (lse == -INFINITY || !visible_score(b, h, i, j, s)) return t;
    t.p = std::exp(s - lse);
    double dp = 0, delta = 0, dp_mag = 0;
    for (int64_t e = 0; e < dv; ++e) {
      const double g = get(a.dout, b, h, i, e);
      dp += g * get(a.v, b, h / group, j, e);
      delta += g * get(a.out, b, h, i, e);
      dp_mag += std::fabs(g * get(a.v, b, h / group, j, e)) + std::fabs(g * get(a.out, b, h, i, e));
    }
    const double dl = a.dlse ? at(*a.dlse, {b, h, i}) : 0.0;
    t.ds = t.p * (dp - delta + dl);
    t.mag_ds = t.p * (dp_mag + std::fabs(dl));
    t.smax = std::fabs(s) + std::fabs(lse);
    return t;
  };
  const double rel = dtype == DType::bfloat16 ? 3e-2 : dtype == DType::float16 ? 5e-3 : 0.0;
  for (int probe = 0; probe < 2; ++probe) {
    if (B * hq * sq * d > 0) {  // dq[b, h, i, e] = scale Σ_j dS_ij k_je
      const int64_t b = rng.range(0, B - 1), h = rng.range(0, hq - 1), i = rng.range(0, sq - 1), e = rng.range(0, d - 1);
      double want = 0, mag = 0, smax = 0;
      for (int64_t j = 0; j < skv; ++j) {
        const Term t = term(b, h, i, j);
        const double kj = get(a.k, b, h / group, j, e);
        want += sm * t.ds * kj, mag += std::fabs(sm) * t.mag_ds * std::fabs(kj), smax = std::max(smax, t.smax);
      }
      expect_near(get(a.dq, b, h, i, e), want, (rel + 2e-5 * (1 + smax)) * mag + 1e-6, "dq element");
    }
    if (B * hkv * skv > 0) {  // dk[b, g, j, e] = scale Σ_{h in g, i} dS_ij q_ie; dv = Σ P_ij dout_i
      const int64_t b = rng.range(0, B - 1), g = rng.range(0, hkv - 1), j = rng.range(0, skv - 1);
      const int64_t e = rng.range(0, d - 1), ev = rng.range(0, dv - 1);
      double want_k = 0, mag_k = 0, want_v = 0, mag_v = 0, smax = 0;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i = 0; i < sq; ++i) {
          const Term t = term(b, h, i, j);
          if (t.p == 0 && t.ds == 0) continue;
          const double qi = get(a.q, b, h, i, e), gi = get(a.dout, b, h, i, ev);
          want_k += sm * t.ds * qi, mag_k += std::fabs(sm) * t.mag_ds * std::fabs(qi);
          want_v += t.p * gi, mag_v += t.p * std::fabs(gi);
          smax = std::max(smax, t.smax);
        }
      }
      const double tol_scale = rel + 2e-5 * (1 + smax);
      expect_near(get(a.dk, b, g, j, e), want_k, tol_scale * mag_k + 1e-6, "dk element");
      expect_near(get(a.dv, b, g, j, ev), want_v, tol_scale * mag_v + 1e-6, "dv element");
    }
  }
  return true;
}

struct Tally {
  int64_t ok = 0, error = 0, compared = 0;
  double seconds = 0;
};

// Shares of the calls, so that each API gets a useful part of the run's time.
Api pick_api(Rng& rng) {
  const int64_t u = rng.range(0, 99);
  if (u < 16) return Api::attention;
  if (u < 25) return Api::sage_int8;
  if (u < 28) return Api::sage_fp4;
  if (u < 36) return Api::sparse_mla;
  if (u < 39) return Api::sparse_q8kv8;
  if (u < 50) return Api::varlen;
  if (u < 60) return Api::paged;
  if (u < 66) return Api::append_kv;
  if (u < 71) return Api::merge;
  if (u < 77) return Api::backward;
  if (u < 84) return Api::mla_decode;
  if (u < 86) return Api::quantize_v32;
  if (u < 91) return Api::indexer_logits;
  if (u < 95) return Api::paged_indexer_logits;
  return Api::topk;
}

// Runs the call of `seed`; returns its API and whether it succeeded, throws Failure.
std::pair<Api, bool> run_one(uint64_t seed, bool verbose, const std::vector<std::string>& isas) {
  Call c(seed, verbose);
  const Api api = pick_api(c.rng);
  const std::string isa = isas[c.rng.range(0, static_cast<int64_t>(isas.size()) - 1)];
  attnkit::set_isa(isa);
  const int threads = static_cast<int>(c.rng.pick<int64_t>({1, 2, 3}));
  if (attnkit::get_num_threads() != threads) attnkit::set_num_threads(threads);
  c.log << "isa=" << isa << " threads=" << threads << "\n";
  try {
    switch (api) {
      case Api::sparse_mla:
      case Api::sparse_q8kv8: return {api, fuzz_sparse_mla(c, api == Api::sparse_q8kv8)};
      case Api::mla_decode: return {api, fuzz_mla_decode(c)};
      case Api::quantize_v32: return {api, fuzz_quantize_v32(c)};
      case Api::indexer_logits:
      case Api::paged_indexer_logits: return {api, fuzz_indexer_logits(c, api == Api::paged_indexer_logits)};
      case Api::topk: return {api, fuzz_topk(c)};
      case Api::varlen: return {api, fuzz_varlen(c)};
      case Api::paged: return {api, fuzz_paged(c)};
      case Api::append_kv: return {api, fuzz_append(c)};
      case Api::merge: return {api, fuzz_merge(c)};
      case Api::backward: return {api, fuzz_backward(c)};
      default: return {api, fuzz_attention(c, api)};
    }
  } catch (Failure& f) {
    f.what = std::string(api_name(api)) + ": " + f.what + "\n" + c.log.str();
    throw;
  }
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 120;
  if (const char* env = std::getenv("ATTNKIT_FUZZ_SECONDS")) seconds = std::atof(env);
  int64_t max_calls = INT64_MAX;
  uint64_t base_seed = 0x5EEDull;
  bool verbose = false, replay = false;
  uint64_t replay_seed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "attnkit_fuzz: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--seconds") seconds = std::atof(value().c_str());
    else if (arg == "--calls") max_calls = std::strtoll(value().c_str(), nullptr, 0);
    else if (arg == "--seed") base_seed = std::strtoull(value().c_str(), nullptr, 0);
    else if (arg == "--replay") replay = true, replay_seed = std::strtoull(value().c_str(), nullptr, 0);
    else if (arg == "--verbose") verbose = true;
    else {
      std::fprintf(stderr, "usage: attnkit_fuzz [--seconds S] [--calls N] [--seed X] [--replay SEED] [--verbose]\n");
      return 2;
    }
  }
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, on_signal);
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_set_death_callback(print_current_seed);
#endif
  const std::vector<std::string> isas = attnkit::supported_isas();
  std::map<Api, Tally> tally;
  const auto start = std::chrono::steady_clock::now();
  int64_t calls = 0;
  for (int64_t i = 0; replay ? i < 1 : i < max_calls; ++i) {
    if (!replay && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= seconds) break;
    const uint64_t seed = replay ? replay_seed : splitmix(base_seed + static_cast<uint64_t>(i));
    g_current_seed = seed;
    g_in_call = true;
    try {
      const auto call_start = std::chrono::steady_clock::now();
      const int64_t compared_before = g_compared;
      const auto [api, ok] = run_one(seed, verbose || replay, isas);
      (ok ? tally[api].ok : tally[api].error)++;
      tally[api].compared += g_compared - compared_before;
      tally[api].seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - call_start).count();
    } catch (const Failure& f) {
      std::fprintf(stderr, "attnkit_fuzz: FAILED call with seed 0x%016llx (replay: --replay 0x%016llx)\n%s",
                   static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed), f.what.c_str());
      return 1;
    }
    g_in_call = false;
    ++calls;
  }
  std::printf("attnkit_fuzz: %lld calls in %.0f s (base seed 0x%llx, ISAs:", static_cast<long long>(calls),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              static_cast<unsigned long long>(base_seed));
  for (const auto& isa : isas) std::printf(" %s", isa.c_str());
  std::printf(")\n");
  for (const auto& [api, t] : tally) {
    std::printf("  %-30s %7lld calls: %7lld returned, %7lld attnkit::Error, %8lld values checked against a "
                "reference, %5.1f s\n",
                api_name(api), static_cast<long long>(t.ok + t.error), static_cast<long long>(t.ok),
                static_cast<long long>(t.error), static_cast<long long>(t.compared), t.seconds);
  }
  return 0;
}
