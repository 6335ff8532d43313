// RMSNorm / RMSNormGrad: root-mean-square normalisation as T5 and LLaMA write it,
//
//   y[r, :] = x[r, :] * inv_rms[r] * gamma,   inv_rms[r] = 1 / sqrt(mean(x[r, :]^2) + eps)
//
// Emitted by the fusion pass (graph_passes/fusion, rule "layer_norm") for
// x * rsqrt(reduce_mean(square(x)) + eps) * gamma; wrapped in
// npu_amp_tf/fused_ops.py.  x is seen as [N, D] with D = gamma.NumElements()
// (the product of x's trailing dims).  fp32/fp16/bf16 input; the sum of squares
// and all arithmetic are fp32; y is written in the input dtype.  inv_rms ([N],
// fp32) is an auxiliary output for the gradient (not differentiable).
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "norm_common.h"

namespace npu_amp_tf {
namespace {

REGISTER_OP("RMSNorm")
    .Input("x: T")
    .Input("gamma: T")
    .Output("y: T")
    .Output("inv_rms: float")
    .Attr("T: {half, bfloat16, float}")
    .Attr("epsilon: float = 1e-6")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
RMS normalisation over the trailing dims of x whose product is gamma's size:
y = x * rsqrt(mean(x^2) + epsilon) * gamma.  fp32 accumulation, output in x's
dtype; inv_rms is the auxiliary [N] fp32 per-row 1/rms used by RMSNormGrad.
)doc");

REGISTER_OP("RMSNormGrad")
    .Input("dy: T")
    .Input("x: T")
    .Input("gamma: T")
    .Input("inv_rms: float")
    .Output("dx: T")
    .Output("dgamma: T")
    .Attr("T: {half, bfloat16, float}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(2));
      return ::tensorflow::OkStatus();
    })
    .Doc("Gradient of RMSNorm with respect to x and gamma (fp32 accumulation).");

template <typename T>
inline float F(T v) { return static_cast<float>(v); }

template <typename T>
class RMSNormOp : public OpKernel {
 public:
  explicit RMSNormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &eps_));
    OP_REQUIRES(ctx, eps_ >= 0.f, InvalidArgument("RMSNorm: epsilon must be >= 0, got ", eps_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& gamma = ctx->input(1);
    int64_t n = 0, d = 0;
    OP_REQUIRES_OK(ctx, RowGeometry("RMSNorm", x, gamma, &n, &d));
    Tensor *y = nullptr, *inv = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &inv));
    if (n == 0) return;
    const std::vector<float> g = LoadFp32<T>(gamma);
    const T* xp = x.flat<T>().data();
    T* yp = y->flat<T>().data();
    float* ip = inv->flat<float>().data();
    const float eps = eps_;
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = xp + r * d;
        T* out = yp + r * d;
        if constexpr (std::is_same<T, float>::value) {
          Eigen::Map<const Eigen::ArrayXf> xr(row, d);
          Eigen::Map<const Eigen::ArrayXf> ga(g.data(), d);
          const float rs = 1.0f / std::sqrt(xr.square().sum() / static_cast<float>(d) + eps);
          ip[r] = rs;
          Eigen::Map<Eigen::ArrayXf>(out, d) = xr * (ga * rs);
        } else {
          float ss = 0.f;
          for (int64_t i = 0; i < d; ++i) {
            const float v = F(row[i]);
            ss += v * v;
          }
          const float rs = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
          ip[r] = rs;
          for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(F(row[i]) * rs * g[i]);
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    pool->ParallelFor(n, /*cost_per_unit=*/d * 8, work);
  }

 private:
  float eps_;
};

template <typename T>
class RMSNormGradOp : public OpKernel {
 public:
  explicit RMSNormGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& gamma = ctx->input(2);
    const Tensor& inv = ctx->input(3);
    int64_t n = 0, d = 0;
    OP_REQUIRES_OK(ctx, GradGeometry("RMSNormGrad", "RMSNorm", dy, x, gamma, {&inv}, "inv_rms",
                                     &n, &d));
    Tensor *dx = nullptr, *dg = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, gamma.shape(), &dg));
    const std::vector<float> g = LoadFp32<T>(gamma);
    const T* dyp = dy.flat<T>().data();
    const T* xp = x.flat<T>().data();
    const float* ip = inv.flat<float>().data();
    T* dxp = dx->flat<T>().data();
    // dgamma = sum over rows of dy * x * inv_rms
    ColumnSums<1> sums(ctx, n, d);
    sums.Run(/*cost_per_element=*/12, [&](int64_t rbeg, int64_t rend,
                                          const std::array<float*, 1>& part) {
      float* pg = part[0];
      for (int64_t r = rbeg; r < rend; ++r) {
        const T* xr = xp + r * d;
        const T* dyr = dyp + r * d;
        const float rs = ip[r];
        // dx = rs * g*dy - x * rs^3 / D * sum(g*dy*x)
        float dot = 0.f;
        for (int64_t i = 0; i < d; ++i) {
          const float xv = F(xr[i]), dv = F(dyr[i]);
          dot += g[i] * dv * xv;
          pg[i] += dv * xv * rs;
        }
        const float c = rs * rs * rs * dot / static_cast<float>(d);
        T* out = dxp + r * d;
        for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(rs * g[i] * F(dyr[i]) - F(xr[i]) * c);
      }
    });
    sums.Store(0, dg->flat<T>().data());
  }
};

#define REGISTER(T)                                                                            \
  REGISTER_KERNEL_BUILDER(Name("RMSNorm").Device(DEVICE_CPU).TypeConstraint<T>("T"),           \
                          RMSNormOp<T>);                                                       \
  REGISTER_KERNEL_BUILDER(Name("RMSNormGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),       \
                          RMSNormGradOp<T>);
REGISTER(float);
REGISTER(Eigen::half);
REGISTER(Eigen::bfloat16);
#undef REGISTER

}  // namespace
}  // namespace npu_amp_tf
