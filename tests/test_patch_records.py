"""Patch records (issue 17): the nodes a pass only re-typed
(``Graph.note_retyped``) or re-wired (``Graph.add_and_rewire``) go to the
bridge as those edits on the input's NodeDef, not serialized whole
(``Graph.patch_records``, custom_ops/opdef_precheck.cc ``ParsePatch``).

Checked here against things the records do not compute themselves:

* on real training graphs, the patch assembled in C++ is the graph
  ``Graph.serialize`` gives, and every node sent as records differs from
  its input NodeDef only in type attrs and input strings (read off the two
  graphs; and colocation entries naming a removed node, dropped from every
  node);
* inside grappler the output is byte-identical with the records off;
* a node also edited another way is sent whole; edits of nodes removed or
  created since are skipped; malformed records are refused with a message.
"""
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2

import npu_amp_tf
from graph_passes.graph import Graph, _varint
from npu_amp_tf import bridge, pipeline
from test_precision_core import _build
from test_speed_paths import optimize_rewritten, plugin_only_grappler

tf1 = tf.compat.v1

pytestmark = pytest.mark.skipif(bridge.patch_records_version() != Graph.RECORDS_VERSION,
                                reason="the library does not read patch records")


def _patch(data, fetches, records=True, **params):
    old = pipeline.PATCH_RECORDS
    pipeline.PATCH_RECORDS = records
    try:
        opts = npu_amp_tf.Options.from_kwargs(**params)
        patch, _, _ = pipeline.optimize_serialized(data, opts, fetches=fetches, patch=True)
    finally:
        pipeline.PATCH_RECORDS = old
    return patch


def _only_types_and_inputs_differ(before: node_def_pb2.NodeDef, after: node_def_pb2.NodeDef) -> bool:
    a, b = node_def_pb2.NodeDef(), node_def_pb2.NodeDef()
    a.CopyFrom(before)
    b.CopyFrom(after)
    if len(a.input) != len(b.input):
        return False
    del a.input[:]
    del b.input[:]
    # (colocation with a node that is gone is dropped, as from every node)
    if "_class" in b.attr and not set(b.attr["_class"].list.s) <= set(a.attr["_class"].list.s):
        return False
    for n in (a, b):
        if "_class" in n.attr:
            del n.attr["_class"]
    for n in (a, b):
        for k in [k for k, v in n.attr.items() if v.WhichOneof("value") == "type"]:
            del n.attr[k]
    return a == b


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "learning_phase_functions",
                                  "slim_resnet_v1_50"])
def test_records_assemble_to_the_reference_on_real_graphs(k2, name):
    gd, fetches = _build(name, k2)
    data = gd.SerializeToString(deterministic=True)
    ref, _, _ = pipeline.optimize_serialized(data, npu_amp_tf.Options.from_kwargs(
        precision_mode="allow_mix_precision"), fetches=fetches)
    with_rec = _patch(data, fetches, precision_mode="allow_mix_precision")
    without = _patch(data, fetches, records=False, precision_mode="allow_mix_precision")
    records = [k for k, v in enumerate(with_rec.order) if v < -1]
    assert records, "no node went as records"
    # the same nodes changed; the records' nodes are no longer in the payload
    changed = sum(1 for v in without.order if v < 0)
    assert sum(1 for v in with_rec.order if v < 0) == changed
    assert len(with_rec.payload) < len(without.payload)
    out = graph_pb2.GraphDef.FromString(bridge.assemble_patch(data, with_rec))
    assert out.SerializeToString(deterministic=True) == ref
    # each record node: its input NodeDef with type attrs and inputs changed, nothing else
    for k in records:
        base = gd.node[-2 - with_rec.order[k]]
        assert base.name == out.node[k].name
        assert _only_types_and_inputs_differ(base, out.node[k]), out.node[k].name


@pytest.mark.parametrize("name", ["bert_like", "keras_resnet50_training"])
def test_records_through_grappler_equal_the_whole_nodes(k2, monkeypatch, name):
    gd, fetches = _build(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    real, seen, outs = Graph.serialize_patch, [], []

    def spy(self):
        p = real(self)
        seen.append(p is not None and min(p.order) < -1)
        return p

    monkeypatch.setattr(Graph, "serialize_patch", spy)
    for on in (True, False):
        monkeypatch.setattr(pipeline, "PATCH_RECORDS", on)
        outs.append(optimize_rewritten(cfg, mg, f"{name}-{on}".encode())[0])
    assert seen == [True, False]
    assert outs[0] == outs[1]


def _small():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 2], name="x")
        a = tf.identity(x, name="a")
        b = tf.identity(a, name="b")
        tf.identity(b, name="c")
    return g.as_graph_def()


def _half():
    return attr_value_pb2.AttrValue(type=tf.float16.as_datatype_enum).SerializeToString()


