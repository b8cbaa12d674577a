// The thread pool and the Philox generator: every task runs once, thread ids stay below
// the cap, errors propagate; Philox4x32-10 matches the published known-answer vectors.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <vector>

#include "attnkit/error.h"
#include "attnkit/runtime.h"
#include "core/philox.h"
#include "core/thread_pool.h"

namespace attnkit::detail {
namespace {

TEST(ThreadPool, EveryTaskRunsExactlyOnceBelowTheThreadCap) {
  const int saved = get_num_threads();
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    for (int cap : {1, threads}) {
      std::vector<std::atomic<int>> hits(1000);
      std::atomic<int> bad_thread{0};
      auto body = [&](int64_t task, int thread) {
        hits[task].fetch_add(1);
        if (thread < 0 || thread >= cap) bad_thread.fetch_add(1);
      };
      parallel_for(static_cast<int64_t>(hits.size()), cap, body);
      for (auto& h : hits) ASSERT_EQ(h.load(), 1);
      EXPECT_EQ(bad_thread.load(), 0);
    }
  }
  set_num_threads(saved);
}

TEST(ThreadPool, ExceptionsReachTheCaller) {
  auto body = [](int64_t task, int) {
    if (task == 17) throw std::runtime_error("task 17");
  };
  EXPECT_THROW(parallel_for(100, num_threads(), body), std::runtime_error);
  std::atomic<int> runs{0};
  auto ok = [&](int64_t, int) { runs.fetch_add(1); };
  parallel_for(10, num_threads(), ok);  // the pool still works afterwards
  EXPECT_EQ(runs.load(), 10);
}

TEST(ThreadPool, RejectsBadThreadCounts) {
  EXPECT_THROW(set_num_threads(0), attnkit::Error);
  EXPECT_THROW(set_num_threads(-3), attnkit::Error);
}

// Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
TEST(Philox, KnownAnswers) {
  EXPECT_EQ(philox4x32({0, 0, 0, 0}, 0),
            (std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, ~uint64_t{0}),
            (std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                       (uint64_t{0x299f31d0u} << 32) | 0xa4093822u),
            (std::array<uint32_t, 4>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Philox, DropoutThreshold) {
  EXPECT_EQ(dropout_threshold(0.0f), 0u);
  EXPECT_EQ(dropout_threshold(0.5f), 0x80000000u);
  EXPECT_GT(dropout_threshold(0.9999999f), 0xFFFF0000u);
}

}  // namespace
}  // namespace attnkit::detail
