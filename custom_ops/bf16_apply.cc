// Momentum updates that read a BF16 gradient (issue 18j): FP32 master weights and
// accumulators, the gradient in T (bfloat16 or float).  Emitted by the fusion rule
// ``bf16_apply_momentum`` (graph_passes/fusion/bf16_apply.py) in place of
// ResourceApplyMomentum / ResourceApplyKerasMomentum; the op is gray for its T, so under a
// BF16 plan it reads the BF16 gradient of a BF16 conv / matmul directly instead of
// ``Cast(bf16 -> f32) -> ResourceApplyMomentum(T=float)``.
//
//   ResourceApplyMomentumMixed(var, accum, lr, grad: T, momentum; use_locking, use_nesterov, keras)
//
// g = float(grad) is exact (a BF16 value widened: a 16-bit shift), and then the FP32
// arithmetic is TF's own (tensorflow/core/kernels/training_ops.cc, functor::ApplyMomentum and
// ApplyKerasMomentum on CPU) in the same order with the same roundings and no FMA:
//   keras = false:  accum = accum * momentum + g
//                   var  -= accum * lr                                   (use_nesterov = false)
//                   var  -= g * lr + accum * momentum * lr               (use_nesterov = true)
//   keras = true:   accum = accum * momentum - g * lr
//                   var  += accum                                        (use_nesterov = false)
//                   var  += accum * momentum - g * lr                    (use_nesterov = true)
// so var and accum equal Cast + TF's FP32 apply bit for bit (tests/test_fusion_bf16_apply.py).
// One pass over var, accum and grad (TF's Eigen kernel makes two over accum, the Cast one more
// over a 4-byte gradient); an AVX-512F loop where the CPU has it (chosen at run time; setting
// NPU_AMP_TF_BF16_PORTABLE=1 before the first call forces the portable loop: same bits).  Variable locking and copy-on-write are TF's helpers
// (training_op_helpers.h: MaybeLockVariableInputMutexesInOrder, GetInputTensorFromVariable),
// as in ResourceApplyMomentum.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/util/work_sharder.h"

// No contraction of a*b + c into an FMA: TF's CPU kernel rounds the product and the sum
// separately, and so must this one to give the same bits.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "bf16_simd.h"
#include "op_common.h"

namespace npu_amp_tf {
namespace {

using ::tensorflow::bfloat16;
using CPUDevice = Eigen::ThreadPoolDevice;
namespace tf = ::tensorflow;

REGISTER_OP("ResourceApplyMomentumMixed")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("lr: float")
    .Input("grad: T")
    .Input("momentum: float")
    .Attr("T: {bfloat16, float}")
    .Attr("use_locking: bool = false")
    .Attr("use_nesterov: bool = false")
    .Attr("keras: bool = false")
    .SetIsStateful()
    .SetShapeFn([](tf::shape_inference::InferenceContext* c) {
      tf::shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));  // lr
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 0, &unused));  // momentum
      return tf::OkStatus();
    })
    .Doc("Momentum update of FP32 variables (var, accum) from a gradient in T: "
         "ResourceApplyMomentum (keras=false) or ResourceApplyKerasMomentum (keras=true) "
         "applied to float(grad), bit for bit.");

inline float Widen(float x) { return x; }
inline float Widen(bfloat16 x) {
  uint16_t h;
  std::memcpy(&h, &x, sizeof(h));
  return Bf16Widen(h);
}

template <typename G>
void Update(float* __restrict var, float* __restrict accum, const G* __restrict grad, float lr,
            float m, bool nesterov, bool keras, int64_t begin, int64_t end) {
  if (!keras && !nesterov) {
    for (int64_t i = begin; i < end; ++i) {
      const float a = accum[i] * m + Widen(grad[i]);
      accum[i] = a;
      var[i] = var[i] - a * lr;
    }
  } else if (!keras) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = Widen(grad[i]);
      const float a = accum[i] * m + g;
      accum[i] = a;
      var[i] = var[i] - (g * lr + a * m * lr);
    }
  } else if (!nesterov) {
    for (int64_t i = begin; i < end; ++i) {
      const float a = accum[i] * m - Widen(grad[i]) * lr;
      accum[i] = a;
      var[i] = var[i] + a;
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      const float g = Widen(grad[i]);
      const float a = accum[i] * m - g * lr;
      accum[i] = a;
      var[i] = var[i] + (a * m - g * lr);
    }
  }
}

#ifdef NPU_AMP_X86
// The same four loops on 16 lanes (AVX-512; chosen at run time): separate multiply, add and
// subtract instructions, so every lane rounds as the scalar loop does (identical bits).
NPU_AMP_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
NPU_AMP_AVX512 inline __m512 Load16(const bfloat16* p) {
  return Bf16Load16(reinterpret_cast<const uint16_t*>(p));
}

