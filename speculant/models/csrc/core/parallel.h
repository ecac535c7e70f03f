// How a kernel splits its work over threads, given by whoever calls it: the PyTorch binding passes
// at::parallel_for (PyTorch's own thread pool and thread count), the test harness a plain loop.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace spk {

// run body(begin, end) over [0, n) in chunks of at least `grain`
using ParallelFor = std::function<void(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body)>;

inline void serial_for(int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& body) {
  if (n > 0) body(0, n);
}

// Row-wise work (norms, rotary, SiLU, quantizing activations) split over the threads by rows where
// a chunk holds at least ROW_WORK values: verify blocks, trees and prompts; a one-token step's row
// stays on the calling thread (a loop would cost more than it saves). Any split gives the same bits.
constexpr int64_t ROW_WORK = 4096;
inline void for_rows(int64_t M, int64_t width, const ParallelFor& parallel,
                     const std::function<void(int64_t, int64_t)>& body) {
  parallel(M, std::max<int64_t>(1, ROW_WORK / std::max<int64_t>(width, 1)), body);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A pass's ~150 parallel loops inside ONE parallel region. A pool's fork and join cost ~2 µs a loop
// (a one-token step of the default target: ~0.3 of its ~3 ms, the other thread idle); here the
// thread that runs the pass (the leader) hands each loop's chunks to the team's other threads,
// which spin between loops, and every loop's chunks are the ones ``at::parallel_for`` would cut
// (which thread takes which changes no bits: a chunk's values depend on it alone). The team is
// whoever joins: a member that starts late (or never) only leaves the leader more chunks, so the
// pass never waits on a thread the pool did not give it.
class SpinTeam {
 public:
  explicit SpinTeam(int64_t threads) : threads_(std::max<int64_t>(1, threads)) {}

  // the leader: body over [0, n) in min(threads, n / grain) chunks, as at::parallel_for cuts them
  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
    if (n <= 0) return;
    const int64_t chunks = std::min(threads_, (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
    if (chunks <= 1) return body(0, n);
    n_ = n, size_ = (n + chunks - 1) / chunks, body_ = &body;
    const int64_t total = (n + size_ - 1) / size_;  // chunks of size_ (the last shorter)
    done_.store(0, std::memory_order_relaxed);
    const uint64_t job = (claim_.load(std::memory_order_relaxed) >> 32) + 1;
    claim_.store(job << 32 | static_cast<uint64_t>(total) << 16, std::memory_order_release);
    take_chunks();
    for (uint64_t spins = 0; done_.load(std::memory_order_acquire) < total; ++spins) wait(spins);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  // a member: chunks of every loop the leader posts, until it finishes
  void join() {
    for (uint64_t spins = 0; !finished_.load(std::memory_order_acquire); ++spins) {
      if (take_chunks()) spins = 0;
      wait(spins);
    }
  }

  void finish() { finished_.store(true, std::memory_order_release); }

 private:
  // claim_: the loop's number (high 32 bits), its chunk count (16) and the next chunk to take (16)
  bool take_chunks() {
    bool took = false;
    for (uint64_t c = claim_.load(std::memory_order_acquire);;) {
      const uint64_t next = c & 0xFFFF, total = c >> 16 & 0xFFFF;
      if (next >= total) return took;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      // the loop is posted before its claim and changes only once every chunk is done: this one is not
      const int64_t begin = static_cast<int64_t>(next) * size_;
      try {
        (*body_)(begin, std::min(n_, begin + size_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
      took = true;
      c = claim_.load(std::memory_order_acquire);
    }
  }

  // spin (the next loop is microseconds away), yielding the core now and then where threads outnumber cores
  static void wait(uint64_t spins) {
    if (spins % 4096 == 4095)
      std::this_thread::yield();
    else
      cpu_relax();
  }

  const int64_t threads_;
  alignas(64) std::atomic<uint64_t> claim_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<bool> finished_{false};
  int64_t n_ = 0, size_ = 1;
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  std::exception_ptr error_;
  std::mutex error_mutex_;
};

// fn(parallel) in one region that `launch` starts over `threads` threads: the call holding index 0
// leads and runs fn, whose loops go to the team through `parallel`; the others join it.
template <typename F>
void in_one_region(const ParallelFor& launch, int64_t threads, F&& fn) {
  SpinTeam team(threads);
  const ParallelFor parallel = [&](int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
    team.run(n, grain, body);
  };
  std::exception_ptr error;
  launch(threads, 1, [&](int64_t begin, int64_t) {
    if (begin != 0) return team.join();
    try {
      fn(parallel);
    } catch (...) {
      error = std::current_exception();
    }
    team.finish();
  });
  if (error) std::rethrow_exception(error);
}

}  // namespace spk
