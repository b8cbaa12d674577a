// The fuzz driver's shared layer: seeded random values, the tensors of one call (each in a
// heap block of exactly its span, poisoned outputs, a copy of every block taken before the
// call), the call's contract check (Call::run), and the double-precision row reference with
// its tolerances. The API fuzzers (fuzz_api.cpp, fuzz_dsa.cpp) build calls on it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"

namespace attnkit_fuzz {

using attnkit::DType;
using attnkit::TensorView;

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
  bool in_place = false;           // an input the call may change when it succeeds (a cache, an in-place merge)
  bool maybe_overlapping = false;  // a stride was perturbed: whether it overlaps is computed
  bool partly_written = false;     // an output the op may leave partly unwritten (its fuzzer checks which)
};

inline int64_t elem_offset(const TensorView& t, int64_t index) {
  int64_t off = 0;
  for (int d = t.rank - 1; d >= 0; --d) {
    off += index % t.shape[d] * t.strides[d];
    index /= t.shape[d];
  }
  return off;
}

inline std::string describe(const TensorView& t) {
  std::ostringstream s;
  s << attnkit::dtype_name(t.dtype) << t.shape_str() << " strides [";
  for (int d = 0; d < t.rank; ++d) s << (d ? ", " : "") << t.strides[d];
  s << "]" << (t.data ? "" : " data=null");
  return s.str();
}

// A random finite-or-not value for input tensors: mostly normal, sometimes 0, huge, NaN, inf.
inline double random_value(Rng& rng, bool specials) {
  if (specials && rng.chance(0.002)) return rng.pick<double>({NAN, INFINITY, -INFINITY, 3e38, -3e38, 0.0, 1e-42});
  return rng.normal();
}

inline void store_value(DType dtype, uint8_t* p, double x, Rng& rng) {
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
    case DType::float8_e5m2: *p = attnkit::float_to_float8_e5m2(static_cast<float>(x)); break;
    case DType::boolean: *p = rng.chance(0.8) ? 1 : 0; break;
    default: *p = static_cast<uint8_t>(rng.bits()); break;
  }
}

inline double load_value(DType dtype, const uint8_t* p) {
  switch (dtype) {
    case DType::float32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::float16:
    case DType::bfloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return dtype == DType::float16 ? attnkit::float16_to_float(h) : attnkit::bfloat16_to_float(h);
    }
    case DType::float8_e4m3fn: return attnkit::float8_e4m3fn_to_float(*p);
    case DType::float8_e5m2: return attnkit::float8_e5m2_to_float(*p);
    case DType::int32: {
      int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DType::int64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return static_cast<double>(x);
    }
    case DType::int8: return static_cast<int8_t>(*p);
    default: return *p;
  }
}

// The element of t at a multi-index (one index per dim).
inline const uint8_t* element(const TensorView& t, std::initializer_list<int64_t> index) {
  int64_t off = 0;
  int d = 0;
  for (int64_t i : index) off += i * t.strides[d++];
  return static_cast<const uint8_t*>(t.data) + off * static_cast<int64_t>(attnkit::dtype_size(t.dtype));
}
inline double at(const TensorView& t, std::initializer_list<int64_t> index) { return load_value(t.dtype, element(t, index)); }

// Index arrays: element i (row-major) of an int32 / int64 view, written and read back
// (through a zero or repeated stride the value read may be another element's).
inline void put_int(const TensorView& t, int64_t i, int64_t x) {
  uint8_t* p = static_cast<uint8_t*>(t.data) + elem_offset(t, i) * static_cast<int64_t>(attnkit::dtype_size(t.dtype));
  if (t.dtype == DType::int64) {
    std::memcpy(p, &x, 8);
  } else {
    const auto y = static_cast<int32_t>(x);
    std::memcpy(p, &y, 4);
  }
}
inline int64_t get_int(const TensorView& t, int64_t i) {
  const uint8_t* p = static_cast<const uint8_t*>(t.data) + elem_offset(t, i) * static_cast<int64_t>(attnkit::dtype_size(t.dtype));
  return static_cast<int64_t>(load_value(t.dtype, p));
}

class Call {
 public:
  Call(uint64_t seed, bool verbose) : rng(seed), verbose_(verbose) {}

  Rng rng;
  std::vector<std::unique_ptr<Tensor>> tensors;
  bool must_fail = false;   // made invalid on purpose: an Error is required
  std::string must_fail_why;
  std::ostringstream log;
  bool specials = true;     // inputs may hold NaN, inf, huge values (no reference check then)

