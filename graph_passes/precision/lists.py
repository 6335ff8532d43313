"""Default black / white / gray / clear lists (CANN semantics), as data.

One entry per line, each with a one-line reason.  Users edit them with
``custom_white_list`` / ``custom_black_list`` / ``custom_gray_list`` or a
CANN ``modify_mixlist`` JSON file; :func:`resolve_lists` applies the edits
and refuses an op that ends up in two lists.

* white: always low precision (matrix / conv compute, where FP16 pays).
* black: always FP32 (range- or accuracy-sensitive).
* gray:  follows its producers: low precision if fed low precision.
* clear: data movement; passes on whatever precision it is given.

Ops that are in no list are decided by the ``unknown_op_policy`` option.  Some
ops are never re-typed whatever the lists say (see ``FIXED_OPS`` and
``_op_meta`` in ``precision/amp.py``; the planner reports them as ``fixed``): variables and their reads (the FP32 master weights),
stateful ops and optimizer updates (``ApplyAdam``, ``ResourceApply*``,
``AssignSub``...; except ``STATEFUL_PAINTABLE``, whose gradient dtype is painted), v1 loop plumbing (``Enter``/``NextIteration``/``Exit``/``LoopCond`` and the
``Merge``/``Switch`` of a loop: a loop-carried value keeps one dtype on every
edge; the ``Switch``/``Merge`` of a conditional are clear), TensorList/variant ops (a TensorList cluster keeps one colour), and
function calls (``PartitionedCall``/``While``/``If``: signatures never change,
bodies are rewritten on their own with casts inside).
"""
from __future__ import annotations

from ..errors import MixlistError

WHITE = {
    "Conv2D": "cube op: matrix unit, FP16 inputs pay",
    "Conv2DBackpropInput": "cube op: backprop of Conv2D",
    "Conv2DBackpropFilter": "cube op: backprop of Conv2D",
    "Conv3D": "cube op",
    "Conv3DBackpropInputV2": "cube op: backprop of Conv3D",
    "Conv3DBackpropFilterV2": "cube op: backprop of Conv3D",
    "DepthwiseConv2dNative": "cube op",
    "DepthwiseConv2dNativeBackpropInput": "cube op: backprop of depthwise conv",
    "DepthwiseConv2dNativeBackpropFilter": "cube op: backprop of depthwise conv",
    "MatMul": "cube op: matrix multiply",
    "BatchMatMul": "cube op: batched matrix multiply",
    "BatchMatMulV2": "cube op: batched matrix multiply",
    "BatchMatMulV3": "cube op: batched matrix multiply",
    "Einsum": "cube op: contraction",
    "_FusedMatMul": "fused cube op (grappler remapper); low only where a kernel exists (none for FP16 on CPU)",
    "_FusedConv2D": "fused cube op (grappler remapper); low only where a kernel exists (none for FP16 on CPU)",
    "_MklNativeFusedConv2D": "oneDNN form of _FusedConv2D that fusion emits for BF16 (registry.FUSED_FORMS)",
}

BLACK = {
    "Softmax": "exp/sum over a row overflows FP16",
    "LogSoftmax": "log of small values loses accuracy in FP16",
    "Log": "log of small values loses accuracy in FP16",
    "Log1p": "log of small values loses accuracy in FP16",
    "Exp": "overflows FP16 above ~11",
    "Expm1": "overflows FP16 above ~11",
    "Pow": "result range exceeds FP16",
    "SoftmaxCrossEntropyWithLogits": "loss: needs FP32 range and accuracy",
    "SparseSoftmaxCrossEntropyWithLogits": "loss: needs FP32 range and accuracy",
    "SigmoidCrossEntropyWithLogits": "loss: needs FP32 range and accuracy",
    "L2Loss": "sum of squares overflows FP16",
    "Sum": "large reduction: accumulates past FP16 range",
    "Mean": "large reduction: accumulates past FP16 range",
    "Prod": "large reduction: product overflows FP16",
    "EuclideanNorm": "large reduction: sum of squares overflows FP16",
    "RsqrtGrad": "-dy * y^3 / 2: y = rsqrt of a small variance (+ epsilon) is large, its cube overflows FP16",
    "Lgamma": "range exceeds FP16",
    "Digamma": "accuracy-sensitive special function",
    "LayerNorm": "fused LayerNorm accumulates in FP32 by itself",
    "LayerNormGrad": "fused LayerNorm gradient accumulates in FP32",
    "RMSNorm": "fused RMSNorm, like LayerNorm: its statistics need FP32",
    "RMSNormGrad": "fused RMSNorm gradient, like LayerNormGrad",
    "ScaleMaskSoftmax": "fused scale + mask + softmax: exp/sum over a row overflows FP16",
    "ScaleMaskSoftmaxGrad": "fused softmax gradient: reads ScaleMaskSoftmax's FP32 probabilities, "
                            "row sum(dp * p) in FP32",
}

