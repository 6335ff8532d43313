"""Session hook of the compatibility layer (tf_adapter's ``decorator_tf_session``).

Wraps ``BaseSession.__init__`` (every ``tf.compat.v1.Session``,
``InteractiveSession``, ``MonitoredTrainingSession`` and Estimator session)
so that its ConfigProto:

* gets the plugin when it has no ``NpuAmpOptimizer`` / ``NpuOptimizer``
  entry: with ``default_params`` (``npu-amp run --precision-mode ...``) an
  :func:`npu_amp_tf.session_config` entry, or, once ``npu_bridge.npu_init``
  is imported, an ``NpuOptimizer`` entry as tf_adapter adds one;
* has GE's ``memory_optimize`` / ``buffer_optim`` keys of its entry applied to
  ``rewrite_options.memory_optimization`` and, for an ``NpuOptimizer`` entry,
  the remapper switched off (as tf_adapter does);
* with ``profiling_mode`` true in its entry, traces the session's steps
  (``RunOptions.FULL_TRACE``) and writes ``timeline.json`` / ``summary.json``
  to ``profiling_options.output`` when the session closes (the
  ``npu-amp profile`` tool's files).
"""
from __future__ import annotations

import atexit
import json
import logging
import threading

log = logging.getLogger("npu_amp_tf")

PLUGIN_ENTRIES = ("NpuAmpOptimizer", "NpuOptimizer")
#: steps traced per profiled session (after the first, warm-up run)
PROFILE_MAX_STEPS = 20

_lock = threading.Lock()
_state = {"orig": None, "default_params": None, "npu_entry": False}


def set_default_params(params):
    _state["default_params"] = None if params is None else dict(params)


def patch(default_params=None, npu_entry=False):
    """Install the hook (idempotent) and set what it adds."""
    from .. import _tf

    with _lock:
        if default_params is not None:
            _state["default_params"] = dict(default_params)
        if npu_entry:
            _state["npu_entry"] = True
        if _state["orig"] is None:
            session_cls = _tf.base_session_class()
            orig = session_cls.__init__

            def __init__(self, target="", graph=None, config=None):  # noqa: N807
                config = adjust_config(config)
                orig(self, target, graph, config)
                _maybe_profile(self, config)

            __init__.__wrapped__ = orig
            session_cls.__init__ = __init__
            _state["orig"] = orig


def unpatch():
    from .. import _tf

    with _lock:
        if _state["orig"] is not None:
            _tf.base_session_class().__init__ = _state["orig"]
        _state.update(orig=None, default_params=None, npu_entry=False)


def _entry_params(entry) -> dict:
    from ..options import attr_value_to_python

    return {k: attr_value_to_python(v) for k, v in entry.parameter_map.items()}


def adjust_config(config):
    """The ConfigProto a session is created with (a copy; ``config`` is kept)."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    from .. import config as _config
    from ..options import memory_optimization_of

    cfg = config_pb2.ConfigProto()
    if config is not None:
        cfg.CopyFrom(config)
    rw = cfg.graph_options.rewrite_options
    names = [c.name for c in rw.custom_optimizers]
    if not any(n in PLUGIN_ENTRIES for n in names):
        if _state["default_params"] is not None:
            cfg = _config.session_config(cfg, **_state["default_params"])
        elif _state["npu_entry"]:
            e = rw.custom_optimizers.add()
            e.name = "NpuOptimizer"
            rw.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
        rw = cfg.graph_options.rewrite_options
    for entry in rw.custom_optimizers:
        if entry.name not in PLUGIN_ENTRIES:
            continue
        if entry.name == "NpuOptimizer":
            rw.remapping = rewriter_config_pb2.RewriterConfig.OFF
        mem = memory_optimization_of(_entry_params(entry))
        if mem is not None:
            rw.memory_optimization = getattr(rewriter_config_pb2.RewriterConfig, mem)
    return cfg


def _profiling_of(config):
    for entry in config.graph_options.rewrite_options.custom_optimizers:
        if entry.name in PLUGIN_ENTRIES:
            p = _entry_params(entry)
            if str(p.get("profiling_mode", "")).lower() in ("true", "1"):
                try:
                    opts = json.loads(p.get("profiling_options") or "{}")
                except json.JSONDecodeError:
                    opts = {}
                return opts.get("output") or "profiling"
    return None


def _maybe_profile(sess, config):
    out_dir = _profiling_of(config)
    if out_dir is None:
        return
    import tensorflow as tf

    from ..tools import profile as prof

    orig_run = sess.run
    stats = []
    state = {"calls": 0, "written": False}

    def run(fetches, feed_dict=None, options=None, run_metadata=None):
        state["calls"] += 1
        if state["calls"] == 1 or len(stats) >= PROFILE_MAX_STEPS or options is not None:
            return orig_run(fetches, feed_dict=feed_dict, options=options, run_metadata=run_metadata)
        md = run_metadata if run_metadata is not None else tf.compat.v1.RunMetadata()
        opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        out = orig_run(fetches, feed_dict=feed_dict, options=opts, run_metadata=md)
        stats.append(md.step_stats)
        return out

    def write():
        if state["written"] or not stats:
            return
        state["written"] = True
        try:
            gd = sess.graph.as_graph_def()
            summary = prof.summarize(stats, gd)
            summary["files"] = prof.write_outputs(out_dir, prof.chrome_trace(stats, sess.graph), summary)
            log.warning("npu_amp_tf: profiling_mode: %d steps traced into %s", len(stats), out_dir)
        except Exception as exc:  # noqa: BLE001 - profiling must not fail the script
            log.error("npu_amp_tf: profiling_mode: writing %s failed: %s", out_dir, exc)

    orig_close = sess.close

    def close():
        write()
        return orig_close()

    sess.run = run
    sess.close = close
    atexit.register(write)
