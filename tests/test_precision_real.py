"""Precision on graphs as real model code builds them (issue 13, parts 1, 2, 4):
Keras layers in a TF1 graph with the learning-phase placeholder (every
BatchNorm under a lowered ``cond``), ``tf.cond`` / ``smart_cond``, a fan-out
through clear ops.  Cast counts are compared with grappler's own
``auto_mixed_precision_cpu`` on the same graph in the same test
(tests/amp_peers.py), numerics with the FP32 graph.  FP16 runs ~130x slower
than FP32 on TF 2.15 CPU kernels: shapes stay tiny.
"""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2

import amp_peers as P
import npu_amp_tf

v1 = tf.compat.v1
F16, F32 = types_pb2.DT_HALF, types_pb2.DT_FLOAT


def _keras_resnet_block_graph(k):
    """A residual CNN from Keras layers (conv-BN-relu x2, shortcut add,
    max-pool, dense), trained with Momentum in a TF1 graph.  The learning
    phase is Keras's placeholder: each BatchNormalization builds a ``cond``."""
    g = tf.Graph()
    g.seed = 0
    L = k.layers
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 8, 8, 3], name="images")
        y = v1.placeholder(tf.int32, [2], name="labels")
        inp = L.Input(tensor=x)
        h = L.Conv2D(8, 3, padding="same", use_bias=False)(inp)
        h = L.BatchNormalization()(h)
        h = L.Activation("relu")(h)
        s = h
        h = L.Conv2D(8, 3, padding="same", use_bias=False)(h)
        h = L.BatchNormalization()(h)
        h = L.Activation("relu")(h)
        h = L.Conv2D(8, 3, padding="same", use_bias=False)(h)
        h = L.BatchNormalization()(h)
        h = L.Add()([h, s])
        h = L.Activation("relu")(h)
        h = L.MaxPooling2D()(h)
        h = L.Flatten()(h)
        logits = L.Dense(5)(h)
        model = k.Model(inp, logits)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        with tf.control_dependencies(model.updates):
            train = v1.train.MomentumOptimizer(0.01, 0.9).minimize(
                loss, var_list=model.trainable_weights, name="train")
        lp = k.backend.learning_phase()
        init = v1.global_variables_initializer()
    rng = np.random.RandomState(0)
    feeds = {x: rng.rand(2, 8, 8, 3).astype(np.float32), y: np.array([1, 3]), lp: True}
    return g, model, loss, train, init, feeds


def _one_step(g, model, loss, train, init, feeds, config):
    with v1.Session(graph=g, config=config) as s:
        s.run(init)
        w0 = s.run(model.trainable_weights)
        l0 = s.run([loss, train], feeds)[0]
        w1 = s.run(model.trainable_weights)
        l1 = s.run(loss, feeds)
    return (l0, l1), w0, [b - a for a, b in zip(w0, w1)]


def test_keras_learning_phase_conds_follow_the_activations(k2):
    g, model, loss, train, init, feeds = _keras_resnet_block_graph(k2)
    assert any(op.type in ("If", "StatelessIf", "Switch") for op in g.get_operations())
    fetches = [loss.op.name, train.name]
    ours = P.ours_session(g, fetches)
    peer = P.grappler_amp(g, fetches)
    # BatchNorm (forward and backward) and Relu run FP16, as under grappler
    for op in ("FusedBatchNormV3", "FusedBatchNormGradV3", "Relu", "ReluGrad", "Conv2D", "MaxPool"):
        assert set(P.dtypes_of(ours, op).values()) == {F16}, op
        assert set(P.dtypes_of(peer, op).values()) == {F16}, op
    # the conds' Switch/Merge pass the activations' dtype on
    merges = P.dtypes_of(ours, "Merge")
    assert F16 in merges.values()
    n_ours, n_peer = P.count(ours), P.count(peer)
    assert n_ours <= n_peer, (n_ours, n_peer)

    # one training step in a Session, vs FP32
    plain = P._base_config()
    amp = P._base_config(npu_amp_tf.session_config(fail_on_error=True))
    l32, w032, d32 = _one_step(g, model, loss, train, init, feeds, plain)
    l16, w016, d16 = _one_step(g, model, loss, train, init, feeds, amp)
    for a, b in zip(w032, w016):
        np.testing.assert_array_equal(a, b)     # same initial weights (graph seed)
    # loss before and after the step: 3 FP16 convs over 27-72-tap windows +
    # BN; fp16 eps 2^-11 = 4.9e-4 per rounding, ~sqrt(72) roundings
    # accumulating per output, a few layers: 1e-2 of the initial loss
    np.testing.assert_allclose(l16, l32, rtol=0, atol=1e-2 * l32[0])
    ref = np.concatenate([d.ravel() for d in d32])
    got = np.concatenate([d.ravel() for d in d16])
    # The update: Relu + max-pool make it tie-sensitive (FP16 rounding can
    # flip the argmax of a near-tied 2x2 window and route that window's
    # gradient elsewhere; with 2 images a single flip moves an early BN beta
    # by ~10%), so no per-element bound; the update's direction must agree
    # (measured 0.9995-1.0 on TF 2.15 and 2.21, and once 0.975 on TF 2.21
    # under load: the threads' summation order changes which windows tie, so
    # the bound leaves room for a few flips: cosine > 0.95).  A layer in the
    # wrong dtype or a lost gradient changes the direction by O(1).
    cos = float(np.dot(got, ref) / (np.linalg.norm(got) * np.linalg.norm(ref)))
    assert cos > 0.95, cos


