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
//   JoinGradSum(grad, shape)      the gradient of one input of a batch-None join:
//                                 grad (forwarded) or its sum over a broadcast leading dim
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
// pass may leave a fused op FP32).  Elementwise inputs must have equal shapes;
// AddRelu's two may also differ in a leading dim of 1, broadcast as AddV2 does
// (the rule lets batch-None joins through; AddV2 broadcasts only that way there).  The AVX-512 path (avx512f + avx512bw + avx512vl, chosen
// at run time) and the portable loop give identical results; setting the
// environment variable NPU_AMP_TF_BF16_PORTABLE=1 before the first call forces
// the portable loop (tests compare both).
#define EIGEN_USE_THREADS

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "norm_common.h"
#include "bf16_simd.h"

// No contraction of a*b + c into an FMA: the AVX-512 loops (whose target has FMA) and the
// portable loop (whose target may not) must round the same way, so that both give
// identical bits (the tests compare them).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
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
      // AddV2's: the kernel broadcasts a leading dim of 1 (batch None in function graphs)
      return shape_inference::BroadcastBinaryOpOutputShapeFn(c, 0);
    })
    .Doc("relu(a + b) in one pass (FP32 arithmetic, one rounding); a and b of equal shape or "
         "differing only in a leading dim of 1 (broadcast as AddV2).");

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

REGISTER_OP("JoinGradSum")
    .Input("grad: T")
    .Input("shape: Tshape")
    .Output("y: T")
    .Attr("T: {bfloat16, float}")
    .Attr("Tshape: {int32, int64} = DT_INT32")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle s;
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(1, &s));
      c->set_output(0, s);
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
The gradient of one input of a batch-None residual join (AddV2's
Reshape(Sum(grad, BroadcastGradientArgs(..)[i], keep_dims), Shape(input))) where
the join's inputs are equal in every dim but the leading one: grad itself when
its shape is `shape` (no copy), else the sum over the leading dim where `shape`
has 1 there (FP32 accumulation, one rounding); any other shape: InvalidArgument.
)doc");

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

// relu as TF's Eigen cwiseMax(x, 0): x < 0 ? 0 : x (NaN and -0 pass through)
inline float ReluF(float v) { return v < 0.f ? 0.f : v; }


// ------------------------------------------------------------------ portable loops
void AddReluPortable(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    // round first, then relu: relu(round(s)) (TF rounds AddV2's result, Relu reads it)
    y[i] = Bf16Round(ReluF(Bf16Widen(Bf16Round(Bf16Widen(a[i]) + Bf16Widen(b[i])))));
  }
}

void AddNReluGradPortable(const uint16_t* a, const uint16_t* b, const uint16_t* f, uint16_t* y,
                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = Bf16Widen(Bf16Round(Bf16Widen(a[i]) + Bf16Widen(b[i])));
    y[i] = Bf16Round(g * (Bf16Widen(f[i]) > 0.f ? 1.f : 0.f));
  }
}

// ------------------------------------------------------------------ AVX-512 loops
#ifdef NPU_AMP_X86


NPU_AMP_AVX512 inline __m512 Relu16(__m512 v) {
  // v < 0 ? 0 : v
  const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(neg, v, _mm512_setzero_ps());
}


