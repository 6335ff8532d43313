"""Subprocess worker for tests/test_fusion_attention_training.py: attention
training graphs as real code writes them, rewritten at graph_level 3 and run one
step next to the unfused graph (FP32, FP16, BF16 kernels may abort a process,
hence the worker).

Each case prints ``CASE <name>`` (flushed) before it starts and ``RESULT {json}``
when it ends; ``DONE`` at the end.  A result holds the op counts of the rewritten
graph, the fusion report's decisions on the softmax, and per trained weight the
size of its one-step update (``scale``, max |w1 - w0| of the unfused graph) and the
max abs difference of the updates: fused vs unfused (``err``), and, for FP16/BF16,
each against the same graph built in FP32 (``err_fused32``, ``err_unfused32``).

Dropout > 0 is compared deterministically: the dropout stays TF ops after the
fused softmax, under the same names, so its random uniform tensor is *fed* with
the same values to both graphs (TF1 graphs), or the frozen Keras 3 seed makes the
mask a constant function of the inputs (TF2 graphs).
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from _fusion_util import op_counts, rewrite, run_gd as _run  # noqa: E402

tf1 = tf.compat.v1
DT = {"fp32": tf.float32, "fp16": tf.float16, "bf16": tf.bfloat16}
B, S, E, H = 2, 6, 8, 2
D = E // H


def _keras_major():
    try:
        import keras
        return int(keras.__version__.split(".")[0])
    except Exception:  # noqa: BLE001
        return 2


def _weights(seed=5):
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal((E, E)) / np.sqrt(E)).astype(np.float32) for n in ("wq", "wk", "wv", "wo")}


def hand_written(dtype="fp32", rate=0.1, form="bert", mask_var=False, fetch_probs=False, batch=B):
    """BERT-style block in TF1 ops: Dense on 3-D by tensordot, heads by
    reshape/transpose, scores = q.k^T (BatchMatMulV2) scaled by 1/sqrt(d), additive
    mask, softmax, tf.nn.dropout, probs.v, output projection; SGD one step.
    ``form="einsum"``: the Keras 3 / hand-written einsum form (einsum products,
    scale by division, boolean mask through tf.where, TF1 ``dropout(keep_prob=)``).  Variables FP32, compute in
    ``dtype`` (Casts), as mixed-precision code does."""
    dt = DT[dtype]
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch, S, E], name="x")
        w = {n: tf1.get_variable(n, initializer=v) for n, v in _weights().items()}
        xc = tf.cast(x, dt)
        wc = {n: tf.cast(v, dt) for n, v in w.items()}

        def heads(t):
            return tf.transpose(tf.reshape(t, [-1, S, H, D]), [0, 2, 1, 3])
        q, k, v = (heads(tf.tensordot(xc, wc[n], 1)) for n in ("wq", "wk", "wv"))
        if form == "t5":  # T5: no scale, learned relative-position bias [1, H, S, S] + mask
            m = tf1.placeholder(tf.float32, [batch, 1, 1, S], name="m")
            bias = np.random.default_rng(8).standard_normal((1, H, S, S)).astype(np.float32)
            pos = tf.cast(tf1.get_variable("pos_bias", initializer=bias), dt) + tf.cast(m, dt)
            s = tf.matmul(q, k, transpose_b=True)
            s += pos
        elif form == "bert":
            m = tf1.placeholder(tf.float32, [batch, 1, 1, S], name="m")
            mc = tf.cast(m, dt)
            if mask_var == "scale":  # a mask that needs a gradient, of no use (m is 0 or -1e4)
                mc = mc * tf.cast(tf1.get_variable("mscale", initializer=np.float32(1.0)), dt)
            elif mask_var == "full":  # a learned mask of the scores' own shape, with a scale
                full = np.random.default_rng(9).standard_normal((batch, H, S, S)).astype(np.float32)
                mc = mc + tf.cast(tf1.get_variable("fullmask", initializer=full), dt)
            elif mask_var == "bias":  # a learned bias on the keys, broadcast over batch, heads, queries
                bias = np.random.default_rng(9).standard_normal((1, 1, 1, S)).astype(np.float32)
                mc = mc + tf.cast(tf1.get_variable("kbias", initializer=bias), dt)
            s = tf.matmul(q, k, transpose_b=True)
            s = tf.multiply(s, 1.0 / np.sqrt(float(D)))
            s = s + mc
        else:
            mb = tf1.placeholder(tf.bool, [batch, 1, S, S], name="mb")
            s = tf.einsum("bhqd,bhkd->bhqk", q, k) / np.float32(np.sqrt(D))
            s = tf.where(mb, s, tf.cast(-1e4, dt))
        p = tf.nn.softmax(s, name="probs")
        if rate and form == "einsum":  # the TF1 spelling (keep_prob), as BERT's own code writes it
            p = tf1.nn.dropout(p, keep_prob=1.0 - rate, seed=1)
        elif rate:
            p = tf.nn.dropout(p, rate=rate, seed=1)
        o = tf.einsum("bhqk,bhkd->bhqd", p, v) if form == "einsum" else tf.matmul(p, v)
        o = tf.reshape(tf.transpose(o, [0, 2, 1, 3]), [-1, S, E])
        y = tf.tensordot(o, wc["wo"], 1)
        loss = tf.reduce_mean(tf.square(tf.cast(y, tf.float32) - 0.5), name="loss")
        tf1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def keras_mha_tf1(dtype="fp32", rate=0.1):
    """tf.keras.layers.MultiHeadAttention (Keras 2) in a TF1 graph, SGD one step."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [B, S, E], name="x")
        mb = tf1.placeholder(tf.bool, [B, S, S], name="mb")
        mha = tf.keras.layers.MultiHeadAttention(
            num_heads=H, key_dim=D, dropout=rate, name="mha",
            kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))
        y = mha(x, x, attention_mask=mb, training=True)
        loss = tf.reduce_mean(tf.square(y - 0.5), name="loss")
        tf1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def _feeds(gd, rng, batch=B):
    batch = batch or B
    names = {n.name: n for n in gd.node}
    f = {"x": rng.standard_normal((batch, S, E)).astype(np.float32)}
    if "m" in names:
        f["m"] = np.where(rng.random((batch, 1, 1, S)) > 0.3, 0.0, -1e4).astype(np.float32)
    if "mb" in names:
        shape = [d.size for d in names["mb"].attr["shape"].shape.dim]
        f["mb"] = rng.random(shape) > 0.3
    for n in gd.node:  # the dropout's uniform noise: fed, the same in both graphs
        if n.op == "RandomUniform" and "dropout" in n.name:
            f[n.name] = rng.random((batch, H, S, S)).astype(np.float32)
    return f


