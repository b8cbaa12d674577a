// Runtime settings exposed in attnkit/runtime.h: threads, version, build facts.
#include <string>

#include "attnkit/runtime.h"
#include "core/thread_pool.h"

namespace attnkit {

void set_num_threads(int n) { detail::set_num_threads(n); }
int get_num_threads() { return detail::num_threads(); }

std::string version() { return ATTNKIT_VERSION; }

std::string build_info() {
  std::string isas;
#if ATTNKIT_HAVE_AVX512AMX
  isas += "avx512amx ";
#endif
#if ATTNKIT_HAVE_AVX512BF16
  isas += "avx512bf16 avx512vnni ";
#endif
#if ATTNKIT_HAVE_AVX512
  isas += "avx512 ";
#endif
#if ATTNKIT_HAVE_AVX2
  isas += "avx2 ";
#endif
  isas += "generic";
  return std::string("compiler: ") + ATTNKIT_COMPILER + "; isas compiled: " + isas;
}

}  // namespace attnkit
