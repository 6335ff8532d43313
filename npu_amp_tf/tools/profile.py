"""Profile N steps with TensorFlow's own tracing.

Each step runs with ``RunOptions(trace_level=FULL_TRACE)``; TF's step stats
become a Chrome trace (``timeline.json``, open it in ``chrome://tracing`` or
https://ui.perfetto.dev) and a summary (``summary.json``):

``lp_compute_share``
    share of op time spent in low-precision (FP16/BF16) compute ops, Cast
    and TransData excluded (Ascend's "FP16 compute share");
``cast_transdata_share``
    share of op time spent in Cast and TransData (Ascend's "copy time");
``peak_bytes``
    peak memory measured by TF's allocators (the largest live-tensor total
    TF's timeline reconstructs from its allocation records, per allocator);
``top_ops``
    the ops with the most total time.

Shares are of the *summed* op time (ops may overlap across threads), over
the traced steps after one untraced warm-up step.

Two sources: a model (``MODEL``: rewritten with the given options and run on
``--inputs`` or synthetic data) or a TF1 training script (``SCRIPT.py``: run
as ``__main__``; its first N ``Session.run`` calls are traced).
"""
from __future__ import annotations

import collections
import json
import os
import runpy
import sys

from . import model_io
from .model_io import ToolError

LOW = {"DT_HALF", "DT_BFLOAT16"}
COPY_OPS = ("Cast", "TransData")
#: not compute: never counted as low-precision compute (their time still counts in the total)
NON_COMPUTE = frozenset({"Const", "_Arg", "_Retval", "Placeholder", "NoOp", "Identity", "_Recv", "_Send"})
_IGNORE = ("_SOURCE", "_SINK")


def _label_op(label: str) -> str:
    # "name = Op(a, b)" -> "Op"
    _, _, rhs = label.partition(" = ")
    return rhs.split("(", 1)[0].strip() if rhs else ""


def summarize(step_stats_list, graph_def=None, top: int = 10) -> dict:
    """Time shares, top ops and peak memory from a list of StepStats."""
    from tensorflow.core.framework import types_pb2
    from tensorflow.python.client import timeline

    nodes = {n.name: n for n in graph_def.node} if graph_def is not None else {}
    per_op = collections.defaultdict(lambda: {"time_us": 0, "count": 0, "low_precision": False})
    total = lp = copy = 0
    peak = {}
    for ss in step_stats_list:
        for dev in ss.dev_stats:
            for ns in dev.node_stats:
                name = ns.node_name.split(":")[0]
                if name in _IGNORE:
                    continue
                dur = max(0, ns.op_end_rel_micros - ns.op_start_rel_micros) or max(
                    0, ns.all_end_rel_micros)
                op = nodes[name].op if name in nodes else (_label_op(ns.timeline_label) or name)
                dts = {types_pb2.DataType.Name(o.tensor_description.dtype) for o in ns.output}
                if name in nodes and not dts:
                    attr = nodes[name].attr
                    for k in ("T", "dtype", "DstT"):
                        if k in attr and attr[k].type:
                            dts.add(types_pb2.DataType.Name(attr[k].type))
                is_low = bool(dts & LOW) and op not in NON_COMPUTE
                total += dur
                if op in COPY_OPS:
                    copy += dur
                elif is_low:
                    lp += dur
                key = op
                per_op[key]["time_us"] += dur
                per_op[key]["count"] += 1
                per_op[key]["low_precision"] |= is_low and op not in COPY_OPS
                for m in ns.memory:
                    peak[m.allocator_name] = max(peak.get(m.allocator_name, 0), m.allocator_bytes_in_use)
        tl = timeline.Timeline(ss)
        tl.generate_chrome_trace_format(show_memory=True)
        for alloc, mx in getattr(tl, "_allocator_maximums", {}).items():
            peak[alloc] = max(peak.get(alloc, 0), int(mx.num_bytes))
    top_ops = sorted(per_op.items(), key=lambda kv: -kv[1]["time_us"])[:top]
    return {
        "steps": len(step_stats_list),
        "total_op_time_us": total,
        "lp_compute_time_us": lp,
        "cast_transdata_time_us": copy,
        "lp_compute_share": lp / total if total else 0.0,
        "cast_transdata_share": copy / total if total else 0.0,
        "peak_bytes": max(peak.values()) if peak else 0,
        "peak_bytes_by_allocator": peak,
        "top_ops": [dict(op=k, share=v["time_us"] / total if total else 0.0, **v) for k, v in top_ops],
    }


