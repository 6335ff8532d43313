"""Subprocess worker for tests/test_fusion_onednn.py (a oneDNN fusion may abort TF,
so every run happens here, never in the pytest process).

``python _onednn_fusion_worker.py KIND`` with KIND one of ``slim``, ``keras_tf1``,
``keras_fit``.  For each precision (fp32, bf16) it trains the same model one step
from the same initial weights under:

* ``peer``    TF's own rewrite: grappler's defaults (remapper on) in FP32, plus
              ``auto_mixed_precision_onednn_bfloat16`` in BF16;
* ``ours``    npu_amp_tf at graph_level 2 (``must_keep_origin_dtype`` in FP32,
              ``allow_mix_precision_bf16`` in BF16);
* ``unfused`` npu_amp_tf at graph_level 1 (same precision, no fusion).

and prints one ``RESULT {json}`` line per run: the fused nodes TF executed
(partition graphs / function run metadata), the forward loss before the step
and the weight update of the step.  ``KIND offline`` rewrites the TF1 graphs
offline and prints the fusion pass's fused/skipped counts and reasons.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2  # noqa: E402

import npu_amp_tf  # noqa: E402

tf1 = tf.compat.v1
MODES = {"fp32": "must_keep_origin_dtype", "bf16": "allow_mix_precision_bf16"}


def _keras2():
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 16):
        import tf_keras
        return tf_keras
    return tf.keras


def fused_counts(graphs) -> dict:
    """{"<op>[fused_ops]:<dtype>": n} for every fused/oneDNN node, plus Relu/AddV2 (and the 18f
    kernels AddRelu / AddNReluGrad / BatchNormGradNHWC)."""
    c = Counter()
    for g in graphs:
        for n in g.node:
            if "Fused" in n.op or n.op in ("Relu", "AddV2", "Add", "AddRelu", "AddNReluGrad", "BatchNormGradNHWC"):
                key = n.op
                if "fused_ops" in n.attr:
                    key += "[" + ",".join(s.decode() for s in n.attr["fused_ops"].list.s) + "]"
                if "T" in n.attr:
                    key += ":" + tf.dtypes.as_dtype(n.attr["T"].type).name
                c[key] += 1
    return dict(c)


def _emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


# ---------------------------------------------------------------- TF1 graphs
def build_slim():
    """Three TF-Slim resnet_v1 bottleneck units (conv+bias, no BN, as resnet_v1_50 without
    its arg_scope): a projection shortcut, an identity shortcut and a stride-2 unit whose
    shortcut is a 1x1 MaxPool subsample.  Each unit ends in relu(shortcut + conv3(+bias))."""
    from real_models import import_slim

    import_slim()
    import tf_slim as slim
    from tf_slim.nets import resnet_v1

    tf1.set_random_seed(1)
    x = tf1.placeholder(tf.float32, [2, 16, 16, 3], name="x")
    y = tf1.placeholder(tf.int32, [2], name="y")
    net = slim.conv2d(x, 16, 3, scope="stem")
    net = resnet_v1.bottleneck(net, 32, 8, 1, scope="unit_1")
    net = resnet_v1.bottleneck(net, 32, 8, 1, scope="unit_2")
    net = resnet_v1.bottleneck(net, 32, 8, 2, scope="unit_3")
    net = tf.reduce_mean(net, [1, 2])
    logits = slim.fully_connected(net, 10, activation_fn=None, scope="logits")
    loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
    rng = np.random.RandomState(0)
    feeds = {x: rng.uniform(-1, 1, [2, 16, 16, 3]).astype(np.float32), y: np.array([3, 7])}
    return feeds, loss, train


def _keras_model(K, tensor=None):
    inp = K.layers.Input((12, 12, 3)) if tensor is None else K.layers.Input(tensor=tensor)
    h = inp
    for i in range(2):  # Conv -> BN -> ReLU, twice
        h = K.layers.Conv2D(8, 3, padding="same", name=f"conv{i}")(h)
        h = K.layers.BatchNormalization(name=f"bn{i}")(h)
        h = K.layers.ReLU(name=f"relu{i}")(h)
    h = K.layers.GlobalAveragePooling2D()(h)
    return K.Model(inp, K.layers.Dense(4, name="logits")(h))


def build_keras_tf1():
    """Keras 2 Conv->BN->ReLU x2 called in a TF1 graph with the learning phase set to
    training (BatchNorm is FusedBatchNormV3 is_training=True), Momentum, BN updates."""
    K = _keras2()
    tf1.set_random_seed(1)
    K.backend.set_learning_phase(1)
    x = tf1.placeholder(tf.float32, [2, 12, 12, 3], name="x")
    y = tf1.placeholder(tf.int32, [2], name="y")
    model = _keras_model(K, x)  # built on x: its BatchNorm updates read x, not a second placeholder
    logits = model.output
    loss = tf.reduce_mean(K.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
    with tf.control_dependencies(model.updates):
        train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, var_list=model.trainable_weights)
    rng = np.random.RandomState(0)
    feeds = {x: rng.uniform(-1, 1, [2, 12, 12, 3]).astype(np.float32), y: np.array([1, 3])}
    return feeds, loss, train


def _configs(prec):
    peer = config_pb2.ConfigProto()
    if prec == "bf16":
        peer.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = \
            rewriter_config_pb2.RewriterConfig.ON
    return {"peer": peer,
            "ours": npu_amp_tf.session_config(precision_mode=MODES[prec], graph_level=2, fail_on_error=True),
            "unfused": npu_amp_tf.session_config(precision_mode=MODES[prec], graph_level=1,
                                                 fail_on_error=True)}


def session_kind(kind, build):
    start = {}  # variable name -> initial value, from the first session (Keras seeds differ per graph)
    for prec in ("fp32", "bf16"):
        for name, cfg in _configs(prec).items():
            g = tf.Graph()
            with g.as_default():
                feeds, loss, train = build()
                tvars = tf1.trainable_variables()
                gvars = tf1.global_variables()
                init = tf1.global_variables_initializer()
            with tf1.Session(graph=g, config=cfg) as s:
                s.run(init)
                if not start:
                    start.update(zip([v.name for v in gvars], s.run(gvars)))
                for v in gvars:
                    v.load(start[v.name], s)
                w0 = s.run(tvars)
                lv = s.run(loss, feeds)  # forward only
                md = tf1.RunMetadata()
                s.run(train, feeds, options=tf1.RunOptions(output_partition_graphs=True), run_metadata=md)
                w1 = s.run(tvars)
            _emit(kind=kind, prec=prec, config=name, loss=float(lv),
                  update=[(b - a).ravel().tolist() for a, b in zip(w0, w1)],
                  fused=fused_counts(md.partition_graphs))


# ---------------------------------------------------------------- Keras fit (TF2)
def keras_fit():
    from tensorflow.python.eager import context

    K = _keras2()
    rng = np.random.RandomState(0)
    x = rng.uniform(-1, 1, [2, 12, 12, 3]).astype(np.float32)
    y = np.array([1, 3])
    tf.random.set_seed(1)
    model = _keras_model(K)
    w0 = [w.copy() for w in model.get_weights()]
    for prec in ("fp32", "bf16"):
        for name in ("peer", "ours", "unfused"):
            npu_amp_tf.disable()
            tf.config.optimizer.set_experimental_options(
                {"auto_mixed_precision_onednn_bfloat16": prec == "bf16" and name == "peer"})
            if name != "peer":
                npu_amp_tf.enable(precision_mode=MODES[prec], graph_level=2 if name == "ours" else 1)
            model.set_weights(w0)
            model.compile(optimizer=K.optimizers.SGD(0.05, momentum=0.9),
                          loss=K.losses.SparseCategoricalCrossentropy(from_logits=True))
            ctx = context.context()
            ctx.enable_run_metadata()
            try:
                model.train_on_batch(x, y)
                md = ctx.export_run_metadata()
            finally:
                ctx.disable_run_metadata()
            graphs = []  # the training function: the graphs that hold the batch-norm gradient
            for fg in md.function_graphs:
                for pg in fg.partition_graphs or [fg.post_optimization_graph]:
                    if any(n.op.endswith("FusedBatchNormGradV3") or n.op == "BatchNormGradNHWC"  # (18f's form)
                           for n in pg.node):
                        graphs.append(pg)
            trained = model.get_weights()
            upd = [(b - a).ravel().tolist() for a, b in zip(w0, trained)]
            model.set_weights(w0)
            lv = float(model.evaluate(x, y, verbose=0))  # forward (inference BN: moving stats)
            _emit(kind="keras_fit", prec=prec, config=name, loss=lv, update=upd, fused=fused_counts(graphs))
    npu_amp_tf.disable()
    tf.config.optimizer.set_experimental_options({"auto_mixed_precision_onednn_bfloat16": False})


# ---------------------------------------------------------------- offline report
def offline():
    from graph_passes.fusion.builtin import onednn_enabled

    for kind, build in (("slim", build_slim), ("keras_tf1", build_keras_tf1)):
        g = tf.Graph()
        with g.as_default():
            _, loss, train = build()
        gd, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=[loss.op.name, train.name],
                                           precision_mode="allow_mix_precision_bf16", graph_level=2)
        st = rep.pass_stats("fusion")
        rules = ("bias_add_act", "bn_act")
        # (per anchor, or once for a rule off in this run: fusion stats' rules_off)
        reasons = sorted({d.get("fusion_reason", "") for d in rep.decisions.values()
                          if d.get("fusion_skipped") in rules}
                         | {v["reason"] for k, v in st.get("rules_off", {}).items() if k in rules})
        _emit(kind=kind, config="offline", onednn=onednn_enabled(), fused=st.get("fused", {}),
              skipped=st.get("skipped", {}), reasons=reasons,
              ops=dict(Counter(n.op for n in gd.node if "Fused" in n.op)))


def main():
    kind = sys.argv[1]
    if kind == "slim":
        session_kind("slim", build_slim)
    elif kind == "keras_tf1":
        session_kind("keras_tf1", build_keras_tf1)
    elif kind == "keras_fit":
        keras_fit()
    elif kind == "offline":
        offline()
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