#: black ops whose only reason is FP16's range: gray (follow their producers)
#: when the low dtype is BF16, which has FP32's exponent range
#: (``planner.Plan``; a user's own black entry keeps them black)
BF16_GRAY = {
    "Softmax": "BF16 has FP32's range, so the FP16 overflow does not apply; oneDNN's BF16 softmax "
               "accumulates in FP32 (grappler's oneDNN BF16 AMP and Keras mixed_bfloat16 run it in BF16); "
               "in FP32 its output is held for the backward pass at twice the bytes",
    "Exp": "overflows FP16 above ~11, BF16 only above ~88 like FP32; in FP32 it keeps the GELU/Erf "
           "backward's elementwise chain in FP32 (FP32 copies of BF16 gradients)",
    "Expm1": "as Exp",
    "RsqrtGrad": "the FP16 overflow of y^3 does not apply; in FP32 it makes a norm's backward an FP32 "
                 "island ([tokens, hidden] FP32 products between the variance's gradient and dx)",
    # the fused norms: statistics, row sums and the backward's sums in FP32 inside the
    # kernels (mean/inv_std are FP32 outputs); FP16 stays black: dgamma/dbeta sum dy over
    # every row and can overflow FP16 under loss scaling, BF16 cannot
    "LayerNorm": "accumulates in FP32 inside (FP32 mean/inv_std); BF16 I/O has FP32's range, so it "
                 "follows its producers (no FP32 copy of x, no casts around it)",
    "LayerNormGrad": "row and column sums in FP32 inside; dgamma/dbeta (sums over all rows) fit BF16's "
                     "range under loss scaling, not FP16's",
    "RMSNorm": "as LayerNorm",
    "RMSNormGrad": "as LayerNormGrad",
    "ScaleMaskSoftmax": "max, exp and the row sum in FP32 inside (18g); BF16 I/O has FP32's range, so it "
                        "follows its producers, like oneDNN's BF16 Softmax",
    "ScaleMaskSoftmaxGrad": "the row sum(dp * p) in FP32 inside; BF16 I/O (probabilities as ScaleMaskSoftmax "
                            "gave them)",
}

#: black reductions whose FP16 reasons (range; an FP16 accumulator) do not hold for
#: BF16 where TF's BF16 kernel accumulates in FP32 (``registry.bf16_accumulates_in_fp32``,
#: measured per TF version): with BF16 they follow their producers, **all together or
#: none** (``planner.Plan``).  Together, because one computation uses both: a layer or
#: batch norm's forward Mean and its backward's Sum (the gradient of the broadcast
#: statistics), a global average pool and its loss.  One of them FP32 and the other BF16
#: splits the norm into FP32 islands with casts at every edge (measured: Mean alone on
#: TF 2.21 took a 2-layer BERT-like training graph from 83 to 103 casts, Cast share 22.5%).
#: TF 2.15's BF16 Mean accumulates in BF16, so on TF 2.15 both stay black.  FP16 keeps
#: them black (CANN).  Grappler's oneDNN BF16 AMP: Mean deny on 2.15, Mean and Sum infer
#: on 2.21 (its 2.15 infer list has "Sum" "Tanh" without a comma: "SumTanh").
BF16_GRAY_REDUCTIONS = {
    "Mean": "BF16 has FP32's range and this TF's BF16 Mean accumulates in FP32 (only the result is "
            "rounded); a global average pool or norm statistics then need no FP32 round trip",
    "Sum": "BF16 has FP32's range and its BF16 kernel accumulates in FP32 (only the result is rounded); "
           "follows its producers together with Mean (a norm's backward sums land with its forward means)",
}

#: stateful ops the precision pass paints like the ops of its lists instead of fixing them: their
#: type attrs are the dtypes of plain tensor inputs only (the variables they update are resource
#: inputs and keep their FP32), so following a BF16 producer only drops a widening Cast in front
#: (``precision/amp.py`` ``_op_meta``; issue 18j).
STATEFUL_PAINTABLE = {
    "ResourceApplyMomentumMixed": "T is the gradient's dtype; var/accum are FP32 resources",
}

