// A seeded random-call fuzz driver over attnkit's C++ API: attention, sage_attention (int8
// and fp4), sparse_mla_prefill_fwd and sparse_mla_q8kv8_prefill_fwd, on every ISA and a few
// thread counts. Shapes include 0, 1, odd sizes and tile edges; strides are contiguous,
// permuted, padded, stepped, negative and zero (inputs), or overlapping and aliasing
// (outputs, which must then be rejected). Every tensor lives in a heap block of exactly its
// span, so AddressSanitizer sees any read or write outside it.
//
// The contract checked per call: it throws attnkit::Error (always, when the call was made
// invalid on purpose: overlapping or aliasing outputs, non-finite scales), or it returns
// with every output element written (outputs are poisoned with a signalling-NaN pattern no
// kernel writes) and nothing outside them touched; inputs are never modified either way.
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
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "attnkit/attnkit.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

namespace {

using attnkit::DType;
using attnkit::TensorView;

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

// Poison patterns: signalling NaNs (quiet bit clear); kernels only ever write quiet NaNs.
constexpr uint32_t kPoison32 = 0x7FBADBADu;
constexpr uint16_t kPoisonBf16 = 0x7F9Du, kPoisonF16 = 0x7D5Bu;

struct Failure {
  std::string what;
};

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  int64_t range(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(gen_) < p; }
  template <class T>
  T pick(std::initializer_list<T> xs) {
    return xs.begin()[range(0, static_cast<int64_t>(xs.size()) - 1)];
  }
  double normal() { return std::normal_distribution<double>()(gen_); }
  uint64_t bits() { return gen_(); }

 private:
  std::mt19937_64 gen_;
};

// One tensor of a call: its view, its heap block (exactly the view's span) and a copy of
// the block taken before the call.
struct Tensor {
  std::string name;
  TensorView view;
  std::shared_ptr<std::vector<uint8_t>> block;  // shared when a view aliases another's memory
  std::vector<uint8_t> before;
  bool output = false;
  bool maybe_overlapping = false;  // a stride was perturbed: whether it overlaps is computed
};

int64_t elem_offset(const TensorView& t, int64_t index) {
  int64_t off = 0;
  for (int d = t.rank - 1; d >= 0; --d) {
    off += index % t.shape[d] * t.strides[d];
    index /= t.shape[d];
  }
  return off;
}

std::string describe(const TensorView& t) {
  std::ostringstream s;
  s << attnkit::dtype_name(t.dtype) << t.shape_str() << " strides [";
  for (int d = 0; d < t.rank; ++d) s << (d ? ", " : "") << t.strides[d];
  s << "]" << (t.data ? "" : " data=null");
  return s.str();
}

// A random finite-or-not value for input tensors: mostly normal, sometimes 0, huge, NaN, inf.
double random_value(Rng& rng, bool specials) {
  if (specials && rng.chance(0.002)) return rng.pick<double>({NAN, INFINITY, -INFINITY, 3e38, -3e38, 0.0, 1e-42});
  return rng.normal();
}

