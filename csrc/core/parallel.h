// parallel.h — a static-partition parallel for over [0, n) for the CPU backend. Each index is handled
// by exactly one thread and no reduction crosses threads, so results do not depend on thread count.
#pragma once
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace moe8 {

template <typename F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  int64_t nthreads = std::min<int64_t>(hw, (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (nthreads <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::vector<std::thread> pool;
  int64_t chunk = (n + nthreads - 1) / nthreads;
  for (int64_t t = 0; t < nthreads; ++t) {
    int64_t lo = t * chunk, hi = std::min(n, lo + chunk);
    if (lo >= hi) break;
    pool.emplace_back([lo, hi, &f] {
      for (int64_t i = lo; i < hi; ++i) f(i);
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace moe8
