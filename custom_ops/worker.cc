// Jobs on the library's persistent helper threads (issue 17); see worker.h.
//
// Two helper threads, started on first use and detached, take the queued
// jobs in order.  Their state is never destroyed (a leaked singleton), so no
// static destructor races them.  Every job is joined by its caller before
// the call that queued it returns to grappler or Python, so none is left
// running at exit.
#include "worker.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

namespace npu_amp_tf {

struct Job::State {
  std::function<void()> fn;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread own;  // (SetKeptWorkers(false): the job's own thread)
};

namespace {

constexpr int kWorkers = 2;

struct Pool {
  std::mutex mu;
  std::condition_variable wake;
  std::deque<std::shared_ptr<Job::State>> jobs;
  int started = 0;
};

Pool& P() {
  static Pool* p = new Pool;  // (never destroyed: see the top comment)
  return *p;
}

std::atomic<bool> g_kept{true};
std::atomic<uint64_t> g_kept_jobs{0};
std::atomic<uint64_t> g_own_jobs{0};

void Run(const std::shared_ptr<Job::State>& st) {
  st->fn();
  st->fn = nullptr;  // (what the job holds is released here, before the caller wakes)
  {
    std::lock_guard<std::mutex> lock(st->mu);
    st->done = true;
  }
  st->cv.notify_all();
}

void Worker() {
  Pool& p = P();
  std::unique_lock<std::mutex> lock(p.mu);
  while (true) {
    p.wake.wait(lock, [&p] { return !p.jobs.empty(); });
    std::shared_ptr<Job::State> st = std::move(p.jobs.front());
    p.jobs.pop_front();
    lock.unlock();
    Run(st);
    st.reset();
    lock.lock();
  }
}

}  // namespace

Job::Job(std::function<void()> fn) {
  auto st = std::make_shared<State>();
  st->fn = std::move(fn);
  if (!g_kept.load()) {
    st->own = std::thread([st] { Run(st); });  // (throws std::system_error as std::thread does)
    g_own_jobs.fetch_add(1);
    state_ = std::move(st);
    return;
  }
  Pool& p = P();
  {
    std::lock_guard<std::mutex> lock(p.mu);
    while (p.started < kWorkers) {
      try {
        std::thread(Worker).detach();
        ++p.started;
      } catch (...) {
        if (p.started == 0) throw;  // (no thread at all: as std::thread's constructor)
        break;
      }
    }
    p.jobs.push_back(st);
  }
  p.wake.notify_one();
  g_kept_jobs.fetch_add(1);
  state_ = std::move(st);
}

void Job::join() {
  if (state_ == nullptr) return;
  {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait(lock, [this] { return state_->done; });
  }
  if (state_->own.joinable()) state_->own.join();
  state_.reset();
}

Job& Job::operator=(Job&& other) noexcept {
  if (this != &other) {
    join();
    state_ = std::move(other.state_);
  }
  return *this;
}

Job::~Job() { join(); }

bool SetKeptWorkers(bool on) { return g_kept.exchange(on); }

void WorkerCounts(uint64_t* kept, uint64_t* own) {
  *kept = g_kept_jobs.load();
  *own = g_own_jobs.load();
}

}  // namespace npu_amp_tf

#define NPU_AMP_EXPORT extern "C" __attribute__((visibility("default")))

// (issue 17) jobs on the kept helper threads (1) or each on a thread of its
// own (0; the reference); returns the previous setting.  bridge.KEPT_WORKERS.
NPU_AMP_EXPORT int NpuAmpSetKeptWorkers(int on) { return npu_amp_tf::SetKeptWorkers(on != 0) ? 1 : 0; }

// Jobs queued on the kept threads and jobs run on threads of their own (tests).
NPU_AMP_EXPORT void NpuAmpWorkerCounts(uint64_t* kept, uint64_t* own) {
  npu_amp_tf::WorkerCounts(kept, own);
}