GRAY = {
    "Add": "elementwise arithmetic",
    "AddV2": "elementwise arithmetic",
    "AddN": "elementwise sum of few tensors",
    "AddRelu": "fused relu(a + b) (fusion rule bf16_add_relu): elementwise, as AddV2 and Relu",
    "AddNReluGrad": "fused ReluGrad(AddN(a, b)) (fusion rule bf16_addn_relu_grad): elementwise",
    "JoinGradSum": "a batch-None residual join's input gradient (fusion rule bf16_join_grad_sum): the "
                   "gradient itself, or its FP32 sum over a broadcast leading dim",
    "BatchNormGradNHWC": "fused batch-norm gradient (bf16_*bn_grad rules): FP32 sums inside, FP32 "
                         "scale/statistics inputs, as FusedBatchNormGradV3",
    "GeluErf": "fused exact GELU (fusion rule bf16_gelu): elementwise, FP32 erf inside, as Erf/Mul",
    "GeluErfGrad": "fused exact-GELU gradient (bf16_gelu): elementwise, FP32 exp/erf inside",
    "ResourceApplyMomentumMixed": "momentum update (fusion rule bf16_apply_momentum): T is the gradient's "
                                  "dtype only (widened exactly inside); var and accum stay FP32",
    "Sub": "elementwise arithmetic",
    "Mul": "elementwise arithmetic",
    "RealDiv": "elementwise arithmetic",
    "Div": "elementwise arithmetic",
    "DivNoNan": "elementwise arithmetic",
    "Neg": "elementwise arithmetic",
    "Abs": "elementwise arithmetic",
    "Square": "elementwise arithmetic",
    "SquaredDifference": "elementwise arithmetic",
    "Sqrt": "elementwise, bounded range",
    "Rsqrt": "elementwise, bounded range",
    "Reciprocal": "elementwise arithmetic",
    "Maximum": "elementwise comparison",
    "Minimum": "elementwise comparison",
    "BiasAdd": "per-channel add",
    "BiasAddV1": "per-channel add",
    "BiasAddGrad": "per-channel reduction of the bias gradient",
    "Tanh": "activation, bounded output",
    "TanhGrad": "activation gradient",
    "Sigmoid": "activation, bounded output",
    "SigmoidGrad": "activation gradient",
    "Elu": "activation",
    "EluGrad": "activation gradient",
    "Selu": "activation",
    "SeluGrad": "activation gradient",
    "LeakyRelu": "activation",
    "LeakyReluGrad": "activation gradient",
    "Softplus": "activation",
    "SoftplusGrad": "activation gradient",
    "Softsign": "activation",
    "Erf": "activation (GELU)",
    "Erfc": "activation (GELU as 0.5*x*erfc(-x/sqrt2), TF >= 2.16)",
    "Gelu": "activation",
    "FusedBatchNorm": "statistics kept in FP32 by the op itself (U=float)",
    "FusedBatchNormV2": "statistics kept in FP32 by the op itself (U=float)",
    "FusedBatchNormV3": "statistics kept in FP32 by the op itself (U=float)",
    "FusedBatchNormGrad": "statistics kept in FP32 by the op itself (U=float)",
    "FusedBatchNormGradV2": "statistics kept in FP32 by the op itself (U=float)",
    "FusedBatchNormGradV3": "statistics kept in FP32 by the op itself (U=float)",
    "_FusedBatchNormEx": "batch norm + Relu that fusion emits under oneDNN; statistics in FP32 (U=float)",
    "AvgPool": "window average of few values",
    "AvgPoolGrad": "gradient of a window average",
    "AvgPool3D": "window average of few values",
    "ClipByValue": "elementwise clamp",
    "Floor": "elementwise rounding",
    "Ceil": "elementwise rounding",
    "Round": "elementwise rounding",
    "Sign": "elementwise",
    "SquaredDifferenceGrad": "elementwise",
    "Sin": "elementwise, bounded output",
    "Cos": "elementwise, bounded output",
}

