// LayerNorm / LayerNormGrad: one op for the whole layer-normalisation
// subgraph (Keras LayerNormalization, BERT-style moments).  Emitted by the
// fusion pass (graph_passes/fusion) and wrapped in npu_amp_tf/fused_ops.py.
//
//   y[r, :] = (x[r, :] - mean[r]) * inv_std[r] * gamma + beta
//
// x is seen as [N, D] where D = gamma.NumElements() is the product of x's
// trailing dims (gamma/beta have the normalised shape, or its flattening).
// Input may be fp32, fp16 or bf16; statistics and arithmetic are fp32; y is
// written in the input dtype.  mean and inv_std ([N], fp32) are auxiliary
// outputs for the gradient (they are not differentiable).
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/work_sharder.h"
#include "norm_common.h"

namespace npu_amp_tf {
namespace {

// Shape function shared by both ops: output 0 has x's shape; the per-row
// statistics are [N] with N = num_elements(x) / num_elements(gamma) when known.
Status RowsOf(shape_inference::InferenceContext* c, int x_idx, int gamma_idx,
              shape_inference::DimensionHandle* rows) {
  shape_inference::ShapeHandle x = c->input(x_idx), g = c->input(gamma_idx);
  *rows = c->UnknownDim();
  if (c->RankKnown(g) && c->RankKnown(x)) {
    int64_t gd = 1;
    for (int i = 0; i < c->Rank(g); ++i) {
      if (!c->ValueKnown(c->Dim(g, i))) return ::tensorflow::OkStatus();
      gd *= c->Value(c->Dim(g, i));
    }
    int64_t xd = 1;
    for (int i = 0; i < c->Rank(x); ++i) {
      if (!c->ValueKnown(c->Dim(x, i))) return ::tensorflow::OkStatus();
      xd *= c->Value(c->Dim(x, i));
    }
    if (gd > 0 && xd % gd == 0) *rows = c->MakeDim(xd / gd);
  }
  return ::tensorflow::OkStatus();
}

REGISTER_OP("LayerNorm")
    .Input("x: T")
    .Input("gamma: T")
    .Input("beta: T")
    .Output("y: T")
    .Output("mean: float")
    .Output("inv_std: float")
    .Attr("T: {half, bfloat16, float}")
    .Attr("epsilon: float = 0.001")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->Merge(c->input(1), c->input(2), &unused));
      c->set_output(0, c->input(0));
      shape_inference::DimensionHandle rows;
      TF_RETURN_IF_ERROR(RowsOf(c, 0, 1, &rows));
      c->set_output(1, c->Vector(rows));
      c->set_output(2, c->Vector(rows));
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
Layer normalisation over the trailing dims of x whose product is gamma's size.
Statistics in fp32, output in x's dtype. mean/inv_std are auxiliary [N] fp32
outputs (per normalised row) used by LayerNormGrad.
)doc");

REGISTER_OP("LayerNormGrad")
    .Input("dy: T")
    .Input("x: T")
    .Input("gamma: T")
    .Input("mean: float")
    .Input("inv_std: float")
    .Output("dx: T")
    .Output("dgamma: T")
    .Output("dbeta: T")
    .Attr("T: {half, bfloat16, float}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(2));
      c->set_output(2, c->input(2));
      return ::tensorflow::OkStatus();
    })
    .Doc("Gradient of LayerNorm with respect to x, gamma and beta (fp32 accumulation).");

