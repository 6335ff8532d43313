"""Level-2 fusion rules for the BF16 residual units of CNN training graphs (issue 18):
the elementwise chain around a residual join and the batch-norm gradient run as this
project's kernels (``custom_ops/bf16_elementwise.cc``) instead of TF's BF16 ones.

Why: once the convs run in BF16 (2.9-3.3x faster than FP32), what is left of a Keras
ResNet-50 BF16 training step is memory-bound glue, and TF runs it *slower* in BF16 than in
FP32: its BF16 Eigen elementwise kernels convert element by element (TF 2.21, op time per
step: ReluGrad 25, Relu 19, AddV2 18, AddN 13 ms, about twice FP32's), and oneDNN's BF16
``FusedBatchNormGradV3`` (54 ms) barely beats FP32's (63).  The kernels here load 16 BF16
values, widen them (a shift), compute in FP32 and round back once with TF's own
round-to-nearest-even, so they read half FP32's bytes; fusing neighbours saves whole passes
over memory.  Measured per ResNet-50 shape against TF's BF16 and FP32 forms in one process
(``benchmarks/fused_forms.py --bf16-elementwise``; table in :data:`MEASURED`).

Rules (before => after; every emitted node keeps the anchor's name, so its readers are untouched)::

    bf16_add_relu        Relu(AddV2|Add(a, b))                  => AddRelu(a, b)
    bf16_join_grad_sum   Reshape(Sum(g, BroadcastGradientArgs(Shape(x0), Shape(x1))[i]), Shape(xi))
                                                                 => JoinGradSum(g, Shape(xi))
    bf16_addn_relu_grad  ReluGrad(AddN(a, b), features)          => AddNReluGrad(a, b, features)
    bf16_relu_bn_grad    FusedBatchNormGradV3(ReluGrad(g, f), x, scale, mean, var, rs3)
                                                                 => BatchNormGradNHWC(g, x, scale, mean, var, [f])
    bf16_bn_grad         FusedBatchNormGradV3(dy, x, scale, mean, var, rs3)
                                                                 => BatchNormGradNHWC(dy, x, scale, mean, var, [])

In a ResNet the forward residual join is ``Relu(AddV2(shortcut, bn))``, the backward one
``ReluGrad(AddN(dconv_input, d_shortcut), relu_out)`` (its output feeds the batch-norm
gradient and the next join), and every conv -> BN -> Relu has ``FusedBatchNormGradV3(
ReluGrad(dconv_input, relu_out), ...)`` with the ReluGrad read only by the batch norm.

Values: the elementwise ops equal TF's BF16 ``AddV2 -> Relu`` / ``AddN -> ReluGrad`` bit for
bit (TF computes each in FP32 and rounds: ``relu(round(a + b))`` and ``round(a + b) * mask``
are what the kernels compute; NaN results are NaN).  The batch-norm gradient computes TF's
formula (``FusedBatchNormGradV3``, ``is_training``) in FP32 with FP32 column sums in fixed row
blocks and rounds dx once to BF16: its error against a float64 reference equals TF's BF16
kernel's (max |err| / max |dx| 2.2-2.6e-3 on every ResNet-50 shape, both).

Conditions (each refusal is reported): CPU (oneDNN on or off: with it off TF's Eigen BF16 batch-norm
gradient is 6x slower than ours, measured); format_mode not NC1HWC0; a precision plan that lowers to BF16
(``allow_mix_precision_bf16`` and the other BF16 modes; FP32 and FP16 modes: refused, the
kernels are measured for BF16 only); the op in float32 (the precision pass will paint the
emitted op: it is gray, like the ops it replaces, and the float kernels are there if it stays
FP32) or bfloat16; ``AddV2`` with both inputs of one rank and equal known dims but the leading
one, which may be unknown (Keras ``fit`` and TF2 function graphs have batch ``None``; the kernel
broadcasts a leading dim of 1 as AddV2 does and rejects any other mismatch, so it equals
AddV2 -> Relu on every shape the graph admits; other broadcasting adds are refused; ``AddN``
and ``ReluGrad`` need equal shapes by their OpDefs); ``AddN`` of exactly 2 inputs;
``FusedBatchNormGradV3`` NHWC, ``is_training``, U float, outputs 3 and 4 unread, rank 4 with
C static, and (without a fused ReluGrad) N*H*W >= :data:`MIN_BN_ROWS` (smaller ones measured
at parity).  The ReluGrad is fused into the batch-norm gradient only where the batch norm is
its only reader.
"""
from __future__ import annotations

