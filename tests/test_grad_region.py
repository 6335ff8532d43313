"""graph_passes.fusion.grad_region on real autodiff graphs (TF1 tf.gradients and
TF2 GradientTape): which nodes form the backward region of a forward subgraph,
what dy is, how the tensors leaving it are assigned, and the refusals."""
import numpy as np
import pytest

from _fusion_util import build, tf, tf1
from graph_passes.fusion.core import ShapeOracle
from graph_passes.fusion.grad_region import (GradRegionRefused, assign_outputs, attributed_forward,
                                             find_grad_region)
from graph_passes.graph import Graph

RNG = np.random.default_rng(3)


def _ln(h, gamma, beta):
    """Raw LayerNorm in name scope 'ln' (the forward region F), output 'ln/y'."""
    with tf.name_scope("ln"):
        mean = tf.reduce_mean(h, -1, keepdims=True)
        var = tf.reduce_mean(tf.square(h - mean), -1, keepdims=True)
        return tf.add((h - mean) * tf.math.rsqrt(var + 1e-6) * gamma, beta, name="y")


def _tf1_graph(residual=False, upstream_scale=False, extra_reader=False):
    def f():
        x = tf1.placeholder(tf.float32, [6, 8], name="x")
        w = tf1.get_variable("w", initializer=RNG.standard_normal((8, 8)).astype(np.float32) * 0.3)
        h = tf.matmul(x, w, name="h")
        if upstream_scale:
            h = tf.multiply(h, 2.0, name="scaled")
        gamma = tf1.get_variable("gamma", initializer=RNG.uniform(0.5, 1.5, 8).astype(np.float32))
        beta = tf1.get_variable("beta", initializer=RNG.standard_normal(8).astype(np.float32))
        y = _ln(h, tf.identity(gamma, name="gamma_read"), tf.identity(beta, name="beta_read"))
        out = y + h if residual else y
        if extra_reader:
            out = out + tf.reduce_sum(tf1.get_default_graph().get_tensor_by_name("ln/Mean:0"))
        loss = tf.reduce_sum(tf.square(out) * tf.range(8, dtype=tf.float32), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        return h.op.name, gamma.op.name, beta.op.name
    gd, (h, g, b) = build(f)
    graph = Graph(gd)
    fwd = [n for n in graph.nodes if n.startswith("ln/")]
    return graph, fwd, [h, "gamma_read", "beta_read"], h


def _classify(graph, region, x):
    shapes = ShapeOracle(graph)
    xs = shapes.shape(x)

    def classify(ref):
        sh = shapes.shape(ref)
        if not region.depends_on_dy(ref):
            return None
        if sh == xs and region.depends_on_forward(ref):
            return "dx"
        if sh == [8]:
            return "dgamma" if region.depends_on_forward(ref) else "dbeta"
        return None
    return classify


def test_tf1_region_dy_and_outputs():
    graph, fwd, ins, h = _tf1_graph()
    region = find_grad_region(graph, fwd, ["ln/y"], ins)
    # every region node is autodiff's, for an op of F (or an unattributed aggregation)
    assert region.nodes and all(n.startswith("gradients/") for n in region.nodes)
    owners = {attributed_forward(graph, n) for n in region.nodes} - {None}
    assert owners and owners <= set(fwd)
    # dy: the gradient of loss w.r.t. y (autodiff names it after the consumer Square)
    assert region.dy.startswith("gradients/Square_grad/")
    assert not any(n.startswith("gradients/h_grad") for n in region.nodes)  # MatMul's gradient is not ours
    terms = assign_outputs(region, graph, _classify(graph, region, h))
    assert set(terms) == {"dx", "dgamma", "dbeta"}
    # h is read by F only: autodiff's AddN of the partial terms (x - mean, mean and
    # variance paths) reads nothing else, so it is in the region and is the one dx
    assert terms["dx"].aggregator is None and len(terms["dx"].refs) == 1
    dx = graph.nodes[terms["dx"].refs[0]]
    assert dx.op == "AddN" and dx.name in region.nodes and len(graph.data_inputs(dx)) == 3
    # and what reads it is the MatMul's gradient
    assert {graph.nodes[c].op for c, _ in region.outputs[dx.name]} == {"MatMul"}


def test_tf1_residual_sum_stays_outside():
    """out = LN(h) + h: the AddN of the residual gradient and LN's dx terms reads
    an external term, so it is the aggregator, never part of the region."""
    graph, fwd, ins, h = _tf1_graph(residual=True)
    region = find_grad_region(graph, fwd, ["ln/y"], ins)
    terms = assign_outputs(region, graph, _classify(graph, region, h))
    agg = graph.nodes[terms["dx"].aggregator]
    assert terms["dx"].aggregator not in region.nodes and len(terms["dx"].refs) == 3
    assert len(graph.data_inputs(agg)) == len(terms["dx"].refs) + 1  # + the residual term
    assert region.dy in [graph.data_inputs(agg)[i] for i in range(4)] or any(
        graph.nodes[i.split(":")[0]].op == "Identity" for i in graph.data_inputs(agg))


def test_upstream_gradient_not_absorbed():
    """h = matmul * 2: the gradient of the Mul (x's producer) reads only dx and
    a constant, but its name ties it to 'scaled', outside F."""
    graph, fwd, ins, h = _tf1_graph(upstream_scale=True)
    region = find_grad_region(graph, fwd, ["ln/y"], ins)
    assert not any("scaled_grad" in n for n in region.nodes)
    terms = assign_outputs(region, graph, _classify(graph, region, h))
    assert "dx" in terms


def test_optimizer_ops_not_absorbed():
    """An optimizer's Neg(grad) * lr reads only the region's dgamma and a
    constant, but it is not autodiff's (found in Keras 2's SGD under fit:
    taking it for dgamma flipped the update's sign)."""
    def f():
        x = tf1.placeholder(tf.float32, [6, 8], name="x")
        gamma = tf1.get_variable("gamma", initializer=np.ones(8, np.float32))
        y = _ln(x, tf.identity(gamma, name="gamma_read"), tf.zeros([8]))
        loss = tf.reduce_sum(tf.square(y) * tf.range(8, dtype=tf.float32), name="loss")
        dgamma = tf.gradients(loss, gamma)[0]
        with tf.name_scope("SGD"):
            tf1.assign_add(gamma, tf.negative(dgamma) * 0.1, name="update")
    graph = Graph(build(f)[0])
    fwd = [n for n in graph.nodes if n.startswith("ln/")]
    region = find_grad_region(graph, fwd, ["ln/y"], ["x", "gamma_read"])
    assert not any(n.startswith("SGD/") for n in region.nodes)
    assert any(c.startswith("SGD/") for cons in region.outputs.values() for c, _ in cons)


def test_aliases_of_one_gradient_are_one_term():
    """dgamma read outside the region twice, through autodiff's tuple Identity
    (the optimizer) and raw (user code): one role, two refs, one root."""
    graph, fwd, ins, h = _tf1_graph()
    region = find_grad_region(graph, fwd, ["ln/y"], ins)
    terms = assign_outputs(region, graph, _classify(graph, region, h))
    ref = terms["dgamma"].refs[0]
    # the same graph plus a user op reading the tensor under the tuple Identity
    node = graph.nodes[ref]
    raw = graph.data_inputs(node)[0] if node.op == "Identity" else ref
    from tensorflow.core.framework import node_def_pb2
    watch = node_def_pb2.NodeDef(op="Identity", name="watch", input=[raw])
    watch.attr["T"].type = 1
    graph.add_node(watch)
    region = find_grad_region(graph, fwd, ["ln/y"], ins)
    terms = assign_outputs(region, graph, _classify(graph, region, h))
    assert len(terms["dgamma"].refs) == 2 and terms["dgamma"].aggregator is None


def test_inner_tensor_read_by_forward_code_refused():
    graph, fwd, ins, _ = _tf1_graph(extra_reader=True)
    with pytest.raises(GradRegionRefused, match="not fused"):
        find_grad_region(graph, fwd, ["ln/y"], ins)


def test_unclassified_output_refused():
    graph, fwd, ins, h = _tf1_graph()
    region = find_grad_region(graph, fwd, ["ln/y"], ins)
    with pytest.raises(GradRegionRefused, match="none of the fused gradient's outputs"):
        assign_outputs(region, graph, lambda ref: None)


def test_no_gradient_refused():
    """An inference graph whose inner tensor is read by forward code: no dy."""
    def f():
        x = tf1.placeholder(tf.float32, [6, 8], name="x")
        y = _ln(x, tf.ones([8]), tf.zeros([8]))
        tf.identity(y + tf.reduce_sum(tf1.get_default_graph().get_tensor_by_name("ln/Mean:0")), name="out")
    graph = Graph(build(f)[0])
    fwd = [n for n in graph.nodes if n.startswith("ln/")]
    with pytest.raises(GradRegionRefused):
        find_grad_region(graph, fwd, ["ln/y"], ["x"])


def test_tf2_gradient_tape_region():
    @tf.function
    def step(x, gamma, beta):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            y = _ln(x, gamma, beta)
            loss = tf.reduce_sum(tf.square(y) * tf.range(8, dtype=tf.float32))
        return tape.gradient(loss, [x, gamma, beta])

    gd = step.get_concrete_function(tf.TensorSpec([6, 8], tf.float32, name="x"),
                                    tf.TensorSpec([8], tf.float32, name="gamma"),
                                    tf.TensorSpec([8], tf.float32, name="beta")).graph.as_graph_def()
    graph = Graph(gd)
    fwd = [n for n in graph.nodes if n.startswith("ln/")]
    returned = {n for n in graph.nodes if n.startswith("Identity")}  # what the function returns
    region = find_grad_region(graph, fwd, ["ln/y"], ["x", "gamma", "beta"], protected=returned)
    # autodiff's ops and its unnamed aggregations
    assert all(n.startswith(("gradient_tape/", "AddN")) for n in region.nodes)
    assert region.dy.startswith("gradient_tape/")
    terms = assign_outputs(region, graph, _classify(graph, region, "x"))
    assert set(terms) == {"dx", "dgamma", "dbeta"}


@pytest.mark.parametrize("name,want", [
    ("gradients/ln/mul_grad/Mul", "ln/mul"),
    ("gradients_1/ln/mul_grad/tuple/control_dependency", "ln/mul"),
    ("gradient_tape/ln/mul/Mul_1", "ln/mul"),
    ("call/gradient_tape/ln/mul/Mul_1", "call/ln/mul"),  # an inlined function call's scope
    ("call/gradients/ln/mul_grad/Mul", "call/ln/mul"),
    ("gradients/AddN", None),
    ("ArithmeticOptimizer/AddOpsRewrite_gradients/AddN", None),
    ("ln/mul", None),
])
def test_attributed_forward(name, want):
    def f():
        with tf.name_scope("ln"):
            tf.multiply(tf1.placeholder(tf.float32, [2], name="a"), 2.0, name="mul")
        with tf.name_scope("call/ln"):
            tf.multiply(tf1.placeholder(tf.float32, [2], name="a"), 2.0, name="mul")
    graph = Graph(build(f)[0])
    assert attributed_forward(graph, name) == want


# ------------------------------------------------------------------ positions across fusions
def _valid_order(graph, pos):
    from graph_passes.graph import parse_tensor
    return all(pos[parse_tensor(i)[0]] < pos[name] for name, n in graph.nodes.items() for i in n.input)


def test_positions_patched_after_edits_and_resorted_when_stale():
    """The region search's topological positions survive a fusion's edits: new
    nodes are placed after their inputs, no whole-graph sort is done (the
    graph's own sort cache stays empty), and the map is a valid order of the
    edited graph; an edit the old order contradicts sends it to the full sort."""
    from graph_passes.fusion.grad_region import _positions

    graph, fwd, _, h = _tf1_graph(residual=True)
    pos = _positions(graph)
    assert _valid_order(graph, pos)
    # a fusion's kind of edit: a new node between 'h' and one of its readers
    reader, idx = next((c, i) for c, i in graph.consumers(h) if i >= 0 and c not in fwd)
    from tensorflow.core.framework import attr_value_pb2
    graph.new_node("Identity", "h_copy", [h], {"T": attr_value_pb2.AttrValue(type=tf.float32.as_datatype_enum)})
    graph.set_input(reader, idx, "h_copy")
    pos2 = _positions(graph)
    assert graph._topo_cache is None  # patched, not re-sorted
    assert pos[h] < pos2["h_copy"] < pos2[reader] and _valid_order(graph, pos2)
    # an edge against the old order: a Const loss does not depend on (the learning
    # rate, placed early) now waits on 'loss' (placed late): full sort
    from graph_passes.graph import parse_tensor
    anc, stack = set(), ["loss"]
    while stack:
        for i in graph.nodes[stack.pop()].input:
            src = parse_tensor(i)[0]
            if src not in anc:
                anc.add(src)
                stack.append(src)
    const = next(n for n in sorted(graph.nodes, key=pos2.get) if graph.nodes[n].op == "Const" and n not in anc)
    assert pos2[const] < pos2["loss"]
    graph.add_control_input(const, "loss")
    pos3 = _positions(graph)
    assert _valid_order(graph, pos3) and pos3["loss"] < pos3[const]


def test_fusion_same_with_fresh_positions(monkeypatch):
    """Three stacked LayerNorms fused in one training graph: the rewrite is
    byte-identical whether the region searches use the patched positions or a
    fresh whole-graph sort each time."""
    from _fusion_util import rewrite
    from graph_passes.fusion import grad_region

    def f():
        x = tf1.placeholder(tf.float32, [4, 6, 8], name="x")
        h = x
        for i in range(3):
            with tf1.variable_scope(f"l{i}"):
                w = tf1.get_variable("w", initializer=RNG.standard_normal((8, 8)).astype(np.float32) * 0.3)
                gamma = tf1.get_variable("gamma", initializer=RNG.uniform(0.5, 1.5, 8).astype(np.float32))
                beta = tf1.get_variable("beta", initializer=RNG.standard_normal(8).astype(np.float32))
                z = tf.reshape(tf.matmul(tf.reshape(h, [-1, 8]), w), [4, 6, 8]) + h
                mean, var = tf.nn.moments(z, [-1], keepdims=True)
                y = (z - mean) * tf.math.rsqrt(var + 1e-6) * gamma + beta
                h = y + tf.reshape(tf.matmul(tf.reshape(y, [-1, 8]), w), [4, 6, 8])
        loss = tf.reduce_sum(tf.square(h), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    gd, _ = build(f)
    patched, _ = rewrite(gd, ["train", "loss"])
    monkeypatch.setattr(grad_region, "_positions", lambda g: g.topo_positions())
    fresh, _ = rewrite(gd, ["train", "loss"])
    assert sum(n.op == "LayerNormGrad" for n in patched.node) == 3
    assert patched.SerializeToString(deterministic=True) == fresh.SerializeToString(deterministic=True)


def test_positions_recheck_a_node_edited_again():
    """Each search checks only the nodes edited since the previous one (those
    before were checked then and no kept position moves), so a node edited
    in two steps is checked again: its second edit, an input placed after it,
    sends the search to the full sort, and the map stays a valid order."""
    from graph_passes.fusion.grad_region import _positions
    from graph_passes.graph import parse_tensor

    graph, fwd, _, h = _tf1_graph(residual=True)
    _positions(graph)
    reader, idx = next((c, i) for c, i in graph.consumers(h) if i >= 0 and c not in fwd)
    from tensorflow.core.framework import attr_value_pb2
    graph.new_node("Identity", "h_copy", [h], {"T": attr_value_pb2.AttrValue(type=tf.float32.as_datatype_enum)})
    graph.set_input(reader, idx, "h_copy")
    pos2 = _positions(graph)
    assert graph._topo_cache is None and _valid_order(graph, pos2)
    graph.new_node("Identity", "unrelated", [h], {"T": attr_value_pb2.AttrValue(type=tf.float32.as_datatype_enum)})
    pos3 = _positions(graph)  # patched again: only 'unrelated' is new
    assert graph._topo_cache is None and pos3["unrelated"] > pos3[h] and _valid_order(graph, pos3)
    # 'h_copy' edited again: it now reads a node placed after it that does not depend on it
    desc, stack = {"h_copy"}, ["h_copy"]
    while stack:
        for c, _ in graph.consumers(stack.pop()):
            if c not in desc:
                desc.add(c)
                stack.append(c)
    late = next(n for n in sorted(graph.nodes, key=pos3.get) if pos3[n] > pos3["h_copy"] and n not in desc)
    graph.set_input("h_copy", 0, late)
    pos4 = _positions(graph)
    assert _valid_order(graph, pos4) and pos4[late] < pos4["h_copy"] < pos4[reader]


# ------------------------------------------ issue 17 (17i): pass A stops at dy
def _searches(monkeypatch, gd, stop_at_dy, grow=None, mode="allow_mix_precision_bf16"):
    """Rewrite ``gd`` and record every region search: its outcome (region
    nodes, dy, outputs, or the refusal) and how many nodes pass A tried."""
    import npu_amp_tf
    from graph_passes.fusion import grad_region as gr

    monkeypatch.setattr(gr, "STOP_AT_DY", stop_at_dy)
    # (the Python search's passes are counted: not the C++ one's, nor compared with it)
    monkeypatch.setattr(gr, "NATIVE_SEARCH", False)
    calls, tries = [], []
    orig_find, orig_grow = gr.find_grad_region, grow or gr._grow

    def counting_grow(graph, seeds, try_add, pos, region, stop=None):
        n = [0]

        def counted(name):
            n[0] += 1
            return try_add(name)

        try:
            return orig_grow(graph, seeds, counted, pos, region, stop=stop)
        finally:
            tries.append(n[0])

    def recording_find(*a, **kw):
        try:
            r = orig_find(*a, **kw)
        except GradRegionRefused as exc:
            calls.append(("refused", str(exc)))
            raise
        calls.append((tuple(r.nodes), r.dy, sorted(r.outputs.items()), r.ctrl_inputs, r.ctrl_consumers))
        return r

    monkeypatch.setattr(gr, "_grow", counting_grow)
    monkeypatch.setattr(gr, "find_grad_region", recording_find)
    import graph_passes.fusion.builtin  # noqa: F401 - its rules import find_grad_region at call time
    out, _ = npu_amp_tf.rewrite_graph(gd, fetches=["loss", "train"], precision_mode=mode)
    monkeypatch.undo()
    return out.SerializeToString(deterministic=True), calls, tries[0::2], tries[1::2]


def test_pass_a_stopping_at_dy_finds_the_same_regions(monkeypatch):
    """``STOP_AT_DY``: every region search of the BERT-like training graph
    (25 LayerNorms at 12 layers; 5 here) gives the same region, dy, outputs
    and refusals as the reference (pass A grown to the end), the rewritten
    graphs are byte-identical, and pass A tried fewer nodes (not vacuous)."""
    from test_speed_paths import bert_like_training_graph

    gd = bert_like_training_graph(layers=2)
    fast, calls_fast, a_fast, b_fast = _searches(monkeypatch, gd, True)
    ref, calls_ref, a_ref, b_ref = _searches(monkeypatch, gd, False)
    assert len(calls_ref) >= 5 and all(c[0] != "refused" for c in calls_ref), calls_ref[:2]
    assert calls_fast == calls_ref
    assert fast == ref
    assert b_fast == b_ref  # pass B is untouched
    assert sum(a_fast) < sum(a_ref), (a_fast, a_ref)


def test_stopping_pass_a_too_early_is_caught(monkeypatch):
    """The comparison above has teeth: a pass A that stops before the try
    that finds dy (here: before its first try; on this graph the first node
    that joins pass A is the one that finds dy, so any stop after a join
    gives the same regions) leaves every search without dy: the LayerNorms
    are refused, and the comparison sees it."""
    from graph_passes.fusion import grad_region as gr
    from test_speed_paths import bert_like_training_graph

    orig = gr._grow

    def early(graph, seeds, try_add, pos, region, stop=None):
        if stop is not None:  # pass A: nothing tried
            return orig(graph, [], try_add, pos, region, stop=stop)
        return orig(graph, seeds, try_add, pos, region)

    gd = bert_like_training_graph(layers=2)
    bad, calls_bad, _, _ = _searches(monkeypatch, gd, True, grow=early)
    ref, calls_ref, _, _ = _searches(monkeypatch, gd, False)
    assert calls_bad != calls_ref
    assert all(c[0] == "refused" for c in calls_bad)
    assert bad != ref


def _scope_groups(rx, name):
    m = rx.match(name)
    return None if m is None else (m.group(1), m.group(2))


def test_scope_matches_equal_the_regexes_on_generated_and_real_names(k2):
    """``_TF1`` / ``_TF2`` (the last occurrence of the scope word first,
    ``FAST_SCOPES``) give the groups of their regexes: on names built from
    the pieces the patterns turn on (several and nested scope words, '/',
    '_grad' with and without a following '/', numbered scopes with ASCII
    and non-ASCII digits, a newline) and on every node name of real
    training graphs."""
    import random

    from graph_passes.fusion import grad_region as gr
    from test_precision_core import GRAPHS, _build

    pieces = ["gradients", "gradients_2", "gradients_", "gradients_\u0663", "_grad", "_grad/", "grad",
              "gradient_tape", "gradient_tape/", "/", "/", "a", "x_grad", "s", "_1", "\n", "gradients/"]
    rnd = random.Random(17)
    names = {"".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 9))) for _ in range(30000)}
    names |= {"gradients/a_grad", "x/gradients/a_grad/gradients/b_grad/c", "gradients/gradients/a_grad",
              "gradient_tape/", "gradient_tape/a", "a/gradient_tape/b/gradient_tape/c", "a/gradients_3/b_grad"}
    for name in GRAPHS:
        gd, _ = _build(name, k2)
        names.update(n.name for n in gd.node)
    hits = 0
    for name in sorted(names):
        for fast, rx in ((gr._TF1, gr._TF1_RX), (gr._TF2, gr._TF2_RX)):
            want = _scope_groups(rx, name)
            assert _scope_groups(fast, name) == want, (name, rx.pattern)
            hits += want is not None
    assert hits > 1000  # (the generated names reach the matching branches)


