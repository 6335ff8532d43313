"""Subprocess worker for tests/test_fusion_bf16_transformer.py (custom kernels and BF16 training
graphs may abort TF, so every run happens here, never in the pytest process).

Kinds (each prints ``RESULT {json}`` lines, then ``DONE``):

* ``kernels``: ``GeluErf`` / ``GeluErfGrad`` (custom_ops/gelu.cc), ``ScaleMaskSoftmax`` /
  ``ScaleMaskSoftmaxGrad`` and ``LayerNorm`` / ``LayerNormGrad`` (BF16 rows) on BF16 data of tiny shapes (tails of 1-15 elements),
  with a float64 reference computed here with NumPy / math.erf from the same BF16 inputs; TF's
  own BF16 op chain (the GELU as tf.nn.gelu writes it, and its autodiff gradient) on the same
  data for comparison; and the float kernels.
* ``bert``: the BERT-like training graph of tests/real_models.py (2 layers, hidden 32, 2 heads,
  seq 8, batch 2, tf.nn.gelu, Adam), one step from the same weights under fp32, ours
  (``allow_mix_precision_bf16``, graph_level 2) and ours without the 18g rules (``norule``):
  executed op types with dtypes, the bridge's fusion counts, the loss and Adam's first-moment
  slots after the step (``m = (1 - beta1) * g``: the gradients, in FP32).
* ``graphs``: ``bert`` then ``offline`` in one process (one TF start-up: the tests' time budget).
* ``offline``: rule counts and refusal reasons of offline rewrites: the same BERT graph in BF16,
  FP32 (must_keep_origin_dtype), FP16 (allow_mix_precision), BF16 with NC1HWC0; a Keras (tf_keras)
  transformer block in BF16; small graphs the rule refuses (a GELU of unknown static shape in a
  training graph, a GELU with 0.4 in place of 0.5).
"""
from __future__ import annotations

import json
import math
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
from _worker_util import executed_ops as _ops  # noqa: E402

tf1 = tf.compat.v1
RULES = ("bf16_gelu", "bf16_attention_train")
MODE = "allow_mix_precision_bf16"
_erf = np.vectorize(math.erf)


def _emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def _bf16(a):
    return tf.cast(tf.constant(np.asarray(a, np.float32)), tf.bfloat16)


def _f64(t):
    return np.asarray(tf.cast(t, tf.float64))


def _gelu64(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_grad64(dy, x):
    return dy * (0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))


def _worst(got, ref, floor):
    """max over elements of |got - ref| / (2^-8 |ref| + floor): <= 1 is "one rounding to BF16 of a
    value computed with FP32 error below ``floor``"."""
    return float(np.max(np.abs(got - ref) / (2.0 ** -8 * np.abs(ref) + floor)))


