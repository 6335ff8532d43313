"""FLOPs of matrix/conv ops and activation bytes, from static shapes.

Shapes come from the graph's shared table (:mod:`graph_passes.shapes`):
``_output_shapes`` when a node carries them, otherwise grappler's C++ shape
inference, run once, lazily, and decoded only for the nodes looked up
(dtypes never change shapes).
Unknown dimensions (``-1``, usually the batch) count as 1, so shares are
exact for a fixed batch and the same for every batch size.

Activation bytes count the tensors a *step* computes from its data: outputs
that depend, through data edges, on a graph input (a feed, an input
pipeline, a function argument).  Variable initializers, weight reads and
their casts, learning-rate schedules are not activations (an initializer
subgraph alone is ~4x the parameter bytes of a TF1 training graph).  A
graph with no input op at all (synthetic data) counts every computed tensor.
Ops whose output aliases their input (Identity, Reshape, ...) add nothing.
The figure is the *sum* of those tensors over the step, an upper bound of
the peak TF's allocator measures (``npu-amp profile``): TF frees a tensor
after its last use.
"""
from __future__ import annotations

import math

from .. import registry
from .. import shapes as _shapes
from ..graph import parse_tensor

MATRIX_OPS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "_FusedMatMul",
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "_FusedConv2D",
    "Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2",
    "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
    "DepthwiseConv2dNativeBackpropFilter",
})

_BYTES = {registry.DT_FLOAT: 4, registry.DT_HALF: 2, registry.DT_BFLOAT16: 2, registry.DT_DOUBLE: 8}
# sources whose outputs are parameters, not activations
_PARAM_OPS = frozenset({"Const", "VariableV2", "Variable", "VarHandleOp", "ReadVariableOp",
                        "_Arg", "Placeholder", "PlaceholderWithDefault"})


#: ops whose output shares its input's buffer: no bytes of their own
_ALIAS_OPS = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "PreventGradient",
    "Enter", "Exit", "Switch", "Merge", "NextIteration", "RefIdentity", "EnsureShape", "CheckNumerics",
})

#: ops whose outputs are the step's data
_INPUT_OPS = frozenset({
    "Placeholder", "PlaceholderWithDefault", "_Arg", "IteratorGetNext", "IteratorGetNextSync",
    "IteratorGetNextAsOptional", "OptionalGetValue", "QueueDequeueV2", "QueueDequeueManyV2",
    "QueueDequeueUpToV2", "MultiDeviceIteratorGetNextFromShard",
})


def input_dependent(graph):
    """Names of the nodes whose value depends on a graph input through data
    edges (inputs included), or None when the graph has no input op."""
    seeds = [name for name, node in graph.nodes.items() if node.op in _INPUT_OPS]
    if not seeds:
        return None
    seen = set(seeds)
    stack = list(seeds)
    while stack:
        for consumer, _ in graph.consumers(stack.pop(), control=False):
            if consumer not in seen:
                seen.add(consumer)
                stack.append(consumer)
    return seen


def ShapeTable(graph):  # noqa: N802 - kept under its old name for callers
    """The shape table every pass shares for ``graph``
    (:func:`graph_passes.shapes.table`): ``_output_shapes``, then the shape
    source handed over with the graph, else grappler's inference once, lazily."""
    return _shapes.table(graph)


def _prod(dims):
    return math.prod(max(d, 1) for d in dims)


def _dim(d):
    return max(d, 1)


def matmul_flops(node, shapes: ShapeTable):
    """2*M*N*K style FLOPs of one matrix/conv node, or None when shapes are unknown."""
    op = node.op
    out = shapes.get(node.name)
    ins = [shapes.get(i) for i in node.input[:] if not i.startswith("^")]

    def inp(k):
        return ins[k] if k < len(ins) else None

    try:
        if op in ("MatMul", "_FusedMatMul"):
            a = inp(0)
            if out is None or a is None or len(a) != 2:
                return None
            k = a[0] if node.attr["transpose_a"].b else a[1]
            return 2 * _prod(out) * _dim(k)
        if op.startswith("BatchMatMul"):
            a = inp(0)
            if out is None or a is None or len(a) < 2:
                return None
            adj = node.attr["adj_x"].b if "adj_x" in node.attr else False
            k = a[-2] if adj else a[-1]
            return 2 * _prod(out) * _dim(k)
        if op == "Einsum":
            return _einsum_flops(node, ins, out)
        if op in ("Conv2D", "_FusedConv2D", "Conv3D", "DepthwiseConv2dNative"):
            f = inp(1)
            if out is None or f is None:
                return None
            window = f[:-1] if op != "DepthwiseConv2dNative" else f[:-2]
            return 2 * _prod(out) * _prod(window)
        if op in ("Conv2DBackpropInput", "Conv3DBackpropInputV2", "DepthwiseConv2dNativeBackpropInput"):
            f, g = inp(1), inp(2)
            if f is None or g is None:
                return None
            window = f[:-1] if not op.startswith("Depthwise") else f[:-2]
            return 2 * _prod(g) * _prod(window)
        if op in ("Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropFilter"):
            g = inp(2)
            if out is None or g is None:
                return None
            window = out[:-1] if not op.startswith("Depthwise") else out[:-2]
            return 2 * _prod(g) * _prod(window)
    except (IndexError, TypeError):
        return None
    return None


def _einsum_flops(node, ins, out):
    eq = node.attr["equation"].s.decode()
    if "->" not in eq or "." in eq or out is None:
        return None
    lhs, rhs = eq.split("->")
    sizes = {}
    for term, shape in zip(lhs.split(","), ins):
        if shape is None or len(term) != len(shape):
            return None
        for c, d in zip(term, shape):
            sizes[c] = max(sizes.get(c, 1), _dim(d))
    contracted = [sizes[c] for c in sizes if c not in rhs]
    return 2 * _prod(out) * math.prod(contracted)