def _variables(gd):
    names = {n.name: n for n in gd.node}
    out = []
    for n in gd.node:
        if n.op in ("VarHandleOp", "VariableV2"):
            read = n.name + "/Read/ReadVariableOp" if n.op == "VarHandleOp" else n.name + "/read"
            if read in names:
                out.append((n.name, read))
    return out


def _step(gd, feeds):
    """Weights before and after one training step (one Session, meta-optimizer off)."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    cfg = tf1.ConfigProto()
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    reads = [r + ":0" for _, r in _variables(gd)]
    feed = {(k if ":" in k else k + ":0"): v for k, v in feeds.items()}
    with tf1.Session(graph=g, config=cfg) as s:
        s.run("init")
        w0 = s.run(reads)
        s.run("train", feed)
        w1 = s.run(reads)
    return {name: (b - a).astype(np.float64) for (name, _), a, b in zip(_variables(gd), w0, w1)}


def _softmax_decisions(rep):
    return {k: v for k, v in rep.decisions.items() if "fusion" in v or "fusion_skipped" in v}


def _compare(name, make, dtype, fetches=("train", "loss"), batch=B, **kw):
    if batch != B:
        kw["batch"] = batch
    gd = make(dtype=dtype, **kw)
    new, rep = rewrite(gd, list(fetches), level=3)
    feeds = _feeds(gd, np.random.default_rng(7), batch)
    unf, fus = _step(gd, feeds), _step(new, feeds)
    res = {"case": name, "dtype": dtype, "counts": dict(op_counts(new)), "before": dict(op_counts(gd)),
           "decisions": _softmax_decisions(rep), "vars": {}}
    ref = _step(make(dtype="fp32", **kw), feeds) if dtype != "fp32" else None
    for v in unf:
        e = {"scale": float(np.abs(unf[v]).max()), "err": float(np.abs(fus[v] - unf[v]).max())}
        if ref is not None:
            e["err_fused32"] = float(np.abs(fus[v] - ref[v]).max())
            e["err_unfused32"] = float(np.abs(unf[v] - ref[v]).max())
        res["vars"][v] = e
    return res


def keras_tf2(rate=0.1, with_mask=True):
    """The TF2 way: a tf.function train step with GradientTape over
    tf.keras.layers.MultiHeadAttention (Keras 2 on TF 2.15, Keras 3 on 2.21),
    frozen (variables -> constants), returning the gradients.  Keras 3's dropout
    is stateless with a seed from its SeedGenerator, a constant once frozen;
    Keras 2's draws from a stateful RandomUniform op, fed like the TF1 cases."""
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    tf.random.set_seed(0)
    kw = dict(num_heads=H, key_dim=D, dropout=rate, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))
    mha = tf.keras.layers.MultiHeadAttention(seed=11, **kw) if _keras_major() >= 3 else \
        tf.keras.layers.MultiHeadAttention(**kw)
    x0 = np.zeros((B, S, E), np.float32)
    mha(x0, x0)

    def step(x, mb):
        with tf.GradientTape() as tape:
            y = mha(x, x, attention_mask=mb if with_mask else None, training=True)
            loss = tf.reduce_mean(tf.square(y - 0.5))
        grads = tape.gradient(loss, mha.trainable_variables)
        return [tf.identity(gr, name=f"grad_{i}") for i, gr in enumerate(grads)]
    cf = tf.function(step).get_concrete_function(tf.TensorSpec([B, S, E], tf.float32, name="x"),
                                                 tf.TensorSpec([B, S, S], tf.bool, name="mb"))
    frozen = convert_variables_to_constants_v2(cf)
    gd = frozen.graph.as_graph_def()
    outs = [t.name.split(":")[0] for t in frozen.outputs]
    names = [v.name for v in mha.trainable_variables]
    return gd, outs, names




