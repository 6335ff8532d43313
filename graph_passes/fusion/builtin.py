"""Built-in fusion rules (graph_level 2 and 3).  One entry per rule, each with a reason.

level 3  ``bn_fold``            Conv2D/Depthwise [+BiasAdd] -> FusedBatchNorm(inference, constants)
                                 => Conv2D(W*s) + BiasAdd((b-mean)*s+offset)
level 2  ``bias_gelu_exact``    MatMul + BiasAdd + GELU(erf)      => _FusedMatMul[BiasAdd,GeluExact]
level 2  ``bias_gelu_tanh``     MatMul + BiasAdd + GELU(tanh)     => _FusedMatMul[BiasAdd,GeluApproximate]
level 2  ``bias_add_act``       Conv2D + BiasAdd + Add(same-shape side input) + Relu|Relu6|Elu|LeakyRelu
                                 => _FusedConv2D[BiasAdd,Add,<act>] (oneDNN only; the residual unit)
level 2  ``bias_add``           Conv2D/MatMul + BiasAdd + Add(same-shape side input)
                                 => _FusedConv2D/_FusedMatMul[BiasAdd,Add] (oneDNN only)
level 2  ``bn_act``             FusedBatchNorm/V2/V3 (training or inference) + Relu
                                 => _FusedBatchNormEx(activation_mode=Relu) (oneDNN only)
level 2  ``bias_act``           Conv2D/Depthwise/MatMul + BiasAdd + Relu|Relu6|Elu|LeakyRelu
                                 => _FusedConv2D/_FusedDepthwiseConv2dNative/_FusedMatMul
level 2  ``bias``               Conv2D/Depthwise/MatMul + BiasAdd => the same fused ops [BiasAdd]
level 2  ``layer_norm_moments`` tf.nn.moments + tf.nn.batch_normalization (BERT)   => LayerNorm
level 2  ``layer_norm_keras3``  Keras 3 LayerNormalization (moments, Neg)          => LayerNorm
level 2  ``layer_norm_keras2``  Keras 2 LayerNormalization (reshape + FusedBatchNormV3) => LayerNorm
level 2  ``layer_norm``         LayerNorm / RMSNorm in plain ops (raw, reduce_mean, moments,
                                 sqrt/div, reduce_variance; T5/LLaMA RMSNorm) => LayerNorm / RMSNorm
level 2  ``filter_grad_1x1``    Conv2DBackpropFilter of a 1x1 conv (any stride), BF16 under oneDNN
                                 => Reshape -> MatMul(transpose_a) -> Reshape (oneDNN's BF16
                                 weight-gradient kernel is 1.4-24x slower than its BF16 matmul)
level 2  ``filter_grad_im2col`` Conv2DBackpropFilter of a kxk conv with few output positions
                                 (<= 16, or <= 49 with >= 512 input channels), BF16 under oneDNN
                                 => ExtractImagePatches -> Reshape -> MatMul(transpose_a) -> Reshape
level 2  ``bias_grad_bn_zero``  BiasAddGrad of a training batch norm's dx (BF16 plan, oneDNN) => zero Const
                                 (exactly zero: the norm removes any per-channel shift; bias_grad.py)
level 2  ``bias_grad_matmul``   BiasAddGrad of a BF16 gradient, under oneDNN => ones[1,M] x Reshape(dy,[M,C])
                                 as one BF16 MatMul (measured 1.8x faster, FP32 accumulation; bias_grad.py)
level 2  ``strided_subsample`` StridedSlice x[:, ::sh, ::sw, :] (H, W divisible) => Reshape -> Slice -> Reshape
                                 (measured 9-33x faster, same values; subsample.py)
level 2  ``bf16_add_relu``      Relu(AddV2(a, b)) (one rank, equal known dims but the leading one, which may be
                                 unknown; AddRelu broadcasts a leading 1 as AddV2), BF16 plan, CPU => AddRelu
level 2  ``bf16_join_grad_sum`` such an add's gradient Reshape(Sum(g, BroadcastGradientArgs(..)[i]), Shape(x_i)),
                                 BF16 plan, CPU => JoinGradSum(g, Shape(x_i)) (gray: no FP32 island)
level 2  ``bf16_addn_relu_grad`` ReluGrad(AddN(a, b), f), BF16 plan, CPU => AddNReluGrad (bit-equal)
level 2  ``bf16_relu_bn_grad``  FusedBatchNormGradV3(ReluGrad(g, f), ...) training NHWC, BF16 plan, CPU
                                 => BatchNormGradNHWC(num_relu=1); ``bf16_bn_grad`` the same without
                                 the ReluGrad (N*H*W >= 1024)  (custom_ops/bf16_elementwise.cc; 1.5-2.4x
                                 faster than TF's BF16 ops; bf16_elementwise.py)
level 2  ``bf16_gelu``           exact GELU (erf/erfc forms) + its autodiff gradient, BF16 plan, CPU => GeluErf /
                                 GeluErfGrad (custom_ops/gelu.cc); ``bf16_attention_train`` ``attention_train``
                                 at level 2 under a BF16 plan (bf16_transformer.py)
level 2  ``bf16_apply_momentum`` ResourceApplyMomentum / ResourceApplyKerasMomentum (FP32 variable), BF16 plan,
                                 CPU => ResourceApplyMomentumMixed (gray in the gradient's T: reads a BF16
                                 gradient without the widening Cast; bit-identical; bf16_apply.py)
level 2  ``batch_norm_moments`` training batch norm as moments + arithmetic (Keras 3, tf.nn.moments),
                                 BF16 under oneDNN => FusedBatchNormV3 / FusedBatchNormGradV3 (batch_norm.py)
level 3  ``attention``          BatchMatMul/Einsum -> scale (q, k or scores) -> [mask add | where]
                                 -> Softmax -> BatchMatMul/Einsum
                                 => the products stay, ScaleMaskSoftmax in between

"BiasAdd" also means ``Add``/``AddV2`` of a 1-D bias (or a [1,..,1,C] reshape of one)
along the last dim, as Keras 3 writes it.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from .. import _tf, registry
from ..graph import parse_tensor, tensor_name
from ..pattern import Pat
from .core import Skip, const_value, planned_dtype, register_fusion_rule, scalar_value

MATRIX_OPS = ("Conv2D", "DepthwiseConv2dNative", "MatMul")
FUSED_OP = {"Conv2D": "_FusedConv2D", "DepthwiseConv2dNative": "_FusedDepthwiseConv2dNative",
            "MatMul": "_FusedMatMul"}
BMM_OPS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def onednn_enabled() -> bool:
    """Whether TF's oneDNN graph rewrite is on in this process (it turns
    ``_Fused*`` ops into oneDNN kernels, which accept more activations).

    TF has no public API for this; :func:`graph_passes._tf.onednn_enabled`
    asks TF's private probe (with the documented environment-variable rule as
    the fallback)."""
    return _tf.onednn_enabled()


#: fused_ops the CPU kernels accept (measured on TF 2.15 and 2.21; see docs/fusion.md)
_EIGEN = {"Conv2D": {"", "Relu", "Relu6", "Elu", "LeakyRelu"},
          "MatMul": {"", "Relu", "Relu6", "Elu", "LeakyRelu"},
          "DepthwiseConv2dNative": set()}
_ONEDNN = {"Conv2D": {"", "Relu", "Relu6", "Elu", "LeakyRelu"},
           "MatMul": {"", "Relu", "Relu6", "Elu", "LeakyRelu", "GeluExact", "GeluApproximate"},
           "DepthwiseConv2dNative": {"", "Relu", "Relu6", "Elu"}}


#: activations after BiasAdd + Add (a same-shape side input, e.g. a residual) that a fused
#: kernel accepts: only oneDNN's (TF's Eigen _FusedConv2D/_FusedMatMul refuse "Add" with
#: "Fusion is not implemented: [BiasAdd,Add,Relu]").  Measured on TF 2.15.1 and 2.21.0 in FP32
#: and BF16 (benchmarks/onednn_forms.py: numerics vs the unfused ops; tests/test_fusion_onednn.py
#: on real models); "" = no activation.
#: MatMul takes no activation after Add: "MklFusedMatMul must have 2 post-arguments at most".
#: TF's remapper fuses the same (FindContractionWithBiasAddAndAdd / ...AndAddActivation).
_ONEDNN_SIDE_ADD = {"Conv2D": {"", "Relu", "Relu6", "Elu", "LeakyRelu"},
                    "MatMul": {""}}

#: FusedBatchNorm + activation -> _FusedBatchNormEx: oneDNN's kernel takes activation Relu and
#: no side input ("_MKLFusedBatchNorm do not support side input"); TF's Eigen CPU kernel takes
#: neither (remapper: "We fuse FusedBatchNorm on GPU or oneDNN CPU").  Measured: FP32 and BF16,
#: is_training true and false, TF 2.15.1 and 2.21.0 -> _MklNativeFusedBatchNormEx.
_ONEDNN_BN_ACTIVATIONS = {"Relu"}
_BN_OPS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")


def supported_activations(op: str, device_type: str = "CPU") -> set:
    if device_type != "CPU":
        return {"", "Relu", "Relu6", "Elu", "LeakyRelu"} if op != "DepthwiseConv2dNative" else {""}
    return (_ONEDNN if onednn_enabled() else _EIGEN)[op]


# ------------------------------------------------------------------ bias part
def _mm_pat():
    """The matrix op, or MatMul seen through the Reshape of ``tf.tensordot``
    (Keras 2 and Keras 3 Dense on a 3-D input: Reshape -> MatMul -> Reshape)."""
    return Pat.one_of(Pat(MATRIX_OPS, name="mm"),
                      Pat("Reshape", name="rs", inputs=[Pat("MatMul", name="mm"), Pat.any("rs_shape")]))


def _bias_pat():
    return Pat.one_of(
        Pat("BiasAdd", name="bias", inputs=[_mm_pat(), Pat.any("b")]),
        Pat(("AddV2", "Add"), name="bias", commutative=True, inputs=[_mm_pat(), Pat.any("b")]))


def _bias_input(m, b) -> str:
    """The 1-D bias tensor for the fused op (emits a Reshape for [1,..,1,C])."""
    bias = m["bias"]
    if bias.op == "BiasAdd":
        fmt = bias.attr["data_format"].s.decode() if "data_format" in bias.attr else "NHWC"
        b.require(fmt == "NHWC", f"BiasAdd data_format {fmt} (fused kernels take NHWC)")
        return m["b"]
    shape = b.shape(m["b"])
    out = b.shape(m["rs"].name if "rs" in m.nodes else m["mm"].name)
    b.require(shape is not None and len(shape) >= 1 and shape[-1] > 0,
              "bias of the Add has an unknown shape")
    b.require(all(d == 1 for d in shape[:-1]), f"Add operand of shape {shape} is not a bias")
    b.require(out is not None and len(out) >= len(shape) and out[-1] == shape[-1],
              f"Add operand {shape} does not match the last dim of {out}")
    if len(shape) == 1:
        return m["b"]
    shp = b.const_node(f"{m.anchor}/FusedBias/shape", [-1], registry.types_pb2.DT_INT32)
    return b.emit("Reshape", f"{m.anchor}/FusedBias", [m["b"], shp],
                  {"T": ("type", b.dtype(m["b"])), "Tshape": ("type", registry.types_pb2.DT_INT32)})


def _require_onednn_cpu(b, what: str):
    """The oneDNN-only CPU fusions (``bias_add``, ``bias_add_act``, ``bn_act``):
    they exist only as oneDNN CPU kernels, and GE's 5HD layout emulation
    (``format_mode='NC1HWC0'``) works on the plain GE op set, which they are not."""
    problem = _onednn_cpu_problem(b.device_type(), b.ctx, what)
    b.require(problem is None, problem)


def _onednn_cpu_problem(dev: str, ctx, what: str):
    """Why :func:`_require_onednn_cpu` refuses ``what`` on device type ``dev``, or None."""
    if not (dev == "CPU" and onednn_enabled()):
        return (f"{what} runs only as a oneDNN CPU kernel "
                f"(device {dev}, oneDNN {'on' if onednn_enabled() else 'off'})")
    fmt = ctx.option("format_mode", "origin") if ctx is not None else "origin"
    if str(fmt).upper() == "NC1HWC0":
        return f"{what}: a oneDNN-only CPU fusion, not done with format_mode=NC1HWC0 (GE's op set)"
    return None


#: (issue 17p) the bias family asks for the fused op's kernel in the planned
#: dtype right after it is known (:func:`_fused_checks`), before the side
#: input's and the bias's shape walks and the rest of the build
#: (``Builder.stop_if_kernel_missing``; with ``core.EARLY_KERNEL_MISS``).  The
#: graph is the same (such a match is skipped either way); a match that would
#: also have failed a later check of the build (side-input or bias shape,
#: tensordot Reshape) is reported with the missing kernel and its warning
#: instead.  False (or ``core.EARLY_KERNEL_MISS`` False): the reference (the
#: checks in their order; 17o's stop right before the emission).
KERNEL_FIRST = True


def _fused_checks(m, b, act: str, side: bool) -> int:
    """The checks of :func:`_emit_fused` that need no shape: activation and
    side input supported, data format, black-listed activation, and the
    fused kernel in the planned dtype (a requirement).  Returns the matrix
    op's T."""
    mm = m["mm"]
    dev = b.device_type()
    if not side:
        ok = supported_activations(mm.op, dev)
        b.require(act in ok, f"{FUSED_OP[mm.op]} on {dev} (oneDNN {'on' if onednn_enabled() else 'off'}) "
                             f"does not support activation {act or 'none'}")
    else:
        _require_onednn_cpu(b, f"{FUSED_OP[mm.op]}[BiasAdd,Add]")
        b.require(act in _ONEDNN_SIDE_ADD.get(mm.op, ()),
                  f"oneDNN's {FUSED_OP[mm.op]} does not fuse BiasAdd+Add+{act or 'none'}")
    dt = mm.attr["T"].type
    if mm.op != "MatMul":
        fmt = mm.attr["data_format"].s.decode() if "data_format" in mm.attr else "NHWC"
        b.require(fmt == "NHWC", f"{mm.op} data_format {fmt}: the fused CPU kernel takes NHWC")
    run_dt = planned_dtype(b.ctx, mm.op, mm.name, dt)
    if run_dt != dt and act:
        from .core import _black_ops
        b.require(act not in _black_ops(b.ctx),
                  f"activation {act} is black-listed: fusing it into a low-precision "
                  f"{FUSED_OP[mm.op]} would run it in {registry.dtype_name(run_dt)}")
    if run_dt != dt:
        b.require_kernel(FUSED_OP[mm.op], {"T": run_dt},
                         f"the precision pass will run {mm.op} '{mm.name}' in {registry.dtype_name(run_dt)}")
    return dt


