// ScaleMaskSoftmax: softmax(scores * scale + mask) over the last axis, one pass.
// Emitted by the fusion pass at graph_level 3 (rule "attention") between the
// two attention matmuls, which stay TF's own BatchMatMul / Einsum: on CPU they
// are oneDNN GEMMs, faster than any hand-written product here (FusedAttention,
// measured in benchmarks/fusion.py).  This op replaces Mul/RealDiv + AddV2 (or
// SelectV2 with a boolean mask) + Softmax, i.e. three passes over the score
// tensor, by one.
//
//   scores [B..., S, T]      float, half or bfloat16 (arithmetic in fp32)
//   mask   (0 or 1 tensors)  same dtype, broadcastable to scores, added
//   out    [B..., S, T]      in the scores dtype
//
// ScaleMaskSoftmaxGrad(dprobs, probs; scale) -> dscores, its gradient with
// respect to the scores (the mask's gradient is dscores / scale, summed over
// the mask's broadcast dims; the fusion pass keeps the graph's own ops where a
// mask needs one):
//
//   dscores = scale * (dprobs - sum(dprobs * probs, last axis)) * probs
//
// one pass per row, the dot product and arithmetic in fp32.  Registered as the
// gradient of ScaleMaskSoftmax (npu_amp_tf/fused_ops.py) and emitted by the
// attention fusion in training graphs in place of the softmax / scale / mask
// backward ops autodiff built.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "op_common.h"
#include "bf16_simd.h"

namespace npu_amp_tf {
namespace {

REGISTER_OP("ScaleMaskSoftmax")
    .Input("scores: T")
    .Input("mask: num_masks * T")
    .Output("probs: T")
    .Attr("T: {half, bfloat16, float}")
    .Attr("num_masks: int >= 0 = 0")
    .Attr("scale: float = 1.0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return ::tensorflow::OkStatus();
    })
    .Doc("softmax(scores * scale + mask) over the last axis; fp32 arithmetic.");

REGISTER_OP("ScaleMaskSoftmaxGrad")
    .Input("dprobs: T")
    .Input("probs: T")
    .Output("dscores: T")
    .Attr("T: {half, bfloat16, float}")
    .Attr("scale: float = 1.0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &out));
      c->set_output(0, out);
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
Gradient of ScaleMaskSoftmax with respect to its scores:
scale * (dprobs - sum(dprobs * probs, last axis)) * probs, fp32 arithmetic.
)doc");

// One row, in place: z <- exp(z - max(z)) / sum.  The file is built with TF's
// flags (no -mavx), so Eigen would use SSE; this AVX2/FMA version (exp by a
// degree-6 polynomial on the reduced argument, 2^n by exponent arithmetic,
// ~1 ulp) is chosen at run time when the CPU has it.
void SoftmaxRowBase(float* z, int64_t n) {
  Eigen::Map<Eigen::ArrayXf> a(z, n);
  const float mx = a.maxCoeff();
  a = (a - mx).exp();
  a *= 1.0f / a.sum();
}

#ifdef NPU_AMP_X86
__attribute__((target("avx2,fma"))) static inline __m256 Exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  x = _mm256_max_ps(x, lo);
  const __m256 l2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, l2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - fx * ln2 (Cody-Waite split)
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Horizontal max / sum of the 8 lanes, in lane order (as the scalar loops did).
__attribute__((target("avx2,fma"))) static inline float HMax8(__m256 v) {
  float buf[8];
  _mm256_storeu_ps(buf, v);
  float r = -INFINITY;
  for (float b : buf) r = std::max(r, b);
  return r;
}

__attribute__((target("avx2,fma"))) static inline float HSum8(__m256 v) {
  float buf[8];
  _mm256_storeu_ps(buf, v);
  float r = 0.f;
  for (float b : buf) r += b;
  return r;
}

// The shared tail of both AVX2 rows: z <- exp(z - mx) / sum, given the row's max.
__attribute__((target("avx2,fma"))) static void ExpNormaliseRowAvx2(float* z, int64_t n, float mx) {
  if (!std::isfinite(mx)) {  // -inf everywhere or NaN/inf: the exact reference path
    SoftmaxRowBase(z, n);
    return;
  }
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 ex = Exp8(_mm256_sub_ps(_mm256_loadu_ps(z + i), vm));
    _mm256_storeu_ps(z + i, ex);
    vsum = _mm256_add_ps(vsum, ex);
  }
  float sum = HSum8(vsum);
  for (; i < n; ++i) {
    z[i] = std::exp(z[i] - mx);
    sum += z[i];
  }
  const float invs = 1.0f / sum;
  const __m256 inv = _mm256_set1_ps(invs);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(z + i, _mm256_mul_ps(_mm256_loadu_ps(z + i), inv));
  for (; i < n; ++i) z[i] *= invs;
}

