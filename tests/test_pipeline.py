"""The whole pipeline (unfuse -> fusion -> precision -> layout -> cleanup)."""
import json

import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from graph_passes.graph import Graph


def cnn_training_graph():
    """Conv (17 channels) + bias + relu + batch norm + dense + tanh, with its
    gradients and a Momentum update; raw ops, so it builds on every TF."""
    g = tf.Graph()
    with g.as_default():
        v1 = tf.compat.v1
        x = v1.placeholder(tf.float32, [2, 8, 8, 3], name="x")
        y = v1.placeholder(tf.int32, [2], name="y")
        k = v1.get_variable("conv/kernel", [3, 3, 3, 17])
        kb = v1.get_variable("conv/bias", [17], initializer=v1.zeros_initializer())
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, k, 1, "SAME"), kb))
        gamma = v1.get_variable("bn/gamma", [17], initializer=v1.ones_initializer())
        beta = v1.get_variable("bn/beta", [17], initializer=v1.zeros_initializer())
        h, _, _ = v1.nn.fused_batch_norm(h, gamma, beta, is_training=True)
        h = tf.reduce_mean(h, axis=[1, 2])
        w = v1.get_variable("dense/kernel", [17, 3])
        logits = tf.nn.tanh(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train")
    return g.as_graph_def()


@pytest.mark.parametrize("params", [
    {},
    {"format_mode": "NC1HWC0"},
    {"precision_mode": "allow_mix_precision_bf16", "graph_level": 3},
    {"precision_mode": "force_fp16", "format_mode": "NC1HWC0", "graph_level": 1},
    {"precision_mode": "cube_fp16in_fp32out"},
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "defaults")
def test_pipeline_is_idempotent_and_reports_json(params):
    """Grappler calls the optimizer once per meta-optimizer iteration: a second
    run on our own output must change nothing."""
    gd = cnn_training_graph()
    fetches = ["loss", "train"]
    once, rep1 = npu_amp_tf.rewrite_graph(gd, fetches=fetches, validate_graph=True, **params)
    twice, rep2 = npu_amp_tf.rewrite_graph(once, fetches=fetches, validate_graph=True, **params)
    assert Graph(once).validate() == []
    assert twice == once
    assert rep2.summary.get("casts_inserted", 0) == 0
    json.loads(rep1.dumps())
    assert rep1.summary["pipeline"][-1] == "cleanup"


def test_pipeline_failure_keeps_graph_and_names_the_pass(monkeypatch):
    from graph_passes import manager

    class Boom(manager.Pass):
        def run(self, graph, ctx):
            err = RuntimeError("kaboom")
            err.node = "loss"
            raise err

    monkeypatch.setitem(manager.PASS_REGISTRY, "precision", Boom)
    gd = cnn_training_graph()
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=["loss"])
    assert out == gd
    assert rep.summary["failed_pass"] == "precision"
    assert any("pass 'precision' at node 'loss'" in w["message"] for w in rep.warnings)
    with pytest.raises(npu_amp_tf.errors.PassError, match="kaboom"):
        npu_amp_tf.rewrite_graph(gd, fetches=["loss"], fail_on_error=True)


def test_function_bodies_are_rewritten_and_share_reported():
    # a call grappler will not inline (``_noinline``, as a shared function may
    # be) stays a call: its body is rewritten on its own, signature kept
    @tf.function(experimental_attributes={"_noinline": True})
    def inner(x, w):
        return tf.nn.relu(tf.matmul(x, w))

    @tf.function
    def outer(x, w):
        return tf.reduce_sum(inner(x, w))

    gd = outer.get_concrete_function(tf.TensorSpec([2, 4]), tf.TensorSpec([4, 3])).graph.as_graph_def()
    out, rep = npu_amp_tf.rewrite_graph(gd)
    assert [n.op for n in out.node if n.op.endswith("PartitionedCall")] == ["PartitionedCall"]
    body = [f for f in out.library.function if "inner" in f.signature.name][0]
    mm = [n for n in body.node_def if n.op == "MatMul"]
    assert mm and mm[0].attr["T"].type == tf.float16.as_datatype_enum
    assert rep.summary["functions_lp_flop_share"] == 1.0
    # and it still runs, with the signature unchanged
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(out, name="")
        with tf.compat.v1.Session(graph=g) as s:
            xv = np.ones((2, 4), np.float32)
            wv = np.full((4, 3), 0.5, np.float32)
            names = [n.name for n in out.node if n.op == "Placeholder"]
            res = s.run("Identity:0", dict(zip([f"{n}:0" for n in names], [xv, wv])))
    assert np.isclose(res, 12.0)