void store_value(DType dtype, uint8_t* p, double x, Rng& rng) {
  switch (dtype) {
    case DType::float32: {
      const float f = static_cast<float>(x);
      std::memcpy(p, &f, 4);
      break;
    }
    case DType::float16: {
      const uint16_t h = attnkit::float_to_float16(static_cast<float>(x));
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::bfloat16: {
      const uint16_t h = attnkit::float_to_bfloat16(static_cast<float>(x));
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::float8_e4m3fn: *p = attnkit::float_to_float8_e4m3fn(static_cast<float>(x)); break;
    case DType::boolean: *p = rng.chance(0.8) ? 1 : 0; break;
    default: *p = static_cast<uint8_t>(rng.bits()); break;
  }
}

class Call {
 public:
  Call(uint64_t seed, bool verbose) : rng(seed), verbose_(verbose) {}

  Rng rng;
  std::vector<std::unique_ptr<Tensor>> tensors;
  bool must_fail = false;   // made invalid on purpose: an Error is required
  std::string must_fail_why;
  std::ostringstream log;

  // Layout kinds for make().
  enum class Kind { input, output };

  // A view of `shape` in a fresh heap block of exactly its span. Inputs may be permuted,
  // padded, stepped, reversed or broadcast (zero stride); outputs permuted, padded, stepped
  // or reversed, and sometimes (overlap_chance) made self-overlapping.
  TensorView& make(const std::string& name, DType dtype, std::vector<int64_t> shape, Kind kind,
                   double overlap_chance = 0.0, double plain_chance = 0.5) {
    auto t = std::make_unique<Tensor>();
    t->name = name;
    t->output = kind == Kind::output;
    const int rank = static_cast<int>(shape.size());
    TensorView& v = t->view;
    v.dtype = dtype;
    v.rank = rank;
    for (int d = 0; d < rank; ++d) v.shape[d] = shape[d];
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    // Memory order of the dims, and a step and padding per dim.
    std::vector<int> order(rank);
    for (int d = 0; d < rank; ++d) order[d] = d;
    const bool plain = rng.chance(plain_chance);
    if (!plain && rng.chance(0.5)) std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<uint32_t>(rng.bits())));
    int64_t stride = 1;
    for (int i = rank - 1; i >= 0; --i) {
      const int d = order[i];
      const int64_t step = !plain && rng.chance(0.2) ? rng.range(2, 3) : 1;
      v.strides[d] = stride * step;
      stride = v.strides[d] * shape[d] + (!plain && rng.chance(0.3) ? rng.range(1, 5) : 0);
      if (stride == 0) stride = 1;
    }
    if (!plain && rank > 0 && rng.chance(0.2)) {  // one dim reversed
      const int d = static_cast<int>(rng.range(0, rank - 1));
      v.strides[d] = -v.strides[d];
    }
    if (!plain && kind == Kind::input && rank > 0 && rng.chance(0.2)) {  // broadcast along one dim
      v.strides[rng.range(0, rank - 1)] = 0;
    }
    if (kind == Kind::output && rank > 0 && rng.chance(overlap_chance)) {
      const int d = static_cast<int>(rng.range(0, rank - 1));
      v.strides[d] = rng.pick<int64_t>({0, 1, v.strides[d] / 2, v.strides[d] - 1});
      t->maybe_overlapping = true;
    }
    // The span [lo, hi] of element offsets, allocated exactly.
    int64_t lo = 0, hi = 0;
    for (int d = 0; d < rank; ++d) {
      const int64_t reach = (shape[d] - 1) * v.strides[d];
      if (shape[d] > 0) (reach < 0 ? lo : hi) += reach;
    }
    const int64_t item = static_cast<int64_t>(attnkit::dtype_size(dtype));
    if (numel == 0) {
      if (rng.chance(0.5)) {
        v.data = nullptr;  // as an empty torch tensor
      } else {
        t->block = std::make_shared<std::vector<uint8_t>>(item);
        v.data = t->block->data();
      }
    } else {
      t->block = std::make_shared<std::vector<uint8_t>>((hi - lo + 1) * item);
      v.data = t->block->data() - lo * item;
    }
    fill(*t);
    log << "  " << name << ": " << describe(v) << "\n";
    tensors.push_back(std::move(t));
    return tensors.back()->view;
  }

  // An output view on the memory of input `of` (same dtype required for a meaningful alias).
  TensorView& alias(const std::string& name, const Tensor& of, std::vector<int64_t> shape, DType dtype) {
    auto t = std::make_unique<Tensor>();
    t->name = name;
    t->output = true;
    t->block = of.block;
    TensorView& v = t->view;
    v.dtype = dtype;
    v.rank = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = v.rank - 1; d >= 0; --d) v.shape[d] = shape[d], v.strides[d] = stride, stride *= shape[d];
    v.data = of.block ? of.block->data() : nullptr;
    log << "  " << name << ": " << describe(v) << " aliasing " << of.name << "\n";
    tensors.push_back(std::move(t));
    return tensors.back()->view;
  }

  const Tensor& last() const { return *tensors.back(); }

  // Whether two indices of t address the same element.
  static bool self_overlaps(const TensorView& t) {
    int64_t numel = 1;
    for (int d = 0; d < t.rank; ++d) numel *= t.shape[d];
    std::vector<int64_t> offs(numel);
    for (int64_t i = 0; i < numel; ++i) offs[i] = elem_offset(t, i);
    std::sort(offs.begin(), offs.end());
    return std::adjacent_find(offs.begin(), offs.end()) != offs.end();
  }

  void require_error(const std::string& why) {
    if (!must_fail) must_fail_why = why;
    must_fail = true;
  }

  // Runs op and checks the contract; throws Failure.
  template <class Op>
  bool run(Op op) {
    for (auto& t : tensors) {
      if (t->maybe_overlapping && self_overlaps(t->view)) require_error(t->name + " overlaps itself");
    }
    for (auto& t : tensors) {
      if (t->block) t->before = *t->block;
    }
    bool threw = false;
    std::string error;
    try {
      op();
    } catch (const attnkit::Error& e) {
      threw = true;
      error = e.what();
    } catch (const std::exception& e) {
      throw Failure{std::string("threw a non-attnkit exception: ") + e.what()};
    }
    if (verbose_) std::fprintf(stderr, "%s  -> %s\n", log.str().c_str(), threw ? ("Error: " + error).c_str() : "ok");
    if (threw && error.empty()) throw Failure{"threw an Error with an empty message"};
    if (!threw && must_fail) throw Failure{"accepted an invalid call (" + must_fail_why + ")"};
    // Inputs (and, after an Error, outputs too) are byte-for-byte unchanged.
    for (auto& t : tensors) {
      if (!t->block || (t->output && !threw)) continue;
      if (*t->block != t->before) {
        throw Failure{(t->output ? "an Error left output " : "modified input ") + t->name +
                      (threw ? " (call threw: " + error + ")" : "")};
      }
    }
    if (threw) return false;
    for (auto& t : tensors) {
      if (t->output) check_written(*t);
    }
    return true;
  }

 private:
  bool verbose_;

  static bool is_poison(DType dtype, const uint8_t* p) {
    if (dtype == DType::float32) {
      uint32_t u;
      std::memcpy(&u, p, 4);
      return u == kPoison32;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h == (dtype == DType::bfloat16 ? kPoisonBf16 : kPoisonF16);
  }

  // Every element of the view written; every other byte of its block as before.
  static void check_written(const Tensor& t) {
    if (!t.block) return;
    const TensorView& v = t.view;
    const int64_t item = static_cast<int64_t>(attnkit::dtype_size(v.dtype));
    int64_t numel = 1;
    for (int d = 0; d < v.rank; ++d) numel *= v.shape[d];
    std::vector<uint8_t> covered(t.block->size(), 0);
    const auto* base = static_cast<const uint8_t*>(v.data);
    for (int64_t i = 0; i < numel; ++i) {
      const uint8_t* p = base + elem_offset(v, i) * item;
      if (is_poison(v.dtype, p)) throw Failure{"output " + t.name + " element " + std::to_string(i) + " not written"};
      std::memset(covered.data() + (p - t.block->data()), 1, item);
    }
    for (size_t b = 0; b < covered.size(); ++b) {
      if (!covered[b] && (*t.block)[b] != t.before[b]) {
        throw Failure{"wrote byte " + std::to_string(b) + " of " + t.name + "'s block outside its view"};
      }
    }
  }

  void fill(Tensor& t) {
    if (!t.block) return;
    const TensorView& v = t.view;
    const int64_t item = static_cast<int64_t>(attnkit::dtype_size(v.dtype));
    uint8_t* p = t.block->data();
    const int64_t n = static_cast<int64_t>(t.block->size()) / item;
    for (int64_t i = 0; i < n; ++i) {
      if (t.output) {
        if (v.dtype == DType::float32) {
          std::memcpy(p + i * 4, &kPoison32, 4);
        } else {
          const uint16_t h = v.dtype == DType::bfloat16 ? kPoisonBf16 : kPoisonF16;
          std::memcpy(p + i * 2, &h, 2);
        }
      } else {
        store_value(v.dtype, p + i * item, random_value(rng, true), rng);
      }
    }
  }
};

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

