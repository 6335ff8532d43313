"""Issue 17: an exact shortcut against its reference switch on real graphs.

* ``shapes.FAST_WALK``: ``local_shape`` walks a tensor whose shape needs no
  input's (constants, variables, placeholders, recorded shapes) or is its
  input 0's (``_SAME_SHAPE``) without a generator.  The answers and the memo
  (entries, values and their order) equal the reference walk's, every node
  and output walked in graph order and readers first, on Keras ResNet-50,
  TF-Slim ResNet-v1-50, the BERT-like builder, a Keras 2 transformer, a Keras
  model in a TF1 graph (learning-phase conds) and v1 control flow; both
  agree on cycles and leave the same memo when the walk raises.
"""
import pytest
from tensorflow.core.framework import graph_pb2

from graph_passes import shapes as shapes_mod
from graph_passes.graph import Graph
from test_precision_native import _graph

REAL = ["keras_resnet50_training", "slim_resnet_v1_50", "bert_like", "keras_transformer_training",
        "learning_phase_conds", "v1_control_flow"]


def _refs(g):
    """Every node's output 0, and output 1 of the nodes with several outputs
    (a port the walk answers None for unless a shape is recorded)."""
    out = []
    for name, node in g.nodes.items():
        out.append(name)
        if node.op in ("FusedBatchNormV3", "Switch", "Unique", "TopKV2", "Split", "SplitV"):
            out.append(f"{name}:1")
    return out


def _walk(monkeypatch, g, refs, fast, memo=None):
    monkeypatch.setattr(shapes_mod, "FAST_WALK", fast)
    memo = {} if memo is None else memo
    answers = [shapes_mod.local_shape(g, r, memo) for r in refs]
    return answers, list(memo.items())


@pytest.mark.parametrize("name", REAL)
def test_fast_walk_equals_the_reference_on_real_graphs(k2, monkeypatch, name):
    gd, _ = _graph(name, k2)
    g = Graph(gd)
    refs = _refs(g)
    calls = []
    real_compute = shapes_mod._compute

    def counting(graph, ref):
        calls.append(ref)
        return real_compute(graph, ref)

    monkeypatch.setattr(shapes_mod, "_compute", counting)
    for order in (refs, refs[::-1]):  # graph order, then readers first (every walk deep)
        fast = _walk(monkeypatch, g, order, True)
        assert calls == []  # (no generator of the reference's was made)
        ref = _walk(monkeypatch, g, order, False)
        assert calls  # the reference walked with its generators
        calls.clear()
        assert fast[0] == ref[0]
        assert fast[1] == ref[1]  # the same memo: entries, values, insertion order
        known = sum(a is not None for a in fast[0])
        assert known >= 30, (known, len(order))  # (answers to compare, not only Nones)
    # each from scratch, the deepest ones: the gradient end of the graph
    for r in refs[-200:]:
        assert _walk(monkeypatch, g, [r], True) == _walk(monkeypatch, g, [r], False), r


def _chain_graph():
    """x -> Identity chains and adds (a walk mixing alias frames and
    generator frames), a recorded shape with an unknown dim, and two cycles
    (an Identity ring; a ring through an Add): not valid TF graphs."""
    from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2

    gd = graph_pb2.GraphDef()

    def add(name, op, inputs=()):
        node = gd.node.add(name=name, op=op)
        node.input.extend(inputs)
        return node

    x = add("x", "Placeholder")
    x.attr["shape"].shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=s) for s in (2, 3)]))
    prev = "x"
    for i in range(30):
        prev = add(f"c{i}", "Identity" if i % 3 else "AddV2", [prev] if i % 3 else [prev, "x"]).name
    add("ctrl_first", "Identity", ["^x", "c29"])  # (malformed: a control input before the data one)
    rec = add("rec", "Relu", ["c29"])
    rec.attr["_output_shapes"].CopyFrom(attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
        shape=[tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=-1)])])))
    add("after_rec", "Identity", ["rec"])
    add("ring_a", "Identity", ["ring_b"])
    add("ring_b", "Identity", ["ring_a"])
    add("loop_a", "AddV2", ["loop_b", "x"])
    add("loop_b", "Identity", ["loop_a"])
    add("from_ring", "AddV2", ["ring_a", "c5"])
    return gd


def test_fast_walk_equals_the_reference_on_chains_and_cycles(monkeypatch):
    g = Graph(_chain_graph())
    refs = _refs(g)
    for order in (refs, refs[::-1]):
        fast, ref = _walk(monkeypatch, g, order, True), _walk(monkeypatch, g, order, False)
        assert fast == ref
    answers = dict(zip(refs, _walk(monkeypatch, g, refs, True)[0]))
    assert answers["c29"] == [2, 3] and answers["ctrl_first"] == [2, 3]
    assert answers["rec"] is None and answers["after_rec"] is None  # (an unknown dim: not fully known)
    assert answers["ring_a"] is None and answers["loop_a"] is None and answers["from_ring"] is None


class _Raising(dict):
    """A node map whose lookup of one name raises (a fault mid-walk)."""

    def __init__(self, nodes, bad):
        super().__init__(nodes)
        self.bad = bad

    def get(self, key, default=None):
        if key == self.bad:
            raise RuntimeError(f"planted: {key}")
        return super().get(key, default)


@pytest.mark.parametrize("bad", ["c9", "c10", "c20"])
def test_a_walk_that_raises_leaves_the_same_memo(monkeypatch, bad):
    """Nothing in progress stays memoised, with either walk: the tensors
    walked before the fault keep their answers, the chain above it has none."""
    g = Graph(_chain_graph())
    memos = []
    for fast in (True, False):
        monkeypatch.setattr(shapes_mod, "FAST_WALK", fast)
        memo = {}
        assert shapes_mod.local_shape(g, "c3", memo) == [2, 3]
        g.nodes = _Raising(g.nodes, bad)
        try:
            with pytest.raises(RuntimeError, match="planted"):
                shapes_mod.local_shape(g, "c29", memo)
        finally:
            g.nodes = dict(g.nodes)
        memos.append(list(memo.items()))
        assert "c29" not in memo and all(v is not None for v in memo.values()), memo
    assert memos[0] == memos[1]
