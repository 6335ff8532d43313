"""Subprocess worker for tests/test_fusion_ln_training.py: LayerNorm/RMSNorm
training graphs run through the grappler plugin (the session path and
``enable()`` + Keras ``fit``), one case after the other in ONE process.

Each case prints ``CASE <name>`` (flushed) before it starts and
``RESULT {json}`` when it ends, so an abort inside TF names the case.

Session cases ``<form>:<mode>:<level>``; forms (tiny shapes, x [2, 6, 16]):

* ``keras``:   Keras 2 LayerNormalization (tf.keras on TF 2.15, tf_keras on TF >= 2.16)
* ``moments``: tf.nn.moments + tf.nn.batch_normalization (BERT)
* ``raw``:     (x - mean) * rsqrt(var + eps) * gamma + beta, mean/var by reduce_mean
* ``div``:     gamma * (x - mean) / sqrt(reduce_variance + eps) + beta
* ``rms``:     T5 RMSNorm x * rsqrt(mean(x^2) + eps) * gamma
* ``llama``:   x / sqrt(mean(x ** 2) + eps) * w
* ``bert``:    benchmarks/fusion.py's BERT-like encoder (2 layers, tiny), variables + SGD

each followed by a residual add and a weighted sum-of-squares loss;
``tf.gradients`` w.r.t. x and the variables, one SGD step.  ``mode`` ``plain``
is TF without the plugin; others are ``session_config(precision_mode=mode,
graph_level=level)``.  Returned: the executed graph's op counts (partition
graphs), the dtypes of the executed LayerNorm/RMSNorm ops, the gradients and
the weights after the step.

``fit:<mode>:<level>``: Keras Dense -> LayerNormalization -> Dense, ``fit`` one
batch under ``enable()`` (``plain``: ``disable()``), the executed function
graphs' op counts and the weights after the step; ``fitmha``: a post-LN
transformer block (MultiHeadAttention, GELU FFN, two LayerNormalization).
"""
import json
import os
import sys
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

B, S, D = 2, 6, 16
COUNT_OPS = ("LayerNorm", "LayerNormGrad", "RMSNorm", "RMSNormGrad", "Mean", "Rsqrt", "RsqrtGrad",
             "SquaredDifference", "FusedBatchNormV3", "FusedBatchNormGradV3", "_MklNativeFusedBatchNormV3",
             "_MklNativeFusedBatchNormGradV3", "_MklFusedBatchNormV3", "_MklFusedBatchNormGradV3", "Tile",
             "Square", "Cast")


def _keras(form):
    """Keras 2 (TF1 graphs with tf.compat.v1 optimizers need it): tf.keras on
    TF 2.15, the tf_keras package on TF >= 2.16 (Keras 3 trains through
    ``fit``, the ``fit`` case)."""
    import tensorflow as tf
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 16):
        import tf_keras
        return tf_keras
    return tf.keras


def _norm(form, h, rng):
    import tensorflow as tf
    tf1 = tf.compat.v1
    if form == "keras":
        layer = _keras(form).layers.LayerNormalization(name="ln", epsilon=1e-3)
        y = layer(h)
        return y, [layer.gamma, layer.beta]
    gamma = tf1.get_variable("gamma", initializer=rng.uniform(0.5, 1.5, D).astype(np.float32))
    beta = tf1.get_variable("beta", initializer=rng.standard_normal(D).astype(np.float32))
    if form == "moments":
        mean, var = tf.nn.moments(h, [-1], keepdims=True)
        return tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-12), [gamma, beta]
    if form == "raw":
        mean = tf.reduce_mean(h, -1, keepdims=True)
        var = tf.reduce_mean(tf.square(h - mean), -1, keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + 1e-6) * gamma + beta, [gamma, beta]
    if form == "div":  # gamma * (x - mean) / sqrt(var + eps) + beta, variance by reduce_variance
        mean = tf.reduce_mean(h, -1, keepdims=True)
        return gamma * (h - mean) / tf.sqrt(tf.math.reduce_variance(h, -1, keepdims=True) + 1e-5) + beta, \
            [gamma, beta]
    if form == "rms":  # T5
        return h * tf.math.rsqrt(tf.reduce_mean(tf.square(h), -1, keepdims=True) + 1e-6) * gamma, [gamma]
    if form == "llama":  # x / sqrt(mean(x^2) + eps) * w
        return h / tf.sqrt(tf.reduce_mean(tf.pow(h, 2.0), -1, keepdims=True) + 1e-6) * gamma, [gamma]
    raise SystemExit(f"unknown form {form}")