def kernels():
    from npu_amp_tf import _loader

    lib = _loader.load()
    rng = np.random.default_rng(0)
    for n in (1, 7, 15, 16, 17, 33, 200, 1000):
        x = rng.standard_normal(n).astype(np.float32) * 3
        x[: min(n, 6)] = np.array([0.0, -0.0, 9.0, -9.0, -4.5, 2.5], np.float32)[: min(n, 6)]
        dy = rng.standard_normal(n).astype(np.float32)
        xb, dyb = _bf16(x), _bf16(dy)
        x64, dy64 = _f64(xb), _f64(dyb)
        ref, refg = _gelu64(x64), _gelu_grad64(dy64, x64)
        ours, oursg = _f64(lib.gelu_erf(xb)), _f64(lib.gelu_erf_grad(dyb, xb))
        # TF's BF16 chain: tf.nn.gelu's formula and its autodiff gradient, every op in BF16
        with tf.GradientTape() as tape:
            tape.watch(xb)
            y = 0.5 * xb * (1.0 + tf.math.erf(xb / tf.constant(math.sqrt(2.0), tf.bfloat16)))
        tfy, tfg = _f64(y), _f64(tape.gradient(y, xb, output_gradients=dyb))
        floor = 2e-6 * np.maximum(np.abs(x64), 1.0)
        fx = tf.constant(x64.astype(np.float32))
        f_ours = np.asarray(lib.gelu_erf(fx), np.float64)
        f_oursg = np.asarray(lib.gelu_erf_grad(tf.constant(dy64.astype(np.float32)), fx), np.float64)
        _emit(kind="gelu", n=n, fwd=_worst(ours, ref, floor), grad=_worst(oursg, refg, floor * np.abs(dy64)),
              tf_fwd=_worst(tfy, ref, floor), tf_grad=_worst(tfg, refg, floor * np.abs(dy64)),
              float_fwd=float(np.max(np.abs(f_ours - ref) / (1e-6 * np.abs(ref) + floor))),
              float_grad=float(np.max(np.abs(f_oursg - refg) / (1e-6 * np.abs(refg) + floor * np.abs(dy64)))),
              dtype=str(lib.gelu_erf(xb).dtype.name))
    for shape in ((1, 5), (3, 16), (2, 3, 17), (2, 2, 4, 40)):
        s = rng.standard_normal(shape).astype(np.float32) * 4
        dp = rng.standard_normal(shape).astype(np.float32)
        sb, dpb = _bf16(s), _bf16(dp)
        scale = 0.125
        p = lib.scale_mask_softmax(sb, [], scale=scale)
        z = _f64(sb) * scale
        e = np.exp(z - z.max(-1, keepdims=True))
        ref = e / e.sum(-1, keepdims=True)
        p64, dp64 = _f64(p), _f64(dpb)
        g = _f64(lib.scale_mask_softmax_grad(dpb, p, scale=scale))
        refg = scale * (dp64 - (dp64 * p64).sum(-1, keepdims=True)) * p64
        _emit(kind="softmax", shape=list(shape), fwd=_worst(p64, ref, 1e-6),
              grad=_worst(g, refg, 1e-5 * np.max(np.abs(refg))), dtype=str(p.dtype.name))
    for n, d in ((3, 17), (4, 40), (2, 768)):
        x = _bf16(rng.standard_normal((n, d)) * 2 + 0.5)
        dy = _bf16(rng.standard_normal((n, d)))
        gam, bet = _bf16(rng.standard_normal(d)), _bf16(rng.standard_normal(d))
        y, mu, rs = lib.layer_norm(x, gam, bet, epsilon=1e-12)
        dx, dg, db = lib.layer_norm_grad(dy, x, gam, mu, rs)
        x64, g64, b64, dy64 = _f64(x), _f64(gam), _f64(bet), _f64(dy)
        m = x64.mean(-1, keepdims=True)
        xh = (x64 - m) / np.sqrt(((x64 - m) ** 2).mean(-1, keepdims=True) + 1e-12)
        ref = xh * g64 + b64
        gi = dy64 * g64
        refdx = (gi - gi.mean(-1, keepdims=True) - xh * (gi * xh).mean(-1, keepdims=True)) * \
            (1 / np.sqrt(((x64 - m) ** 2).mean(-1, keepdims=True) + 1e-12))
        refdg, refdb = (dy64 * xh).sum(0), dy64.sum(0)
        _emit(kind="layer_norm", shape=[n, d], fwd=_worst(_f64(y), ref, 1e-5 * np.max(np.abs(ref))),
              dx=_worst(_f64(dx), refdx, 1e-4 * np.max(np.abs(refdx))),
              dgamma=_worst(_f64(dg), refdg, 1e-4 * np.max(np.abs(refdg))),
              dbeta=_worst(_f64(db), refdb, 1e-4 * np.max(np.abs(refdb))), dtype=str(y.dtype.name))


# ------------------------------------------------------------------ graphs
def _bert(batch=2, seq=8, hidden=32, heads=2, ffn=64, layers=2):
    from real_models import bert_training_graph

    return bert_training_graph(layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch, vocab=50,
                               ffn=ffn, pooler=False)


class _RulesRemoved:
    def __enter__(self):
        from graph_passes.fusion import RULES as REG

        self.saved = {n: REG.pop(n) for n in RULES if n in REG}

    def __exit__(self, *exc):
        from graph_passes.fusion import RULES as REG

        REG.update(self.saved)  # (registration order is not restored; this process ends soon)


def _fusion_counts(decisions):
    c = Counter()
    for d in decisions.values():
        if d.get("fusion") in RULES:
            c[d["fusion"]] += 1
    return dict(c)