def activation_bytes(graph, shapes: ShapeTable, names=None, per_node=None):
    """Bytes of every float activation (outputs of compute nodes that depend
    on a graph input, see the module doc), over ``names`` (default: every
    node).  ``per_node`` (a dict) receives each node's share, so a later
    figure can be updated for the few nodes that changed instead of rescanning
    the graph.  The input dependence is taken once per ``shapes`` (on the
    graph before a rewrite); a node added since (an inserted Cast) depends on
    an input when one of its data inputs does."""
    total = 0
    nodes = graph.nodes
    if shapes._dependent is False:
        shapes._dependent = input_dependent(graph)
    dependent = shapes._dependent
    for name in (nodes if names is None else names):
        node = nodes.get(name)
        if node is None or node.op in _PARAM_OPS or node.op in _ALIAS_OPS:
            continue
        if dependent is not None and name not in dependent:
            if not any(parse_tensor(i)[0] in dependent for i in node.input[:] if not i.startswith("^")):
                continue
            dependent.add(name)
        dts = graph.output_dtypes(node)
        if not dts:
            continue
        outs = None
        mine = 0
        for port, dt in enumerate(dts):
            b = _BYTES.get(registry.base_dtype(dt))
            if b is None or b == 8:
                continue
            if outs is None:
                outs = shapes.node_shapes(name)
            shape = outs[port] if outs is not None and port < len(outs) else None
            if shape is None:
                continue
            mine += b * _prod(shape)
        total += mine
        if per_node is not None and mine:
            per_node[name] = mine
    return total


def _port_bytes(graph, shapes: ShapeTable, name, node) -> list:
    """Bytes of each float output of ``node`` (0 where not float / unknown)."""
    dts = graph.output_dtypes(node) or []
    outs = None
    res = []
    for port, dt in enumerate(dts):
        b = _BYTES.get(registry.base_dtype(dt))
        if b is None or b == 8:
            res.append(0)
            continue
        if outs is None:
            outs = shapes.node_shapes(name)
        shape = outs[port] if outs is not None and port < len(outs) else None
        res.append(b * _prod(shape) if shape is not None else 0)
    return res


#: element-wise ops whose kernels write into an input buffer TF can hand over
#: (``forward_input_or_allocate_output``): same bytes, input not used later
_FORWARDING_OPS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Softplus", "Neg", "Square", "Sqrt", "Rsqrt",
    "Exp", "Log", "Add", "AddV2", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "BiasAdd",
    "ReluGrad", "Relu6GradGrad", "EluGrad", "TanhGrad", "SigmoidGrad", "AddN", "Gelu",
})


def peak_step_bytes(graph, shapes: ShapeTable, dependent=False) -> int:
    """Estimated peak bytes of the tensors one step allocates: what
    ``npu-amp profile`` measures from TF's allocation records.

    The step's float tensors (those depending on a graph input, plus the
    inputs' one-hop producers: a weight's Cast to FP16 is step memory, its
    initializer is not) are allocated in Kahn topological order (the order
    TF's executor roughly follows: ready ops first-in first-out) and freed
    after their last data consumer; an aliasing op (Identity, Reshape, ...)
    extends its source's lifetime and allocates nothing, and so does an
    element-wise op that TF lets write into an input buffer of the same size
    whose last use it is (Relu after a BatchNorm, a gradient AddN).  Returns
    the peak of the running total.  Workspace memory inside kernels is not counted.
    Measured against TF 2.15 on ResNet-50 and a BERT-like encoder
    (benchmarks/memory.py)."""
    if dependent is False:
        dependent = input_dependent(graph)
    nodes = graph.nodes
    order = graph.topo_order()
    pos = {n: i for i, n in enumerate(order)}
    owner = {}  # tensor -> the tensor whose buffer it shares (aliases, forwarded buffers)

    def root(t):
        while t in owner:
            t = owner[t]
        return t

    # pass 1: aliases and last uses
    last = {}  # buffer-owning tensor -> position of its last data consumer
    inputs = {}
    for name in order:
        node = nodes[name]
        i = pos[name]
        ins = []
        for ref in node.input[:]:
            if not ref.startswith("^"):
                src, port, _ = parse_tensor(ref)
                t = root((src, port))
                ins.append(t)
                last[t] = max(last.get(t, -1), i)
        inputs[name] = ins
        if node.op in _ALIAS_OPS and ins:
            owner[(name, 0)] = ins[0]
    # pass 2: allocations, and element-wise ops taking over a dying input buffer of their size
    size, start = {}, {}
    for name in order:
        node = nodes[name]
        if node.op in _ALIAS_OPS or node.op in _PARAM_OPS:
            continue
        if dependent is not None and name not in dependent:
            if not any(c in dependent for c, _ in graph.consumers(name, control=False)):
                continue
        i = pos[name]
        for port, b in enumerate(_port_bytes(graph, shapes, name, node)):
            if not b:
                continue
            t = (name, port)
            if node.op in _FORWARDING_OPS:
                donor = None
                for s_ in inputs[name]:
                    d = root(s_)
                    if size.get(d) == b and last.get(d) == i:
                        donor = d
                        break
                if donor is not None:
                    owner[t] = donor
                    last[donor] = max(i, last.get(t, i))
                    continue
            size[t] = b
            start[t] = i
    events = [0] * (len(order) + 2)
    for t, b in size.items():
        i = start[t]
        events[i] += b
        events[max(last.get(t, i), i) + 1] -= b
    cur = peak = 0
    for e in events:
        cur += e
        peak = max(peak, cur)
    return peak