  // Layout kinds for make(): in_place is written by the op (a cache) but starts with values.
  enum class Kind { input, output, in_place };

  // A view of `shape` in a fresh heap block of exactly its span. Inputs may be permuted,
  // padded, stepped, reversed or broadcast (zero stride); outputs permuted, padded, stepped
  // or reversed, and sometimes (overlap_chance) made self-overlapping.
  TensorView& make(const std::string& name, DType dtype, std::vector<int64_t> shape, Kind kind,
                   double overlap_chance = 0.0, double plain_chance = 0.5) {
    auto t = std::make_unique<Tensor>();
    t->name = name;
    t->output = kind == Kind::output;
    t->in_place = kind == Kind::in_place;
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
    if (kind != Kind::input && rank > 0 && rng.chance(overlap_chance)) {
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

  // Whether a contiguous view of shape and dtype on `of`'s memory (alias()) is non-empty and
  // stays inside of's block.
  static bool fits(const Tensor& of, const std::vector<int64_t>& shape, DType dtype) {
    int64_t numel = 1;
    for (int64_t x : shape) numel *= x;
    return of.block && numel > 0 &&
           numel * static_cast<int64_t>(attnkit::dtype_size(dtype)) <= static_cast<int64_t>(of.block->size());
  }

  // An output that is exactly the view of `of` (an in-place merge): of may then change.
  TensorView& same_view(const std::string& name, Tensor& of) {
    auto t = std::make_unique<Tensor>();
    t->name = name;
    t->output = true;
    t->block = of.block;
    t->view = of.view;
    of.in_place = true;
    log << "  " << name << ": the view of " << of.name << "\n";
    tensors.push_back(std::move(t));
    return tensors.back()->view;
  }

  Tensor& last() { return *tensors.back(); }

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
      if (!t->block || ((t->output || t->in_place) && !threw)) continue;
      if (*t->block != t->before) {
        throw Failure{(t->output ? "an Error left output " : "modified input ") + t->name +
                      (threw ? " (call threw: " + error + ")" : "")};
      }
    }
    if (threw) return false;
    for (auto& t : tensors) {
      if (t->output) check_written(*t, !t->partly_written);
    }
    return true;
  }

 private:
  bool verbose_;

 public:
  // Whether the element at p still holds its output poison (never for 1-byte outputs, whose
  // every value is some code: their callers compare every byte with a reference).
  static bool is_poison(DType dtype, const uint8_t* p) {
    const size_t item = attnkit::dtype_size(dtype);
    if (item == 4) {
      uint32_t u;
      std::memcpy(&u, p, 4);
      return u == kPoison32;
    }
    if (item != 2) return false;
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h == (dtype == DType::bfloat16 ? kPoisonBf16 : kPoisonF16);
  }

  // Every element of the view written (require_written), every other byte of its block as before.
  static void check_written(const Tensor& t, bool require_written = true) {
    if (!t.block) return;
    const TensorView& v = t.view;
    const int64_t item = static_cast<int64_t>(attnkit::dtype_size(v.dtype));
    int64_t numel = 1;
    for (int d = 0; d < v.rank; ++d) numel *= v.shape[d];
    std::vector<uint8_t> covered(t.block->size(), 0);
    const auto* base = static_cast<const uint8_t*>(v.data);
    for (int64_t i = 0; i < numel; ++i) {
      const uint8_t* p = base + elem_offset(v, i) * item;
      if (require_written && is_poison(v.dtype, p)) {
        throw Failure{"output " + t.name + " element " + std::to_string(i) + " not written"};
      }
      std::memset(covered.data() + (p - t.block->data()), 1, item);
    }
    for (size_t b = 0; b < covered.size(); ++b) {
      if (!covered[b] && (*t.block)[b] != t.before[b]) {
        throw Failure{"wrote byte " + std::to_string(b) + " of " + t.name + "'s block outside its view"};
      }
    }
  }

 private:
  void fill(Tensor& t) {
    if (!t.block) return;
    const TensorView& v = t.view;
    const int64_t item = static_cast<int64_t>(attnkit::dtype_size(v.dtype));
    uint8_t* p = t.block->data();
    const int64_t n = static_cast<int64_t>(t.block->size()) / item;
    for (int64_t i = 0; i < n; ++i) {
      if (t.output) {
        if (item == 4) {  // float32, or int32 (no index an op writes)
          std::memcpy(p + i * 4, &kPoison32, 4);
        } else if (item == 2) {
          const uint16_t h = v.dtype == DType::bfloat16 ? kPoisonBf16 : kPoisonF16;
          std::memcpy(p + i * 2, &h, 2);
        } else {  // bytes (every pattern is a value), or a dtype no op writes (the call must fail)
          std::memset(p + i * item, 0xA5, item);
        }
      } else {
        store_value(v.dtype, p + i * item, random_value(rng, specials), rng);
      }
    }
  }
};

