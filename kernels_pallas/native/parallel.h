// Work split over XLA's own intra-op threads, shared by the native CPU kernels.
//
// The kernels run inside XLA:CPU's step, whose thread pool is already sized to the machine.
// An OpenMP team next to it oversubscribes the cores (its threads spin after each region
// while XLA's threads want the same cores, and each calling thread gets its own team): on
// 2 cores a matmul ran 2-40x slower that way. So items go to XLA's pool (`ffi::ThreadPool`,
// the FFI's handle on it): helpers and the calling thread take items from one counter, and
// the caller returns once every item is done. A helper that starts after the last item was
// taken returns at once; the counter lives in a shared_ptr so a late helper never touches
// the caller's stack. Without a pool (or with one thread) the caller runs every item.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JAXSERVE_PAUSE() _mm_pause()
#else
#define JAXSERVE_PAUSE() std::this_thread::yield()
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_native {

struct WorkCounter {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Returns once `done` reaches `target` (other threads' work): spins, then yields (a preempted
// thread may hold the rest).
inline void wait_until(const std::atomic<int64_t>& done, int64_t target) {
  for (int spins = 0; done.load(std::memory_order_acquire) < target; ++spins) {
    if (spins < 4096) JAXSERVE_PAUSE();
    else std::this_thread::yield();
  }
}

// Calls run(item) for item in [0, items), on up to `workers` threads (XLA's pool + the caller).
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t items, int64_t workers, F&& run) {
  workers = std::min<int64_t>(std::min<int64_t>(workers, pool.num_threads() + 1), items);
  if (workers <= 1) {
    for (int64_t i = 0; i < items; ++i) run(i);
    return;
  }
  auto counter = std::make_shared<WorkCounter>();
  auto work = [counter, items, &run] {
    for (int64_t i; (i = counter->next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      run(i);
      counter->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t w = 1; w < workers; ++w)
    pool.Schedule([counter, items, work] {
      if (counter->next.load(std::memory_order_relaxed) < items) work();
    });
  work();
  wait_until(counter->done, items);
}

}  // namespace jaxserve_native
