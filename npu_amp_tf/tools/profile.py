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
    peak memory of the step measured by TF's allocators: the largest running
    total of the allocation records of the traced steps, per allocator
    (:func:`allocator_peaks`).  Variables allocated before the step (weights,
    optimizer slots) are not in it: it is the step's activations, gradients,
    casts and temporaries;
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
import contextlib
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
                # (not ``allocator_bytes_in_use``: it is the whole process's, so it
                # counts every other live session's buffers and variables)
        for alloc, mx in allocator_peaks(ss).items():
            peak[alloc] = max(peak.get(alloc, 0), mx)
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


def allocator_peaks(step_stats) -> dict:
    """{allocator name: peak bytes allocated during one step} from the
    step's StepStats.

    Every allocation and deallocation TF's tracking allocators record for
    the step's ops (``NodeExecStats.memory[].allocation_records``, public
    fields of ``step_stats.proto``, filled under ``FULL_TRACE``) is replayed in
    time order; the peak of the running total is the step's peak: its
    activations, gradients, casts and temporaries.  Buffers that outlive the
    step (variables, optimizer slots) are not in it, and a tensor that
    aliases another buffer (a resource variable read, an Identity) allocates
    nothing.  Trace a step after a warm-up: the first step after the
    initializers also allocates the variables' buffers.

    (TF's own timeline memory counter sums every op *output* from creation
    to last use, aliases included, so it counts each FP32 weight read as
    new memory and cannot compare an FP32 graph with a mixed one.)"""
    events = collections.defaultdict(list)
    for dev in step_stats.dev_stats:
        for ns in dev.node_stats:
            for mem in ns.memory:
                for rec in mem.allocation_records:
                    events[mem.allocator_name].append((rec.alloc_micros, rec.alloc_bytes))
    peaks = {}
    for alloc, recs in events.items():
        recs.sort()
        cur = peak = 0
        for _, b in recs:
            cur += b
            peak = max(peak, cur)
        peaks[alloc] = peak
    return peaks


def chrome_trace(step_stats_list, graph=None) -> dict:
    """One Chrome trace (``{"traceEvents": [...]}``) over all steps."""
    from .. import _tf

    events, seen_meta = [], set()
    for ss in step_stats_list:
        tl = _tf.step_stats_timeline(ss, graph)
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


def trace_steps(graph_def, feeds: dict, fetches: list[str], steps: int, variables: dict | None = None,
                progress: bool = True, warmup: int = 1, config=None, desc: str = "profile"):
    """Run ``graph_def`` ``warmup + steps`` times (``variables`` loaded once,
    see :class:`.model_io.StepSession`: a train op in ``fetches`` trains on),
    tracing the last ``steps``.  Returns (list of StepStats, tf.Graph)."""
    import tensorflow as tf
    from tqdm import tqdm

    g = model_io.import_graph(graph_def)
    stats = []
    opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    with model_io.StepSession(graph_def, variables, graph=g, config=config) as sess:
        for _ in range(warmup):
            sess.run(fetches, feeds)
        for _ in tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False):
            md = tf.compat.v1.RunMetadata()
            sess.run(fetches, feeds, options=opts, run_metadata=md)
            stats.append(md.step_stats)
    return stats, g


def profile_graph(graph_def, feeds: dict, fetches: list[str], steps: int, out_dir: str,
                  progress: bool = True, warmup: int = 1, variables: dict | None = None) -> dict:
    """Run ``graph_def`` ``warmup + steps`` times, tracing the last ``steps``.
    ``variables`` ({variable node: value}, :attr:`.model_io.Runnable.variables`)
    are loaded first; a train op among ``fetches`` makes each step a training
    step."""
    stats, g = trace_steps(graph_def, feeds, fetches, steps, variables, progress, warmup)
    summary = summarize(stats, graph_def)
    summary["files"] = write_outputs(out_dir, chrome_trace(stats, g), summary)
    return summary


def profile_script(script: str, steps: int, out_dir: str, args=(), progress: bool = True,
                   skip: int = 1) -> dict:
    """Run a TF1 script as ``__main__`` and trace ``steps`` of its
    ``Session.run`` calls after the first ``skip`` (warm-up / initialiser)."""
    from tqdm import tqdm

    if not os.path.isfile(script):
        raise ToolError(f"script '{script}' does not exist")
    stats, graphs = [], []
    bar = tqdm(total=steps, desc="profile", unit="step", disable=not progress, leave=False)
    old_argv = sys.argv
    sys.argv = [script] + list(args)
    try:
        with _traced_session_runs(steps, skip, stats, graphs, bar.update):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ToolError(f"script '{script}' exited with status {exc.code}") from None
    finally:
        sys.argv = old_argv
        bar.close()
    if not stats:
        raise ToolError(f"script '{script}' made no Session.run call past the first {skip}; "
                        "profile traces TF1 Session scripts (for a model file, pass the model instead)")
    gd = graphs[-1].as_graph_def()
    summary = summarize(stats, gd)
    summary["files"] = write_outputs(out_dir, chrome_trace(stats, graphs[-1]), summary)
    return summary


@contextlib.contextmanager
def _traced_session_runs(steps: int, skip: int, stats: list, graphs: list, on_step):
    """While active, ``Session.run`` calls number ``skip + 1`` to
    ``skip + steps`` (those without their own ``RunOptions``) run with
    ``FULL_TRACE``; their StepStats and graphs are appended to ``stats`` /
    ``graphs``.

    TF has no public hook into a plain ``tf.compat.v1.Session`` (session hooks
    exist for ``MonitoredSession`` only), so this wraps ``BaseSession.run``
    for the duration (:func:`npu_amp_tf._tf.patched_base_session`), the one
    place the tools patch TF."""
    import tensorflow as tf

    from .. import _tf

    orig_run = _tf.base_session_class().run
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
        on_step(1)
        return out

    with _tf.patched_base_session("run", lambda _orig: traced_run):
        yield


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
