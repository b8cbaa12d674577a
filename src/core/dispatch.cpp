// CPU feature detection and the ISA dispatch table. The variant that is fastest on this CPU
// is chosen once, by its features and a per-vendor rule for bf16 (below); ATTNKIT_ISA or
// set_isa() may pick another runnable one (tests run every variant).
#include "core/dispatch.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "attnkit/error.h"
#include "attnkit/runtime.h"
#include "ops/attention_params.h"

namespace attnkit {
namespace {

struct Variant {
  const cpu::KernelTable* table;
  const cpu::ProbeTable* probes;
  bool (*runnable)();
};

bool cpu_has(const char* feature);

struct CpuId {
  std::string vendor;  // "GenuineIntel", "AuthenticAMD", ... ("" off x86)
  int family = 0, model = 0;
};

// Vendor, and family and model as the kernel reports them (base + extended fields).
CpuId cpu_id() {
  CpuId id;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return id;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  id.vendor = vendor;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return id;
  const int base_family = (a >> 8) & 0xF, base_model = (a >> 4) & 0xF;
  id.family = base_family == 0xF ? base_family + static_cast<int>((a >> 20) & 0xFF) : base_family;
  id.model = base_family == 0x6 || base_family == 0xF ? static_cast<int>(((a >> 16) & 0xF) << 4) + base_model
                                                      : base_model;
#endif
  return id;
}

std::string describe(const CpuId& id) {
  if (id.vendor.empty()) return "a CPU without cpuid";
  return id.vendor + " family " + std::to_string(id.family) + " model " + std::to_string(id.model);
}

// The bf16 rule: Intel's family-6 cores with AVX512_BF16 (Sapphire, Emerald and Granite
// Rapids; Cooper Lake too, but without VBMI it runs avx512) run vdpbf16ps at about half their fp32 FMA rate (measured on Emerald
// Rapids: 88 vs 180 GFLOP/s per core), so bf16 inputs are faster converted to fp32 for FMAs
// there; AMD Zen 4 and Zen 5 run it at 1.75-1.84x the fp32 rate. Decided by cpuid alone, so
// the choice is the same on every run; the benchmark measures both peaks and says when a
// machine disagrees with the rule.
bool bf16_dot_slower_than_fma(const CpuId& id) { return id.vendor == "GenuineIntel" && id.family == 6; }

// The read-ahead rule (decode.h, attend_kv_heads): on AMD Zen 4 (family 25) decode over
// grouped kv heads ran in 0.64-0.86 of the time reading the block after next into L2 share by
// share; on Zen 5 (family 26) and the Xeons reading the next block was as fast or faster.
bool zen4_read_ahead(const CpuId& id) { return id.vendor == "AuthenticAMD" && id.family == 25; }

#if ATTNKIT_HAVE_AVX512BF16
bool avx512bf16_runnable() {
  return cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl") && cpu_has("avx512dq") &&
         cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c") && cpu_has("bmi2") && cpu_has("avx512bf16") &&
         cpu_has("avx512vnni") && cpu_has("avx512vbmi");
}

// avx512vnni's attention: bf16 calls that only decode run avx512bf16's loop, on vdpbf16ps.
// Decode reads each K and V element for one product (or a few), so converting them to fp32
// costs more than the bf16 rule's half-rate dot products save: on the Xeon with AMX forced
// to these variants, Dc bf16 took 2.71 / 1.58 ms (1 / 2 threads) on vdpbf16ps against 4.28 /
// 2.47 on FMAs, and paged decode P16 31.1 / 15.5 against 33.2 / 16.9. Calls with any row
// block of more rows (prefill, and mixed serving batches) stay on FMAs.
void avx512vnni_attention_fwd(const AttentionParams& p) {
  const bool bf16_decode = p.dtype == DType::bfloat16 && cpu::avx512bf16::kernel_table.attention_decodes(p);
  (bf16_decode ? cpu::avx512bf16::kernel_table : cpu::avx512::kernel_table).attention_fwd(p);
}

// avx512vnni: avx512's kernels (bf16 inputs converted to fp32 for FMAs) with avx512bf16's
// int8 Sage (Q·Kᵀ on vpdpbusd; its P·V stays on vdpbf16ps) and bf16 decode, for the CPUs of
// the bf16 rule. Entries added to KernelTable come from avx512 unless listed here.
const cpu::KernelTable avx512vnni_table = [] {
  cpu::KernelTable t = cpu::avx512::kernel_table;
  t.isa = "avx512vnni";
  t.attention_fwd = &avx512vnni_attention_fwd;
  t.sage_int8_fwd = cpu::avx512bf16::kernel_table.sage_int8_fwd;
  return t;
}();
#endif

#if ATTNKIT_HAVE_AVX512AMX
// AMX tiles need the kernel's leave to use their 8 KB of state (Linux 5.16+: arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process); without it the first tile
// instruction faults.
bool os_allows_amx() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  static const bool allowed = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return allowed;
#else
  return false;
#endif
}

bool avx512amx_runnable() {
  return avx512bf16_runnable() && cpu_has("amx-tile") && cpu_has("amx-bf16") && cpu_has("amx-int8") &&
         os_allows_amx();
}

// avx512amx: the bf16 tile loop (dense, varlen and paged prefill) and decode over grouped kv
// heads (paged, packed), sage's Q·Kᵀ (int8) and P·V, the backward's bf16 products, the sparse MLA tile loop (prefill
// and MLA decode) and the DSA indexer's scores on AMX tiles; every other entry as the best
// variant without AMX (avx512vnni's on the CPUs of the bf16 rule, which all AMX CPUs so far are, else
// avx512bf16's).
const cpu::KernelTable avx512amx_table = [] {
  cpu::KernelTable t = bf16_dot_slower_than_fma(cpu_id()) ? avx512vnni_table : cpu::avx512bf16::kernel_table;
  t.isa = "avx512amx";
  t.attention_fwd = cpu::avx512amx::kernel_table.attention_fwd;
  t.sage_int8_fwd = cpu::avx512amx::kernel_table.sage_int8_fwd;
  t.attention_bwd = cpu::avx512amx::kernel_table.attention_bwd;
  t.sparse_mla_fwd = cpu::avx512amx::kernel_table.sparse_mla_fwd;
  t.mla_decode_fwd = cpu::avx512amx::kernel_table.mla_decode_fwd;
  t.indexer_logits = cpu::avx512amx::kernel_table.indexer_logits;
  return t;
}();
#endif

// Best first for this CPU: avx512amx where it runs, then avx512vnni before avx512bf16
// where the bf16 rule holds.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = [] {
    std::vector<Variant> v;
#if ATTNKIT_HAVE_AVX512AMX
    v.push_back({&avx512amx_table, &cpu::avx512amx::probe_table, &avx512amx_runnable});
#endif
#if ATTNKIT_HAVE_AVX512BF16
    const Variant bf16{&cpu::avx512bf16::kernel_table, &cpu::avx512bf16::probe_table, &avx512bf16_runnable};
    const Variant vnni{&avx512vnni_table, &cpu::avx512bf16::probe_table, &avx512bf16_runnable};
    if (bf16_dot_slower_than_fma(cpu_id())) {
      v.insert(v.end(), {vnni, bf16});
    } else {
      v.insert(v.end(), {bf16, vnni});
    }
#endif
#if ATTNKIT_HAVE_AVX512
    v.push_back({&cpu::avx512::kernel_table, &cpu::avx512::probe_table, [] {
                   return cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl") &&
                          cpu_has("avx512dq") && cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c") &&
                          cpu_has("bmi2");
                 }});
#endif
#if ATTNKIT_HAVE_AVX2
    v.push_back({&cpu::avx2::kernel_table, &cpu::avx2::probe_table,
                 [] { return cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c") && cpu_has("bmi2"); }});
#endif
    v.push_back({&cpu::generic::kernel_table, &cpu::generic::probe_table, [] { return true; }});
    return v;
  }();
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
  if (f == "avx512vbmi") return __builtin_cpu_supports("avx512vbmi");
  if (f == "amx-tile") return __builtin_cpu_supports("amx-tile");
  if (f == "amx-bf16") return __builtin_cpu_supports("amx-bf16");
  if (f == "amx-int8") return __builtin_cpu_supports("amx-int8");
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

cpu::PeakLoop detail::peak_loop(cpu::PeakLoop cpu::ProbeTable::*instruction) {
  if (instruction == &cpu::ProbeTable::fp32_fma) return probes().fp32_fma;  // the active width
  if (instruction == &cpu::ProbeTable::fp16_fma && !cpu_has("avx512fp16")) return {};
  for (const Variant& v : variants()) {
    if (v.runnable() && (v.probes->*instruction).loop) return v.probes->*instruction;
  }
  return {};
}

bool detail::l2_read_ahead() {
  static const bool by_machine = zen4_read_ahead(cpu_id());
  const char* env = std::getenv("ATTNKIT_READ_AHEAD");
  if (env == nullptr || *env == '\0') return by_machine;
  if (std::strcmp(env, "l2") == 0) return true;
  if (std::strcmp(env, "next") == 0) return false;
  static std::atomic<bool> warned{false};  // as ATTNKIT_ISA: reported once, the rule used
  if (!warned.exchange(true)) {
    std::fprintf(stderr, "attnkit: warning: ATTNKIT_READ_AHEAD=\"%s\" is not l2 or next; using %s (this machine's rule)\n",
                 env, by_machine ? "l2" : "next");
  }
  return by_machine;
}

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

// The default variant and why (isa_rule without the read-ahead rule).
static std::string isa_choice(const CpuId& id) {
  for (const Variant& v : variants()) {
    if (!v.runnable()) continue;
    const std::string name = v.table->isa;
    if (name == "avx512amx") {
      return name + ": " + describe(id) +
             " has AMX tiles, so bf16 prefill and backward, decode over grouped kv heads (paged caches), "
             "sparse MLA and the DSA indexer run their "
             "products on tdpbf16ps and int8 Sage its Q·Kᵀ on tdpbusd" +
             (bf16_dot_slower_than_fma(id)
                  ? "; its other bf16 decodes on vdpbf16ps, other bf16 ops as avx512vnni (Intel family 6)"
                  : "");
    }
    if (name == "avx512vnni") {
      return name + ": " + describe(id) +
             " runs vdpbf16ps at about half the fp32 FMA rate (Intel family 6), so bf16 inputs are "
             "converted to fp32 for FMAs, but for decode (vdpbf16ps); int8 Sage keeps vpdpbusd";
    }
    if (name == "avx512bf16") {
      return name + ": " + describe(id) +
             " has AVX512_BF16 and is not Intel family 6, so bf16 inputs run on vdpbf16ps";
    }
    return name + ": the widest variant " + describe(id) + " runs";
  }
  return "generic";
}

std::string isa_rule() {
  const CpuId id = cpu_id();
  const std::string rule = isa_choice(id);
  return zen4_read_ahead(id) ? rule + "; decode over grouped kv heads reads ahead into L2 (AMD family 25)" : rule;
}

std::string cpu_features() {
  std::string out;
  for (const char* f : {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
                        "avx512dq", "avx512bf16", "avx512fp16", "avx512vnni", "avx512vbmi", "amx-tile",
                        "amx-bf16", "amx-int8"}) {
    if (cpu_has(f)) out += (out.empty() ? "" : " ") + std::string(f);
  }
  return out;
}

}  // namespace attnkit