__attribute__((target("avx2,fma"))) void SoftmaxRowAvx2(float* z, int64_t n) {
  int64_t i = 0;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(z + i));
  float mx = HMax8(vmax);
  for (; i < n; ++i) mx = std::max(mx, z[i]);
  ExpNormaliseRowAvx2(z, n, mx);
}
#endif

#ifdef NPU_AMP_X86
// fp32 rows with a contiguous (or no) mask row: z = in * scale + mask and its max
// in one pass, then exp/sum, then the normalisation (3 passes over the row
// instead of the generic path's 5).
__attribute__((target("avx2,fma"))) void ScaleMaskSoftmaxRowAvx2(const float* in, const float* m, float* z,
                                                                  int64_t n, float scale) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  if (m != nullptr) {
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(in + i), vs, _mm256_loadu_ps(m + i));
      _mm256_storeu_ps(z + i, v);
      vmax = _mm256_max_ps(vmax, v);
    }
  } else {
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(in + i), vs);
      _mm256_storeu_ps(z + i, v);
      vmax = _mm256_max_ps(vmax, v);
    }
  }
  float mx = HMax8(vmax);
  for (; i < n; ++i) {
    z[i] = in[i] * scale + (m != nullptr ? m[i] : 0.f);
    mx = std::max(mx, z[i]);
  }
  ExpNormaliseRowAvx2(z, n, mx);
}
#endif

#ifdef NPU_AMP_X86
// The AVX2/FMA rows are picked once per kernel, at run time.
bool HasAvx2Fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

using RowFn = void (*)(float*, int64_t);
using FusedRowFn = void (*)(const float*, const float*, float*, int64_t, float);

FusedRowFn PickFusedRow() {
#ifdef NPU_AMP_X86
  if (HasAvx2Fma()) return &ScaleMaskSoftmaxRowAvx2;
#endif
  return nullptr;
}

RowFn PickRow() {
#ifdef NPU_AMP_X86
  if (HasAvx2Fma()) return &SoftmaxRowAvx2;
#endif
  return &SoftmaxRowBase;
}


// ------------------------------------------------------------------ BF16 rows (18g)
// bfloat16 rows widened to / rounded from fp32 16 at a time (AVX-512, chosen at run time): the
// element-by-element static_cast of the generic path cost more than the softmax arithmetic.
// Rounding is round-to-nearest-even on the bit pattern, as Eigen's float -> bfloat16 (a NaN
// becomes 0x7fc0).  NPU_AMP_TF_BF16_PORTABLE=1 before the first call keeps the scalar loops.

#ifdef NPU_AMP_X86
// z = widen(in) * scale
NPU_AMP_AVX512 void WidenScaleRowAvx512(const uint16_t* in, float* z, int64_t n, float scale) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = Bf16Tail(n - i);
    _mm512_mask_storeu_ps(z + i, m, _mm512_mul_ps(Bf16Load16(in + i, m), vs));
  }
}
NPU_AMP_AVX512 void RoundRowAvx512(const float* z, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = Bf16Tail(n - i);
    _mm256_mask_storeu_epi16(out + i, m, Bf16Round16(_mm512_maskz_loadu_ps(m, z + i)));
  }
}
// out = (dp - sum(dp * p)) * (scale * p), straight from and to bfloat16 (two passes over the row)
NPU_AMP_AVX512 void SoftmaxGradRowBf16Avx512(const uint16_t* dp, const uint16_t* p, uint16_t* out,
                                                int64_t n, float scale) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = Bf16Tail(n - i);
    acc = _mm512_fmadd_ps(Bf16Load16(dp + i, m), Bf16Load16(p + i, m), acc);
  }
  const __m512 vd = _mm512_set1_ps(_mm512_reduce_add_ps(acc)), vs = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = Bf16Tail(n - i);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(Bf16Load16(dp + i, m), vd), _mm512_mul_ps(Bf16Load16(p + i, m), vs));
    _mm256_mask_storeu_epi16(out + i, m, Bf16Round16(r));
  }
}
#endif

