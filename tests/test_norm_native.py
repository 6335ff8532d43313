"""Issue 17 (the C++ core's milestone 3, the layer-norm fusion's match): the
layer-norm rule's analysis (``builtin._analyze_norm``) in C++ over the
gradient-region search's mirror (custom_ops/grad_region.cc ``NormAnalyzer``,
``builtin._native_norms``).

Every Add/AddV2/Mul/RealDiv of graphs holding the norm forms the rule
knows, and real training graphs, is analysed both ways: the answers (kind,
references as written, the inner nodes in order) are equal, the C++ side
answers the forms it covers and leaves the others (a ``Pow`` exponent) to
Python, and the rule's fusions are the same with the switch on and off.
(The test suite also compares every analysis the fusion pass asks for,
``grad_region.CHECK_NATIVE``.)"""
import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from graph_passes.fusion import builtin
from graph_passes.fusion import grad_region as gr
from graph_passes.fusion import prefuse
from graph_passes.graph import Graph
from npu_amp_tf import bridge
from test_precision_native import _graph

from conftest import assert_same


@pytest.fixture(autouse=True)
def _library():
    bridge.register()
    assert gr.native is not None and gr.native.can_analyze_norms


def norm_forms_graph():
    """Each form once, on x [4, 16]: moments, reduce_variance (Square of
    x - mean, a RealDiv by Sqrt), RMSNorm with and without gamma, a Pow 2
    variance, and a mean without keep_dims (no norm)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 16], name="x")
        gamma = tf.constant(np.linspace(0.5, 1.5, 16, dtype=np.float32), name="gamma")
        beta = tf.constant(np.linspace(-0.1, 0.1, 16, dtype=np.float32), name="beta")
        eps = tf.constant(1e-5, name="eps")
        with tf.name_scope("moments_ln"):
            mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
            y1 = (x - mean) * tf.math.rsqrt(var + eps) * gamma + beta
        with tf.name_scope("variance_ln"):
            m = tf.reduce_mean(x, -1, keepdims=True)
            v = tf.reduce_mean(tf.square(x - m), -1, keepdims=True)
            y2 = gamma * (x - m) / tf.sqrt(v + eps) + beta
        with tf.name_scope("rms"):
            y3 = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + eps) * gamma
            y4 = x * tf.math.rsqrt(tf.reduce_mean(x * x, -1, keepdims=True) + eps)
        with tf.name_scope("pow_ln"):
            m5 = tf.reduce_mean(x, -1, keepdims=True)
            v5 = tf.reduce_mean(tf.pow(x - m5, 2.0), -1, keepdims=True)
            y5 = (x - m5) * tf.math.rsqrt(v5 + eps)
        with tf.name_scope("flat_mean"):
            m6 = tf.reshape(tf.reduce_mean(x, -1), [4, 1])
            v6 = tf.reduce_mean(tf.square(x - m6), -1, keepdims=True)
            y6 = (x - m6) * tf.math.rsqrt(v6 + eps)
        tf.add_n([y1, y2, y3, y4, y5, y6], name="out")
    return g.as_graph_def()


def _mirrored(gd):
    data = gd.SerializeToString()
    graph = Graph(gd, index=bridge.graph_index(gd, data), copy=True)
    graph.source_bytes = data
    return graph


def _answers(graph):
    names = [n for n, node in graph.nodes.items() if node.op in ("Add", "AddV2", "Mul", "RealDiv")]
    m = gr._mirror(graph, None)
    assert m is not None and m.attrs
    text = gr.native.analyze_norms(m.h, names)
    return names, {item.split("\x01")[0]: item.split("\x01")[1:] for item in text.split("\x02")}


def test_each_form_equals_python():
    graph = _mirrored(norm_forms_graph())
    names, native = _answers(graph)
    assert set(names) <= set(native)
    found = {}
    for name in names:
        status = native[name][0]
        ref = builtin._analyze_norm(graph, graph.nodes[name])
        if status == "p":
            continue
        if status == "n":
            assert ref is None, name
            continue
        kind, x, axes, eps, gamma, beta, inner = native[name][1:8]
        got = {"kind": "layer_norm" if kind == "l" else "rms_norm", "x": x, "axes": axes, "eps": eps,
               "gamma": None if gamma == "\x04" else gamma, "inner": inner.split("\x05"),
               "beta": None if beta == "\x04" else beta}
        assert got == ref, name
        found[name] = got
    scopes = {n.split("/")[0] for n in found}
    # the forms C++ covers were found; the Pow variance is Python's to decide
    assert {"moments_ln", "variance_ln", "rms"} <= scopes, scopes
    assert "flat_mean" not in scopes and "pow_ln" not in scopes
    assert any(native[n][0] == "p" for n in names if n.startswith("pow_ln/"))
    assert any(builtin._analyze_norm(graph, graph.nodes[n]) for n in names if n.startswith("pow_ln/"))
    kinds = {v["kind"] for v in found.values()}
    assert kinds == {"layer_norm", "rms_norm"}
    # gamma / beta as written, or absent
    ln = [v for k, v in found.items() if k.startswith("moments_ln/") and v["beta"] is not None]
    assert ln and ln[0]["beta"] == "beta" and ln[0]["gamma"] == "gamma"


@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training"])
def test_real_graphs_equal_python(k2, name):
    gd, _ = _graph(name, k2)
    graph = _mirrored(gd)
    names, native = _answers(graph)
    answered = 0
    for n in names:
        if native[n][0] == "p":
            continue
        ref = builtin._analyze_norm(graph, graph.nodes[n])
        assert (ref is None) == (native[n][0] == "n"), n
        if ref is not None:
            assert native[n][2] == ref["x"] and native[n][7].split("\x05") == ref["inner"], n
            answered += 1
    # (the Keras 2 layer is a FusedBatchNorm form, another rule's)
    assert answered >= (5 if name == "bert_like" else 0), answered


@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training"])
def test_fusions_equal_with_the_switch(k2, monkeypatch, name):
    # (the pass's own layer-norm rule, which the run before the parse would
    # leave idle: that run is tests/test_prefuse.py's)
    monkeypatch.setattr(prefuse, "PREFUSE", False)
    gd, fetches = _graph(name, k2)
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(builtin, "NATIVE_NORMS", on)
        calls = builtin.NATIVE_NORM_CALLS[0]
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[f.split(":")[0] for f in fetches],
                                            precision_mode="allow_mix_precision")
        outs[on] = (out.SerializeToString(deterministic=True), rep.summary.get("fusions"),
                    builtin.NATIVE_NORM_CALLS[0] - calls)
    assert outs[True][1] and outs[True][1] > 0
    assert outs[False][2] == 0
    if name == "bert_like":  # (its norms are the rule's forms: the C++ analysis answered)
        assert outs[True][2] > 0
    assert_same(outs[True][0], outs[False][0], "the graphs with the C++ analysis and without")
