"""Issue 17: the layer-norm rule's decisions made in C++ (custom_ops/grad_region.cc
``NormPlanner``, ``graph_passes.fusion.norm_plan``): its checks, the backward
region's search and finish, and the roles of the tensors leaving the region,
over the gradient-region search's mirror, with Python's emission and commit.

The C++ plan must be the Python reference's decisions exactly, or none (then
Python decides and words the reason).  Here, on real training graphs and on
one of each norm form written as raw ops (each with its gradient):

* the rewritten graphs and reports are identical with the planner on and off;
* the planner answered where it should (a count of its plans against the
  fusions made) and left the refusals to Python, whose reasons the report keeps;
* every plan was compared with the reference (the suite's ``CHECK_NATIVE``),
  and a planted difference in a plan is caught;
* the rules that match a norm by a pattern (``tf.nn.moments`` +
  ``batch_normalization``, Keras 3's ``LayerNormalization``) have their
  backward half decided in C++ too.
"""
import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from graph_passes.fusion import grad_region as gr
from graph_passes.fusion import norm_plan, prefuse
from npu_amp_tf import bridge
from test_precision_native import _graph

from conftest import assert_same


@pytest.fixture(autouse=True)
def _library():
    bridge.register()
    assert gr.native is not None and gr.native.can_norm_plan


