"""``check_align``: which tensors/ops waste Ascend cube compute on padding.

Channel dims of activations are padded to C0 (16 for fp16/fp32/bf16, 32 for
int8) in NC1HWC0; matrix dims of MatMul and conv filters to 16.  For every
unaligned tensor or op ``check_align`` gives the padded shape and the wasted
compute share; for a graph also the total padding waste in FLOPs.

    >>> r = npu_amp_tf.check_align(((1, 56, 56, 17), "float16"))
    >>> r["items"][0]["padded_shape"], r["items"][0]["waste_share"]
    ([1, 2, 56, 56, 16], 0.46875)
    >>> print(r.format_table())

The result is a ``dict`` (JSON-serialisable as is) with ``format_table()``.
"""
from __future__ import annotations

import json

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from graph_passes.graph import Graph
from graph_passes.layout import align, formats

from .errors import NpuAmpError

__all__ = ["check_align", "AlignResult"]

_ACCEPTED = ("a tf.Tensor / tf.Variable / numpy array, a (shape, dtype) pair, a GraphDef, "
             "a tf.Graph or a concrete tf.function")


class AlignResult(dict):
    """``{"kind": "tensor"|"graph", "items": [...], totals...}`` plus :meth:`format_table`."""

    def to_json(self, **kw) -> str:
        return json.dumps(self, **kw)

    def format_table(self) -> str:
        rows = [("name", "op/kind", "dtype", "unaligned", "shape", "padded shape", "waste")]
        for it in self["items"]:
            unal = ",".join(f"{k}={v}" for k, v in it["unaligned_dims"].items()) or "-"
            rows.append((str(it.get("name") or "-"), it.get("op") or it["kind"], it["dtype"], unal,
                         str(it["shape"]), str(it["padded_shape"]), f"{100 * it['waste_share']:.1f}%"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self["kind"] == "graph":
            lines.append("")
            lines.append(f"cube FLOPs {self['total_flops']:,}  padded {self['total_padded_flops']:,}  "
                         f"padding waste {self['total_padding_waste_flops']:,} "
                         f"({100 * self['waste_share']:.1f}%)  unaligned ops {len(self['items'])}")
        elif not self["items"]:
            lines.append("(aligned)")
        return "\n".join(lines)


def _as_graph_def(x):
    if isinstance(x, graph_pb2.GraphDef):
        return x
    if isinstance(x, (bytes, bytearray)):
        gd = graph_pb2.GraphDef()
        gd.ParseFromString(bytes(x))
        return gd
    if isinstance(x, tf.Graph):
        return x.as_graph_def(add_shapes=True)
    graph = getattr(x, "graph", None)
    if isinstance(graph, tf.Graph):       # ConcreteFunction
        return graph.as_graph_def(add_shapes=True)
    return None


def check_align(x) -> AlignResult:
    """Alignment of a tensor, a ``(shape, dtype)`` pair or a whole graph (see module doc)."""
    gd = _as_graph_def(x)
    if gd is not None:
        res = align.analyze_graph(Graph(gd))
        return AlignResult(res)
    shape = dtype = None
    name = None
    if isinstance(x, (tf.Tensor, tf.Variable)) or hasattr(x, "shape") and hasattr(x, "dtype"):
        shape, dtype = list(x.shape), x.dtype
        name = getattr(x, "name", None) if not tf.executing_eagerly() or isinstance(x, tf.Variable) else None
    elif isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], (tuple, list, tf.TensorShape)):
        shape, dtype = list(x[0]), x[1]
    if shape is None:
        raise NpuAmpError(f"check_align: cannot analyse {type(x).__name__}; accepted: {_ACCEPTED}")
    try:
        dt = formats._dtype_name(tf.as_dtype(dtype) if not isinstance(dtype, str) else tf.as_dtype(dtype))
    except TypeError as exc:
        raise NpuAmpError(f"check_align: dtype {dtype!r} is not a dtype; accepted: float16, float32, "
                          f"bfloat16, int8, uint8") from exc
    try:
        item = align.tensor_item([(-1 if d is None else int(d)) for d in shape], dt, name=name)
    except formats.FormatError as exc:
        raise NpuAmpError(f"check_align: {exc}") from exc
    return AlignResult({"kind": "tensor", "items": [] if item["aligned"] else [item],
                        "tensor": item})