# ------------------------------------------ issue 17: the search in C++
def _native_lib():
    from npu_amp_tf import bridge

    bridge.library()
    from graph_passes.fusion import grad_region as gr

    if gr.native is None:
        pytest.skip("the library has no C++ gradient-region search")
    return gr


def _rewrite(gd, monkeypatch, native_on, fetches=("loss", "train"), counts=None):
    import npu_amp_tf
    from graph_passes.fusion import grad_region as gr

    monkeypatch.setattr(gr, "NATIVE_SEARCH", native_on)
    monkeypatch.setattr(gr, "CHECK_NATIVE", False)
    orig = gr._native_growth

    def counted(*a, **kw):
        try:
            r = orig(*a, **kw)
        except GradRegionRefused:
            counts.append("refused")
            raise
        counts.append("grown" if r is not None else "python")
        return r

    if counts is not None:
        monkeypatch.setattr(gr, "_native_growth", counted)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=list(fetches), precision_mode="allow_mix_precision_bf16")
    monkeypatch.undo()
    return out.SerializeToString(deterministic=True), rep


def _keras_tf1_transformer_block(k2):
    """A Keras 2 transformer block (MultiHeadAttention, LayerNormalization,
    dropout under the learning phase) trained in a TF1 graph: code this
    project did not write, with TF1 autodiff names."""
    def f():
        inp = k2.Input((6, 16), name="tokens")
        att = k2.layers.MultiHeadAttention(2, 8, name="mha")(inp, inp)
        h = k2.layers.LayerNormalization(name="ln1")(inp + k2.layers.Dropout(0.1)(att))
        ff = k2.layers.Dense(16, name="ff")(k2.layers.Dense(32, activation="gelu", name="ff_in")(h))
        out = k2.layers.LayerNormalization(name="ln2")(h + ff)
        model = k2.Model(inp, out)
        loss = tf.reduce_mean(tf.square(model.output), name="loss")
        tf1.train.AdamOptimizer(1e-3).minimize(loss, name="train")
    gd, _ = build(f)
    return gd


