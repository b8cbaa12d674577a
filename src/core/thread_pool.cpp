// The thread pool behind parallel_for (see thread_pool.h). Workers sleep on a condition
// variable between jobs, after a short spin; each job is one parallel_for call. The pool is
// created at the first job, rebuilt when the thread count changes, and abandoned in a fork()
// child (whose only thread is the forking one), which then builds its own at its first job.
#include "core/thread_pool.h"

#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "attnkit/error.h"
#include "attnkit/runtime.h"

namespace attnkit::detail {
namespace {

constexpr int kMaxThreads = 1024;

// ATTNKIT_NUM_THREADS if it is an integer in [1, kMaxThreads], else all cores; a bad value
// is reported once (this runs once) rather than silently ignored.
int threads_from_environment() {
  const unsigned hw = std::thread::hardware_concurrency();
  const int all_cores = hw ? static_cast<int>(hw < kMaxThreads ? hw : kMaxThreads) : 1;
  const char* env = std::getenv("ATTNKIT_NUM_THREADS");
  if (!env || !*env) return all_cores;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(env, &end, 10);
  if (end != env && *end == '\0' && errno == 0 && n >= 1 && n <= kMaxThreads) return static_cast<int>(n);
  std::fprintf(stderr,
               "attnkit: warning: ATTNKIT_NUM_THREADS=\"%s\" is not an integer in [1, %d]; using %d (all cores)\n",
               env, kMaxThreads, all_cores);
  return all_cores;
}

// The interrupt poll installed on this thread (runtime.h), and whether this thread is
// running a job (a nested parallel_for then runs serially instead of waiting for itself).
struct InterruptPoll {
  bool (*fn)(void*) = nullptr;
  void* context = nullptr;
};
thread_local InterruptPoll t_poll;
thread_local bool t_in_job = false;

// Calls the poll at most every kPollInterval; true once it asked to stop.
class PollTimer {
 public:
  // The Python poll takes the GIL, waiting up to its switch interval (5 ms) when another
  // thread runs Python: every 10 ms that made such calls ~45% slower; every 50 ms, <= 10%.
  static constexpr auto kPollInterval = std::chrono::milliseconds(50);
  explicit PollTimer(InterruptPoll poll) : poll_(poll) {
    if (poll_.fn) next_ = std::chrono::steady_clock::now() + kPollInterval;
  }
  bool stop_requested() {
    if (!poll_.fn) return false;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_) return false;
    next_ = now + kPollInterval;
    return poll_.fn(poll_.context);
  }

 private:
  InterruptPoll poll_;
  std::chrono::steady_clock::time_point next_;
};

// How long a thread spins before it sleeps: the caller waiting for the workers' last tasks,
// a worker for the next job. Waking a sleeping thread cost ~70 us per parallel_for at 2
// threads on the Xeon VM (a decode over 16 keys took 82 us against 12 with both spins), as
// much as a short decode's whole work. The worker's spin catches an op's next parallel_for
// (decode's merge) and back-to-back calls; it is kept short because it holds a core that
// another library's threads may want right after the call (torch ops between attention
// calls measured the same with it, ~3% slower with 50 us).
constexpr auto kCallerSpin = std::chrono::microseconds(50);
constexpr auto kWorkerSpin = std::chrono::microseconds(20);

// Returns once ready() holds or after `spin`; the condition-variable wait that follows
// checks again under the mutex.
template <class Ready>
void spin_until(Ready ready, std::chrono::microseconds spin) {
  const auto end = std::chrono::steady_clock::now() + spin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return;
#if defined(__x86_64__) || defined(__i386__)
      _mm_pause();
#endif
    }
    if (std::chrono::steady_clock::now() >= end) return;
  }
}

