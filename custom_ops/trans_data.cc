// TransData: GE's format conversion op, emulated on CPU.
//
//   src_format -> dst_format              shapes
//   NHWC  -> NC1HWC0  (and back)          [N,H,W,C]   <-> [N,C1,H,W,C0]
//   NCHW  -> NC1HWC0  (and back)          [N,C,H,W]   <-> [N,C1,H,W,C0]
//   C     -> NC1HWC0  (and back)          [..,C]      <-> [1,C1,1,1,C0]   per-channel operands
//   HWCN  -> FRACTAL_Z (and back)         [Kh,Kw,C,N] <-> [C1*Kh*Kw, ceil(N/16), 16, C0]
//
// C1 = ceil(C / C0); C0 = 16 for float/half/bfloat16, 32 for int8/uint8.
// Padding lanes are written as zero.  Converting back to an original format
// needs the original channel count(s): attr `orig_shape` is the shape in the
// original format, -1 for dims that are taken from the input (batch, H, W).
// For FRACTAL_Z -> HWCN all four dims must be given.
//
// The gradient (the inverse TransData) is registered in Python
// (npu_amp_tf/ops.py).  The NumPy reference is graph_passes/layout/formats.py.
#include <cstdint>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/bfloat16.h"
#include "op_common.h"

namespace npu_amp_tf {
namespace {

enum Conv {
  kNHWC_to_5HD, k5HD_to_NHWC, kNCHW_to_5HD, k5HD_to_NCHW,
  kC_to_5HD, k5HD_to_C, kHWCN_to_FZ, kFZ_to_HWCN, kBad
};

Conv ParseConv(const std::string& s, const std::string& d) {
  if (s == "NHWC" && d == "NC1HWC0") return kNHWC_to_5HD;
  if (s == "NC1HWC0" && d == "NHWC") return k5HD_to_NHWC;
  if (s == "NCHW" && d == "NC1HWC0") return kNCHW_to_5HD;
  if (s == "NC1HWC0" && d == "NCHW") return k5HD_to_NCHW;
  if (s == "C" && d == "NC1HWC0") return kC_to_5HD;
  if (s == "NC1HWC0" && d == "C") return k5HD_to_C;
  if (s == "HWCN" && d == "FRACTAL_Z") return kHWCN_to_FZ;
  if (s == "FRACTAL_Z" && d == "HWCN") return kFZ_to_HWCN;
  return kBad;
}

const char* kAccepted =
    "accepted (src_format, dst_format): (NHWC|NCHW|C, NC1HWC0), (NC1HWC0, NHWC|NCHW|C), "
    "(HWCN, FRACTAL_Z), (FRACTAL_Z, HWCN)";

int64_t C0For(DataType dt) {
  return (dt == tensorflow::DT_INT8 || dt == tensorflow::DT_UINT8) ? 32 : 16;
}
constexpr int64_t kN0 = 16;
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// --------------------------------------------------------------- shapes
::tensorflow::Status ShapeFn(shape_inference::InferenceContext* c) {
  std::string src, dst;
  std::vector<int64_t> orig;
  DataType dt;
  TF_RETURN_IF_ERROR(c->GetAttr("src_format", &src));
  TF_RETURN_IF_ERROR(c->GetAttr("dst_format", &dst));
  TF_RETURN_IF_ERROR(c->GetAttr("orig_shape", &orig));
  TF_RETURN_IF_ERROR(c->GetAttr("T", &dt));
  const Conv conv = ParseConv(src, dst);
  if (conv == kBad)
    return InvalidArgument("TransData: unsupported src_format='", src, "', dst_format='", dst,
                           "'; ", kAccepted);
  const int64_t c0 = C0For(dt);
  auto in = c->input(0);
  auto dim = [&](int i) { return c->Dim(in, i); };
  auto val = [&](int i) -> int64_t {
    auto d = c->Dim(in, i);
    return c->ValueKnown(d) ? c->Value(d) : -1;
  };
  auto c1of = [&](int64_t ch) -> shape_inference::DimensionHandle {
    return ch < 0 ? c->UnknownDim() : c->MakeDim(CeilDiv(ch, c0));
  };
  auto orig_dim = [&](int i, shape_inference::DimensionHandle fallback) {
    return (i < static_cast<int>(orig.size()) && orig[i] >= 0) ? c->MakeDim(orig[i]) : fallback;
  };
  switch (conv) {
    case kNHWC_to_5HD: {
      TF_RETURN_IF_ERROR(c->WithRank(in, 4, &in));
      c->set_output(0, c->MakeShape({dim(0), c1of(val(3)), dim(1), dim(2), c->MakeDim(c0)}));
      return ::tensorflow::OkStatus();
    }
    case kNCHW_to_5HD: {
      TF_RETURN_IF_ERROR(c->WithRank(in, 4, &in));
      c->set_output(0, c->MakeShape({dim(0), c1of(val(1)), dim(2), dim(3), c->MakeDim(c0)}));
      return ::tensorflow::OkStatus();
    }
    case kC_to_5HD: {
      int64_t ch = -1;
      if (c->RankKnown(in) && c->Rank(in) >= 1) ch = val(c->Rank(in) - 1);
      c->set_output(0, c->MakeShape({c->MakeDim(1), c1of(ch), c->MakeDim(1), c->MakeDim(1),
                                     c->MakeDim(c0)}));
      return ::tensorflow::OkStatus();
    }
    case k5HD_to_NHWC:
    case k5HD_to_NCHW: {
      TF_RETURN_IF_ERROR(c->WithRank(in, 5, &in));
      if (orig.size() != 4)
        return InvalidArgument("TransData NC1HWC0->", dst, ": attr orig_shape must have 4 dims ",
                               "(the ", dst, " shape, -1 where unknown), got ", orig.size());
      const int cpos = conv == k5HD_to_NHWC ? 3 : 1;
      auto ch = orig[cpos] >= 0 ? c->MakeDim(orig[cpos]) : c->UnknownDim();
      if (conv == k5HD_to_NHWC)
        c->set_output(0, c->MakeShape({orig_dim(0, dim(0)), orig_dim(1, dim(2)), orig_dim(2, dim(3)), ch}));
      else
        c->set_output(0, c->MakeShape({orig_dim(0, dim(0)), ch, orig_dim(2, dim(2)), orig_dim(3, dim(3))}));
      return ::tensorflow::OkStatus();
    }
    case k5HD_to_C: {
      if (orig.empty())
        return InvalidArgument("TransData NC1HWC0->C: attr orig_shape must give the per-channel shape");
      std::vector<shape_inference::DimensionHandle> dims;
      for (auto d : orig) dims.push_back(d >= 0 ? c->MakeDim(d) : c->UnknownDim());
      c->set_output(0, c->MakeShape(dims));
      return ::tensorflow::OkStatus();
    }
    case kHWCN_to_FZ: {
      TF_RETURN_IF_ERROR(c->WithRank(in, 4, &in));
      int64_t kh = val(0), kw = val(1), ci = val(2), co = val(3);
      auto first = (kh < 0 || kw < 0 || ci < 0) ? c->UnknownDim()
                                                 : c->MakeDim(CeilDiv(ci, c0) * kh * kw);
      auto n1 = co < 0 ? c->UnknownDim() : c->MakeDim(CeilDiv(co, kN0));
      c->set_output(0, c->MakeShape({first, n1, c->MakeDim(kN0), c->MakeDim(c0)}));
      return ::tensorflow::OkStatus();
    }
    case kFZ_to_HWCN: {
      TF_RETURN_IF_ERROR(c->WithRank(in, 4, &in));
      if (orig.size() != 4 || orig[0] < 0 || orig[1] < 0 || orig[2] < 0 || orig[3] < 0)
        return InvalidArgument("TransData FRACTAL_Z->HWCN: attr orig_shape must be the full HWCN ",
                               "shape [Kh, Kw, Cin, Cout]");
      c->set_output(0, c->MakeShape({orig[0], orig[1], orig[2], orig[3]}));
      return ::tensorflow::OkStatus();
    }
    default:
      return InvalidArgument("TransData: unsupported conversion");
  }
}

REGISTER_OP("TransData")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16, int8, uint8}")
    .Attr("src_format: string")
    .Attr("dst_format: string")
    .Attr("orig_shape: list(int) = []")
    .SetShapeFn(ShapeFn)
    .Doc(R"doc(
Converts a tensor between TensorFlow formats and Ascend's NC1HWC0 / FRACTAL_Z.
Padding lanes are zero. orig_shape: the shape in the original (non-5HD,
non-FRACTAL_Z) format, -1 where it can be taken from the input; needed when
converting back to an original format.
)doc");

// --------------------------------------------------------------- kernel
template <typename T>
class TransDataOp : public OpKernel {
 public:
  explicit TransDataOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string src, dst;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("src_format", &src));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dst_format", &dst));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("orig_shape", &orig_));
    conv_ = ParseConv(src, dst);
    OP_REQUIRES(ctx, conv_ != kBad,
                InvalidArgument("TransData: unsupported src_format='", src, "', dst_format='",
                                dst, "'; ", kAccepted));
    DataType dt;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &dt));
    c0_ = C0For(dt);
    dst_ = dst;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const int64_t c0 = c0_;
    switch (conv_) {
      case kNHWC_to_5HD:
      case kNCHW_to_5HD:
      case kC_to_5HD: {
        int64_t n, h, w, c;
        bool nchw = conv_ == kNCHW_to_5HD;
        if (conv_ == kC_to_5HD) {
          OP_REQUIRES(ctx, x.dims() >= 1,
                      InvalidArgument("TransData C->NC1HWC0: input must have rank >= 1"));
          c = x.dim_size(x.dims() - 1);
          OP_REQUIRES(ctx, x.NumElements() == c,
                      InvalidArgument("TransData C->NC1HWC0: input must be per-channel (all dims "
                                      "but the last are 1), got ", x.shape().DebugString()));
          n = h = w = 1;
        } else {
          OP_REQUIRES(ctx, x.dims() == 4,
                      InvalidArgument("TransData ", nchw ? "NCHW" : "NHWC",
                                      "->NC1HWC0: input must be 4-D, got ", x.shape().DebugString()));
          n = x.dim_size(0);
          c = nchw ? x.dim_size(1) : x.dim_size(3);
          h = nchw ? x.dim_size(2) : x.dim_size(1);
          w = nchw ? x.dim_size(3) : x.dim_size(2);
        }
        const int64_t c1 = CeilDiv(c, c0);
        Tensor* y = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, c1, h, w, c0}), &y));
        const T* src = x.flat<T>().data();
        T* out = y->flat<T>().data();
        for (int64_t in = 0; in < n; ++in)
          for (int64_t ic1 = 0; ic1 < c1; ++ic1)
            for (int64_t ih = 0; ih < h; ++ih)
              for (int64_t iw = 0; iw < w; ++iw) {
                T* o = out + (((in * c1 + ic1) * h + ih) * w + iw) * c0;
                for (int64_t k = 0; k < c0; ++k) {
                  const int64_t ch = ic1 * c0 + k;
                  if (ch >= c) {
                    o[k] = T(0);
                  } else if (nchw) {
                    o[k] = src[((in * c + ch) * h + ih) * w + iw];
                  } else {
                    o[k] = src[((in * h + ih) * w + iw) * c + ch];
                  }
                }
              }
        return;
      }
      case k5HD_to_NHWC:
      case k5HD_to_NCHW:
      case k5HD_to_C: {
        OP_REQUIRES(ctx, x.dims() == 5 && x.dim_size(4) == c0,
                    InvalidArgument("TransData NC1HWC0->", dst_, ": input must be 5-D with C0=", c0,
                                    ", got ", x.shape().DebugString()));
        const int64_t n = x.dim_size(0), c1 = x.dim_size(1), h = x.dim_size(2), w = x.dim_size(3);
        int64_t c;
        TensorShape out_shape;
        bool nchw = conv_ == k5HD_to_NCHW;
        if (conv_ == k5HD_to_C) {
          OP_REQUIRES(ctx, !orig_.empty() && orig_.back() >= 0 && n == 1 && h == 1 && w == 1,
                      InvalidArgument("TransData NC1HWC0->C: needs input [1,C1,1,1,C0] and "
                                      "orig_shape ending in the channel count"));
          c = orig_.back();
          for (auto d : orig_) out_shape.AddDim(d < 0 ? 1 : d);
        } else {
          OP_REQUIRES(ctx, orig_.size() == 4,
                      InvalidArgument("TransData NC1HWC0->", dst_, ": attr orig_shape must have 4 dims"));
          c = nchw ? orig_[1] : orig_[3];
          if (c < 0) c = c1 * c0;
          if (nchw) out_shape = TensorShape({n, c, h, w});
          else out_shape = TensorShape({n, h, w, c});
        }
        OP_REQUIRES(ctx, c <= c1 * c0 && c > (c1 - 1) * c0,
                    InvalidArgument("TransData NC1HWC0->", dst_, ": channel count ", c,
                                    " does not match C1=", c1, " (C0=", c0, ")"));
        Tensor* y = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &y));
        const T* src = x.flat<T>().data();
        T* out = y->flat<T>().data();
        for (int64_t in = 0; in < n; ++in)
          for (int64_t ch = 0; ch < c; ++ch) {
            const int64_t ic1 = ch / c0, k = ch % c0;
            for (int64_t ih = 0; ih < h; ++ih)
              for (int64_t iw = 0; iw < w; ++iw) {
                const T v = src[(((in * c1 + ic1) * h + ih) * w + iw) * c0 + k];
                if (nchw) out[((in * c + ch) * h + ih) * w + iw] = v;
                else out[((in * h + ih) * w + iw) * c + ch] = v;
              }
          }
        return;
      }
      case kHWCN_to_FZ: {
        OP_REQUIRES(ctx, x.dims() == 4,
                    InvalidArgument("TransData HWCN->FRACTAL_Z: input must be 4-D, got ",
                                    x.shape().DebugString()));
        const int64_t kh = x.dim_size(0), kw = x.dim_size(1), ci = x.dim_size(2), co = x.dim_size(3);
        const int64_t c1 = CeilDiv(ci, c0), n1 = CeilDiv(co, kN0);
        Tensor* y = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({c1 * kh * kw, n1, kN0, c0}), &y));
        const T* src = x.flat<T>().data();
        T* out = y->flat<T>().data();
        for (int64_t ic1 = 0; ic1 < c1; ++ic1)
          for (int64_t ih = 0; ih < kh; ++ih)
            for (int64_t iw = 0; iw < kw; ++iw)
              for (int64_t on = 0; on < n1 * kN0; ++on)
                for (int64_t k = 0; k < c0; ++k) {
                  const int64_t row = (ic1 * kh + ih) * kw + iw;
                  const int64_t ch = ic1 * c0 + k;
                  T v = T(0);
                  if (ch < ci && on < co) v = src[((ih * kw + iw) * ci + ch) * co + on];
                  out[((row * n1 + on / kN0) * kN0 + on % kN0) * c0 + k] = v;
                }
        return;
      }
      case kFZ_to_HWCN: {
        OP_REQUIRES(ctx, orig_.size() == 4 && orig_[0] >= 0 && orig_[1] >= 0 && orig_[2] >= 0 &&
                             orig_[3] >= 0,
                    InvalidArgument("TransData FRACTAL_Z->HWCN: attr orig_shape must be the full "
                                    "HWCN shape [Kh, Kw, Cin, Cout]"));
        const int64_t kh = orig_[0], kw = orig_[1], ci = orig_[2], co = orig_[3];
        const int64_t c1 = CeilDiv(ci, c0), n1 = CeilDiv(co, kN0);
        OP_REQUIRES(ctx, x.dims() == 4 && x.dim_size(0) == c1 * kh * kw && x.dim_size(1) == n1 &&
                             x.dim_size(2) == kN0 && x.dim_size(3) == c0,
                    InvalidArgument("TransData FRACTAL_Z->HWCN: input shape ", x.shape().DebugString(),
                                    " does not match orig_shape [", kh, ",", kw, ",", ci, ",", co, "]"));
        Tensor* y = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({kh, kw, ci, co}), &y));
        const T* src = x.flat<T>().data();
        T* out = y->flat<T>().data();
        for (int64_t ih = 0; ih < kh; ++ih)
          for (int64_t iw = 0; iw < kw; ++iw)
            for (int64_t ch = 0; ch < ci; ++ch)
              for (int64_t on = 0; on < co; ++on) {
                const int64_t row = ((ch / c0) * kh + ih) * kw + iw;
                out[((ih * kw + iw) * ci + ch) * co + on] =
                    src[((row * n1 + on / kN0) * kN0 + on % kN0) * c0 + ch % c0];
              }
        return;
      }
      default:
        ctx->SetStatus(InvalidArgument("TransData: unsupported conversion"));
    }
  }

 private:
  Conv conv_ = kBad;
  int64_t c0_ = 16;
  std::vector<int64_t> orig_;
  std::string dst_;
};

#define REGISTER_TRANS_DATA(T)                                                        \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("TransData").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),      \
      TransDataOp<T>)

REGISTER_TRANS_DATA(float);
REGISTER_TRANS_DATA(::Eigen::half);
REGISTER_TRANS_DATA(::tensorflow::bfloat16);
REGISTER_TRANS_DATA(int8_t);
REGISTER_TRANS_DATA(uint8_t);

}  // namespace
}  // namespace npu_amp_tf