def _build(form):
    """(graph, feeds, grads {name: tensor}, weights [tensor], train op)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    rng = np.random.default_rng(7)
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        if form == "bert":
            import fusion as bench
            gd, feeds, _ = bench.bert_graph(2, batch=2, seq=8, hidden=32, heads=4, ffn=64, train=True)
            tf.graph_util.import_graph_def(gd, name="")
            loss = g.get_tensor_by_name("loss:0")
            x = g.get_tensor_by_name("input:0")
            var_ops = [op for op in g.get_operations() if op.type == "VarHandleOp"]
            reads = {op.name: g.get_tensor_by_name(op.name + "/Read/ReadVariableOp:0")
                     if (op.name + "/Read/ReadVariableOp") in [o.name for o in g.get_operations()] else None
                     for op in var_ops}
            # gradients of the (already built) train graph: read them from the optimizer's inputs
            apply = [op for op in g.get_operations() if op.type == "ResourceApplyGradientDescent"]
            grads = {op.inputs[0].op.name: op.inputs[2] for op in apply}
            # (no second tf.gradients call: a second backward pass reads the norms' inner
            # tensors too, and one LayerNormGrad cannot serve two incoming gradients)
            weights = {k: v for k, v in reads.items() if v is not None}
            return g, {k: v for k, v in feeds.items()}, grads, weights, g.get_operation_by_name("train"), loss
        x = tf1.placeholder(tf.float32, [B, S, D], name="x")
        w = tf1.get_variable("w", initializer=(rng.standard_normal((D, D)) * 0.4).astype(np.float32))
        bias = tf1.get_variable("b", initializer=(rng.standard_normal(D) * 0.1).astype(np.float32))
        h = tf.reshape(tf.matmul(tf.reshape(x, [-1, D]), w) + bias, [B, S, D])
        y, params = _norm(form, h, rng)
        # y read by a matmul and an add (a transformer's next sublayer and residual);
        # h read by the norm and the add: its gradient sums the norm's dx with another
        # term.  (y read by ONE add only would be merged by grappler's AddOpsRewrite
        # with that add before the plugin runs: the norm pattern is gone then.)
        w2 = tf1.get_variable("w2", initializer=(rng.standard_normal((D, D)) * 0.3).astype(np.float32))
        out = tf.reshape(tf.matmul(tf.reshape(y, [-1, D]), w2), [B, S, D]) + y + h
        c = tf.constant(np.linspace(-1.0, 2.0, D).astype(np.float32))
        loss = tf.reduce_sum(tf.square(out) * c, name="loss")
        variables = [w, bias, w2] + params
        grads = tf.gradients(loss, [x] + variables)
        train = tf1.train.GradientDescentOptimizer(0.05).apply_gradients(
            list(zip(grads[1:], variables)), name="train")
        names = ["x", "w", "b", "w2", "gamma", "beta"][:len(grads)]
        feeds = {x: rng.standard_normal((B, S, D)).astype(np.float32)}
        weights = {n: v.read_value() if hasattr(v, "read_value") else v for n, v in zip(names[1:], variables)}
        return g, feeds, dict(zip(names, grads)), weights, train, loss


def _mixlist(mode):
    """``<mode>+lngray``: a CANN mixlist that takes the fused norms off the black
    list (gray: they follow their producers' dtype, e.g. FP16 I/O after FP16 matmuls);
    ``<mode>+lnblack``: one that puts them on it as the user's own entries (FP32 I/O
    in BF16 mode too: the behaviour before they joined ``BF16_GRAY``)."""
    ops = ["LayerNorm", "LayerNormGrad", "RMSNorm", "RMSNormGrad"]
    if mode.endswith("+lngray"):
        body = {"black-list": {"to-remove": ops}}
    elif mode.endswith("+lnblack"):
        body = {"black-list": {"to-add": ops}}
    else:
        return {}
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "mixlist.json")
    with open(path, "w") as fh:
        json.dump(body, fh)
    return {"modify_mixlist": path}


def _session_case(form, mode, level):
    import tensorflow as tf
    tf1 = tf.compat.v1
    import npu_amp_tf
    from tensorflow.core.protobuf import rewriter_config_pb2

    g, feeds, grads, weights, train, loss = _build(form)
    if mode == "plain":
        cfg = tf1.ConfigProto()
        cfg.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF
    else:
        cfg = npu_amp_tf.session_config(precision_mode=mode.split("+")[0], graph_level=level,
                                        **_mixlist(mode))
    with g.as_default():
        init = g.get_operation_by_name("init") if form == "bert" else tf1.global_variables_initializer()
    gnames = sorted(grads)
    with tf1.Session(graph=g, config=cfg) as s:
        s.run(init)
        md = tf1.RunMetadata()
        vals = s.run([grads[k] for k in gnames] + [loss], feeds,
                     options=tf1.RunOptions(output_partition_graphs=True,
                                            trace_level=tf1.RunOptions.FULL_TRACE), run_metadata=md)
        s.run(train, feeds)
        after = s.run({k: v for k, v in weights.items()})
    counts = Counter(n.op for pg in md.partition_graphs for n in pg.node)
    # elements converted by the executed Casts (their output shapes from the step's trace)
    casts = {n.name for pg in md.partition_graphs for n in pg.node if n.op == "Cast"}
    cast_sizes = [int(np.prod([d.size for d in ns.output[0].tensor_description.shape.dim]))
                  for ds in md.step_stats.dev_stats for ns in ds.node_stats
                  if ns.node_name in casts and ns.output]
    from tensorflow.core.framework import types_pb2
    dts = sorted({types_pb2.DataType.Name(n.attr["T"].type) for pg in md.partition_graphs for n in pg.node
                  if n.op in ("LayerNorm", "LayerNormGrad", "RMSNorm", "RMSNormGrad")})
    return {"counts": {k: counts.get(k, 0) for k in COUNT_OPS}, "norm_dtypes": dts,
            "cast_sizes": sorted(cast_sizes),
            "grads": {k: np.asarray(v, np.float64).tolist() for k, v in zip(gnames, vals[:-1])},
            "loss": float(vals[-1]),
            "after": {k: np.asarray(v, np.float64).tolist() for k, v in after.items()}}


def _fit_case(mode, level, mha=False):
    import tensorflow as tf
    from tensorflow.python.eager import context

    import npu_amp_tf

    K = tf.keras
    tf.random.set_seed(0)
    rng = np.random.default_rng(5)
    if mha:  # a post-LN transformer block: LN(x + attention(x)), LN(h + FFN(h))
        inp = K.Input((S, D))
        h = K.layers.LayerNormalization()(inp + K.layers.MultiHeadAttention(4, 4)(inp, inp))
        f = K.layers.Dense(D)(K.layers.Dense(2 * D, activation="gelu")(h))
        model = K.Model(inp, K.layers.Dense(D)(K.layers.LayerNormalization()(h + f)))
    else:
        model = K.Sequential([K.layers.Input((S, D)), K.layers.Dense(D), K.layers.LayerNormalization(),
                              K.layers.Dense(D)])
    rng_w = np.random.default_rng(11)
    model.set_weights([rng_w.standard_normal(w.shape).astype(np.float32) * 0.3
                       + (1.0 if "gamma" in v.name else 0.0) for w, v in zip(model.get_weights(), model.weights)])
    model.compile(optimizer=K.optimizers.SGD(0.1), loss="mse")
    x = rng.standard_normal((B, S, D)).astype(np.float32)
    y = rng.standard_normal((B, S, D)).astype(np.float32)
    w0 = model.get_weights()
    if mode == "plain":
        npu_amp_tf.disable()
    else:
        npu_amp_tf.enable(precision_mode=mode.split("+")[0], graph_level=level, **_mixlist(mode))
    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        md = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
        npu_amp_tf.disable()
    counts = Counter()
    for fg in md.function_graphs:
        for pg in (fg.partition_graphs or [fg.post_optimization_graph]):
            counts.update(n.op for n in pg.node)
    w1 = model.get_weights()
    return {"counts": {k: counts.get(k, 0) for k in COUNT_OPS},
            "delta": [np.asarray(a - b, np.float64).tolist() for a, b in zip(w1, w0)]}


def main():
    for case in sys.argv[1].split(","):
        print("CASE", case, flush=True)
        form, mode, level = case.split(":")
        if form in ("fit", "fitmha"):
            res = _fit_case(mode, int(level), mha=form == "fitmha")
        else:
            res = _session_case(form, mode, int(level))
        res["case"] = case
        print("RESULT", json.dumps(res), flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