def forms_training_graph(eps_const=True, fetch_mean=False):
    """One norm of each raw form on x = inp @ w [4, 16] (so dx is needed),
    gamma / beta variables, the gradient through an SGD step: moments,
    reduce_variance with a RealDiv by Sqrt, RMSNorm with and without gamma,
    and a Pow-2 variance (a form the C++ analysis leaves to Python).
    ``eps_const`` False: the moments form's epsilon is fed (no constant);
    ``fetch_mean``: its mean is fetched too."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(1)
        inp = tf.compat.v1.placeholder(tf.float32, [4, 8], name="inp")
        feeds = []
        eps = tf.constant(1e-5, name="eps")
        eps_fed = eps if eps_const else tf.compat.v1.placeholder_with_default(1e-5, [], name="eps_fed")
        outs, extra = [], []
        for scope in ("moments_ln", "variance_ln", "rms", "rms_plain", "pow_ln"):
            with tf.compat.v1.variable_scope(scope):
                w = tf.compat.v1.get_variable("w", [8, 16])
                gamma = tf.compat.v1.get_variable("gamma", [16], initializer=tf.compat.v1.ones_initializer())
                beta = tf.compat.v1.get_variable("beta", [16], initializer=tf.compat.v1.zeros_initializer())
                x = tf.matmul(inp, w)
                if scope == "moments_ln":
                    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
                    y = (x - mean) * tf.math.rsqrt(var + eps_fed) * gamma + beta
                    if fetch_mean:
                        extra.append(tf.identity(mean, name="mean_out"))
                elif scope == "variance_ln":
                    m = tf.reduce_mean(x, -1, keepdims=True)
                    v = tf.reduce_mean(tf.square(x - m), -1, keepdims=True)
                    y = gamma * (x - m) / tf.sqrt(v + eps) + beta
                elif scope == "rms":
                    y = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + eps) * gamma
                elif scope == "rms_plain":
                    y = x * tf.math.rsqrt(tf.reduce_mean(x * x, -1, keepdims=True) + eps)
                else:
                    m5 = tf.reduce_mean(x, -1, keepdims=True)
                    v5 = tf.reduce_mean(tf.pow(x - m5, 2.0), -1, keepdims=True)
                    y = (x - m5) * tf.math.rsqrt(v5 + eps) * gamma + beta
                outs.append(tf.reduce_sum(tf.tanh(y)))
        loss = tf.add_n(outs, name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    fetches = ["loss", "train"] + [e.op.name for e in extra]
    return g.as_graph_def(), fetches, feeds


def _rewrite(gd, fetches, on, monkeypatch, check=None):
    """(the rewritten graph's bytes, the report, plans made in C++, plans
    compared with Python's).  ``check`` False: the C++ plans are emitted as
    they are, not compared (and replaced by the reference's) first."""
    monkeypatch.setattr(norm_plan, "NATIVE_PLAN", on)
    # (the rule's own run, in the fusion pass: not the one made in C++ before the parse,
    # tests/test_prefuse.py, which would leave it no norm to plan)
    monkeypatch.setattr(prefuse, "PREFUSE", False)
    if check is not None:
        monkeypatch.setattr(gr, "CHECK_NATIVE", check)
    planned, compared = norm_plan.CHECKED_PLANS[0], norm_plan.CHECKED_PLANS[1]
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode="allow_mix_precision")
    return (out.SerializeToString(deterministic=True), rep, norm_plan.CHECKED_PLANS[0] - planned,
            norm_plan.CHECKED_PLANS[1] - compared)


@pytest.mark.parametrize("graph", ["forms", "moments", "bert_like"])
def test_cpp_plans_emitted_unchecked(k2, monkeypatch, graph):
    """The C++ plans emitted as they are (no comparison replacing them by
    the reference's): the same graph and report as Python's plans."""
    if graph == "forms":
        gd, fetches, _ = forms_training_graph()
    elif graph == "moments":
        gd, fetches = moments_training_graph()
    else:
        gd, fetches = _graph("bert_like", k2)
        fetches = [f.split(":")[0] for f in fetches]
    cpp = _rewrite(gd, fetches, True, monkeypatch, check=False)
    ref = _rewrite(gd, fetches, False, monkeypatch, check=False)
    assert cpp[2] == {"forms": 4, "moments": 3, "bert_like": 5}[graph] and cpp[3] == 0 and ref[2] == 0
    assert_same(cpp[0], ref[0], "the graphs from C++ plans and from Python's")
    assert cpp[1].decisions == ref[1].decisions


def _decisions(rep, rule="layer_norm"):
    return {k: v for k, v in rep.decisions.items() if v.get("fusion") == rule or v.get("fusion_skipped") == rule}


@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training"])
def test_real_graphs_same_with_the_planner(k2, monkeypatch, name):
    gd, fetches = _graph(name, k2)
    fetches = [f.split(":")[0] for f in fetches]
    on = _rewrite(gd, fetches, True, monkeypatch)
    off = _rewrite(gd, fetches, False, monkeypatch)
    assert_same(on[0], off[0], "the graphs with the C++ plan and without")
    assert on[1].decisions == off[1].decisions and on[1].summary.get("fusions") == off[1].summary.get("fusions")
    assert off[2] == 0
    fused = [k for k, v in on[1].decisions.items() if v.get("fusion") == "layer_norm"]
    if name == "bert_like":  # 1 + 2 per layer, all of the rule's forms, each with its gradient region
        assert len(fused) == 5 and all(on[1].decisions[k].get("fused_gradient_nodes") for k in fused)
        assert on[2] == 5 and on[3] == (5 if gr.CHECK_NATIVE else 0)
    else:  # (Keras 2's layer is a FusedBatchNorm form: another rule's, never planned here)
        assert on[2] == len(fused)


def test_each_form_planned_or_left(monkeypatch):
    gd, fetches, _ = forms_training_graph()
    on = _rewrite(gd, fetches, True, monkeypatch)
    off = _rewrite(gd, fetches, False, monkeypatch)
    assert_same(on[0], off[0], "the graphs with the C++ plan and without")
    assert on[1].decisions == off[1].decisions
    decided = _decisions(on[1])
    # four forms fused, each with its backward region replaced
    fused = {k: v for k, v in decided.items() if v.get("fusion")}
    assert {k.split("/")[0] for k in fused} == {"moments_ln", "variance_ln", "rms", "rms_plain"}, decided
    assert all(v.get("fused_gradient_nodes") for v in fused.values())
    # the Pow-2 variance: left to Python (its analysis), which refuses it (Pow's gradient reads
    # the forward's x - mean through a Greater, no gradient op) and says so
    skipped = {k: v for k, v in decided.items() if v.get("fusion_skipped")}
    assert [k.split("/")[0] for k in skipped] == ["pow_ln"]
    assert "Greater" in next(iter(skipped.values()))["fusion_reason"]
    out = tf.compat.v1.GraphDef.FromString(on[0])
    ops = [n.op for n in out.node]
    assert ops.count("LayerNormGrad") == 2 and ops.count("RMSNormGrad") == 2
    # C++ planned the four forms its analysis covers
    assert on[2] == 4
    if gr.CHECK_NATIVE:
        assert on[3] == 4


def test_refusals_are_left_to_python(monkeypatch):
    for kw, reason in (({"eps_const": False}, "the variance epsilon is not a constant >= 0"),
                       ({"fetch_mean": True}, "is fetched or preserved")):
        gd, fetches, _ = forms_training_graph(**kw)
        on = _rewrite(gd, fetches, True, monkeypatch)
        off = _rewrite(gd, fetches, False, monkeypatch)
        assert_same(on[0], off[0], "the graphs with the C++ plan and without")
        assert on[1].decisions == off[1].decisions
        skipped = {k: v for k, v in _decisions(on[1]).items() if v.get("fusion_skipped")}
        assert sorted(k.split("/")[0] for k in skipped) == ["moments_ln", "pow_ln"], skipped
        assert reason in next(v for k, v in skipped.items() if k.startswith("moments_ln/"))["fusion_reason"]
        assert on[2] == 3  # the other three C++ forms planned; the refused one left to Python


def test_fused_forms_compute_the_same(monkeypatch):
    """The rewritten graph (the plans' emission) against the original, in FP32."""
    gd, fetches, _ = forms_training_graph()
    monkeypatch.setattr(norm_plan, "NATIVE_PLAN", True)
    out, _ = npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode="must_keep_origin_dtype")
    assert sum(n.op in ("LayerNorm", "RMSNorm") for n in out.node) == 4
    feed = np.random.RandomState(0).standard_normal([4, 8]).astype(np.float32)
    vals = []
    for graph_def in (gd, out):
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
            with tf.compat.v1.Session(graph=g) as s:
                s.run([op for op in g.get_operations() if op.type in ("Assign", "AssignVariableOp")])  # (seeded)
                loss0 = s.run("loss:0", {"inp:0": feed})
                s.run("train", {"inp:0": feed})
                loss1 = s.run("loss:0", {"inp:0": feed})
        vals.append((loss0, loss1))
    # the same initial values (the same initializers' seeds), one SGD step through each
    # backward: float32 sums of 16-wide rows, ~1e-6 relative
    np.testing.assert_allclose(vals[1], vals[0], rtol=1e-5, atol=1e-5)