def _kernel_first(m, b, act: str, side: bool) -> bool:
    """:data:`KERNEL_FIRST`: run :func:`_fused_checks` now and stop the build
    if the planned-dtype kernel is missing; True when it ran (the caller passes
    ``checked=True`` to :func:`_emit_fused`)."""
    from . import core

    if not (KERNEL_FIRST and core.EARLY_KERNEL_MISS):
        return False
    _fused_checks(m, b, act, side)
    b.stop_if_kernel_missing()
    return True


def _emit_fused(m, b, act: str, extra_attrs=None, side: str | None = None, checked: bool = False):
    """Emit the fused matrix op for the match (``side``: a same-shape tensor
    added after the bias, fused as ``[BiasAdd, Add, act]`` with a second arg).
    ``checked``: :func:`_fused_checks` already ran for this build."""
    mm = m["mm"]
    if checked:
        dt = mm.attr["T"].type
    else:
        dt = _fused_checks(m, b, act, side is not None)
    bias = _bias_input(m, b)
    fused = FUSED_OP[mm.op]
    od = registry.op_def(fused)
    names = {a.name for a in od.attr} if od is not None else set()
    attrs = {k: v for k, v in mm.attr.items() if k in names}
    attrs["T"] = ("type", dt)
    args = [bias] if side is None else [bias, side]
    attrs["num_args"] = len(args)
    if "TArgs" in names:
        attrs["TArgs"] = ("types", [dt] * len(args))
    attrs["fused_ops"] = ["BiasAdd"] + (["Add"] if side is not None else []) + ([act] if act else [])
    attrs["epsilon"] = 0.0001
    attrs.update(extra_attrs or {})
    data = b.graph.data_inputs(mm)
    if "rs" not in m.nodes:
        # (the anchor's name, one output, no inner reader outside the match: nothing
        # but the kernels can refuse it after this point)
        b.stop_if_kernel_missing()
        b.emit(fused, m.anchor, [data[0], data[1]] + args, attrs)
        return
    b.require(side is None, "a side input after a tensordot Reshape is not fused")
    # tensordot: bias and activation act on the last dim, which the Reshape keeps;
    # fuse on the 2-D MatMul (it keeps its name) and reshape its result instead
    rs = m["rs"]
    s2, s3 = b.shape(mm.name), b.shape(rs.name)
    b.require(s2 is not None and s3 is not None and len(s2) == 2 and s2[-1] > 0 and s3[-1] == s2[-1],
              f"the Reshape of '{mm.name}' ({s2} -> {s3}) does not keep the last dim")
    b.stop_if_kernel_missing()
    b.emit(fused, mm.name, [data[0], data[1], bias], attrs)
    b.emit("Reshape", m.anchor, [mm.name, m["rs_shape"]],
           {"T": ("type", dt), "Tshape": rs.attr["Tshape"]})


def _build_bias(m, b):
    _emit_fused(m, b, "", checked=_kernel_first(m, b, "", False))


def _build_bias_act(m, b):
    act = b.anchor.op
    extra = {}
    if act == "LeakyRelu":
        extra["leakyrelu_alpha"] = float(b.anchor.attr["alpha"].f) if "alpha" in b.anchor.attr else 0.2
    _emit_fused(m, b, act, extra, checked=_kernel_first(m, b, act, False))


def _side_input(m, b) -> str:
    """The residual operand of ``Add(BiasAdd(contraction), side)``: same shape
    and dtype as the biased result (the fused kernel does not broadcast; TF's
    remapper asks the same: IsAddWithNoBroadcast)."""
    side, out = m["side"], m["bias"].name
    s1, s2 = b.shape(side), b.shape(out)
    b.require(s1 is not None and s2 is not None and s1 == s2 and min(s1, default=0) >= 0,
              f"Add operands have shapes {s2} and {s1}: the fused kernel takes a same-shape side input")
    b.require(b.dtype(side) == b.dtype(out), "the Add operands differ in dtype")
    b.require(parse_tensor(side)[0] not in (m["mm"].name, m["bias"].name), "the side input is the matched op")
    return side


def _build_bias_add(m, b):
    checked = _kernel_first(m, b, "", True)
    _emit_fused(m, b, "", side=_side_input(m, b), checked=checked)


def _build_bias_add_act(m, b):
    act = b.anchor.op
    extra = {}
    if act == "LeakyRelu":
        extra["leakyrelu_alpha"] = float(b.anchor.attr["alpha"].f) if "alpha" in b.anchor.attr else 0.2
    checked = _kernel_first(m, b, act, True)
    _emit_fused(m, b, act, extra, side=_side_input(m, b), checked=checked)


def _conv_mm_bias_pat(ops):
    """``BiasAdd(op)`` or a 1-D-bias ``Add(op, b)`` (no tensordot Reshape)."""
    return Pat.one_of(
        Pat("BiasAdd", name="bias", inputs=[Pat(ops, name="mm"), Pat.any("b")]),
        Pat(("AddV2", "Add"), name="bias", commutative=True, inputs=[Pat(ops, name="mm"), Pat.any("b")]))


def _side_add_pat(ops):
    return Pat(("AddV2", "Add"), name="add", commutative=True,
               inputs=[_conv_mm_bias_pat(ops), Pat.any("side")])


def _bn_act_predicate(node, graph):
    if node.op not in _ONEDNN_BN_ACTIVATIONS or not node.input:
        return False
    src, port, ctrl = parse_tensor(node.input[0])
    bn = graph.nodes.get(src)
    return bn is not None and not ctrl and port == 0 and bn.op in _BN_OPS


def _bn_act_plan_problem(ctx):
    """Why no batch norm + activation fuses under this run's precision plan, or None."""
    plan = _precision_plan(ctx)
    if plan is None or not plan.lowers_matrix_ops or plan.low != registry.DT_HALF:
        return None
    return (f"in {plan.mode} the batch norm follows its FP16 producers, "
            "and oneDNN's fused batch norm takes float or bfloat16 only")


def _bn_act_policy(ctx, graph):
    """:attr:`~.core.FusionRule.policy` of ``bn_act``: its build refuses every
    match under an FP16 plan (:func:`_bn_act_plan_problem`, after the oneDNN
    check, which refuses too): that reason, once per run (with
    :data:`FUSED_KERNEL_POLICY`, the bias family's switch)."""
    return _bn_act_plan_problem(ctx) if FUSED_KERNEL_POLICY else None


def _build_bn_act(m, b):
    """FusedBatchNorm(V2/V3) -> Relu  =>  _FusedBatchNormEx(activation_mode=Relu)
    under the batch norm's name (its statistics and reserve spaces keep their
    readers: moving-average updates, FusedBatchNormGradV3); the Relu's readers
    (ReluGrad included: it reads the activation output) read its output 0."""
    relu = b.anchor
    bn = b.graph.nodes[parse_tensor(relu.input[0])[0]]
    _require_onednn_cpu(b, "_FusedBatchNormEx with an activation")
    problem = _bn_act_plan_problem(b.ctx)
    b.require(problem is None, f"not fused: {problem}")
    b.require(b.device == bn.device, "the Relu and the batch norm are placed on different devices")
    readers = [(c, i) for c, i in b.graph.consumers(bn.name)
               if i >= 0 and parse_tensor(b.graph.nodes[c].input[i])[1] == 0]
    b.require(readers == [(relu.name, 0)],
              f"not fused: output 0 of '{bn.name}' is also read by "
              f"'{next((c for c, _ in readers if c != relu.name), '?')}'")
    t = bn.attr["T"].type
    b.require(t in (registry.DT_FLOAT, registry.DT_BFLOAT16),
              f"{bn.op} in {registry.dtype_name(t)}: oneDNN's fused batch norm takes float or bfloat16")
    b.require(bn.op == "FusedBatchNorm" or bn.attr["U"].type == registry.DT_FLOAT,
              "batch norm statistics (U) are not float")
    fmt = bn.attr["data_format"].s.decode() if "data_format" in bn.attr else "NHWC"
    b.require(fmt in ("NHWC", "NCHW"), f"data_format {fmt}")
    b.replace(bn.name)
    od = registry.op_def("_FusedBatchNormEx")
    names = {a.name for a in od.attr} if od is not None else set()
    lost = sorted(k for k in bn.attr if not k.startswith("_") and k not in names | {"U"})
    b.require(not lost, f"_FusedBatchNormEx has no attr {lost} of '{bn.name}'")
    attrs = {k: v for k, v in bn.attr.items() if k in names}
    attrs["T"] = ("type", t)
    attrs["U"] = ("type", registry.DT_FLOAT)
    attrs["activation_mode"] = relu.op
    attrs["num_side_inputs"] = 0
    b.emit("_FusedBatchNormEx", bn.name, list(bn.input[:5]), attrs)
    return {0: tensor_name(bn.name, 0)}


#: modes in which ``Plan.matrix_dtype`` leaves every float32 matrix op float32
_FP32_MATRIX_MODES = ("must_keep_origin_dtype", "force_fp32", "allow_fp32_to_fp16")


def bf16_matrix_policy(anchor_op: str, what: str):
    """:attr:`~.core.FusionRule.policy` of the rules that rewrite a BF16 gradient
    into a MatMul (``filter_grad_*``, ``bias_grad_*``): their builds require the
    op to run in BF16: a float32 ``anchor_op`` only does where the precision
    plan's low dtype is BF16 (``Plan.matrix_dtype`` gives float32 or the low
    dtype), one already in bfloat16 always.  So with no BF16 plan and no
    bfloat16 ``anchor_op`` in the graph no match can fuse: the reason, else None."""
    def policy(ctx, graph):
        plan = _precision_plan(ctx)
        if plan is not None and plan.low == registry.DT_BFLOAT16:
            return None
        if _has_bf16(graph, anchor_op):
            return None
        if plan is None or plan.mode in _FP32_MATRIX_MODES:
            runs = "float32"
        else:
            runs = f"{registry.dtype_name(plan.low)} or float32"
        mode = plan.mode if plan is not None else "none"
        return (f"{what} runs in {runs} (precision mode {mode}, no bfloat16 {anchor_op}): "
                f"the MatMul form is measured faster in BF16 only")
    policy.__qualname__ = f"bf16_matrix_policy({anchor_op!r})"
    return policy


#: (issue 17) :func:`fused_kernel_policy` for the bias family (``bias``,
#: ``bias_act``, ``bias_add``, ``bias_add_act``, ``bias_gelu_exact``, ``bias_gelu_tanh``; and
#: ``bn_act``'s own plan-wide refusal, :func:`_bn_act_policy`): when no matrix op of the graph
#: can get a fused kernel in the dtype it will run in, the rules are off for the
#: run (listed once in ``rules_off``) instead of matched and skipped per anchor,
#: each skip with the same warning (BERT-12 under FP16 on CPU: 98, no float16
#: ``_FusedMatMul``).  The graph is the same; False: the reference, per anchor
FUSED_KERNEL_POLICY = True
#: (issue 17) :func:`_fused_kernel_problem` asks the precision plan once per
#: (op type, dtype) of the matrix ops when no plan rule reads node names
#: (``Plan.names_matter``); False: once per node (the reference, the same answers)
PLANNED_BY_TYPE = True
#: attribute of a Graph holding the policies' answers during a fusion pass run: {"ctx", "key":
#: (version, edit mark), "answers": {(ops, side): reason or None}, "on": the (ops, side) answered
#: None once in the run (such a rule stays on)}
_FUSED_KERNEL_MEMO_ATTR = "_fusion_fused_kernel_memo"
#: the anchor op types of the bias family and the GELU forms (whose device the builds ask for a
#: kernel on)
_BIAS_FAMILY_ANCHORS = ("BiasAdd", "Add", "AddV2", "Relu", "Relu6", "Elu", "LeakyRelu", "Mul")


