"""Graphs shared by the layout tests and benchmarks/layout.py (built with TF itself)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2


def resnet50_inference(hw=32, batch=1):
    """Frozen ResNet-50 (weights=None) inference GraphDef, input 'x', fetch name."""
    m = tf.keras.applications.ResNet50(weights=None, input_shape=(hw, hw, 3))
    f = tf.function(lambda x: m(x, training=False)).get_concrete_function(
        tf.TensorSpec([batch, hw, hw, 3], tf.float32, name="x"))
    gd = convert_variables_to_constants_v2(f).graph.as_graph_def()
    out = [n.name for n in gd.node if n.op == "Softmax"][0]
    return gd, out


def resnet50_training(hw=32, batch=2, lr=0.01):
    """ResNet-50 training step as a tf.function graph: forward, gradients, SGD update."""
    m = tf.keras.applications.ResNet50(weights=None, input_shape=(hw, hw, 3), classes=10)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = m(x, training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits))
        grads = tape.gradient(loss, m.trainable_variables)
        for v, g in zip(m.trainable_variables, grads):
            v.assign_sub(lr * g)
        return loss

    cf = step.get_concrete_function(tf.TensorSpec([batch, hw, hw, 3], tf.float32),
                                    tf.TensorSpec([batch], tf.int32))
    return cf.graph.as_graph_def(add_shapes=True)   # resource reads keep their shapes


def small_cnn_training(channels=(17, 24), hw=8, batch=2, n_classes=5, seed=0):
    """TF1-style training graph of a small CNN with resource variables whose
    initial values are constants (so two imports start from the same weights).

    conv(3->c1)+bias -> BN(train) -> relu -> maxpool -> conv(c1->c2)+bias ->
    relu * per-channel scale + x -> global mean -> dense -> softmax CE; SGD.

    Returns (graph_def, feeds {name: array}, fetch names: loss, train op,
    variable read names).
    """
    rng = np.random.RandomState(seed)
    c1, c2 = channels
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, hw, hw, 3], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [batch], name="y")

        def var(name, shape, scale=0.3):
            init = tf.compat.v1.constant_initializer(rng.randn(*shape).astype(np.float32) * scale)
            return tf.compat.v1.get_variable(name, shape, tf.float32, init, use_resource=True)

        w1, b1 = var("w1", [3, 3, 3, c1]), var("b1", [c1])
        gamma, beta = var("gamma", [c1], 0.1), var("beta", [c1], 0.1)
        w2, b2 = var("w2", [3, 3, c1, c2]), var("b2", [c2])
        s2 = var("s2", [c2], 0.5)
        wd, bd = var("wd", [c2, n_classes]), var("bd", [n_classes])
        h = tf.nn.bias_add(tf.nn.conv2d(x, w1, 1, "SAME"), b1)
        h, _, _ = tf.compat.v1.nn.fused_batch_norm(h, gamma + 1.0, beta, is_training=True)
        h = tf.nn.relu(h)
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h2 = tf.nn.bias_add(tf.nn.conv2d(h, w2, 1, "SAME"), b2)
        h2 = tf.nn.relu(h2) * s2 + tf.nn.sigmoid(h2)
        feat = tf.reduce_mean(h2, axis=[1, 2])
        logits = tf.matmul(feat, wd) + bd
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        init = tf.compat.v1.global_variables_initializer()
        reads = {v.op.name: tf.identity(v.read_value(), name=f"{v.op.name}_value").name
                 for v in tf.compat.v1.global_variables()}
    feeds = {"x:0": rng.rand(batch, hw, hw, 3).astype(np.float32),
             "y:0": rng.randint(0, n_classes, size=batch).astype(np.int32)}
    return g.as_graph_def(), feeds, {"loss": loss.name, "train": train.name, "init": init.name,
                                     "reads": reads}


def run_training_step(graph_def, feeds, names):
    """Import, initialise, run one SGD step; returns (loss, {var: value after the step})."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(names["init"])
        loss, _ = sess.run([names["loss"], names["train"]], feeds)
        vals = sess.run(names["reads"])
    return loss, vals


def run_graph(graph_def, fetches, feeds):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=g) as sess:
        return sess.run(fetches, feeds)


def count_op(graph_def, op):
    return sum(1 for n in graph_def.node if n.op == op)