NPU_AMP_AVX512 void AddReluAvx512(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i s = Bf16Round16(_mm512_add_ps(Bf16Load16(a + i), Bf16Load16(b + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), Bf16Round16(Relu16(Bf16Widen16(s))));
  }
  if (i < n) {
    const __mmask16 m = Bf16Tail(n - i);
    __m256i s = Bf16Round16(_mm512_add_ps(Bf16Load16(a + i, m), Bf16Load16(b + i, m)));
    _mm256_mask_storeu_epi16(y + i, m, Bf16Round16(Relu16(Bf16Widen16(s))));
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
    __m512 g = Bf16Widen16(Bf16Round16(_mm512_add_ps(Bf16Load16(a + i), Bf16Load16(b + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), Bf16Round16(MaskPos(g, Bf16Load16(f + i))));
  }
  if (i < n) {
    const __mmask16 m = Bf16Tail(n - i);
    __m512 g = Bf16Widen16(Bf16Round16(_mm512_add_ps(Bf16Load16(a + i, m), Bf16Load16(b + i, m))));
    _mm256_mask_storeu_epi16(y + i, m, Bf16Round16(MaskPos(g, Bf16Load16(f + i, m))));
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

// The elementwise ops' common kernel: K inputs of one shape (``Fn::kLeadBroadcast``: inputs 0
// and 1 may also differ in a leading dim of 1, broadcast as AddV2 does; any other mismatch is
// InvalidArgument), output 0 forwarded from input 0 or 1 where that has the output's shape, else
// allocated; then, in shards of 16-element chunks, Fn's float loop (T = float) or its BF16 loops
// (AVX-512 when Bf16UseAvx512(), else portable) on uint16 bit patterns.  Fn provides kName, kIn,
// kCost, kLeadBroadcast, Float(in, i) and Bf16(avx, in, y, n) (in: K pointers already offset).
template <typename T, typename Fn>
class ElementwiseOp : public OpKernel {
 public:
  static constexpr int K = Fn::kIn;
  explicit ElementwiseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    std::array<const Tensor*, K> t;
    for (int k = 0; k < K; ++k) t[k] = &ctx->input(k);
    TensorShape out = t[0]->shape();
    // bcast[k]: input k repeats one row (its leading dim is 1, the output's is not)
    std::array<bool, K> bcast{};
    int64_t row = 0;
    bool same = true;
    for (int k = 1; k < K; ++k) same = same && t[k]->shape() == out;
    if (!same) {
      OP_REQUIRES(ctx, Fn::kLeadBroadcast && LeadBroadcast(*t[0], *t[1], &out),
                  InvalidArgument(Fn::kName, ": inputs must have equal shapes", Fn::kLeadBroadcast ?
                                  " or differ only in a leading dim of 1" : " (no broadcasting)", ", got ",
                                  t[0]->shape().DebugString(), " and ", t[1]->shape().DebugString()));
      for (int k = 0; k < 2; ++k) bcast[k] = t[k]->shape() != out;
      row = out.dim_size(0) ? out.num_elements() / out.dim_size(0) : 0;
    }
    std::vector<int> fwd;
    for (int k = 0; k < 2; ++k) {
      if (t[k]->shape() == out) fwd.push_back(k);
    }
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output(fwd, 0, out, &y));
    const int64_t n = out.num_elements();
    if (n == 0) return;
    std::array<const T*, K> base;
    for (int k = 0; k < K; ++k) base[k] = t[k]->template flat<T>().data();
    T* yp = y->flat<T>().data();
    const bool avx = Bf16UseAvx512();
    ParallelChunks(ctx, n, Fn::kCost, [&](int64_t s, int64_t e) {
      while (s < e) {
        // one piece per output row where an input is broadcast (its offset restarts each row)
        const int64_t pe = row ? std::min(e, (s / row + 1) * row) : e;
        std::array<const T*, K> in;
        for (int k = 0; k < K; ++k) in[k] = base[k] + (bcast[k] ? s % row : s);
        Run(avx, in, yp + s, pe - s);
        s = pe;
      }
    });
  }

 private:
  // a and b of one rank >= 1, equal in every dim but the leading one, where one of them is 1:
  // *out = the broadcast shape
  static bool LeadBroadcast(const Tensor& a, const Tensor& b, TensorShape* out) {
    if (a.dims() != b.dims() || a.dims() == 0) return false;
    for (int d = 1; d < a.dims(); ++d) {
      if (a.dim_size(d) != b.dim_size(d)) return false;
    }
    if (a.dim_size(0) != 1 && b.dim_size(0) != 1) return false;
    *out = a.dim_size(0) == 1 ? b.shape() : a.shape();
    return true;
  }

  static void Run(bool avx, const std::array<const T*, K>& in, T* y, int64_t n) {
    if constexpr (std::is_same<T, float>::value) {
      for (int64_t i = 0; i < n; ++i) y[i] = Fn::Float(in, i);
    } else {
      std::array<const uint16_t*, K> in16;
      for (int k = 0; k < K; ++k) in16[k] = reinterpret_cast<const uint16_t*>(in[k]);
      Fn::Bf16(avx, in16, reinterpret_cast<uint16_t*>(y), n);
    }
  }
};

struct AddReluFn {
  static constexpr const char* kName = "AddRelu";
  static constexpr int kIn = 2;
  static constexpr int64_t kCost = 2;
  static constexpr bool kLeadBroadcast = true;
  static float Float(const std::array<const float*, 2>& p, int64_t i) { return ReluF(p[0][i] + p[1][i]); }
  static void Bf16(bool avx, const std::array<const uint16_t*, 2>& p, uint16_t* y, int64_t n) {
#ifdef NPU_AMP_X86
    if (avx) return AddReluAvx512(p[0], p[1], y, n);
#endif
    AddReluPortable(p[0], p[1], y, n);
  }
};

struct AddNReluGradFn {
  static constexpr const char* kName = "AddNReluGrad";
  static constexpr int kIn = 3;
  static constexpr int64_t kCost = 3;
  static constexpr bool kLeadBroadcast = false;  // AddN and ReluGrad take equal shapes only
  static float Float(const std::array<const float*, 3>& p, int64_t i) {
    return (p[0][i] + p[1][i]) * (p[2][i] > 0.f ? 1.f : 0.f);
  }
  static void Bf16(bool avx, const std::array<const uint16_t*, 3>& p, uint16_t* y, int64_t n) {
#ifdef NPU_AMP_X86
    if (avx) return AddNReluGradAvx512(p[0], p[1], p[2], y, n);
#endif
    AddNReluGradPortable(p[0], p[1], p[2], y, n);
  }
};

// element i of a float / bfloat16 array as float, and back (bfloat16: TF's rounding)
inline float LoadF(const float* p, int64_t i) { return p[i]; }
inline float LoadF(const bfloat16* p, int64_t i) {
  return Bf16Widen(reinterpret_cast<const uint16_t*>(p)[i]);
}
inline void StoreF(float* p, int64_t i, float v) { p[i] = v; }
inline void StoreF(bfloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = Bf16Round(v); }

template <typename T, typename Tshape>
class JoinGradSumOp : public OpKernel {
 public:
  explicit JoinGradSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& st = ctx->input(1);
    OP_REQUIRES(ctx, st.dims() == 1, InvalidArgument("JoinGradSum: shape must be a vector, got ",
                                                     st.shape().DebugString()));
    TensorShape target;
    const auto sv = st.vec<Tshape>();
    for (int64_t d = 0; d < sv.size(); ++d) {
      OP_REQUIRES(ctx, sv(d) >= 0, InvalidArgument("JoinGradSum: negative dim in shape"));
      target.AddDim(static_cast<int64_t>(sv(d)));
    }
    if (target == g.shape()) {  // the join's inputs had equal shapes: nothing to sum
      ctx->set_output(0, g);
      return;
    }
    bool lead = g.dims() == target.dims() && g.dims() > 0 && target.dim_size(0) == 1;
    for (int d = 1; lead && d < g.dims(); ++d) lead = g.dim_size(d) == target.dim_size(d);
    OP_REQUIRES(ctx, lead, InvalidArgument("JoinGradSum: grad of shape ", g.shape().DebugString(),
                                           " is not ", target.DebugString(),
                                           " broadcast along a leading dim of 1"));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, target, &y));
    const int64_t row = target.num_elements(), rows = g.dim_size(0);
    std::vector<float> acc(row, 0.f);
    const T* gp = g.flat<T>().data();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < row; ++i) acc[i] += LoadF(gp, r * row + i);
    }
    T* yp = y->flat<T>().data();
    for (int64_t i = 0; i < row; ++i) StoreF(yp, i, acc[i]);
  }
};