def case_keras_tf2(rate):
    gd, outs, names = keras_tf2(rate)
    inputs = [n.name for n in gd.node if n.op == "Placeholder"]
    new, rep = rewrite(gd, outs, level=3)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((B, S, E)).astype(np.float32), "mb": rng.random((B, S, S)) > 0.3}
    for n in gd.node:
        if n.op == "RandomUniform" and "dropout" in n.name:
            feeds[n.name] = rng.random((B, H, S, S)).astype(np.float32)
    a, b = _run(gd, outs, feeds), _run(new, outs, feeds)
    again = _run(new, outs, feeds)  # the dropout mask is a function of the feeds
    res = {"case": f"keras_tf2_rate{rate}", "dtype": "fp32", "counts": dict(op_counts(new)),
           "before": dict(op_counts(gd)), "decisions": _softmax_decisions(rep), "inputs": inputs,
           "deterministic": all(np.array_equal(p, q) for p, q in zip(b, again)), "vars": {}}
    for name, x, y in zip(names, a, b):
        res["vars"][name] = {"scale": float(np.abs(x).max()), "err": float(np.abs(x - y).max())}
    return res


def case_keras_enable():
    """The TF2 product path: npu_amp_tf.enable(graph_level=3) rewrites the
    tf.function train step through grappler (after grappler's own passes).  Two
    MultiHeadAttention layers with the same weights (and, Keras 3, the same dropout
    seed, so the same masks; Keras 2's unseeded dropout is off here, the frozen case
    covers it): the plain step's gradients against the rewritten one's, and the
    executed graph (run metadata) must hold the fused ops."""
    import npu_amp_tf
    from tensorflow.python.eager import context
    k3 = _keras_major() >= 3
    rate = 0.1 if k3 else 0.0

    def layer():
        kw = dict(num_heads=H, key_dim=D, dropout=rate, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))
        return tf.keras.layers.MultiHeadAttention(seed=11, **kw) if k3 else tf.keras.layers.MultiHeadAttention(**kw)

    rng = np.random.default_rng(4)
    x = tf.constant(rng.standard_normal((B, S, E)).astype(np.float32))
    mb = tf.constant(rng.random((B, S, S)) > 0.3)

    def grads(mha):
        @tf.function(jit_compile=False)
        def step(x, mb):
            with tf.GradientTape() as tape:
                y = mha(x, x, attention_mask=mb, training=True)
                loss = tf.reduce_mean(tf.square(y - 0.5))
            return tape.gradient(loss, mha.trainable_variables)
        return [g.numpy() for g in step(x, mb)], [getattr(v, "path", v.name) for v in mha.trainable_variables]

    plain, names = grads(layer())
    fused_layer = layer()
    from npu_amp_tf import bridge
    bridge.clear_reports()
    npu_amp_tf.enable(graph_level=3, precision_mode="must_keep_origin_dtype")
    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        fused, _ = grads(fused_layer)
        md = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
        npu_amp_tf.disable()
    nodes = [n for fg in md.function_graphs for pg in fg.partition_graphs for n in pg.node]
    counts = {}
    for n in nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    decisions = {}
    for rec in bridge.last_reports():
        for k, v in ((rec.get("report") or {}).get("decisions") or {}).items():
            if "fusion" in v or ("fusion_skipped" in v and "attention" in v["fusion_skipped"]):
                decisions[k] = v
    res = {"case": "keras_enable", "dtype": "fp32", "counts": counts, "rate": rate,
           "before": {"Softmax": 1, "Sub": 1, "Sum": 1}, "decisions": decisions, "vars": {}}
    for name, a, b in zip(names, plain, fused):
        res["vars"][name] = {"scale": float(np.abs(a).max()), "err": float(np.abs(a - b).max())}
    return res


