#include "core/scratch.h"

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace attnkit::detail {
namespace {

constexpr int64_t kHugePage = int64_t{1} << 21;

struct Kept {
  std::mutex mutex;
  std::vector<std::pair<void*, int64_t>> blocks;  // (data, bytes), at most kKeptBlocks
  ~Kept() {
    for (auto& [data, bytes] : blocks) std::free(data);
  }
};

// Namespace-scope and constant-initialised: no static-initialisation guard a fork() could
// catch half-taken.
constinit Kept g_kept;

Kept& kept() { return g_kept; }

// In a fork() child the mutex may be held by a thread that no longer exists (a child hung in
// the backward's scratch), and the list may be half-changed: start both afresh, leaving
// the parent's kept blocks to the child's exit.
void forget_kept_in_child() {
  new (&g_kept.mutex) std::mutex();
  new (&g_kept.blocks) std::vector<std::pair<void*, int64_t>>();
}

// Registered when the library loads, before any thread of it exists.
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, forget_kept_in_child);

}  // namespace

LargeScratch::LargeScratch(int64_t bytes) {
  if (bytes <= 0) return;
  bytes_ = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  {
    Kept& k = kept();
    std::lock_guard<std::mutex> lock(k.mutex);
    // The smallest kept block that fits.
    auto best = k.blocks.end();
    for (auto it = k.blocks.begin(); it != k.blocks.end(); ++it) {
      if (it->second >= bytes_ && (best == k.blocks.end() || it->second < best->second)) best = it;
    }
    if (best != k.blocks.end()) {
      data_ = best->first, bytes_ = best->second;
      k.blocks.erase(best);
      return;
    }
  }
  data_ = std::aligned_alloc(kHugePage, bytes_);
  if (!data_) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
  madvise(data_, bytes_, MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
#endif
}

LargeScratch::~LargeScratch() {
  if (!data_) return;
  if (bytes_ > kMaxKeptBytes) {
    std::free(data_);
    return;
  }
  Kept& k = kept();
  std::lock_guard<std::mutex> lock(k.mutex);
  k.blocks.emplace_back(data_, bytes_);
  // Over a limit: drop the smallest blocks first (the larger ones serve more calls).
  auto total = [&] {
    int64_t sum = 0;
    for (const auto& block : k.blocks) sum += block.second;
    return sum;
  };
  while (static_cast<int>(k.blocks.size()) > kKeptBlocks || total() > kMaxKeptBytes) {
    auto drop = std::min_element(k.blocks.begin(), k.blocks.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
    std::free(drop->first);
    k.blocks.erase(drop);
  }
}

}  // namespace attnkit::detail
