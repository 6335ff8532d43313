// Exact (erf) GELU and its gradient as single elementwise passes (issue 18, helper 18g),
// for BF16 transformer training on CPUs: TF runs BERT's GELU as 5 forward ops
// (RealDiv/Mul, Erf, AddV2, Mul, Mul) and ~12 backward ops (Mul, Square, Neg, Exp,
// AddN...), each a full pass over [tokens, ffn] in BF16 Eigen kernels that convert
// element by element, with FP32 islands and casts where the precision plan keeps
// Exp's chain FP32.  Emitted by the fusion rule ``bf16_gelu`` in
// graph_passes/fusion/bf16_transformer.py.
//
//   GeluErf(x)          y  = 0.5 * x * (1 + erf(x / sqrt(2)))           = x * Phi(x)
//   GeluErfGrad(dy, x)  dx = dy * (Phi(x) + x * exp(-x^2 / 2) / sqrt(2 pi))
//
// FP32 arithmetic, one rounding to T at the end (bfloat16: round to nearest even as
// TF's conversion, NaN -> 0x7fc0).  erf: the rational approximation Eigen's FP32
// erf uses (odd degree-13 numerator over even degree-8 denominator, argument clamped
// to [-4, 4]; |error| ~1e-7); exp: range reduction by ln 2 (Cody-Waite) and a
// degree-6 Taylor polynomial, scaled by 2^n (|relative error| < 2e-7).  The AVX-512
// path (avx512f, chosen at run time) and the portable loop (std::erf / std::exp in
// float) agree to FP32 rounding, not bit for bit; NPU_AMP_TF_BF16_PORTABLE=1 before
// the first call forces the portable loop.  T is bfloat16 or float.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "norm_common.h"
#include "bf16_simd.h"

namespace npu_amp_tf {
namespace {

using ::tensorflow::bfloat16;

REGISTER_OP("GeluErf")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: {bfloat16, float}")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Exact GELU 0.5 * x * (1 + erf(x / sqrt(2))) in one pass (FP32 arithmetic, one rounding).");

REGISTER_OP("GeluErfGrad")
    .Input("dy: T")
    .Input("x: T")
    .Output("dx: T")
    .Attr("T: {bfloat16, float}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle s;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &s));
      c->set_output(0, s);
      return ::tensorflow::OkStatus();
    })
    .Doc("Gradient of GeluErf: dy * (Phi(x) + x * exp(-x^2/2) / sqrt(2 pi)); dy and x of equal shape.");

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;


inline float GeluF(float x) { return 0.5f * x * (1.f + std::erf(x * kInvSqrt2)); }
inline float GeluGradF(float dy, float x) {
  const float cdf = 0.5f * (1.f + std::erf(x * kInvSqrt2));
  return dy * (cdf + x * kInvSqrt2Pi * std::exp(-0.5f * x * x));
}


#ifdef NPU_AMP_X86


