"""Built-in fusion rules (graph_level 2 and 3).  One entry per rule, each with a reason.

level 3  ``bn_fold``            Conv2D/Depthwise [+BiasAdd] -> FusedBatchNorm(inference, constants)
                                 => Conv2D(W*s) + BiasAdd((b-mean)*s+offset)
level 2  ``bias_gelu_exact``    MatMul + BiasAdd + GELU(erf)      => _FusedMatMul[BiasAdd,GeluExact]
level 2  ``bias_gelu_tanh``     MatMul + BiasAdd + GELU(tanh)     => _FusedMatMul[BiasAdd,GeluApproximate]
level 2  ``bias_act``           Conv2D/Depthwise/MatMul + BiasAdd + Relu|Relu6|Elu|LeakyRelu
                                 => _FusedConv2D/_FusedDepthwiseConv2dNative/_FusedMatMul
level 2  ``bias``               Conv2D/Depthwise/MatMul + BiasAdd => the same fused ops [BiasAdd]
level 2  ``layer_norm_moments`` tf.nn.moments + tf.nn.batch_normalization (BERT)   => LayerNorm
level 2  ``layer_norm_keras3``  Keras 3 LayerNormalization (moments, Neg)          => LayerNorm
level 2  ``layer_norm_keras2``  Keras 2 LayerNormalization (reshape + FusedBatchNormV3) => LayerNorm
level 3  ``attention``          BatchMatMul -> scale -> [mask add] -> Softmax -> BatchMatMul
                                 => FusedAttention

"BiasAdd" also means ``Add``/``AddV2`` of a 1-D bias (or a [1,..,1,C] reshape of one)
along the last dim, as Keras 3 writes it.
"""
from __future__ import annotations

import math

import numpy as np

from .. import registry
from ..graph import parse_tensor
from ..pattern import Pat
from .core import Skip, planned_dtype, register_fusion_rule

MATRIX_OPS = ("Conv2D", "DepthwiseConv2dNative", "MatMul")
FUSED_OP = {"Conv2D": "_FusedConv2D", "DepthwiseConv2dNative": "_FusedDepthwiseConv2dNative",
            "MatMul": "_FusedMatMul"}
