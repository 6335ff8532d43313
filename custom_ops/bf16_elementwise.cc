// BF16 elementwise kernels for the residual units of CNN training graphs
// (issue 18): TF's BF16 Eigen kernels convert element by element and run
// slower than its FP32 ones; these load 16 BF16 values, widen them to FP32
// (a shift), compute in FP32 and round back to BF16 with round-to-nearest-even
// exactly as TF's bfloat16 conversion does (Eigen's float_to_bfloat16_rtne:
// add 0x7fff + lsb, keep the high half; a NaN becomes 0x7fc0), so every
// output equals TF's "compute in FP32, round once" bit for bit.  Emitted by
// the fusion rules in graph_passes/fusion/bf16_elementwise.py.
//
//   AddRelu(a, b)                 y  = relu(a + b)             (Relu(AddV2(a, b)))
//   AddNReluGrad(a, b, features)  dx = (a + b) * (features > 0) (ReluGrad(AddN(a, b), features))
//   BatchNormGradNHWC(dy, x, scale, mean, variance[, relu_y])
//       the training batch-norm gradient over N, H, W (FusedBatchNormGradV3,
//       is_training, NHWC), optionally with the ReluGrad before it fused:
//       dy := dy * (relu_y > 0).  Per channel c, n = N*H*W rows,
//         r = rsqrt(var + eps), xh = (x - mean) * r,
//         doffset = sum dy,  dscale = sum dy * xh,
//         dx = scale * r * (dy - doffset / n - xh * dscale / n)
//       in FP32 (sums in fixed row blocks: deterministic), dx rounded to T.
//
// T is bfloat16 or float (the float kernels are the plain loops: the precision
// pass may leave a fused op FP32).  Elementwise inputs must have equal shapes
// (no broadcasting).  The AVX-512 path (avx512f + avx512bw + avx512vl, chosen
// at run time) and the portable loop give identical results; setting the
// environment variable NPU_AMP_TF_BF16_PORTABLE=1 before the first call forces
// the portable loop (tests compare both).
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
#include "norm_common.h"

// No contraction of a*b + c into an FMA: the AVX-512 loops (whose target has FMA) and the
// portable loop (whose target may not) must round the same way, so that both give
// identical bits (the tests compare them).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define NPU_AMP_X86 1
#endif

namespace npu_amp_tf {
namespace {

using ::tensorflow::bfloat16;

// ------------------------------------------------------------------ ops
REGISTER_OP("AddRelu")
    .Input("a: T")
    .Input("b: T")
    .Output("y: T")
    .Attr("T: {bfloat16, float}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle s;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &s));
      c->set_output(0, s);
      return ::tensorflow::OkStatus();
    })
    .Doc("relu(a + b) in one pass (FP32 arithmetic, one rounding); a and b of equal shape.");

REGISTER_OP("AddNReluGrad")
    .Input("a: T")
    .Input("b: T")
    .Input("features: T")
    .Output("backprops: T")
    .Attr("T: {bfloat16, float}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle s;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &s));
      TF_RETURN_IF_ERROR(c->Merge(s, c->input(2), &s));
      c->set_output(0, s);
      return ::tensorflow::OkStatus();
    })
    .Doc("ReluGrad(a + b, features) = (a + b) * (features > 0) in one pass; equal shapes.");

REGISTER_OP("BatchNormGradNHWC")
    .Input("dy: T")
    .Input("x: T")
    .Input("scale: float")
    .Input("mean: float")
    .Input("variance: float")
    .Input("relu_y: num_relu * T")
    .Output("dx: T")
    .Output("dscale: float")
    .Output("doffset: float")
    .Attr("T: {bfloat16, float}")
    .Attr("epsilon: float = 0.0001")
    .Attr("num_relu: int >= 0 = 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle s;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 4, &s));
      TF_RETURN_IF_ERROR(c->Merge(s, c->input(0), &s));
      c->set_output(0, s);
      c->set_output(1, c->Vector(c->Dim(s, 3)));
      c->set_output(2, c->Vector(c->Dim(s, 3)));
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
Training batch-norm gradient, NHWC, statistics over N, H, W (FusedBatchNormGradV3
with is_training=True; mean and variance are its reserve_space_1/2: the batch
mean and the biased batch variance).  With num_relu=1, dy is first multiplied by
(relu_y > 0) (the ReluGrad of a Relu after the batch norm).  FP32 arithmetic.
)doc");

