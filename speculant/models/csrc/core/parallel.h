// How a kernel splits its work over threads, given by whoever calls it: the PyTorch binding passes
// at::parallel_for (PyTorch's own thread pool and thread count), the test harness a plain loop.
#pragma once

#include <cstdint>
#include <functional>

namespace spk {

// run body(begin, end) over [0, n) in chunks of at least `grain`
using ParallelFor = std::function<void(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body)>;

inline void serial_for(int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& body) {
  if (n > 0) body(0, n);
}

}  // namespace spk
