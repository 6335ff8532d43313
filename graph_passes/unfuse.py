"""``unfuse``: split grappler's ``_FusedConv2D`` / ``_FusedMatMul`` back into
their parts, so their compute can run in low precision.

Why: a hand-written ``ConfigProto`` entry leaves grappler's remapper on, and
the remapper runs *before* custom optimizers.  By the time the pipeline sees
the graph, ``Conv2D+BiasAdd+Relu`` may be one ``_FusedConv2D`` node, which has
no FP16 CPU kernel, so the precision pass would have to keep it FP32.  This
pass runs first and restores the plain ops.

Preconditions
    Any graph.  Only fused nodes whose *low-precision* dtype
    (``options.low_dtype``) has no kernel on the node's device type are split,
    and only when the precision mode lowers matrix ops (asked of the
    precision planner: not ``must_keep_origin_dtype`` / ``force_fp32`` /
    ``allow_fp32_to_fp16``, which keeps ops with an FP32 kernel FP32).  A fused node that already
    has a low-precision kernel there (for example bfloat16 on CPU, or the GPU)
    is left for the precision pass to convert as it is.
Postconditions
    Each split node is replaced by a chain whose *last* node keeps the fused
    node's name (so consumers, fetches and control edges stay valid) and its
    output dtype.  The new inner nodes are named ``<fused>/Unfused/<Op>``.
    Nodes with ``fused_ops`` this pass does not know (``GeluExact``,
    ``_FusedHardSwish``, host args...) are left alone with a recorded reason.
    Running the pass twice changes nothing the second time.

Sketch::

    before                                   after
    x   w   b                                x   w
     \\  |  /                                  \\ /
    _FusedConv2D  name=c                     c/Unfused/Conv2D   b
    fused_ops=[BiasAdd, Relu]                       \\          /
        |                                    c/Unfused/BiasAdd
                                                     |
                                             Relu  name=c
                                                     |

``_FusedMatMul`` splits into ``MatMul`` (+ ``BiasAdd``) (+ activation);
``fused_ops=[FusedBatchNorm, ...]`` splits into ``Conv2D`` +
``FusedBatchNormV3(is_training=False)`` (+ activation); ``Add``/``AddV2``
after the bias becomes ``AddV2`` with the extra argument.
"""
from __future__ import annotations

from tensorflow.core.framework import attr_value_pb2, types_pb2

from . import registry
from .precision.planner import plan_for
from .manager import Pass, register_pass

FUSED_OPS = ("_FusedConv2D", "_FusedMatMul")

#: fused activation name -> (op type, extra attrs taken from the fused node)
ACTIVATIONS = {
    "Relu": ("Relu", ()),
    "Relu6": ("Relu6", ()),
    "Elu": ("Elu", ()),
    "LeakyRelu": ("LeakyRelu", (("leakyrelu_alpha", "alpha"),)),
    "Tanh": ("Tanh", ()),
    "Sigmoid": ("Sigmoid", ()),
}

#: (op, device type, dtype) whose kernel TF registers but which fails at run
#: time; these are split as if no kernel existed.  One line per entry, with why.
BROKEN_KERNELS = registry.BROKEN_KERNELS  # kept here for callers of the old name


def _type_attr(dt):
    return attr_value_pb2.AttrValue(type=dt)


def _plan(fused_ops):
    """fused_ops -> (head, add, activation) or a reason string when unknown."""
    ops = list(fused_ops)
    if not ops:
        return "empty fused_ops"
    head = ops.pop(0)
    if head not in ("BiasAdd", "FusedBatchNorm"):
        return f"fused_ops {list(fused_ops)} not supported"
    add = False
    if ops and ops[0] in ("Add", "AddV2"):
        if head != "BiasAdd":
            return f"fused_ops {list(fused_ops)} not supported"
        add = True
        ops.pop(0)
    act = None
    if ops:
        act = ops.pop(0)
        if act not in ACTIVATIONS:
            return f"fused activation '{act}' has no plain TF op"
    if ops:
        return f"fused_ops {list(fused_ops)} not supported"
    return head, add, act