// ------------------------------------------------------------------ scalar helpers
inline float Widen(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// TF's float -> bfloat16 rounding as its vectorised Eigen kernels do it (F32ToBf16):
// round to nearest even on the bit pattern (denormals too), any NaN -> 0x7fc0
// (measured: TF's BF16 ReluGrad of inf * 0 gives 0x7fc0, not x86's default 0xffc0).
inline uint16_t Round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// relu as TF's Eigen cwiseMax(x, 0): x < 0 ? 0 : x (NaN and -0 pass through)
inline float ReluF(float v) { return v < 0.f ? 0.f : v; }

bool UseAvx512() {
  static const bool use = [] {
    const char* env = std::getenv("NPU_AMP_TF_BF16_PORTABLE");
    if (env != nullptr && env[0] != '\0' && env[0] != '0') return false;
#ifdef NPU_AMP_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return false;
#endif
  }();
  return use;
}

// ------------------------------------------------------------------ portable loops
void AddReluPortable(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    // round first, then relu: relu(round(s)) (TF rounds AddV2's result, Relu reads it)
    y[i] = Round(ReluF(Widen(Round(Widen(a[i]) + Widen(b[i])))));
  }
}

void AddNReluGradPortable(const uint16_t* a, const uint16_t* b, const uint16_t* f, uint16_t* y,
                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = Widen(Round(Widen(a[i]) + Widen(b[i])));
    y[i] = Round(g * (Widen(f[i]) > 0.f ? 1.f : 0.f));
  }
}

// ------------------------------------------------------------------ AVX-512 loops
#ifdef NPU_AMP_X86
#define NPU_AMP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

NPU_AMP_AVX512 inline __m512 Load16(const uint16_t* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

NPU_AMP_AVX512 inline __m512 Load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 floats -> 16 bf16 bit patterns, exactly as Round()
NPU_AMP_AVX512 inline __m256i Round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  __m512i t = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  t = _mm512_add_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(0x7fff)), u);
  t = _mm512_srli_epi32(t, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  t = _mm512_mask_blend_epi32(nan, t, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(t);
}

NPU_AMP_AVX512 inline __m512 Relu16(__m512 v) {
  // v < 0 ? 0 : v
  const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(neg, v, _mm512_setzero_ps());
}

NPU_AMP_AVX512 inline __m512 Widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

NPU_AMP_AVX512 void AddReluAvx512(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i s = Round16(_mm512_add_ps(Load16(a + i), Load16(b + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), Round16(Relu16(Widen16(s))));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m256i s = Round16(_mm512_add_ps(Load16(a + i, m), Load16(b + i, m)));
    _mm256_mask_storeu_epi16(y + i, m, Round16(Relu16(Widen16(s))));
  }
}

NPU_AMP_AVX512 inline __m512 MaskPos(__m512 g, __m512 f) {
  // g * (f > 0 ? 1 : 0), as TF's ReluGrad (a negative g times 0 is -0, NaN stays NaN)
  const __mmask16 pos = _mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_mul_ps(g, _mm512_mask_blend_ps(pos, _mm512_setzero_ps(), _mm512_set1_ps(1.f)));
}

NPU_AMP_AVX512 void AddNReluGradAvx512(const uint16_t* a, const uint16_t* b, const uint16_t* f,
                                       uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 g = Widen16(Round16(_mm512_add_ps(Load16(a + i), Load16(b + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), Round16(MaskPos(g, Load16(f + i))));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m512 g = Widen16(Round16(_mm512_add_ps(Load16(a + i, m), Load16(b + i, m))));
    _mm256_mask_storeu_epi16(y + i, m, Round16(MaskPos(g, Load16(f + i, m))));
  }
}
#endif  // NPU_AMP_X86

// ------------------------------------------------------------------ sharding
constexpr int64_t kChunk = 16;  // shards start at multiples of 16 elements

template <typename Fn>
void ParallelChunks(OpKernelContext* ctx, int64_t n, int64_t cost_per_element, Fn fn) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  pool->ParallelFor(chunks, /*cost_per_unit=*/kChunk * cost_per_element,
                    [&](int64_t cb, int64_t ce) {
                      const int64_t b = cb * kChunk, e = std::min(n, ce * kChunk);
                      if (b < e) fn(b, e);
                    });
}

Status SameShapes(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = *ts.begin();
  for (const Tensor* t : ts) {
    if (t->shape() != first->shape()) {
      return InvalidArgument(op, ": inputs must have equal shapes (no broadcasting), got ",
                             first->shape().DebugString(), " and ", t->shape().DebugString());
    }
  }
  return ::tensorflow::OkStatus();
}

template <typename T>
class AddReluOp : public OpKernel {
 public:
  explicit AddReluOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& a = ctx->input(0);
    const Tensor& b = ctx->input(1);
    OP_REQUIRES_OK(ctx, SameShapes("AddRelu", {&a, &b}));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0, 1}, 0, a.shape(), &y));
    const int64_t n = a.NumElements();
    if (n == 0) return;
    const T* ap = a.flat<T>().data();
    const T* bp = b.flat<T>().data();
    T* yp = y->flat<T>().data();
    if constexpr (std::is_same<T, float>::value) {
      ParallelChunks(ctx, n, 2, [&](int64_t s, int64_t e) {
        for (int64_t i = s; i < e; ++i) yp[i] = ReluF(ap[i] + bp[i]);
      });
    } else {
      auto* a16 = reinterpret_cast<const uint16_t*>(ap);
      auto* b16 = reinterpret_cast<const uint16_t*>(bp);
      auto* y16 = reinterpret_cast<uint16_t*>(yp);
      const bool avx = UseAvx512();
      ParallelChunks(ctx, n, 2, [&](int64_t s, int64_t e) {
#ifdef NPU_AMP_X86
        if (avx) return AddReluAvx512(a16 + s, b16 + s, y16 + s, e - s);
#endif
        AddReluPortable(a16 + s, b16 + s, y16 + s, e - s);
      });
    }
  }
};

