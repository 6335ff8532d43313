"""The fast paths of issue 17h outside the passes: the OpDef guard reads
only the edges from changed nodes into their unchanged readers
(``opdef_check.FAST_READERS``), and inside grappler the bridge hands back
the nodes the pipeline changed plus the positions of the unchanged ones
(``Graph.serialize_patch``, assembled in C++ from the item grappler holds)
instead of the whole graph's bytes.  Each is compared with its reference
path, and a planted fault in each is caught."""
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import npu_amp_tf
from graph_passes import manager, opdef_check, registry
from graph_passes.graph import Graph
from npu_amp_tf import pipeline
from real_models import bert_training_graph

tf1 = tf.compat.v1


def _guard(gd, g, changed, fast):
    old = opdef_check.FAST_READERS
    opdef_check.FAST_READERS = fast
    try:
        return opdef_check.new_problems(gd, g, "CPU", changed)
    finally:
        opdef_check.FAST_READERS = old


def _reader_graph():
    """A Cast feeding MatMuls whose input lists are odd: control inputs
    before the data inputs, a hundred control inputs after them, one MatMul
    with three data inputs (an arity problem the input already has), one
    reading output 1 of the Cast (which has one)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 2], name="x")
        c = tf.raw_ops.Cast(x=x, DstT=tf.float32, name="c")
        for k in range(5):
            tf.matmul(c, x, name=f"mm{k}")
        for k in range(100):
            tf.no_op(name=f"dep{k}")
    gd = g.as_graph_def()
    nodes = {n.name: n for n in gd.node}
    mm = nodes["mm1"]
    data = list(mm.input)
    del mm.input[:]
    mm.input.extend(["^dep0", "^dep1", *data])  # control before data
    nodes["mm2"].input.extend([f"^dep{k}" for k in range(100)])
    nodes["mm3"].input.append("x")  # three data inputs: the input's own arity problem
    nodes["mm4"].input[0] = "c:1"  # reads an output the Cast lacks
    return gd


def test_guard_fast_readers_equal_the_reference_on_odd_input_lists():
    """A Cast the 'pass' turns to FP16 (set through the graph): every reader
    is unchanged, so the fast guard checks only its edge from the Cast.
    Expected, from the graph's construction: a new edge problem at mm0, mm1
    (data input 0 after two control inputs) and mm2 (before 100 control
    inputs); nothing at mm3 (the input's arity problem hides its edges) and
    nothing new at mm4 (its bad port is the input's problem)."""
    gd = _reader_graph()
    g = Graph(gd)
    g.nodes["c"].attr["DstT"].type = registry.DT_HALF
    g.touch("c")
    changed = g.changed_nodes()
    assert changed == {"c"}
    ref = _guard(gd, g, changed, False)
    fast = _guard(gd, g, changed, True)
    full = _guard(gd, g, None, False)
    assert fast == ref == full
    assert [p.split("'")[3] for p in fast] == ["mm0", "mm1", "mm2"], fast
    assert all("carries float16 but MatMul expects float32" in p for p in fast), fast
    assert "'c' -> 'mm1':0" in fast[1]


def test_guard_fast_readers_planted_fault_is_caught(monkeypatch):
    """The same graph with the fast path's edge check on readers planted
    away: the comparison above would fail."""
    gd = _reader_graph()
    g = Graph(gd)
    g.nodes["c"].attr["DstT"].type = registry.DT_HALF
    g.touch("c")
    monkeypatch.setattr(Graph, "_edge_problems_at", lambda *a: None)
    assert _guard(gd, g, g.changed_nodes(), True) != _guard(gd, g, g.changed_nodes(), False)


@pytest.mark.parametrize("params", [dict(precision_mode="allow_mix_precision"),
                                    dict(precision_mode="allow_mix_precision_bf16", graph_level=3)],
                         ids=["fp16", "bf16-level3"])
def test_guard_fast_readers_on_training_graphs_with_planted_faults(params):
    """BERT-like training graph through the passes: the fast guard and the
    reference find nothing; then a fault at an unchanged reader of a changed
    node (its input re-pointed at a low-precision tensor, through the graph,
    which marks the reader changed; and the same edit made by hand and
    declared on the producer only) is found by both, with the same text."""
    gd, fetches = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50,
                                      ffn=64)
    gd = gd.as_graph_def()
    opts = npu_amp_tf.Options.from_kwargs(**params)
    g = Graph(gd)
    manager.PassManager(pipeline.pass_names(opts)).run(g, manager.PassContext(opts, fetches))
    changed = g.changed_nodes()
    assert _guard(gd, g, changed, True) == _guard(gd, g, changed, False) == []
    # an unchanged FP32 reader of a changed node
    low = next(n for n in sorted(changed) if n in g.nodes and g.nodes[n].op == "Cast"
               and g.nodes[n].attr["DstT"].type in registry.LOW_TYPES)
    cands = [n for n, node in g.nodes.items() if n not in changed and node.op in ("MatMul", "Mul", "AddV2")
             and "T" in node.attr and node.attr["T"].type == registry.DT_FLOAT]
    reader = cands[0]
    g.nodes[reader].input[0] = low  # by hand: the reader's edit is not declared...
    g.reindex()
    g.touch(low)  # ...only the producer's
    ref, fast = _guard(gd, g, g.changed_nodes(), False), _guard(gd, g, g.changed_nodes(), True)
    assert fast == ref and any(f"'{low}' -> '{reader}':0" in p for p in fast), fast


# ------------------------------------------------------ the output as a patch
from npu_amp_tf import bridge  # noqa: E402
from test_precision_core import GRAPHS, _build  # noqa: E402
from test_speed_paths import optimize_rewritten, plugin_only_grappler  # noqa: E402


def _patch_and_reference(gd, fetches, **params):
    """(patch, reference bytes) of the pipeline on ``gd``'s deterministic
    bytes, the patch assembled by the C++ library on those bytes."""
    data = gd.SerializeToString(deterministic=True)
    opts = npu_amp_tf.Options.from_kwargs(**params)
    ref, _, n_ref = pipeline.optimize_serialized(data, opts, fetches=fetches)
    patch, _, n = pipeline.optimize_serialized(data, opts, fetches=fetches, patch=True)
    assert n == n_ref
    return data, patch, ref


def _assembled_equals_reference(data, patch, ref):
    out = bridge.assemble_patch(data, patch)
    assert out is not None, "the library has no NpuAmpAssemblePatch"
    a, b = graph_pb2.GraphDef.FromString(out), graph_pb2.GraphDef.FromString(ref)
    # the same message, and byte-identical once serialized by the same side
    return a == b and a.SerializeToString(deterministic=True) == ref


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_patch_assembles_to_the_reference_bytes(k2, name, mode):
    """On every test graph (Keras ResNet50 training, BERT-like, a learning
    phase with functions, control inputs, a v1 loop, type lists and an
    unknown op, TF-Slim resnet_v1_50), FP16 and BF16: the patch assembled
    in C++ from the input graph is the GraphDef of ``Graph.serialize``'s
    bytes, and re-serialized, those very bytes."""
    gd, fetches = _build(name, k2)
    data, patch, ref = _patch_and_reference(gd, fetches, precision_mode=mode)
    if isinstance(patch, bytes):  # the node count did not change: the reference bytes
        assert patch == ref
        return
    assert patch.nodes == len(graph_pb2.GraphDef.FromString(ref).node)
    assert sum(1 for k in patch.order if k < 0) < len(patch.order)  # most nodes copied
    assert _assembled_equals_reference(data, patch, ref)


def test_patch_drops_colocation_with_missing_nodes_like_the_reference():
    """Unchanged nodes colocated with a node that does not exist: the
    reference serialization drops those entries (keeping the others), and so
    does the C++ assembly of the patch."""
    gd, fetches = bert_training_graph(layers=1, hidden=16, heads=2, seq=4, batch=2, vocab=20, ffn=16)
    gd = gd.as_graph_def()
    _, _, first = _patch_and_reference(gd, fetches, precision_mode="allow_mix_precision")
    kept = {n.name: n for n in graph_pb2.GraphDef.FromString(first).node}
    unchanged = [n for n in gd.node if n.op == "Const" and "_class" not in n.attr
                 and kept.get(n.name) == n][:3]
    assert len(unchanged) == 3
    unchanged[0].attr["_class"].list.s.extend([b"loc:@ghost"])
    unchanged[1].attr["_class"].list.s.extend([b"loc:@ghost", f"loc:@{gd.node[0].name}".encode(), b"x"])
    unchanged[2].attr["_class"].list.s.extend([f"loc:@{gd.node[0].name}".encode()])
    data, patch, ref = _patch_and_reference(gd, fetches, precision_mode="allow_mix_precision")
    assert not isinstance(patch, bytes)
    out = {n.name: n for n in graph_pb2.GraphDef.FromString(ref).node}
    assert "_class" not in out[unchanged[0].name].attr
    assert list(out[unchanged[1].name].attr["_class"].list.s) == [f"loc:@{gd.node[0].name}".encode(), b"x"]
    assert len(out[unchanged[2].name].attr["_class"].list.s) == 1
    # they are among the nodes the C++ side copies from the input
    copied = {gd.node[k].name for k in patch.order if k >= 0}
    assert {n.name for n in unchanged} <= copied
    assert _assembled_equals_reference(data, patch, ref)


def test_patch_planted_fault_is_caught(k2, monkeypatch):
    """A patch that takes one edited node from the input (its edit not
    declared): the comparison above fails."""
    gd, fetches = _build("keras_resnet50_training", k2)
    real = Graph.serialize_patch

    def forgetful(self):
        victim = sorted(self.modified)[0]
        self.modified.discard(victim)
        return real(self)

    monkeypatch.setattr(Graph, "serialize_patch", forgetful)
    monkeypatch.setattr(pipeline, "CHECKED_RECORDS", [0, []])  # (this run's own)
    data, patch, ref = _patch_and_reference(gd, fetches, precision_mode="allow_mix_precision")
    assert not _assembled_equals_reference(data, patch, ref)
    if min(patch.order) < -1:  # (a patch with records: the suite's own check caught it too)
        assert pipeline.CHECKED_RECORDS[1]


def test_patch_that_does_not_fit_is_refused():
    gd, fetches = _build("control_inputs", None)
    data, patch, _ = _patch_and_reference(gd, fetches, precision_mode="allow_mix_precision")
    bad = patch._replace(order=type(patch.order)("i", [*patch.order, len(gd.node) + 5]))
    with pytest.raises(ValueError, match="does not have"):
        bridge.assemble_patch(data, bad)
    bad = patch._replace(order=type(patch.order)("i", [*patch.order, -1]))
    with pytest.raises(ValueError, match="fewer nodes"):
        bridge.assemble_patch(data, bad)


@pytest.mark.parametrize("name", ["bert_like", "keras_resnet50_training", "learning_phase_functions"])
def test_patch_through_grappler_equals_bytes(k2, monkeypatch, name):
    """Inside grappler: the optimized graph with the patch handed to C++
    equals the one with the whole graph's bytes (``Graph.patch_output =
    False``), byte for byte."""

    gd, fetches = _build(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    outs, kinds = [], []
    real = Graph.serialize_patch
    for on in (True, False):
        made = []

        def spy(self, made=made):
            p = real(self)
            made.append(p is not None)
            return p

        monkeypatch.setattr(Graph, "serialize_patch", spy)
        monkeypatch.setattr(Graph, "patch_output", on)
        out, _ = optimize_rewritten(cfg, mg, name.encode())
        outs.append(out)
        kinds.append(made)
    assert kinds[0] and kinds[0][0] and not any(kinds[1])
    assert outs[0] == outs[1]