class Pool {
 public:
  // Throws Error when the system refuses a thread (a process or container limit), after
  // stopping those that started: unwinding past waiting workers destroyed the condition
  // variable under them and hung the call and every later one. Any other failure while
  // starting them (bad_alloc) stops them too before it propagates.
  explicit Pool(int threads) : threads_(threads) {
    try {
      workers_.reserve(threads_ - 1);
      for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { worker(t); });
    } catch (const std::system_error& e) {
      stop_workers();
      throw Error("could not start " + std::to_string(threads_) + " threads (the system refused thread " +
                  std::to_string(workers_.size() + 1) + ": " + e.what() + "); set fewer with set_num_threads");
    } catch (...) {
      stop_workers();
      throw;
    }
  }
  ~Pool() { stop_workers(); }
  int threads() const { return threads_; }

  void run(int64_t n, int max_threads, TaskFn fn, PollTimer& poll) {
    if (threads_ == 1 || max_threads <= 1 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) {
        if (poll.stop_requested()) throw Interrupted();
        fn(i, 0);
      }
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
    const bool interrupted = work(0, &poll);
    spin_until([this] { return active_.load(std::memory_order_acquire) == 0; }, kCallerSpin);
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    if (interrupted) throw Interrupted();
  }

 private:
  // Runs tasks until none is left; the caller (thread 0) polls between them. True if the
  // poll stopped the job.
  bool work(int thread, PollTimer* poll) {
    if (thread >= max_threads_) return false;
    try {
      for (int64_t i; (i = next_.fetch_add(1)) < n_tasks_;) {
        (*job_)(i, thread);
        if (poll && poll->stop_requested()) {
          next_.store(n_tasks_);  // hand out no more tasks
          return true;
        }
      }
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_tasks_);
    }
    return false;
  }
  void stop_workers() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  void worker(int thread) {
    t_in_job = true;  // for good: a parallel_for inside a task runs serially
    uint64_t seen = 0;
    for (;;) {
      spin_until([&] {
        return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
      }, kWorkerSpin);
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work(thread, nullptr);
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
  // Changed under mutex_ only; atomic so that the spins may read them without it.
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> generation_{0};
  TaskFn* job_ = nullptr;
  int64_t n_tasks_ = 0;
  int max_threads_ = 1;
  std::atomic<int64_t> next_{0};
  std::atomic<int> active_{0};  // changed under mutex_ only, read by the caller's spin
  std::exception_ptr error_;
};

// One job at a time: a job holds the slot (g_busy, under g_slot_mutex). Waiting for it is
// a condition-variable wait, with a timeout when an interrupt poll is installed so that the
// wait is interruptible too. Namespace-scope, constant- or load-time-initialised, so no
// static-initialisation guard exists that a fork() could catch half-taken.
constinit std::mutex g_slot_mutex;
std::condition_variable g_slot_free;
constinit bool g_busy = false;                // guarded by g_slot_mutex
constinit std::unique_ptr<Pool> g_pool;       // owned by the slot's holder
constinit std::atomic<int> g_threads{0};      // the requested count; 0 = not yet read from the environment
constinit bool g_atfork_registered = false;  // owned by the slot's holder

class JobSlot {
 public:
  JobSlot() {
    std::unique_lock lock(g_slot_mutex);
    const auto free = [] { return !g_busy; };
    if (!t_poll.fn) {
      g_slot_free.wait(lock, free);
    } else {
      while (!g_slot_free.wait_for(lock, PollTimer::kPollInterval, free)) {
        lock.unlock();  // the poll may take a while (the Python one takes the GIL)
        if (t_poll.fn(t_poll.context)) throw Interrupted();
        lock.lock();
      }
    }
    g_busy = true;
  }
  ~JobSlot() {
    {
      std::lock_guard lock(g_slot_mutex);
      g_busy = false;
    }
    g_slot_free.notify_one();
  }
  JobSlot(const JobSlot&) = delete;
  JobSlot& operator=(const JobSlot&) = delete;
};

// In a fork() child only the forking thread exists: the workers are gone and the slot may
// be held (and its mutex locked) by a thread that no longer exists. Abandon the pool
// (destroying it would join threads that are not there) and start from a fresh slot; the
// next job builds a new pool.
void abandon_pool_in_child() {
  (void)g_pool.release();
  new (&g_slot_mutex) std::mutex();
  new (&g_slot_free) std::condition_variable();
  g_busy = false;
}

int requested_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  if (n == 0) {
    static const int from_environment = threads_from_environment();
    g_threads.compare_exchange_strong(n, from_environment, std::memory_order_relaxed);
    n = g_threads.load(std::memory_order_relaxed);
  }
  return n;
}

}  // namespace

void parallel_for(int64_t n, int max_threads, TaskFn fn) {
  if (t_in_job) {  // called from a task or from a poll of this thread's job: the pool is busy
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  PollTimer poll(t_poll);
  const JobSlot slot;
  const int threads = requested_threads();
  if (!g_pool || g_pool->threads() != threads) {
    g_pool.reset();
    g_pool = std::make_unique<Pool>(threads);
    if (!g_atfork_registered) {
      pthread_atfork(nullptr, nullptr, abandon_pool_in_child);
      g_atfork_registered = true;
    }
  }
  t_in_job = true;
  struct Reset {
    ~Reset() { t_in_job = false; }
  } reset;
  g_pool->run(n, max_threads, fn, poll);
}

int num_threads() { return requested_threads(); }

void set_num_threads(int n) {
  if (n < 1 || n > kMaxThreads) {
    throw Error("num_threads must be in [1, " + std::to_string(kMaxThreads) + "], got " + std::to_string(n));
  }
  requested_threads();  // a bad ATTNKIT_NUM_THREADS is still reported, once
  g_threads.store(n, std::memory_order_relaxed);
}

}  // namespace attnkit::detail

namespace attnkit {

ScopedInterruptPoll::ScopedInterruptPoll(bool (*poll)(void*), void* context)
    : previous_poll_(detail::t_poll.fn), previous_context_(detail::t_poll.context) {
  detail::t_poll = {poll, context};
}

ScopedInterruptPoll::~ScopedInterruptPoll() { detail::t_poll = {previous_poll_, previous_context_}; }

}  // namespace attnkit