import numpy as np

from .. import registry
from ..graph import parse_tensor, tensor_name
from ..pattern import Pat

#: measured (``benchmarks/fused_forms.py --bf16-elementwise``; ms per run, min over 5 rounds of 8
#: runs, summed over ResNet-50's (b16, 128x128) shapes: 4 residual-join shapes, 9 batch-norm
#: shapes; TF BF16 / ours BF16 / TF FP32 on FP32 data, wall):
#: TF 2.21.0 oneDNN on (load 3.6): add_relu 8.87 / 5.20 / 7.60, addn_relugrad 8.90 / 3.69 / 7.58,
#: bn_grad 16.36 / 11.17 / 21.44, relu_bn_grad 25.23 / 13.85 / 30.73 (CPU ms: 6.77 / 4.18 / 5.58,
#: 7.54 / 4.15 / 6.79, 14.57 / 10.70 / 19.94, 23.52 / 13.06 / 26.07).  Elementwise: bit-equal to TF's
#: BF16 result on every shape.  bn_grad at N*H*W = 256 ([16,4,4,512], [16,4,4,2048]): 0.67 vs 0.35 and
#: 1.25 vs 1.01 ms wall, CPU at parity: not paying, hence MIN_BN_ROWS.  TF 2.15.1 oneDNN on (load 4.8):
#: add_relu 11.54 / 5.06 / 4.88, addn_relugrad 7.39 / 3.84 / 7.41, bn_grad 14.53 / 9.63 / 23.80,
#: relu_bn_grad 21.61 / 12.02 / 32.85 (CPU ms 6.92 / 3.79 / 5.34, 7.39 / 3.96 / 7.62, 13.74 / 10.15 /
#: 18.84, 21.50 / 11.48 / 28.34); bit-equal on every shape; bn_grad at [16,4,4,2048] 1.11 vs 0.80 wall.
#: TF 2.21.0 oneDNN off (TF_ENABLE_ONEDNN_OPTS=0, Eigen kernels, load 8.7): add_relu 12.63 / 6.21 / 15.43,
#: addn_relugrad 9.67 / 7.67 / 22.49, bn_grad 100.33 / 16.21 / 122.32, relu_bn_grad 110.01 / 19.47 / 125.43
#: (Eigen's BF16 batch-norm gradient is 6x slower than ours): the rules need no oneDNN.
MEASURED = {
    ("2.21", "add_relu"): "1.7x faster than TF's BF16 AddV2+Relu (5.20 vs 8.87 ms), 1.5x FP32's (7.60)",
    ("2.21", "addn_relugrad"): "2.4x faster than TF's BF16 AddN+ReluGrad (3.69 vs 8.90 ms), 2.1x FP32's (7.58)",
    ("2.21", "bn_grad"): "1.5x faster than oneDNN's BF16 FusedBatchNormGradV3 (11.17 vs 16.36 ms), 1.9x FP32's",
    ("2.21", "relu_bn_grad"): "1.8x faster than TF's BF16 ReluGrad+FusedBatchNormGradV3 (13.85 vs 25.23 ms)",
    ("2.21", "onednn_off"): "2.0x (add_relu), 1.3x (addn_relugrad), 6.2x (bn_grad), 5.7x (relu_bn_grad) faster "
                            "than TF's Eigen BF16 ops",
    ("2.15", "add_relu"): "2.3x faster than TF's BF16 AddV2+Relu (5.06 vs 11.54 ms), at FP32's wall (4.88)",
    ("2.15", "addn_relugrad"): "1.9x faster than TF's BF16 AddN+ReluGrad (3.84 vs 7.39 ms), 1.9x FP32's",
    ("2.15", "bn_grad"): "1.5x faster than oneDNN's BF16 FusedBatchNormGradV3 (9.63 vs 14.53 ms), 2.5x FP32's",
    ("2.15", "relu_bn_grad"): "1.8x faster than TF's BF16 ReluGrad+FusedBatchNormGradV3 (12.02 vs 21.61 ms)",
}
#: N*H*W from which the plain batch-norm gradient rule fires (measured to pay from [16, 8, 8, C])
MIN_BN_ROWS = 1024

