// CPU feature detection and the ISA dispatch table. The best variant this CPU runs is
// chosen once; ATTNKIT_ISA or set_isa() may pick a lower one (tests run every variant).
#include "core/dispatch.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "attnkit/error.h"
#include "attnkit/runtime.h"

namespace attnkit {
namespace {

struct Variant {
  const cpu::KernelTable* table;
  const cpu::ProbeTable* probes;
  bool (*runnable)();
};

bool cpu_has(const char* feature);

// Best first.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = {
#if ATTNKIT_HAVE_AVX512BF16
      {&cpu::avx512bf16::kernel_table, &cpu::avx512bf16::probe_table,
       [] {
         return cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl") &&
                cpu_has("avx512dq") && cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c") &&
                cpu_has("bmi2") && cpu_has("avx512bf16") && cpu_has("avx512vnni");
       }},
#endif
#if ATTNKIT_HAVE_AVX512
      {&cpu::avx512::kernel_table, &cpu::avx512::probe_table,
       [] {
         return cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl") &&
                cpu_has("avx512dq") && cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c") &&
                cpu_has("bmi2");
       }},
#endif
#if ATTNKIT_HAVE_AVX2
      {&cpu::avx2::kernel_table, &cpu::avx2::probe_table,
       [] { return cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c") && cpu_has("bmi2"); }},
#endif
      {&cpu::generic::kernel_table, &cpu::generic::probe_table, [] { return true; }},
  };
  return all;
}

bool cpu_has(const char* feature) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  std::string f = feature;
  // __builtin_cpu_supports needs literal names.
  if (f == "avx2") return __builtin_cpu_supports("avx2");
  if (f == "fma") return __builtin_cpu_supports("fma");
  if (f == "f16c") return __builtin_cpu_supports("f16c");
  if (f == "bmi2") return __builtin_cpu_supports("bmi2");
  if (f == "avx512f") return __builtin_cpu_supports("avx512f");
  if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (f == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (f == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
  if (f == "avx512fp16") return __builtin_cpu_supports("avx512fp16");
  if (f == "avx512vnni") return __builtin_cpu_supports("avx512vnni");
  if (f == "amx-tile") return __builtin_cpu_supports("amx-tile");
#endif
  (void)feature;
  return false;
}

const Variant* find(const std::string& name) {
  for (const Variant& v : variants()) {
    if (name == v.table->isa && v.runnable()) return &v;
  }
  return nullptr;
}

std::string runnable_names() {
  std::string names;
  for (const Variant& v : variants()) {
    if (v.runnable()) names += (names.empty() ? "" : ", ") + std::string(v.table->isa);
  }
  return names;
}

// The best runnable variant, or ATTNKIT_ISA's. A value naming no variant runnable here is
// reported once (this runs once) and the best one used: an image or job script that sets
// ATTNKIT_ISA on every machine must not break attnkit on a CPU that lacks that variant, and
// every variant computes the same results within the documented tolerances. set_isa()
// raises instead, for code that needs one variant.
const Variant* initial_variant() {
  const Variant* best = &variants().back();
  for (const Variant& v : variants()) {
    if (v.runnable()) {
      best = &v;
      break;
    }
  }
  const char* env = std::getenv("ATTNKIT_ISA");
  if (!env || !*env) return best;
  if (const Variant* v = find(env)) return v;
  bool compiled = false;
  for (const Variant& v : variants()) compiled = compiled || env == std::string(v.table->isa);
  std::fprintf(stderr, "attnkit: warning: ATTNKIT_ISA=\"%s\" is %s (runnable here: %s); using %s\n", env,
               compiled ? "not supported by this CPU" : "not a kernel variant of this build",
               runnable_names().c_str(), best->table->isa);
  return best;
}

std::atomic<const Variant*>& active() {
  static std::atomic<const Variant*> variant{initial_variant()};
  return variant;
}

}  // namespace

const cpu::KernelTable& detail::kernels() { return *active().load()->table; }
const cpu::ProbeTable& detail::probes() { return *active().load()->probes; }

std::string active_isa() { return detail::kernels().isa; }

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const Variant& v : variants()) {
    if (v.runnable()) names.push_back(v.table->isa);
  }
  return names;
}

void set_isa(const std::string& name) {
  const Variant* v = find(name);
  if (!v) {
    throw Error("isa must be one of the variants supported here (" + runnable_names() + "), got \"" + name +
                "\"");
  }
  active().store(v);
}

std::string cpu_features() {
  std::string out;
  for (const char* f : {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
                        "avx512dq", "avx512bf16", "avx512fp16", "avx512vnni", "amx-tile"}) {
    if (cpu_has(f)) out += (out.empty() ? "" : " ") + std::string(f);
  }
  return out;
}

}  // namespace attnkit