CLEAR = {
    "TransData": "layout conversion moves data, keeps the dtype",
    "Identity": "data movement",
    "IdentityN": "data movement",
    "Snapshot": "data movement",
    "StopGradient": "data movement",
    "PreventGradient": "data movement",
    "Reshape": "data movement",
    "Transpose": "data movement",
    "ConjugateTranspose": "data movement",
    "Squeeze": "data movement",
    "ExpandDims": "data movement",
    "Concat": "data movement",
    "ConcatV2": "data movement",
    "Pack": "data movement",
    "Unpack": "data movement",
    "Split": "data movement",
    "SplitV": "data movement",
    "Slice": "data movement",
    "StridedSlice": "data movement",
    "StridedSliceGrad": "data movement",
    "Tile": "data movement",
    "Pad": "data movement",
    "PadV2": "data movement",
    "MirrorPad": "data movement",
    "Gather": "data movement",
    "GatherV2": "data movement",
    "GatherNd": "data movement",
    "BroadcastTo": "data movement",
    "Reverse": "data movement",
    "ReverseV2": "data movement",
    "DepthToSpace": "data movement",
    "SpaceToDepth": "data movement",
    "ExtractImagePatches": "data movement (copies windows, pads with zeros)",
    "Relu": "max(x, 0) is exact in any precision",
    "Relu6": "clamp is exact in any precision",
    "ReluGrad": "masking is exact in any precision",
    "Relu6Grad": "masking is exact in any precision",
    "MaxPool": "max is exact in any precision",
    "MaxPoolV2": "max is exact in any precision",
    "MaxPool3D": "max is exact in any precision",
    "MaxPoolGrad": "routes gradients; exact",
    "MaxPoolGradV2": "routes gradients; exact",
    "Max": "max reduction is exact",
    "Min": "min reduction is exact",
    "Select": "data movement",
    "SelectV2": "data movement",
    "ZerosLike": "constant fill",
    "OnesLike": "constant fill",
    "Fill": "constant fill",
    "CheckNumerics": "passes its input through",
    "Switch": "conditional (tf.cond/smart_cond lowered): routes data; loop Switches are fixed",
    "Merge": "conditional (tf.cond/smart_cond lowered): forwards the taken branch; loop Merges are fixed",
    "EnsureShape": "passes its input through",
}

LIST_NAMES = ("white", "black", "gray", "clear")
_MIXLIST_TO_LIST = {"white-list": "white", "black-list": "black", "gray-list": "gray"}


def default_lists() -> dict[str, dict[str, str]]:
    """Fresh copies of the four default lists: list name -> {op type: reason}."""
    return {"white": dict(WHITE), "black": dict(BLACK), "gray": dict(GRAY), "clear": dict(CLEAR)}


def resolve_lists(white_add=(), black_add=(), gray_add=(), mixlist=None, mixlist_name=None):
    """Apply custom lists and a parsed modify_mixlist to the defaults.

    Returns list name -> {op type: reason}.  Custom additions move an op out of
    its default list.  An op that the *user* puts in two lists (custom lists
    and mixlist together) raises :class:`MixlistError`.
    """
    lists = default_lists()
    requested: dict[str, str] = {}
    where_of: dict[str, str] = {}

    def request(op, target, where):
        if op in requested and requested[op] != target:
            raise MixlistError(
                f"op '{op}' is put in two lists: {requested[op]} ({where_of[op]}) "
                f"and {target} ({where}); an op may be in one list only")
        requested[op] = target
        where_of[op] = where

    for op in white_add:
        request(op, "white", "custom_white_list")
    for op in black_add:
        request(op, "black", "custom_black_list")
    for op in gray_add:
        request(op, "gray", "custom_gray_list")
    removals = []
    if mixlist:
        src = f"modify_mixlist '{mixlist_name}'" if mixlist_name else "modify_mixlist"
        for key, body in mixlist.items():
            target = _MIXLIST_TO_LIST[key]
            for op in body.get("to-add", ()):
                request(op, target, f"{src} {key}.to-add")
            for op in body.get("to-remove", ()):
                if op in body.get("to-add", ()):
                    raise MixlistError(f"{src}: op '{op}' is both in {key}.to-add and {key}.to-remove")
                removals.append((target, op))
    for target, op in removals:
        # CANN: an op removed from the white or black list becomes gray
        # (GE: no precision_reduce flag); removed from gray it is unlisted
        if lists[target].pop(op, None) is not None and target != "gray" and op not in requested:
            lists["gray"][op] = f"user: modify_mixlist {target}-list.to-remove (CANN: removed ops are gray)"
    for op, target in requested.items():
        for name in LIST_NAMES:
            lists[name].pop(op, None)
        lists[target][op] = f"user: {where_of[op]}"
    return lists


def lists_for(options) -> dict[str, dict[str, str]]:
    """:func:`resolve_lists` for an options-like object (attributes
    ``custom_*_list``, ``mixlist``, ``modify_mixlist``); defaults when None.
    Passes that run before the precision pass (unfuse, fusion) use it to
    predict which list an op will be in."""
    get = (lambda k, d=None: getattr(options, k, d)) if options is not None else (lambda k, d=None: d)
    return resolve_lists(
        white_add=get("custom_white_list", ()) or (),
        black_add=get("custom_black_list", ()) or (),
        gray_add=get("custom_gray_list", ()) or (),
        mixlist=get("mixlist"),
        mixlist_name=get("modify_mixlist"))
