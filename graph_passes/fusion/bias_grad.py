"""Level-2 fusion rule ``bias_grad_matmul``: a BF16 bias gradient (``BiasAddGrad``)
becomes one BF16 MatMul of a ones row with the flattened output gradient, under oneDNN.

Why: TF's BF16 ``BiasAddGrad`` is an Eigen reduction that accumulates in BF16: slower
than FP32's (Keras 2 ResNet-50 in a session, TF 2.21, ours 70 vs FP32 49 ms per step)
and inexact (relative L2 error 0.02-0.21 against the exact sum of the same BF16 values
on ResNet-50's shapes: a sum of 2^12-2^16 BF16 additions).  oneDNN's BF16 MatMul reads
the same BF16 gradient once, accumulates in FP32 and rounds once to BF16 (error 1.4-1.8e-3,
one BF16 rounding); measured 1.8x faster than BF16 ``BiasAddGrad`` summed over ResNet-50's
and BERT's shapes, and about as fast as FP32's ``BiasAddGrad`` on FP32 data
(``benchmarks/fused_forms.py --bias-grad``; table in :data:`MEASURED`).

Before / after (NHWC, or a rank-2 [N, C] gradient; M = N*H*W)::

    dy [N,H,W,C] (BF16) ── BiasAddGrad ── db [C]

    dy ── Reshape [M, C] ──┐
    ones [1, M] (Const) ── MatMul ── [1, C] ── Reshape [C] = db   (same name as the BiasAddGrad)

The fusion pass runs before the precision pass, so the emitted ops are FP32 then: the
MatMul is white (BF16 in ``allow_mix_precision_bf16``), the Reshapes are clear, the ones
splat Const is re-typed in place.  The rule fires only where the result is sure to run in
BF16 on a BF16 gradient, i.e. where that is measured to pay:

* oneDNN on, CPU (the BF16 MatMul is oneDNN's; with oneDNN off not measured: refused);
* the precision plan runs MatMul in BF16 (FP32 modes and FP16 modes: refused, the FP16
  MatMul is ~130x slower than FP32's on TF 2.15 and FP16 was not measured here);
* a white op the plan runs in BF16 reads the same gradient (a conv's weight or input
  gradient, a MatMul's gradient, or a filter-gradient rule's Reshape -> MatMul), so the
  gradient exists in BF16 anyway: the MatMul adds no Cast.  (``BiasAddGrad`` itself is
  gray: it follows its producer, so without such a reader the gradient may stay FP32.)
* static shape with M = N*H*W >= 256 (the smallest measured shape that pays: [16,4,4,512];
  at [16,100] the two are at parity) and C known.

``bias_grad_bn_zero`` (runs first, same conditions but the size): the bias gradient of a
conv whose output feeds a *training* batch norm is exactly zero, whatever dy is: the
gradient reaching the bias is the batch norm's input gradient
``dx = g*r*(dy - mean(dy) - (x - m)*r^2*mean(dy*(x - m)))`` (m, r^-2 - eps the batch mean and
variance of x over N, H, W), and its sum over N, H, W is
``g*r*(sum dy - n*mean(dy) - r^2*mean(dy*(x - m))*sum(x - m)) = 0`` since ``sum(x - m) = 0``.
(A training batch norm removes any per-channel shift of its input.)  So
``BiasAddGrad(FusedBatchNormGrad*(is_training=True):0)`` becomes a zero [C] Const: FP32
computes rounding noise there (~1e-8 of the update's scale on the test nets), TF's BF16
BiasAddGrad ~1e-3, the MatMul form ~1e-5; the Const is the exact value and costs nothing
(the Keras 2 ResNet-50 step spent 19 ms of op time on these 53 bias gradients as MatMuls).
Matched only when the BiasAddGrad's input is that output itself (through Identity nodes), the
batch norm is NHWC (statistics over N, H, W: BiasAddGrad's axes) and ``is_training`` is true.
"""
from __future__ import annotations

import numpy as np

from .. import registry
from ..graph import parse_tensor
from .builtin import _require_onednn_cpu, bf16_matrix_policy
from .core import planned_dtype

