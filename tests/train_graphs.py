"""Real ``tf.compat.v1`` training scripts exported as MetaGraphs (+ checkpoints).

Each builder writes what a TF1 user has after ``saver.save`` /
``tf.compat.v1.train.export_meta_graph``: ``DIR/model.meta`` and, when
``checkpoint`` is true, ``DIR/model.ckpt-1`` taken after one real training
step (so checkpoint weights differ from the initializers).  Shapes are tiny:
FP16 CPU kernels are slow on TF 2.15.
"""
import contextlib
import os

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


def _export(g, sess, d, checkpoint, feed, train_op):
    os.makedirs(d, exist_ok=True)
    with g.as_default():
        saver = tf1.train.Saver()
        sess.run(tf1.global_variables_initializer())
        ckpt = None
        if checkpoint:
            sess.run(train_op, feed)
            ckpt = saver.save(sess, os.path.join(d, "model.ckpt"), global_step=1)
        meta = os.path.join(d, "model.meta")
        saver.export_meta_graph(meta)
    return meta, ckpt


def _tf1_layers():
    """``tf.compat.v1.layers`` (Keras 2); on TF >= 2.16 with Keras 3 the same
    legacy layers come from ``tf_keras``."""
    import types

    try:
        tf1.layers.conv2d  # noqa: B018  (raises on Keras 3)
        return tf1.layers
    except AttributeError:
        from tf_keras.src.legacy_tf_layers import convolutional, core
        return types.SimpleNamespace(conv2d=convolutional.conv2d, dense=core.dense, flatten=core.flatten)


def layers_adam(d, checkpoint=False, resource=True, seed=0):
    """tf1.layers conv2d + dense, softmax cross-entropy, Adam.  Returns
    (meta path, checkpoint prefix or None, feeds {name: array})."""
    g = tf.Graph()
    rng = np.random.default_rng(seed)
    feed = {"images:0": rng.standard_normal((2, 8, 8, 3)).astype(np.float32),
            "labels:0": np.array([1, 3], np.int64)}
    with g.as_default(), tf1.variable_scope("", use_resource=resource):
        tf1.set_random_seed(seed)
        x = tf1.placeholder(tf.float32, [2, 8, 8, 3], name="images")
        y = tf1.placeholder(tf.int64, [2], name="labels")
        layers = _tf1_layers()
        h = layers.conv2d(x, 4, 3, padding="same", activation=tf.nn.relu, name="conv1")
        h = layers.flatten(h)
        logits = layers.dense(h, 5, name="fc")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.AdamOptimizer(1e-2).minimize(loss, global_step=step, name="train")
        with tf1.Session(graph=g) as sess:
            meta, ckpt = _export(g, sess, d, checkpoint, {g.get_tensor_by_name(k): v for k, v in feed.items()},
                                 train)
    return meta, ckpt, feed


def slim_momentum(d, checkpoint=False, resource=False, seed=1):
    """TF-Slim conv2d + batch_norm + fully_connected, Momentum; ref variables
    by default."""
    from real_models import import_slim

    slim = import_slim()
    g = tf.Graph()
    rng = np.random.default_rng(seed)
    feed = {"images:0": rng.standard_normal((2, 8, 8, 3)).astype(np.float32),
            "labels:0": np.eye(4, dtype=np.float32)[[0, 2]]}
    with g.as_default(), tf1.variable_scope("", use_resource=resource):
        tf1.set_random_seed(seed)
        x = tf1.placeholder(tf.float32, [2, 8, 8, 3], name="images")
        y = tf1.placeholder(tf.float32, [2, 4], name="labels")
        with slim.arg_scope([slim.conv2d], normalizer_fn=slim.batch_norm,
                            normalizer_params={"is_training": True}):
            h = slim.conv2d(x, 4, [3, 3], scope="conv1")
        h = slim.flatten(h)
        logits = slim.fully_connected(h, 4, activation_fn=None, scope="logits")
        loss = tf1.losses.softmax_cross_entropy(y, logits)
        loss = tf.identity(loss, name="loss")
        opt = tf1.train.MomentumOptimizer(0.05, 0.9)
        train = slim.learning.create_train_op(loss, opt)
        train = tf.identity(train, name="train")
        with tf1.Session(graph=g) as sess:
            meta, ckpt = _export(g, sess, d, checkpoint, {g.get_tensor_by_name(k): v for k, v in feed.items()},
                                 train)
    return meta, ckpt, feed


