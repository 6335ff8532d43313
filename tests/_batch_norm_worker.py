"""Subprocess worker for tests/test_fusion_batch_norm.py (fused BF16 kernels may abort TF,
so every run happens here, never in the pytest process).

``python _batch_norm_worker.py <kind>`` prints one ``RESULT {json}`` line per run:

* ``keras3``  (Keras 3 only: tf.keras on TF >= 2.16) a Keras 3 model with four moments-based
  batch norms -- Conv -> BN -> ReLU; Conv -> BN(center=False, scale=False, axis=3) added to the
  first block's output (a residual unit: grappler's AddOpsRewrite spreads the batch norm's
  final Add over the residual sums) -> ReLU; two Conv -> BN(axis=3) branches added (ResNet's
  projection shortcut: both norms get the same incoming gradient, and grappler's CSE merges
  their identical dy-only gradient ops) -> ReLU; global pool -> Dense -- trained one SGD step
  (learning rate 1: the update is minus the gradient) from the same weights, in a
  tf.function with a GradientTape (``keras3_dynamic``: traced with an unknown batch
  dimension, as ``model.fit`` traces it), under: ``fp32`` plain TF; ``ours_fp32``
  enable(must_keep_origin_dtype, graph_level=2); ``ours`` enable(allow_mix_precision_bf16,
  graph_level=2); ``level1`` the same at graph_level 1 (no fusion: the BF16 moments
  arithmetic); ``fp16`` enable(allow_mix_precision, graph_level=2).
* ``slim``    a TF1 graph with a hand-written batch norm (``tf.nn.moments`` over [0, 1, 2],
  ``tf.nn.batch_normalization``, moving averages by ``assign_moving_average``, as TF-Slim /
  ModelZoo scripts write it) after a conv, one SGD step in a Session under the same configs
  (``session_config``).
* ``offline`` the ``slim`` graph rewritten offline in BF16, FP32 and FP16 modes, and a
  rank-2 (Dense) batch norm: fusion counts and skip reasons.

Each run reports the weights' updates, the moving statistics after the step, the loss, and
the op types (with T) of the nodes TF executed.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import npu_amp_tf  # noqa: E402
from _worker_util import run_from  # noqa: E402

tf1 = tf.compat.v1
BF16 = "allow_mix_precision_bf16"
CONFIGS = {"fp32": None,
           "ours_fp32": {"precision_mode": "must_keep_origin_dtype", "graph_level": 2},
           "ours": {"precision_mode": BF16, "graph_level": 2},
           "level1": {"precision_mode": BF16, "graph_level": 1},
           "fp16": {"precision_mode": "allow_mix_precision", "graph_level": 2}}


def _emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def _ops(nodes):
    c = Counter()
    for n in nodes:
        dt = tf.dtypes.as_dtype(n.attr["T"].type).name if "T" in n.attr else ""
        c[f"{n.op}:{dt}"] += 1
    return dict(c)


def _fusions():
    from npu_amp_tf import bridge
    s = json.dumps(bridge.last_reports())
    return s.count('"fusion": "batch_norm_moments"')


def keras3(dynamic=False):
    import keras
    if int(keras.__version__.split(".")[0]) < 3:
        _emit(skip=f"Keras {keras.__version__}")
        return
    from tensorflow.python.eager import context

    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inp)
    a = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    h = keras.layers.Conv2D(16, 3, padding="same")(a)
    h = keras.layers.BatchNormalization(axis=3, center=False, scale=False)(h)
    h = keras.layers.ReLU()(keras.layers.Add()([h, a]))
    # a projection shortcut: two batch norms summed, so both get the same incoming gradient
    # (grappler's CSE then shares their identical Sum(dy) -> Reshape -> Neg)
    p1 = keras.layers.BatchNormalization(axis=3)(keras.layers.Conv2D(8, 1, use_bias=False)(h))
    p2 = keras.layers.BatchNormalization(axis=3)(keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(h))
    h = keras.layers.ReLU()(keras.layers.Add()([p1, p2]))
    out = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inp, out)
    w0 = model.get_weights()
    rng = np.random.RandomState(5)
    x = tf.constant(rng.standard_normal((8, 8, 8, 3)).astype(np.float32))
    y = tf.constant(rng.randint(0, 4, 8).astype(np.int32))
    names = [v.path for v in model.trainable_variables]
    stat_names = [v.path for v in model.non_trainable_variables]
    for name, cfg in CONFIGS.items():
        model.set_weights(w0)
        from npu_amp_tf import bridge
        bridge.clear_reports()
        if cfg is not None:
            npu_amp_tf.enable(**cfg)

        sig = [tf.TensorSpec([None, 8, 8, 3], tf.float32), tf.TensorSpec([None], tf.int32)] if dynamic else None

        @tf.function(input_signature=sig)
        def step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(g)
            return loss

        ctx = context.context()
        ctx.enable_run_metadata()
        try:
            loss = float(step(x, y))
            md = ctx.export_run_metadata()
        finally:
            ctx.disable_run_metadata()
            npu_amp_tf.disable()
        ran = [n for fg in md.function_graphs for g in (fg.partition_graphs or [fg.post_optimization_graph])
               for n in g.node]
        w1 = model.get_weights()
        ntr = len(model.trainable_variables)
        upd = {}
        tw = [v for v in model.weights]
        for v, a0, a1 in zip(tw, w0, w1):
            if v.path in names:
                upd[v.path] = (a1 - a0).ravel().tolist()
        stats = {v.path: np.asarray(v.numpy()).ravel().tolist() for v in model.non_trainable_variables}
        assert len(upd) == ntr and len(stats) == len(stat_names)
        _emit(config=name, loss=loss, update=upd, stats=stats, ops=_ops(ran), fused=_fusions())


def _slim_graph(rank=4):
    tf1.set_random_seed(1)
    shape = [8, 6, 6, 4] if rank == 4 else [8, 12]
    x = tf1.placeholder(tf.float32, shape, name="x")
    y = tf1.placeholder(tf.int32, [8], name="y")
    init = tf1.initializers.glorot_uniform()
    if rank == 4:
        w = tf1.get_variable("w", [3, 3, 4, 12], initializer=init)
        h = tf.nn.conv2d(x, w, 1, "SAME")
        axes = [0, 1, 2]
    else:
        w = tf1.get_variable("w", [12, 12], initializer=init)
        h = tf.matmul(x, w)
        axes = [0]
    with tf1.variable_scope("bn"):
        gamma = tf1.get_variable("gamma", [12], initializer=tf1.initializers.random_uniform(0.5, 1.5))
        beta = tf1.get_variable("beta", [12], initializer=tf1.initializers.random_normal())
        mm = tf1.get_variable("moving_mean", [12], initializer=tf1.zeros_initializer(), trainable=False)
        mv = tf1.get_variable("moving_variance", [12], initializer=tf1.ones_initializer(), trainable=False)
        mean, var = tf.nn.moments(h, axes)
        upd_m = tf1.assign_sub(mm, (mm - mean) * 0.1)
        upd_v = tf1.assign_sub(mv, (mv - var) * 0.1)
        h = tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-3)
    h = tf.nn.relu(h)
    feat = tf.reduce_mean(h, [1, 2]) if rank == 4 else h
    wd = tf1.get_variable("dense", [12, 5], initializer=init)
    logits = tf.matmul(feat, wd)
    loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    with tf.control_dependencies([upd_m, upd_v]):
        train = tf1.train.GradientDescentOptimizer(1.0).minimize(loss)
    rng = np.random.RandomState(0)
    feeds = {x: rng.standard_normal(shape).astype(np.float32) * 2 + 0.5, y: rng.randint(0, 5, 8)}
    return feeds, loss, train


def slim():
    start = None
    for name, cfg in CONFIGS.items():
        g = tf.Graph()
        with g.as_default():
            feeds, loss, train = _slim_graph()
            allv = {v.op.name: v for v in tf1.global_variables()}
            tvars = {v.op.name for v in tf1.trainable_variables()}
            init = tf1.global_variables_initializer()
        from npu_amp_tf import bridge
        bridge.clear_reports()
        conf = npu_amp_tf.session_config(**cfg) if cfg is not None else tf1.ConfigProto()
        with tf1.Session(graph=g, config=conf) as s:
            s.run(init)
            start, (lv, _), md, after = run_from(s, allv, start, [loss, train], feeds)
        ran = [n for pg in md.partition_graphs for n in pg.node]
        _emit(config=name, loss=float(lv),
              update={k: (after[k] - start[k]).ravel().tolist() for k in tvars},
              stats={k: after[k].ravel().tolist() for k in allv if k not in tvars},
              ops=_ops(ran), fused=_fusions())


def offline():
    for rank in (4, 2):
        for mode in (BF16, "must_keep_origin_dtype", "allow_mix_precision"):
            g = tf.Graph()
            with g.as_default():
                _, loss, train = _slim_graph(rank)
            gd, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=[loss.op.name, train.name],
                                               precision_mode=mode, graph_level=2)
            st = rep.pass_stats("fusion")
            reasons = sorted({d.get("fusion_reason", "") for d in rep.decisions.values()
                              if d.get("fusion_skipped") == "batch_norm_moments"})
            _emit(config="offline", rank=rank, mode=mode,
                  fused=st.get("fused", {}).get("batch_norm_moments", 0), reasons=reasons,
                  ops=dict(Counter(n.op for n in gd.node)))


if __name__ == "__main__":
    {"keras3": keras3, "keras3_dynamic": lambda: keras3(dynamic=True), "slim": slim,
     "offline": offline}[sys.argv[1]]()
    print("DONE", flush=True)
