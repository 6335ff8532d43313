// FusedAttention: softmax(q . k^T * scale + mask) . v in one CPU kernel.
// Emitted by the fusion pass at graph_level 3 for inference graphs
// (BatchMatMul -> Mul/RealDiv scale -> [AddV2 mask] -> Softmax -> BatchMatMul).
//
//   q    [B..., S, D]
//   k    [B..., T, D]   (adj_k = true, the usual q . k^T)   or [B..., D, T]
//   v    [B..., T, Dv]
//   mask (0 or 1 tensors) broadcastable to [B..., S, T], added before softmax
//   out  [B..., S, Dv]
//
// Work is split over (batch, block of query rows) on the intra-op pool.  The
// two products are written as row-axpy loops over contiguous memory so the
// compiler vectorises them; an AVX2/FMA clone of those loops is selected at
// run time when the CPU has it (the rest of the file is built with TF's flags).
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "op_common.h"

namespace npu_amp_tf {
namespace {

REGISTER_OP("FusedAttention")
    .Input("q: T")
    .Input("k: T")
    .Input("v: T")
    .Input("mask: num_masks * T")
    .Output("out: T")
    .Attr("T: {float}")
    .Attr("num_masks: int >= 0 = 0")
    .Attr("scale: float = 1.0")
    .Attr("adj_k: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle q, v, out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 2, &q));
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(2), 2, &v));
      TF_RETURN_IF_ERROR(c->Subshape(q, 0, -1, &out));
      TF_RETURN_IF_ERROR(c->Concatenate(out, c->Vector(c->Dim(v, -1)), &out));
      c->set_output(0, out);
      return ::tensorflow::OkStatus();
    })
    .Doc("softmax(q . k^T * scale + mask) . v with fp32 softmax; inference only (no gradient).");

// C[rows x cols] += A[rows x k] . B[k x cols]  (all row-major).  Four rows of C
// are updated per pass over B so each loaded B row feeds four FMAs; the inner
// loop is contiguous, so the compiler vectorises it.
#define GEMM_BODY                                                                  \
  int64_t r = 0;                                                                   \
  for (; r + 4 <= rows; r += 4) {                                                  \
    float* __restrict c0 = c + r * ldc;                                            \
    float* __restrict c1 = c0 + ldc;                                               \
    float* __restrict c2 = c1 + ldc;                                               \
    float* __restrict c3 = c2 + ldc;                                               \
    const float* a0 = a + r * lda;                                                 \
    for (int64_t j = 0; j < k; ++j) {                                              \
      const float* __restrict bj = b + j * ldb;                                    \
      const float x0 = a0[j], x1 = a0[lda + j], x2 = a0[2 * lda + j], x3 = a0[3 * lda + j]; \
      for (int64_t i = 0; i < cols; ++i) {                                         \
        const float bv = bj[i];                                                    \
        c0[i] += x0 * bv;                                                          \
        c1[i] += x1 * bv;                                                          \
        c2[i] += x2 * bv;                                                          \
        c3[i] += x3 * bv;                                                          \
      }                                                                            \
    }                                                                              \
  }                                                                                \
  for (; r < rows; ++r) {                                                          \
    float* __restrict c0 = c + r * ldc;                                            \
    for (int64_t j = 0; j < k; ++j) {                                              \
      const float* __restrict bj = b + j * ldb;                                    \
      const float x0 = a[r * lda + j];                                             \
      for (int64_t i = 0; i < cols; ++i) c0[i] += x0 * bj[i];                      \
    }                                                                              \
  }

__attribute__((target("avx2,fma"), optimize("O3"))) void GemmAvx2(
    const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t rows,
    int64_t k, int64_t cols) {
  GEMM_BODY
}
__attribute__((optimize("O3"))) void GemmBase(const float* a, int64_t lda, const float* b, int64_t ldb,
                                              float* c, int64_t ldc, int64_t rows, int64_t k,
                                              int64_t cols) {
  GEMM_BODY
}
#undef GEMM_BODY

using GemmFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t,
                        int64_t);

GemmFn PickGemm() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &GemmAvx2;
  return &GemmBase;
}