template <typename T>
class LayerNormOp : public OpKernel {
 public:
  explicit LayerNormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES(ctx, epsilon_ >= 0.f, InvalidArgument("LayerNorm: epsilon must be >= 0, got ", epsilon_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& gamma = ctx->input(1);
    const Tensor& beta = ctx->input(2);
    OP_REQUIRES(ctx, gamma.shape() == beta.shape(),
                InvalidArgument("LayerNorm: gamma ", gamma.shape().DebugString(), " and beta ",
                                beta.shape().DebugString(), " must have the same shape"));
    int64_t n = 0, d = 0;
    OP_REQUIRES_OK(ctx, RowGeometry("LayerNorm", x, gamma, &n, &d));
    Tensor *y = nullptr, *mean = nullptr, *inv = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &inv));
    if (n == 0) return;
    const T* xp = x.flat<T>().data();
    T* yp = y->flat<T>().data();
    float* mp = mean->flat<float>().data();
    float* ip = inv->flat<float>().data();
    // gamma / beta in fp32 once
    const std::vector<float> g = LoadFp32<T>(gamma), b = LoadFp32<T>(beta);
    const float eps = epsilon_;
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same<T, float>::value ? 0 : d);
      for (int64_t r = begin; r < end; ++r) {
        const float* row;
        if constexpr (std::is_same<T, float>::value) {
          row = xp + r * d;
        } else {
          LoadRow(xp + r * d, buf.data(), d);
          row = buf.data();
        }
        Eigen::Map<const Eigen::ArrayXf> xr(row, d);
        const float mu = xr.sum() / static_cast<float>(d);
        const float var = (xr - mu).square().sum() / static_cast<float>(d);
        const float rs = 1.0f / std::sqrt(var + eps);
        mp[r] = mu;
        ip[r] = rs;
        Eigen::Map<const Eigen::ArrayXf> ga(g.data(), d), be(b.data(), d);
        if constexpr (std::is_same<T, float>::value) {
          Eigen::Map<Eigen::ArrayXf> yr(yp + r * d, d);
          yr = (xr - mu) * (ga * rs) + be;
        } else {
          T* out = yp + r * d;
          for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>((row[i] - mu) * rs * g[i] + b[i]);
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    pool->ParallelFor(n, /*cost_per_unit=*/d * 12, work);
  }

 private:
  float epsilon_;
};

template <typename T>
class LayerNormGradOp : public OpKernel {
 public:
  explicit LayerNormGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& gamma = ctx->input(2);
    const Tensor& mean = ctx->input(3);
    const Tensor& inv = ctx->input(4);
    int64_t n = 0, d = 0;
    OP_REQUIRES_OK(ctx, GradGeometry("LayerNormGrad", "LayerNorm", dy, x, gamma, {&mean, &inv},
                                     "mean/inv_std", &n, &d));
    Tensor *dx = nullptr, *dg = nullptr, *db = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, gamma.shape(), &dg));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, gamma.shape(), &db));
    const std::vector<float> g = LoadFp32<T>(gamma);
    const T* dyp = dy.flat<T>().data();
    const T* xp = x.flat<T>().data();
    const float* mp = mean.flat<float>().data();
    const float* ip = inv.flat<float>().data();
    T* dxp = dx->flat<T>().data();

    // dgamma = sum over rows of dy * xhat, dbeta = sum of dy
    ColumnSums<2> sums(ctx, n, d);
    sums.Run(/*cost_per_element=*/20, [&](int64_t rbeg, int64_t rend,
                                          const std::array<float*, 2>& part) {
      float* pg = part[0];
      float* pb = part[1];
      std::vector<float> xr(d), dyr(d), gg(d);
      for (int64_t r = rbeg; r < rend; ++r) {
        LoadRow(xp + r * d, xr.data(), d);
        LoadRow(dyp + r * d, dyr.data(), d);
        const float mu = mp[r], rs = ip[r];
        float sum_g = 0.f, sum_gx = 0.f;
        for (int64_t i = 0; i < d; ++i) {
          const float xh = (xr[i] - mu) * rs;
          xr[i] = xh;
          const float gi = dyr[i] * g[i];
          gg[i] = gi;
          sum_g += gi;
          sum_gx += gi * xh;
          pg[i] += dyr[i] * xh;
          pb[i] += dyr[i];
        }
        const float mg = sum_g / d, mgx = sum_gx / d;
        T* out = dxp + r * d;
        for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(rs * (gg[i] - mg - xr[i] * mgx));
      }
    });
    sums.Store(0, dg->flat<T>().data());
    sums.Store(1, db->flat<T>().data());
  }
};

#define REGISTER(T)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                           \
      Name("LayerNorm").Device(DEVICE_CPU).TypeConstraint<T>("T"), LayerNormOp<T>); \
  REGISTER_KERNEL_BUILDER(Name("LayerNormGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          LayerNormGradOp<T>);
REGISTER(float);
REGISTER(Eigen::half);
REGISTER(Eigen::bfloat16);
#undef REGISTER

}  // namespace
}  // namespace npu_amp_tf