def fused_kernel_policy(ops, side: bool = False):
    """:attr:`~.core.FusionRule.policy` of a bias-family rule whose matrix
    position takes ``ops``: its build skips a match whose matrix op ``mm`` has
    no kernel for ``FUSED_OP[mm.op]`` in the dtype the precision plan will run
    ``mm`` in (``planned_dtype``), on the anchor's device (the kernel check of
    :func:`_fused_checks`, or of the emitted node when the dtype stays).  So
    when that holds for every node of ``ops`` in the graph and the anchors'
    op types all sit on one device type, no match can fuse: the reason, else
    None (see :data:`FUSED_KERNEL_POLICY`).  ``side``: the residual forms,
    whose builds first require oneDNN on a CPU (:func:`_require_onednn_cpu`):
    when that fails for every op type, its reason."""
    ops = tuple(ops)
    mkey = (ops, side)

    def policy(ctx, graph):
        if not FUSED_KERNEL_POLICY or ctx is None:
            return None
        key = (graph.version, graph.edits_since(sys.maxsize)[1])
        memo = getattr(graph, _FUSED_KERNEL_MEMO_ATTR, None)
        if memo is None or memo["ctx"] is not ctx:
            memo = {"ctx": ctx, "key": None, "answers": {}, "on": set()}
            setattr(graph, _FUSED_KERNEL_MEMO_ATTR, memo)
        if memo["key"] != key:
            memo["key"], memo["answers"] = key, {}
        if mkey in memo["on"]:
            return None  # (it ran per anchor in this run: it stays on, its skips already reported)
        if mkey not in memo["answers"]:
            memo["answers"][mkey] = _fused_kernel_problem(ctx, graph, ops, side)
        if memo["answers"][mkey] is None:
            memo["on"].add(mkey)
        return memo["answers"][mkey]
    policy.__qualname__ = f"fused_kernel_policy({ops!r}, side={side})"
    return policy


def _fused_kernel_problem(ctx, graph, ops, side=False):
    """See :func:`fused_kernel_policy`."""
    from ..pattern import _of_type
    from .core import _requirement_problem

    nodes = graph.nodes
    mms = _of_type(graph, ops)
    if not mms:
        return None  # (nothing to match: the rule finds that out at once)
    default = ctx.default_device_type()
    kinds = {registry.device_type_named(d, default) for d in _anchor_devices(graph)} or {default}
    if len(kinds) != 1:
        return None
    dev = kinds.pop()
    if side:
        present = sorted({nodes[n].op for n in mms})
        found = [_onednn_cpu_problem(dev, ctx, f"{FUSED_OP[op]}[BiasAdd,Add]") for op in present]
        if all(found):
            return "; ".join(found)
    problems = {}
    # (issue 17) the planned dtype once per (op type, dtype) when the plan
    # has no rule by node name (``Plan.names_matter``); False: per node
    plan = _precision_plan(ctx) if PLANNED_BY_TYPE else None
    by_type = {} if plan is not None and not plan.names_matter else None
    for name in mms:
        node = nodes[name]
        t = node.attr.get("T")
        if t is None:
            return None
        if by_type is None:
            key = (node.op, planned_dtype(ctx, node.op, name, t.type))
        else:
            key = by_type.get((node.op, t.type))
            if key is None:
                key = by_type[(node.op, t.type)] = (node.op, planned_dtype(ctx, node.op, name, t.type))
        if key not in problems:
            op, run = FUSED_OP[key[0]], key[1]
            form = registry.fused_form(op, dev, run)
            problems[key] = _requirement_problem(
                form[0] if form is not None else op, {"T": run},
                f"every {key[0]} runs in {registry.dtype_name(run)}", dev)
            if problems[key] is None:
                return None
    return "; ".join(problems[k] for k in sorted(problems))


def _anchor_devices(graph) -> set:
    """The device strings of the nodes of :data:`_BIAS_FAMILY_ANCHORS` (a
    superset): when no node of the graph's source had one
    (``Graph.source_has_device``, the grappler bridge), "" and those of the
    nodes a pass created or edited; else every such node's."""
    from ..pattern import _of_type

    nodes = graph.nodes
    fn = graph.source_has_device
    changed = graph.changed_nodes() if fn is not None and fn() is False else None
    if changed is not None:
        return {""} | {nodes[n].device for n in changed}
    return {nodes[n].device for n in _of_type(graph, _BIAS_FAMILY_ANCHORS)}


def _has_bf16(graph, op):
    """Whether a node of type ``op`` in ``graph`` has ``T`` = bfloat16;
    remembered on the graph while its version does not change (the rules
    sharing an anchor op ask in turn)."""
    from ..pattern import _of_type

    memo = graph.__dict__.setdefault("_bf16_anchor_memo", {})
    hit = memo.get(op)
    if hit is not None and hit[0] == graph.version:
        return hit[1]
    nodes, bf16 = graph.nodes, registry.DT_BFLOAT16
    found = False
    for name in _of_type(graph, (op,)):
        t = nodes[name].attr.get("T")
        if t is not None and t.type == bf16:
            found = True
            break
    memo[op] = (graph.version, found)
    return found


def _precision_plan(ctx):
    """The precision planner of this pipeline run, or None when no precision
    pass follows (then every op keeps its dtype)."""
    from ..manager import PASS_REGISTRY

    if ctx is None or "precision" not in PASS_REGISTRY:
        return None
    if ctx.option("precision") is None and ctx.option("precision_mode") is None:
        return None
    from ..precision.planner import plan_for

    return plan_for(ctx)


def _close(v, want, tol=1e-4):
    return v is not None and abs(v - want) <= tol * max(1.0, abs(want))


_CONST_UNARY = {"Sqrt": np.sqrt, "Rsqrt": lambda v: 1.0 / np.sqrt(v), "Reciprocal": lambda v: 1.0 / v,
                "Inv": lambda v: 1.0 / v, "Neg": np.negative, "Cast": lambda v: v, "Identity": lambda v: v,
                "StopGradient": lambda v: v}
_CONST_BINARY = {"Mul": np.multiply, "RealDiv": np.divide, "Add": np.add, "AddV2": np.add,
                 "Sub": np.subtract, "Pow": np.power, "Maximum": np.maximum}


def const_eval(b, ref, depth=0):
    """numpy value of a small constant expression (``tf.sqrt(2.0)``,
    ``rsqrt(cast(d))``, ``1/sqrt(k.shape[-1])``, ``shape(k)[-1]`` with a known
    static shape), in float64; None when it depends on run-time data."""
    src, port, ctrl = parse_tensor(ref)
    node = b.graph.nodes.get(src)
    if node is None or ctrl or port != 0 or depth > 8:
        return None
    if node.op == "Const":
        v = b.const(ref)
        if v is None or (v.dtype.kind not in "fiub" and v.dtype.name != "bfloat16"):  # ml_dtypes: kind "V"
            return None
        return v.astype(np.float32).astype(np.float64)
    data = b.graph.data_inputs(node)
    if node.op in _CONST_UNARY and data:
        v = const_eval(b, data[0], depth + 1)
        return None if v is None else _CONST_UNARY[node.op](v)
    if node.op in _CONST_BINARY and len(data) == 2:
        x, y = const_eval(b, data[0], depth + 1), const_eval(b, data[1], depth + 1)
        return None if x is None or y is None else _CONST_BINARY[node.op](x, y)
    if node.op == "Shape" and data:
        sh = b.shape(data[0])
        return None if sh is None or min(sh, default=0) < 0 else np.asarray(sh, np.float64)
    if node.op == "StridedSlice" and len(data) == 4:
        vals = [const_eval(b, d, depth + 1) for d in data]
        if any(v is None for v in vals) or vals[0].ndim != 1 or vals[1].size != 1:
            return None
        shrink = node.attr["shrink_axis_mask"].i if "shrink_axis_mask" in node.attr else 0
        if shrink != 1 or (node.attr["ellipsis_mask"].i if "ellipsis_mask" in node.attr else 0):
            return None
        i = int(vals[1].reshape(()))
        return vals[0][i] if -len(vals[0]) <= i < len(vals[0]) else None
    return None


def const_scalar(b, ref):
    v = const_eval(b, ref)
    return None if v is None or v.size != 1 else float(v.reshape(()))


def _build_gelu_exact(m, b):
    b.require(_close(const_scalar(b, m["half"]), 0.5), "GELU constant is not 0.5")
    c = const_scalar(b, m["c"])
    if "erfc" in m.nodes:  # TF >= 2.16: 0.5 * x * erfc(-x / sqrt(2))
        b.require(c is not None and _close(abs(c), 1 / math.sqrt(2.0)),
                  f"erfc argument scale {c} is not 1/sqrt(2)")
    else:
        b.require(_close(const_scalar(b, m["one"]), 1.0), "GELU constant is not 1")
        div = m["div"].op == "RealDiv"
        b.require(c is not None and (_close(c, math.sqrt(2.0)) if div else _close(c, 1 / math.sqrt(2.0))),
                  f"erf argument scale {c} is not 1/sqrt(2)")
    _emit_fused(m, b, "GeluExact")


def _build_gelu_tanh(m, b):
    cs = {k: const_scalar(b, m[k]) for k in ("half", "one", "k", "a", "three")}
    b.require(_close(cs["half"], 0.5) and _close(cs["one"], 1.0)
              and _close(cs["k"], math.sqrt(2 / math.pi)) and _close(cs["a"], 0.044715)
              and _close(cs["three"], 3.0), "tanh-GELU constants do not match")
    _emit_fused(m, b, "GeluApproximate")


def _gelu_exact_pat():
    """0.5*x*(1+erf(x/sqrt2)) as tf.nn.gelu (TF <= 2.15), x*0.5*(...) and BERT's
    x*(0.5*(1+erf(x/sqrt(2)))); TF >= 2.16's tf.nn.gelu: 0.5*x*erfc(-x/sqrt2)."""
    erf_arg = Pat(("RealDiv", "Mul"), name="div", inputs=[Pat.any("@bias"), Pat.any("c")])
    one_plus = Pat(("AddV2", "Add"), commutative=True, name="onep",
                   inputs=[Pat.any("one"), Pat("Erf", name="erf", inputs=[erf_arg])])
    tf_style = Pat("Mul", commutative=True, inputs=[
        Pat("Mul", name="halfx", commutative=True, inputs=[Pat.any("half"), _bias_pat()]), one_plus])
    bert_style = Pat("Mul", commutative=True, inputs=[
        _bias_pat(), Pat("Mul", name="cdf", commutative=True, inputs=[Pat.any("half"), one_plus])])
    erfc_arg = Pat("Mul", name="div", commutative=True, inputs=[
        Pat("Neg", name="neg", inputs=[Pat.any("@bias")]), Pat.any("c")])
    erfc_style = Pat("Mul", commutative=True, inputs=[
        Pat("Mul", name="halfx", commutative=True, inputs=[Pat.any("half"), _bias_pat()]),
        Pat("Erfc", name="erfc", inputs=[erfc_arg])])
    return Pat.one_of(tf_style, bert_style, erfc_style)


def _gelu_tanh_pat():
    cube = Pat("Mul", name="acube", commutative=True,
               inputs=[Pat.any("a"), Pat("Pow", name="pow", inputs=[Pat.any("@bias"), Pat.any("three")])])
    inner = Pat("Mul", name="kmul", commutative=True, inputs=[
        Pat.any("k"), Pat(("AddV2", "Add"), name="xpc", commutative=True, inputs=[Pat.any("@bias"), cube])])
    one_plus = Pat(("AddV2", "Add"), name="onep", commutative=True,
                   inputs=[Pat.any("one"), Pat("Tanh", name="tanh", inputs=[inner])])
    tf_style = Pat("Mul", commutative=True, inputs=[
        Pat("Mul", name="halfx", commutative=True, inputs=[Pat.any("half"), _bias_pat()]), one_plus])
    bert_style = Pat("Mul", commutative=True, inputs=[
        _bias_pat(), Pat("Mul", name="cdf", commutative=True, inputs=[Pat.any("half"), one_plus])])
    return Pat.one_of(tf_style, bert_style)


