"""unfuse: grappler's remapper output is split where low precision needs it."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

import npu_amp_tf
from graph_passes import registry
from graph_passes.graph import Graph


def fused_matmul_graph(act="Tanh"):
    """x @ w + b -> act, as grappler's remapper leaves it (golden structure case)."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        tf.constant(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), name="w")
        tf.constant(np.linspace(-0.5, 0.5, 4, dtype=np.float32), name="b")
    gd = graph_pb2.GraphDef()
    gd.CopyFrom(g.as_graph_def())
    n = gd.node.add(name="fused", op="_FusedMatMul")
    n.input.extend(["x", "w", "b"])
    n.attr["T"].type = types_pb2.DT_FLOAT
    n.attr["num_args"].i = 1
    n.attr["transpose_a"].b = False
    n.attr["transpose_b"].b = False
    n.attr["epsilon"].f = 0.0001
    n.attr["fused_ops"].list.s.extend([b"BiasAdd", act.encode()])
    return gd


def run(gd, x):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
        with tf.compat.v1.Session(graph=g) as s:
            return s.run("fused:0", {"x:0": x})


BF16_KERNEL = registry.has_kernel("_FusedMatMul", "CPU", {"T": types_pb2.DT_BFLOAT16})


@pytest.mark.skipif(not BF16_KERNEL, reason="no bfloat16 _FusedMatMul CPU kernel in this TF build")
def test_black_listed_activation_is_split_out_of_a_low_precision_fused_op():
    gd = fused_matmul_graph("Tanh")
    x = np.array([[0.1, -0.2, 0.3], [0.4, 0.5, -0.6]], np.float32)
    ref = run(gd, x)
    kept, rep = npu_amp_tf.rewrite_graph(gd, fetches=["fused"], precision_mode="allow_mix_precision_bf16")
    assert rep.decisions["fused"]["unfuse"] == "kept"       # a bf16 kernel exists: stays fused
    split, rep2 = npu_amp_tf.rewrite_graph(gd, fetches=["fused"], precision_mode="allow_mix_precision_bf16",
                                           custom_black_list=["Tanh"])
    assert rep2.decisions["fused"]["unfuse"] == "split"
    assert "black-listed" in rep2.decisions["fused"]["unfuse_reason"]
    G = Graph(split)
    assert G.nodes["fused"].op == "Tanh" and G.nodes["fused"].attr["T"].type == types_pb2.DT_FLOAT
    # the matrix compute (re-fused with its bias by the fusion pass, without Tanh) runs in bf16
    mm = [n for n in G.nodes.values() if n.op in ("MatMul", "_FusedMatMul")]
    assert len(mm) == 1 and mm[0].attr["T"].type == types_pb2.DT_BFLOAT16
    assert b"Tanh" not in list(mm[0].attr["fused_ops"].list.s)
    np.testing.assert_allclose(run(split, x), ref, atol=2e-2)


def test_no_split_when_precision_keeps_fp32():
    gd = fused_matmul_graph("Relu")
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=["fused"], precision_mode="must_keep_origin_dtype")
    assert [n.op for n in out.node if n.name == "fused"] == ["_FusedMatMul"]
    assert rep.pass_stats("unfuse")["unfused"] == 0


def test_fused_nodes_visited_in_graph_order_from_the_op_index(monkeypatch):
    """17g: the pass finds the fused nodes through ``Graph.nodes_of_type``
    (graph order) instead of walking every node: the rewritten graph and the
    report equal those of a walk of every node in graph order (the
    reference), on a graph whose fused nodes are interleaved with others and
    chained (each split re-adds the fused node's name)."""
    gd = fused_matmul_graph("Relu")
    prev = "fused"
    for i in range(4):  # a chain: fused_i reads the previous one, a Tanh between
        t = gd.node.add(name=f"t{i}", op="Tanh")
        t.input.append(prev)
        t.attr["T"].type = types_pb2.DT_FLOAT
        w = gd.node.add(name=f"w{i}", op="Const")
        w.attr["dtype"].type = types_pb2.DT_FLOAT
        w.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.eye(4, dtype=np.float32)))
        n = gd.node.add()
        n.CopyFrom(next(x for x in gd.node if x.name == "fused"))
        n.name = f"fused{i}"
        n.input[:] = [f"t{i}", f"w{i}", "b"]
        prev = n.name
    # the fused nodes out of name order in the GraphDef
    nodes = list(gd.node)
    nodes.insert(0, nodes.pop(len(nodes) - 4))
    del gd.node[:]
    gd.node.extend(nodes)

    def rewrite():
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[prev], precision_mode="allow_mix_precision")
        decided = [n for n, d in rep.decisions.items() if "unfuse" in d]
        return out.SerializeToString(deterministic=True), decided, rep.pass_stats("unfuse")

    fast = rewrite()
    from graph_passes import unfuse

    def walk_all(graph, ops):  # the reference: every node, in graph order
        ops = (ops,) if isinstance(ops, str) else tuple(ops)
        return [n for n, node in graph.nodes.items() if node.op in ops]

    monkeypatch.setattr(Graph, "nodes_of_type", walk_all)
    ref = rewrite()
    assert unfuse.FUSED_OPS == ("_FusedConv2D", "_FusedMatMul")
    assert fast == ref
    assert fast[2]["unfused"] == 5 and len(fast[1]) == 5, fast[1:]
    assert fast[1] == [n.name for n in gd.node if n.op == "_FusedMatMul"]