def amp_overflow(d, checkpoint=False, seed=2, npu=False):
    """A training graph with ``AMP_Optimizer`` (dynamic loss scale) whose
    forward MatMul ``big/MatMul`` overflows in FP16 only: 16 products of
    ~100 x ~100 = ~1.6e5 > 65504.  After it the activations are scaled down,
    so FP32 stays finite.  ``npu=True``: the Ascend script's spelling,
    ``NPULossScaleOptimizer`` + ``ExponentialUpdateLossScaleManager``."""
    import npu_amp_tf

    g = tf.Graph()
    rng = np.random.default_rng(seed)
    feed = {"x:0": rng.uniform(90.0, 110.0, (2, 16)).astype(np.float32),
            "t:0": rng.standard_normal((2, 4)).astype(np.float32)}
    with g.as_default(), tf1.variable_scope("", use_resource=True):
        x = tf1.placeholder(tf.float32, [2, 16], name="x")
        t = tf1.placeholder(tf.float32, [2, 4], name="t")
        w = tf1.get_variable("w_big", initializer=np.full((16, 8), 100.0, np.float32))
        h = tf.matmul(x, w, name="big/MatMul")
        s = tf.multiply(h, 1e-3, name="scale")
        w2 = tf1.get_variable("w_small", initializer=rng.uniform(0.05, 0.15, (8, 4)).astype(np.float32))
        out = tf.matmul(s, w2, name="small/MatMul")
        loss = tf.reduce_mean(tf.square(out - t), name="loss")
        if npu:
            manager = npu_amp_tf.ExponentialUpdateLossScaleManager(init_loss_scale=2 ** 10, incr_every_n_steps=100,
                                                                   decr_every_n_nan_or_inf=1)
            opt = npu_amp_tf.NPULossScaleOptimizer(tf1.train.GradientDescentOptimizer(1e-6), manager)
        else:
            opt = npu_amp_tf.AMP_Optimizer(tf1.train.GradientDescentOptimizer(1e-6))
        train = opt.minimize(loss, global_step=tf1.train.get_or_create_global_step(), name="train")
        train = tf.group(train, name="train_step")
        with tf1.Session(graph=g) as sess:
            meta, ckpt = _export(g, sess, d, checkpoint, {g.get_tensor_by_name(k): v for k, v in feed.items()},
                                 train)
    return meta, ckpt, feed


@contextlib.contextmanager
def control_flow_v1():
    """Build v1 ``while_loop`` / ``cond`` (Enter/Exit/Switch/Merge) in this block."""
    from tensorflow.python.ops import control_flow_util

    old = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        yield
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = old


def v1_loop_cond(d):
    """Control flow v1 (``Enter``/``Exit``/``Switch``/``Merge``, as TF1 and
    ``disable_control_flow_v2`` scripts build it): a ``while_loop`` of three
    MatMuls, then a ``cond`` whose false branch never runs, trained by SGD."""
    with control_flow_v1():
        g = tf.Graph()
        feed = {"x:0": np.full((2, 4), 0.5, np.float32)}
        with g.as_default(), tf1.variable_scope("", use_resource=True):
            x = tf1.placeholder(tf.float32, [2, 4], name="x")
            w = tf1.get_variable("w", initializer=np.eye(4, dtype=np.float32) * 1.5)
            _, h = tf1.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.matmul(h, w, name="step")),
                                  [tf.constant(0), x], name="loop")
            y = tf1.cond(tf.reduce_sum(h) > 0, lambda: tf.nn.relu(h, name="pos"),
                         lambda: tf.negative(h, name="neg"), name="branch")
            loss = tf.reduce_sum(tf.square(y), name="loss")
            tf1.train.GradientDescentOptimizer(1e-3).minimize(loss, name="train")
            with tf1.Session(graph=g) as sess:
                meta, _ = _export(g, sess, d, False, {}, None)
    return meta, None, feed


def v1_loop_conv(d):
    """A v1 ``while_loop`` whose body is Conv2D + BiasAdd + Relu (oneDNN's
    layout pass fuses the FP32 Conv2D + BiasAdd inside the Session, so the
    debugger sees no Conv2D output), trained by SGD."""
    with control_flow_v1():
        g = tf.Graph()
        feed = {"x:0": np.full((1, 8, 8, 4), 0.5, np.float32)}
        with g.as_default(), tf1.variable_scope("", use_resource=True):
            x = tf1.placeholder(tf.float32, [1, 8, 8, 4], name="x")
            k = tf1.get_variable("k", initializer=np.full((3, 3, 4, 4), 0.05, np.float32))
            b = tf1.get_variable("b", initializer=np.full((4,), 0.1, np.float32))

            def body(i, h):
                c = tf.nn.conv2d(h, k, 1, "SAME", name="conv")
                return i + 1, tf.nn.relu(tf.nn.bias_add(c, b, name="bias"), name="act")

            _, h = tf1.while_loop(lambda i, h: i < 2, body, [tf.constant(0), x], name="loop")
            loss = tf.reduce_sum(tf.square(h), name="loss")
            tf1.train.GradientDescentOptimizer(1e-3).minimize(loss, name="train")
            with tf1.Session(graph=g) as sess:
                meta, _ = _export(g, sess, d, False, {}, None)
    return meta, None, feed
