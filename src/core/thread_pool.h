// A persistent pool of worker threads with dynamic scheduling: parallel_for hands out task
// indices from an atomic counter, so uneven tasks (causal rows) balance by themselves.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace attnkit::detail {

// A non-owning reference to a callable void(int64_t task, int thread). Cheap to pass
// across the ISA boundary (no std::function, no allocation).
class TaskFn {
 public:
  template <class F>
  TaskFn(F& f)  // NOLINT: implicit on purpose
      : obj_(&f), call_([](void* o, int64_t task, int thread) { (*static_cast<F*>(o))(task, thread); }) {}
  void operator()(int64_t task, int thread) const { call_(obj_, task, thread); }

 private:
  void* obj_;
  void (*call_)(void*, int64_t, int);
};

// Runs fn(task, thread) for task in [0, n) on at most max_threads threads of the pool (the
// caller is thread 0), so thread < max_threads always holds: callers size per-thread
// workspaces by it. Calls from several host threads at once are serialised; a call made
// from inside a task (or from an interrupt poll) runs serially on the calling thread.
// With an interrupt poll installed on the calling thread (runtime.h) the caller polls it
// while it waits for another host thread's job and between its tasks; when it asks to stop,
// no further task starts and Interrupted is thrown once the running ones have finished.
void parallel_for(int64_t n, int max_threads, TaskFn fn);
// The thread count the next parallel_for uses; never blocks, does not start the pool.
int num_threads();
// Takes effect at the next parallel_for (the pool is rebuilt there); never blocks.
void set_num_threads(int n);

}  // namespace attnkit::detail
