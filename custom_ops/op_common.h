// The TensorFlow names the custom-op sources use, brought into npu_amp_tf once
// (included by fused_attention.cc, scale_mask_softmax.cc, trans_data.cc and
// norm_common.h).
#ifndef NPU_AMP_TF_CUSTOM_OPS_OP_COMMON_H_
#define NPU_AMP_TF_CUSTOM_OPS_OP_COMMON_H_

#include <cstdlib>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace npu_amp_tf {

// The BF16 kernels' run-time dispatch (bf16_elementwise.cc, gelu.cc, layer_norm.cc,
// scale_mask_softmax.cc): true when the CPU has avx512f, avx512bw and avx512vl and the
// environment variable NPU_AMP_TF_BF16_PORTABLE was not set to a non-zero value before the
// first call (tests set it to compare the portable loops with the vector ones).
inline bool Bf16UseAvx512() {
  static const bool use = [] {
    const char* env = std::getenv("NPU_AMP_TF_BF16_PORTABLE");
    if (env != nullptr && env[0] != '\0' && env[0] != '0') return false;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return false;
#endif
  }();
  return use;
}

using ::tensorflow::DataType;
using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::errors::InvalidArgument;
namespace shape_inference = ::tensorflow::shape_inference;

}  // namespace npu_amp_tf

#endif  // NPU_AMP_TF_CUSTOM_OPS_OP_COMMON_H_
