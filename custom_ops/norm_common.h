// Pieces shared by the row-wise normalisation kernels (layer_norm.cc,
// rms_norm.cc).  Both see x as [N, D] with D = gamma.NumElements(), the
// product of x's trailing dims; they load rows into fp32, and their gradients
// sum dgamma (and dbeta) over the N rows in fixed row blocks so the result
// does not depend on how the thread pool schedules them.
//
// Include after `#define EIGEN_USE_THREADS`.  The TensorFlow using-declarations
// come from op_common.h.
#ifndef NPU_AMP_TF_CUSTOM_OPS_NORM_COMMON_H_
#define NPU_AMP_TF_CUSTOM_OPS_NORM_COMMON_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "op_common.h"

namespace npu_amp_tf {

// dst[i] = float(src[i]) for i < n.
template <typename T>
inline void LoadRow(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// A whole parameter tensor (gamma, beta) in fp32.
template <typename T>
inline std::vector<float> LoadFp32(const Tensor& t) {
  std::vector<float> out(t.NumElements());
  LoadRow(t.flat<T>().data(), out.data(), t.NumElements());
  return out;
}

// Validates x against gamma and returns D (row length, gamma's size) and N
// (rows).  `op` names the op in the message ("LayerNorm", "RMSNorm").
inline Status RowGeometry(const char* op, const Tensor& x, const Tensor& gamma, int64_t* n_rows,
                          int64_t* d) {
  *d = gamma.NumElements();
  if (*d == 0) return InvalidArgument(op, ": gamma is empty");
  // the trailing dims of x must multiply to D
  int64_t acc = 1;
  int k = x.dims();
  while (k > 0 && acc < *d) acc *= x.dim_size(--k);
  if (acc != *d || x.dims() == 0) {
    return InvalidArgument(op, ": the trailing dims of x ", x.shape().DebugString(),
                           " do not multiply to gamma's size ", *d, " (gamma shape ",
                           gamma.shape().DebugString(), ")");
  }
  *n_rows = x.NumElements() / *d;
  return ::tensorflow::OkStatus();
}

// The shared checks of a normalisation gradient: dy has x's shape, x fits gamma
// (RowGeometry), and every per-row auxiliary input (mean, inv_std, inv_rms)
// has N elements.  `op` names the gradient op, `norm` the forward op whose
// geometry applies, `aux_names` the auxiliary inputs in the message.
inline Status GradGeometry(const char* op, const char* norm, const Tensor& dy, const Tensor& x,
                           const Tensor& gamma, std::initializer_list<const Tensor*> per_row,
                           const char* aux_names, int64_t* n_rows, int64_t* d) {
  if (dy.shape() != x.shape()) {
    return InvalidArgument(op, ": dy ", dy.shape().DebugString(), " and x ",
                           x.shape().DebugString(), " must have the same shape");
  }
  TF_RETURN_IF_ERROR(RowGeometry(norm, x, gamma, n_rows, d));
  for (const Tensor* t : per_row) {
    if (t->NumElements() != *n_rows) {
      return InvalidArgument(op, ": ", aux_names, " must have ", *n_rows, " elements, got ",
                             t->NumElements());
    }
  }
  return ::tensorflow::OkStatus();
}

// K per-column sums over the N rows of an [N, D] problem (dgamma, dbeta),
// accumulated in fp32 in parallel yet deterministically: the rows are cut into
// `blocks()` fixed blocks (a function of N and the pool's size only), each
// block adds into its own partial rows, and Store sums the partials in block
// order.
//
//   ColumnSums<2> sums(ctx, n, d);
//   sums.Run(/*cost_per_element=*/20, [&](int64_t rbeg, int64_t rend,
//                                         const std::array<float*, 2>& part) {
//     for (r in [rbeg, rend)) part[0][i] += ..., part[1][i] += ...;
//   });
//   sums.Store(0, dgamma_out);  sums.Store(1, dbeta_out);
template <int K>
class ColumnSums {
 public:
  ColumnSums(OpKernelContext* ctx, int64_t n, int64_t d)
      : pool_(ctx->device()->tensorflow_cpu_worker_threads()->workers),
        n_(n),
        d_(d),
        nblocks_(std::max<int64_t>(1, std::min<int64_t>(n, 4 * pool_->NumThreads() + 4))),
        per_((n + nblocks_ - 1) / nblocks_) {
    for (auto& p : part_) p.assign(nblocks_ * d, 0.f);
  }

  int64_t blocks() const { return nblocks_; }

  // Calls block_fn(row_begin, row_end, partials) once per block, in parallel;
  // partials[k] is that block's D floats for sum k.  cost_per_element is the
  // rough cost of one row element (for the pool's sharding only).
  template <typename BlockFn>
  void Run(int64_t cost_per_element, BlockFn block_fn) {
    if (n_ == 0) return;
    pool_->ParallelFor(nblocks_, /*cost_per_unit=*/per_ * d_ * cost_per_element,
                       [&](int64_t bbeg, int64_t bend) {
                         for (int64_t blk = bbeg; blk < bend; ++blk) {
                           std::array<float*, K> p;
                           for (int k = 0; k < K; ++k) p[k] = part_[k].data() + blk * d_;
                           block_fn(blk * per_, std::min(n_, (blk + 1) * per_), p);
                         }
                       });
  }

  // out[i] = T(sum over blocks, in block order, of the block partials of sum k).
  template <typename T>
  void Store(int k, T* out) const {
    const std::vector<float>& part = part_[k];
    for (int64_t i = 0; i < d_; ++i) {
      float s = 0.f;
      for (int64_t blk = 0; blk < nblocks_; ++blk) s += part[blk * d_ + i];
      out[i] = static_cast<T>(s);
    }
  }

 private:
  ::tensorflow::thread::ThreadPool* pool_;
  const int64_t n_, d_, nblocks_, per_;
  std::array<std::vector<float>, K> part_;
};

}  // namespace npu_amp_tf

#endif  // NPU_AMP_TF_CUSTOM_OPS_NORM_COMMON_H_
