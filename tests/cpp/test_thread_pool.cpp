// The thread pool and the Philox generator: every task runs once, thread ids stay below
// the cap, errors propagate, an interrupt poll stops a job, a fork() child gets a working
// pool; Philox4x32-10 matches the published known-answer vectors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <thread>
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

// Sums task indices on the pool: true if every task ran exactly once.
bool sum_is_right(int64_t n) {
  std::atomic<int64_t> sum{0};
  auto body = [&](int64_t task, int) { sum.fetch_add(task); };
  parallel_for(n, num_threads(), body);
  return sum.load() == n * (n - 1) / 2;
}

// Forks, runs child() there under a 20 s alarm (a hang is the failure) and returns its exit status.
template <class F>
int in_child(F child) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(20);
    _exit(child() ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(ThreadPool, ForkedChildGetsItsOwnPool) {
  const int saved = get_num_threads();
  set_num_threads(3);
  ASSERT_TRUE(sum_is_right(1000));  // the parent's workers exist now
  EXPECT_EQ(in_child([] { return sum_is_right(1000); }), 0);
  EXPECT_EQ(in_child([] {
              set_num_threads(2);  // must not wait for the parent's workers
              return get_num_threads() == 2 && sum_is_right(1000) && in_child([] { return sum_is_right(77); }) == 0;
            }),
            0);
  EXPECT_TRUE(sum_is_right(1000));  // the parent's pool is untouched
  set_num_threads(saved);
}

// Fork while another thread is inside a job (holding the pool): the child must not wait for it.
TEST(ThreadPool, ForkDuringAJobOfAnotherThread) {
  const int saved = get_num_threads();
  set_num_threads(2);
  std::atomic<bool> started{false}, release{false};
  std::thread busy([&] {
    auto body = [&](int64_t, int) {
      started.store(true);
      while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
    parallel_for(2, 2, body);
  });
  while (!started.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(in_child([] { return sum_is_right(500); }), 0);
  release.store(true);
  busy.join();
  set_num_threads(saved);
}

bool stop_after_three_polls(void* context) { return ++*static_cast<int*>(context) >= 3; }

TEST(ThreadPool, InterruptPollStopsTheJob) {
  const int saved = get_num_threads();
  for (int threads : {1, 3}) {
    set_num_threads(threads);
    int polls = 0;
    std::atomic<int64_t> ran{0};
    auto slow = [&](int64_t, int) {
      ran.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    };
    {
      ScopedInterruptPoll poll(stop_after_three_polls, &polls);
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_THROW(parallel_for(100000, threads, slow), Interrupted);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_EQ(polls, 3);
      EXPECT_LT(seconds, 1.0);  // three polls ~50 ms apart, not 100000 tasks of 2 ms
      EXPECT_LT(ran.load(), 100000);
    }
    ran.store(0);
    parallel_for(50, threads, slow);  // the poll is gone and the pool works
    EXPECT_EQ(ran.load(), 50);
    EXPECT_EQ(polls, 3);
  }
  set_num_threads(saved);
}

bool always_stop(void*) { return true; }

// A call waiting for another thread's job stops too (the job ends by itself after 3 s, so
// that a wait that cannot be interrupted fails the test instead of hanging it).
TEST(ThreadPool, InterruptPollStopsTheWaitForAnotherJob) {
  std::atomic<bool> started{false}, release{false}, finished{false};
  std::thread busy([&] {
    auto body = [&](int64_t, int) {
      started.store(true);
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(3);
      while (!release.load() && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    };
    parallel_for(1, 1, body);
    finished.store(true);
  });
  while (!started.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  bool ran = false;
  auto body = [&](int64_t, int) { ran = true; };
  {
    ScopedInterruptPoll poll(always_stop, nullptr);
    EXPECT_THROW(parallel_for(1, 1, body), Interrupted);
  }
  EXPECT_FALSE(finished.load());  // the wait was interrupted, not ended by the other job
  release.store(true);
  busy.join();
  EXPECT_FALSE(ran);
}

TEST(ThreadPool, NestedCallsRunSerially) {
  std::atomic<int64_t> inner{0};
  auto outer = [&](int64_t, int) {
    auto body = [&](int64_t, int thread) {
      EXPECT_EQ(thread, 0);
      inner.fetch_add(1);
    };
    parallel_for(10, num_threads(), body);
  };
  parallel_for(20, num_threads(), outer);
  EXPECT_EQ(inner.load(), 200);
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