# ------------------------------------------------------------------ BN folding
def _build_bn_fold(m, b):
    bn, conv = b.anchor, m["mm"]
    b.require(not bn.attr["is_training"].b, "batch norm in training mode")
    fmt = bn.attr["data_format"].s.decode() if "data_format" in bn.attr else "NHWC"
    b.require(fmt == "NHWC", f"batch norm data_format {fmt}")
    cfmt = conv.attr["data_format"].s.decode() if "data_format" in conv.attr else "NHWC"
    b.require(cfmt == "NHWC", f"{conv.op} data_format {cfmt}")
    vals = {k: b.const(m[k]) for k in ("scale", "offset", "mean", "var")}
    missing = [k for k, v in vals.items() if v is None]
    b.require(not missing, f"batch norm {', '.join(missing)} not constant (freeze the graph first)")
    data = b.graph.data_inputs(conv)
    w = b.const(data[1])
    b.require(w is not None and w.ndim == 4, "conv filter is not a constant (freeze the graph first)")
    eps = bn.attr["epsilon"].f if "epsilon" in bn.attr else 1e-3
    s = vals["scale"].astype(np.float64) / np.sqrt(vals["var"].astype(np.float64) + eps)
    if conv.op == "Conv2D":
        b.require(w.shape[3] == s.shape[0], "filter out-channels differ from the batch-norm size")
        w2 = w.astype(np.float64) * s.reshape(1, 1, 1, -1)
    else:  # depthwise filter [H, W, C, M], output channel c*M + m
        b.require(w.shape[2] * w.shape[3] == s.shape[0], "depthwise channels differ from the batch-norm size")
        w2 = w.astype(np.float64) * s.reshape(1, 1, w.shape[2], w.shape[3])
    bias0 = 0.0
    if "bias" in m.nodes:
        bv = b.const(m["b"])
        b.require(bv is not None, "conv bias is not a constant")
        bias0 = bv.astype(np.float64)
    b2 = (bias0 - vals["mean"].astype(np.float64)) * s + vals["offset"].astype(np.float64)
    dt = conv.attr["T"].type
    wname = b.const_node(f"{conv.name}/Folded_filter", w2, dt)
    bname = b.const_node(f"{m.anchor}/Folded_bias", b2, dt)
    attrs = {k: v for k, v in conv.attr.items() if k != "_output_shapes"}
    b.emit(conv.op, conv.name, [data[0], wname], attrs)
    b.emit("BiasAdd", m.anchor, [conv.name, bname], {"T": ("type", dt), "data_format": "NHWC"})


def _bn_fold_pat():
    conv = Pat(("Conv2D", "DepthwiseConv2dNative"), name="mm")
    x = Pat.one_of(Pat("BiasAdd", name="bias", inputs=[conv, Pat.any("b")]), conv)
    return Pat(("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"),
               inputs=[x, Pat.any("scale"), Pat.any("offset"), Pat.any("mean"), Pat.any("var")])


# ------------------------------------------------------------------ LayerNorm
def _trailing_axes(b, axes_ref, x_ref):
    """How many trailing axes of x the constant ``axes`` name (contiguous, ending
    at the last one), or None."""
    v = b.const(axes_ref)
    if v is None or v.size < 1:
        return None
    vals = [int(a) for a in v.reshape(-1).tolist()]
    if vals == [-1]:
        return 1
    xs = b.shape(x_ref)
    if xs is None:
        return None
    r = len(xs)
    axes = sorted({a % r for a in vals})
    return len(axes) if axes == list(range(r - len(axes), r)) else None


def _emit_layer_norm(m, b, x, gamma, beta, eps):
    dt = b.dtype(x)
    b.require(dt in registry.FLOAT_TYPES, f"LayerNorm input dtype {registry.dtype_name(dt)}")
    b.require(b.dtype(gamma) == dt and b.dtype(beta) == dt, "gamma/beta dtype differs from the input")
    gs, bs, xs = b.shape(gamma), b.shape(beta), b.shape(x)
    b.require(gs is not None and bs is not None and gs == bs and len(gs) >= 1 and min(gs) > 0,
              f"gamma {gs} / beta {bs} shapes unknown or different")
    core = list(gs)
    while len(core) > 1 and core[0] == 1:
        core.pop(0)
    if xs is not None:
        b.require(len(xs) >= len(core) and list(xs[len(xs) - len(core):]) == core,
                  f"gamma {gs} does not cover the trailing dims of x {xs}")
    else:
        b.require(core[-1] > 1, "x shape unknown and gamma could broadcast")
    b.emit("LayerNorm", m.anchor, [x, gamma, beta], {"T": ("type", dt), "epsilon": float(eps)})
    _norm_backward(m, b, "layer_norm", x, gamma, beta, gs)


def _build_ln_moments(m, b):
    ks = {_trailing_axes(b, m[a], m["x"]) for a in ("axes", "axes2")}
    b.require(len(ks) == 1 and None not in ks, "moments are not over the last axis (or trailing axes)")
    k = ks.pop()
    if k > 1:  # multi-axis (Keras 2 LayerNormalization(axis=[1, 2])): gamma must cover them all
        xs, gs = b.shape(m["x"]), b.shape(m["gamma"])
        core = list(gs or [])
        while len(core) > k and core[0] == 1:
            core.pop(0)
        b.require(xs is not None and core == list(xs[-k:]),
                  f"gamma {gs} does not cover the normalised dims {xs and xs[-k:]}")
    b.require(m["mean"].attr["keep_dims"].b and m["var"].attr["keep_dims"].b, "moments without keep_dims")
    eps = b.scalar(m["eps"])
    b.require(eps is not None and eps >= 0, "variance epsilon is not a constant")
    _emit_layer_norm(m, b, m["x"], m["gamma"], m["beta"], eps)


def _moments():
    mean = Pat("Mean", name="mean", inputs=[Pat.any("x"), Pat.any("axes")])
    # grappler's arithmetic optimizer removes the StopGradient (a no-op when running)
    var = Pat("Mean", name="var", inputs=[
        Pat("SquaredDifference", name="sqd", inputs=[
            Pat.any("x"), Pat.one_of(Pat("StopGradient", name="sg", inputs=[Pat.any("@mean")]),
                                     Pat.any("@mean"))]),
        Pat.any("axes2")])
    inv = Pat("Mul", name="inv", commutative=True, inputs=[
        Pat("Rsqrt", name="rsqrt", inputs=[
            Pat(("AddV2", "Add"), name="addeps", commutative=True, inputs=[var, Pat.any("eps")])]),
        Pat.any("gamma")])
    return mean, inv


def _ln_moments_pat():
    mean, inv = _moments()
    return Pat(("AddV2", "Add"), commutative=True, inputs=[
        Pat("Mul", name="xinv", commutative=True, inputs=[Pat.any("x"), inv]),
        Pat("Sub", name="sub", inputs=[
            Pat.any("beta"), Pat("Mul", name="minv", commutative=True, inputs=[mean, Pat.any("@inv")])])])


def _ln_keras3_pat():
    mean, inv = _moments()
    keras3 = Pat(("AddV2", "Add"), commutative=True, inputs=[
        Pat("Mul", name="xinv", commutative=True, inputs=[Pat.any("x"), inv]),
        Pat(("AddV2", "Add"), name="shift", commutative=True, inputs=[
            Pat("Mul", name="minv", commutative=True, inputs=[
                Pat("Neg", name="neg", inputs=[mean]), Pat.any("@inv")]),
            Pat.any("beta")])])
    # the same after grappler's AddOpsRewrite (the inner add has one reader):
    # AddV2(beta, AddN(x*inv, -mean*inv))
    mean2, inv2 = _moments()
    rewritten = Pat(("AddV2", "Add"), commutative=True, inputs=[
        Pat("AddN", name="shift", commutative=True, inputs=[
            Pat("Mul", name="xinv", commutative=True, inputs=[Pat.any("x"), inv2]),
            Pat("Mul", name="minv", commutative=True, inputs=[
                Pat("Neg", name="neg", inputs=[mean2]), Pat.any("@inv")])]),
        Pat.any("beta")])
    return Pat.one_of(keras3, rewritten)


def _build_ln_keras2(m, b):
    fbn = m["fbn"]
    b.require(fbn.attr["is_training"].b and fbn.attr["data_format"].s == b"NCHW",
              "FusedBatchNorm is not the Keras layer-norm form (training, NCHW)")
    for k, want in (("scale", 1.0), ("offset", 0.0)):
        node = b.graph.nodes.get(parse_tensor(m[k])[0])
        if node is not None and node.op == "Fill":
            ok = _close(b.scalar(node.input[1]), want)
        else:  # grappler's constant folding turned the Fill into a Const
            v = b.const(m[k])
            ok = v is not None and v.size > 0 and bool(np.all(np.abs(v - want) <= 1e-6))
        b.require(ok, f"FusedBatchNorm {k} is not a fill of {want}")
    xs = b.shape(m["x"])
    b.require(xs is not None, "input shape unknown")
    _emit_layer_norm(m, b, m["x"], m["gamma"], m["beta"], fbn.attr["epsilon"].f)


def _ln_keras2_pat():
    fbn = Pat("FusedBatchNormV3", name="fbn", inputs=[
        Pat("Reshape", name="rs_in", inputs=[Pat.any("x"), Pat.any("shape_in")]),
        Pat.any("scale"), Pat.any("offset"), Pat.any("m_empty"), Pat.any("v_empty")])
    return Pat(("AddV2", "Add"), commutative=True, inputs=[
        Pat("Mul", name="mul", commutative=True, inputs=[
            Pat("Reshape", name="rs_out", inputs=[fbn, Pat.any("shape_out")]), Pat.any("gamma")]),
        Pat.any("beta")])



# ------------------------------------------------- the backward of a fused norm
def _squeeze_lead(shape):
    s = list(shape)
    while len(s) > 1 and s[0] == 1:
        s.pop(0)
    return s


def _norm_backward(m, b, kind, x, gamma, beta, gshape, has_gamma=True, has_beta=True):
    """Training graphs: when the backward pass reads the forward's inner
    tensors, replace that gradient subgraph (``grad_region.find_grad_region``)
    by ONE ``LayerNormGrad(dy, x, gamma, mean, inv_std) -> dx, dgamma, dbeta``
    (``RMSNormGrad(dy, x, gamma, inv_rms) -> dx, dgamma``) reading the fused
    op's statistics.  Every tensor leaving the region must be dx (or partial
    dx terms that one AddN sums, replaced there by the one dx), dgamma or dbeta
    (gamma's shape, leading 1s aside; dbeta depends on no forward value), else
    the match is refused with the reason and the graph is unchanged.

        x, gamma, beta -> [mean, sub, rsqrt, mul, add] -> y       x, gamma, beta -> LayerNorm -> y
        dy -> [Mul, Sum, Reshape, RsqrtGrad, Tile, ...] ─ dx1 ┐    dy -> LayerNormGrad ─ dx ┐
                                                          dx2 ┼ AddN       dgamma, dbeta   ├ AddN
                                            d_residual ───────┘           d_residual ─────┘

    Two halves: :func:`_grad_facts` decides (and refuses), :func:`_emit_norm_grad` emits."""
    from . import norm_plan

    inner = set(b.match.matched) | set(b.absorbed)
    real = [t for t, r in ((gamma, has_gamma), (beta, has_beta)) if r and t is not None]
    facts = norm_plan.grad_facts(m, b, kind, x, real, gshape, inner, has_gamma, has_beta)
    if facts is not None:
        _emit_norm_grad(m, b, kind, x, gamma, facts)


def _grad_facts(m, b, kind, x, params, gshape, inner, has_gamma, has_beta):
    """The decisions of :func:`_norm_backward` (Skip with the reason when it
    refuses), without touching the builder: None when no reader outside the
    forward region reads its inner tensors (nothing to replace), else a
    :class:`norm_plan.GradFacts`.  ``params``: gamma / beta as the graph has
    them (absent ones left out); ``inner``: the forward region's nodes."""
    from .grad_region import GradRegionRefused, assign_outputs, find_grad_region
    from .norm_plan import GradFacts

    g = b.graph
    if not b.escaping_readers(inner):
        return None
    dt = b.dtype(x)
    xs, gs = b.shape(x), list(gshape) if gshape is not None else None
    b.require(xs is not None and min(xs, default=0) > 0 and gs is not None,
              "not fused: the backward pass reads the norm's inner tensors and x's shape is not static")
    b.require(_squeeze_lead(xs) != _squeeze_lead(gs),
              f"not fused: x {xs} has one normalised row, so dx and dgamma cannot be told apart by shape")
    inputs = [x] + list(params)
    protected = b.ctx.protected if b.ctx is not None else frozenset()
    try:
        region = find_grad_region(g, inner, [tensor_name(m.anchor, 0)], inputs, shapes=b.shapes,
                                  protected=protected, dy_shape=list(xs))

        def classify(ref):
            if b.dtype(ref) != dt or not region.depends_on_dy(ref):
                return None
            sh = b.shape(ref)
            if sh is None or min(sh, default=0) < 0:
                return None
            fwd = region.depends_on_forward(ref)
            if list(sh) == list(xs) and fwd:
                return "dx"
            if _squeeze_lead(sh) == _squeeze_lead(gs):
                if fwd and has_gamma:
                    return "dgamma"
                if not fwd and has_beta and kind == "layer_norm":
                    return "dbeta"
            return None

        terms = assign_outputs(region, g, classify, summed=("dx",))
    except GradRegionRefused as exc:
        raise Skip(str(exc)) from None
    b.require("dx" in terms, "not fused: the backward pass reads the norm's inner tensors, but no "
                             "gradient with respect to x leaves it")
    b.require(b.dtype(region.dy) == dt, "the incoming gradient's dtype differs from the input's")
    shapes = {ref: list(b.shape(ref)) for term in terms.values() if term.aggregator is None for ref in term.refs}
    return GradFacts(list(region.nodes), region.dy, terms, shapes, list(xs), gs)