_LOW_OK = (registry.DT_FLOAT, registry.DT_BFLOAT16)


def _bf16_run_problem(ctx, what):
    """The reason no match of a BF16-only rule (one whose build starts with
    :func:`_require_bf16_cpu`) can fuse in this run whatever the anchor
    (``format_mode=NC1HWC0``, or no BF16 precision plan), or None."""
    from .builtin import _precision_plan

    fmt = ctx.option("format_mode", "origin") if ctx is not None else "origin"
    if str(fmt).upper() == "NC1HWC0":
        return f"{what}: not with format_mode=NC1HWC0 (GE's 5HD emulation works on the plain GE op set)"
    plan = _precision_plan(ctx)
    if not (plan is not None and plan.lowers_matrix_ops and plan.low == registry.DT_BFLOAT16):
        return f"{what}: measured to pay in BF16 only (precision mode {plan.mode if plan is not None else 'none'})"
    return None


def bf16_policy(what):
    """:attr:`~.core.FusionRule.policy` of a rule whose build calls
    :func:`_require_bf16_cpu` before anything else that could emit: its
    ctx-wide checks, asked once per run instead of per anchor."""
    def policy(ctx, graph):
        return _bf16_run_problem(ctx, what)
    policy.__qualname__ = f"bf16_policy({what!r})"
    return policy


def _require_bf16_cpu(b, node, what):
    """CPU, a BF16 precision plan, the op in float32 or bfloat16: returns its T."""
    dev = b.device_type()
    b.require(dev == "CPU", f"{what}: the kernels are CPU kernels (device {dev})")
    problem = _bf16_run_problem(b.ctx, what)
    b.require(problem is None, problem)
    dt = node.attr["T"].type if "T" in node.attr else None
    b.require(dt in _LOW_OK, f"{what}: {node.op} in {registry.dtype_name(dt) if dt else '?'}; "
                             "the kernels take float32 (painted BF16 later) or bfloat16")
    return dt


def _known(d):
    return d is not None and d >= 0


def _join_shapes_ok(shapes):
    """The shapes AddRelu takes where TF's AddV2 could broadcast: equal fully known shapes, or
    (Keras ``fit`` / TF2 function graphs, batch ``None``) one rank with every dim but the
    leading one known and equal and the leading dims unknown on at least one side (or equal).
    At run time those can differ only in the leading dim, and AddV2 then broadcasts only where
    one of them is 1: the kernel does that broadcast itself (any other mismatch: InvalidArgument,
    as AddV2's), so the op equals AddV2 -> Relu on every input the graph's shapes allow."""
    s0, s1 = shapes
    if s0 is None or s1 is None or len(s0) != len(s1) or not s0:
        return False
    if not all(_known(x) and x == y for x, y in zip(s0[1:], s1[1:])):
        return False
    return (not _known(s0[0])) or (not _known(s1[0])) or s0[0] == s1[0]


def _build_add_relu(m, b):
    add = b.node("add")
    dt = _require_bf16_cpu(b, add, "AddRelu")
    a, bb = m.tensors["a"], m.tensors["b"]
    shapes = [b.shape(a), b.shape(bb)]
    b.require(_join_shapes_ok(shapes),
              f"AddV2 inputs of shapes {shapes}: needs one rank and equal known dims but the leading "
              "one (no broadcasting)")
    b.emit("AddRelu", b.anchor.name, [a, bb], {"T": ("type", dt)})