template <typename T>
class ScaleMaskSoftmaxOp : public OpKernel {
 public:
  explicit ScaleMaskSoftmaxOp(OpKernelConstruction* ctx)
      : OpKernel(ctx), row_fn_(PickRow()), fused_fn_(PickFusedRow()) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& s = ctx->input(0);
    OpInputList masks;
    OP_REQUIRES_OK(ctx, ctx->input_list("mask", &masks));
    OP_REQUIRES(ctx, masks.size() <= 1, InvalidArgument("ScaleMaskSoftmax: at most one mask"));
    const int r = s.dims();
    OP_REQUIRES(ctx, r >= 1, InvalidArgument("ScaleMaskSoftmax: scores must have rank >= 1"));
    const int64_t NC = s.dim_size(r - 1);
    const int64_t rows = NC == 0 ? 0 : s.NumElements() / NC;
    // mask broadcasting: stride of each scores dim in the mask (0 where broadcast)
    std::vector<int64_t> dims(r), mstride(r, 0);
    for (int i = 0; i < r; ++i) dims[i] = s.dim_size(i);
    const T* mp = nullptr;
    if (masks.size() == 1) {
      const Tensor& m = masks[0];
      OP_REQUIRES(ctx, m.dims() <= r, InvalidArgument("ScaleMaskSoftmax: mask rank ", m.dims(), " > ", r));
      std::vector<int64_t> md(r, 1);
      for (int i = 0; i < m.dims(); ++i) md[r - m.dims() + i] = m.dim_size(i);
      int64_t st = 1;
      for (int i = r - 1; i >= 0; --i) {
        OP_REQUIRES(ctx, md[i] == 1 || md[i] == dims[i],
                    InvalidArgument("ScaleMaskSoftmax: mask ", m.shape().DebugString(),
                                    " does not broadcast to ", s.shape().DebugString()));
        mstride[i] = md[i] == 1 ? 0 : st;
        st *= md[i];
      }
      mp = m.flat<T>().data();
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, s.shape(), &out));
    if (rows == 0) return;
    const T* sp = s.flat<T>().data();
    T* op = out->flat<T>().data();
    const float scale = scale_;
    const int64_t col_stride = mstride[r - 1];
    RowFn row_fn = row_fn_;
    FusedRowFn fused_fn = fused_fn_;
    const bool avx512 = Bf16UseAvx512();
    (void)avx512;
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same<T, float>::value ? 0 : NC);
      for (int64_t row = begin; row < end; ++row) {
        const T* in = sp + row * NC;
        if constexpr (std::is_same<T, float>::value) {
          if (fused_fn != nullptr && (mp == nullptr || col_stride == 1)) {
            const float* mrow = nullptr;
            if (mp != nullptr) {
              int64_t rem = row, off = 0;
              for (int i = r - 2; i >= 0; --i) {
                off += (rem % dims[i]) * mstride[i];
                rem /= dims[i];
              }
              mrow = mp + off;
            }
            fused_fn(in, mrow, op + row * NC, NC, scale);
            continue;
          }
        }
        float* zp;  // fp32 works in the output row itself
        if constexpr (std::is_same<T, float>::value) {
          zp = op + row * NC;
        } else {
          zp = buf.data();
        }
        Eigen::Map<Eigen::ArrayXf> z(zp, NC);
        if constexpr (std::is_same<T, float>::value) {
          z = Eigen::Map<const Eigen::ArrayXf>(in, NC) * scale;
        } else {
#ifdef NPU_AMP_X86
          if (std::is_same<T, Eigen::bfloat16>::value && avx512) {
            WidenScaleRowAvx512(reinterpret_cast<const uint16_t*>(in), zp, NC, scale);
          } else
#endif
          for (int64_t j = 0; j < NC; ++j) zp[j] = static_cast<float>(in[j]) * scale;
        }
        if (mp != nullptr) {
          int64_t rem = row, off = 0;
          for (int i = r - 2; i >= 0; --i) {
            off += (rem % dims[i]) * mstride[i];
            rem /= dims[i];
          }
          const T* mrow = mp + off;
          if constexpr (std::is_same<T, float>::value) {
            if (col_stride == 1) {
              z += Eigen::Map<const Eigen::ArrayXf>(mrow, NC);
            } else {
              z += mrow[0];
            }
          } else {
            for (int64_t j = 0; j < NC; ++j) zp[j] += static_cast<float>(mrow[j * col_stride]);
          }
        }
        row_fn(zp, NC);
        if constexpr (!std::is_same<T, float>::value) {
#ifdef NPU_AMP_X86
          if (std::is_same<T, Eigen::bfloat16>::value && avx512) {
            RoundRowAvx512(zp, reinterpret_cast<uint16_t*>(op + row * NC), NC);
            continue;
          }
#endif
          for (int64_t j = 0; j < NC; ++j) op[row * NC + j] = static_cast<T>(zp[j]);
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    pool->ParallelFor(rows, /*cost_per_unit=*/NC * 30, work);
  }

 private:
  float scale_;
  RowFn row_fn_;
  FusedRowFn fused_fn_;
};

