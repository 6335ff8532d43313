"""Issue 17 (helper 17i): two more exact shortcuts of the fusion pass, each
checked against its reference switch (the rewritten graphs and reports of
the real models, byte for byte, are compared in ``test_fusion_skip.py``,
whose reference turns these off too), and each with a planted fault that
the comparison catches.

* ``shapes.tensor_value`` decodes common TensorProtos without
  ``tf.make_ndarray`` (``FAST_TENSOR_DECODE = False``: the reference);
* ``pattern.INNER_FILTER``: ``find_matches`` does not read through candidates
  of inner positions that ``match_at`` refuses as inner nodes whatever the
  match (fetched or preserved, or, without escapes, a control consumer of an
  op no position accepts).
* ``builtin.NORM_MEMO``: ``analyze_norm`` answers kept while the graph does
  not change.
"""
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from graph_passes import pattern, shapes
from graph_passes.fusion import RULES
from graph_passes.graph import Graph
from test_fusion_skip import keras_transformer_block_training_graph
from test_precision_fast import slim_resnet_graph
from test_speed_paths import _keras_resnet_training_graph, bert_like_training_graph

tf1 = tf.compat.v1


def _real_graphs(k2):
    yield "bert", bert_like_training_graph()
    yield "keras_resnet50", _keras_resnet_training_graph(k2)
    yield "keras_transformer_block", keras_transformer_block_training_graph(k2)
    try:
        yield "slim_resnet_v1_50", slim_resnet_graph()[0]
    except ImportError:
        pass