def test_a_planted_difference_is_caught(monkeypatch):
    if not gr.CHECK_NATIVE:
        pytest.skip("the comparison runs with grad_region.CHECK_NATIVE (the suite's default)")
    gd, fetches, _ = forms_training_graph()
    real = norm_plan._parse

    def off_by_one(text):
        facts = real(text)
        if facts.grad is not None:
            facts.grad.nodes = facts.grad.nodes[1:]
        return facts

    monkeypatch.setattr(norm_plan, "_parse", off_by_one)
    before = len(norm_plan.CHECKED_PLANS[2])
    try:
        with pytest.raises(Exception):
            npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode="allow_mix_precision",
                                     fail_on_error=True)
    finally:
        caught = norm_plan.CHECKED_PLANS[2][before:]
        del norm_plan.CHECKED_PLANS[2][before:]
    assert caught and caught[0][1].grad.nodes != caught[0][2].grad.nodes


def moments_training_graph(layers=3):
    """``tf.nn.moments`` + ``tf.nn.batch_normalization`` norms (BERT's TF1
    form: the ``layer_norm_moments`` rule, whose backward half the C++
    planner decides, ``norm_plan.grad_facts``), stacked, with an SGD step."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(2)
        h = tf.compat.v1.placeholder(tf.float32, [4, 8], name="inp")
        for i in range(layers):
            with tf.compat.v1.variable_scope(f"ln{i}"):
                w = tf.compat.v1.get_variable("w", [8, 8])
                gamma = tf.compat.v1.get_variable("gamma", [8], initializer=tf.compat.v1.ones_initializer())
                beta = tf.compat.v1.get_variable("beta", [8], initializer=tf.compat.v1.zeros_initializer())
                x = tf.matmul(h, w)
                mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
                h = tf.tanh(tf.nn.batch_normalization(x, mean, var, beta, gamma, 1e-5))
        loss = tf.reduce_sum(h, name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g.as_graph_def(), ["loss", "train"]


def keras3_training_graph():
    """A Keras 3 model's training step (``tf.function``, GradientTape, SGD)
    with two ``LayerNormalization`` layers: the ``layer_norm_keras3`` rule,
    variables read through the function's resource ``_Arg`` s."""
    import keras

    model = keras.Sequential([keras.Input((6, 16)), keras.layers.Dense(16), keras.layers.LayerNormalization(),
                              keras.layers.Dense(16), keras.layers.LayerNormalization(), keras.layers.Dense(4)])
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    cf = step.get_concrete_function(tf.TensorSpec([2, 6, 16]), tf.TensorSpec([2, 6, 4]))
    return cf.graph.as_graph_def(), [o.op.name for o in cf.outputs]