BMM_OPS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def onednn_enabled() -> bool:
    """oneDNN rewrites _Fused* ops into its own kernels, which accept more activations."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except Exception:  # noqa: BLE001 - older/newer TF without the probe: assume stock kernels
        return False


#: fused_ops the CPU kernels accept (measured on TF 2.15 and 2.21; see docs/fusion.md)
_EIGEN = {"Conv2D": {"", "Relu", "Relu6", "Elu", "LeakyRelu"},
          "MatMul": {"", "Relu", "Relu6", "Elu", "LeakyRelu"},
          "DepthwiseConv2dNative": set()}
_ONEDNN = {"Conv2D": {"", "Relu", "Relu6", "Elu", "LeakyRelu"},
           "MatMul": {"", "Relu", "Relu6", "Elu", "LeakyRelu", "GeluExact", "GeluApproximate"},
           "DepthwiseConv2dNative": {"", "Relu", "Relu6", "Elu"}}


def supported_activations(op: str, device_type: str = "CPU") -> set:
    if device_type != "CPU":
        return {"", "Relu", "Relu6", "Elu", "LeakyRelu"} if op != "DepthwiseConv2dNative" else {""}
    return (_ONEDNN if onednn_enabled() else _EIGEN)[op]


# ------------------------------------------------------------------ bias part
def _bias_pat():
    return Pat.one_of(
        Pat("BiasAdd", name="bias", inputs=[Pat(MATRIX_OPS, name="mm"), Pat.any("b")]),
        Pat(("AddV2", "Add"), name="bias", commutative=True,
            inputs=[Pat(MATRIX_OPS, name="mm"), Pat.any("b")]))


def _bias_input(m, b) -> str:
    """The 1-D bias tensor for the fused op (emits a Reshape for [1,..,1,C])."""
    bias = m["bias"]
    if bias.op == "BiasAdd":
        fmt = bias.attr["data_format"].s.decode() if "data_format" in bias.attr else "NHWC"
        b.require(fmt == "NHWC", f"BiasAdd data_format {fmt} (fused kernels take NHWC)")
        return m["b"]
    shape = b.shape(m["b"])
    out = b.shape(m["mm"].name)
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


def _emit_fused(m, b, act: str, extra_attrs=None):
    mm = m["mm"]
    dev = b.device_type()
    ok = supported_activations(mm.op, dev)
    b.require(act in ok, f"{FUSED_OP[mm.op]} on {dev} (oneDNN {'on' if onednn_enabled() else 'off'}) "
                         f"does not support activation {act or 'none'}")
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
    bias = _bias_input(m, b)
    fused = FUSED_OP[mm.op]
    od = registry.op_def(fused)
    names = {a.name for a in od.attr} if od is not None else set()
    attrs = {k: v for k, v in mm.attr.items() if k in names}
    attrs["T"] = ("type", dt)
    attrs["num_args"] = 1
    if "TArgs" in names:
        attrs["TArgs"] = ("types", [dt])
    attrs["fused_ops"] = ["BiasAdd"] + ([act] if act else [])
    attrs["epsilon"] = 0.0001
    attrs.update(extra_attrs or {})
    data = b.graph.data_inputs(mm)
    b.emit(fused, m.anchor, [data[0], data[1], bias], attrs)


def _build_bias(m, b):
    _emit_fused(m, b, "")


def _build_bias_act(m, b):
    act = b.anchor.op
    extra = {}
    if act == "LeakyRelu":
        extra["leakyrelu_alpha"] = float(b.anchor.attr["alpha"].f) if "alpha" in b.anchor.attr else 0.2
    _emit_fused(m, b, act, extra)


def _close(v, want, tol=1e-4):
    return v is not None and abs(v - want) <= tol * max(1.0, abs(want))


def _build_gelu_exact(m, b):
    b.require(_close(b.scalar(m["half"]), 0.5) and _close(b.scalar(m["one"]), 1.0),
              "GELU constants are not 0.5 and 1")
    c = b.scalar(m["c"])
    div = m["div"].op == "RealDiv"
    b.require(c is not None and (_close(c, math.sqrt(2.0)) if div else _close(c, 1 / math.sqrt(2.0))),
              f"erf argument scale {c} is not 1/sqrt(2)")
    _emit_fused(m, b, "GeluExact")


def _build_gelu_tanh(m, b):
    b.require(_close(b.scalar(m["half"]), 0.5) and _close(b.scalar(m["one"]), 1.0)
              and _close(b.scalar(m["k"]), math.sqrt(2 / math.pi)) and _close(b.scalar(m["a"]), 0.044715)
              and _close(b.scalar(m["three"]), 3.0), "tanh-GELU constants do not match")
    _emit_fused(m, b, "GeluApproximate")


def _gelu_exact_pat():
    x = _bias_pat()
    erf_arg = Pat(("RealDiv", "Mul"), name="div", inputs=[Pat.any("@bias"), Pat.any("c")])
    one_plus = Pat(("AddV2", "Add"), commutative=True, name="onep",
                   inputs=[Pat.any("one"), Pat("Erf", name="erf", inputs=[erf_arg])])
    return Pat("Mul", commutative=True, inputs=[
        Pat("Mul", name="halfx", commutative=True, inputs=[Pat.any("half"), x]), one_plus])


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
def _last_axis(b, axes_ref, x_ref) -> bool:
    v = b.const(axes_ref)
    if v is None or v.size != 1:
        return False
    ax = int(v.reshape(()))
    if ax == -1:
        return True
    xs = b.shape(x_ref)
    return xs is not None and ax == len(xs) - 1


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


def _build_ln_moments(m, b):
    for a in ("axes", "axes2"):
        b.require(_last_axis(b, m[a], m["x"]), "moments are not over the last axis")
    b.require(m["mean"].attr["keep_dims"].b and m["var"].attr["keep_dims"].b, "moments without keep_dims")
    eps = b.scalar(m["eps"])
    b.require(eps is not None and eps >= 0, "variance epsilon is not a constant")
    _emit_layer_norm(m, b, m["x"], m["gamma"], m["beta"], eps)


def _moments():
    mean = Pat("Mean", name="mean", inputs=[Pat.any("x"), Pat.any("axes")])
    var = Pat("Mean", name="var", inputs=[
        Pat("SquaredDifference", name="sqd", inputs=[
            Pat.any("x"), Pat("StopGradient", name="sg", inputs=[Pat.any("@mean")])]),
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
    return Pat(("AddV2", "Add"), commutative=True, inputs=[
        Pat("Mul", name="xinv", commutative=True, inputs=[Pat.any("x"), inv]),
        Pat(("AddV2", "Add"), name="shift", commutative=True, inputs=[
            Pat("Mul", name="minv", commutative=True, inputs=[
                Pat("Neg", name="neg", inputs=[mean]), Pat.any("@inv")]),
            Pat.any("beta")])])


def _build_ln_keras2(m, b):
    fbn = m["fbn"]
    b.require(fbn.attr["is_training"].b and fbn.attr["data_format"].s == b"NCHW",
              "FusedBatchNorm is not the Keras layer-norm form (training, NCHW)")
    for k, want in (("scale", 1.0), ("offset", 0.0)):
        node = b.graph.nodes.get(parse_tensor(m[k])[0])
        b.require(node is not None and node.op == "Fill" and _close(b.scalar(node.input[1]), want),
                  f"FusedBatchNorm {k} is not a fill of {want}")
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


# ------------------------------------------------------------------ attention
def _build_attention(m, b):
    bmm1, bmm2 = m["bmm1"], m["bmm2"]
    adj = lambda n, a: n.attr[a].b if a in n.attr else False  # noqa: E731
    b.require(not adj(bmm1, "adj_x") and not adj(bmm2, "adj_x") and not adj(bmm2, "adj_y"),
              "transposed operands other than k")
    for n in (bmm1, bmm2):
        for a in ("Ta", "Tb", "Tout"):
            if a in n.attr:
                b.require(n.attr[a].type == registry.DT_FLOAT, f"{n.name} {a} is not float32")
    c = b.scalar(m["scale"])
    b.require(c is not None and c != 0, "attention scale is not a constant")
    scale = 1.0 / c if m["scale_op"].op == "RealDiv" else c
    q, k, v = m["q"], m["k"], m["v"]
    shapes = [b.shape(t) for t in (q, k, v)]
    b.require(all(s is not None for s in shapes) and len({len(s) for s in shapes}) == 1 and len(shapes[0]) >= 2,
              f"q/k/v shapes {shapes}: need equal known ranks")
    r = len(shapes[0])
    for i in range(r - 2):
        dims = {s[i] for s in shapes if s[i] != -1}
        b.require(len(dims) <= 1, f"q/k/v batch dims differ (broadcasting batch matmul): {shapes}")
    inputs = [q, k, v]
    if "mask_add" in m.nodes:
        ms = b.shape(m["mask"])
        b.require(ms is not None and len(ms) <= r, f"mask shape {ms} unknown or of higher rank")
        b.require(b.dtype(m["mask"]) == registry.DT_FLOAT, "mask is not float32")
        inputs.append(m["mask"])
    b.emit("FusedAttention", m.anchor, inputs,
           {"T": ("type", registry.DT_FLOAT), "num_masks": len(inputs) - 3, "scale": float(scale),
            "adj_k": bool(adj(bmm1, "adj_y"))})


def _attention_pat():
    bmm1 = Pat(BMM_OPS, name="bmm1", inputs=[Pat.any("q"), Pat.any("k")])
    scaled = Pat.one_of(Pat("Mul", name="scale_op", commutative=True, inputs=[bmm1, Pat.any("scale")]),
                        Pat("RealDiv", name="scale_op", inputs=[bmm1, Pat.any("scale")]))
    masked = Pat(("AddV2", "Add"), name="mask_add", commutative=True, inputs=[scaled, Pat.any("mask")])
    sm = Pat("Softmax", name="softmax", inputs=[Pat.one_of(masked, scaled)])
    return Pat(BMM_OPS, name="bmm2", inputs=[sm, Pat.any("v")])


def register():
    reg = lambda *a, **kw: register_fusion_rule(*a, _builtin=True, **kw)  # noqa: E731
    reg("bn_fold", _bn_fold_pat(), _build_bn_fold, graph_level=3,
        reason="inference batch norm folds into the conv weights and bias (rounding changes)")
    reg("bias_gelu_exact", _gelu_exact_pat(), _build_gelu_exact, follows_precision=True,
        reason="MatMul+BiasAdd+GELU(erf) is one oneDNN kernel")
    reg("bias_gelu_tanh", _gelu_tanh_pat(), _build_gelu_tanh, follows_precision=True,
        reason="MatMul+BiasAdd+GELU(tanh) is one oneDNN kernel")
    reg("bias_act", Pat(("Relu", "Relu6", "Elu", "LeakyRelu"), inputs=[_bias_pat()]), _build_bias_act,
        follows_precision=True, reason="matrix op, bias and activation in one kernel pass")
    reg("bias", _bias_pat(), _build_bias, follows_precision=True,
        reason="matrix op and bias in one kernel pass")
    reg("layer_norm_moments", _ln_moments_pat(), _build_ln_moments,
        reason="10 elementwise/reduction ops become one fp32-accumulating kernel")
    reg("layer_norm_keras3", _ln_keras3_pat(), _build_ln_moments,
        reason="Keras 3 LayerNormalization becomes one kernel")
    reg("layer_norm_keras2", _ln_keras2_pat(), _build_ln_keras2,
        reason="Keras 2 LayerNormalization (reshape + FusedBatchNormV3) becomes one kernel")
    reg("attention", _attention_pat(), _build_attention, graph_level=3,
        reason="scores never leave cache; softmax fused (rounding changes)")


__all__ = ["register", "supported_activations", "onednn_enabled", "Skip"]