def _same_array(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


# ------------------------------------------------------------ tensor decode
def _odd_tensors():
    """TensorProtos off the fast path or at its edges."""
    make = tf.make_tensor_proto
    yield make(np.float32(2.5))                                    # scalar, float_val
    yield make(np.arange(6, dtype=np.int32).reshape(2, 3))         # tensor_content
    yield make(np.array([True, False, True]))                      # bool
    yield make(np.arange(4, dtype=np.int64))
    yield make(np.arange(3, dtype=np.float64))
    yield make(np.zeros([0, 3], np.float32))                       # no elements
    yield make(np.float16(1.5) * np.ones([2, 2], np.float16))      # half_val: make_ndarray's
    yield make(np.array([b"a", b"bc"]))                            # strings: make_ndarray's
    t = make(np.float32(7.0))
    t.tensor_shape.dim.add().size = 4                              # one value for 4 elements: padded
    yield t
    t = make(np.arange(5, dtype=np.int32))
    t.tensor_shape.dim[0].size = 3                                 # 5 values listed for 3
    yield t


def _decode_both(t):
    """(fast, reference) results, an exception standing for itself by type."""
    out = []
    for fast in (True, False):
        shapes.FAST_TENSOR_DECODE = fast
        try:
            out.append(shapes.tensor_value(t))
        except Exception as exc:  # noqa: BLE001 - compared by type
            out.append(type(exc))
        finally:
            shapes.FAST_TENSOR_DECODE = True
    return out


def test_tensor_value_equals_make_ndarray_on_every_constant(k2):
    checked = 0
    for name, gd in _real_graphs(k2):
        for node in gd.node:
            if node.op != "Const":
                continue
            t = node.attr["value"].tensor
            fast, ref = _decode_both(t)
            if isinstance(ref, type):
                assert fast is ref, (name, node.name)
                continue
            assert _same_array(fast, ref), (name, node.name)
            checked += 1
    for t in _odd_tensors():
        fast, ref = _decode_both(t)
        assert (fast is ref) if isinstance(ref, type) else _same_array(fast, ref), t
    assert checked > 1000, checked


def test_a_wrong_decode_table_is_caught(monkeypatch):
    """Planted fault: int32 values read as uint32 (the same bytes, another
    dtype: the comparison above fails)."""
    monkeypatch.setitem(shapes._DECODE, 3, (np.uint32, "int_val"))
    t = tf.make_tensor_proto(np.arange(6, dtype=np.int32).reshape(2, 3))
    fast, ref = _decode_both(t)
    assert not (not isinstance(fast, type) and _same_array(fast, ref))


# ------------------------------------------------------------ inner filter
def _identity_chains():
    """Identity(Identity(x)) three ways: the inner one also waited on by a
    NoOp (no match), by the anchor itself (a match: the control edge stays
    inside it), and read by nothing else (a match)."""
    gd = graph_pb2.GraphDef()

    def add(name, op, inputs=()):
        n = gd.node.add(name=name, op=op)
        n.input.extend(inputs)
        if op == "Identity":
            n.attr["T"].type = 1
        if op == "Placeholder":
            n.attr["dtype"].type = 1
        return n

    add("x", "Placeholder")
    add("a1", "Identity", ["x"])
    add("a2", "Identity", ["a1"])
    add("deps", "NoOp", ["^a1"])
    add("b1", "Identity", ["x"])
    add("b2", "Identity", ["b1", "^b1"])
    add("c1", "Identity", ["x"])
    add("c2", "Identity", ["c1"])
    return gd


def _visit_all(g, pat, protected, escapes):
    return [(m.anchor, m.matched) for m in
            pattern.find_matches(g, pat, protected, order=g.topo_order(), escapes_ok=escapes)]


def test_inner_filter_keeps_every_match():
    pat = RULES["identity_chain"].pattern
    g = Graph(_identity_chains())
    for protected in (frozenset(), frozenset({"c1"})):
        got = [(m.anchor, m.matched) for m in pattern.find_matches(g, pat, protected)]
        assert got == _visit_all(g, pat, protected, False)
    assert [m.anchor for m in pattern.find_matches(g, pat)] == ["b2", "c2"]
    assert [m.anchor for m in pattern.find_matches(g, pat, frozenset({"c1"}))] == ["b2"]
    # the filter is what narrows here: a1 (waited on by a NoOp) is not read through
    cands = pattern._candidates(g, pat, pattern._inner_filter(g, pat, frozenset(), False))
    assert cands == {"b2", "c2"}


def test_inner_filter_on_real_graphs(k2):
    """For every rule, on the raw and the rewritten real graphs, with a
    protected set: the filtered find_matches equals the visit of every node
    in topological order, and the filter narrowed something."""
    import npu_amp_tf

    narrowed = 0
    for name, gd in _real_graphs(k2):
        out, _ = npu_amp_tf.rewrite_graph(gd, fetches=["loss", "train"],
                                          precision_mode="allow_mix_precision_bf16")
        for g in (Graph(gd), Graph(out)):
            protected = frozenset(n for n in list(g.nodes)[::97])
            for rule in RULES.values():
                pat = rule.pattern
                for prot in (frozenset(), protected):
                    got = [(m.anchor, m.matched) for m in
                           pattern.find_matches(g, pat, prot, escapes_ok=rule.escapes)]
                    assert got == _visit_all(g, pat, prot, rule.escapes), (name, rule.name)
                plain = pattern._candidates(g, pat)
                kept = pattern._candidates(g, pat, pattern._inner_filter(g, pat, frozenset(), rule.escapes))
                if plain is not None and len(kept) < len(plain):
                    narrowed += 1
    assert narrowed >= 2, narrowed


def test_a_too_strict_inner_filter_is_caught(monkeypatch):
    """Planted fault: refusing every node with a control consumer loses the
    match whose control edge stays inside it (b2), which the comparison with
    the visit of every node sees."""
    def too_strict(graph, pat, protected, escapes_ok):
        cons = graph._consumers
        return lambda name: all(idx >= 0 for _, idx in cons.get(name, ()))

    monkeypatch.setattr(pattern, "_inner_filter", too_strict)
    pat = RULES["identity_chain"].pattern
    g = Graph(_identity_chains())
    got = [(m.anchor, m.matched) for m in pattern.find_matches(g, pat)]
    assert got != _visit_all(g, pat, frozenset(), False)


# ------------------------------------------------------------ norm memo
def _norm_answers(g, names):
    from graph_passes.fusion import builtin

    return {n: builtin.analyze_norm(g, g.nodes[n]) for n in names if n in g.nodes}


def test_norm_memo_answers_like_the_analysis_and_follows_edits(monkeypatch):
    """On the BERT-like graph: asked twice with the memo, every Add/Mul/RealDiv
    gets the reference's answer; after an edit that breaks a LayerNorm (its
    final Add reads x instead), the memo answers for the new graph."""
    from graph_passes.fusion import builtin

    g = Graph(bert_like_training_graph())
    names = g.nodes_of_type(("Add", "AddV2", "Mul", "RealDiv"))
    monkeypatch.setattr(builtin, "NORM_MEMO", False)
    ref = _norm_answers(g, names)
    monkeypatch.setattr(builtin, "NORM_MEMO", True)
    assert _norm_answers(g, names) == ref and _norm_answers(g, names) == ref
    found = [n for n, r in ref.items() if r is not None and r["kind"] == "layer_norm" and r["beta"]]
    assert len(found) >= 3, found
    anchor = found[0]
    node = g.nodes[anchor]
    beta_idx = [i for i, inp in enumerate(node.input) if inp == ref[anchor]["beta"]][0]
    g.set_input(anchor, 1 - beta_idx, ref[anchor]["x"])  # y = x + beta: no norm any more
    monkeypatch.setattr(builtin, "NORM_MEMO", False)
    after = builtin.analyze_norm(g, g.nodes[anchor])
    monkeypatch.setattr(builtin, "NORM_MEMO", True)
    assert after != ref[anchor]
    assert builtin.analyze_norm(g, g.nodes[anchor]) == after


def test_a_norm_memo_blind_to_edits_is_caught(monkeypatch):
    """Planted fault: a memo keyed on nothing but the node name keeps the
    answer of the graph before the edit; the check above sees it."""
    from graph_passes.fusion import builtin

    g = Graph(bert_like_training_graph())
    names = g.nodes_of_type(("Add", "AddV2"))
    monkeypatch.setattr(builtin, "NORM_MEMO", True)
    ref = _norm_answers(g, names)
    anchor = next(n for n, r in ref.items() if r is not None and r["beta"])
    monkeypatch.setattr(g, "edits_since", lambda mark: ([], 0))  # the fault: no edit is ever seen
    g.version = 0
    builtin.analyze_norm(g, g.nodes[anchor])  # (memoised under the constant key)
    node = g.nodes[anchor]
    beta_idx = [i for i, inp in enumerate(node.input) if inp == ref[anchor]["beta"]][0]
    g.set_input(anchor, 1 - beta_idx, ref[anchor]["x"])
    g.version = 0  # (the fault: the version is not seen either)
    monkeypatch.setattr(builtin, "NORM_MEMO", False)
    truth = builtin.analyze_norm(g, g.nodes[anchor])
    monkeypatch.setattr(builtin, "NORM_MEMO", True)
    assert builtin.analyze_norm(g, g.nodes[anchor]) != truth


# ------------------------------------------------------------ rarest memo
def test_rarest_memo_gives_the_same_candidates(k2):
    """``pattern.RAREST_MEMO``: for every rule, on the raw and the rewritten
    real graphs, the candidates with the memo equal those asked without it;
    the memo answers the same as ``_rarest`` for every subtree it kept."""
    import npu_amp_tf

    kept = 0
    for name, gd in _real_graphs(k2):
        out, _ = npu_amp_tf.rewrite_graph(gd, fetches=["loss", "train"],
                                          precision_mode="allow_mix_precision_bf16")
        for g in (Graph(gd), Graph(out)):
            for rule in RULES.values():
                pat = rule.pattern
                flt = pattern._inner_filter(g, pat, frozenset(), rule.escapes)
                memo = {}
                assert pattern._candidates(g, pat, flt, memo) == pattern._candidates(g, pat, flt), \
                    (name, rule.name)
                for pos, answer in memo.values():
                    assert answer == pattern._rarest(g, pos), (name, rule.name)
                kept += len(memo)
    assert kept > 50, kept