def bert():
    from npu_amp_tf.bridge import clear_reports, last_reports

    g, fetches = _bert()
    with g.as_default():
        variables = {v.op.name: v for v in tf1.global_variables()}
        init = tf1.global_variables_initializer()
    loss_t = g.get_tensor_by_name(fetches[0] + ":0")
    train = g.get_operation_by_name(fetches[1])
    rng = np.random.default_rng(1)
    feed = {g.get_tensor_by_name("input_ids:0"): rng.integers(0, 50, (2, 8)).astype(np.int32),
            g.get_tensor_by_name("labels:0"): np.array([0, 1], np.int32)}
    cfgs = {"fp32": tf1.ConfigProto(),
            "ours": npu_amp_tf.session_config(precision_mode=MODE, graph_level=2),
            "norule": npu_amp_tf.session_config(precision_mode=MODE, graph_level=2,
                                                keep_dtype_nodes=["__18g_norule__"])}
    start = None
    for name, cfg in cfgs.items():
        with tf1.Session(graph=g, config=cfg) as s:
            s.run(init)
            if start is None:
                start = {k: s.run(v) for k, v in variables.items()}
            for k, v in variables.items():
                v.load(start[k], s)
            md = tf1.RunMetadata()
            clear_reports()  # (at most 64 records are kept; the loads above made many)
            if name == "norule":
                with _RulesRemoved():
                    lv, _ = s.run([loss_t, train], feed, options=tf1.RunOptions(output_partition_graphs=True),
                                  run_metadata=md)
            else:
                lv, _ = s.run([loss_t, train], feed, options=tf1.RunOptions(output_partition_graphs=True),
                              run_metadata=md)
            fused = Counter()
            for r in last_reports():
                rep = r.get("report") or {}
                fused.update(_fusion_counts(rep.get("decisions", {})))
            slots = {k: s.run(v).ravel().tolist() for k, v in variables.items()
                     if k.endswith("/Adam") and ("kernel" in k)}
            _emit(kind="bert", config=name, loss=float(lv), ops=_ops(md), fused=dict(fused), m=slots)


def _refusals(rep):
    out = {}
    for name, d in rep.decisions.items():
        if d.get("fusion_skipped") in RULES:
            out[name] = [d["fusion_skipped"], d.get("fusion_reason", "")]
    return out


def _rewrite(gd, fetches, **kw):
    rgd, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, graph_level=2, **kw)
    return dict(Counter(n.op for n in rgd.node)), _fusion_counts(rep.decisions), _refusals(rep)


def offline():
    g, fetches = _bert()
    gd = g.as_graph_def()
    for label, kw in (("bf16", {"precision_mode": MODE}), ("fp32", {"precision_mode": "must_keep_origin_dtype"}),
                      ("fp16", {"precision_mode": "allow_mix_precision"}),
                      ("nc1hwc0", {"precision_mode": MODE, "format_mode": "NC1HWC0"})):
        rgd, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, graph_level=2, **kw)
        off = {k: v for k, v in rep.pass_stats("fusion").get("rules_off", {}).items() if k in RULES}
        _emit(kind="offline_bert", mode=label, ops=dict(Counter(n.op for n in rgd.node)),
              fused=_fusion_counts(rep.decisions), refused=_refusals(rep), off=off,
              softmax=sum(1 for n in gd.node if n.op == "Softmax"))
    keras_block()
    # refusals: a GELU of unknown batch size in a training graph; 0.4 in place of 0.5
    for label in ("dynamic", "not_gelu"):
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 16] if label == "dynamic" else [4, 16], name="x")
            w = tf1.get_variable("w", [16, 16])
            h = tf.matmul(x, w)
            half = 0.5 if label == "dynamic" else 0.4
            y = half * h * (1.0 + tf.math.erf(h / math.sqrt(2.0)))
            loss = tf.reduce_sum(y * y, name="loss")
            train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        ops, fused, refused = _rewrite(g.as_graph_def(), ["loss", train.name], precision_mode=MODE)
        _emit(kind="offline_refusal", case=label, ops=ops, fused=fused, refused=refused)


def keras_block():
    try:
        import tf_keras as K
    except ImportError:
        import keras

        if not keras.__version__.startswith("2."):
            _emit(kind="keras_block", skipped="no Keras 2 (tf_keras) here")
            return
        K = tf.keras
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 8, 32], name="x")
        att = K.layers.MultiHeadAttention(num_heads=2, key_dim=16)(x, x)
        h = K.layers.LayerNormalization()(x + att)
        f = K.layers.Dense(64, activation="gelu")(h)
        out = K.layers.LayerNormalization()(h + K.layers.Dense(32)(f))
        loss = tf.reduce_mean(tf.square(out), name="loss")
        train = tf1.train.AdamOptimizer(1e-3).minimize(loss, name="train")
    ops, fused, refused = _rewrite(g.as_graph_def(), ["loss", train.name], precision_mode=MODE)
    _emit(kind="keras_block", ops=ops, fused=fused, refused=refused)


if __name__ == "__main__":
    tf1.disable_eager_execution() if sys.argv[1] != "kernels" else None
    {"kernels": kernels, "bert": bert, "offline": offline,
     "graphs": lambda: (bert(), offline())}[sys.argv[1]]()
    print("DONE", flush=True)