def _emit_norm_grad(m, b, kind, x, gamma, facts):
    """Emit the gradient op :func:`_grad_facts` decided on (``gamma``: the
    fused op's gamma input, a node emitted for an absent one included)."""
    dt = b.dtype(x)
    op = "LayerNormGrad" if kind == "layer_norm" else "RMSNormGrad"
    gname = f"{m.anchor}/{op}"
    stats = [tensor_name(m.anchor, 1)] + ([tensor_name(m.anchor, 2)] if kind == "layer_norm" else [])
    b.emit(op, gname, [facts.dy, x, gamma] + stats, {"T": ("type", dt)})
    ports = {"dx": 0, "dgamma": 1, "dbeta": 2}
    want_shape = {"dx": facts.xs, "dgamma": facts.gs, "dbeta": facts.gs}
    rewire = {}
    for role, term in facts.terms.items():
        src = tensor_name(gname, ports[role])
        if term.aggregator is not None:
            reemit_aggregator(b, b.graph, term, src, dt)
            continue
        for k, ref in enumerate(term.refs):
            sh = facts.shapes[ref]
            if sh == want_shape[role]:
                rewire[ref] = src
                continue
            shp = b.const_node(f"{gname}/{role}_shape_{k}", np.asarray(sh, np.int32), registry.types_pb2.DT_INT32)
            rewire[ref] = b.emit("Reshape", f"{gname}/{role}_{k}", [src, shp],
                                 {"T": ("type", dt), "Tshape": ("type", registry.types_pb2.DT_INT32)})
    b.region(facts.nodes, rewire, gname)


def reemit_aggregator(b, g, term, src, dt):
    """A gradient term summed with other gradients (``term.aggregator``, an
    AddN/Add outside the region): re-emit that sum under its own name with
    the fused op's output ``src`` in place of the term's refs (an Identity
    when nothing else is summed), on the device it was placed on."""
    agg = g.nodes[term.aggregator]
    b.replace(agg.name, control_ok=True)
    rest = [i for i in g.data_inputs(agg) if _canon(i) not in term.refs]
    rest_ctrl = [i for i in agg.input[:] if i.startswith("^")]
    if not rest:
        b.emit("Identity", agg.name, [src] + rest_ctrl, {"T": ("type", dt)})
    elif agg.op == "AddN":
        b.emit("AddN", agg.name, [src] + rest + rest_ctrl, {"T": ("type", dt), "N": 1 + len(rest)})
    else:
        b.emit(agg.op, agg.name, [src] + rest + rest_ctrl, {"T": ("type", dt)})
    b.emitted[-1].device = agg.device  # the sum stays where it was placed


def _canon(ref):
    n, p, c = parse_tensor(ref)
    return ("^" + n) if c else (n if p == 0 else f"{n}:{p}")

# ------------------------------------------------- LayerNorm / RMSNorm, any form
# A functional matcher (the forms are too many for one Pat tree): the rule's Pat
# is the root op; the predicate does the structural match, the build function
# checks axes/shapes/dtypes with reasons and absorbs the inner nodes.
_ADDS = ("Add", "AddV2")


def _src(graph, ref):
    """The node producing ``ref`` when it is output 0 (else None)."""
    name, port, ctrl = parse_tensor(ref)
    return None if ctrl or port != 0 else graph.nodes.get(name)


def _product(graph, ref, factors, inner, depth=0):
    """Flatten Mul/RealDiv trees: factors as ('mul'|'div', ref)."""
    node = _src(graph, ref)
    if node is not None and depth < 4 and node.op in ("Mul", "RealDiv"):
        a, c = graph.data_inputs(node)
        inner.append(node.name)
        _product(graph, a, factors, inner, depth + 1)
        if node.op == "Mul":
            _product(graph, c, factors, inner, depth + 1)
        else:
            factors.append(("div", c))
        return
    factors.append(("mul", ref))


def _mean_of(graph, ref):
    """(x, axes_ref, node) when ``ref`` is Mean(x, axes, keep_dims=True)."""
    node = _src(graph, ref)
    if node is None or node.op != "Mean" or not node.attr["keep_dims"].b:
        return None
    x, axes = graph.data_inputs(node)
    return x, axes, node


def _same_mean(graph, a, b_):
    """Two Means of the same tensor over the same constant axes."""
    if a[2].name == b_[2].name:
        return True
    va, vb = const_value(graph, a[1]), const_value(graph, b_[1])
    return a[0] == b_[0] and va is not None and vb is not None and sorted(va.reshape(-1)) == sorted(vb.reshape(-1))


def _inv_std(graph, kind, ref, inner):
    """Rsqrt(v + eps) as a 'mul' factor or Sqrt(v + eps) as a 'div' factor -> (v_ref, eps_ref)."""
    node = _src(graph, ref)
    want = "Rsqrt" if kind == "mul" else "Sqrt"
    if node is None or node.op != want:
        return None
    add = _src(graph, graph.data_inputs(node)[0])
    if add is None or add.op not in _ADDS:
        return None
    a, c = graph.data_inputs(add)
    inner += [node.name, add.name]
    for v, e in ((a, c), (c, a)):
        if _src(graph, v) is not None and _src(graph, v).op == "Mean":
            return v, e
    return None


def _variance(graph, ref, mean, inner):
    """Mean((x-mean)^2) as moments / reduce_variance / raw code write it."""
    mv = _mean_of(graph, ref)
    if mv is None:
        return False
    inner.append(mv[2].name)
    sq = _src(graph, mv[0])
    if sq is None:
        return False
    x = mean[0]
    if sq.op == "SquaredDifference":
        a, c = graph.data_inputs(sq)
        inner.append(sq.name)
        for xx, mm in ((a, c), (c, a)):
            if xx != x:
                continue
            mnode = _src(graph, mm)
            if mnode is not None and mnode.op == "StopGradient":
                inner.append(mnode.name)
                mm = mnode.input[0]
            m2 = _mean_of(graph, mm)
            if m2 is not None and _same_mean(graph, mean, m2):
                inner.append(m2[2].name)
                return _same_axes(graph, mv[1], mean[1])
        return False
    if sq.op in ("Square", "Pow", "Mul"):
        d = graph.data_inputs(sq)
        if sq.op == "Pow" and not _close(scalar_value(graph, d[1]), 2.0):
            return False
        if sq.op == "Mul" and d[0] != d[1]:
            return False
        sub = _src(graph, d[0])
        if sub is None or sub.op != "Sub" or graph.data_inputs(sub)[0] != x:
            return False
        m2 = _mean_of(graph, graph.data_inputs(sub)[1])
        if m2 is None or not _same_mean(graph, mean, m2):
            return False
        inner += [sq.name, sub.name, m2[2].name]
        return _same_axes(graph, mv[1], mean[1])
    return False


def _same_axes(graph, a, c):
    va, vc = const_value(graph, a), const_value(graph, c)
    return va is not None and vc is not None and sorted(va.reshape(-1)) == sorted(vc.reshape(-1))


def _mean_square(graph, ref, inner):
    """Mean(x^2) (Square, Pow 2, x*x) -> (x, axes_ref)."""
    mv = _mean_of(graph, ref)
    if mv is None:
        return None
    sq = _src(graph, mv[0])
    if sq is None or sq.op not in ("Square", "Pow", "Mul"):
        return None
    d = graph.data_inputs(sq)
    if sq.op == "Pow" and not _close(scalar_value(graph, d[1]), 2.0):
        return None
    if sq.op == "Mul" and d[0] != d[1]:
        return None
    inner += [mv[2].name, sq.name]
    return d[0], mv[1]


#: ``analyze_norm`` answers kept per state of the graph (issue 17, 17i: the
#: LayerNorm predicate asks it at an anchor and at its reader
#: (``_would_extend``), the build asks again: 182 calls, 107 distinct, per
#: BERT-12 run).  False: the reference, every call analyses
NORM_MEMO = True
#: attribute of a Graph holding ((version, edit mark), {name: (node, answer)})
NORM_MEMO_ATTR = "_fusion_norm_memo"


def analyze_norm(graph, anchor):
    """:func:`_analyze_norm`, memoised while the graph does not change
    (``graph.version`` and its edit log: the answer is a function of the
    nodes' structure and constant values).  Returns a fresh dict (its
    ``inner`` list a copy) on every call."""
    if not NORM_MEMO or not hasattr(graph, "edits_since"):
        return _analyze_norm(graph, anchor)
    key = (graph.version, graph.edits_since(sys.maxsize)[1])
    memo = getattr(graph, NORM_MEMO_ATTR, None)
    if memo is None or memo[0] != key:
        memo = (key, {})
        setattr(graph, NORM_MEMO_ATTR, memo)
    hit = memo[1].get(anchor.name)
    if hit is None and NATIVE_NORMS:  # (the build's question after an edit: asked of C++ too)
        _native_norms(graph, (anchor.name,))
        hit = memo[1].get(anchor.name)
    if hit is None or hit[0] is not anchor:
        hit = memo[1][anchor.name] = (anchor, _analyze_norm(graph, anchor))
    res = hit[1]
    return None if res is None else dict(res, inner=list(res["inner"]))


def _analyze_norm(graph, anchor):
    """Match LayerNorm / RMSNorm written as plain ops, rooted at ``anchor``.

    LayerNorm: ``[gamma *] (x - mean) {* rsqrt(var + eps) | / sqrt(var + eps)} [+ beta]``,
    mean = Mean(x, axes, keep_dims), var = moments' Mean(SquaredDifference(x,
    StopGradient(mean))), or Mean(Square(x - mean)) (reduce_variance / raw code).
    RMSNorm: ``[gamma *] x {* rsqrt(mean(x^2) + eps) | / sqrt(...)}``.
    Returns a dict (kind, x, axes, eps, gamma, beta, inner) or None."""
    beta = None
    inner = [anchor.name]
    roots = []
    if anchor.op in _ADDS:
        a, c = graph.data_inputs(anchor)
        roots = [(a, c), (c, a)]
    elif anchor.op in ("Mul", "RealDiv"):
        roots = [(anchor.name, None)]
    for prod, beta in roots:
        node = _src(graph, prod)
        if node is None or node.op not in ("Mul", "RealDiv"):
            continue
        factors, pinner = [], []
        _product(graph, prod, factors, pinner)
        res = _classify_norm(graph, factors, list(inner) + [n for n in pinner if n != anchor.name])
        if res is not None:
            res["beta"] = beta
            return res
    return None


def _classify_norm(graph, factors, inner):
    if not 2 <= len(factors) <= 3:
        return None
    for i, (kind, ref) in enumerate(factors):
        sub_inner = []
        inv = _inv_std(graph, kind, ref, sub_inner)
        if inv is None:
            continue
        var_ref, eps = inv
        rest = factors[:i] + factors[i + 1:]
        if any(k != "mul" for k, _ in rest):
            return None
        # LayerNorm: one of the rest is x - mean
        for j, (_, r) in enumerate(rest):
            sub = _src(graph, r)
            if sub is None or sub.op != "Sub":
                continue
            x, mref = graph.data_inputs(sub)
            mean = _mean_of(graph, mref)
            if mean is None or mean[0] != x:
                continue
            v_inner = []
            if not _variance(graph, var_ref, mean, v_inner):
                continue
            gamma = [g for k2, (_, g) in enumerate(rest) if k2 != j]
            return {"kind": "layer_norm", "x": x, "axes": mean[1], "eps": eps,
                    "gamma": gamma[0] if gamma else None,
                    "inner": inner + sub_inner + v_inner + [sub.name, mean[2].name]}
        # RMSNorm: one of the rest is x itself
        ms_inner = []
        ms = _mean_square(graph, var_ref, ms_inner)
        if ms is None:
            return None
        x, axes = ms
        for j, (_, r) in enumerate(rest):
            if r == x:
                gamma = [g for k2, (_, g) in enumerate(rest) if k2 != j]
                return {"kind": "rms_norm", "x": x, "axes": axes, "eps": eps,
                        "gamma": gamma[0] if gamma else None, "inner": inner + sub_inner + ms_inner}
        return None
    return None


