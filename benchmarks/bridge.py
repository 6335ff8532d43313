"""What crossing the grappler bridge costs, next to what the passes cost.

Graph: the training graph of ``tf.keras.applications.ResNet50`` (weights=None,
batch 8) with Keras' momentum SGD, built in TF1 graph mode (5.9k nodes with
gradients on TF 2.15).  Everything runs in one process through real grappler
(``tf_optimizer.OptimizeGraph``) with only ``NpuAmpOptimizer`` enabled and one
meta-optimizer iteration:

* ``grappler, NpuAmpOptimizer returns at once``: grappler's own fixed cost
  (item creation, pruning to the fetches) with our optimizer called but
  returning before it serializes anything (no callback registered);
* ``bridge echo``: NpuAmpOptimizer with a Python callback that hands the
  input bytes straight back: C++ serialize + ctypes copies + C++ parse;
* ``python parse + serialize``: GraphDef.FromString / SerializeToString in
  Python (the part of the round trip the echo skips);
* ``pipeline``: the pass pipeline itself (``Report.summary.time_s``);
* ``bridge full``: grappler with the real bridge and pipeline, end to end.

Round trip = (echo - baseline) + python parse/serialize.  The goal is a round
trip well under 10% of the pass time.  Figures only; nothing is asserted.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from tensorflow.core.framework import graph_pb2  # noqa: E402
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import npu_amp_tf  # noqa: E402
from npu_amp_tf import bridge  # noqa: E402

RC = rewriter_config_pb2.RewriterConfig


def resnet50_training_metagraph(batch=8):
    if int(tf.__version__.split(".")[1]) >= 16:
        raise SystemExit(f"benchmarks/bridge.py builds a Keras 2 graph-mode training graph; "
                         f"run it with TF 2.15 (this is {tf.__version__})")
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.keras.backend.set_learning_phase(1)
        x = tf.compat.v1.placeholder(tf.float32, [batch, 224, 224, 3], name="images")
        labels = tf.compat.v1.placeholder(tf.int32, [batch], name="labels")
        model = tf.keras.applications.ResNet50(weights=None, input_tensor=x, classes=1000)
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, model.output))
        # Keras' own momentum SGD, as a Keras 2 user would write it
        opt = tf.keras.optimizers.legacy.SGD(0.01, momentum=0.9)
        updates = opt.get_updates(loss, model.trainable_weights)
        train_op = tf.group(*updates, *model.updates, name="train_op")
        g.add_to_collection("train_op", train_op)
        meta = tf.compat.v1.train.export_meta_graph(graph=g)
    return meta


def grappler_config():
    """Only NpuAmpOptimizer, one iteration."""
    cfg = config_pb2.ConfigProto()
    rw = cfg.graph_options.rewrite_options
    rw.meta_optimizer_iterations = RC.ONE
    rw.min_graph_nodes = -1
    rw.optimizers.append("NpuAmpOptimizer")
    entry = rw.custom_optimizers.add()
    entry.name = "NpuAmpOptimizer"
    entry.parameter_map["precision_mode"].s = b"allow_mix_precision"
    return cfg


def timeit(fn, repeat):
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(repeat=5):
    bridge.register()
    meta = resnet50_training_metagraph()
    gd = meta.graph_def
    nbytes = len(gd.SerializeToString())
    print(f"TensorFlow {tf.__version__}; ResNet50 training graph: {len(gd.node)} nodes, "
          f"{nbytes / 1e6:.2f} MB serialized; median of {repeat} runs\n")

    our_cfg = grappler_config()
    # baseline: NpuAmpOptimizer is called but, with no callback registered, it
    # returns at once (before serializing anything); grappler logs one error
    bridge.unregister()
    t_base = timeit(lambda: tf_optimizer.OptimizeGraph(our_cfg, meta), repeat)
    bridge.register()

    real_handle = bridge.handle
    bridge.handle = lambda graph_bytes, *a, **k: (bridge.RC_OK, graph_bytes)  # echo
    try:
        t_echo = timeit(lambda: tf_optimizer.OptimizeGraph(our_cfg, meta), repeat)
    finally:
        bridge.handle = real_handle

    raw = gd.SerializeToString()
    t_parse = timeit(lambda: graph_pb2.GraphDef.FromString(raw), repeat)
    t_ser = timeit(lambda: gd.SerializeToString(deterministic=True), repeat)

    pipe_times, full_times = [], []
    for _ in range(repeat):
        bridge.clear_reports()  # no memo: every run does the full work
        t0 = time.perf_counter()
        tf_optimizer.OptimizeGraph(our_cfg, meta)
        full_times.append(time.perf_counter() - t0)
        recs = [r for r in bridge.last_reports() if r["report"]]
        pipe_times.append(sum(r["report"]["summary"]["time_s"] for r in recs))
    t_pipe, t_full = statistics.median(pipe_times), statistics.median(full_times)
    status = [r["status"] for r in bridge.last_reports()]
    rep = next((r["report"] for r in bridge.last_reports() if r["report"]), None)

    round_trip = max(t_echo - t_base, 0.0) + t_parse + t_ser
    rows = [
        ("grappler, NpuAmpOptimizer returns at once", t_base),
        ("bridge echo (C++ ser + ctypes + C++ parse)", t_echo),
        ("  echo minus baseline", max(t_echo - t_base, 0.0)),
        ("python GraphDef parse", t_parse),
        ("python GraphDef serialize", t_ser),
        ("round trip across the bridge", round_trip),
        ("pass pipeline", t_pipe),
        ("bridge full, end to end", t_full),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'step':<{w}}  {'seconds':>9}")
    for name, t in rows:
        print(f"{name:<{w}}  {t:9.4f}")
    print(f"\nround trip / pass time: {100 * round_trip / t_pipe:.1f}%  (goal: well under 10%)")
    print(f"bridge statuses of the last run: {status}")
    if rep:
        s = rep["summary"]
        print(f"pipeline: {s.get('pipeline')}; casts in output: {s.get('casts')}; "
              f"nodes out: {s.get('nodes')}")


if __name__ == "__main__":
    main()