// erf(a): Eigen's FP32 rational approximation (generic_fast_erf_float)
NPU_AMP_AVX512 inline __m512 Erf16(__m512 a) {
  const __m512 x = _mm512_max_ps(_mm512_min_ps(a, _mm512_set1_ps(4.f)), _mm512_set1_ps(-4.f));
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_fmadd_ps(x2, _mm512_set1_ps(-2.72614225801306e-10f), _mm512_set1_ps(2.77068142495902e-08f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-2.10102402082508e-06f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-5.69250639462346e-05f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-7.34990630326855e-04f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-2.95459980854025e-03f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-1.60960333262415e-02f));
  p = _mm512_mul_ps(x, p);
  __m512 q = _mm512_fmadd_ps(x2, _mm512_set1_ps(-1.45660718464996e-05f), _mm512_set1_ps(-2.13374055278905e-04f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(-1.68282697438203e-03f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(-7.37332916720468e-03f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(-1.42647390514189e-02f));
  return _mm512_div_ps(p, q);
}

// exp(a) for a <= 0 (here -x^2/2): Cody-Waite reduction by ln 2, Taylor degree 6, * 2^n
NPU_AMP_AVX512 inline __m512 ExpNeg16(__m512 a) {
  const __m512 x = _mm512_max_ps(a, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.f / 720.f), _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

NPU_AMP_AVX512 inline __m512 Cdf16(__m512 x) {
  const __m512 e = Erf16(_mm512_mul_ps(x, _mm512_set1_ps(kInvSqrt2)));
  return _mm512_mul_ps(_mm512_set1_ps(0.5f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

NPU_AMP_AVX512 void GeluAvx512(const uint16_t* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = Bf16Tail(n - i);
    const __m512 v = Bf16Load16(x + i, m);
    _mm256_mask_storeu_epi16(y + i, m, Bf16Round16(_mm512_mul_ps(v, Cdf16(v))));
  }
}

NPU_AMP_AVX512 void GeluGradAvx512(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = Bf16Tail(n - i);
    const __m512 v = Bf16Load16(x + i, m);
    const __m512 pdf = _mm512_mul_ps(_mm512_set1_ps(kInvSqrt2Pi),
                                     ExpNeg16(_mm512_mul_ps(_mm512_set1_ps(-0.5f), _mm512_mul_ps(v, v))));
    const __m512 g = _mm512_fmadd_ps(v, pdf, Cdf16(v));
    _mm256_mask_storeu_epi16(dx + i, m, Bf16Round16(_mm512_mul_ps(Bf16Load16(dy + i, m), g)));
  }
}
#endif  // NPU_AMP_X86

constexpr int64_t kGChunk = 16;

template <typename Fn>
void GeluParallel(OpKernelContext* ctx, int64_t n, int64_t cost_per_element, Fn fn) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  const int64_t chunks = (n + kGChunk - 1) / kGChunk;
  pool->ParallelFor(chunks, kGChunk * cost_per_element, [&](int64_t cb, int64_t ce) {
    const int64_t b = cb * kGChunk, e = std::min(n, ce * kGChunk);
    if (b < e) fn(b, e);
  });
}

template <typename T>
class GeluErfOp : public OpKernel {
 public:
  explicit GeluErfOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &y));
    const int64_t n = x.NumElements();
    if (n == 0) return;
    const T* xp = x.flat<T>().data();
    T* yp = y->flat<T>().data();
    if constexpr (std::is_same<T, float>::value) {
      GeluParallel(ctx, n, 40, [&](int64_t s, int64_t e) {
        for (int64_t i = s; i < e; ++i) yp[i] = GeluF(xp[i]);
      });
    } else {
      auto* x16 = reinterpret_cast<const uint16_t*>(xp);
      auto* y16 = reinterpret_cast<uint16_t*>(yp);
      const bool avx = Bf16UseAvx512();
      GeluParallel(ctx, n, 20, [&](int64_t s, int64_t e) {
#ifdef NPU_AMP_X86
        if (avx) return GeluAvx512(x16 + s, y16 + s, e - s);
#endif
        for (int64_t i = s; i < e; ++i) y16[i] = Bf16Round(GeluF(Bf16Widen(x16[i])));
      });
    }
  }
};

template <typename T>
class GeluErfGradOp : public OpKernel {
 public:
  explicit GeluErfGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, dy.shape() == x.shape(),
                InvalidArgument("GeluErfGrad: dy and x must have equal shapes, got ", dy.shape().DebugString(),
                                " and ", x.shape().DebugString()));
    Tensor* dx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0, 1}, 0, x.shape(), &dx));
    const int64_t n = x.NumElements();
    if (n == 0) return;
    const T* dyp = dy.flat<T>().data();
    const T* xp = x.flat<T>().data();
    T* dxp = dx->flat<T>().data();
    if constexpr (std::is_same<T, float>::value) {
      GeluParallel(ctx, n, 60, [&](int64_t s, int64_t e) {
        for (int64_t i = s; i < e; ++i) dxp[i] = GeluGradF(dyp[i], xp[i]);
      });
    } else {
      auto* dy16 = reinterpret_cast<const uint16_t*>(dyp);
      auto* x16 = reinterpret_cast<const uint16_t*>(xp);
      auto* dx16 = reinterpret_cast<uint16_t*>(dxp);
      const bool avx = Bf16UseAvx512();
      GeluParallel(ctx, n, 30, [&](int64_t s, int64_t e) {
#ifdef NPU_AMP_X86
        if (avx) return GeluGradAvx512(dy16 + s, x16 + s, dx16 + s, e - s);
#endif
        for (int64_t i = s; i < e; ++i) dx16[i] = Bf16Round(GeluGradF(Bf16Widen(dy16[i]), Bf16Widen(x16[i])));
      });
    }
  }
};

#define REGISTER(T)                                                                           \
  REGISTER_KERNEL_BUILDER(Name("GeluErf").Device(DEVICE_CPU).TypeConstraint<T>("T"),          \
                          GeluErfOp<T>);                                                      \
  REGISTER_KERNEL_BUILDER(Name("GeluErfGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
                          GeluErfGradOp<T>);
REGISTER(float);
REGISTER(bfloat16);
#undef REGISTER

}  // namespace
}  // namespace npu_amp_tf
