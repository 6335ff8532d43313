// Frees off the caller's thread (issue 17); see deferred_free.h.
//
// One helper thread, started on first use and detached, runs the queued
// destructions in order.  Its state is never destroyed (a leaked singleton),
// so no static destructor races it.  At exit (std::atexit, registered on
// first use, hence run before the destructors of statics built earlier, such
// as TensorFlow's) the queue is closed: the destruction under way finishes,
// the ones still queued are dropped (the process's memory goes with it), and
// later calls run inline.
#include "deferred_free.h"

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

namespace npu_amp_tf {
namespace {

struct Queue {
  std::mutex mu;
  std::condition_variable wake;  // the helper: work, or closed
  std::condition_variable idle;  // DrainDeferredFrees / the exit handler
  std::deque<std::function<void()>> jobs;
  bool busy = false;     // the helper runs a job
  bool started = false;  // the helper thread exists
  bool closed = false;   // exiting: run inline from now on
  bool on = true;        // SetDeferFree
  uint64_t queued = 0;   // handed to the helper
  uint64_t ran = 0;      // run by it
};

Queue& Q() {
  static Queue* q = new Queue;  // (never destroyed: see the top comment)
  return *q;
}

void Helper() {
  Queue& q = Q();
  std::unique_lock<std::mutex> lock(q.mu);
  while (true) {
    q.wake.wait(lock, [&q] { return q.closed || !q.jobs.empty(); });
    if (q.closed) {
      q.jobs.clear();  // (dropped, not run: the process is ending)
      q.idle.notify_all();
      return;
    }
    std::function<void()> job = std::move(q.jobs.front());
    q.jobs.pop_front();
    q.busy = true;
    lock.unlock();
    job();
    job = nullptr;  // (whatever the job owns goes here, still off the caller's thread)
    lock.lock();
    q.busy = false;
    ++q.ran;
    if (q.jobs.empty()) q.idle.notify_all();
  }
}

void CloseAtExit() {
  Queue& q = Q();
  std::unique_lock<std::mutex> lock(q.mu);
  q.closed = true;
  q.wake.notify_all();
  q.idle.wait(lock, [&q] { return !q.busy; });
}

}  // namespace

void DeferFree(std::function<void()> free_fn) {
  Queue& q = Q();
  try {
    std::lock_guard<std::mutex> lock(q.mu);
    if (q.on && !q.closed) {
      if (!q.started) {
        try {
          std::thread(Helper).detach();
          q.started = true;
          std::atexit(CloseAtExit);
        } catch (...) {  // (no thread: the frees stay inline)
          q.on = false;
        }
      }
      if (q.started) {
        q.jobs.push_back(std::move(free_fn));  // (bad_alloc: `free_fn` untouched, run below)
        ++q.queued;
        q.wake.notify_one();
        return;
      }
    }
  } catch (...) {  // (the lock or the queue failed: freed here)
  }
  free_fn();
}

bool SetDeferFree(bool on) {
  Queue& q = Q();
  std::lock_guard<std::mutex> lock(q.mu);
  const bool was = q.on;
  q.on = on;
  return was;
}

void DrainDeferredFrees() {
  Queue& q = Q();
  std::unique_lock<std::mutex> lock(q.mu);
  q.idle.wait(lock, [&q] { return q.closed || (q.jobs.empty() && !q.busy); });
}

void DeferredFreeCounts(uint64_t* queued, uint64_t* ran) {
  Queue& q = Q();
  std::lock_guard<std::mutex> lock(q.mu);
  *queued = q.queued;
  *ran = q.ran;
}

}  // namespace npu_amp_tf

#define NPU_AMP_EXPORT extern "C" __attribute__((visibility("default")))

// (issue 17) deferring on (1) / off (0; the reference: every free inline);
// returns the previous setting.  bridge.DEFER_FREES.
NPU_AMP_EXPORT int NpuAmpSetDeferFree(int on) { return npu_amp_tf::SetDeferFree(on != 0) ? 1 : 0; }

// Waits until the destructions handed over so far have run (tests, benchmarks).
NPU_AMP_EXPORT void NpuAmpDrainDeferredFrees() { npu_amp_tf::DrainDeferredFrees(); }

// How many destructions were handed to the helper and how many it ran (tests).
NPU_AMP_EXPORT void NpuAmpDeferredFreeCounts(uint64_t* queued, uint64_t* ran) {
  npu_amp_tf::DeferredFreeCounts(queued, ran);
}
