"""Pattern matcher and PassManager on real TF graphs."""
import numpy as np
import pytest
import tensorflow as tf

from graph_passes.errors import PassError
from graph_passes.graph import Graph
from graph_passes.manager import PASS_REGISTRY, Pass, PassContext, PassManager, register_pass
from graph_passes.pattern import Pat, find_matches, match_at


def conv_bias_relu_graph(extra_consumer=False, fetch_inner=False):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 6, 6, 3], name="x")
        w = tf.constant(np.ones([3, 3, 3, 4], np.float32), name="w")
        b = tf.constant(np.ones([4], np.float32), name="b")
        conv = tf.nn.conv2d(x, w, 1, "SAME", name="conv")
        ba = tf.nn.bias_add(conv, b, name="bias")
        tf.nn.relu(ba, name="relu")
        if extra_consumer:
            tf.identity(conv, name="conv_reader")
    return g.as_graph_def()


PATTERN = Pat("Relu", name="act", inputs=[
    Pat("BiasAdd", name="bias", inputs=[Pat(("Conv2D", "DepthwiseConv2dNative"), name="conv"),
                                        Pat.any("b")])])


def test_match_captures_nodes_and_tensors():
    g = Graph(conv_bias_relu_graph())
    ms = find_matches(g, PATTERN)
    assert len(ms) == 1
    m = ms[0]
    assert m.anchor == "relu" and m.matched == ["relu", "bias", "conv"]
    assert m["conv"].op == "Conv2D" and m["b"] == "b"


def test_no_match_on_other_ops():
    g = Graph(conv_bias_relu_graph())
    assert find_matches(g, Pat("Relu6", inputs=[Pat.any()])) == []
    assert find_matches(g, Pat("Relu", inputs=[Pat("MatMul", inputs=[Pat.any(), Pat.any()])])) == []


def test_external_consumer_refused():
    g = Graph(conv_bias_relu_graph(extra_consumer=True))
    assert find_matches(g, PATTERN) == []
    # but a pattern that does not swallow conv still matches
    assert len(find_matches(g, Pat("Relu", inputs=[Pat("BiasAdd", inputs=[Pat.any(), Pat.any()])]))) == 1


def test_fetched_inner_tensor_refused():
    g = Graph(conv_bias_relu_graph())
    assert find_matches(g, PATTERN, protected=frozenset({"bias"})) == []
    assert len(find_matches(g, PATTERN, protected=frozenset({"relu"}))) == 1  # anchor may be fetched


def test_commutative_predicates_alternatives_and_overlap():
    g = tf.Graph()
    with g.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [2], name="a")
        c = tf.constant([1.0, 2.0], name="c")
        s1 = tf.add(c, a, name="s1")          # const first
        tf.multiply(s1, s1, name="sq")
    G = Graph(g.as_graph_def())
    p_plain = Pat("AddV2", inputs=[Pat.any("x"), Pat("Const", name="k")])
    p_comm = Pat("AddV2", commutative=True, inputs=[Pat.any("x"), Pat("Const", name="k")])
    assert match_at(G, p_plain, "s1") is None
    m = match_at(G, p_comm, "s1")
    assert m is not None and m["x"] == "a"
    pred = Pat("AddV2", commutative=True, inputs=[Pat.any(), Pat("Const", predicate=lambda n, gr: False)])
    assert match_at(G, pred, "s1") is None
    alt = Pat.one_of(Pat("Sub", inputs=[Pat.any(), Pat.any()]), Pat("AddV2", inputs=[Pat.any(), Pat.any()]))
    assert match_at(G, alt, "s1") is not None
    # same leaf name must bind the same tensor: Mul(s1, s1) matches x*x
    sq = Pat("Mul", inputs=[Pat.any("t"), Pat.any("t")])
    assert match_at(G, sq, "sq")["t"] == "s1"
    # overlapping matches: both anchors want s1's add -> only one match
    assert len(find_matches(G, Pat(("Mul", "AddV2"), inputs=[Pat.any(), Pat.any()]))) == 2
    swallow = Pat("Mul", inputs=[Pat("AddV2", inputs=[Pat.any(), Pat.any()]), Pat.any()])
    assert find_matches(G, swallow) == []   # the leaf would read the swallowed AddV2


def test_overlapping_matches_dropped():
    g = tf.Graph()
    with g.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [2], name="a")
        x = a
        for i in range(3):
            x = tf.add(x, a, name=f"add{i}")
    G = Graph(g.as_graph_def())
    chain = Pat("AddV2", inputs=[Pat("AddV2", inputs=[Pat.any(), Pat.any()]), Pat.any()])
    assert match_at(G, chain, "add1") is not None and match_at(G, chain, "add2") is not None
    ms = find_matches(G, chain)
    assert [m.matched for m in ms] == [["add1", "add0"]]


