"""Subprocess worker for tests/test_fusion_bias_grad.py (BF16 kernels may abort TF, so
every run happens here, never in the pytest process).

``python _bias_grad_worker.py run`` / ``run_norule``: trains a small TF-Slim net (three
``slim.conv2d`` with bias and Relu on [8, 8, 8, 16]: a 3x3 and a 1x1 with 512 gradient rows
each (rewritten), a 1x1 stride 2 with 128 rows (below the measured 256: left alone); then a
``slim.fully_connected`` with bias, 8 rows: left alone) one SGD step (learning rate 1: the
update is minus the gradient) from the same weights under

* ``fp32``  plain TF (grappler's defaults);
* ``ours``  npu_amp_tf ``allow_mix_precision_bf16`` at graph_level 2;

and prints one ``RESULT {json}`` line per run: each weight's update, the op types (with
dtype) of the nodes TF executed (partition graphs), and for ``ours`` the bias gradients
fetched with the output gradients they sum (``dy``, rounded to BF16), from a run of their own
before the training step.  ``run_norule`` does the same with
the ``bias_grad_matmul`` rule removed from the registry (the reference: the same graph but
for the bias gradients).  ``offline`` rewrites the graph offline in BF16 and FP32 modes and
prints the rule's counts and skip reasons; ``keras`` does that for Keras (tf_keras on TF >=
2.16) ResNet50 at 64x64, batch 8, in a TF1 graph, with the BiasAddGrad row counts of the
original graph.
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

import npu_amp_tf  # noqa: E402
from _worker_util import executed_ops as _ops, run_from  # noqa: E402

tf1 = tf.compat.v1
RULE = "bias_grad_matmul"
#: the biases whose gradient the rule rewrites (512 rows) and those it leaves (128, 8 rows)
MATCHED = ("Conv/biases", "Conv_1/biases")
LEFT = ("Conv_2/biases", "fully_connected/biases")


def build():
    from real_models import import_slim

    import_slim()
    import tf_slim as slim

    tf1.set_random_seed(1)
    x = tf1.placeholder(tf.float32, [8, 8, 8, 16], name="x")
    y = tf1.placeholder(tf.int32, [8], name="y")
    binit = tf1.random_uniform_initializer(-0.1, 0.1)
    h = slim.conv2d(x, 16, 3, biases_initializer=binit)
    h = slim.conv2d(h, 32, 1, biases_initializer=binit)
    h = slim.conv2d(h, 24, 1, stride=2, biases_initializer=binit)  # 8x8 -> 4x4
    logits = slim.fully_connected(tf.reduce_mean(h, [1, 2]), 5, activation_fn=None, biases_initializer=binit)
    loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    opt = tf1.train.GradientDescentOptimizer(1.0)
    gv = opt.compute_gradients(loss)
    train = opt.apply_gradients(gv)
    rng = np.random.RandomState(0)
    feeds = {x: rng.uniform(-1, 1, [8, 8, 8, 16]).astype(np.float32), y: np.arange(8) % 5}
    grads = {v.op.name: g for g, v in gv}
    return feeds, loss, train, grads


def _bias_dy(grad):
    """The BiasAddGrad's input (the output gradient it sums), through Identity nodes."""
    op = grad.op
    while op.type == "Identity":
        op = op.inputs[0].op
    assert op.type == "BiasAddGrad", op.type
    return op.inputs[0]


def _configs():
    mode = "allow_mix_precision_bf16"
    return {"fp32": tf1.ConfigProto(),
            "ours": npu_amp_tf.session_config(precision_mode=mode, graph_level=2, fail_on_error=True)}


def _emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def run(norule=False):
    if norule:
        from graph_passes.fusion import RULES  # importing the package registers the built-in rules

        del RULES[RULE]
    start = None
    for name, cfg in _configs().items():
        g = tf.Graph()
        with g.as_default():
            feeds, loss, train, grads = build()
            tvars = {v.op.name: v for v in tf1.trainable_variables()}
            init = tf1.global_variables_initializer()
            extra = {}
            if name == "ours":
                for k in MATCHED + LEFT:
                    extra[k] = grads[k]
                    extra[k + ":dy"] = _bias_dy(grads[k])
        with tf1.Session(graph=g, config=cfg) as s:
            s.run(init)
            if start is None:
                start = {k: s.run(v) for k, v in tvars.items()}
            for k, v in tvars.items():
                v.load(start[k], s)
            # the gradients and the output gradients they sum, fetched in a run of their own
            # (a fetched tensor keeps its FP32 dtype, which would change the training graph)
            fetched = s.run(extra, feeds) if extra else {}
            md = tf1.RunMetadata()
            s.run(train, feeds, options=tf1.RunOptions(output_partition_graphs=True), run_metadata=md)
            upd = {k: (s.run(v) - start[k]).ravel().tolist() for k, v in tvars.items()}
        # dy is fetched in FP32; the rewritten gradient sums its BF16 rounding
        fetched = {k: (tf.cast(tf.cast(v, tf.bfloat16), tf.float64).numpy() if k.endswith(":dy")
                       else np.asarray(v, np.float64)).tolist() for k, v in fetched.items()}
        _emit(config=name, update=upd, ops=_ops(md), fetched=fetched, norule=norule)