def _would_extend(graph, node) -> bool:
    """True when ``node``'s single consumer also matches a norm (and so is the
    better anchor: it takes gamma or beta in too)."""
    from .grad_region import is_autodiff_name

    cons = graph.consumers(node.name)
    for cname, idx in cons:
        # training graphs: the gradient reads the node too; any other reader
        # (forward code) keeps it the output
        c = graph.nodes[cname]
        if idx < 0 or c.op not in _ADDS + ("Mul",):
            continue
        if any(o != cname and not is_autodiff_name(o) for o, _ in cons):
            return False
        res = analyze_norm(graph, c)
        if res is not None and node.name in res["inner"] and not (res["kind"] == "rms_norm" and res["beta"]):
            return True
    return False


def _norm_predicate(node, graph):
    from .grad_region import is_autodiff_name

    if is_autodiff_name(node.name):  # a gradient's own Mul chain is no norm
        return False
    res = analyze_norm(graph, node)
    if res is None or (res["kind"] == "rms_norm" and res["beta"] is not None):
        return False  # RMSNorm + a bias: the plain RMSNorm under it is the match
    return not _would_extend(graph, node)


def _norm_candidates(graph):
    """Every node at which :func:`_norm_predicate` can be true (a superset),
    without running it at each of the graph's Add/Mul/RealDiv (≈ 580 in a
    12-layer BERT training graph, in every sweep).

    ``analyze_norm`` needs a factor ``Rsqrt(...)`` or ``Sqrt(...)`` (the
    inverse standard deviation, :func:`_inv_std`) read directly by a node of
    the product tree :func:`_product` expands: Mul/RealDiv nodes, each
    reading the next, at depths 0-3 below the tree's root.  The root is the
    anchor (Mul/RealDiv) or a data input of it (Add/AddV2).  So a candidate is
    a Mul/RealDiv at most 3 reader hops through Mul/RealDiv below a reader
    of an Rsqrt/Sqrt, or an Add/AddV2 reading such a node."""
    from ..pattern import _of_type

    nodes = graph.nodes
    prods = ("Mul", "RealDiv")
    level = set()
    for name in _of_type(graph, ("Rsqrt", "Sqrt")):
        for c, idx in graph.consumers(name):
            if idx >= 0 and nodes[c].op in prods:
                level.add(c)
    roots = set(level)
    for _ in range(3):
        nxt = set()
        for name in level:
            for c, idx in graph.consumers(name):
                if idx >= 0 and c not in roots and nodes[c].op in prods:
                    nxt.add(c)
        roots |= nxt
        level = nxt
    out = with_add_readers(graph, roots)
    if NATIVE_NORMS and out:
        _native_norms(graph, out)
    return out


#: (issue 17, the C++ core's milestone 3: the layer-norm fusion's match) the
#: candidates' :func:`_analyze_norm` answers (and their Add/Mul readers',
#: which ``_would_extend`` asks) computed in one C++ call over the
#: gradient-region search's mirror (custom_ops/grad_region.cc
#: ``NormAnalyzer``) and put in :func:`analyze_norm`'s memo; a form it leaves
#: to Python is analysed here as before.  False: Python analyses all (the
#: reference).  ``grad_region.CHECK_NATIVE`` (the test suite) analyses both
#: ways and compares every answer (``grad_region.CHECKED_NORMS``)
NATIVE_NORMS = True
#: how many times the C++ analysis answered (for tests)
NATIVE_NORM_CALLS = [0]


def _native_norms(graph, names):
    from . import grad_region as gr

    if gr.native is None or not gr.NATIVE_SEARCH or not NORM_MEMO or not hasattr(graph, "edits_since"):
        return
    fn = getattr(gr.native, "analyze_norms", None)
    if fn is None or graph.nodes_of_type(("NextIteration", "RefNextIteration")):
        return
    if not isinstance(getattr(graph, gr._MIRROR_ATTR, None), gr._Mirror):
        return  # (no mirror loaded for the gradient-region searches: none is built for this)
    m = gr._mirror(graph, None)
    if m is None or not m.attrs:
        return  # (a mirror of names, ops and inputs only: no attrs to read)
    text = fn(m.h, sorted(names))
    if not text:
        return
    NATIVE_NORM_CALLS[0] += 1
    key = (graph.version, graph.edits_since(sys.maxsize)[1])
    memo = getattr(graph, NORM_MEMO_ATTR, None)
    if memo is None or memo[0] != key:
        memo = (key, {})
        setattr(graph, NORM_MEMO_ATTR, memo)
    known, nodes = memo[1], graph.nodes
    for item in text.split("\x02"):
        f = item.split("\x01")
        name = f[0]
        node = nodes.get(name)
        if f[1] == "p" or node is None or name in known:
            continue
        if f[1] == "n":
            res = None
        else:
            kind, x, axes, eps, gamma, beta, inner = f[2:9]
            res = {"kind": "layer_norm" if kind == "l" else "rms_norm", "x": x, "axes": axes, "eps": eps,
                   "gamma": None if gamma == "\x04" else gamma, "inner": inner.split("\x05"),
                   "beta": None if beta == "\x04" else beta}
        if gr.CHECK_NATIVE:
            gr.CHECKED_NORMS[0] += 1
            ref = _analyze_norm(graph, node)
            if ref != res:
                gr.CHECKED[1].append(([name], res, ref))
                res = ref
        known[name] = (node, res)


def with_add_readers(graph, names) -> set:
    """``names`` and the Add/AddV2 nodes reading them (data inputs): a norm's
    final op is a product or the Add of its offset (the candidates hooks)."""
    nodes = graph.nodes
    out = set(names)
    for name in names:
        for c, idx in graph.consumers(name):
            if idx >= 0 and nodes[c].op in _ADDS:
                out.add(c)
    return out


_norm_predicate.candidates = _norm_candidates


def _build_norm(m, b):
    """The layer-norm rule's build: :func:`_norm_facts` decides (in C++ with
    :data:`norm_plan.NATIVE_PLAN`, else or when C++ leaves it, in Python),
    :func:`_emit_norm` emits."""
    from . import norm_plan

    _emit_norm(m, b, norm_plan.decided(m.anchor, norm_plan.native_facts(m, b), lambda: _norm_facts(m, b)))


def _norm_facts(m, b):
    """The layer-norm rule's decisions at ``m.anchor`` (Skip with the reason
    when it refuses), without touching the builder: a :class:`norm_plan.NormFacts`.
    The Python reference of the C++ plan (``norm_plan.native_facts``)."""
    from .norm_plan import NormFacts

    res = analyze_norm(b.graph, b.anchor)
    b.require(res is not None, "the norm subgraph changed")
    x = res["x"]
    dt = b.dtype(x)
    b.require(dt in registry.FLOAT_TYPES, f"input dtype {registry.dtype_name(dt)}")
    xs = b.shape(x)
    b.require(xs is not None, f"the shape of '{x}' is unknown")
    ax = b.const(res["axes"])
    b.require(ax is not None, "reduction axes are not constant")
    r = len(xs)
    axes = sorted({int(a) % r for a in ax.reshape(-1).tolist()}) if r else []
    b.require(axes and axes == list(range(r - len(axes), r)),
              f"the mean is over axes {sorted(int(a) for a in ax.reshape(-1))} of a rank-{r} "
              f"input: not over the last axis (or trailing axes)")
    norm = list(xs[r - len(axes):])
    b.require(min(norm) > 0, f"normalised dims {norm} not static")
    eps = const_scalar(b, res["eps"])
    b.require(eps is not None and eps >= 0, "the variance epsilon is not a constant >= 0")

    def param(ref, what):
        if ref is None:
            return None
        b.require(b.dtype(ref) == dt, f"{what} dtype differs from the input")
        ps = b.shape(ref)
        b.require(ps is not None, f"{what} shape unknown")
        core = list(ps)
        while len(core) > len(norm) and core[0] == 1:
            core.pop(0)
        b.require(core == norm, f"{what} of shape {ps} does not cover the normalised dims {norm}")
        return ref

    kind = res["kind"]
    gamma = param(res["gamma"], "gamma")
    if kind == "layer_norm":
        beta = param(res["beta"], "beta")
    else:
        b.require(res["beta"] is None, "RMSNorm takes no beta")
        beta = None
    inner = list(dict.fromkeys(res["inner"]))
    b.check_absorb(inner, escapes_ok=True)
    grad = _grad_facts(m, b, kind, x, [p for p in (gamma, beta) if p is not None], norm,
                       set(m.matched) | set(b.absorbed) | set(inner), gamma is not None,
                       beta is not None and kind == "layer_norm")
    return NormFacts(kind, x, gamma, beta, dt, float(eps), norm, inner, grad)


def _emit_norm(m, b, f):
    """Emit what :func:`_norm_facts` decided: LayerNorm / RMSNorm under the
    anchor's name (gamma of ones, beta of zeros for absent ones), and its
    gradient op in place of the backward region (:func:`_emit_norm_grad`)."""
    gamma = f.gamma if f.gamma is not None else b.const_node(f"{m.anchor}/gamma", np.full(f.norm, 1.0), f.dt)
    if f.kind == "layer_norm":
        beta = f.beta if f.beta is not None else b.const_node(f"{m.anchor}/beta", np.full(f.norm, 0.0), f.dt)
    b.absorb(f.inner, escapes_ok=True)
    if f.kind == "layer_norm":
        b.emit("LayerNorm", m.anchor, [f.x, gamma, beta], {"T": ("type", f.dt), "epsilon": f.eps})
    else:
        b.emit("RMSNorm", m.anchor, [f.x, gamma], {"T": ("type", f.dt), "epsilon": f.eps})
    if f.grad is not None:
        _emit_norm_grad(m, b, f.kind, f.x, gamma, f.grad)


# ------------------------------------------------------------- attention, any form
_ATT_OPS = BMM_OPS + ("Einsum",)


def _through_identity(graph, ref, inner):
    node = _src(graph, ref)
    while node is not None and node.op in ("Identity", "StopGradient"):
        inner.append(node.name)
        ref = node.input[0]
        node = _src(graph, ref)
    return ref, node


def _att_predicate(node, graph):
    data = graph.data_inputs(node)
    if len(data) != 2:
        return False
    _, sm = _through_identity(graph, data[0], [])
    return sm is not None and sm.op == "Softmax"


def _scale_chain(b, ref, inner, max_ops=2):
    """Strip Mul/RealDiv by constant scalars: (ref, scale)."""
    scale = 1.0
    for _ in range(max_ops):
        node = _src(b.graph, ref)
        if node is None or node.op not in ("Mul", "RealDiv"):
            break
        a, c = b.graph.data_inputs(node)
        pairs = [(a, c), (c, a)] if node.op == "Mul" else [(a, c)]
        for t, k in pairs:
            v = const_scalar(b, k)
            if v is not None and v != 0:
                scale *= (1.0 / v) if node.op == "RealDiv" else v
                inner.append(node.name)
                ref = t
                break
        else:
            break
    return ref, scale


def _is_product(node, graph, transposed=False) -> bool:
    """A q.k product (BatchMatMul/Einsum); with ``transposed`` also a Transpose
    of one (Keras 3 lowers its einsum to BatchMatMulV2 + Transpose)."""
    if node is None:
        return False
    if node.op in _ATT_OPS:
        return True
    return transposed and node.op == "Transpose" and _is_product(_src(graph, node.input[0]), graph)


def _softmax_front(b, sm, inner, transposed=False):
    """What feeds Softmax ``sm``: ``[scale *] scores [+ mask | where(mask, ., fill)]``
    with the scores a q.k product.  Appends the mask/scale nodes to ``inner``;
    returns (scores_ref, scale, mask, bool_mask) or raises Skip."""
    g = b.graph
    logits = sm.input[0]
    mask, bool_mask = None, None
    node = _src(g, logits)
    scores_ref = logits
    if node is not None and node.op in _ADDS:
        a, c = g.data_inputs(node)
        for s_ref, mk in ((a, c), (c, a)):
            bn = _src(g, _scale_chain(b, s_ref, [])[0])
            if _is_product(bn, g, transposed):
                inner.append(node.name)
                scores_ref, mask = s_ref, mk
                break
    elif node is not None and node.op in ("Select", "SelectV2"):
        cond, then, other = g.data_inputs(node)
        for s_ref, fill, keep in ((then, other, True), (other, then, False)):
            bn = _src(g, _scale_chain(b, s_ref, [])[0])
            if _is_product(bn, g, transposed):
                fv = const_scalar(b, fill)
                b.require(fv is not None, "the masked fill value is not a constant")
                inner.append(node.name)
                scores_ref, bool_mask = s_ref, (cond, fv, keep)
                break
    s_base, scale = _scale_chain(b, scores_ref, inner)
    bmm1 = _src(g, s_base)
    b.require(_is_product(bmm1, g, transposed), "softmax input is not a scaled q.k product")
    return s_base, scale, mask, bool_mask