def _build_join_grad_sum(m, b):
    """Reshape(Sum(g, BroadcastGradientArgs(Shape(x0), Shape(x1))[i]), Shape(xi)): TF's gradient
    of one input of ``AddV2(x0, x1)`` where the shapes are not static (it omits the Sum when
    they are).  With x0 and x1 as AddRelu takes them (:func:`_join_shapes_ok`) the Sum reduces
    nothing at run time unless a leading dim of 1 was broadcast: ``JoinGradSum`` forwards g then
    (no copy) and sums the leading dim in FP32 otherwise.  It is gray, so it follows g into BF16
    where TF's Sum (black on TF 2.15) made an FP32 island: a Cast in, FP32 Sum/Reshape, the
    batch-norm gradient after it in FP32, a Cast out."""
    sm = b.node("sum")
    dt = _require_bf16_cpu(b, sm, "JoinGradSum")
    src, port, ctrl = parse_tensor(m.tensors["axes"])
    bga = b.graph.nodes.get(src)
    b.require(bga is not None and not ctrl and bga.op == "BroadcastGradientArgs" and port in (0, 1),
              "the Sum's axes are not an output of BroadcastGradientArgs (not an add's gradient)")
    shape_refs = b.graph.data_inputs(bga)[:2]
    b.require(len(shape_refs) == 2 and parse_tensor(m.tensors["shape"])[:2] == parse_tensor(shape_refs[port])[:2],
              "the Reshape's shape is not the BroadcastGradientArgs input of the same side")
    xs = []
    for ref in shape_refs:
        shp_node = b.graph.nodes.get(parse_tensor(ref)[0])
        b.require(shp_node is not None and shp_node.op == "Shape", "a BroadcastGradientArgs input is not a Shape")
        xs.append(b.graph.data_inputs(shp_node)[0])
    shapes = [b.shape(x) for x in xs]
    b.require(_join_shapes_ok(shapes),
              f"add inputs of shapes {shapes}: needs one rank and equal known dims but the leading one")
    tshape = b.anchor.attr["Tshape"].type if "Tshape" in b.anchor.attr else registry.DT_INT32
    b.emit("JoinGradSum", b.anchor.name, [m.tensors["g"], m.tensors["shape"]],
           {"T": ("type", dt), "Tshape": ("type", tshape)})


def _addn2(node, graph):
    return node.attr["N"].i == 2 if "N" in node.attr else False


def _build_addn_relu_grad(m, b):
    addn = b.node("addn")
    dt = _require_bf16_cpu(b, addn, "AddNReluGrad")
    b.require(b.anchor.attr["T"].type == dt, "AddN and ReluGrad dtypes differ")
    b.emit("AddNReluGrad", b.anchor.name, [m.tensors["a"], m.tensors["b"], m.tensors["f"]], {"T": ("type", dt)})


def _bn_grad_predicate(node, graph):
    if node.op != "FusedBatchNormGradV3" or len(node.input) < 5:
        return False
    a = node.attr
    fmt = a["data_format"].s.decode() if "data_format" in a else "NHWC"
    training = a["is_training"].b if "is_training" in a else True
    return fmt == "NHWC" and training


def _bn_grad_common(b):
    node = b.anchor
    dt = _require_bf16_cpu(b, node, "BatchNormGradNHWC")
    b.require(node.attr["U"].type == registry.DT_FLOAT, "batch-norm statistics (U) are not float")
    for port in (3, 4):
        b.require(not b.graph.consumers(node.name, port, control=False),
                  f"output {port} of '{node.name}' is read (BatchNormGradNHWC has dx, dscale, doffset only)")
    data = b.graph.data_inputs(node)
    shp = b.shape(data[1])
    b.require(shp is not None and len(shp) == 4 and shp[3] is not None and shp[3] > 0,
              f"x of shape {shp}: needs rank 4 with C known")
    eps = float(node.attr["epsilon"].f) if "epsilon" in node.attr else 1e-4
    return dt, data, shp, eps


def _OUTS(name):
    """dx, dscale, doffset: the anchor's outputs 0-2 on the same ports."""
    return {p: tensor_name(name, p) for p in range(3)}