def _offline(gd, fetches, modes=("allow_mix_precision_bf16", "must_keep_origin_dtype")):
    out = {}
    for mode in modes:
        rgd, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode=mode, graph_level=2)
        st = rep.pass_stats("fusion")
        reasons = sorted({d.get("fusion_reason", "") for d in rep.decisions.values()
                          if d.get("fusion_skipped") == RULE})
        again, rep2 = npu_amp_tf.rewrite_graph(rgd, fetches=fetches, precision_mode=mode, graph_level=2)
        fused2 = rep2.pass_stats("fusion").get("fused", {})
        out[mode + ":again"] = {"ops": dict(Counter(n.op for n in again.node)),
                                "fused": {k: fused2.get(k, 0) for k in
                                          ("bias_grad_bn_zero", "bias_grad_matmul", "strided_subsample")}}
        out[mode] = {"fused": st.get("fused", {}).get(RULE, 0), "reasons": reasons,
                     "off": {k: v for k, v in st.get("rules_off", {}).items()
                             if k in ("bias_grad_bn_zero", "bias_grad_matmul")},
                     "fused_zero": st.get("fused", {}).get("bias_grad_bn_zero", 0),
                     "ops": dict(Counter(n.op for n in rgd.node)),
                     "matmul_dtypes": dict(Counter(str(n.attr["T"].type) for n in rgd.node
                                                   if n.op == "MatMul" and "/BiasAddGrad" in n.name))}
    return out


def offline():
    from graph_passes.fusion.builtin import onednn_enabled

    g = tf.Graph()
    with g.as_default():
        _, loss, train, _ = build()
    res = _offline(g.as_graph_def(), [loss.op.name, train.name],
                   ("allow_mix_precision_bf16", "must_keep_origin_dtype", "allow_mix_precision"))
    _emit(config="offline", onednn=onednn_enabled(), modes=res)


def keras():
    from graph_passes.fusion.builtin import onednn_enabled

    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 16):
        import tf_keras as K
    else:
        K = tf.keras
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [8, 64, 64, 3], name="images")
        y = tf1.placeholder(tf.int32, [8], name="labels")
        K.backend.set_learning_phase(1)
        model = K.applications.ResNet50(weights=None, input_tensor=x, classes=10)
        loss = tf.reduce_mean(K.losses.sparse_categorical_crossentropy(y, model.output))
        train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, var_list=model.trainable_weights)
        rows = []
        for op in g.get_operations():
            if op.type == "BiasAddGrad":
                shp = op.inputs[0].shape.as_list()
                rows.append(int(np.prod(shp[:-1])))
    res = _offline(g.as_graph_def(), [loss.op.name, train.name])
    _emit(config="keras", onednn=onednn_enabled(), modes=res, rows=rows)


def build_bn():
    """tf_keras (Keras 2) Conv2D(bias) -> BatchNormalization -> ReLU, twice, then Dense, in a TF1
    graph in training mode (FusedBatchNormV3 is_training=True), plain SGD (learning rate 1)."""
    K = _keras2()
    tf1.set_random_seed(1)
    K.backend.set_learning_phase(1)
    x = tf1.placeholder(tf.float32, [8, 8, 8, 16], name="x")
    y = tf1.placeholder(tf.int32, [8], name="y")
    h = x
    for i in range(2):
        h = K.layers.Conv2D(16, 3, padding="same", name=f"conv{i}",
                            bias_initializer=K.initializers.RandomUniform(-0.1, 0.1))(h)
        h = K.layers.BatchNormalization(name=f"bn{i}")(h)
        h = K.layers.ReLU()(h)
    logits = K.layers.Dense(5, name="dense")(tf.reduce_mean(h, [1, 2]))
    loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    train = tf1.train.GradientDescentOptimizer(1.0).minimize(loss)
    rng = np.random.RandomState(0)
    feeds = {x: rng.uniform(-1, 1, [8, 8, 8, 16]).astype(np.float32), y: np.arange(8) % 5}
    return feeds, loss, train