// Sometimes one of the call's non-empty views loses its data pointer: the op must refuse it
// before reading anything.
inline void maybe_null_data(Call& c, std::initializer_list<TensorView*> views) {
  if (!c.rng.chance(0.03)) return;
  std::vector<TensorView*> filled;
  for (TensorView* v : views) {
    if (v && v->data && v->numel() > 0) filled.push_back(v);
  }
  if (filled.empty()) return;
  filled[c.rng.range(0, static_cast<int64_t>(filled.size()) - 1)]->data = nullptr;
  c.log << "  (one view's data set to null)\n";
  c.require_error("a view with elements and no data");
}
inline TensorView* opt(std::optional<TensorView>& v) { return v ? &*v : nullptr; }

// ---- double references and their tolerances

// A query row's attention in double over n keys: visible(j), score(j) (scaled, with the
// score modifiers), value(j, e); sink in the denominator only. mag gets the largest |v| of
// a visible key (what the rounding of P and of out scales with), smax the largest |score|.
struct RowRef {
  std::vector<double> out;
  double lse = -INFINITY, max = -INFINITY, mag = 0, smax = 0;  // max: the largest visible score
};
inline RowRef attend_row(int64_t n, int64_t dv, const std::function<bool(int64_t)>& visible,
                  const std::function<double(int64_t)>& score, const std::function<double(int64_t, int64_t)>& value,
                  std::optional<double> sink) {
  RowRef r;
  r.out.assign(dv, 0.0);
  std::vector<double> s(n, -INFINITY);
  double m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    if (!visible(j)) continue;
    s[j] = score(j);
    m = std::max(m, s[j]);
    r.smax = std::max(r.smax, std::fabs(s[j]));
  }
  if (m == -INFINITY) return r;  // no key: out 0, lse -inf
  r.max = m;
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += s[j] == -INFINITY ? 0.0 : std::exp(s[j] - m);
  r.lse = m + std::log(sum);
  const double denom = sum + (sink ? std::exp(*sink - m) : 0.0);
  for (int64_t j = 0; j < n; ++j) {
    if (s[j] == -INFINITY) continue;
    const double p = std::exp(s[j] - m);
    for (int64_t e = 0; e < dv; ++e) {
      const double x = value(j, e);
      r.out[e] += p * x / denom;
      r.mag = std::max(r.mag, std::fabs(x));
    }
  }
  return r;
}

// Relative tolerance of an output of dtype: float32 arithmetic (error growing with the
// scores' size), plus for bf16 the rounding of P and out, for fp16 that of out.
inline double rel_tol(DType dtype, double smax) {
  const double f32 = 2e-5 * (1 + smax);
  return f32 + (dtype == DType::bfloat16 ? 1.2e-2 : dtype == DType::float16 ? 2e-3 : 0.0);
}

inline int64_t g_compared = 0;  // elements compared with a reference (all calls)

inline void expect_near(double got, double want, double tol, const std::string& what) {
  ++g_compared;
  const bool same_inf = std::isinf(want) && got == want;
  if (!same_inf && !(std::fabs(got - want) <= tol)) {
    std::ostringstream s;
    s << what << ": got " << got << ", the double reference " << want << " (tolerance " << tol << ")";
    throw Failure{s.str()};
  }
}

// The tolerance of an lse against the reference's: none where that is infinite (a row that
// saw no key must give exactly the documented value).
inline double lse_tol(const RowRef& want) {
  return std::isfinite(want.lse) ? 2e-5 * (1 + want.smax) + 1e-5 * std::fabs(want.lse) : 0.0;
}

inline void expect_row(const RowRef& want, const std::function<double(int64_t)>& out, std::optional<double> lse,
                DType dtype, const std::string& what) {
  const double tol = rel_tol(dtype, want.smax) * (1 + want.mag);
  for (size_t e = 0; e < want.out.size(); ++e) {
    expect_near(out(static_cast<int64_t>(e)), want.out[e], tol, what + " out[" + std::to_string(e) + "]");
  }
  if (lse) expect_near(*lse, want.lse, lse_tol(want), what + " lse");
}

// A valid dense attention call (finite inputs, no dropout): four random query rows against

}  // namespace attnkit_fuzz
