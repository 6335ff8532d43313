"""Issue 17: the nodes a graph makes share one protobuf arena (``Graph.blank_node``,
``graph.SHARED_ARENA``).

Python's protobuf (upb) gives every NodeDef made on its own an arena of its own (~3 allocations
for a Cast), and calls ``malloc_trim(0)`` after every 10,000 arena blocks the process frees. The
trim hands the heap's free pages back to the kernel, and the next grappler callback faults them
in again: ~12k minor faults, ~3-4 ms on a BERT-12 item, on every fifth callback before this
change (every ninth after it). The nodes the passes make (``Graph.new_node``, the precision
pass's Casts, the fusion rules' emitted nodes) now come from one ``GraphDef`` per graph.

Checked:
* the whole pipeline gives byte-identical GraphDefs and equal reports with the switch on and
  off, on the BERT-like builder, Keras ResNet-50, a Keras transformer block and TF-Slim's
  ResNet-v1-50, in FP16 and BF16 (level 3: attention with its region);
* through grappler on a BERT-base-like item, the same output and report both ways;
* every node the passes created is held by the graph's shared arena (the same message the graph
  edits), and none is with the switch off;
* a node made there behaves as one made on its own: edits, copies into another GraphDef,
  removal and re-adding.
"""
import pytest
from tensorflow.core.framework import graph_pb2, node_def_pb2

import npu_amp_tf
from graph_passes import graph as graph_mod
from graph_passes.graph import Graph
from graph_passes.precision import native
from npu_amp_tf import bridge, pipeline
from real_models import bert_training_graph
from test_fusion_skip import MODES
from test_precision_fast import _strip_times
from test_speed_paths import optimize_rewritten, plugin_only_grappler


def _rewrite_keeping_graph(monkeypatch, gd, fetches, shared, kw):
    """(output bytes, report, the pipeline's Graph) with the switch set."""
    monkeypatch.setattr(graph_mod, "SHARED_ARENA", shared)
    made = []

    class Kept(Graph):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(pipeline, "Graph", Kept)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, **kw)
    monkeypatch.setattr(pipeline, "Graph", Graph)
    return out.SerializeToString(deterministic=True), _strip_times(rep.to_json()), made[0]


def _in_scratch(g):
    """The names of the nodes of ``g`` whose message is one of its shared arena's."""
    if g._scratch is None:
        return set()
    ids = {id(n) for n in g._scratch.node}
    return {name for name, node in g.nodes.items() if id(node) in ids}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_pipeline_equal_with_and_without_the_shared_arena(real_graphs, monkeypatch, mode):
    for label, gd, fetches in real_graphs:
        out, rep, g = _rewrite_keeping_graph(monkeypatch, gd, fetches, True, MODES[mode])
        ref, ref_rep, g_ref = _rewrite_keeping_graph(monkeypatch, gd, fetches, False, MODES[mode])
        assert rep["summary"].get("failed_pass") is None, (label, rep["warnings"][:3])
        assert out == ref, f"{label} {mode}: the shared arena changed the graph"
        assert rep == ref_rep, f"{label} {mode}: the shared arena changed the report"
        created = {n for n in g.created if n in g.nodes}
        assert created, f"{label} {mode}: no node created, the comparison is vacuous"
        # every node a pass made is the arena's own message (the one the graph edits)
        assert created <= _in_scratch(g), (label, mode, sorted(created - _in_scratch(g))[:5])
        assert g_ref._scratch is None and not _in_scratch(g_ref)


def test_the_same_output_through_grappler(monkeypatch):
    bridge.register()
    g, fetches = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
    mg, cfg = plugin_only_grappler(g.as_graph_def(), fetches)
    outs = []
    for shared in (True, False):
        monkeypatch.setattr(graph_mod, "SHARED_ARENA", shared)
        outs.append(optimize_rewritten(cfg, mg, b"test_shared_arena"))
    (out, rep), (ref, ref_rep) = outs
    assert out == ref and _strip_times(rep) == _strip_times(ref_rep)


def test_a_node_made_in_the_arena_behaves_as_one_made_alone():
    gd = graph_pb2.GraphDef()
    gd.node.add(name="x", op="Placeholder").attr["dtype"].type = 1
    g = Graph(gd)
    a = g.new_node("Identity", "a", ["x"], {"T": 1}, device="/device:CPU:0")
    c = native.cast_node({}, 1, 19, "", "c", "a", g.blank_node)
    g.add_node(c)
    assert [n.name for n in g._scratch.node] == ["a", "c"]
    # an edit through the graph's message is the arena's (the same storage)
    g.set_input("c", 0, "x")
    a.attr["T"].type = 19
    assert g._scratch.node[1].input[:] == ["x"] and g._scratch.node[0].attr["T"].type == 19
    alone = node_def_pb2.NodeDef(name="c", op="Cast", input=["x"])
    for k, t in (("SrcT", 1), ("DstT", 19)):
        alone.attr[k].type = t
    alone.attr["Truncate"].b = False
    assert c.SerializeToString(deterministic=True) == alone.SerializeToString(deterministic=True)
    # copied into another GraphDef, then changed there: the graph's node stays as it was
    out = g.to_graph_def()
    assert [n.name for n in out.node] == ["x", "a", "c"]
    out.node[2].name = "renamed"
    assert g.nodes["c"].name == "c"
    # removed and added again: the same message
    node = g.nodes["a"]
    g.remove_node("a", force=True)
    g.add_node(node)
    assert g.nodes["a"] is node and g.nodes["a"].attr["T"].type == 19
    # the switch off: each node on its own
    graph_mod.SHARED_ARENA = False
    try:
        g2 = Graph(gd)
        g2.new_node("Identity", "a", ["x"], {"T": 1})
        assert g2._scratch is None
    finally:
        graph_mod.SHARED_ARENA = True