def test_native_search_gives_the_python_regions_on_real_training_graphs(monkeypatch, k2):
    """The C++ search (custom_ops/grad_region.cc) on the BERT-like training
    graph (LayerNorms, GELU, attention) and on a Keras 2 transformer block in
    a TF1 graph: every search ran in C++ (none fell back to Python), and
    the rewritten graphs are byte-identical to the Python search's."""
    _native_lib()
    from test_speed_paths import bert_like_training_graph

    for gd in (bert_like_training_graph(layers=2), _keras_tf1_transformer_block(k2)):
        counts = []
        fast, rep_fast = _rewrite(gd, monkeypatch, True, counts=counts)
        ref, rep_ref = _rewrite(gd, monkeypatch, False)
        assert counts and "python" not in counts, counts
        assert "grown" in counts, counts
        assert fast == ref
        assert rep_fast.decisions == rep_ref.decisions


def test_native_and_python_searches_compared_on_direct_calls():
    """find_grad_region called directly (TF1 and TF2 graphs, regions that
    grow and refusals): with CHECK_NATIVE on, each search ran in both and
    they agreed (the conftest sets CHECK_NATIVE for the whole suite)."""
    gr = _native_lib()
    if not gr.CHECK_NATIVE:
        pytest.skip("NPU_AMP_TF_CHECK_NATIVE_GRAD_REGION is off")
    before, differing = gr.CHECKED[0], len(gr.CHECKED[1])
    for kw in ({}, {"residual": True}, {"upstream_scale": True}, {"extra_reader": True}):
        graph, fwd, inputs, h = _tf1_graph(**kw)
        try:
            find_grad_region(graph, fwd, ["ln/y"], inputs)
        except GradRegionRefused:
            pass
    assert gr.CHECKED[0] == before + 4
    assert len(gr.CHECKED[1]) == differing


