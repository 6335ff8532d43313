"""GE / CANN op type names -> the TensorFlow op types they are parsed from.

A ``modify_mixlist`` file or a ``custom_*_list`` written for Ascend names
*GE* op types (what GE's graph holds after the TF parser), not TF ones:
``SoftmaxV2`` instead of ``Softmax``, ``MatMulV2`` instead of ``MatMul``,
``ReduceSumD`` instead of ``Sum``.  This table maps each GE type back to the
TF op type(s) GE's TensorFlow parser builds it from, so such a file acts on a
TF graph here exactly where it would act on the NPU.

Sources (read, not copied):

* CANN TF parser plugins, ``REGISTER_CUSTOM_OP("<GE type>").FrameworkType(
  TENSORFLOW).OriginOpType("<TF type>")`` (e.g. ``SoftmaxV2`` <- ``Softmax``,
  ``MatMulV2`` <- ``MatMul``; the ``*D`` variants are the constant-folded
  forms of ``Reduce*`` / ``Concat`` / ``Split`` / ``Pad`` / ``Tile``...);
* the CANN operator list "TensorFlow operator -> Ascend operator" table and
  the mixed-precision op lists (``ops_info`` ``precision_reduce`` flags);
* tf_adapter ``npu_bridge`` (``npu_rnn`` / ``npu_ops``) for the GE-only types.

A GE type that maps to ``()`` exists only as an NPU fused kernel with no TF
counterpart in a stock graph (e.g. ``DynamicRNN``): a list entry naming it is
reported as a warning, never silently dropped.

Names that are not in this table are taken as TF op types when TF (or this
plugin's lists) knows them; anything else is an error naming the entry.
"""
from __future__ import annotations

