"""Issue 17: the precision pass's "before" snapshot of nodes it only re-types.

``_Snapshot.lazy_retypes`` keeps a node whose only edits are re-typings as
its old attr types instead of a NodeDef copy; the copy is made when the node
is next edited otherwise or when the graph is assembled, with those types put
back.  The snapshot must be exactly the graph the pass received: that is the
expectation here, taken from the input graph's own bytes before the pass
runs (not from the snapshot code), on real graphs in FP16 and BF16, and on
a hand-made node re-typed twice, through two attrs, one of them absent.
"""
import pytest
from tensorflow.core.framework import graph_pb2, node_def_pb2

from graph_passes import registry
from graph_passes.graph import Graph
from graph_passes.manager import PassContext
from graph_passes.precision import amp
from npu_amp_tf import bridge, pipeline
from npu_amp_tf.options import Options
from test_precision_native import _graph


@pytest.fixture(autouse=True)
def _library():
    bridge.register()


def _nodes_bytes(nodes):
    return {n.name: n.SerializeToString(deterministic=True) for n in nodes}


def _run(gd, fetches, mode, lazy, monkeypatch):
    monkeypatch.setattr(amp._Snapshot, "lazy_retypes", lazy)
    graph = Graph(gd)
    want = _nodes_bytes(graph.nodes.values())  # the input, before the pass touches it
    order = list(graph.nodes)
    ctx = PassContext(Options.from_kwargs(precision_mode=mode), fetches, ())
    ctx.native_paint = pipeline.native_paint_entry()
    pp = amp.PrecisionPass()
    records = {}
    orig = amp._Snapshot.retype

    def retype(self, node, attrs, dt):
        orig(self, node, attrs, dt)
        records.update(self._retyped)  # (what the lazy path kept instead of copies)

    monkeypatch.setattr(amp._Snapshot, "retype", retype)
    pp.run(graph, ctx)
    before = pp._before.graph_def()
    return want, order, before, records, graph


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "keras_transformer_training"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_the_before_graph_is_the_input_graph(k2, monkeypatch, name, mode):
    gd, fetches = _graph(name, k2)
    want, order, before, records, after = _run(gd, fetches, mode, True, monkeypatch)
    # the pass re-typed nodes, and kept some as old types only
    assert records, "no node was kept as its old types"
    retyped_changed = [n for n in records if after.nodes[n].SerializeToString(deterministic=True) != want[n]]
    assert retyped_changed, "the nodes kept as old types were not changed by the pass"
    got = [n.name for n in before.node]
    assert got == order
    assert _nodes_bytes(before.node) == want
    # and the reference (a copy before the first re-typing) gives the same bytes
    gd2, _ = _graph(name, k2)
    _, _, before_ref, records_ref, _ = _run(gd2, fetches, mode, False, monkeypatch)
    assert not records_ref
    assert before_ref.SerializeToString(deterministic=True) == before.SerializeToString(deterministic=True)


def test_two_retypings_an_absent_attr_and_a_later_edit(monkeypatch):
    monkeypatch.setattr(amp._Snapshot, "lazy_retypes", True)
    gd = graph_pb2.GraphDef()
    a = gd.node.add(name="a", op="Placeholder")
    a.attr["dtype"].type = registry.DT_FLOAT
    for name in ("m", "k"):
        m = gd.node.add(name=name, op="Mul", input=["a", "a"])
        m.attr["T"].type = registry.DT_FLOAT
    want = {n.name: n.SerializeToString(deterministic=True) for n in gd.node}
    graph = Graph(gd)
    snap = amp._Snapshot(graph, list(graph.nodes), copy_on_write=True)
    m, k = graph.nodes["m"], graph.nodes["k"]
    snap.retype(m, ("T",), registry.DT_HALF)
    snap.retype(m, ("T", "Tx"), registry.DT_FLOAT)  # "Tx" was absent: it goes again
    snap.retype(k, ("T",), registry.DT_BFLOAT16)
    assert set(snap._retyped) == {"m", "k"}
    snap.save("k")  # a later edit of k: its copy is made now, with its old type
    graph.set_input("k", 1, "m")
    assert "k" not in snap._retyped
    assert m.attr["Tx"].type == registry.DT_FLOAT and k.attr["T"].type == registry.DT_BFLOAT16
    got = {n.name: n.SerializeToString(deterministic=True) for n in snap.graph_def().node}
    assert got == want
    assert not snap._retyped


def test_fused_args_follow_and_are_put_back(monkeypatch):
    """An op whose list(type) attr follows its type (``_FusedConv2D``'s TArgs)
    is copied whole before it is re-typed (the lazy record holds type attrs only)."""
    monkeypatch.setattr(amp._Snapshot, "lazy_retypes", True)
    gd = graph_pb2.GraphDef()
    c = gd.node.add(name="c", op="_FusedConv2D", input=["x", "w", "b"])
    c.attr["T"].type = registry.DT_FLOAT
    c.attr["TArgs"].list.type.append(registry.DT_FLOAT)
    want = c.SerializeToString(deterministic=True)
    graph = Graph(gd)
    snap = amp._Snapshot(graph, list(graph.nodes), copy_on_write=True)
    node = graph.nodes["c"]
    snap.retype(node, ("T",), registry.DT_BFLOAT16)
    assert list(node.attr["TArgs"].list.type) == [registry.DT_BFLOAT16]
    assert not snap._retyped and "c" in snap._saved
    assert snap.graph_def().node[0].SerializeToString(deterministic=True) == want


def test_retype_returns_the_old_types():
    n = node_def_pb2.NodeDef(name="n", op="Mul")
    n.attr["T"].type = registry.DT_FLOAT
    assert registry.retype(n, ("T", "U"), registry.DT_HALF) == [registry.DT_FLOAT, None]
    assert n.attr["T"].type == registry.DT_HALF and n.attr["U"].type == registry.DT_HALF
