"""Dump one step of the FP32 graph and of the rewritten (mixed) graph.

Both graphs run on the same inputs and the same weights: a frozen model's
constants, or a TF1 MetaGraph's variables loaded into both from
``--checkpoint`` / the initializers (:class:`.model_io.StepSession`).  When
the outputs name a train op the step is a real training step (forward,
backward, loss scaling, apply) and the gradients are dumped too.

Tensors are captured with TensorFlow's own debugger (tfdbg's
``DebugIdentity`` watches, written by TF while the step runs, grappler off so
every node runs as written), not by fetching: so the bodies of v1
``while_loop`` / ``cond`` are dumped too.  A tensor computed several times in
the step (a loop body) is saved once: its first execution holding inf/NaN,
else its last; ``executions`` in ``meta.json`` says how many there were.

``DIR/fp32.npz``, ``DIR/mixed.npz``
    tensor name (``node:port``) -> array, in the graph's own dtype (BF16
    widened to FP32: NumPy has no portable bfloat16).
``DIR/meta.json``
    per tensor: node, op, dtype in each graph, topological index in the
    mixed graph, executions; the graph inputs and outputs; the rewrite
    options; ``not_dumped``: every float tensor (or function body) of either
    graph with no value, and why (an untaken ``cond`` branch, a function body
    of control flow v2 that the debugger cannot watch, ...).
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
#: ops whose bodies are functions TF's v1 debugger does not watch
_FUNCTION_CALL_OPS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
                                "PartitionedCall", "StatefulPartitionedCall"})


def _float_tensors(g):
    """Float tensors of ``g`` in graph order (the tool's own load ops excluded)."""
    out = []
    for op in g.get_operations():
        if op.type in _SKIP_OPS or op.name.startswith("npu_amp_load/"):
            continue
        for t in op.outputs:
            if t.dtype.base_dtype.name in FLOAT_DTYPES:
                out.append(t)
    return out


def _pick(values):
    """The first execution holding inf/NaN, else the last."""
    for i, v in enumerate(values):
        if v.dtype.kind == "f" or v.dtype.name == "bfloat16":
            if not np.isfinite(v.astype(np.float64)).all():
                return i, v
    return len(values) - 1, values[-1]


def _run_all(graph_def, run, feeds, label, progress=True):
    """Run one step of ``graph_def`` under tfdbg watches on every float tensor.

    Returns ({tensor: array}, {tensor: (node, op, dtype, executions)},
    {tensor or node: reason it has no value})."""
    import shutil
    import tempfile

    import tensorflow as tf
    from tqdm import tqdm

    from .. import _tf

    debug_data, debug_utils = _tf.tfdbg()

    g = model_io.import_graph(graph_def)
    tensors = _float_tensors(g)
    info = {t.name: (t.op.name, t.op.type, t.dtype.base_dtype.name, 0) for t in tensors}
    opts = tf.compat.v1.RunOptions(output_partition_graphs=True)
    tmp = tempfile.mkdtemp(prefix=f"npu_amp_dump_{label}_")
    try:
        for t in tensors:
            debug_utils.add_debug_tensor_watch(opts, t.op.name, t.value_index, "DebugIdentity",
                                               debug_urls=["file://" + tmp])
        md = tf.compat.v1.RunMetadata()
        with model_io.StepSession(graph_def, run.variables, graph=g,
                                  config=model_io.session_config(grappler=False)) as sess:
            sess.run(list(run.outputs.values()), feeds, options=opts, run_metadata=md,
                     what=f"the {label} graph")
        dd = debug_data.DebugDumpDir(tmp, partition_graphs=md.partition_graphs, validate=False)
        seen = {}
        for datum in tqdm(dd.dumped_tensor_data, desc=f"dump {label}", unit="tensor", disable=not progress,
                          leave=False):
            name = f"{datum.node_name}:{datum.output_slot}"
            if name in info:
                seen.setdefault(name, []).append((datum.timestamp, datum))
        values, missing = {}, {}
        for name, entries in seen.items():
            arrays = []
            for _, datum in sorted(entries, key=lambda e: e[0]):
                a = datum.get_tensor()
                if isinstance(a, np.ndarray):
                    arrays.append(a)
            if not arrays:
                missing[name] = "the debugger dumped it but its value cannot be converted to an array"
                continue
            i, values[name] = _pick(arrays)
            node, op, dtype, _ = info[name]
            info[name] = (node, op, dtype, len(arrays))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Tensors a graph rewrite inside the Session fused away before the watches went in (oneDNN's layout
    # pass fuses Conv2D + BiasAdd in FP32, for one): fetching them keeps them; the step is re-run from the
    # same weights.  Tensors inside a v1 while_loop cannot be fetched: they are named below with the loop.
    frames = _loop_frames(g)
    for name in info:
        node = info[name][0]
        if name not in values and name not in missing and node in frames:
            missing[name] = (f"inside v1 while_loop frame '{frames[node]}': the debugger recorded no value "
                             "(a rewrite inside the Session fused it away, or the loop did not run) and a "
                             "tensor inside a loop cannot be fetched")
    fetchable = [n for n in info if n not in values and n not in missing and n not in
                 {model_io.tensor_ref(k) for k in feeds}]
    if fetchable:
        values.update(_fetch_each(graph_def, run, feeds, fetchable))
    for name, value in feeds.items():  # fed tensors do not run, their value is the feed
        name = model_io.tensor_ref(name)
        if name in info and name not in values:
            values[name] = np.asarray(value)
            node, op, dtype, _ = info[name]
            info[name] = (node, op, dtype, 1)
    for name in info:
        if name not in values and name not in missing:
            missing[name] = ("not computed in this step (an untaken cond branch, or not needed by the "
                             "outputs)")
    for op in g.get_operations():
        if op.type in _FUNCTION_CALL_OPS:
            fns = [op.get_attr(a).name for a in ("then_branch", "else_branch", "body", "cond", "f")
                   if a in op.node_def.attr and op.node_def.attr[a].HasField("func")]
            missing[op.name + "/<function body>"] = (
                f"inside function(s) {', '.join(fns)} called by {op.type} '{op.name}' (control flow v2 / "
                "tf.function): the v1 debugger cannot watch function bodies; only the call's outputs are dumped")
    return values, info, missing


def _loop_frames(g) -> dict:
    """{op name: frame name} for the ops inside v1 ``while_loop`` bodies (and
    conditions) of ``g``: everything reached from an ``Enter`` through data or
    control edges before the loop's ``Exit`` (nested loops: an inner op is
    named with the first frame that reaches it)."""
    waiting = {}
    for op in g.get_operations():
        for ci in op.control_inputs:
            waiting.setdefault(ci.name, []).append(op)
    frames = {}
    stack = []
    for op in g.get_operations():
        if op.type in ("Enter", "RefEnter"):
            frame = op.get_attr("frame_name")
            stack.append((op, frame.decode() if isinstance(frame, bytes) else frame))
    while stack:
        op, frame = stack.pop()
        if op.name in frames:
            continue
        frames[op.name] = frame
        nxt = [c for t in op.outputs for c in t.consumers()] + waiting.get(op.name, [])
        stack.extend((c, frame) for c in nxt if c.type not in ("Exit", "RefExit") and c.name not in frames)
    return frames


def _fetch_each(graph_def, run, feeds, names):
    """{tensor: value} for those of ``names`` a Session can fetch alongside
    the step (all at once; one by one when one of them cannot be fetched)."""
    out = {}
    sess = model_io.StepSession(graph_def, run.variables, config=model_io.session_config(grappler=False))
    try:
        steps = list(run.outputs.values())
        try:
            vals = sess.run(steps + names, feeds)[len(steps):]
            return dict(zip(names, vals))
        except ToolError:
            pass
        for n in names:
            sess.reset()
            try:
                out[n] = sess.run(steps + [n], feeds)[-1]
            except ToolError:
                continue
    finally:
        sess.close()
    return out


def _to_npz_value(a):
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":  # numpy cannot store ml_dtypes bfloat16 portably
        return a.astype(np.float32)
    return a


def dump(model, feeds: dict, out_dir: str, options=None, progress: bool = True) -> dict:
    """Run one step of the FP32 and of the rewritten graph of ``model`` (a
    :class:`Model` or :class:`Runnable`) on ``feeds`` ({tensor name: array})
    and save every float tensor under ``out_dir``.  Returns the meta dict
    written to ``meta.json``."""
    from graph_passes.graph import Graph

    from ..options import Options

    options = options if options is not None else Options.from_kwargs(_groups=("rewrite",))
    run = model if isinstance(model, model_io.Runnable) else model_io.runnable(model)
    os.makedirs(out_dir, exist_ok=True)
    mixed_gd, report = model_io.rewrite_runnable(run, options)

    fp32_vals, fp32_info, fp32_missing = _run_all(run.graph_def, run, feeds, "fp32", progress)
    mixed_vals, mixed_info, mixed_missing = _run_all(mixed_gd, run, feeds, "mixed", progress)

    order = Graph(mixed_gd).topo_order()
    topo = {name: i for i, name in enumerate(order)}
    tensors = {}
    for name in sorted((set(fp32_vals) | set(mixed_vals)), key=lambda t: (
            topo.get(mixed_info.get(t, fp32_info.get(t))[0], 1 << 30), t)):
        info = mixed_info.get(name) or fp32_info[name]
        tensors[name] = {
            "node": info[0], "op": info[1],
            "fp32_dtype": fp32_info[name][2] if name in fp32_vals else None,
            "mixed_dtype": mixed_info[name][2] if name in mixed_vals else None,
            "topo_index": topo.get(info[0]),
            "executions": info[3],
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
        "weights_from": run.weights_from,
        "training_step": run.training,
        "loader_notes": list(run.notes),
        "tensors": tensors,
        "not_dumped": {"fp32": fp32_missing, "mixed": mixed_missing},
    }
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1, default=str)
    return meta
