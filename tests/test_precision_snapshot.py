"""Issue 17: the precision pass's "before" snapshot (``amp._Snapshot``), copied on write.

The deferred "before" figures (activation bytes, FLOP share) are computed
from a snapshot the pass fills lazily: a node is copied just before its
first in-place edit.  The snapshot must be exactly the graph the pass
received.  The expectation is taken from the input graph's own bytes before
the pass runs (not from the snapshot code), on real graphs in FP16 and
BF16, where the pass re-types, rewires and adds nodes.  And
``registry.retype`` (one map lookup per attr) sets a present and an absent attr.
"""
import pytest
from tensorflow.core.framework import node_def_pb2

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


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "keras_transformer_training"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_the_before_graph_is_the_input_graph(k2, name, mode):
    gd, fetches = _graph(name, k2)
    graph = Graph(gd)
    want = _nodes_bytes(graph.nodes.values())  # the input, before the pass touches it
    order = list(graph.nodes)
    ctx = PassContext(Options.from_kwargs(precision_mode=mode), fetches, ())
    ctx.native_paint = pipeline.native_paint_entry()
    pp = amp.PrecisionPass()
    pp.run(graph, ctx)
    edited = [n for n in order if n in graph.nodes
              and graph.nodes[n].SerializeToString(deterministic=True) != want[n]]
    assert len(edited) > 50, "the pass edited few of the input's nodes in place"
    assert pp.casts_inserted > 0
    before = pp._before.graph_def()
    assert [n.name for n in before.node] == order
    assert _nodes_bytes(before.node) == want


def test_retype_sets_a_present_and_an_absent_attr():
    n = node_def_pb2.NodeDef(name="n", op="Mul")
    n.attr["T"].type = registry.DT_FLOAT
    registry.retype(n, ("T", "U"), registry.DT_HALF)
    assert n.attr["T"].type == registry.DT_HALF and n.attr["U"].type == registry.DT_HALF


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
@pytest.mark.parametrize("pristine", [True, False])
def test_unedited_nodes_come_from_the_source_bytes(k2, monkeypatch, name, mode, pristine):
    """As in the pipeline: the graph built from bytes (``source_bytes``), the
    fusion pass first (it edits and creates nodes), then the precision pass.
    The snapshot keeps only indexes for the nodes the fusion pass left alone
    (``pristine``, ``_Snapshot.pristine_from_source``: it records nothing for
    them and copies only the others), and is still exactly the graph the
    precision pass received."""
    from graph_passes.fusion.fusion_pass import FusionPass
    from tensorflow.core.framework import graph_pb2

    monkeypatch.setattr(amp._Snapshot, "pristine_from_source", pristine)
    gd, fetches = _graph(name, k2)
    data = gd.SerializeToString()
    parsed = graph_pb2.GraphDef()
    parsed.ParseFromString(data)
    graph = Graph(parsed, index=bridge.graph_index(parsed, data), copy=False)
    graph.source_bytes = data
    ctx = PassContext(Options.from_kwargs(precision_mode=mode), fetches, ())
    ctx.native_paint = pipeline.native_paint_entry()
    FusionPass().run(graph, ctx)
    if name == "bert_like":  # (its layer norms are fused: a mixed snapshot)
        assert graph.created and graph.modified, "the fusion pass changed nothing"
    want = _nodes_bytes(graph.nodes.values())  # what the precision pass receives
    order = list(graph.nodes)
    pp = amp.PrecisionPass()
    pp.run(graph, ctx)
    saved = pp._before._saved
    if pristine:  # (nothing recorded for the source's nodes: they are the rest)
        assert not any(type(v) is int for v in saved.values())
        lazy = [n for n in order if n not in pp._before._dirty]
    else:
        lazy = [n for n, v in saved.items() if type(v) is int]
    copied = [n for n, v in saved.items() if type(v) is not int]
    assert len(lazy) > 100, "few nodes were left as indexes into the source"
    assert all(n not in graph.created for n in lazy)
    before = pp._before.graph_def()
    assert [n.name for n in before.node] == order
    assert _nodes_bytes(before.node) == want
    # nodes the fusion pass edited or made are copies
    assert all(n in graph.created or n in graph.modified for n in copied)
    if name == "bert_like":
        assert copied