def chrome_trace(step_stats_list, graph=None) -> dict:
    """One Chrome trace (``{"traceEvents": [...]}``) over all steps."""
    from tensorflow.python.client import timeline

    events, seen_meta = [], set()
    for ss in step_stats_list:
        tl = timeline.Timeline(ss, graph)
        data = json.loads(tl.generate_chrome_trace_format(show_memory=True))
        for ev in data.get("traceEvents", []):
            if ev.get("ph") == "M":
                key = (ev.get("name"), ev.get("pid"), ev.get("tid"), json.dumps(ev.get("args"), sort_keys=True))
                if key in seen_meta:
                    continue
                seen_meta.add(key)
            events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_outputs(out_dir: str, trace: dict, summary: dict) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    tpath = os.path.join(out_dir, "timeline.json")
    spath = os.path.join(out_dir, "summary.json")
    with open(tpath, "w", encoding="utf-8") as fh:
        json.dump(trace, fh)
    with open(spath, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    return [tpath, spath]


def profile_graph(graph_def, feeds: dict, fetches: list[str], steps: int, out_dir: str,
                  progress: bool = True, warmup: int = 1) -> dict:
    """Run ``graph_def`` ``warmup + steps`` times, tracing the last ``steps``."""
    import tensorflow as tf
    from tqdm import tqdm

    g = model_io.import_graph(graph_def)
    stats = []
    opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    with tf.compat.v1.Session(graph=g, config=model_io.session_config()) as sess:
        try:
            for _ in range(warmup):
                sess.run(fetches, feed_dict=feeds)
            for _ in tqdm(range(steps), desc="profile", unit="step", disable=not progress, leave=False):
                md = tf.compat.v1.RunMetadata()
                sess.run(fetches, feed_dict=feeds, options=opts, run_metadata=md)
                stats.append(md.step_stats)
        except tf.errors.OpError as exc:
            raise ToolError(f"running the graph failed: {model_io._first_line(exc.message)}") from None
    summary = summarize(stats, graph_def)
    summary["files"] = write_outputs(out_dir, chrome_trace(stats, g), summary)
    return summary


def profile_script(script: str, steps: int, out_dir: str, args=(), progress: bool = True,
                   skip: int = 1) -> dict:
    """Run a TF1 script as ``__main__`` and trace ``steps`` of its
    ``Session.run`` calls after the first ``skip`` (warm-up / initialiser)."""
    import tensorflow as tf
    from tqdm import tqdm
    from tensorflow.python.client import session as session_lib

    if not os.path.isfile(script):
        raise ToolError(f"script '{script}' does not exist")
    stats, graphs = [], []
    bar = tqdm(total=steps, desc="profile", unit="step", disable=not progress, leave=False)
    orig_run = session_lib.BaseSession.run
    calls = {"n": 0}

    def traced_run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        calls["n"] += 1
        if calls["n"] <= skip or len(stats) >= steps or options is not None:
            return orig_run(self, fetches, feed_dict, options, run_metadata)
        md = run_metadata if run_metadata is not None else tf.compat.v1.RunMetadata()
        opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        out = orig_run(self, fetches, feed_dict, opts, md)
        stats.append(md.step_stats)
        graphs.append(self.graph)
        bar.update(1)
        return out

    old_argv = sys.argv
    sys.argv = [script] + list(args)
    session_lib.BaseSession.run = traced_run
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ToolError(f"script '{script}' exited with status {exc.code}") from None
    finally:
        session_lib.BaseSession.run = orig_run
        sys.argv = old_argv
        bar.close()
    if not stats:
        raise ToolError(f"script '{script}' made no Session.run call past the first {skip}; "
                        "profile traces TF1 Session scripts (for a model file, pass the model instead)")
    gd = graphs[-1].as_graph_def()
    summary = summarize(stats, gd)
    summary["files"] = write_outputs(out_dir, chrome_trace(stats, graphs[-1]), summary)
    return summary


def format_summary(summary: dict) -> str:
    lines = [
        f"steps traced:              {summary['steps']}",
        f"total op time:             {summary['total_op_time_us'] / 1000:.2f} ms",
        f"low-precision compute:     {summary['lp_compute_share'] * 100:.1f}% of op time",
        f"Cast + TransData:          {summary['cast_transdata_share'] * 100:.1f}% of op time "
        f"(Ascend guidance: < 15%)",
        f"peak memory (TF):          {_fmt_bytes(summary['peak_bytes'])}",
        "top ops:",
    ]
    for t in summary["top_ops"]:
        lines.append(f"  {t['op']:<28} {t['share'] * 100:5.1f}%  {t['time_us'] / 1000:8.3f} ms  "
                     f"x{t['count']}{'  [low precision]' if t['low_precision'] else ''}")
    return "\n".join(lines)


def _fmt_bytes(b):
    if b < 1024:
        return f"{int(b)} B"
    if b < 2 ** 20:
        return f"{b / 1024:.1f} KiB"
    return f"{b / 2 ** 20:.2f} MiB"