#: measured (``benchmarks/fused_forms.py --bias-grad``, oneDNN on, AMX; ms, minimum over 5 rounds
#: of 4 runs; BF16 gradient in; BiasAddGrad BF16 / MatMul form / FP32 BiasAddGrad on FP32 data):
#: sum over ResNet-50's 9 conv-output shapes (b16, 128x128) and BERT's [1024, 768], [1024, 3072],
#: [16, 100]: TF 2.21.0 7.88 / 4.27 / 4.34 (load 2.0; a quieter run over the 9 conv shapes 4.74 /
#: 2.79 / 3.13), TF 2.15.1 7.63 / 4.00 / 4.04 (load 2.2; 4.97 / 2.77 / 3.28).  Per shape the MatMul
#: form is 1.1-3x faster, except [16, 100] (0.06 vs 0.05 ms).  Other forms measured slower: BF16
#: BiasAddGrad after a Cast to FP32 (8.66 / 9.47), BF16 Sum over (N, H, W) (10.8 / 9.6; slow on
#: 32x32 and 16x16 shapes), FP32 Sum (19.8 / 18.0), the MatMul as dy^T x ones[M, 1] (7.15 / 5.87).
#: Relative L2 error against the exact sum of the BF16 values: BiasAddGrad BF16 0.005-0.21, the
#: MatMul form 1.4-1.8e-3 (one BF16 rounding), FP32 forms ~1e-7.
MEASURED = {
    ("2.21", True): "MatMul form 1.8x faster than BF16 BiasAddGrad (4.27 vs 7.88 ms over 12 shapes), "
                    "at parity with FP32 BiasAddGrad (4.34)",
    ("2.15", True): "MatMul form 1.9x faster than BF16 BiasAddGrad (4.00 vs 7.63 ms), parity with FP32 (4.04)",
}
#: the smallest N*H*W measured to pay
MIN_ROWS = 256

_WHITE_READERS = ("Conv2DBackpropFilter", "Conv2DBackpropInput", "MatMul", "_FusedMatMul",
                  "DepthwiseConv2dNativeBackpropFilter", "DepthwiseConv2dNativeBackpropInput")


def _same_tensors(graph, ref):
    """``ref`` and the tensors that equal it through Identity nodes (both ways: the
    gradient tuples ``tf.gradients`` builds put Identity nodes between a gradient and
    its readers)."""
    src, port, _ = parse_tensor(ref)
    node = graph.nodes.get(src)
    while node is not None and node.op == "Identity" and node.input and port == 0:
        src, port, _ = parse_tensor(node.input[0])
        node = graph.nodes.get(src)
    out, todo = [(src, port)], [(src, port)]
    while todo:
        name, p = todo.pop()
        for cname, _idx in graph.consumers(name, p, control=False):
            c = graph.nodes[cname]
            if c.op == "Identity" and (cname, 0) not in out:
                out.append((cname, 0))
                todo.append((cname, 0))
    return out


def _bf16_white_reader(b, dy):
    """The name of a white op the precision plan runs in BF16 that reads ``dy`` (directly,
    through Identity, or through a Reshape as the filter-gradient rules emit), or None."""
    g = b.graph
    for name, port in _same_tensors(g, dy):
        for cname, _idx in g.consumers(name, port, control=False):
            c = g.nodes[cname]
            cands = [c]
            if c.op == "Reshape":
                cands = [g.nodes[n] for n, _ in g.consumers(cname, 0, control=False)]
            for r in cands:
                if r.op not in _WHITE_READERS or r.name == b.anchor.name:
                    continue
                dt = r.attr["T"].type if "T" in r.attr else registry.DT_FLOAT
                if planned_dtype(b.ctx, r.op, r.name, dt) == registry.DT_BFLOAT16:
                    return r.name
    return None


def _predicate(node, graph):
    if node.op != "BiasAddGrad" or not node.input:
        return False
    fmt = node.attr["data_format"].s.decode() if "data_format" in node.attr else "NHWC"
    return fmt == "NHWC"


def _build(m, b):
    node = b.anchor
    dy = b.graph.data_inputs(node)[0]
    dt = _common_checks(b, node, dy)
    shp = b.shape(dy)
    b.require(shp is not None and len(shp) in (2, 4) and min(shp) > 0,
              f"gradient shape {shp}: needs a static rank-2 or rank-4 shape")
    rows, ch = int(np.prod(shp[:-1])), int(shp[-1])
    b.require(rows >= MIN_ROWS,
              f"{rows} rows (N*H*W): the MatMul form is measured to pay from {MIN_ROWS} rows")
    i32 = registry.types_pb2.DT_INT32
    name = node.name
    flat = b.emit("Reshape", f"{name}/FlatGrad", [dy, b.const_node(f"{name}/FlatGrad/shape", [rows, ch], i32)],
                  {"T": ("type", dt), "Tshape": ("type", i32)})
    ones = b.emit("Const", f"{name}/Ones", [], {
        "dtype": ("type", dt),
        "value": _splat(1.0, [1, rows], dt)})
    mm = b.emit("MatMul", f"{name}/MatMul", [ones, flat],
                {"T": ("type", dt), "transpose_a": False, "transpose_b": False})
    b.emit("Reshape", name, [mm, b.const_node(f"{name}/shape", [ch], i32)],
           {"T": ("type", dt), "Tshape": ("type", i32)})