def _retype(g, names):
    for n in names:
        g.nodes[n].attr["T"].type = tf.float16.as_datatype_enum
    g.note_retyped([(list(names), (("T", _half()),))])


def _cast(name, src):
    n = node_def_pb2.NodeDef(name=name, op="Cast", input=[src])
    n.attr["SrcT"].type = tf.float32.as_datatype_enum
    n.attr["DstT"].type = tf.float16.as_datatype_enum
    return n


def _assembled(data, g):
    g.patch_records = True
    patch = g.serialize_patch()
    assert patch is not None
    out = graph_pb2.GraphDef.FromString(bridge.assemble_patch(data, patch))
    return patch, out


def test_record_nodes_rewired_and_retyped_assemble_to_serialize():
    data = _small().SerializeToString(deterministic=True)
    g = Graph(data)
    _retype(g, ["a", "b"])
    g.add_and_rewire([(_cast("x/CastToFp16", "x"), "a", 0, "x/CastToFp16")])
    patch, out = _assembled(data, g)
    names = [n.name for n in out.node]
    kinds = {names[k]: v for k, v in enumerate(patch.order)}
    assert kinds["a"] < -1 and kinds["b"] < -1 and kinds["x/CastToFp16"] == -1 and kinds["c"] >= 0
    assert out.SerializeToString(deterministic=True) == g.serialize()
    a = {n.name: n for n in out.node}["a"]
    assert list(a.input) == ["x/CastToFp16"] and a.attr["T"].type == tf.float16.as_datatype_enum


def test_record_node_edited_another_way_is_sent_whole():
    data = _small().SerializeToString(deterministic=True)
    g = Graph(data)
    _retype(g, ["a", "b"])
    g.nodes["b"].device = "/device:CPU:0"  # not a type attr: declared with touch
    g.touch("b")
    g.set_input("c", 0, "a")  # not through add_and_rewire: c is sent whole
    g.add_node(_cast("x/CastToFp16", "x"))
    patch, out = _assembled(data, g)
    kinds = {out.node[k].name: v for k, v in enumerate(patch.order)}
    assert kinds["a"] < -1 and kinds["b"] == -1 and kinds["c"] == -1
    assert out.SerializeToString(deterministic=True) == g.serialize()
    assert {n.name: n for n in out.node}["b"].device == "/device:CPU:0"


def test_records_of_removed_nodes_are_skipped():
    data = _small().SerializeToString(deterministic=True)
    g = Graph(data)
    _retype(g, ["a", "b", "c"])
    g.add_and_rewire([(_cast("x/CastToFp16", "x"), "c", 0, "x/CastToFp16")])
    g.remove_node("c")
    g.add_node(_cast("b/CastToFp16", "b"))  # (a node count other than the input's: a patch)
    patch, out = _assembled(data, g)
    assert "c" not in {n.name for n in out.node}
    assert out.SerializeToString(deterministic=True) == g.serialize()


def test_records_that_do_not_fit_are_refused():
    data = _small().SerializeToString(deterministic=True)
    g = Graph(data)
    _retype(g, ["a"])
    g.add_and_rewire([(_cast("x/CastToFp16", "x"), "a", 0, "x/CastToFp16")])
    g.patch_records = True
    patch = g.serialize_patch()
    # an order naming a record node without the records
    g2 = Graph(data)
    _retype(g2, ["a"])
    g2.add_node(_cast("x/CastToFp16", "x"))
    g2.patch_records = False
    plain = g2.serialize_patch()
    bad = plain._replace(order=type(plain.order)("i", [v if v >= 0 else -1 for v in plain.order]))
    bad.order[1] = -3
    with pytest.raises(ValueError, match="records are missing"):
        bridge.assemble_patch(data, bad)
    # a record re-wiring an input the node does not have
    blob = bytearray(patch.payload)
    at = blob.index(b"x/CastToFp16")  # the edit's input, after its (node, position) ints
    pos = at - 4 - 4  # the refs' length, then the position before it
    blob[pos:pos + 4] = (7).to_bytes(4, "little")
    with pytest.raises(ValueError, match="input a node does not have"):
        bridge.assemble_patch(data, patch._replace(payload=bytes(blob)))
    # records cut short (their field's length kept right)
    body, rest = _split_records(patch.payload)
    short = _field(body[:-4]) + rest
    with pytest.raises(ValueError, match="records do not parse"):
        bridge.assemble_patch(data, patch._replace(payload=short))


def _field(body):
    return _varint((Graph.RECORDS_FIELD << 3) | 2) + _varint(len(body)) + body


def _split_records(payload):
    """(the records' body, the payload after their field)."""
    tag = _varint((Graph.RECORDS_FIELD << 3) | 2)
    assert payload.startswith(tag)
    at, n, shift = len(tag), 0, 0
    while True:
        b = payload[at]
        at += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    return payload[at:at + n], payload[at + n:]
