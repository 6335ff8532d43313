"""What the layout pass knows about op types.  Data, one entry per line, each
with a short reason (docs/architecture.md: lists are data).

* ``HEAVY``: ops that pick NC1HWC0 (their cube/vector kernels on Ascend
  consume 5HD).  Roles: which inputs are activations (``act``), filters
  (``filter``, converted to FRACTAL_Z), which outputs are activations or
  filter gradients.  On CPU each is *lowered*: it keeps running in NHWC
  between internal TransData nodes marked ``_npu_lowering``.
* ``UNARY`` / ``SAME_SHAPE`` / ``BROADCAST``: format-agnostic ops the format
  spreads through.
* ``PADDING_UNSAFE``: ops for which 0 is not neutral.  Zero padding lanes
  must never reach them, so they always stay in the original format.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Heavy:
    act_in: tuple = ()
    filter_in: tuple = ()
    act_out: tuple = ()
    filter_out: tuple = ()
    reason: str = ""


_CONV = "cube op: Ascend's conv kernel consumes 5HD activations and FRACTAL_Z filters"
_DW = "depthwise conv runs on 5HD activations (its filter format C1HWNCoC0 is not emulated; the filter stays HWCN)"
_POOL = "pooling runs on 5HD activations"
_BN = "batch norm statistics are per (C1, C0) lane in 5HD"

HEAVY = {
    "Conv2D": Heavy(act_in=(0,), filter_in=(1,), act_out=(0,), reason=_CONV),
    "_FusedConv2D": Heavy(act_in=(0,), filter_in=(1,), act_out=(0,), reason=_CONV),
    "Conv2DBackpropInput": Heavy(act_in=(2,), filter_in=(1,), act_out=(0,), reason=_CONV),
    "Conv2DBackpropFilter": Heavy(act_in=(0, 2), filter_out=(0,), reason=_CONV + " (filter gradient in FRACTAL_Z)"),
    "DepthwiseConv2dNative": Heavy(act_in=(0,), act_out=(0,), reason=_DW),
    "DepthwiseConv2dNativeBackpropInput": Heavy(act_in=(2,), act_out=(0,), reason=_DW),
    "DepthwiseConv2dNativeBackpropFilter": Heavy(act_in=(0, 2), reason=_DW),
    "MaxPool": Heavy(act_in=(0,), act_out=(0,), reason=_POOL),
    "AvgPool": Heavy(act_in=(0,), act_out=(0,), reason=_POOL),
    "MaxPoolGrad": Heavy(act_in=(0, 1, 2), act_out=(0,), reason=_POOL),
    "AvgPoolGrad": Heavy(act_in=(1,), act_out=(0,), reason=_POOL),
    "FusedBatchNorm": Heavy(act_in=(0,), act_out=(0,), reason=_BN),
    "FusedBatchNormV2": Heavy(act_in=(0,), act_out=(0,), reason=_BN),
    "FusedBatchNormV3": Heavy(act_in=(0,), act_out=(0,), reason=_BN),
    "_FusedBatchNormEx": Heavy(act_in=(0,), act_out=(0,), reason=_BN),
    "FusedBatchNormGrad": Heavy(act_in=(0, 1), act_out=(0,), reason=_BN),
    "FusedBatchNormGradV2": Heavy(act_in=(0, 1), act_out=(0,), reason=_BN),
    "FusedBatchNormGradV3": Heavy(act_in=(0, 1), act_out=(0,), reason=_BN),
}

#: elementwise unary ops: f applies lane by lane (padding lanes included)
UNARY = {
    "Identity": "identity",
    "Snapshot": "identity",
    "StopGradient": "identity",
    "PreventGradient": "identity",
    "Cast": "elementwise (only between dtypes with the same C0)",
    "Relu": "f(0)=0", "Relu6": "f(0)=0", "Elu": "f(0)=0", "Selu": "f(0)=0",
    "LeakyRelu": "f(0)=0", "Tanh": "f(0)=0", "Neg": "f(0)=0", "Abs": "f(0)=0",
    "Square": "f(0)=0", "Sqrt": "f(0)=0", "Softsign": "f(0)=0", "Erf": "f(0)=0",
    "Sign": "f(0)=0", "Floor": "f(0)=0", "Ceil": "f(0)=0", "Round": "f(0)=0",
    "ZerosLike": "f(0)=0",
    "Sigmoid": "finite on padding (0.5); padding lanes never reach real lanes",
    "Softplus": "finite on padding (log 2)",
    "Exp": "finite on padding (1)",
    "OnesLike": "finite on padding (1)",
}

#: two same-shape activations, lane by lane (activation gradients)
SAME_SHAPE = {op: "activation gradient, lane by lane" for op in (
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SigmoidGrad", "TanhGrad",
    "SoftplusGrad", "SoftsignGrad")}
SAME_SHAPE["AddN"] = "sum of same-shape tensors"

#: binary ops with broadcasting: same-shape operands stay 5HD, per-channel
#: operands become per-channel 5HD operands ([1, C1, 1, 1, C0]), scalars stay
BROADCAST = {
    "Add": "f(0,0)=0", "AddV2": "f(0,0)=0", "Sub": "f(0,0)=0", "Mul": "f(0,0)=0",
    "Maximum": "f(0,0)=0", "Minimum": "f(0,0)=0", "SquaredDifference": "f(0,0)=0",
    "MulNoNan": "f(0,0)=0", "DivNoNan": "x/0 is defined as 0",
    "BiasAdd": "bias becomes a per-channel 5HD operand (lowered to AddV2)",
}

#: division: allowed in 5HD only with a scalar divisor (x/0 on padding lanes is inf/NaN)
DIVISION = {"RealDiv", "Div", "FloorDiv", "TruncateDiv"}

#: spatial padding: allowed when the channel dim is not padded
PAD = {"Pad": "spatial zero padding", "PadV2": "spatial constant padding"}

PADDING_UNSAFE = {
    "Log": "log(0) = -inf on padding lanes",
    "Reciprocal": "1/0 = inf on padding lanes",
    "Inv": "1/0 = inf on padding lanes",
    "Rsqrt": "rsqrt(0) = inf on padding lanes",
    "Pow": "0**negative = inf on padding lanes",
    "Lgamma": "lgamma(0) = inf on padding lanes",
    "Digamma": "digamma(0) = NaN on padding lanes",
    "Xdivy": "x/0 on padding lanes",
    "Xlogy": "log(0) on padding lanes",
    "SqrtGrad": "divides by sqrt(x)",
    "RsqrtGrad": "divides by x",
    "Softmax": "softmax over channels would count padding lanes",
    "LogSoftmax": "softmax over channels would count padding lanes",
    "Sum": "reduction over channels would count padding lanes",
    "Mean": "reduction over channels would count padding lanes",
    "Max": "reduction over channels would see padding lanes",
    "Min": "reduction over channels would see padding lanes",
    "Prod": "reduction over channels would multiply padding lanes",
    "BiasAddGrad": "channel reduction",
    "L2Loss": "reduction",
    "ArgMax": "reduction over channels would see padding lanes",
}

#: need the original layout (documented; anything not listed above is a boundary too)
LAYOUT_BOUND = {
    "Reshape": "reinterprets the memory layout",
    "MatMul": "matrix op on 2-D data",
    "Squeeze": "drops dims of the original layout",
    "ExpandDims": "adds dims to the original layout",
    "Transpose": "permutes the original layout",
    "ConcatV2": "concatenation axis is in the original layout",
    "Slice": "indices are in the original layout",
    "StridedSlice": "indices are in the original layout",
    "Shape": "reports the original shape",
}

#: dtypes with a TransData kernel (DataType names)
TRANSDATA_DTYPES = frozenset({"float32", "float16", "bfloat16", "int8", "uint8"})
