// Jobs on the library's persistent helper threads (issue 17).  The bridge's
// work beside the callback's thread (the item's index, the early mirror's
// load, the second half of the item's bytes) ran on a std::thread made per
// call; a fresh thread allocates from a malloc arena whose memory was handed
// back since, and pays a page fault per page again: the mirror's load of
// BERT-12's bytes took 4.1-4.5 ms on a new thread against 1.8-2.0 ms on the
// caller's (and 1.9-2.3 on a thread kept alive).  A Job is used like a
// std::thread that always joins: it runs on one of two threads started on
// first use and kept (never destroyed: a leaked singleton).  See worker.cc.
#ifndef NPU_AMP_TF_WORKER_H_
#define NPU_AMP_TF_WORKER_H_

#include <cstdint>
#include <functional>
#include <memory>

namespace npu_amp_tf {

class Job {
 public:
  struct State;
  Job() = default;
  // Queues `fn` for a helper thread.  Throws std::system_error when no
  // helper thread can be had (as std::thread's constructor), std::bad_alloc.
  explicit Job(std::function<void()> fn);
  Job(Job&&) noexcept = default;
  Job& operator=(Job&& other) noexcept;  // (joins the job it held first)
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  ~Job();  // joins
  // a job was queued and not joined yet
  bool joinable() const { return state_ != nullptr; }
  // waits until the job has run (its exceptions are the job's own to catch:
  // one that escapes ends the process, as on a std::thread)
  void join();

 private:
  std::shared_ptr<State> state_;
};

// (tests) whether jobs run on the kept threads (true, the default) or each
// on a std::thread of its own (false, the reference); returns the previous
// setting.
bool SetKeptWorkers(bool on);

// (tests) jobs queued on the kept threads, and jobs run on threads of their own.
void WorkerCounts(uint64_t* kept, uint64_t* own);

}  // namespace npu_amp_tf

#endif  // NPU_AMP_TF_WORKER_H_
