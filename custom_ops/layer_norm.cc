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
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/work_sharder.h"
#include "norm_common.h"
#include "bf16_simd.h"

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


// ------------------------------------------------------------------ BF16 rows (18g)
// bfloat16 rows read 16 at a time (a shift widens them), FP32 arithmetic with vector
// accumulators, results rounded to nearest even on the bit pattern as Eigen's float ->
// bfloat16 (NaN -> 0x7fc0).  The element-by-element static_cast loops of the generic path
// were most of a BF16 LayerNorm's time (BERT-like b8 s128: 2.5 ms forward, 7 ms backward per
// [1024, 768] norm).  AVX-512 (avx512f/bw/vl) is chosen at run time;
// NPU_AMP_TF_BF16_PORTABLE=1 before the first call keeps the generic loops.  The sums run in
// another order than the generic loops' (FP32 rounding differs, not the formula).

#ifdef NPU_AMP_X86

// one row: mean, inv_std (two passes: sum, then sum of squared deviations), y
NPU_AMP_AVX512 void LnRowBf16Avx512(const uint16_t* x, const float* g, const float* b, uint16_t* y,
                                       int64_t d, float eps, float* mu_out, float* rs_out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) acc = _mm512_add_ps(acc, Bf16Load16(x + i, Bf16Tail(d - i)));
  const float mu = _mm512_reduce_add_ps(acc) / static_cast<float>(d);
  const __m512 vmu = _mm512_set1_ps(mu);
  acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = Bf16Tail(d - i);
    const __m512 c = _mm512_maskz_sub_ps(m, Bf16Load16(x + i, m), vmu);
    acc = _mm512_fmadd_ps(c, c, acc);
  }
  const float var = _mm512_reduce_add_ps(acc) / static_cast<float>(d);
  const float rs = 1.0f / std::sqrt(var + eps);
  const __m512 vrs = _mm512_set1_ps(rs);
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = Bf16Tail(d - i);
    const __m512 xh = _mm512_mul_ps(_mm512_sub_ps(Bf16Load16(x + i, m), vmu), vrs);
    const __m512 out = _mm512_fmadd_ps(xh, _mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, b + i));
    _mm256_mask_storeu_epi16(y + i, m, Bf16Round16(out));
  }
  *mu_out = mu;
  *rs_out = rs;
}

// one row of the gradient: pg += dy * xhat, pb += dy (column partials), dx rounded to BF16;
// xh / gg: D floats of scratch
NPU_AMP_AVX512 void LnGradRowBf16Avx512(const uint16_t* x, const uint16_t* dy, const float* g, float mu,
                                           float rs, float* pg, float* pb, float* xh, float* gg, uint16_t* dx,
                                           int64_t d) {
  const __m512 vmu = _mm512_set1_ps(mu), vrs = _mm512_set1_ps(rs);
  __m512 sg = _mm512_setzero_ps(), sgx = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = Bf16Tail(d - i);
    const __m512 h = _mm512_maskz_mul_ps(m, _mm512_sub_ps(Bf16Load16(x + i, m), vmu), vrs);
    const __m512 dv = Bf16Load16(dy + i, m);
    const __m512 gi = _mm512_mul_ps(dv, _mm512_maskz_loadu_ps(m, g + i));
    _mm512_mask_storeu_ps(xh + i, m, h);
    _mm512_mask_storeu_ps(gg + i, m, gi);
    sg = _mm512_add_ps(sg, gi);
    sgx = _mm512_fmadd_ps(gi, h, sgx);
    _mm512_mask_storeu_ps(pg + i, m, _mm512_fmadd_ps(dv, h, _mm512_maskz_loadu_ps(m, pg + i)));
    _mm512_mask_storeu_ps(pb + i, m, _mm512_add_ps(dv, _mm512_maskz_loadu_ps(m, pb + i)));
  }
  const __m512 mg = _mm512_set1_ps(_mm512_reduce_add_ps(sg) / static_cast<float>(d));
  const __m512 mgx = _mm512_set1_ps(_mm512_reduce_add_ps(sgx) / static_cast<float>(d));
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = Bf16Tail(d - i);
    const __m512 h = _mm512_maskz_loadu_ps(m, xh + i);
    const __m512 t = _mm512_sub_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, gg + i), mg), _mm512_mul_ps(h, mgx));
    _mm256_mask_storeu_epi16(dx + i, m, Bf16Round16(_mm512_mul_ps(vrs, t)));
  }
}
#endif

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
    const bool avx512 = std::is_same<T, Eigen::bfloat16>::value && Bf16UseAvx512();
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same<T, float>::value ? 0 : d);
      for (int64_t r = begin; r < end; ++r) {
#ifdef NPU_AMP_X86
        if (avx512) {
          LnRowBf16Avx512(reinterpret_cast<const uint16_t*>(xp + r * d), g.data(), b.data(),
                          reinterpret_cast<uint16_t*>(yp + r * d), d, eps, mp + r, ip + r);
          continue;
        }
#endif
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
    const bool avx512 = std::is_same<T, Eigen::bfloat16>::value && Bf16UseAvx512();
    (void)avx512;
    ColumnSums<2> sums(ctx, n, d);
    sums.Run(/*cost_per_element=*/20, [&](int64_t rbeg, int64_t rend,
                                          const std::array<float*, 2>& part) {
      float* pg = part[0];
      float* pb = part[1];
      std::vector<float> xr(d), dyr(d), gg(d);
      for (int64_t r = rbeg; r < rend; ++r) {
#ifdef NPU_AMP_X86
        if (avx512) {
          LnGradRowBf16Avx512(reinterpret_cast<const uint16_t*>(xp + r * d),
                              reinterpret_cast<const uint16_t*>(dyp + r * d), g.data(), mp[r], ip[r], pg, pb,
                              xr.data(), gg.data(), reinterpret_cast<uint16_t*>(dxp + r * d), d);
          continue;
        }
#endif
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