def test_check_mode_sees_a_wrong_native_answer(monkeypatch):
    """The comparison has teeth: a C++ answer missing the region's last node
    raises, and is recorded (the suite fails at its end even where a pass's
    error handling swallowed the exception)."""
    gr = _native_lib()
    graph, fwd, inputs, h = _tf1_graph()
    orig = gr._native_growth

    def wrong(*a, **kw):
        region, fwd_dep, dy_dep, val_static, why_not, dy, *hints = orig(*a, **kw)
        region = dict.fromkeys(list(region)[:-1])
        return (region, fwd_dep, dy_dep, val_static, why_not, dy, *hints)

    monkeypatch.setattr(gr, "_native_growth", wrong)
    monkeypatch.setattr(gr, "CHECK_NATIVE", True)
    monkeypatch.setattr(gr, "CHECKED", [0, []])
    with pytest.raises(AssertionError, match="differs from the Python one"):
        find_grad_region(graph, fwd, ["ln/y"], inputs)
    assert gr.CHECKED[0] == 1 and len(gr.CHECKED[1]) == 1


def test_native_mirror_follows_edits_and_refuses_non_ascii_names(monkeypatch):
    """The mirror is patched from the graph's edit and removal logs: after
    the graph's nodes are removed, re-added under the same name and rewired,
    the next search still equals Python's.  A non-ASCII name makes the
    mirror refuse (the C++ matchers read ASCII only): Python searches."""
    gr = _native_lib()
    monkeypatch.setattr(gr, "CHECK_NATIVE", True)
    monkeypatch.setattr(gr, "CHECKED", [0, []])
    graph, fwd, inputs, h = _tf1_graph()
    r1 = find_grad_region(graph, fwd, ["ln/y"], inputs)
    assert getattr(graph, gr._MIRROR_ATTR)  # built
    # re-emit a region node under its name (removed, added again), and rewire a reader
    name = r1.nodes[-1]
    node = graph.nodes[name]
    readers = graph.consumers(name)
    from tensorflow.core.framework import node_def_pb2
    copy = node_def_pb2.NodeDef()
    copy.CopyFrom(node)
    graph.remove_node(name, force=True)
    graph.add_node(copy)
    graph._consumers[name].extend(readers)  # (the readers' index entries, as the fusion commit repairs them)
    assert not graph.index_problems()
    r2 = find_grad_region(graph, fwd, ["ln/y"], inputs)
    assert r2.nodes == r1.nodes and r2.dy == r1.dy
    assert gr.CHECKED[0] == 2 and not gr.CHECKED[1]
    # a non-ASCII name: the mirror refuses, Python searches (nothing compared)
    graph2, fwd2, inputs2, _ = _tf1_graph()
    graph2.new_node("NoOp", "caf\u00e9")
    counts = []
    orig = gr._native_growth
    monkeypatch.setattr(gr, "_native_growth", lambda *a, **kw: counts.append(orig(*a, **kw)) or counts[-1])
    r3 = find_grad_region(graph2, fwd2, ["ln/y"], inputs2)
    assert counts == [None] and getattr(graph2, gr._MIRROR_ATTR) is False
    assert r3.nodes == r1.nodes