#: GE op type -> TF op types (one entry per line: GE name: (TF types), source)
GE_TO_TF: dict[str, tuple[str, ...]] = {
    # cube (matrix) ops
    "MatMulV2": ("MatMul",),                      # parser: MatMul -> MatMulV2
    "MatMulV3": ("MatMul",),
    "BatchMatMul": ("BatchMatMul",),
    "BatchMatMulV2": ("BatchMatMulV2", "BatchMatMulV3"),  # TF BatchMatMulV2/V3 -> GE BatchMatMulV2
    "BatchMatMulV3": ("BatchMatMulV3",),
    "FullyConnection": ("MatMul",),
    "Conv2DBackpropInputD": ("Conv2DBackpropInput",),
    "Conv2DBackpropFilterD": ("Conv2DBackpropFilter",),
    "Conv3DBackpropInputD": ("Conv3DBackpropInputV2",),
    "Conv3DBackpropFilterD": ("Conv3DBackpropFilterV2",),
    "DepthwiseConv2D": ("DepthwiseConv2dNative",),
    "DepthwiseConv2DBackpropInputD": ("DepthwiseConv2dNativeBackpropInput",),
    "DepthwiseConv2DBackpropFilterD": ("DepthwiseConv2dNativeBackpropFilter",),
    "DepthwiseConv2DBackpropInput": ("DepthwiseConv2dNativeBackpropInput",),
    "DepthwiseConv2DBackpropFilter": ("DepthwiseConv2dNativeBackpropFilter",),
    # softmax family
    "SoftmaxV2": ("Softmax",),                    # parser: Softmax -> SoftmaxV2 (axes attr)
    "LogSoftmaxV2": ("LogSoftmax",),
    "SoftmaxGrad": ("ScaleMaskSoftmaxGrad",),     # GE's backward kernel; TF builds it from Mul/Sum/Sub
    # reductions: the *D forms carry the axes as an attribute
    "ReduceSum": ("Sum",),
    "ReduceSumD": ("Sum",),
    "ReduceMean": ("Mean",),
    "ReduceMeanD": ("Mean",),
    "ReduceMax": ("Max",),
    "ReduceMaxD": ("Max",),
    "ReduceMin": ("Min",),
    "ReduceMinD": ("Min",),
    "ReduceProd": ("Prod",),
    "ReduceProdD": ("Prod",),
    "ReduceAll": ("All",),
    "ReduceAllD": ("All",),
    "ReduceAny": ("Any",),
    "ReduceAnyD": ("Any",),
    "SquareSumV1": ("L2Loss",),
    # batch norm: GE splits FusedBatchNorm* into BN training ops
    "BatchNorm": ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"),
    "BNTrainingReduce": ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"),
    "BNTrainingUpdate": ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"),
    "BNInfer": ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"),
    "BatchNormGrad": ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"),
    "BNTrainingReduceGrad": ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"),
    "BNTrainingUpdateGrad": ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"),
    # elementwise with GE-specific names
    "Add": ("Add", "AddV2"),                      # TF AddV2 -> GE Add
    "Axpy": ("AddV2",),
    "Power": ("Pow",),
    "ReluV2": ("Relu",),
    "ReluGradV2": ("ReluGrad",),
    "FastGelu": ("Gelu",),
    "FastGeluGrad": (),                           # TF differentiates Gelu into elementwise ops
    "GeluGrad": (),
    "ClipByValue": ("ClipByValue",),
    "LayerNormBetaGammaBackprop": ("LayerNormGrad",),
    "LayerNormXBackprop": ("LayerNormGrad",),
    "LayerNormV3": ("LayerNorm",),
    "BiasAddGrad": ("BiasAddGrad",),
    "Pooling": ("MaxPool", "AvgPool"),
    "MaxPoolV3": ("MaxPool", "MaxPoolV2"),
    "AvgPoolV2": ("AvgPool",),
    # shape / data movement: *D forms with constant attributes
    "ConcatD": ("Concat", "ConcatV2"),
    "ConcatV2D": ("ConcatV2",),
    "SplitD": ("Split",),
    "SplitVD": ("SplitV",),
    "PadD": ("Pad",),
    "PadV2D": ("PadV2",),
    "TileD": ("Tile",),
    "TransposeD": ("Transpose",),
    "StridedSliceD": ("StridedSlice",),
    "StridedSliceGradD": ("StridedSliceGrad",),
    "SliceD": ("Slice",),
    "GatherV2D": ("GatherV2",),
    "BroadcastToD": ("BroadcastTo",),
    "ReverseV2D": ("ReverseV2",),
    "ExpandDims": ("ExpandDims",),
    "SoftmaxCrossEntropyWithLogits": ("SoftmaxCrossEntropyWithLogits",),
    "SparseSoftmaxCrossEntropyWithLogits": ("SparseSoftmaxCrossEntropyWithLogits",),
    # GE-only fused kernels: no TF op type in a stock graph (reported)
    "DynamicRNN": (),                             # npu_bridge npu_rnn.DynamicRNN
    "DynamicRNNV2": (),
    "DynamicGRUV2": (),
    "BasicLSTMCell": (),
    "DropOutDoMask": (),                          # npu_ops.dropout on the NPU
    "DropOutGenMask": (),
    "FlashAttentionScore": (),
    "PromptFlashAttention": (),
    "Conv2DTransposeD": ("Conv2DBackpropInput",),
}


def lookup(name: str):
    """``(tf_types, known)``: the TF types a GE name stands for; ``known`` is
    False when the table has no entry (the caller then treats ``name`` as a
    TF op type if TF knows it)."""
    if name in GE_TO_TF:
        return GE_TO_TF[name], True
    return (name,), False


def is_tf_op(name: str, extra=()) -> bool:
    """True when ``name`` is an op type registered with TensorFlow (or one of
    ``extra``, e.g. the plugin's own list entries whose ops load later)."""
    if name in extra:
        return True
    try:
        from .. import _tf

        return _tf.op_def(name) is not None
    except Exception:  # noqa: BLE001 - a registry problem: accept the name
        return True


def map_names(names, extra=()):
    """Map a sequence of list entries (GE or TF names) to TF op types.

    Returns ``(tf_types, unmapped, unknown)``: ``tf_types`` in order without
    duplicates; ``unmapped`` the GE names with no TF counterpart;
    ``unknown`` the names that are neither GE types in the table nor TF op
    types.
    """
    out, unmapped, unknown = [], [], []
    for name in names:
        types, known = lookup(name)
        if known and not types:
            unmapped.append(name)
            continue
        if not known and not is_tf_op(name, extra):
            unknown.append(name)
            continue
        for t in types:
            if t not in out:
                out.append(t)
    return tuple(out), tuple(unmapped), tuple(unknown)