// ------------------------------------------------------------------ gradient
// One row: out = (dp - sum(dp * p)) * (scale * p), everything fp32.
void SoftmaxGradRowBase(const float* dp, const float* p, float* out, int64_t n, float scale) {
  Eigen::Map<const Eigen::ArrayXf> a(dp, n), b(p, n);
  const float dot = (a * b).sum();
  Eigen::Map<Eigen::ArrayXf>(out, n) = (a - dot) * b * scale;
}

#ifdef NPU_AMP_X86
__attribute__((target("avx2,fma"))) void SoftmaxGradRowAvx2(const float* dp, const float* p, float* out,
                                                             int64_t n, float scale) {
  int64_t i = 0;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(dp + i), _mm256_loadu_ps(p + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(dp + i + 8), _mm256_loadu_ps(p + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(dp + i), _mm256_loadu_ps(p + i), acc0);
  float dot = HSum8(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) dot += dp[i] * p[i];
  const __m256 vd = _mm256_set1_ps(dot), vs = _mm256_set1_ps(scale);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 sp = _mm256_mul_ps(_mm256_loadu_ps(p + i), vs);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(dp + i), vd), sp));
  }
  for (; i < n; ++i) out[i] = (dp[i] - dot) * (p[i] * scale);
}
#endif

using GradRowFn = void (*)(const float*, const float*, float*, int64_t, float);

GradRowFn PickGradRow() {
#ifdef NPU_AMP_X86
  if (HasAvx2Fma()) return &SoftmaxGradRowAvx2;
#endif
  return &SoftmaxGradRowBase;
}

template <typename T>
class ScaleMaskSoftmaxGradOp : public OpKernel {
 public:
  explicit ScaleMaskSoftmaxGradOp(OpKernelConstruction* ctx) : OpKernel(ctx), row_fn_(PickGradRow()) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& y = ctx->input(1);
    OP_REQUIRES(ctx, dy.shape() == y.shape(),
                InvalidArgument("ScaleMaskSoftmaxGrad: dprobs ", dy.shape().DebugString(), " and probs ",
                                y.shape().DebugString(), " must have the same shape"));
    OP_REQUIRES(ctx, y.dims() >= 1, InvalidArgument("ScaleMaskSoftmaxGrad: probs must have rank >= 1"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, y.shape(), &out));
    const int64_t NC = y.dim_size(y.dims() - 1);
    const int64_t rows = NC == 0 ? 0 : y.NumElements() / NC;
    if (rows == 0) return;
    const T* dyp = dy.flat<T>().data();
    const T* yp = y.flat<T>().data();
    T* op = out->flat<T>().data();
    const float scale = scale_;
    GradRowFn row_fn = row_fn_;
    const bool avx512 = Bf16UseAvx512();
    (void)avx512;
    auto work = [&](int64_t begin, int64_t end) {
      constexpr bool kF32 = std::is_same<T, float>::value;
      std::vector<float> a(kF32 ? 0 : NC), b(kF32 ? 0 : NC), c(kF32 ? 0 : NC);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t off = row * NC;
        if constexpr (kF32) {
          row_fn(dyp + off, yp + off, op + off, NC, scale);
        } else {
#ifdef NPU_AMP_X86
          if (std::is_same<T, Eigen::bfloat16>::value && avx512) {
            SoftmaxGradRowBf16Avx512(reinterpret_cast<const uint16_t*>(dyp + off),
                                     reinterpret_cast<const uint16_t*>(yp + off),
                                     reinterpret_cast<uint16_t*>(op + off), NC, scale);
            continue;
          }
#endif
          for (int64_t j = 0; j < NC; ++j) a[j] = static_cast<float>(dyp[off + j]);
          for (int64_t j = 0; j < NC; ++j) b[j] = static_cast<float>(yp[off + j]);
          row_fn(a.data(), b.data(), c.data(), NC, scale);
          for (int64_t j = 0; j < NC; ++j) op[off + j] = static_cast<T>(c[j]);
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    pool->ParallelFor(rows, /*cost_per_unit=*/NC * 8, work);
  }

 private:
  float scale_;
  GradRowFn row_fn_;
};

#define REGISTER(T)                                                                        \
  REGISTER_KERNEL_BUILDER(Name("ScaleMaskSoftmax").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          ScaleMaskSoftmaxOp<T>);                                          \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("ScaleMaskSoftmaxGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),              \
      ScaleMaskSoftmaxGradOp<T>);
REGISTER(float);
REGISTER(Eigen::half);
REGISTER(Eigen::bfloat16);
#undef REGISTER

}  // namespace
}  // namespace npu_amp_tf
