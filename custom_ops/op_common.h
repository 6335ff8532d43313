// The TensorFlow names the custom-op sources use, brought into npu_amp_tf once
// (included by fused_attention.cc, scale_mask_softmax.cc, trans_data.cc and
// norm_common.h).
#ifndef NPU_AMP_TF_CUSTOM_OPS_OP_COMMON_H_
#define NPU_AMP_TF_CUSTOM_OPS_OP_COMMON_H_

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace npu_amp_tf {

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
