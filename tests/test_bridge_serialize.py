"""The bridge's own writer of the item's bytes (issue 17, ``SerializeGraph``
in custom_ops/grappler_bridge.cc) equals TF's deterministic serialization
byte for byte: on real training graphs, on a graph with a function library,
debug info and the deprecated version field, and on nodes carrying every
kind of attr value, an experimental type, debug info, unknown fields and
empty names; and a graph rewritten through grappler is the same whichever
writer the bridge uses.  A graph of 1,024 nodes or more is planned and
written in two halves on two threads (``g_serialize_split``): the same
bytes as on one thread, also with every odd kind of node on both sides of
the split."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, full_type_pb2, graph_pb2, node_def_pb2

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

from npu_amp_tf import bridge  # noqa: E402


@pytest.fixture(autouse=True)
def _library():
    bridge.register()
    if getattr(bridge._lib, "NpuAmpSerializeGraph", None) is None:  # noqa: SLF001
        pytest.fail("the library has no NpuAmpSerializeGraph")


def test_the_writer_knows_this_tfs_messages():
    """Else every graph goes through the generated code and the comparisons
    below compare it with itself."""
    assert bridge._lib.NpuAmpSerializeKnownSchema() == 1  # noqa: SLF001


def _both(gd: graph_pb2.GraphDef):
    data = gd.SerializeToString()
    fast, ref = bridge.serialize_graph(data, True), bridge.serialize_graph(data, False)
    assert ref is not None and fast is not None
    one = bridge.serialize_graph(data, True, split=False)  # (the writer on one thread)
    assert one == fast
    return fast, ref


def _same(gd):
    fast, ref = _both(gd)
    assert fast == ref
    # and what TF's own Python serializer says (deterministic): the same message
    back = graph_pb2.GraphDef.FromString(fast)
    assert back == gd
    return fast


def test_keras_resnet50_training_graph():
    import precision as bench  # (tf.keras.applications.ResNet50's training step, TF1 graph)

    graph, fetches = bench.resnet50_training_graph()
    gd = bench.metagraph(graph, fetches).graph_def
    assert len(gd.node) > 5000
    _same(gd)


def test_bert_like_training_graph_with_a_function_library():
    from test_speed_paths import bert_like_training_graph

    gd = bert_like_training_graph()
    _same(gd)

    @tf.function
    def f(x):
        return tf.nn.relu(tf.matmul(x, x)) * 2.0

    fg = f.get_concrete_function(tf.TensorSpec([4, 4], tf.float32)).graph.as_graph_def()
    gd.library.CopyFrom(fg.library)
    gd.version = 7  # the deprecated field 3
    gd.debug_info.files.append("model.py")
    _same(gd)


def _attr(**kw):
    return attr_value_pb2.AttrValue(**kw)


def test_every_kind_of_node_and_attr():
    gd = graph_pb2.GraphDef()
    gd.versions.producer = 1234
    n = gd.node.add(name="a", op="Const", device="/device:CPU:0", input=["x", "^y", "", "z:3"])
    n.attr["type"].CopyFrom(_attr(type=tf.float16.as_datatype_enum))
    n.attr["neg"].CopyFrom(_attr(i=-5))
    n.attr["big"].CopyFrom(_attr(i=1 << 62))
    n.attr["zero_i"].CopyFrom(_attr(i=0))  # a set oneof member is written even when 0
    n.attr["f"].CopyFrom(_attr(f=-0.0))
    n.attr["nan"].CopyFrom(_attr(f=float("nan")))
    n.attr["b0"].CopyFrom(_attr(b=False))
    n.attr["b1"].CopyFrom(_attr(b=True))
    n.attr["s"].CopyFrom(_attr(s=b"\xff\x00bytes"))
    n.attr["s_empty"].CopyFrom(_attr(s=b""))
    n.attr["ph"].CopyFrom(_attr(placeholder="T"))
    n.attr["shape"].CopyFrom(_attr(shape=tf.TensorShape([None, 3]).as_proto()))
    n.attr["value"].CopyFrom(_attr(tensor=tf.make_tensor_proto(np.arange(6, dtype=np.float32))))
    n.attr["list"].CopyFrom(_attr(list=attr_value_pb2.AttrValue.ListValue(type=[1, 19], i=[-1, 2])))
    n.attr["empty_list"].CopyFrom(_attr(list=attr_value_pb2.AttrValue.ListValue()))
    n.attr["scalars"].CopyFrom(_attr(list=attr_value_pb2.AttrValue.ListValue(
        s=[b"loc:@a", b"", b"\x80"], i=[0, -(1 << 63), 300], f=[1.5, -0.0], b=[True, False], type=[19, 1, 0])))
    n.attr["shapes"].CopyFrom(_attr(list=attr_value_pb2.AttrValue.ListValue(
        s=[b"x"], shape=[tf.TensorShape([2]).as_proto()])))  # (not all scalars: the generated code)
    odd = _attr(i=3)
    odd.MergeFromString(b"\xf8\x01\x01")  # an unknown field on an AttrValue
    n.attr["odd"].CopyFrom(odd)
    odd_list = _attr(list=attr_value_pb2.AttrValue.ListValue(i=[1]))
    odd_list.list.MergeFromString(b"\xf8\x01\x01")  # and on a ListValue
    n.attr["odd_list"].CopyFrom(odd_list)
    fn = _attr(func=attr_value_pb2.NameAttrList(name="g"))
    fn.func.attr["z"].CopyFrom(_attr(i=1))
    fn.func.attr["a"].CopyFrom(_attr(type=1))  # (a nested map: sorted too)
    n.attr["func"].CopyFrom(fn)
    n.attr[""].CopyFrom(_attr())  # an empty key and no member set
    gd.node.add()  # no field at all
    gd.node.add(name="", op="NoOp", input=["a"])
    t = gd.node.add(name="typed", op="Identity", input=["a"])
    t.experimental_type.type_id = full_type_pb2.TFT_PRODUCT
    d = gd.node.add(name="debug", op="Identity", input=["a"])
    d.experimental_debug_info.original_node_names.append("orig")
    d.attr["T"].CopyFrom(_attr(type=1))
    u = node_def_pb2.NodeDef(name="unknown", op="Identity")
    raw = u.SerializeToString() + b"\xf8\x01\x07"  # field 31, varint 7: unknown to NodeDef
    gd.node.add().MergeFromString(raw)
    assert gd.node[-1].name == "unknown"
    fast, ref = _both(gd)
    assert fast == ref
    assert b"\xf8\x01\x07" in fast  # the unknown field kept


def test_every_kind_of_node_on_both_sides_of_the_split():
    """Above the split's threshold, the odd nodes (written whole by the
    generated code, unknown fields, no fields, many attrs) on both halves
    and at the boundary: the same bytes split, on one thread, and generated."""
    rng = np.random.default_rng(1)
    gd = graph_pb2.GraphDef()
    gd.versions.producer = 99
    n_nodes = 2049  # (halves of 1,024 and 1,025)
    for i in range(n_nodes):
        kind = i % 7 if i not in (1023, 1024, 1025) else 3
        if kind == 0:
            gd.node.add()  # no field at all
            continue
        n = gd.node.add(name=f"n{i}", op="Foo", input=[f"n{j}" for j in range(max(0, i - 3), i)])
        if kind == 1:
            n.experimental_debug_info.original_node_names.append(f"o{i}")
        elif kind == 2:
            n.MergeFromString(b"\xf8\x01\x07")  # an unknown field
        elif kind == 3:
            for k in rng.permutation(12):
                n.attr[f"k{k:02d}"].CopyFrom(_attr(i=int(k) - 6))
        elif kind == 4:
            n.attr["value"].CopyFrom(_attr(tensor=tf.make_tensor_proto(np.arange(3, dtype=np.float32))))
            n.device = "/device:CPU:0"
        elif kind == 5:
            n.experimental_type.type_id = full_type_pb2.TFT_PRODUCT
        else:
            n.attr["T"].CopyFrom(_attr(type=1))
    gd.library.function.add().signature.name = "fn"
    _same(gd)


def test_the_bridge_splits_by_its_switch():
    was = bridge.set_serialize_split(False)
    try:
        assert bridge.set_serialize_split(True) is False
        assert bridge.set_serialize_split(was) is True
    finally:
        bridge.set_serialize_split(was)


def test_many_attrs_in_random_insertion_order():
    rng = np.random.default_rng(0)
    gd = graph_pb2.GraphDef()
    for i in range(50):
        n = gd.node.add(name=f"n{i}", op="Foo", input=[f"n{j}" for j in range(i % 5)])
        for k in rng.permutation(40):
            n.attr[f"k{k:02d}{'x' * int(k % 7)}"].CopyFrom(_attr(i=int(k) - 20))
    _same(gd)


def test_grappler_output_is_the_same_with_either_writer():
    """The whole bridge (fingerprint, index, painting strings, the patch
    assembled from the item's bytes) gives the same graph with either writer."""
    import precision as bench
    from tensorflow.python.grappler import tf_optimizer

    graph, fetches = bench.bert_training_graph(layers=1)
    mg = bench.metagraph(graph, fetches)
    assert len(mg.graph_def.node) > 1024  # (split in two halves by the fast writer)
    outs = []
    was, was_split = bridge.set_serialize_fast(True), bridge.set_serialize_split(True)
    try:
        for fast, split in ((True, True), (False, True), (True, False), (True, True)):
            bridge.set_serialize_fast(fast)
            bridge.set_serialize_split(split)
            bridge.clear_reports()  # (no memo: every run rewrites)
            out = tf_optimizer.OptimizeGraph(bench.grappler_config("ours"), mg, graph_id=b"serialize_test")
            recs = bridge.last_reports()
            assert recs and recs[-1]["status"] == "rewritten", recs
            outs.append(out.SerializeToString(deterministic=True))
    finally:
        bridge.set_serialize_fast(was)
        bridge.set_serialize_split(was_split)
    assert outs[0] == outs[1] == outs[2] == outs[3]
    assert sum(n.op == "Cast" for n in graph_pb2.GraphDef.FromString(outs[0]).node) > 10  # (it did rewrite)