# ------------------------------------------------------------ PassManager
@register_pass("test_rename_relu")
class _RenameRelu(Pass):
    """Turns Relu into Relu6 (toy pass for manager tests); idempotent."""

    def run(self, graph, ctx):
        n = 0
        for node in graph.nodes.values():
            if node.op == "Relu":
                node.op = "Relu6"
                ctx.report.decide(node.name, op="Relu6", reason="test")
                n += 1
        return {"changed": n}


@register_pass("test_break_graph")
class _Break(Pass):
    def run(self, graph, ctx):
        graph.nodes["relu"].input.append("nowhere")
        return {}


@register_pass("test_raise")
class _Raise(Pass):
    def run(self, graph, ctx):
        err = KeyError("boom")
        err.node = "bias"
        raise err


@register_pass("test_drop_fetch")
class _DropFetch(Pass):
    def run(self, graph, ctx):
        graph.nodes["relu"].attr["T"].type = tf.float16.as_datatype_enum
        return {}


@register_pass("test_stale_index")
class _StaleIndex(Pass):
    """Edits an input by hand (no reindex), then edits the same edge properly."""

    def run(self, graph, ctx):
        relu = graph.nodes["relu"]
        src = relu.input[0]
        probe = graph.new_node("Identity", "probe", [src], attrs={"T": relu.attr["T"]})
        relu.input[0] = probe.name        # the consumers index still says relu reads src
        graph.set_input("relu", 0, src)   # finds the index stale: rebuilt
        return {}


def test_stale_consumers_index_is_a_report_warning():
    g = Graph(conv_bias_relu_graph())
    report = PassManager(["test_stale_index"]).run(g, PassContext(fetches=["relu:0"]))
    assert g.index_repairs == 1
    assert [(w["pass"], w["message"]) for w in report.warnings] == [
        ("test_stale_index", "the graph's consumers index was out of sync 1 time(s) (node inputs "
                             "edited without Graph.reindex()); it was rebuilt")]
    assert ("relu", 0) in g.consumers("bias") and ("relu", 0) not in g.consumers("probe")
    clean = PassManager(["test_rename_relu"]).run(Graph(conv_bias_relu_graph()), PassContext())
    assert clean.warnings == []


def test_manager_runs_times_and_reports():
    g = Graph(conv_bias_relu_graph())
    ctx = PassContext(fetches=["relu:0"])
    import time
    t0 = time.perf_counter()
    report = PassManager(["test_rename_relu", "test_rename_relu"], validate=True).run(g, ctx)
    wall = time.perf_counter() - t0
    assert [p["name"] for p in report.passes] == ["test_rename_relu"] * 2
    assert report.passes[0]["stats"] == {"changed": 1} and report.passes[1]["stats"] == {"changed": 0}
    # each pass is timed (a pass cannot take 0 s at microsecond resolution) and the
    # per-pass times are parts of the manager's wall time, not made-up figures
    assert all(p["time_s"] > 0 for p in report.passes)
    assert sum(p["time_s"] for p in report.passes) <= wall + 2e-6
    assert report.decisions["relu"]["op"] == "Relu6"
    import json
    json.dumps(report.to_json())


def test_manager_names_failing_pass():
    g = Graph(conv_bias_relu_graph())
    with pytest.raises(PassError, match="pass 'test_break_graph'.*invalid graph"):
        PassManager(["test_break_graph"], validate=True).run(g, PassContext())
    with pytest.raises(PassError, match="pass 'test_raise' at node 'bias'") as ei:
        PassManager(["test_raise"]).run(Graph(conv_bias_relu_graph()), PassContext())
    assert ei.value.pass_name == "test_raise" and ei.value.node == "bias"
    with pytest.raises(PassError, match="fetched/preserved"):
        PassManager(["test_drop_fetch"]).run(Graph(conv_bias_relu_graph()), PassContext(fetches=["relu"]))
    with pytest.raises(PassError, match="no such pass"):
        PassManager(["nope"])
    assert "test_rename_relu" in PASS_REGISTRY


def test_back_reference_reads_an_inner_node_twice():
    g = tf.Graph()
    with g.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [2], name="a")
        s = tf.square(a, name="sq")
        tf.multiply(s, s, name="m")
    G = Graph(g.as_graph_def())
    plain = Pat("Mul", inputs=[Pat("Square", name="sq", inputs=[Pat.any("x")]), Pat.any()])
    assert match_at(G, plain, "m") is None          # the leaf would need 'sq' kept
    backref = Pat("Mul", inputs=[Pat("Square", name="sq", inputs=[Pat.any("x")]), Pat.any("@sq")])
    m = match_at(G, backref, "m")
    assert m is not None and m.matched == ["m", "sq"] and m["x"] == "a"
    wrong = Pat("Mul", inputs=[Pat("Square", name="sq", inputs=[Pat.any("x")]), Pat.any("@x")])
    assert match_at(G, wrong, "m") is None          # '@x' names no inner node
