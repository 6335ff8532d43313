"""Dump one step of the FP32 graph and of the rewritten (mixed) graph.

Both graphs run on the same inputs and the same weights (the model is frozen
first, so variables become the same constants in both).  Every float tensor
that can be fetched (everything outside v1 loop / cond bodies) is saved:

``DIR/fp32.npz``, ``DIR/mixed.npz``
    tensor name (``node:port``) -> array, in the graph's own dtype.
``DIR/meta.json``
    per tensor: node, op, dtype in each graph, topological index in the
    mixed graph; the graph inputs and outputs; the rewrite options.
``DIR/fp32.pb``, ``DIR/mixed.pb``, ``DIR/report.json``
    the two graphs that ran and the rewrite report.

``npu-amp compare DIR`` reads this directory (:mod:`.compare`).
"""
from __future__ import annotations

import json
import os

import numpy as np

from . import model_io
from .model_io import ToolError

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_SKIP_OPS = frozenset({"NoOp", "Assert"})


def _fetchable_float_tensors(g):
    """Float tensors of ``g`` that a Session can fetch, in graph order."""
    out = []
    for op in g.get_operations():
        if op.type in _SKIP_OPS:
            continue
        if op._get_control_flow_context() is not None:  # inside a v1 loop / cond
            continue
        for t in op.outputs:
            if t.dtype.base_dtype.name in FLOAT_DTYPES:
                out.append(t)
    return out


def _run_all(graph_def, feeds, label, progress=True, chunk=256):
    """Run ``graph_def`` once per chunk of fetches; return {tensor name: array}."""
    import tensorflow as tf
    from tqdm import tqdm

    g = model_io.import_graph(graph_def)
    tensors = _fetchable_float_tensors(g)
    names = [t.name for t in tensors]
    result = {}
    with tf.compat.v1.Session(graph=g, config=model_io.session_config()) as sess:
        with tqdm(total=len(names), desc=f"dump {label}", unit="tensor", disable=not progress,
                  leave=False) as bar:
            for i in range(0, len(names), chunk):
                part = names[i:i + chunk]
                try:
                    vals = sess.run(part, feed_dict=feeds)
                except tf.errors.OpError as exc:
                    raise ToolError(f"running the {label} graph failed: "
                                    f"{model_io._first_line(exc.message)}") from None
                result.update(zip(part, vals))
                bar.update(len(part))
    return result, {t.name: (t.op.name, t.op.type, t.dtype.base_dtype.name) for t in tensors}


def _to_npz_value(a):
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":  # numpy cannot store ml_dtypes bfloat16 portably
        return a.astype(np.float32)
    return a


def dump(model, feeds: dict, out_dir: str, options=None, progress: bool = True) -> dict:
    """Run the FP32 and the rewritten graph of ``model`` (a :class:`Model`
    or :class:`Runnable`) on ``feeds`` ({tensor name: array}) and save every
    float tensor under ``out_dir``.  Returns the meta dict written to
    ``meta.json``."""
    from graph_passes.graph import Graph

    from ..options import Options

    options = options if options is not None else Options.from_kwargs(_groups=("rewrite",))
    run = model if isinstance(model, model_io.Runnable) else model_io.runnable(model)
    os.makedirs(out_dir, exist_ok=True)
    mixed_gd, report = model_io.rewrite_runnable(run, options)

    fp32_vals, fp32_info = _run_all(run.graph_def, feeds, "fp32", progress)
    mixed_vals, mixed_info = _run_all(mixed_gd, feeds, "mixed", progress)

    order = Graph(mixed_gd).topo_order()
    topo = {name: i for i, name in enumerate(order)}
    tensors = {}
    for name in sorted(set(fp32_info) | set(mixed_info), key=lambda t: (
            topo.get(mixed_info.get(t, fp32_info.get(t))[0], 1 << 30), t)):
        info = mixed_info.get(name) or fp32_info[name]
        tensors[name] = {
            "node": info[0], "op": info[1],
            "fp32_dtype": fp32_info[name][2] if name in fp32_info else None,
            "mixed_dtype": mixed_info[name][2] if name in mixed_info else None,
            "topo_index": topo.get(info[0]),
        }
    np.savez(os.path.join(out_dir, "fp32.npz"), **{k: _to_npz_value(v) for k, v in fp32_vals.items()})
    np.savez(os.path.join(out_dir, "mixed.npz"), **{k: _to_npz_value(v) for k, v in mixed_vals.items()})
    with open(os.path.join(out_dir, "fp32.pb"), "wb") as fh:
        fh.write(run.graph_def.SerializeToString())
    with open(os.path.join(out_dir, "mixed.pb"), "wb") as fh:
        fh.write(mixed_gd.SerializeToString())
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as fh:
        fh.write(report.dumps(indent=1))
    meta = {
        "format": "npu-amp-dump/1",
        "inputs": dict(run.inputs),
        "outputs": dict(run.outputs),
        "options": options.rewrite_params(),
        "precision_mode": options.precision,
        "tensors": tensors,
    }
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1, default=str)
    return meta