enum class Api { attention, sage_int8, sage_fp4, sparse_mla, sparse_q8kv8 };
const char* api_name(Api a) {
  switch (a) {
    case Api::attention: return "attention";
    case Api::sage_int8: return "sage_attention(int8)";
    case Api::sage_fp4: return "sage_attention(fp4)";
    case Api::sparse_mla: return "sparse_mla_prefill_fwd";
    case Api::sparse_q8kv8: return "sparse_mla_q8kv8_prefill_fwd";
  }
  return "?";
}

std::vector<int64_t> layout_shape(attnkit::Layout layout, int64_t b, int64_t h, int64_t s, int64_t d) {
  return layout == attnkit::Layout::BHSD ? std::vector<int64_t>{b, h, s, d} : std::vector<int64_t>{b, s, h, d};
}

bool fuzz_attention(Call& c, Api api) {
  Rng& rng = c.rng;
  const bool sage = api != Api::attention, fp4 = api == Api::sage_fp4;
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
    return c.run([&] { attnkit::sage_attention(s); });
  }
  return c.run([&] { attnkit::attention(a); });
}

// ---- sparse MLA

float pick_scale(Rng& rng, bool& bad) {
  const float x = rng.chance(0.8) ? static_cast<float>(std::fabs(rng.normal()) + 0.1)
                                  : rng.pick<float>({0.0f, -0.5f, NAN, INFINITY, -INFINITY, 1e30f});
  bad = bad || !std::isfinite(x);
  return x;
}