@pytest.mark.parametrize("pristine", [True, False])
def test_a_node_edited_by_hand_without_touch_would_show(monkeypatch, pristine):
    """Planted: a node edited in place without ``touch`` (a pass breaking
    the rule ``serialize_patch`` relies on too) makes the snapshot differ
    from the graph the pass received; the check above sees such a fault."""
    from tensorflow.core.framework import graph_pb2

    from test_precision_native import unsafe_constants_graph

    gd, fetches = unsafe_constants_graph()
    data = gd.SerializeToString()
    parsed = graph_pb2.GraphDef()
    parsed.ParseFromString(data)
    graph = Graph(parsed, index=bridge.graph_index(parsed, data), copy=False)
    graph.source_bytes = data
    monkeypatch.setattr(amp._Snapshot, "pristine_from_source", pristine)
    victim = next(n for n in graph.nodes.values() if n.op == "MatMul")
    victim.attr["_planted"].b = True  # (no touch: the graph does not know)
    want = _nodes_bytes(graph.nodes.values())
    ctx = PassContext(Options.from_kwargs(precision_mode="allow_mix_precision"), fetches, ())
    ctx.native_paint = pipeline.native_paint_entry()
    pp = amp.PrecisionPass()
    pp.run(graph, ctx)
    if pristine:  # (taken from the source when the figures are read)
        assert victim.name not in pp._before._saved and victim.name not in pp._before._dirty
    else:
        assert type(pp._before._saved.get(victim.name)) is int
    assert _nodes_bytes(pp._before.graph_def().node) != want


@pytest.mark.parametrize("op", ["Mul", "_FusedConv2D"])
@pytest.mark.parametrize("attrs", [("T", "U"), ("T",), ("U",)])
def test_retype_all_equals_retype_per_node(op, attrs):
    """The per-class batch sets what ``retype`` sets node by node, tied
    list attrs (``_FusedConv2D``'s TArgs) included; one attr (the batch's
    own loop) or two, present (T) or absent (U)."""
    def make(k):
        n = node_def_pb2.NodeDef(name=f"n{k}", op=op)
        n.attr["T"].type = registry.DT_FLOAT
        if op == "_FusedConv2D":
            n.attr["TArgs"].list.type.extend([registry.DT_FLOAT, 3])  # (3: DT_INT32)
        return n

    one, many = [make(k) for k in range(3)], [make(k) for k in range(3)]
    for dt in (registry.DT_HALF, registry.DT_FLOAT):
        for n in one:
            registry.retype(n, attrs, dt)
        registry.retype_all(many, op, attrs, dt)
        assert [n.SerializeToString(deterministic=True) for n in one] == \
            [n.SerializeToString(deterministic=True) for n in many]



@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_batched_saves_equal_the_per_node_ones(k2, monkeypatch, name):
    """``PrecisionPass.batch_saves`` (issue 17: a re-typing batch's snapshot
    saves and memo drops for the whole batch) leaves what the per-node calls
    leave: the same snapshot entries in the same order (source indexes, or
    copies with the same bytes), the same memos, the same graph; as in the
    pipeline (bytes, the C++ index, the fusion pass first)."""
    from graph_passes.fusion.fusion_pass import FusionPass
    from tensorflow.core.framework import graph_pb2

    gd, fetches = _graph(name, k2)
    data = gd.SerializeToString()
    seen = []
    orig = amp._Snapshot.save_all

    def save_all(self, names):
        if amp.PrecisionPass.batch_saves:  # (Snapshot.save, the per-node path, calls it too)
            seen.append(len(names))
        return orig(self, names)

    monkeypatch.setattr(amp._Snapshot, "save_all", save_all)
    res = {}
    for batch in (True, False):
        monkeypatch.setattr(amp.PrecisionPass, "batch_saves", batch)
        parsed = graph_pb2.GraphDef.FromString(data)
        graph = Graph(parsed, index=bridge.graph_index(parsed, data), copy=False)
        graph.source_bytes = data
        ctx = PassContext(Options.from_kwargs(precision_mode="allow_mix_precision"), fetches, ())
        ctx.native_paint = pipeline.native_paint_entry()
        FusionPass().run(graph, ctx)
        pp = amp.PrecisionPass()
        pp.run(graph, ctx)
        saved = [(n, v if type(v) is int else v.SerializeToString(deterministic=True))
                 for n, v in pp._before._saved.items()]
        memos = (list(pp._dts), list(pp._keys), None if pp._cls is None else sorted(pp._cls.items()))
        res[batch] = (saved, memos, graph.to_graph_def().SerializeToString(deterministic=True))
    assert sum(seen) > 100, seen  # the batched path ran, over the re-typed nodes
    assert res[True][0] == res[False][0]
    assert res[True][1] == res[False][1]
    assert res[True][2] == res[False][2]