def _softmax_inputs(b, base, s_base, mask, bool_mask, dt):
    """The ScaleMaskSoftmax inputs (scores, mask); a boolean mask becomes the
    additive ``SelectV2(mask, 0, fill)`` named ``<base>/mask``."""
    inputs = [s_base]
    if mask is not None:
        b.require(b.dtype(mask) == dt, "the mask dtype differs from the scores")
        inputs.append(mask)
    elif bool_mask is not None:
        cond, fill, keep = bool_mask
        zero = b.const_node(f"{base}/mask_keep", 0.0, dt)
        drop = b.const_node(f"{base}/mask_fill", fill, dt)
        inputs.append(b.emit("SelectV2", f"{base}/mask", [cond] + ([zero, drop] if keep else [drop, zero]),
                             {"T": ("type", dt)}))
    return inputs


def _build_attention_any(m, b):
    """softmax(q.k * scale [+ mask | where(mask, ., fill)]) . v  =>  the two products
    stay (TF's oneDNN GEMMs), scale + mask + softmax become one ScaleMaskSoftmax.

    The scale may sit on q, on k (a single-consumer Mul/RealDiv by a constant
    feeding the product: moved into the op, the product re-emitted on the raw
    operand) or on the scores; constants may be expressions like rsqrt(d).
    A boolean mask becomes the additive mask where(mask, 0, fill)."""
    g = b.graph
    bmm2 = b.anchor
    inner = []
    p_in = g.data_inputs(bmm2)[0]
    _, sm = _through_identity(g, p_in, inner)
    inner.append(sm.name)
    s_base, scale, mask, bool_mask = _softmax_front(b, sm, inner)
    bmm1 = _src(g, s_base)
    ops_in = g.data_inputs(bmm1)
    new_in = list(ops_in)
    for i, ref in enumerate(ops_in):  # a scale on q or k moves into the softmax op
        node_s = _src(g, ref)
        if node_s is not None and node_s.op in ("Mul", "RealDiv") and len(g.consumers(node_s.name)) == 1:
            tmp = []
            raw, sc = _scale_chain(b, ref, tmp, max_ops=1)
            if tmp:
                inner += tmp
                scale *= sc
                new_in[i] = raw
    dt = b.dtype(s_base)
    b.require(dt in registry.FLOAT_TYPES, f"scores dtype {registry.dtype_name(dt)}")
    reemit = new_in != ops_in
    if reemit:
        inner.append(bmm1.name)
    inner.append(bmm2.name)
    b.absorb(list(dict.fromkeys(inner)))
    copy = lambda n: {k: v for k, v in n.attr.items() if k != "_output_shapes"}  # noqa: E731
    if reemit:
        b.emit(bmm1.op, bmm1.name, new_in, copy(bmm1))
    base = sm.name
    inputs = _softmax_inputs(b, base, s_base, mask, bool_mask, dt)
    b.emit("ScaleMaskSoftmax", base, inputs,
           {"T": ("type", dt), "num_masks": len(inputs) - 1, "scale": float(scale)})
    b.emit(bmm2.op, bmm2.name, [base, g.data_inputs(bmm2)[1]], copy(bmm2))


# ------------------------------------------------------ attention, training graphs
def _softmax_grad_signature(node, graph):
    """Softmax whose output autodiff differentiated: a reader ``Mul(dp, probs)``
    summed by a ``Sum`` that a ``Sub(dp, .)`` reads (TF's _SoftmaxGrad:
    ``(dp - sum(dp * p, -1)) * p``).  Inference graphs never show it."""
    for cname, idx in graph.consumers(node.name):
        c = graph.nodes[cname]
        if idx < 0 or c.op != "Mul":
            continue
        d = graph.data_inputs(c)
        if len(d) != 2:
            continue
        dp = d[1] if parse_tensor(d[0])[0] == node.name else d[0]
        sums = [graph.nodes[s] for s, i in graph.consumers(cname) if i >= 0 and graph.nodes[s].op == "Sum"]
        for sm in sums:
            for sub, i in graph.consumers(sm.name):
                sn = graph.nodes[sub]
                if i >= 0 and sn.op == "Sub" and graph.data_inputs(sn)[0] == dp:
                    return True
    return False


def _build_attention_train(m, b):
    """Training graph: softmax(scale * q.k [+ mask]) [-> dropout] ... and the backward
    region autodiff built for it (softmax grad Mul/Sum/Sub/Mul reading the probs,
    the mask Add's and the scale Mul's gradients) =>

        scores --ScaleMaskSoftmax(scale)--> probs --> (dropout, TF ops) --> probs . v
        dprobs, probs --ScaleMaskSoftmaxGrad(scale)--> dscores --> the q.k product's gradient

    ScaleMaskSoftmax keeps the Softmax's name (the dropout and the gradient of the
    second product read it unchanged).  The backward region is delimited by
    ``grad_region.find_grad_region`` (``grad_reads_output``: the softmax gradient
    reads the probabilities); every tensor leaving it must be the gradient of the
    raw scores, read by the product's (or its Transpose's) gradient, or the
    gradient of a learned mask of static shape (then
    ``ScaleMaskSoftmaxGrad(scale=1)`` summed over the mask's broadcast dims);
    anything else refuses the match with the reason.  A scale on q or k stays a
    TF op."""
    from .grad_region import GradRegionRefused, assign_outputs, attributed_forward, find_grad_region

    g = b.graph
    sm = b.anchor
    inner = []
    s_base, scale, mask, bool_mask = _softmax_front(b, sm, inner, transposed=True)
    dt = b.dtype(s_base)
    b.require(dt in registry.FLOAT_TYPES, f"scores dtype {registry.dtype_name(dt)}")
    inner = list(dict.fromkeys(inner))
    b.absorb(inner, escapes_ok=True)
    fwd = [sm.name] + inner
    outside = []
    for n in inner:
        for ref in g.data_inputs(g.nodes[n]):
            if parse_tensor(ref)[0] not in fwd and ref not in outside:
                outside.append(ref)
    protected = b.ctx.protected if b.ctx is not None else frozenset()
    try:
        region = find_grad_region(g, fwd, [sm.name], outside, shapes=b.shapes, protected=protected,
                                  grad_reads_output=True, partial_shapes=True)
    except GradRegionRefused as exc:
        raise Skip(str(exc)) from None
    bmm1 = _src(g, s_base)
    product = _src(g, bmm1.input[0]) if bmm1.op == "Transpose" else bmm1
    operands = set(g.data_inputs(product))
    why = {}

    def scores_grad_reader(c, idx):
        """``c`` is the gradient of the scores' producer: of the q.k product (a
        BatchMatMul/Einsum with q or k as its other operand; grappler may have
        folded the gradient of a Transpose after it into that product) or of
        that Transpose (a Transpose)."""
        if bmm1.op == "Transpose" and c.op == "Transpose" and idx == 0:
            return True
        other = [r for k, r in enumerate(g.data_inputs(c)) if k != idx]
        return c.op in _ATT_OPS and bool(operands.intersection(other))

    # the mask's gradient (T5's learned position bias, a learned mask): d/dlogits
    # summed over the dims the mask was broadcast along; its static shape is needed
    ms = b.shape(mask) if mask is not None else None
    ss = b.shape(s_base)
    mask_known = ms is not None and min(ms, default=1) >= 0
    same_shape = mask_known and ss is not None and list(ms) == list(ss)

    def classify(ref):
        if not region.depends_on_dy(ref):
            return None
        readers = region.outputs[ref]
        kinds = [scores_grad_reader(g.nodes[c], i) for c, i in readers]
        if all(kinds):
            return "dscores"
        rs = b.shape(ref)
        if mask_known and rs is not None and list(rs) == list(ms):
            # the region's outputs are the gradients of F's inputs: scores, mask, and the
            # scale/fill constants (scalars, unread); a mask-shaped one not read by the
            # scores' gradient is the mask's.  (Were the scores' gradient read by
            # something else, "dscores" would be missing, or two different tensors would
            # claim "dmask": assign_outputs and the require below refuse both.)
            if not any(kinds):
                return "dmask"
            if same_shape and scale == 1.0:
                return "dscores"  # no scale, full-shape mask: d/dscores == d/dmask, one tensor
        why["r"] = (ref, readers[kinds.index(False)][0])
        return None

    try:
        terms = assign_outputs(region, g, classify, summed=())
    except GradRegionRefused as exc:
        if "r" in why:
            ref, cname = why["r"]
            owner = attributed_forward(g, cname) or ""
            for what, t in (("mask", mask), ("mask", bool_mask and bool_mask[0])):
                if t and owner and parse_tensor(t)[0] == owner:
                    raise Skip(f"not fused: the {what} '{t}' needs a gradient ('{ref}' is read by "
                               f"'{cname}') and its shape {ms} is not static") from None
            raise Skip(f"not fused: the gradient '{ref}' is read by '{cname}', neither the gradient of "
                       f"the scores' producer '{bmm1.name}' nor of the mask") from None
        raise Skip(str(exc)) from None
    b.require("dscores" in terms, "not fused: the backward region yields no gradient for the scores")
    b.require(b.dtype(region.dy) == dt, "the incoming gradient's dtype differs from the scores")
    base = sm.name
    inputs = _softmax_inputs(b, base, s_base, mask, bool_mask, dt)
    b.emit("ScaleMaskSoftmax", base, inputs,
           {"T": ("type", dt), "num_masks": len(inputs) - 1, "scale": float(scale)})
    first = region.nodes[0]
    gname = (first.rsplit("/", 1)[0] + "/" if "/" in first else "") + "ScaleMaskSoftmaxGrad"
    b.emit("ScaleMaskSoftmaxGrad", gname, [region.dy, base], {"T": ("type", dt), "scale": float(scale)})
    rewire = {ref: gname for ref in terms["dscores"].refs}
    if "dmask" in terms:
        dmask = _mask_gradient(b, gname, region.dy, base, dt, ms, ss, scale)
        rewire.update({ref: dmask for ref in terms["dmask"].refs})
    b.region(region.nodes, rewire, target=gname)


def _mask_gradient(b, gname, dy, probs, dt, ms, ss, scale):
    """d/dmask = ScaleMaskSoftmaxGrad(dy, probs; scale=1) (the scores' own op when
    the scale is 1) summed over the dims the mask broadcast along, reshaped to
    the mask's (static) shape."""
    dl = gname if scale == 1.0 else b.emit("ScaleMaskSoftmaxGrad", gname + "_mask", [dy, probs],
                                           {"T": ("type", dt), "scale": 1.0})
    r = len(ss)
    md = [1] * (r - len(ms)) + list(ms)
    axes = [i for i in range(r) if md[i] == 1 and ss[i] != 1]
    b.require(all(md[i] in (1, ss[i]) or ss[i] < 0 for i in range(r)),
              f"the mask of shape {ms} does not broadcast to the scores {ss}")
    if not axes and len(ms) == r:
        return dl
    out = dl
    if axes:
        ax = b.const_node(gname + "_mask/axes", np.asarray(axes, np.int32), 3)  # DT_INT32
        out = b.emit("Sum", gname + "_mask/Sum", [dl, ax],
                     {"T": ("type", dt), "Tidx": ("type", 3), "keep_dims": True})
    shape = b.const_node(gname + "_mask/shape", np.asarray(ms, np.int32), 3)
    return b.emit("Reshape", gname + "_mask/Reshape", [out, shape], {"T": ("type", dt), "Tshape": ("type", 3)})


# ------------------------------------------------------------------ 1x1 filter gradient
#: measured (benchmarks/fused_forms.py --filter-grad; TF 2.15.1 and 2.21.0, oneDNN on, AMX): the
#: BF16 weight gradient of a 1x1 conv as one BF16 MatMul of the flattened input and output
#: gradient is 1.4-24x faster than oneDNN's BF16 Conv2DBackpropFilter (small spatial sizes worst:
#: [16,4,4,512]x[16,4,4,2048] 48 ms vs 2 ms, 10.7 vs 1.2 ms in a quieter run), and faster than its
#: FP32 one.  In FP32 the two are close (0.85-1.8x, one run per TF version, not validated on
#: whole models), so the rule fires only for a gradient the precision pass makes BF16.


#: ``filter_grad_im2col``: the kxk weight gradient as im2col (ExtractImagePatches) + one BF16
#: MatMul, measured against oneDNN's BF16 Conv2DBackpropFilter (3x3, batch 16, ms; conv / im2col):
#: output 4x4: 512 ch 61/23 (2.15), 50/9 (2.21); 256 ch 4.3/2.2; 128 ch 2.8/2.0; 2x2x512 47/7;
#: stride 2 10x10->4x4x256 26/10 (2.15), 11/2.7 (2.21); 6x6x512 50/27; 7x7x512 85/44 (2.15),
#: 91/42 (2.21); a quieter rerun: 4x4x512 17/4.3 (2.15), 19/5.6 (2.21), 7x7x512 17.5/17.8 (2.15,
#: parity), 29/19 (2.21).  Slower: 7x7x256 5.8/7.8, 8x8x256 15/24, 8x8x512 59/62, 14x14x256
#: 51/61, 16x16x128 5/45.  So: at most 16 output positions, or at most 49 with >= 512 input channels.
_IM2COL_MAX_POSITIONS = 16
_IM2COL_MAX_POSITIONS_WIDE = (49, 512)