bool fuzz_sparse(Call& c, bool strict) {
  Rng& rng = c.rng;
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
  // Indices: valid rows, -1, out of range, INT_MIN/INT_MAX; written after fill.
  a.indices = c.make("indices", DType::int32, {s_q, 1, topk}, Call::Kind::input, 0.0, plain);
  {
    const TensorView& t = a.indices;
    for (int64_t i = 0; i < s_q * topk; ++i) {
      int32_t x;
      const double u = rng.range(0, 99);
      if (u < 70 && s_kv > 0) x = static_cast<int32_t>(rng.range(0, s_kv - 1));
      else if (u < 85) x = -1;
      else x = rng.pick<int32_t>({static_cast<int32_t>(s_kv), INT32_MIN, INT32_MAX, -2, static_cast<int32_t>(rng.bits())});
      std::memcpy(static_cast<int32_t*>(t.data) + elem_offset(t, i), &x, 4);
    }
  }
  bool bad_scale = false;
  const bool fp8 = dtype == DType::float8_e4m3fn;
  if (fp8 || rng.chance(0.3)) {
    if (!(perturb == 2)) {
      a.q_scale = c.make("q_scale", DType::float32, {1}, Call::Kind::input);
      const float x = pick_scale(rng, bad_scale);
      std::memcpy(a.q_scale->data, &x, 4);
    }
    a.kv_scale = c.make("kv_scale", DType::float32, rng.chance(0.5) ? std::vector<int64_t>{1} : std::vector<int64_t>{},
                        Call::Kind::input);
    const float x = pick_scale(rng, bad_scale);
    std::memcpy(a.kv_scale->data, &x, 4);
  }
  a.sm_scale = rng.chance(0.8) ? 1.0 / std::sqrt(static_cast<double>(d_qk))
                               : rng.pick<double>({0.0, -0.3, NAN, INFINITY, 1e39, 1e30});
  if (!std::isfinite(static_cast<float>(a.sm_scale))) bad_scale = true;
  if (rng.chance(0.4)) a.attn_sink = c.make("attn_sink", DType::float32, {h_q}, Call::Kind::input);
  if (rng.chance(0.5)) {
    a.topk_length = c.make("topk_length", DType::int32, {s_q}, Call::Kind::input);
    const TensorView& t = *a.topk_length;
    for (int64_t i = 0; i < s_q; ++i) {
      const int32_t x = rng.chance(0.85) ? static_cast<int32_t>(rng.range(0, topk))
                                         : rng.pick<int32_t>({-1, static_cast<int32_t>(topk + 1), INT32_MIN, INT32_MAX});
      std::memcpy(static_cast<int32_t*>(t.data) + elem_offset(t, i), &x, 4);
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
  c.log << "  sm_scale=" << a.sm_scale << "\n";
  if (strict) return c.run([&] { attnkit::sparse_mla_q8kv8_prefill_fwd(a); });
  return c.run([&] { attnkit::sparse_mla_prefill_fwd(a); });
}

struct Tally {
  int64_t ok = 0, error = 0;
};

Api pick_api(Rng& rng) {
  const int64_t u = rng.range(0, 99);
  if (u < 40) return Api::attention;
  if (u < 65) return Api::sage_int8;
  if (u < 70) return Api::sage_fp4;
  if (u < 90) return Api::sparse_mla;
  return Api::sparse_q8kv8;
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
    const bool ok = api == Api::sparse_mla || api == Api::sparse_q8kv8 ? fuzz_sparse(c, api == Api::sparse_q8kv8)
                                                                         : fuzz_attention(c, api);
    return {api, ok};
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
      const auto [api, ok] = run_one(seed, verbose || replay, isas);
      (ok ? tally[api].ok : tally[api].error)++;
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
    std::printf("  %-30s %8lld calls: %8lld returned, %8lld attnkit::Error\n", api_name(api),
                static_cast<long long>(t.ok + t.error), static_cast<long long>(t.ok), static_cast<long long>(t.error));
  }
  return 0;
}
