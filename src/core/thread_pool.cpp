// The thread pool behind parallel_for (see thread_pool.h). Workers sleep on a condition
// variable between jobs; each job is one parallel_for call.
#include "core/thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "attnkit/error.h"

namespace attnkit::detail {
namespace {

int default_threads() {
  if (const char* env = std::getenv("ATTNKIT_NUM_THREADS")) {
    char* end = nullptr;
    long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= 1024) return static_cast<int>(n);
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { worker(t); });
  }
  ~Pool() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int threads() const { return threads_; }

  void run(int64_t n, int max_threads, TaskFn fn) {
    if (threads_ == 1 || max_threads <= 1 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) fn(i, 0);
      return;
    }
    {
      std::lock_guard lock(mutex_);
      job_ = &fn;
      n_tasks_ = n;
      max_threads_ = max_threads;
      next_.store(0);
      active_ = threads_ - 1;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    work(0);
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work(int thread) {
    if (thread >= max_threads_) return;
    try {
      for (int64_t i; (i = next_.fetch_add(1)) < n_tasks_;) (*job_)(i, thread);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_tasks_);
    }
  }
  void worker(int thread) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work(thread);
      {
        std::lock_guard lock(mutex_);
        if (--active_ == 0) done_.notify_one();
      }
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  bool stop_ = false;
  uint64_t generation_ = 0;
  TaskFn* job_ = nullptr;
  int64_t n_tasks_ = 0;
  int max_threads_ = 1;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
  std::exception_ptr error_;
};

// One job at a time; set_num_threads swaps the pool under the same lock.
std::mutex& pool_mutex() {
  static std::mutex m;
  return m;
}
std::unique_ptr<Pool>& pool() {
  static std::unique_ptr<Pool> p = std::make_unique<Pool>(default_threads());
  return p;
}

}  // namespace

void parallel_for(int64_t n, int max_threads, TaskFn fn) {
  std::lock_guard lock(pool_mutex());
  pool()->run(n, max_threads, fn);
}

int num_threads() {
  std::lock_guard lock(pool_mutex());
  return pool()->threads();
}

void set_num_threads(int n) {
  if (n < 1 || n > 1024) {
    throw Error("num_threads must be in [1, 1024], got " + std::to_string(n));
  }
  std::lock_guard lock(pool_mutex());
  if (pool()->threads() != n) pool() = std::make_unique<Pool>(n);
}

}  // namespace attnkit::detail
