"""Python API of npu_amp_tf.tools on real small models built with TF.

The model builders here are shared with tests/test_cli.py.
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

FP16_MAX = 65504.0


# --------------------------------------------------------------------------
# model builders (real TF graphs, small shapes: FP16 kernels are slow here)
# --------------------------------------------------------------------------
def mlp_graph_def():
    """Frozen MLP: x[2,8] -> MatMul -> BiasAdd -> Relu -> MatMul -> Softmax (y)."""
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8], name="x")
        w1 = tf.constant(rng.standard_normal((8, 16)).astype(np.float32), name="w1")
        b1 = tf.constant(np.full(16, 0.1, np.float32), name="b1")
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1, name="fc1/MatMul"), b1, name="fc1/BiasAdd"),
                       name="fc1/Relu")
        w2 = tf.constant(rng.standard_normal((16, 4)).astype(np.float32), name="w2")
        logits = tf.matmul(h, w2, name="fc2/MatMul")
        tf.nn.softmax(logits, name="y")
    return g.as_graph_def()


def overflow_graph_def():
    """A graph with one op that overflows in FP16 only.

    ``big/MatMul`` sums 16 products of ~100 x ~100: ~1.6e5 in FP32, above the
    FP16 maximum 65504, so inf once the rewrite runs it in FP16.  Everything
    after it is scaled down (finite in FP32).  A second, benign white op
    (``small/BatchMatMul``) runs fine in FP16.
    """
    g = tf.Graph()
    rng = np.random.default_rng(1)
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 16], name="x")
        w = tf.constant(np.full((16, 8), 100.0, np.float32), name="w_big")
        h = tf.matmul(x, w, name="big/MatMul")
        s = tf.multiply(h, tf.constant(1e-3, tf.float32), name="scale")
        s3 = tf.reshape(s, [2, 1, 8], name="to3d")
        w2 = tf.constant(rng.uniform(0.05, 0.15, (1, 8, 4)).astype(np.float32), name="w_small")
        bm = tf.linalg.matmul(s3, w2, name="small/BatchMatMul")
        tf.reshape(bm, [2, 4], name="out")
    return g.as_graph_def()


def overflow_inputs():
    rng = np.random.default_rng(2)
    return {"x": rng.uniform(90.0, 110.0, (2, 16)).astype(np.float32)}


def write_pb(gd, path, text=False):
    if text:
        from google.protobuf import text_format
        with open(path, "w") as fh:
            fh.write(text_format.MessageToString(gd))
    else:
        with open(path, "wb") as fh:
            fh.write(gd.SerializeToString())
    return str(path)


def write_metagraph(path):
    """TF1 MetaGraph with variables, a signature and a train op."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8], name="x")
        w = tf.compat.v1.get_variable("w", initializer=np.random.default_rng(3).standard_normal(
            (8, 4)).astype(np.float32))
        y = tf.nn.relu(tf.matmul(x, w, name="dense/MatMul"), name="y")
        loss = tf.reduce_mean(tf.square(y), name="loss")
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf.compat.v1.add_to_collection("train_op", train)
        sig = tf.compat.v1.saved_model.signature_def_utils.predict_signature_def({"x": x}, {"y": y})
        mg = tf.compat.v1.train.export_meta_graph(graph=g)
        mg.signature_def["serving_default"].CopyFrom(sig)
    with open(path, "wb") as fh:
        fh.write(mg.SerializeToString())
    return str(path)


def write_saved_model(path):
    """TF2 SavedModel: a tf.Module with variables and a serving signature."""
    class M(tf.Module):
        def __init__(self):
            rng = np.random.default_rng(4)
            self.w = tf.Variable(rng.standard_normal((8, 16)).astype(np.float32))
            self.w2 = tf.Variable(rng.standard_normal((16, 4)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.matmul(tf.nn.relu(tf.matmul(x, self.w)), self.w2)}

    m = M()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return str(path)


def run_gd(gd, feeds, fetches):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with tf.compat.v1.Session(graph=g) as s:
        return s.run(fetches, feeds)


def precision_pass_available():
    from npu_amp_tf import pipeline
    from npu_amp_tf.options import Options
    return "precision" in pipeline.pass_names(Options.from_kwargs())


requires_precision = pytest.mark.skipif(
    not precision_pass_available(), reason="the precision pass (graph_passes.precision) is not built yet")
