// Frees off the caller's thread (issue 17): what a grappler callback only
// has to destroy (the nodes a fusion replaced, the patch parsed for the
// pre-check, a gradient-region mirror) is destroyed on one helper thread, so
// that grappler's timer around NpuAmpOptimizer::Optimize does not wait for
// it.  See deferred_free.cc.
#ifndef NPU_AMP_TF_DEFERRED_FREE_H_
#define NPU_AMP_TF_DEFERRED_FREE_H_

#include <cstdint>
#include <functional>

namespace npu_amp_tf {

// Runs `free_fn` (a destruction, nothing else: it must read no state another
// thread may change) on the helper thread, in call order; inline when
// deferring is off (SetDeferFree), when the helper cannot start or the job
// cannot be queued, or once the process is exiting.  Never throws (making
// the std::function argument, at the caller, may: a job holding more than
// two pointers).
void DeferFree(std::function<void()> free_fn);

// Turns deferring on / off (on by default); returns the previous setting.
bool SetDeferFree(bool on);

// Waits until every destruction handed over so far has run.
void DrainDeferredFrees();

// How many destructions were handed to the helper, and how many it has run.
void DeferredFreeCounts(uint64_t* queued, uint64_t* ran);

}  // namespace npu_amp_tf

#endif  // NPU_AMP_TF_DEFERRED_FREE_H_
