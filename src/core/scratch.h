// Large per-call scratch (hundreds of MiB for a long backward) on transparent huge pages,
// reused across calls. Fresh anonymous memory is zeroed by the kernel page by page on first
// touch; for the dense backward at shape A (80 MiB of scratch) that clearing took ~5% of the
// call. Released blocks are kept (at most kKeptBlocks, kMaxKeptBytes in all, the smallest
// dropped first) and handed to the next request that fits; their contents are stale, never
// zeros: callers write before they read, as with any allocation.
#pragma once

#include <cstdint>

namespace attnkit::detail {

class LargeScratch {
 public:
  static constexpr int kKeptBlocks = 4;
  static constexpr int64_t kMaxKeptBytes = int64_t{1} << 30;

  explicit LargeScratch(int64_t bytes);  // bytes <= 0: no block
  ~LargeScratch();
  LargeScratch(const LargeScratch&) = delete;
  LargeScratch& operator=(const LargeScratch&) = delete;

  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;  // rounded up to whole huge pages
};

}  // namespace attnkit::detail
