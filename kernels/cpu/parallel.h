// Work sharing for the kernels: OpenMP with dynamic scheduling over chunks.
//
// at::parallel_for splits a range into one static block per thread. On this
// project's 2-core machines the whole mesh (scheduler, detokenizer, gateway)
// shares the cores with the worker, so any one of its threads can be
// preempted mid-kernel; with static blocks the other thread then idles at the
// barrier. Here threads take chunks from a shared counter: a preempted thread
// takes fewer, the running one takes the rest.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace radixmesh {

// fn(begin, end) over [0, n) in chunks of `chunk` items, called from the threads that pick them.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t c = 0; c < chunks; ++c) fn(c * chunk, std::min(n, (c + 1) * chunk));
}

// A chunk size giving each thread about `per_thread` chunks of at least `min_chunk` items,
// rounded up to a multiple of `multiple`.
inline int64_t chunk_for(int64_t n, int64_t per_thread, int64_t min_chunk, int64_t multiple) {
  const int64_t want = n / std::max<int64_t>(1, at::get_num_threads() * per_thread);
  const int64_t c = std::max(min_chunk, want);
  return (c + multiple - 1) / multiple * multiple;
}

}  // namespace radixmesh