def _keras2():
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 16):
        import tf_keras
        return tf_keras
    return tf.keras


def run_bn():
    """fp32 / ours / ours without the two bias-gradient rules (``norule``) on ``build_bn``."""
    from graph_passes.fusion import RULES

    mode = "allow_mix_precision_bf16"
    cfgs = {"fp32": tf1.ConfigProto(),
            "ours": npu_amp_tf.session_config(precision_mode=mode, graph_level=2, fail_on_error=True),
            "norule": npu_amp_tf.session_config(precision_mode=mode, graph_level=2, fail_on_error=True,
                                                keep_dtype_nodes=["__no_such_node__"])}
    start = None
    for name, cfg in cfgs.items():
        g = tf.Graph()
        with g.as_default():
            feeds, loss, train = build_bn()
            tvars = {v.op.name: v for v in tf1.trainable_variables()}
            init = tf1.global_variables_initializer()
        saved = {k: RULES.pop(k) for k in ("bias_grad_bn_zero", "bias_grad_matmul")} if name == "norule" else {}
        try:
            with tf1.Session(graph=g, config=cfg) as s:
                s.run(init)
                start, _, md, after = run_from(s, tvars, start, train, feeds)
                upd = {k: (after[k] - start[k]).ravel().tolist() for k in tvars}
        finally:
            RULES.update(saved)
        _emit(config=name, update=upd, ops=_ops(md))


def subsample():
    """``strided_subsample``: x[:, ::2, ::2, :], x[:, ::2, :, :] and x[:, :, ::3, :] (rewritten), x on
    odd 7x7 and x[:, 1::2, 1::2, :] (left alone), rewritten offline in BF16 and FP32 modes and
    run (graph imported into a fresh graph, so TF checks every OpDef): values and op counts."""
    for mode in ("allow_mix_precision_bf16", "must_keep_origin_dtype"):
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 8, 6, 5], name="x")
            xo = tf1.placeholder(tf.float32, [3, 7, 7, 5], name="xo")
            # each read by a MatMul, so that the BF16 mode runs them in BF16
            w = tf.constant(np.linspace(-1, 1, 25).reshape(5, 5).astype(np.float32))
            outs = {"s22": x[:, ::2, ::2, :], "s21": x[:, ::2, :, :], "s13": x[:, :, ::3, :],
                    "odd": xo[:, ::2, ::2, :], "offset": x[:, 1::2, 1::2, :]}
            fetch = {k: tf.identity(tf.reshape(tf.matmul(tf.reshape(v, [-1, 5]), w), tf.shape(v)), name="out_" + k)
                     for k, v in outs.items()}
        gd, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=[t.op.name for t in fetch.values()],
                                           precision_mode=mode, graph_level=2)
        st = rep.pass_stats("fusion")
        reasons = sorted({d.get("fusion_reason", "") for d in rep.decisions.values()
                          if d.get("fusion_skipped") == "strided_subsample"})
        g2 = tf.Graph()
        with g2.as_default():
            tf.graph_util.import_graph_def(gd, name="")
        rng = np.random.RandomState(0)
        fx, fxo = rng.uniform(-1, 1, [4, 8, 6, 5]).astype(np.float32), rng.uniform(-1, 1, [3, 7, 7, 5]).astype(np.float32)
        with tf1.Session(graph=g2) as s:
            got = s.run({k: "out_%s:0" % k for k in outs}, {"x:0": fx, "xo:0": fxo})
        with tf1.Session(graph=g) as s:
            ref = s.run(fetch, {x: fx, xo: fxo})
        ops = Counter(f"{n.op}:{tf.dtypes.as_dtype(n.attr['T'].type).name if 'T' in n.attr else ''}"
                      for n in gd.node)
        _emit(config="subsample", mode=mode, fused=st.get("fused", {}).get("strided_subsample", 0),
              reasons=reasons, ops=dict(ops),
              shapes={k: list(np.shape(v)) for k, v in got.items()},
              ref_shapes={k: list(np.shape(v)) for k, v in ref.items()},
              err={k: float(np.max(np.abs(np.asarray(got[k], np.float64) - ref[k])) / max(np.max(np.abs(ref[k])), 1e-30))
                   for k in outs})


if __name__ == "__main__":
    kind = sys.argv[1]
    {"run": run, "run_norule": lambda: run(norule=True), "offline": offline, "keras": keras, "run_bn": run_bn,
     "subsample": subsample}[kind]()
    print("DONE", flush=True)