@register_pass("unfuse")
class Unfuse(Pass):
    tracks_edits = True  # creates and removes nodes only
    """Split ``_FusedConv2D``/``_FusedMatMul`` that would block low precision."""

    def run(self, graph, ctx):
        plan = plan_for(ctx)
        if not plan.lowers_matrix_ops:
            return {"unfused": 0, "skipped": f"precision_mode={plan.mode} keeps matrix ops FP32"}
        low = plan.low
        default_dev = ctx.default_device_type()
        black = plan.lists["black"]
        unfused = kept = 0
        # the fused nodes in graph order, from the op index (not a walk of every node)
        for name in graph.nodes_of_type(FUSED_OPS):
            node = graph.nodes.get(name)
            if node is None or node.op not in FUSED_OPS:
                continue
            dev_type = registry.device_type_of(node, default_dev)
            broken = BROKEN_KERNELS.get((node.op, dev_type, low))
            parts = [s.decode() for s in node.attr["fused_ops"].list.s[:]]
            broken = broken or registry.fused_ops_broken(node.op, dev_type, low, parts)
            listed = [p for p in parts if ACTIVATIONS.get(p, (p,))[0] in black]
            if listed:  # a black-listed activation must not ride along in low precision
                broken = f"fused {listed} black-listed: split so it stays FP32"
            if not broken and registry.has_kernel(node.op, dev_type, {"T": low}):
                ctx.report.decide(name, unfuse="kept",
                                  unfuse_reason=f"{node.op} has a {registry.dtype_name(low)} kernel on {dev_type}")
                kept += 1
                continue
            plan = _plan(parts)
            host_args = node.attr["num_host_args"].i if "num_host_args" in node.attr else 0
            if isinstance(plan, str) or host_args:
                reason = plan if isinstance(plan, str) else "host args are not supported"
                ctx.report.decide(name, unfuse="kept", unfuse_reason=reason)
                ctx.warn(f"{node.op} left fused ({reason}); it stays in its original dtype", node=name)
                kept += 1
                continue
            self._split(graph, node, plan)
            ctx.report.decide(name, unfuse="split",
                              unfuse_reason=broken or f"{node.op} has no {registry.dtype_name(low)} kernel on {dev_type}")
            unfused += 1
        if unfused:
            graph.reindex()
        return {"unfused": unfused, "kept_fused": kept}

    # ------------------------------------------------------------------
    def _split(self, graph, node, plan):
        head, add, act = plan
        name, dev = node.name, node.device
        T = node.attr["T"].type
        data = [i for i in node.input[:] if not i.startswith("^")]
        ctrl = [i for i in node.input[:] if i.startswith("^")]
        x, w, args = data[0], data[1], data[2:]
        base = f"{name}/Unfused"
        a = node.attr

        if node.op == "_FusedConv2D":
            attrs = {"T": _type_attr(T)}
            for k in ("strides", "padding", "explicit_paddings", "data_format", "dilations",
                      "use_cudnn_on_gpu"):
                if k in a:
                    attrs[k] = a[k]
            core = graph.new_node("Conv2D", f"{base}/Conv2D", [x, w, *ctrl], attrs, device=dev)
            data_format = a["data_format"] if "data_format" in a else attr_value_pb2.AttrValue(s=b"NHWC")
        else:
            attrs = {"T": _type_attr(T), "transpose_a": a["transpose_a"], "transpose_b": a["transpose_b"]}
            core = graph.new_node("MatMul", f"{base}/MatMul", [x, w, *ctrl], attrs, device=dev)
            data_format = attr_value_pb2.AttrValue(s=b"NHWC")

        steps = []  # (op, inputs-after-prev, attrs)
        if head == "BiasAdd":
            steps.append(("BiasAdd", [args[0]], {"T": _type_attr(T), "data_format": data_format}))
            if add:
                steps.append(("AddV2", [args[1]], {"T": _type_attr(T)}))
        else:  # FusedBatchNorm: args = scale, offset, mean, variance
            steps.append(("FusedBatchNormV3", list(args[:4]), {
                "T": _type_attr(T), "U": _type_attr(types_pb2.DT_FLOAT),
                "epsilon": a["epsilon"], "data_format": data_format,
                "is_training": attr_value_pb2.AttrValue(b=False)}))
        if act is not None:
            op, extra = ACTIVATIONS[act]
            attrs = {"T": _type_attr(T)}
            for src, dst in extra:
                attrs[dst] = a[src]
            steps.append((op, [], attrs))

        # detach the fused node: its name goes to the last step
        graph.remove_node(name, force=True)
        prev = core.name
        for i, (op, extra_in, attrs) in enumerate(steps):
            last = i == len(steps) - 1
            nm = name if last else f"{base}/{op}"
            graph.new_node(op, nm, [prev, *extra_in], attrs, device=dev)
            prev = nm


__all__ = ["Unfuse", "FUSED_OPS", "ACTIVATIONS"]