template <typename G>
NPU_AMP_AVX512 void UpdateAvx512(float* __restrict var, float* __restrict accum,
                                                     const G* __restrict grad, float lr, float m,
                                                     bool nesterov, bool keras, int64_t begin,
                                                     int64_t end) {
  const __m512 vlr = _mm512_set1_ps(lr), vm = _mm512_set1_ps(m);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 g = Load16(grad + i);
    const __m512 am = _mm512_mul_ps(_mm512_loadu_ps(accum + i), vm);
    const __m512 v = _mm512_loadu_ps(var + i);
    __m512 a, nv;
    if (!keras) {
      a = _mm512_add_ps(am, g);
      nv = nesterov ? _mm512_sub_ps(v, _mm512_add_ps(_mm512_mul_ps(g, vlr),
                                                     _mm512_mul_ps(_mm512_mul_ps(a, vm), vlr)))
                    : _mm512_sub_ps(v, _mm512_mul_ps(a, vlr));
    } else {
      const __m512 glr = _mm512_mul_ps(g, vlr);
      a = _mm512_sub_ps(am, glr);
      nv = nesterov ? _mm512_add_ps(v, _mm512_sub_ps(_mm512_mul_ps(a, vm), glr)) : _mm512_add_ps(v, a);
    }
    _mm512_storeu_ps(accum + i, a);
    _mm512_storeu_ps(var + i, nv);
  }
  Update<G>(var, accum, grad, lr, m, nesterov, keras, i, end);
}

#endif

template <typename G>
void UpdateRange(float* var, float* accum, const G* grad, float lr, float m, bool nesterov, bool keras,
                 int64_t begin, int64_t end) {
#ifdef NPU_AMP_X86
  if (Bf16UseAvx512()) return UpdateAvx512<G>(var, accum, grad, lr, m, nesterov, keras, begin, end);
#endif
  Update<G>(var, accum, grad, lr, m, nesterov, keras, begin, end);
}

template <typename G>
class ApplyMomentumMixedOp : public tf::OpKernel {
 public:
  explicit ApplyMomentumMixedOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_locking", &use_exclusive_lock_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_nesterov", &use_nesterov_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("keras", &keras_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const bool sparse = false;
    auto locks = tf::MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(ctx, use_exclusive_lock_,
                                                                            sparse, {0, 1});
    tf::Tensor var;
    OP_REQUIRES_OK(ctx, tf::GetInputTensorFromVariable<CPUDevice, float>(ctx, 0, use_exclusive_lock_,
                                                                         sparse, &var));
    tf::Tensor accum;
    OP_REQUIRES_OK(ctx, tf::GetInputTensorFromVariable<CPUDevice, float>(ctx, 1, use_exclusive_lock_,
                                                                         sparse, &accum));
    OP_REQUIRES(ctx, var.IsInitialized(),
                tf::errors::FailedPrecondition("Attempting to use uninitialized variables: ",
                                               requested_input(0)));
    OP_REQUIRES(ctx, accum.IsInitialized(),
                tf::errors::FailedPrecondition("Attempting to use uninitialized variables: ",
                                               requested_input(1)));
    OP_REQUIRES(ctx, var.dtype() == tf::DT_FLOAT && accum.dtype() == tf::DT_FLOAT,
                tf::errors::InvalidArgument("ResourceApplyMomentumMixed: var and accum must be float32, got ",
                                            tf::DataTypeString(var.dtype()), " and ",
                                            tf::DataTypeString(accum.dtype())));
    const tf::Tensor& lr = ctx->input(2);
    OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(lr.shape()),
                tf::errors::InvalidArgument("lr is not a scalar: ", lr.shape().DebugString()));
    const tf::Tensor& grad = ctx->input(3);
    OP_REQUIRES(ctx, var.shape().IsSameSize(accum.shape()),
                tf::errors::InvalidArgument("var and accum do not have the same shape",
                                            var.shape().DebugString(), " ", accum.shape().DebugString()));
    OP_REQUIRES(ctx, var.shape().IsSameSize(grad.shape()),
                tf::errors::InvalidArgument("var and grad do not have the same shape",
                                            var.shape().DebugString(), " ", grad.shape().DebugString()));
    const tf::Tensor& momentum = ctx->input(4);
    OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(momentum.shape()),
                tf::errors::InvalidArgument("momentum is not a scalar: ", momentum.shape().DebugString()));

    float* v = var.flat<float>().data();
    float* a = accum.flat<float>().data();
    const G* g = grad.flat<G>().data();
    const float lr_v = lr.scalar<float>()();
    const float m_v = momentum.scalar<float>()();
    const bool nesterov = use_nesterov_, keras = keras_;
    const int64_t n = var.NumElements();
    auto work = [=](int64_t b, int64_t e) { UpdateRange<G>(v, a, g, lr_v, m_v, nesterov, keras, b, e); };
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    if (n < 16384) {
      work(0, n);
    } else {
      // ~5 memory passes per element; shard in 4096-element blocks (cost per unit in cycles)
      tf::Shard(workers->num_threads, workers->workers, (n + 4095) / 4096, 4096 * 8,
                [&](int64_t b, int64_t e) { work(b * 4096, std::min<int64_t>(e * 4096, n)); });
    }
  }

 private:
  bool use_exclusive_lock_ = false;
  bool use_nesterov_ = false;
  bool keras_ = false;
};

REGISTER_KERNEL_BUILDER(
    Name("ResourceApplyMomentumMixed").Device(tf::DEVICE_CPU).TypeConstraint<float>("T"),
    ApplyMomentumMixedOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("ResourceApplyMomentumMixed").Device(tf::DEVICE_CPU).TypeConstraint<bfloat16>("T"),
    ApplyMomentumMixedOp<bfloat16>);

}  // namespace
}  // namespace npu_amp_tf