def test_the_mirror_takes_printable_ascii_names_only_at_every_position():
    """(issue 17) ``Printable`` reads names eight bytes at a time: a byte
    below 0x20 or above 0x7e anywhere in a name of any length (across the
    word boundaries and in the tail) refuses it, and 0x20 / 0x7e do not; the
    expectation is the byte rule itself, applied here byte by byte."""
    from graph_passes.fusion import grad_region
    from npu_amp_tf import bridge

    bridge.register()
    lib = grad_region.native
    assert lib is not None and lib.can_upsert_text
    bad_bytes = [0x00, 0x03, 0x1F, 0x7F, 0x80, 0xA0, 0xC3, 0xFF]
    edge_ok = [0x20, 0x21, 0x7D, 0x7E]
    cases = []
    for n in (1, 7, 8, 9, 15, 16, 17, 24, 31, 40, 100):
        base = bytearray((b"abcdefghijklmnopqrstuvwxyz/_0123456789" * 3)[:n])
        cases.append(bytes(base))
        for at in sorted({0, n // 2, n - 1, min(7, n - 1), min(8, n - 1)}):
            for b in bad_bytes + edge_ok:
                name = bytearray(base)
                name[at] = b
                cases.append(bytes(name))
    seen = 0
    for name in cases:
        want = all(0x20 <= b <= 0x7E for b in name)
        h = lib.new()
        try:
            got = lib.upsert_text(h, name + b"\x01NoOp") == 0
        finally:
            lib.free(h)
        assert got == want, (name, want)
        seen += not want
    assert seen > 300  # (the refusals were tried)
