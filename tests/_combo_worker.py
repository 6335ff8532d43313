"""Subprocess worker for tests/test_bf16_safety.py: every precision mode x
graph_level on one graph kind, one combo after the other, in ONE process.

Each combo prints ``COMBO <kind> <mode> <level>`` (flushed) before it starts
and ``RESULT {json}`` when it ends, so that if TensorFlow aborts the process
the parent names the combo that killed it.

Kinds (tiny shapes: FP16 kernels are ~130x slower than FP32 on TF 2.15 CPUs):

* ``slim``:        TF-Slim conv+bias+relu x2 + fully_connected, one SGD step in a
                   TF1 Session from ``session_config`` (also grappler's own
                   ``auto_mixed_precision_onednn_bfloat16`` as a peer);
* ``keras``:       Keras Conv2D -> BatchNormalization -> ReLU -> Dense under
                   ``enable()``: an eval forward and a training step in a fresh
                   ``tf.function`` per combo;
* ``transformer``: a BERT-style block from raw ops (attention, LayerNorm via
                   tf.nn.moments, GELU FFN) trained one Adam step in a TF1 Session.

The executed graph is read back from TF (partition graphs / function run
metadata), never from our own report, and the dtypes of its convs/matmuls are
returned with the loss.
"""
import json
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("must_keep_origin_dtype", "force_fp32", "allow_mix_precision_bf16", "allow_mix_precision",
         "force_fp16", "allow_fp32_to_fp16", "cube_fp16in_fp32out")
LEVELS = (0, 1, 2, 3)
if os.environ.get("COMBO_MODES"):
    MODES = tuple(os.environ["COMBO_MODES"].split(","))
_CONV = re.compile(r"^(_MklNative|_Mkl|_Fused|_MklNativeFused|_MklFused)*Conv2D(WithBias)?$")
_MATMUL = re.compile(r"^(_MklNative|_Mkl|_Fused|_MklNativeFused|_MklFused)*(MatMul|BatchMatMulV\d?)$")


def _dtype_names(graph_defs):
    from tensorflow.python.framework import dtypes

    conv, mm = set(), set()
    for gd in graph_defs:
        for n in gd.node:
            if "T" not in n.attr:
                continue
            name = dtypes.as_dtype(n.attr["T"].type).name
            if _CONV.match(n.op):
                conv.add(name)
            elif _MATMUL.match(n.op) and not n.name.startswith("gradients"):
                mm.add(name)
    return sorted(conv), sorted(mm)


def _status():
    import npu_amp_tf

    reps = npu_amp_tf.bridge.last_reports()
    statuses = sorted({r["status"] for r in reps})
    warns = []
    for r in reps:
        for w in ((r.get("report") or {}).get("warnings") or []):
            if w.get("pass") == "opdef_check":
                warns.append(w["message"][:300])
    npu_amp_tf.bridge.clear_reports()
    return statuses, warns


_T0 = [0.0]


def _announce(kind, mode, level):
    import time

    _T0[0] = time.perf_counter()
    print(f"COMBO {kind} {mode} {level}", flush=True)


def _emit(kind, mode, level, loss, graphs, extra=None):
    conv, mm = _dtype_names(graphs)
    statuses, warns = _status()
    import time

    out = {"kind": kind, "mode": mode, "level": level, "secs": round(time.perf_counter() - _T0[0], 2),
           "loss": float(loss), "conv": conv,
           "matmul": mm, "statuses": statuses, "opdef_warnings": warns}
    out.update(extra or {})
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------- TF1 kinds
def _session_kind(kind, build):
    import tensorflow as tf

    import npu_amp_tf

    tf1 = tf.compat.v1
    g = tf.Graph()  # a TF1 graph and Session; eager stays on for the other kinds
    with g.as_default():
        tf1.set_random_seed(0)
        feeds, loss, train = build(tf, tf1)
        init = tf1.global_variables_initializer()
    opts = tf1.RunOptions(output_partition_graphs=True)

    def run(cfg, label_mode, level):
        _announce(kind, label_mode, level)
        with tf1.Session(graph=g, config=cfg) as s:
            s.run(init)  # graph-level seed: the same initial weights in every session
            md = tf1.RunMetadata()
            lv, _ = s.run([loss, train], feeds, options=opts, run_metadata=md)
            lv2 = s.run(loss, feeds)  # after the update: the step used the gradients
        _emit(kind, label_mode, level, lv, md.partition_graphs, {"loss_after": float(lv2)})

    only = os.environ.get("COMBO_ONLY")
    for mode in MODES:
        for level in LEVELS:
            if only and only != f"{mode}:{level}":
                continue
            run(npu_amp_tf.session_config(precision_mode=mode, graph_level=level), mode, level)
    if not only:
        from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

        if not os.environ.get("COMBO_NO_PEERS"):
            cfg = config_pb2.ConfigProto()
            cfg.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = \
                rewriter_config_pb2.RewriterConfig.ON
            run(cfg, "grappler_onednn_bf16", -1)
        run(config_pb2.ConfigProto(), "plain_tf", -1)