def _filter_grad_predicate(node, graph):
    if node.op != "Conv2DBackpropFilter" or len(node.input) < 3:
        return False
    a = node.attr
    fmt = a["data_format"].s.decode() if "data_format" in a else "NHWC"
    dil = a["dilations"].list.i[:] if "dilations" in a else [1, 1, 1, 1]
    pad = a["padding"].s.decode() if "padding" in a else ""
    st = a["strides"].list.i[:] if "strides" in a else []
    return (fmt == "NHWC" and pad in ("SAME", "VALID") and all(d == 1 for d in dil)
            and len(st) == 4 and st[0] == 1 and st[3] == 1 and st[1] >= 1 and st[2] >= 1)


def _filter_grad_setup(b, want_1x1: bool):
    """Checks shared by the two filter-gradient rules; returns
    (x, dy, dtype, filter sizes, input shape, gradient shape, strides)."""
    node = b.anchor
    x, fsize, dy = node.input[0], node.input[1], node.input[2]
    _require_onednn_cpu(b, "the filter gradient as a BF16 MatMul")
    dt = node.attr["T"].type
    run_dt = planned_dtype(b.ctx, node.op, node.name, dt) if dt == registry.DT_FLOAT else dt
    b.require(run_dt == registry.DT_BFLOAT16,
              f"runs in {registry.dtype_name(run_dt)}: the MatMul form is measured faster in BF16 only")
    fs = b.const(fsize)
    if fs is None:  # e.g. ShapeN(input, filter)[1] before constant folding: the static shape
        known = b.shape(node.name)
        fs = np.asarray(known) if known is not None and min(known, default=-1) >= 0 else None
    b.require(fs is not None and fs.size == 4 and min(int(v) for v in fs) > 0,
              "filter_sizes is not known")
    fs = [int(v) for v in fs]
    is_1x1 = fs[0] == 1 and fs[1] == 1
    b.require(is_1x1 == want_1x1, f"filter {fs[0]}x{fs[1]}")
    xs, ys = b.shape(x), b.shape(dy)
    b.require(xs is not None and ys is not None and len(xs) == 4 and len(ys) == 4
              and xs[3] == fs[2] and ys[3] == fs[3],
              f"input {xs} / gradient {ys} shapes do not match filter_sizes {fs}")
    return x, dy, dt, fs, xs, ys, node.attr["strides"].list.i[:]


def _emit_filter_matmul(b, cols, dy, dt, fs, what):
    """Reshape(cols, [-1, K]) ^T x Reshape(dy, [-1, Co]) -> Reshape to the filter shape,
    under the anchor's name."""
    i32 = registry.types_pb2.DT_INT32
    name = b.anchor.name
    k = fs[0] * fs[1] * fs[2]
    rx = b.emit("Reshape", f"{name}/Flat{what}", [cols, b.const_node(f"{name}/Flat{what}/shape", [-1, k], i32)],
                {"T": ("type", dt), "Tshape": ("type", i32)})
    ry = b.emit("Reshape", f"{name}/FlatGrad", [dy, b.const_node(f"{name}/FlatGrad/shape", [-1, fs[3]], i32)],
                {"T": ("type", dt), "Tshape": ("type", i32)})
    mm = b.emit("MatMul", f"{name}/MatMul", [rx, ry],
                {"T": ("type", dt), "transpose_a": True, "transpose_b": False})
    b.emit("Reshape", name, [mm, b.const_node(f"{name}/shape", fs, i32)],
           {"T": ("type", dt), "Tshape": ("type", i32)})


def _build_filter_grad_im2col(m, b):
    """dW[i,j,ci,co] = sum_{n,h,w} xpad[n, h*s+i, w*s+j, ci] * dy[n,h,w,co]: the patches of x
    (ExtractImagePatches, same padding rule as the conv, last dim ordered (i, j, ci) as the
    filter) flattened to [N*H'*W', kh*kw*Ci], transposed, times dy flattened to [N*H'*W', Co]."""
    x, dy, dt, fs, xs, ys, st = _filter_grad_setup(b, want_1x1=False)
    pos = ys[1] * ys[2] if ys[1] > 0 and ys[2] > 0 else -1
    lim, (wide, wide_ch) = _IM2COL_MAX_POSITIONS, _IM2COL_MAX_POSITIONS_WIDE
    b.require(0 < pos and (pos <= lim or (pos <= wide and fs[2] >= wide_ch)),
              f"{ys[1]}x{ys[2]} output positions with {fs[2]} input channels: oneDNN's kernel is "
              f"measured faster there (im2col pays at <= {lim} positions, or <= {wide} with >= {wide_ch} channels)")
    pad = b.anchor.attr["padding"].s.decode()
    name = b.anchor.name
    cols = b.emit("ExtractImagePatches", f"{name}/Patches", [x],
                  {"T": ("type", dt), "ksizes": [1, fs[0], fs[1], 1], "strides": [1, st[1], st[2], 1],
                   "rates": [1, 1, 1, 1], "padding": pad})
    _emit_filter_matmul(b, cols, dy, dt, fs, "Patches")


def _build_filter_grad_1x1(m, b):
    """dW[0,0,ci,co] = sum_{n,h,w} x[n, h*s, w*s, ci] * dy[n, h, w, co]: with a 1x1
    filter, SAME and VALID both pad nothing (out = ceil(H/s), (out-1)*s+1 <= H), so
    the weight gradient is x (every s-th row and column) flattened to [N*H'*W', Ci],
    transposed, times dy flattened to [N*H'*W', Co]."""
    x, dy, dt, fs, xs, ys, st = _filter_grad_setup(b, want_1x1=True)
    i32 = registry.types_pb2.DT_INT32
    name = b.anchor.name
    if st[1] != 1 or st[2] != 1:
        b.require(xs[1] > 0 and xs[2] > 0 and ys[1] > 0 and ys[2] > 0,
                  f"strided 1x1 filter gradient with unknown spatial sizes {xs}")
        b.require(ys[1] == -(-xs[1] // st[1]) and ys[2] == -(-xs[2] // st[2]),
                  f"gradient {ys} is not the strided output of {xs}")
        beg = b.const_node(f"{name}/Subsample/begin", [0, 0, 0, 0], i32)
        end = b.const_node(f"{name}/Subsample/end", [0, 0, 0, 0], i32)
        stp = b.const_node(f"{name}/Subsample/strides", [1, st[1], st[2], 1], i32)
        x = b.emit("StridedSlice", f"{name}/Subsample", [x, beg, end, stp],
                   {"T": ("type", dt), "Index": ("type", i32), "begin_mask": 15, "end_mask": 15,
                    "ellipsis_mask": 0, "new_axis_mask": 0, "shrink_axis_mask": 0})
    else:
        b.require(xs[1] < 0 or ys[1] < 0 or (xs[1] == ys[1] and xs[2] == ys[2]),
                  f"gradient {ys} is not the output of {xs}")
    _emit_filter_matmul(b, x, dy, dt, fs, "Input")


def register_norms():
    """The layer-norm rules, registered before every other rule (issue 17):
    they run first in each sweep, so that the ``layer_norm`` rule's run on a
    graph the three pattern rules find nothing in is the one the grappler
    bridge can make in C++ before Python parses the graph
    (:mod:`graph_passes.fusion.prefuse`)."""
    reg = lambda *a, **kw: register_fusion_rule(*a, _builtin=True, **kw)  # noqa: E731
    reg("layer_norm_moments", _ln_moments_pat(), _build_ln_moments, escapes=True, searches_gradient=True,
        reason="10 elementwise/reduction ops become one fp32-accumulating kernel")
    reg("layer_norm_keras3", _ln_keras3_pat(), _build_ln_moments, escapes=True, searches_gradient=True,
        reason="Keras 3 LayerNormalization becomes one kernel")
    reg("layer_norm_keras2", _ln_keras2_pat(), _build_ln_keras2, escapes=True, searches_gradient=True,
        reason="Keras 2 LayerNormalization (reshape + FusedBatchNormV3) becomes one kernel")
    reg("layer_norm", Pat(_ADDS + ("Mul", "RealDiv"), predicate=_norm_predicate), _build_norm, searches_gradient=True,
        reason="LayerNorm/RMSNorm written as plain ops (raw, reduce_mean, moments, sqrt/div, "
               "reduce_variance) becomes one fp32-accumulating kernel")


def register():
    reg = lambda *a, **kw: register_fusion_rule(*a, _builtin=True, **kw)  # noqa: E731
    reg("bn_fold", _bn_fold_pat(), _build_bn_fold, graph_level=3,
        reason="inference batch norm folds into the conv weights and bias (rounding changes)", reads=0)
    reg("bias_gelu_exact", _gelu_exact_pat(), _build_gelu_exact, follows_precision=True,
        policy=fused_kernel_policy(MATRIX_OPS),
        reason="MatMul+BiasAdd+GELU(erf) is one oneDNN kernel", reads=0)
    reg("bias_gelu_tanh", _gelu_tanh_pat(), _build_gelu_tanh, follows_precision=True,
        policy=fused_kernel_policy(MATRIX_OPS),
        reason="MatMul+BiasAdd+GELU(tanh) is one oneDNN kernel", reads=0)
    reg("bias_add_act", Pat(("Relu", "Relu6", "Elu", "LeakyRelu"), inputs=[_side_add_pat("Conv2D")]),
        _build_bias_add_act, follows_precision=True, policy=fused_kernel_policy(("Conv2D",), side=True),
        reason="residual unit: conv, bias, the shortcut add and the activation in one oneDNN kernel", reads=0)
    reg("bias_add", _side_add_pat(("Conv2D", "MatMul")), _build_bias_add, follows_precision=True,
        policy=fused_kernel_policy(("Conv2D", "MatMul"), side=True),
        reason="conv/matmul, bias and a same-shape add (residual) in one oneDNN kernel", reads=0)
    reg("bn_act", Pat(tuple(_ONEDNN_BN_ACTIVATIONS), predicate=_bn_act_predicate), _build_bn_act,
        policy=_bn_act_policy,
        reason="batch norm and its Relu in one oneDNN kernel pass (training or inference)", reads=1)
    reg("bias_act", Pat(("Relu", "Relu6", "Elu", "LeakyRelu"), inputs=[_bias_pat()]), _build_bias_act,
        follows_precision=True, policy=fused_kernel_policy(MATRIX_OPS),
        reason="matrix op, bias and activation in one kernel pass", reads=0)
    reg("bias", _bias_pat(), _build_bias, follows_precision=True, policy=fused_kernel_policy(MATRIX_OPS),
        reason="matrix op and bias in one kernel pass", reads=0)
    reg("filter_grad_1x1", Pat("Conv2DBackpropFilter", predicate=_filter_grad_predicate),
        _build_filter_grad_1x1, follows_precision=True,
        policy=bf16_matrix_policy("Conv2DBackpropFilter", "the weight gradient's MatMul"),
        reason="the BF16 weight gradient of a 1x1 conv is one BF16 MatMul, measured faster than "
               "oneDNN's BF16 Conv2DBackpropFilter", reads=0)
    reg("filter_grad_im2col", Pat("Conv2DBackpropFilter", predicate=_filter_grad_predicate),
        _build_filter_grad_im2col, follows_precision=True,
        policy=bf16_matrix_policy("Conv2DBackpropFilter", "the weight gradient's MatMul"),
        reason="the BF16 weight gradient of a kxk conv with few output positions is im2col + one "
               "BF16 MatMul, measured faster than oneDNN's BF16 Conv2DBackpropFilter there", reads=0)
    __import__(__package__ + ".bias_grad", fromlist=["register"]).register(reg)  # its own file (18d)
    __import__(__package__ + ".subsample", fromlist=["register"]).register(reg)  # its own file (18d)
    __import__(__package__ + ".bf16_elementwise", fromlist=["register"]).register(reg)  # its own file (18f)
    __import__(__package__ + ".bf16_transformer", fromlist=["register"]).register(reg)  # its own file (18g)
    __import__(__package__ + ".bf16_apply", fromlist=["register"]).register(reg)  # its own file (18j)
    from .batch_norm import register as register_batch_norm  # its own file; imports this one

    register_batch_norm(reg)
    reg("attention_train", Pat("Softmax", predicate=_softmax_grad_signature), _build_attention_train,
        graph_level=3, escapes=True, searches_gradient=True,
        reason="training graph: scale + mask + softmax and their backward region become "
               "ScaleMaskSoftmax / ScaleMaskSoftmaxGrad (rounding changes)")
    reg("attention", Pat(_ATT_OPS, predicate=_att_predicate), _build_attention_any, graph_level=3,
        reason="scores never leave cache; softmax fused (rounding changes)")


__all__ = ["register", "supported_activations", "onednn_enabled", "Skip"]
