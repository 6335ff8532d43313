"""FLOPs of matrix/conv ops and activation bytes, from static shapes.

Shapes come from the graph's shared table (:mod:`graph_passes.shapes`):
``_output_shapes`` when a node carries them, otherwise grappler's C++ shape
inference, run once, lazily, and decoded only for the nodes looked up
(dtypes never change shapes).
Unknown dimensions (``-1``, usually the batch) count as 1, so shares are
exact for a fixed batch and the same for every batch size.
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
    ins = [shapes.get(i) for i in node.input if not i.startswith("^")]

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
    """Bytes of every float activation (outputs of compute nodes, not of
    constants, variables or feeds), over ``names`` (default: every node).
    ``per_node`` (a dict) receives each node's share, so a later figure can be
    updated for the few nodes that changed instead of rescanning the graph."""
    total = 0
    nodes = graph.nodes
    for name in (nodes if names is None else names):
        node = nodes.get(name)
        if node is None or node.op in _PARAM_OPS:
            continue
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
