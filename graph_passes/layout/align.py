"""Alignment analysis: which tensors and ops have channel dims that are not
multiples of C0, or matrix dims that are not multiples of 16, what they pad
to, and how much cube compute the padding wastes.

Used by the layout pass (``padding_waste_flops`` in the report) and by the
public ``npu_amp_tf.check_align``.  Shapes come from ``_output_shapes`` or TF
shape inference; FLOPs count multiply-adds as 2.
"""
from __future__ import annotations

from .. import registry
from .. import shapes as _shapes
from ..graph import Graph, parse_tensor
from . import formats

CONV_OPS = ("Conv2D", "_FusedConv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter")
DEPTHWISE_OPS = ("DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
                 "DepthwiseConv2dNativeBackpropFilter")
MATMUL_OPS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "_FusedMatMul")


def _known(shape, rank=None):
    return shape is not None and (rank is None or len(shape) == rank) and all(
        d is not None and d >= 0 for d in shape)


def tensor_item(shape, dtype, name=None) -> dict:
    """Alignment of one tensor.  4-D: an NHWC activation (channel = last dim);
    1-D: a channel vector; 2-D and more: the last two dims are matrix dims."""
    shape = [int(d) if d is not None else -1 for d in shape]
    dt = formats._dtype_name(dtype)
    c0 = formats.c0_for(dt)
    item = {"name": name, "dtype": dt, "shape": shape}
    if len(shape) == 4:
        c = shape[3]
        item.update(kind="activation", format="NC1HWC0", align=c0,
                    padded_shape=formats.nc1hwc0_shape(shape, "NHWC", dt))
        real, padded = c, formats.pad_to(c, c0) if c > 0 else c
        item["unaligned_dims"] = {"C": c} if c > 0 and c % c0 else {}
    elif len(shape) == 1:
        c = shape[0]
        real, padded = c, formats.pad_to(c, c0) if c > 0 else c
        item.update(kind="channel_vector", align=c0, padded_shape=[padded])
        item["unaligned_dims"] = {"C": c} if c > 0 and c % c0 else {}
    elif len(shape) >= 2:
        m, n = shape[-2:]
        pm = formats.pad_to(m, formats.MATRIX_ALIGN) if m > 0 else m
        pn = formats.pad_to(n, formats.MATRIX_ALIGN) if n > 0 else n
        item.update(kind="matrix", align=formats.MATRIX_ALIGN, padded_shape=shape[:-2] + [pm, pn])
        item["unaligned_dims"] = {k: v for k, v in (("rows", m), ("cols", n))
                                  if v > 0 and v % formats.MATRIX_ALIGN}
        real, padded = max(m, 0) * max(n, 0), max(pm, 0) * max(pn, 0)
    else:
        item.update(kind="scalar", align=1, padded_shape=[], unaligned_dims={})
        real = padded = 1
    item["aligned"] = not item["unaligned_dims"]
    item["waste_share"] = round(1.0 - real / padded, 6) if padded and padded > 0 else 0.0
    return item


def _dt(graph, ref):
    dt = graph.tensor_dtype(ref)
    return registry.dtype_name(registry.base_dtype(dt)) if dt is not None else "float32"