template <typename T>
class AddNReluGradOp : public OpKernel {
 public:
  explicit AddNReluGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& a = ctx->input(0);
    const Tensor& b = ctx->input(1);
    const Tensor& f = ctx->input(2);
    OP_REQUIRES_OK(ctx, SameShapes("AddNReluGrad", {&a, &b, &f}));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0, 1}, 0, a.shape(), &y));
    const int64_t n = a.NumElements();
    if (n == 0) return;
    const T* ap = a.flat<T>().data();
    const T* bp = b.flat<T>().data();
    const T* fp = f.flat<T>().data();
    T* yp = y->flat<T>().data();
    if constexpr (std::is_same<T, float>::value) {
      ParallelChunks(ctx, n, 2, [&](int64_t s, int64_t e) {
        for (int64_t i = s; i < e; ++i) yp[i] = (ap[i] + bp[i]) * (fp[i] > 0.f ? 1.f : 0.f);
      });
    } else {
      auto* a16 = reinterpret_cast<const uint16_t*>(ap);
      auto* b16 = reinterpret_cast<const uint16_t*>(bp);
      auto* f16 = reinterpret_cast<const uint16_t*>(fp);
      auto* y16 = reinterpret_cast<uint16_t*>(yp);
      const bool avx = UseAvx512();
      ParallelChunks(ctx, n, 3, [&](int64_t s, int64_t e) {
#ifdef NPU_AMP_X86
        if (avx) return AddNReluGradAvx512(a16 + s, b16 + s, f16 + s, y16 + s, e - s);
#endif
        AddNReluGradPortable(a16 + s, b16 + s, f16 + s, y16 + s, e - s);
      });
    }
  }
};

// ------------------------------------------------------------------ batch-norm gradient
// One row (C channels) of pass 1: sdy[c] += dy, sdx[c] += dy * (x - mean)
inline float LoadF(const float* p, int64_t i) { return p[i]; }
inline float LoadF(const bfloat16* p, int64_t i) {
  return Widen(reinterpret_cast<const uint16_t*>(p)[i]);
}
inline void StoreF(float* p, int64_t i, float v) { p[i] = v; }
inline void StoreF(bfloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = Round(v); }