def _build_slim(tf, tf1):
    from real_models import import_slim

    slim = import_slim()
    rng = np.random.RandomState(0)
    x = tf1.placeholder(tf.float32, [2, 8, 8, 3], name="x")
    y = tf1.placeholder(tf.float32, [2, 4], name="y")
    n = slim.conv2d(x, 8, 3, scope="conv1")
    n = slim.conv2d(n, 8, 3, scope="conv2")
    n = slim.flatten(n)
    out = slim.fully_connected(n, 4, activation_fn=None, scope="fc")
    loss = tf.reduce_mean(tf.square(out - y), name="loss")
    train = tf1.train.GradientDescentOptimizer(0.05).minimize(loss)
    feeds = {x: rng.uniform(-1, 1, [2, 8, 8, 3]).astype(np.float32),
             y: rng.uniform(-1, 1, [2, 4]).astype(np.float32)}
    return feeds, loss, train


def _build_transformer(tf, tf1):
    rng = np.random.RandomState(0)
    B, S, H, NH = 2, 8, 16, 2
    D = H // NH
    x = tf1.placeholder(tf.float32, [B, S, H], name="x")
    y = tf1.placeholder(tf.float32, [B, S, H], name="y")
    init = tf1.truncated_normal_initializer(stddev=0.2)

    def dense(t, n, name):
        w = tf1.get_variable(name + "/kernel", [t.shape[-1], n], initializer=init)
        b = tf1.get_variable(name + "/bias", [n], initializer=tf1.zeros_initializer())
        return tf.nn.bias_add(tf.matmul(tf.reshape(t, [-1, t.shape[-1]]), w), b)

    def layer_norm(t, name):
        g = tf1.get_variable(name + "/gamma", [H], initializer=tf1.ones_initializer())
        b = tf1.get_variable(name + "/beta", [H], initializer=tf1.zeros_initializer())
        mean, var = tf.nn.moments(t, [-1], keepdims=True)
        return tf.nn.batch_normalization(t, mean, var, b, g, 1e-6)

    def heads(t):
        return tf.transpose(tf.reshape(t, [B, S, NH, D]), [0, 2, 1, 3])

    q, k, v = (heads(dense(x, H, n)) for n in ("q", "k", "v"))
    scores = tf.matmul(q, k, transpose_b=True) * (1.0 / np.sqrt(D))
    probs = tf.nn.softmax(scores)
    ctx = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [B * S, H])
    h = layer_norm(tf.reshape(ctx, [B, S, H]) + x, "ln1")
    f = dense(h, 4 * H, "ffn1")
    f = 0.5 * f * (1.0 + tf.math.erf(f / np.sqrt(2.0)))
    f = tf.reshape(dense(f, H, "ffn2"), [B, S, H])
    out = layer_norm(f + h, "ln2")
    loss = tf.reduce_mean(tf.square(out - y), name="loss")
    train = tf1.train.AdamOptimizer(1e-2).minimize(loss)
    feeds = {x: rng.uniform(-1, 1, [B, S, H]).astype(np.float32),
             y: rng.uniform(-1, 1, [B, S, H]).astype(np.float32)}
    return feeds, loss, train


# ---------------------------------------------------------------- Keras (TF2)
def _keras_kind():
    import tensorflow as tf
    from tensorflow.python.eager import context

    import npu_amp_tf

    K = tf.keras
    # Keras 3 draws initial weights from its own seed generator, which
    # tf.random.set_seed does not reach: seed both (same weights every process)
    K.utils.set_random_seed(0)
    tf.random.set_seed(0)
    rng = np.random.RandomState(0)
    model = K.Sequential([K.layers.Input((8, 8, 3)), K.layers.Conv2D(8, 3), K.layers.BatchNormalization(),
                          K.layers.ReLU(), K.layers.Flatten(), K.layers.Dense(4)])
    x = tf.constant(rng.uniform(-1, 1, [2, 8, 8, 3]).astype(np.float32))
    y = tf.constant(rng.uniform(-1, 1, [2, 4]).astype(np.float32))
    w0 = model.get_weights()

    def make_step():
        @tf.function
        def step(x, y):
            ev = tf.reduce_mean(tf.square(model(x, training=False) - y))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(0.05 * g)
            return ev, loss
        return step

    def run(label_mode, level, params):
        _announce("keras", label_mode, level)
        model.set_weights(w0)
        if params is None:
            npu_amp_tf.disable()
        else:
            npu_amp_tf.enable(**params)
        step = make_step()
        ctx = context.context()
        ctx.enable_run_metadata()
        try:
            ev, loss = step(x, y)
            md = ctx.export_run_metadata()
        finally:
            ctx.disable_run_metadata()
        graphs = []
        for fg in md.function_graphs:
            graphs.extend(fg.partition_graphs or [fg.post_optimization_graph])
        _emit("keras", label_mode, level, float(loss), graphs, {"eval": float(ev)})

    only = os.environ.get("COMBO_ONLY")
    for mode in MODES:
        for level in LEVELS:
            if only and only != f"{mode}:{level}":
                continue
            run(mode, level, {"precision_mode": mode, "graph_level": level})
    if not only:
        run("plain_tf", -1, None)


def main():
    for kind in sys.argv[1].split(","):
        if kind == "slim":
            _session_kind("slim", _build_slim)
        elif kind == "transformer":
            _session_kind("transformer", _build_transformer)
        elif kind == "keras":
            _keras_kind()
        else:
            raise SystemExit(f"unknown kind {kind!r}")
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