def op_item(graph: Graph, node, shapes) -> dict | None:
    """Cube compute of one conv/matmul op and the share lost to padding."""
    def shape(ref):
        return _shapes.tensor_shape(shapes, ref)

    data = [i for i in node.input[:] if not i.startswith("^")]
    out = (shapes.get(node.name) or [None])[0]
    op = node.op
    if op in CONV_OPS + DEPTHWISE_OPS:
        if "data_format" in node.attr and node.attr["data_format"].s not in (b"NHWC", b""):
            return None
        if op.endswith("BackpropInput"):
            filt, dy, x = shape(data[1]), shape(data[2]), out
        elif op.endswith("BackpropFilter"):
            x, dy, filt = shape(data[0]), shape(data[2]), out
        else:
            x, filt, dy = shape(data[0]), shape(data[1]), out
        if not (_known(x, 4) and _known(filt, 4) and _known(dy, 4)):
            return None
        dt = _dt(graph, data[0] if not op.endswith("BackpropInput") else data[2])
        if not formats.has_c0(dt):
            return None
        c0 = formats.c0_for(dt)
        n, ho, wo = dy[0], dy[1], dy[2]
        kh, kw, ci, co = filt
        if op in DEPTHWISE_OPS:
            co_total = ci * co
            flops = 2 * n * ho * wo * kh * kw * co_total
            ci_p = formats.pad_to(ci, c0)
            padded = 2 * n * ho * wo * kh * kw * ci_p * co
            dims = {"C": ci}
            unaligned = {"C": ci} if ci % c0 else {}
            padded_filter = None
        else:
            flops = 2 * n * ho * wo * kh * kw * ci * co
            ci_p, co_p = formats.pad_to(ci, c0), formats.pad_to(co, formats.N0)
            padded = 2 * n * ho * wo * kh * kw * ci_p * co_p
            dims = {"Cin": ci, "Cout": co}
            unaligned = {k: v for k, v, a in (("Cin", ci, c0), ("Cout", co, formats.N0)) if v % a}
            padded_filter = formats.fractal_z_shape(filt, dt)
        item = {"name": node.name, "op": op, "kind": "conv", "dtype": dt, "dims": dims,
                "unaligned_dims": unaligned, "shape": list(x),
                "padded_shape": formats.nc1hwc0_shape(x, "NHWC", dt),
                "filter_shape": list(filt), "padded_filter_shape": padded_filter}
    elif op in MATMUL_OPS:
        a, b = shape(data[0]), shape(data[1])
        if not (_known(a) and _known(b)) or len(a) < 2 or len(b) < 2:
            return None
        ta = node.attr["transpose_a"].b if "transpose_a" in node.attr else (
            node.attr["adj_x"].b if "adj_x" in node.attr else False)
        tb = node.attr["transpose_b"].b if "transpose_b" in node.attr else (
            node.attr["adj_y"].b if "adj_y" in node.attr else False)
        m, k = (a[-1], a[-2]) if ta else (a[-2], a[-1])
        n = b[-2] if tb else b[-1]
        batch = 1
        if out is not None and _known(out) and len(out) > 2:
            for d in out[:-2]:
                batch *= d
        al = formats.MATRIX_ALIGN
        flops = 2 * batch * m * k * n
        padded = 2 * batch * formats.pad_to(m, al) * formats.pad_to(k, al) * formats.pad_to(n, al)
        dt = _dt(graph, data[0])
        unaligned = {key: v for key, v in (("M", m), ("K", k), ("N", n)) if v % al}
        item = {"name": node.name, "op": op, "kind": "matmul", "dtype": dt,
                "dims": {"M": m, "K": k, "N": n}, "unaligned_dims": unaligned,
                "shape": [m, k, n], "padded_shape": [formats.pad_to(v, al) for v in (m, k, n)]}
    else:
        return None
    item["flops"] = int(flops)
    item["padded_flops"] = int(padded)
    item["waste_flops"] = int(padded - flops)
    item["waste_share"] = round((padded - flops) / padded, 6) if padded else 0.0
    item["aligned"] = not item["unaligned_dims"]
    return item


def analyze_graph(graph: Graph, shapes=None) -> dict:
    """Every conv/matmul op whose channel or matrix dims are unaligned, with
    totals over the whole graph (aligned ops count in ``total_flops``)."""
    if shapes is None:
        shapes = _shapes.graph_shapes(graph)
    items, total, total_padded = [], 0, 0
    for name in graph.topo_order():
        node = graph.nodes[name]
        if node.op not in CONV_OPS + DEPTHWISE_OPS + MATMUL_OPS:
            continue
        it = op_item(graph, node, shapes)
        if it is None:
            continue
        total += it["flops"]
        total_padded += it["padded_flops"]
        if not it["aligned"]:
            items.append(it)
    waste = total_padded - total
    return {"kind": "graph", "items": items, "total_flops": int(total),
            "total_padded_flops": int(total_padded), "total_padding_waste_flops": int(waste),
            "waste_share": round(waste / total_padded, 6) if total_padded else 0.0}