template <typename T>
void BnSumsPortable(const T* dy, const T* x, const T* relu, const float* mean, int64_t rb, int64_t re,
                    int64_t c, float* sdy, float* sdx) {
  for (int64_t r = rb; r < re; ++r) {
    const int64_t o = r * c;
    for (int64_t k = 0; k < c; ++k) {
      float g = LoadF(dy, o + k);
      if (relu != nullptr) g *= (LoadF(relu, o + k) > 0.f ? 1.f : 0.f);
      sdy[k] += g;
      sdx[k] += g * (LoadF(x, o + k) - mean[k]);
    }
  }
}

// dx = a[c] * dy + b[c] * (x - mean[c]) + d[c]:  a = scale*r, b = -scale*r^3*sdx/n,
// d = -scale*r*sdy/n
template <typename T>
void BnDxPortable(const T* dy, const T* x, const T* relu, const float* mean, const float* ka,
                  const float* kb, const float* kd, int64_t rb, int64_t re, int64_t c, T* dx) {
  for (int64_t r = rb; r < re; ++r) {
    const int64_t o = r * c;
    for (int64_t k = 0; k < c; ++k) {
      float g = LoadF(dy, o + k);
      if (relu != nullptr) g *= (LoadF(relu, o + k) > 0.f ? 1.f : 0.f);
      StoreF(dx, o + k, ka[k] * g + kb[k] * (LoadF(x, o + k) - mean[k]) + kd[k]);
    }
  }
}

#ifdef NPU_AMP_X86
// bf16, c % 16 == 0
NPU_AMP_AVX512 void BnSumsAvx512(const uint16_t* dy, const uint16_t* x, const uint16_t* relu,
                                 const float* mean, int64_t rb, int64_t re, int64_t c, float* sdy,
                                 float* sdx) {
  for (int64_t r = rb; r < re; ++r) {
    for (int64_t k = 0; k < c; k += 16) {
      const int64_t o = r * c + k;
      __m512 g = Load16(dy + o);
      if (relu != nullptr) g = MaskPos(g, Load16(relu + o));
      _mm512_storeu_ps(sdy + k, _mm512_add_ps(_mm512_loadu_ps(sdy + k), g));
      // mul then add (no FMA): the same roundings as the portable loop
      _mm512_storeu_ps(sdx + k, _mm512_add_ps(_mm512_loadu_ps(sdx + k),
                                              _mm512_mul_ps(g, _mm512_sub_ps(Load16(x + o), _mm512_loadu_ps(mean + k)))));
    }
  }
}

NPU_AMP_AVX512 void BnDxAvx512(const uint16_t* dy, const uint16_t* x, const uint16_t* relu,
                               const float* mean, const float* ka, const float* kb, const float* kd,
                               int64_t rb, int64_t re, int64_t c, uint16_t* dx) {
  for (int64_t r = rb; r < re; ++r) {
    for (int64_t k = 0; k < c; k += 16) {
      const int64_t o = r * c + k;
      __m512 g = Load16(dy + o);
      if (relu != nullptr) g = MaskPos(g, Load16(relu + o));
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(ka + k), g);
      v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_loadu_ps(kb + k),
                                         _mm512_sub_ps(Load16(x + o), _mm512_loadu_ps(mean + k))));
      v = _mm512_add_ps(v, _mm512_loadu_ps(kd + k));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dx + o), Round16(v));
    }
  }
}
#endif