@pytest.mark.parametrize("name", ["moments", "keras3"])
def test_other_rules_backward_planned(monkeypatch, name):
    if name == "keras3":
        keras = pytest.importorskip("keras")
        if int(keras.__version__.split(".")[0]) < 3:
            pytest.skip(f"Keras {keras.__version__}: its LayerNormalization is the FusedBatchNorm form")
        gd, fetches = keras3_training_graph()
        rule, n = "layer_norm_keras3", 2
    else:
        gd, fetches = moments_training_graph()
        rule, n = "layer_norm_moments", 3
    on = _rewrite(gd, fetches, True, monkeypatch)
    off = _rewrite(gd, fetches, False, monkeypatch)
    assert_same(on[0], off[0], "the graphs with the C++ plan and without")
    assert on[1].decisions == off[1].decisions
    fused = {k: v for k, v in _decisions(on[1], rule).items() if v.get("fusion")}
    assert len(fused) == n and all(v.get("fused_gradient_nodes") for v in fused.values()), fused
    out = tf.compat.v1.GraphDef.FromString(on[0])
    assert sum(nd.op == "LayerNormGrad" for nd in out.node) == n
    # every backward half decided in C++ (and compared with Python's under the suite's CHECK_NATIVE)
    assert on[2] == n and off[2] == 0
    if gr.CHECK_NATIVE:
        assert on[3] == n


def test_bad_requests_never_crash():
    """Malformed or stale requests to the planner's entries get an answer
    (Python decides, bad arguments, or an answer to the question as asked),
    never a crash: an unknown anchor, a node that is no norm, too few
    sections, names that are not nodes, dims that are not numbers."""
    from graph_passes.graph import Graph

    gd, _, _ = forms_training_graph()
    data = gd.SerializeToString()
    graph = Graph(gd, index=bridge.graph_index(gd, data), copy=True)
    graph.source_bytes = data
    pos = gr._positions(graph)
    m = gr._mirror(graph, pos)
    assert m is not None and m.attrs
    memo = gr.native.shape_memo()
    try:
        lib = gr.native
        for req, grad in ((b"no_such_node\x03\x034000\x031", False), (b"inp\x03\x034000\x031", False),
                          (b"moments_ln/add_1", False), (b"", False),
                          (b"moments_ln/add_1\x03nope\x03x\x03\x031\x031\x0316\x03\x034000\x031", True),
                          (b"moments_ln/add_1\x03moments_ln/mul_1\x03moments_ln/MatMul\x03\x030\x030\x03"
                           b"a,b\x03\x03-5\x031", True)):
            answer = lib.norm_plan(m.h, memo, req, grad)
            assert answer is None or (isinstance(answer[0], bool) and isinstance(answer[1], str)), (req, answer)
            if not grad:  # (no anchor, no norm, or no request: Python decides, or bad arguments)
                assert answer is None or answer[0] is False, (req, answer)
        # and a well-formed request at a real anchor plans it
        planned, text = lib.norm_plan(m.h, memo, b"moments_ln/add_1\x03\x034000\x031")
        assert planned and text.split("\x03")[1] == "moments_ln/MatMul"
    finally:
        gr.native.free_shape_memo(memo)
