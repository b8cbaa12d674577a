// detail::LargeScratch: a released block serves the next request that fits (the smallest
// such), a larger request gets a fresh block, every byte is writable, and concurrent users
// get distinct blocks; a fork() child never waits on a lock another thread held at the fork.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "core/scratch.h"

namespace attnkit::detail {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(LargeScratch, ReleasedBlockServesTheNextRequestThatFits) {
  void* first = nullptr;
  {
    LargeScratch s(37 * kMiB);
    first = s.data();
    std::memset(first, 1, 37 * kMiB);
  }
  {
    LargeScratch smaller(35 * kMiB);  // rounds to whole 2 MiB pages: 36 MiB fits in 38
    EXPECT_EQ(smaller.data(), first);
    LargeScratch larger(41 * kMiB);  // the kept block is in use: a new one
    EXPECT_NE(larger.data(), first);
    std::memset(larger.data(), 2, 41 * kMiB);
  }
}

TEST(LargeScratch, TheSmallestKeptBlockThatFitsIsChosen) {
  void *big = nullptr, *small = nullptr;
  {
    LargeScratch a(61 * kMiB), b(51 * kMiB);
    big = a.data(), small = b.data();
  }
  LargeScratch c(49 * kMiB);
  EXPECT_EQ(c.data(), small);
  LargeScratch d(49 * kMiB);
  EXPECT_EQ(d.data(), big);
}

TEST(LargeScratch, EmptyRequestHasNoBlock) {
  LargeScratch s(0);
  EXPECT_EQ(s.data(), nullptr);
}

TEST(LargeScratch, ConcurrentUsersGetDistinctBlocks) {
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 20; ++i) {
        LargeScratch s((3 + t) * kMiB);
        std::memset(s.data(), t, (3 + t) * kMiB);
        const auto* bytes = static_cast<const unsigned char*>(s.data());
        EXPECT_EQ(bytes[(3 + t) * kMiB - 1], t);  // nobody else wrote it meanwhile
      }
    });
  }
  for (auto& th : threads) th.join();
}


// Another thread takes and returns a kept block in a loop, so the list's lock is held at
// most forks; each child then takes a block itself. Without the fork handler that starts the
// list afresh in the child, a child caught the lock held and hung (1 fork in ~2000 from
// Python; here most of them).
TEST(LargeScratch, ForkChildrenNeverWaitOnTheParentsLock) {
  { LargeScratch warm(4 * kMiB); }
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load(std::memory_order_relaxed)) LargeScratch s(4 * kMiB);
  });
  int hung = 0;
  for (int i = 0; i < 200 && hung == 0; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      { LargeScratch s(4 * kMiB); }
      _exit(0);
    }
    ASSERT_GT(pid, 0);
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ++hung;
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  stop = true;
  churn.join();
  EXPECT_EQ(hung, 0) << "a fork child hung taking a scratch block";
}

}  // namespace
}  // namespace attnkit::detail