template <typename T>
class BatchNormGradNHWCOp : public OpKernel {
 public:
  explicit BatchNormGradNHWCOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &eps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_relu", &num_relu_));
    OP_REQUIRES(ctx, num_relu_ <= 1, InvalidArgument("BatchNormGradNHWC: num_relu must be 0 or 1"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& scale = ctx->input(2);
    const Tensor& mean = ctx->input(3);
    const Tensor& var = ctx->input(4);
    OP_REQUIRES(ctx, x.dims() == 4,
                InvalidArgument("BatchNormGradNHWC: x must be rank 4, got ", x.shape().DebugString()));
    const Tensor* relu = num_relu_ ? &ctx->input(5) : nullptr;
    OP_REQUIRES_OK(ctx, relu ? SameShapes("BatchNormGradNHWC", {&x, &dy, relu})
                             : SameShapes("BatchNormGradNHWC", {&x, &dy}));
    const int64_t c = x.dim_size(3);
    const int64_t n = c ? x.NumElements() / c : 0;
    for (const Tensor* t : {&scale, &mean, &var}) {
      OP_REQUIRES(ctx, t->NumElements() == c,
                  InvalidArgument("BatchNormGradNHWC: scale, mean and variance must have ", c,
                                  " elements, got ", t->shape().DebugString()));
    }
    Tensor *dx = nullptr, *ds = nullptr, *db = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({c}), &ds));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({c}), &db));
    float* dsp = ds->flat<float>().data();
    float* dbp = db->flat<float>().data();
    if (c == 0) return;
    if (n == 0) {
      std::fill(dsp, dsp + c, 0.f);
      std::fill(dbp, dbp + c, 0.f);
      return;
    }
    const T* dyp = dy.flat<T>().data();
    const T* xp = x.flat<T>().data();
    const T* rp = relu ? relu->flat<T>().data() : nullptr;
    const float* mp = mean.flat<float>().data();
    const float* vp = var.flat<float>().data();
    const float* sp = scale.flat<float>().data();
    const bool avx = std::is_same<T, bfloat16>::value && c % 16 == 0 && UseAvx512();

    ColumnSums<2> sums(ctx, n, c);
    sums.Run(/*cost_per_element=*/4, [&](int64_t rb, int64_t re, const std::array<float*, 2>& part) {
#ifdef NPU_AMP_X86
      if constexpr (std::is_same<T, bfloat16>::value) {
        if (avx) {
          return BnSumsAvx512(reinterpret_cast<const uint16_t*>(dyp), reinterpret_cast<const uint16_t*>(xp),
                              reinterpret_cast<const uint16_t*>(rp), mp, rb, re, c, part[1], part[0]);
        }
      }
#endif
      BnSumsPortable<T>(dyp, xp, rp, mp, rb, re, c, part[1], part[0]);
    });
    sums.Store(0, dsp);  // sum dy * (x - mean): dscale before the factor r
    sums.Store(1, dbp);  // sum dy = doffset
    std::vector<float> ka(c), kb(c), kd(c);
    const float inv_n = 1.0f / static_cast<float>(n);
    for (int64_t k = 0; k < c; ++k) {
      const float r = 1.0f / std::sqrt(vp[k] + eps_);
      const float sdx = dsp[k];
      dsp[k] = sdx * r;
      ka[k] = sp[k] * r;
      kb[k] = -sp[k] * r * r * r * sdx * inv_n;
      kd[k] = -sp[k] * r * dbp[k] * inv_n;
    }
    T* dxp = dx->flat<T>().data();
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    pool->ParallelFor(n, /*cost_per_unit=*/c * 3, [&](int64_t rb, int64_t re) {
#ifdef NPU_AMP_X86
      if constexpr (std::is_same<T, bfloat16>::value) {
        if (avx) {
          return BnDxAvx512(reinterpret_cast<const uint16_t*>(dyp), reinterpret_cast<const uint16_t*>(xp),
                            reinterpret_cast<const uint16_t*>(rp), mp, ka.data(), kb.data(), kd.data(), rb,
                            re, c, reinterpret_cast<uint16_t*>(dxp));
        }
      }
#endif
      BnDxPortable<T>(dyp, xp, rp, mp, ka.data(), kb.data(), kd.data(), rb, re, c, dxp);
    });
  }

 private:
  float eps_;
  int num_relu_;
};

#define REGISTER(T)                                                                             \
  REGISTER_KERNEL_BUILDER(Name("AddRelu").Device(DEVICE_CPU).TypeConstraint<T>("T"),            \
                          AddReluOp<T>);                                                        \
  REGISTER_KERNEL_BUILDER(Name("AddNReluGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),       \
                          AddNReluGradOp<T>);                                                   \
  REGISTER_KERNEL_BUILDER(Name("BatchNormGradNHWC").Device(DEVICE_CPU).TypeConstraint<T>("T"),  \
                          BatchNormGradNHWCOp<T>);
REGISTER(float);
REGISTER(bfloat16);
#undef REGISTER

}  // namespace
}  // namespace npu_amp_tf