def test_tf_cond_and_smart_cond_branches_agree():
    """tf.cond whose branches are conv (FP16) vs identity, and a smart_cond on
    a placeholder: the Merge takes one dtype, the disagreeing branch is cast."""
    from tensorflow.python.framework import smart_cond

    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [1, 6, 6, 2], name="x")
        p = v1.placeholder_with_default(True, [], name="p")
        w = tf.constant(np.random.RandomState(0).randn(3, 3, 2, 2).astype(np.float32) * 0.3)
        c = tf.nn.conv2d(x, w, 1, "SAME", name="c0")
        h = tf.cond(p, lambda: tf.nn.relu(tf.nn.conv2d(c, w, 1, "SAME")), lambda: tf.nn.relu(c),
                    name="cond")
        h = smart_cond.smart_cond(p, lambda: tf.nn.max_pool2d(h, 2, 2, "VALID"),
                                  lambda: tf.nn.avg_pool2d(h, 2, 2, "VALID"), name="sc")
        out = tf.nn.conv2d(h, w, 1, "SAME", name="out")
        tf.identity(tf.cast(out, tf.float32) * 1.0, name="y")
    ours = P.ours_session(g, ["y"])
    peer = P.grappler_amp(g, ["y"])
    merges = P.dtypes_of(ours, "Merge")
    assert merges and set(merges.values()) == {F16}, merges
    assert P.count(ours) <= P.count(peer), (P.count(ours), P.count(peer))
    feeds = {"x:0": np.random.RandomState(1).randn(1, 6, 6, 2).astype(np.float32)}
    for pv in (True, False):
        feeds["p:0"] = pv
        with v1.Session(graph=g, config=P._base_config()) as s:
            ref = s.run("y:0", feeds)
        with v1.Session(graph=g, config=P._base_config(npu_amp_tf.session_config())) as s:
            got = s.run("y:0", feeds)
        # 3 chained 18-tap FP16 convs: relative error ~ 3 * sqrt(18) * 4.9e-4 ~ 6e-3
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-2 * np.abs(ref).max())


def test_cast_once_before_a_fan_out():
    """TF's own AMP test shape: input -> Split -> three conv branches ->
    Concat, trained.  The Split goes FP16 behind ONE cast of the input,
    instead of one cast per Split output."""
    rng = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 6, 6, 6], name="x")
        outs = []
        for i, part in enumerate(tf.split(x, 3, axis=3, name="split")):
            w = v1.get_variable(f"w{i}", initializer=rng.randn(3, 3, 2, 4).astype(np.float32) * 0.3)
            outs.append(tf.nn.relu(tf.nn.conv2d(part, w, 1, "SAME", name=f"conv{i}")))
        y = tf.concat(outs, 3, name="concat")
        loss = tf.reduce_mean(tf.square(y), name="loss")
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        init = v1.global_variables_initializer()
    fetches = ["loss", "train"]
    ours = P.ours_session(g, fetches)
    peer = P.grappler_amp(g, fetches)
    assert P.dtypes_of(ours, "Split") == {"split": F16}
    by = {n.name: n for n in ours.node}
    x_casts = [n for n in ours.node if n.op == "Cast" and n.input[0] == "x"]
    assert len(x_casts) == 1 and by["split"].input[1] == x_casts[0].name
    assert P.count(ours) <= P.count(peer), (P.count(ours), P.count(peer))
    feeds = {x: rng.randn(2, 6, 6, 6).astype(np.float32)}
    res = []
    for cfg in (P._base_config(), P._base_config(npu_amp_tf.session_config(fail_on_error=True))):
        with v1.Session(graph=g, config=cfg) as s:
            s.run(init)
            w0 = s.run(v1.trainable_variables())
            l0 = s.run([loss, train], feeds)[0]
            res.append((l0, [b - a for a, b in zip(w0, s.run(v1.trainable_variables()))]))
    (l32, d32), (l16, d16) = res
    # 18-tap FP16 convs (eps 4.9e-4, ~sqrt(18) roundings): 1e-2 relative
    np.testing.assert_allclose(l16, l32, rtol=1e-2)
    for a, b in zip(d32, d16):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-2 * np.abs(a).max())