class FusedAttentionOp : public OpKernel {
 public:
  explicit FusedAttentionOp(OpKernelConstruction* ctx) : OpKernel(ctx), gemm_(PickGemm()) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("adj_k", &adj_k_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& q = ctx->input(0);
    const Tensor& k = ctx->input(1);
    const Tensor& v = ctx->input(2);
    OpInputList masks;
    OP_REQUIRES_OK(ctx, ctx->input_list("mask", &masks));
    OP_REQUIRES(ctx, masks.size() <= 1, InvalidArgument("FusedAttention: at most one mask, got ", masks.size()));
    const int r = q.dims();
    OP_REQUIRES(ctx, r >= 2 && k.dims() == r && v.dims() == r,
                InvalidArgument("FusedAttention: q, k, v must have the same rank >= 2; got ",
                                q.shape().DebugString(), ", ", k.shape().DebugString(), ", ",
                                v.shape().DebugString()));
    int64_t batch = 1;
    for (int i = 0; i < r - 2; ++i) {
      OP_REQUIRES(ctx, q.dim_size(i) == k.dim_size(i) && q.dim_size(i) == v.dim_size(i),
                  InvalidArgument("FusedAttention: batch dims of q, k, v differ: ", q.shape().DebugString(),
                                  ", ", k.shape().DebugString(), ", ", v.shape().DebugString()));
      batch *= q.dim_size(i);
    }
    const int64_t S = q.dim_size(r - 2), D = q.dim_size(r - 1);
    const int64_t T = adj_k_ ? k.dim_size(r - 2) : k.dim_size(r - 1);
    const int64_t Dk = adj_k_ ? k.dim_size(r - 1) : k.dim_size(r - 2);
    const int64_t Dv = v.dim_size(r - 1);
    OP_REQUIRES(ctx, Dk == D && v.dim_size(r - 2) == T,
                InvalidArgument("FusedAttention: inner dims disagree: q ", q.shape().DebugString(), ", k ",
                                k.shape().DebugString(), " (adj_k=", adj_k_, "), v ", v.shape().DebugString()));
    // mask broadcasting: offsets per batch index, stride per query row / key column
    std::vector<int64_t> mask_batch_off(batch, 0);
    int64_t mask_row_stride = 0, mask_col_stride = 0;
    const float* mp = nullptr;
    if (masks.size() == 1) {
      const Tensor& m = masks[0];
      OP_REQUIRES(ctx, m.dims() <= r,
                  InvalidArgument("FusedAttention: mask rank ", m.dims(), " exceeds ", r));
      std::vector<int64_t> out_dims(r), mdims(r, 1), mstride(r, 0);
      for (int i = 0; i < r - 2; ++i) out_dims[i] = q.dim_size(i);
      out_dims[r - 2] = S;
      out_dims[r - 1] = T;
      for (int i = 0; i < m.dims(); ++i) mdims[r - m.dims() + i] = m.dim_size(i);
      int64_t st = 1;
      for (int i = r - 1; i >= 0; --i) {
        OP_REQUIRES(ctx, mdims[i] == 1 || mdims[i] == out_dims[i],
                    InvalidArgument("FusedAttention: mask ", m.shape().DebugString(),
                                    " does not broadcast to the score shape (dim ", i, ": ", out_dims[i], ")"));
        mstride[i] = mdims[i] == 1 ? 0 : st;
        st *= mdims[i];
      }
      mask_row_stride = mstride[r - 2];
      mask_col_stride = mstride[r - 1];
      for (int64_t b = 0; b < batch; ++b) {
        int64_t rem = b, off = 0;
        for (int i = r - 3; i >= 0; --i) {
          off += (rem % out_dims[i]) * mstride[i];
          rem /= out_dims[i];
        }
        mask_batch_off[b] = off;
      }
      mp = m.flat<float>().data();
    }
    TensorShape out_shape = q.shape();
    out_shape.set_dim(r - 1, Dv);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    if (out->NumElements() == 0) return;
    if (T == 0) {
      out->flat<float>().setZero();
      return;
    }
    const float* qp = q.flat<float>().data();
    const float* kp = k.flat<float>().data();
    const float* vp = v.flat<float>().data();
    float* op = out->flat<float>().data();
    const int64_t rb = std::min<int64_t>(S, 32);  // query rows per work unit
    const int64_t blocks_per_batch = (S + rb - 1) / rb;
    const float scale = scale_;
    const bool adj_k = adj_k_;
    GemmFn gemm = gemm_;
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> kt(adj_k ? D * T : 0), scores(rb * T);
      int64_t kt_batch = -1;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u / blocks_per_batch;
        const int64_t s0 = (u % blocks_per_batch) * rb;
        const int64_t rows = std::min(rb, S - s0);
        const float* kb;
        if (adj_k) {  // k [T, D] -> kt [D, T] so the product is row-axpy
          if (kt_batch != b) {
            const float* src = kp + b * T * D;
            for (int64_t t = 0; t < T; ++t)
              for (int64_t d = 0; d < D; ++d) kt[d * T + t] = src[t * D + d];
            kt_batch = b;
          }
          kb = kt.data();
        } else {
          kb = kp + b * D * T;
        }
        std::fill(scores.begin(), scores.begin() + rows * T, 0.f);
        gemm(qp + (b * S + s0) * D, D, kb, T, scores.data(), T, rows, D, T);
        for (int64_t i = 0; i < rows; ++i) {
          Eigen::Map<Eigen::ArrayXf> row(scores.data() + i * T, T);
          row *= scale;
          if (mp != nullptr) {
            const float* mrow = mp + mask_batch_off[b] + (s0 + i) * mask_row_stride;
            if (mask_col_stride == 1) {
              row += Eigen::Map<const Eigen::ArrayXf>(mrow, T);
            } else {
              row += mrow[0];
            }
          }
          const float mx = row.maxCoeff();
          row = (row - mx).exp();
          row *= 1.0f / row.sum();
        }
        float* ob = op + (b * S + s0) * Dv;
        std::fill(ob, ob + rows * Dv, 0.f);
        gemm(scores.data(), T, vp + b * T * Dv, Dv, ob, Dv, rows, T, Dv);
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64_t cost = rb * T * (2 * D + 2 * Dv + 20);
    pool->ParallelFor(batch * blocks_per_batch, cost, work);
  }

 private:
  float scale_;
  bool adj_k_;
  GemmFn gemm_;
};

REGISTER_KERNEL_BUILDER(Name("FusedAttention").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        FusedAttentionOp);

}  // namespace
}  // namespace npu_amp_tf