def _relu_grad_of(b, ref):
    """The ReluGrad producing ``ref`` (output 0) when the batch-norm gradient is its only
    reader, else None."""
    src, port, ctrl = parse_tensor(ref)
    rg = b.graph.nodes.get(src)
    if rg is None or ctrl or port != 0 or rg.op != "ReluGrad":
        return None
    if [c for c, _ in b.graph.consumers(rg.name)] != [b.anchor.name]:
        return None
    return rg


def _build_relu_bn_grad(m, b):
    node = b.anchor
    dt, data, shp, eps = _bn_grad_common(b)
    rg = _relu_grad_of(b, data[0])
    b.require(rg is not None, "input 0 is not a ReluGrad read only by this batch-norm gradient")
    b.require(rg.attr["T"].type == dt, "ReluGrad and batch-norm gradient dtypes differ")
    b.absorb([rg.name])
    g, f = b.graph.data_inputs(rg)[:2]
    b.emit("BatchNormGradNHWC", node.name, [g, data[1], data[2], data[3], data[4], f],
           {"T": ("type", dt), "epsilon": eps, "num_relu": 1})
    return _OUTS(node.name)


def _build_bn_grad(m, b):
    node = b.anchor
    dt, data, shp, eps = _bn_grad_common(b)
    rows = int(np.prod(shp[:3])) if all(d is not None and d > 0 for d in shp[:3]) else None
    b.require(rows is None or rows >= MIN_BN_ROWS,
              f"N*H*W = {rows}: measured to pay from {MIN_BN_ROWS} rows")
    b.emit("BatchNormGradNHWC", node.name, list(data[:5]),
           {"T": ("type", dt), "epsilon": eps, "num_relu": 0})
    return _OUTS(node.name)


def register(reg):
    """Called from ``builtin.register`` with its registering function."""
    reg("bf16_add_relu", Pat("Relu", inputs=[Pat(("AddV2", "Add"), name="add",
                                                 inputs=[Pat.any("a"), Pat.any("b")])]),
        _build_add_relu, follows_precision=True, reads=1, policy=bf16_policy("AddRelu"),
        reason="BF16 residual join relu(a + b) as one vectorised pass (TF's BF16 AddV2 and Relu convert "
               "element by element): measured 1.7x faster, bit-equal")
    reg("bf16_join_grad_sum", Pat("Reshape", inputs=[Pat("Sum", name="sum", inputs=[Pat.any("g"), Pat.any("axes")]),
                                                 Pat.any("shape")]),
        _build_join_grad_sum, follows_precision=True, reads=4, policy=bf16_policy("JoinGradSum"),
        reason="gradient of a batch-None residual join's input: TF's Sum over BroadcastGradientArgs (empty at "
               "run time) and Reshape as a gray pass-through (no FP32 island around a black Sum)")
    reg("bf16_addn_relu_grad", Pat("ReluGrad", inputs=[Pat("AddN", name="addn", predicate=_addn2,
                                                           inputs=[Pat.any("a"), Pat.any("b")]),
                                                       Pat.any("f")]),
        _build_addn_relu_grad, follows_precision=True, reads=1, policy=bf16_policy("AddNReluGrad"),
        reason="BF16 backward residual join ReluGrad(AddN(a, b)) as one vectorised pass: measured 2.4x "
               "faster, bit-equal")
    reg("bf16_relu_bn_grad", Pat("FusedBatchNormGradV3", predicate=_bn_grad_predicate),
        _build_relu_bn_grad, follows_precision=True, reads=1, policy=bf16_policy("BatchNormGradNHWC"),
        reason="BF16 ReluGrad + training batch-norm gradient (NHWC) as one two-pass kernel: measured 1.8x "
               "faster than TF's BF16 pair")
    reg("bf16_bn_grad", Pat("FusedBatchNormGradV3", predicate=_bn_grad_predicate),
        _build_bn_grad, follows_precision=True, reads=0, policy=bf16_policy("BatchNormGradNHWC"),
        reason="BF16 training batch-norm gradient (NHWC) as a vectorised two-pass kernel: measured 1.5x "
               "faster than oneDNN's BF16 FusedBatchNormGradV3")


__all__ = ["register", "MEASURED", "MIN_BN_ROWS", "bf16_policy"]