# (BatchNormGradNHWC: the bf16_*bn_grad rules' form, NHWC and training by definition)
_BN_GRADS = ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3", "BatchNormGradNHWC")


def _bn_training_dx(graph, ref):
    """The training FusedBatchNormGrad* (NHWC) whose output 0 ``ref`` is (through Identity), or None."""
    src, port, _ = parse_tensor(ref)
    node = graph.nodes.get(src)
    while node is not None and node.op == "Identity" and node.input and port == 0:
        src, port, _ = parse_tensor(node.input[0])
        node = graph.nodes.get(src)
    if node is None or node.op not in _BN_GRADS or port != 0:
        return None
    a = node.attr
    fmt = a["data_format"].s.decode() if "data_format" in a else "NHWC"
    training = a["is_training"].b if "is_training" in a else True
    return node if fmt == "NHWC" and training else None


def _common_checks(b, node, dy):
    """oneDNN CPU, a BF16 MatMul plan and a BF16 reader of dy (both bias-gradient rules)."""
    _require_onednn_cpu(b, "the bias gradient rewrite")
    dt = node.attr["T"].type
    b.require(dt in (registry.DT_FLOAT, registry.DT_BFLOAT16),
              f"BiasAddGrad in {registry.dtype_name(dt)}: the MatMul form is measured for BF16 only")
    run_mm = planned_dtype(b.ctx, "MatMul", node.name + "/MatMul", dt) if dt == registry.DT_FLOAT else dt
    b.require(run_mm == registry.DT_BFLOAT16,
              f"MatMul runs in {registry.dtype_name(run_mm)}: the MatMul form is measured faster in BF16 only")
    reader = _bf16_white_reader(b, dy) if dt == registry.DT_FLOAT else "(already BF16)"
    b.require(reader is not None,
              "no BF16 matrix op reads the gradient: it may stay FP32, and a BF16 MatMul would add a Cast")
    return dt


def _build_bn_zero(m, b):
    node = b.anchor
    dy = b.graph.data_inputs(node)[0]
    bn = _bn_training_dx(b.graph, dy)
    b.require(bn is not None, "the gradient is not a training batch norm's input gradient")
    dt = _common_checks(b, node, dy)
    shp = b.shape(dy)
    b.require(shp is not None and len(shp) == 4 and shp[-1] > 0, f"gradient shape {shp}: needs rank 4, C known")
    b.emit("Const", node.name, [], {"dtype": ("type", dt), "value": _splat(0.0, [shp[-1]], dt)})


def _splat(value, shape, dt):
    """A splat TensorProto AttrValue (one value, the shape): small in the GraphDef."""
    from tensorflow.core.framework import attr_value_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

    t = tensor_pb2.TensorProto(dtype=dt, tensor_shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=int(s)) for s in shape]))
    if dt == types_pb2.DT_BFLOAT16:
        import numpy as _np
        t.half_val.append(int(_np.array([value], _np.float32).view(_np.uint32)[0] >> 16))
    else:
        t.float_val.append(float(value))
    return attr_value_pb2.AttrValue(tensor=t)


def register(reg):
    """Called from ``builtin.register`` with its registering function."""
    from ..pattern import Pat

    policy = bf16_matrix_policy("BiasAddGrad", "MatMul")
    reg("bias_grad_bn_zero", Pat("BiasAddGrad", predicate=_predicate), _build_bn_zero, follows_precision=True,
        policy=policy,
        reason="the bias gradient of a conv feeding a training batch norm is exactly zero (the norm removes "
               "any per-channel shift): a zero Const instead of a BF16 reduction of rounding noise")
    reg("bias_grad_matmul", Pat("BiasAddGrad", predicate=_predicate), _build, follows_precision=True,
        policy=policy,
        reason="the BF16 bias gradient as one oneDNN BF16 MatMul (ones x flattened gradient): measured "
               "1.8x faster than TF's BF16 BiasAddGrad, and it accumulates in FP32")
    # (reads not declared: the build looks at the gradient's other readers, which the
    # filter-gradient rules rewrite)


__all__ = ["register", "MEASURED", "MIN_ROWS"]