// ------------------------------------------------------------------ batch-norm gradient
// One row (C channels) of pass 1: sdy[c] += dy, sdx[c] += dy * (x - mean)

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
      __m512 g = Bf16Load16(dy + o);
      if (relu != nullptr) g = MaskPos(g, Bf16Load16(relu + o));
      _mm512_storeu_ps(sdy + k, _mm512_add_ps(_mm512_loadu_ps(sdy + k), g));
      // mul then add (no FMA): the same roundings as the portable loop
      _mm512_storeu_ps(sdx + k, _mm512_add_ps(_mm512_loadu_ps(sdx + k),
                                              _mm512_mul_ps(g, _mm512_sub_ps(Bf16Load16(x + o), _mm512_loadu_ps(mean + k)))));
    }
  }
}

NPU_AMP_AVX512 void BnDxAvx512(const uint16_t* dy, const uint16_t* x, const uint16_t* relu,
                               const float* mean, const float* ka, const float* kb, const float* kd,
                               int64_t rb, int64_t re, int64_t c, uint16_t* dx) {
  for (int64_t r = rb; r < re; ++r) {
    for (int64_t k = 0; k < c; k += 16) {
      const int64_t o = r * c + k;
      __m512 g = Bf16Load16(dy + o);
      if (relu != nullptr) g = MaskPos(g, Bf16Load16(relu + o));
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(ka + k), g);
      v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_loadu_ps(kb + k),
                                         _mm512_sub_ps(Bf16Load16(x + o), _mm512_loadu_ps(mean + k))));
      v = _mm512_add_ps(v, _mm512_loadu_ps(kd + k));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dx + o), Bf16Round16(v));
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
    const bool avx = std::is_same<T, bfloat16>::value && c % 16 == 0 && Bf16UseAvx512();

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
                          ElementwiseOp<T, AddReluFn>);                                         \
  REGISTER_KERNEL_BUILDER(Name("AddNReluGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),       \
                          ElementwiseOp<T, AddNReluGradFn>);                                    \
  REGISTER_KERNEL_BUILDER(Name("BatchNormGradNHWC").Device(DEVICE_CPU).TypeConstraint<T>("T"),  \
                          BatchNormGradNHWCOp<T>);
REGISTER(float);
REGISTER(bfloat16);
#undef REGISTER

#define REGISTER_JOIN(T, TS)                                                                    \
  REGISTER_KERNEL_BUILDER(Name("JoinGradSum").Device(DEVICE_CPU).TypeConstraint<T>("T")        \
                              .TypeConstraint<TS>("Tshape").HostMemory("shape"),                 \
                          JoinGradSumOp<T, TS>);
REGISTER_JOIN(float, int32_t);
REGISTER_JOIN(float, int64_t);
REGISTER_JOIN(bfloat16, int32_t);
REGISTER_JOIN(bfloat16, int64_t);
#undef REGISTER_JOIN

}  // namespace
}  // namespace npu_amp_tf