def case_session(mode):
    """The TF1 product path: session_config(graph_level=3, precision_mode=mode)
    runs the grappler bridge on the BERT-style block (after grappler's own
    passes).  The partition graphs TF executed are read back; the updates are
    compared with the same mode at graph_level 2 (unfused attention) and each
    with plain TF FP32."""
    import npu_amp_tf
    gd = hand_written("fp32")
    feeds = _feeds(gd, np.random.default_rng(7))

    def step(cfg):
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(gd, name="")
        reads = [r + ":0" for _, r in _variables(gd)]
        with tf1.Session(graph=g, config=cfg) as s:
            s.run("init")
            w0 = s.run(reads)
            md = tf1.RunMetadata()
            s.run("train", {k + ":0": v for k, v in feeds.items()},
                  options=tf1.RunOptions(output_partition_graphs=True), run_metadata=md)
            w1 = s.run(reads)
        ops = {}
        for pg in md.partition_graphs:
            for n in pg.node:
                ops[n.op] = ops.get(n.op, 0) + 1
        return {name: (b - a).astype(np.float64) for (name, _), a, b in zip(_variables(gd), w0, w1)}, ops

    ref, _ = step(tf1.ConfigProto())
    unf, _ = step(npu_amp_tf.session_config(graph_level=2, precision_mode=mode))
    fus, ops = step(npu_amp_tf.session_config(graph_level=3, precision_mode=mode))
    kind = {"must_keep_origin_dtype": "fp32", "allow_mix_precision": "fp16", "allow_mix_precision_bf16": "bf16"}[mode]
    res = {"case": f"session_{mode}", "dtype": kind, "counts": ops, "decisions": {}, "vars": {}}
    for v in ref:
        e = {"scale": float(np.abs(unf[v]).max()), "err": float(np.abs(fus[v] - unf[v]).max())}
        if kind != "fp32":
            e["err_fused32"] = float(np.abs(fus[v] - ref[v]).max())
            e["err_unfused32"] = float(np.abs(unf[v] - ref[v]).max())
        res["vars"][v] = e
    return res


CASES = {
    "bert_fp32": lambda: _compare("bert", hand_written, "fp32"),
    "bert_fp16": lambda: _compare("bert", hand_written, "fp16"),
    "bert_bf16": lambda: _compare("bert", hand_written, "bf16"),
    "einsum_fp32": lambda: _compare("einsum", hand_written, "fp32", form="einsum"),
    "einsum_bf16": lambda: _compare("einsum", hand_written, "bf16", form="einsum"),
    "mask_full_fp32": lambda: _compare("mask_full", hand_written, "fp32", mask_var="full"),
    "mask_grad": lambda: _compare("mask_grad", hand_written, "fp32", mask_var="scale", batch=None),
    "mask_bias_fp32": lambda: _compare("mask_bias", hand_written, "fp32", mask_var="bias"),
    "t5_fp32": lambda: _compare("t5", hand_written, "fp32", form="t5"),
    "t5_bf16": lambda: _compare("t5", hand_written, "bf16", form="t5"),
    "probs_fetched": lambda: _compare("probs_fetched", hand_written, "fp32", fetches=("train", "loss", "probs")),
    "dynamic_batch": lambda: _compare("dynamic_batch", hand_written, "fp32", batch=None),
    "keras_tf1": lambda: _compare("keras_tf1", keras_mha_tf1, "fp32") if _keras_major() < 3 else
    {"case": "keras_tf1", "skipped": f"Keras {_keras_major()}: no TF1-graph Keras layers"},
    "keras_tf2": lambda: case_keras_tf2(0.1) if _keras_major() < 3 else
    {"case": "keras_tf2", "skipped": "Keras 3's dropout seed state is a variable the function updates: "
                                     "not freezable (keras_enable covers Keras 3)"},
    "keras_enable": case_keras_enable,
    "session_fp32": lambda: case_session("must_keep_origin_dtype"),
    "session_fp16": lambda: case_session("allow_mix_precision"),
    "session_bf16": lambda: case_session("allow_mix_precision_bf16"),
}


def main(names):
    for name in names or list(CASES):
        print("CASE", name, flush=True)
        res = CASES[name]()
        res["name"] = name
        print("RESULT", json.dumps(res), flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
