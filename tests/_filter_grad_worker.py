"""Subprocess worker for tests/test_fusion_filter_grad.py (BF16 kernels may abort TF,
so every run happens here, never in the pytest process).

``python _filter_grad_worker.py run``: trains a small conv net (four convs without bias:
3x3 on 8x8 (64 output positions: left alone), 1x1 stride 1, 1x1 stride 2, 3x3 on 4x4 (16
positions: im2col); then a dense layer) one SGD step (learning rate 1:
the update is minus the gradient) from the same weights under

* ``fp32``     plain TF (grappler's defaults);
* ``ours``     npu_amp_tf ``allow_mix_precision_bf16`` at graph_level 2;
* ``level1``   the same at graph_level 1 (no fusion: the filter gradients stay
               Conv2DBackpropFilter; the convs carry no bias and the net no batch norm,
               so no other level-2 rule fires and the forward graph is the same as ours);

and prints one ``RESULT {json}`` line per run: each weight's update, and the op types
(with dtype) of the nodes TF executed (partition graphs).  ``offline`` rewrites the graph
offline in BF16 and prints the fusion pass's counts and skip reasons.
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
#: the weights whose gradient the rules rewrite and those they leave
MATCHED = ("w1", "w2", "w3")
OTHERS = ("w0", "dense")


def build():
    tf1.set_random_seed(1)
    x = tf1.placeholder(tf.float32, [4, 8, 8, 16], name="x")
    y = tf1.placeholder(tf.int32, [4], name="y")
    init = tf1.initializers.glorot_uniform()
    w0 = tf1.get_variable("w0", [3, 3, 16, 16], initializer=init)
    w1 = tf1.get_variable("w1", [1, 1, 16, 32], initializer=init)
    w2 = tf1.get_variable("w2", [1, 1, 32, 24], initializer=init)
    w3 = tf1.get_variable("w3", [3, 3, 24, 8], initializer=init)
    wd = tf1.get_variable("dense", [8, 5], initializer=init)
    h = tf.nn.relu(tf.nn.conv2d(x, w0, 1, "SAME"))
    h = tf.nn.relu(tf.nn.conv2d(h, w1, 1, "SAME"))
    h = tf.nn.relu(tf.nn.conv2d(h, w2, 2, "VALID"))  # 8x8 -> 4x4
    h = tf.nn.relu(tf.nn.conv2d(h, w3, 1, "SAME"))
    logits = tf.matmul(tf.reduce_mean(h, [1, 2]), wd)
    loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    train = tf1.train.GradientDescentOptimizer(1.0).minimize(loss)
    rng = np.random.RandomState(0)
    feeds = {x: rng.uniform(-1, 1, [4, 8, 8, 16]).astype(np.float32), y: np.array([0, 1, 2, 4])}
    return feeds, loss, train


def _configs():
    mode = "allow_mix_precision_bf16"
    return {"fp32": tf1.ConfigProto(),
            "ours": npu_amp_tf.session_config(precision_mode=mode, graph_level=2, fail_on_error=True),
            "level1": npu_amp_tf.session_config(precision_mode=mode, graph_level=1, fail_on_error=True)}


def _emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def run():
    start = None
    for name, cfg in _configs().items():
        g = tf.Graph()
        with g.as_default():
            feeds, loss, train = build()
            tvars = {v.op.name: v for v in tf1.trainable_variables()}
            init = tf1.global_variables_initializer()
        with tf1.Session(graph=g, config=cfg) as s:
            s.run(init)
            start, _, md, after = run_from(s, tvars, start, train, feeds)
            upd = {k: (after[k] - start[k]).ravel().tolist() for k in tvars}
        ops = Counter()
        for pg in md.partition_graphs:
            for n in pg.node:
                dt = tf.dtypes.as_dtype(n.attr["T"].type).name if "T" in n.attr else ""
                ops[f"{n.op}:{dt}"] += 1
        _emit(config=name, update=upd, ops=dict(ops))


def offline():
    from graph_passes.fusion.builtin import onednn_enabled

    for mode in ("allow_mix_precision_bf16", "must_keep_origin_dtype"):
        g = tf.Graph()
        with g.as_default():
            _, loss, train = build()
        gd, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=[loss.op.name, train.name],
                                           precision_mode=mode, graph_level=2)
        st = rep.pass_stats("fusion")
        rules = ("filter_grad_1x1", "filter_grad_im2col")
        reasons = {r: sorted({d.get("fusion_reason", "") for d in rep.decisions.values()
                              if d.get("fusion_skipped") == r}) for r in rules}
        _emit(config="offline", mode=mode, onednn=onednn_enabled(),
              fused={r: st.get("fused", {}).get(r, 0) for r in rules}, reasons=reasons,
              off={r: st.get("rules_off", {}).get(r) for r in rules},
              ops=dict(Counter(n.op for n in gd.node)))


if __name__ == "__main__":
    {"run": run, "offline": offline}[sys.argv[1]]()
    print("DONE", flush=True)
