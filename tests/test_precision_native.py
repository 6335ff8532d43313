"""Issue 17l: the precision pass's painting loops in C++.

``PrecisionPass._paint``, ``_demote`` and ``_follow_readers`` run in
``custom_ops/precision_paint.cc`` over integer arrays
(``graph_passes/precision/native.py``) when the pipeline puts the entry point
on the pass context (``ctx.native_paint``); ``PrecisionPass.native_paint =
False`` runs the Python loops, the reference.

Each graph below is rewritten both ways: the GraphDefs must be byte-identical
(deterministic serialisation) and the reports equal (every decision with its
reason, state, list and dtypes, every warning in its order, the summary),
timings and the ``precision_paint`` marker aside; the marker must say which
loops ran, so a native path that silently fell back is caught.  Real graphs
(Keras ResNet50 and a Keras transformer block training steps, TF-Slim
ResNet-v1-50, the BERT-like builder), FP16 and BF16, graph levels 1 and 3,
keep_dtype / low_precision_nodes / custom black list, constants unsafe in the
low dtype, control flow v1 (cond Switch/Merge, while loops), offline and
through grappler.  A planted fault in the native result is caught."""
import json

import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from graph_passes.precision import amp
from graph_passes.precision import native as native_mod
from npu_amp_tf import bridge, pipeline
from test_precision_fast import (_strip_times, control_dependencies_graph, keras_learning_phase_graph,
                                 slim_resnet_graph)
from test_speed_paths import (_keras_resnet_training_graph, bert_like_training_graph, optimize_rewritten,
                              plugin_only_grappler)
from train_graphs import control_flow_v1

tf1 = tf.compat.v1

MODES = {
    "fp16": dict(precision_mode="allow_mix_precision"),
    "bf16": dict(precision_mode="allow_mix_precision_bf16"),
    "fp16_l1": dict(precision_mode="allow_mix_precision", graph_level=1),
    "bf16_l3": dict(precision_mode="allow_mix_precision_bf16", graph_level=3),
}


@pytest.fixture(autouse=True)
def _library():
    bridge.register()  # loads the library: the pipeline injects the native entry point
    assert pipeline.native_paint_entry() is not None, "the library has no native painting"


# ------------------------------------------------------------------ graphs
def keras_transformer_training_graph(k):
    """A Keras 2 transformer block (MultiHeadAttention, residual adds,
    LayerNormalization, GELU Dense) trained by Momentum, in a TF1 graph."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 6, 16], name="x")
        y = tf1.placeholder(tf.float32, [2, 6, 16], name="target")
        att = k.layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x)
        h = k.layers.LayerNormalization()(x + att)
        f = k.layers.Dense(32, activation="gelu")(h)
        h = k.layers.LayerNormalization()(h + k.layers.Dense(16)(f))
        loss = tf.reduce_mean(tf.square(h - y), name="loss")
        tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train")
    return g.as_graph_def(), ["loss", "train"]


def v1_control_flow_graph():
    """Control flow v1: a ``while_loop`` (Enter/Merge/Switch/NextIteration/
    Exit: loop plumbing, fixed) of MatMuls, then a ``cond`` (Switch/Merge of
    a conditional: clear ops), trained by SGD."""
    with control_flow_v1():
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [2, 4], name="x")
            w = tf1.get_variable("w", [4, 4])
            _, h = tf1.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.matmul(h, w, name="step")),
                                  [tf.constant(0), x], name="loop")
            y = tf1.cond(tf.reduce_sum(h) > 0, lambda: tf.nn.relu(h, name="pos"),
                         lambda: tf.negative(h, name="neg"), name="branch")
            z = tf1.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(y, w), lambda: y, name="branch2")
            loss = tf.reduce_sum(tf.square(z), name="loss")
            tf1.train.GradientDescentOptimizer(1e-3).minimize(loss, name="train")
    gd = g.as_graph_def()
    ops = {n.op for n in gd.node}
    assert {"Enter", "Merge", "Switch", "NextIteration", "Exit", "LoopCond"} <= ops, ops
    return gd, ["loss", "train"]


def unsafe_constants_graph():
    """Gray/white ops fed constants a low dtype cannot hold (1e-9 underflows
    in FP16, 1e6 overflows), a constant through an Identity and a Reshape,
    a Split fan-out (clear op going low before it), a Bitcast (fixed)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 8], name="x")
        w = tf1.get_variable("w", [8, 8])
        a = tf.matmul(x, w, name="mm")
        tiny = tf.identity(tf.constant(1e-9, tf.float32), name="tiny_id")
        b = tf.multiply(a, tiny, name="scaled_tiny")
        big = tf.reshape(tf.constant([1e6] * 8, tf.float32), [8], name="big_r")
        c = tf.add(a, big, name="plus_big")
        d = tf.matmul(c, tf.constant(np.full((8, 8), 1e-9, np.float32)), name="mm_tiny")
        parts = tf.split(x, 2, axis=1, name="split")
        e = tf.concat([tf.matmul(p, w[:4], name=f"mm_part{i}") for i, p in enumerate(parts)], 1)
        bits = tf.bitcast(a, tf.int32, name="bits")
        loss = tf.add_n([tf.reduce_sum(b), tf.reduce_sum(d), tf.reduce_sum(e),
                         tf.cast(tf.reduce_sum(bits), tf.float32)], name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g.as_graph_def(), ["loss", "train"]


_CACHE = {}


def _graph(name, k2):
    """(a fresh copy of the GraphDef, fetches), each graph built once per module."""
    from tensorflow.core.framework import graph_pb2

    if name not in _CACHE:
        _CACHE[name] = _build(name, k2)
    gd, fetches = _CACHE[name]
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(gd)
    return copy, list(fetches)


def _build(name, k2):
    if name == "keras_resnet50_training":
        return _keras_resnet_training_graph(k2), ["loss", "train"]
    if name == "keras_transformer_training":
        return keras_transformer_training_graph(k2)
    if name == "slim_resnet_v1_50":
        pytest.importorskip("tf_slim", reason="tf_slim is not installed in this environment")
        return slim_resnet_graph()
    if name == "bert_like":
        return bert_like_training_graph(), ["loss", "train"]
    if name == "learning_phase_conds":
        return keras_learning_phase_graph(k2)
    if name == "control_inputs":
        return control_dependencies_graph()
    if name == "v1_control_flow":
        return v1_control_flow_graph()
    if name == "unsafe_constants":
        return unsafe_constants_graph()
    raise KeyError(name)


# ---------------------------------------------------------------- checking
def _strip(obj):
    """Timings and the marker of which loops ran aside."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != "precision_paint"}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _rewrite(monkeypatch, gd, fetches, kw, native, paths):
    monkeypatch.setattr(amp.PrecisionPass, "native_paint", native)
    orig = amp.PrecisionPass.run

    def run(self, graph, ctx):
        res = orig(self, graph, ctx)
        paths.append(self.paint_path)
        return res

    monkeypatch.setattr(amp.PrecisionPass, "run", run)
    try:
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[f.split(":")[0] for f in fetches], **kw)
    finally:
        monkeypatch.setattr(amp.PrecisionPass, "run", orig)
    return out.SerializeToString(deterministic=True), rep.to_json()


def assert_native_equals_python(monkeypatch, gd, fetches, kw):
    paths_n, paths_p = [], []
    out_n, rep_n = _rewrite(monkeypatch, gd, fetches, kw, True, paths_n)
    out_p, rep_p = _rewrite(monkeypatch, gd, fetches, kw, False, paths_p)
    assert paths_n and paths_n[0] == "native", paths_n  # the main graph painted natively
    assert set(paths_p) == {"python"}
    assert rep_n["summary"]["precision_paint"] == "native"
    assert rep_p["summary"]["precision_paint"] == "python"
    assert rep_n["summary"].get("failed_pass") is None, rep_n["warnings"][:3]
    summ = rep_n["summary"]
    assert summ["casts_inserted"] + summ.get("functions_casts_inserted", 0) > 0
    assert out_n == out_p, "the native loops rewrote the graph differently"
    a, b = _strip(_strip_times(rep_n)), _strip(_strip_times(rep_p))
    assert a["decisions"] == b["decisions"], _first_difference(a["decisions"], b["decisions"])
    assert a["warnings"] == b["warnings"]
    assert a == b, "the reports differ"
    # (and in the same order: decisions, their fields, warnings, as a user reads the JSON)
    assert json.dumps(a, default=str) == json.dumps(b, default=str), "the reports' order differs"
    return rep_n


def _first_difference(a, b):
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return k, a.get(k), b.get(k)
    return None


# ------------------------------------------------------------------- tests
REAL = ["keras_resnet50_training", "keras_transformer_training", "slim_resnet_v1_50", "bert_like"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", REAL)
def test_real_graphs_native_equals_python(k2, monkeypatch, name, mode):
    gd, fetches = _graph(name, k2)
    assert_native_equals_python(monkeypatch, gd, fetches, MODES[mode])


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["learning_phase_conds", "control_inputs", "v1_control_flow"])
def test_control_flow_native_equals_python(k2, monkeypatch, name, mode):
    gd, fetches = _graph(name, k2)
    rep = assert_native_equals_python(monkeypatch, gd, fetches, MODES[mode])
    if name == "v1_control_flow":
        dec = rep["decisions"]
        loop = [n for n, d in dec.items() if d.get("list") == "fixed" and "loop plumbing" in d["reason"]]
        conds = [n for n, d in dec.items() if n.startswith("branch/") and d.get("list") == "clear"]
        assert loop and conds, (loop[:3], conds[:3])


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_unsafe_constants_and_fan_out(monkeypatch, mode):
    gd, fetches = unsafe_constants_graph()
    rep = assert_native_equals_python(monkeypatch, gd, fetches, MODES[mode])
    dec = rep["decisions"]
    if mode == "fp16":  # (BF16 holds 1e-9 and 1e6)
        assert "const underflow" in dec["mm_tiny"]["reason"], dec["mm_tiny"]
        assert any("const underflow" in w["message"] for w in rep["warnings"])
    assert dec["bits"]["state"] == "fixed"


@pytest.mark.parametrize("case", ["keep", "low", "black", "gray_unknown"])
def test_name_overrides_and_lists(k2, monkeypatch, case):
    gd, fetches = _graph("keras_resnet50_training", k2)
    names = [n.name for n in gd.node]
    convs = [n for n in names if n.endswith("conv/Conv2D")][:3]
    adds = [n.name for n in gd.node if n.op == "AddV2"][:4]
    bns = [n.name for n in gd.node if n.op.startswith("FusedBatchNorm")][:3]
    kw = dict(MODES["fp16"])
    if case == "keep":
        kw["keep_dtype_nodes"] = convs + adds
    elif case == "low":
        kw["low_precision_nodes"] = adds + bns
    elif case == "black":
        kw["custom_black_list"] = ["Relu", "AddV2"]
    else:
        kw["unknown_op_policy"] = "gray"
    rep = assert_native_equals_python(monkeypatch, gd, fetches, kw)
    dec = rep["decisions"]
    if case == "keep":
        assert all(dec[n]["list"] == "keep_dtype" for n in convs if n in dec)
    if case == "low":
        assert any("low_precision_nodes" in dec[n]["reason"] for n in adds if n in dec)
    if case == "black":
        assert all(dec[n]["list"] == "black" for n in adds if n in dec)


def test_fetched_nodes_and_keep_attr(monkeypatch):
    """Fetched/preserved nodes keep their dtypes, ``_keep_dtype`` attrs too."""
    gd, fetches = unsafe_constants_graph()
    for n in gd.node:
        if n.name in ("plus_big", "mm_part0"):
            n.attr["_keep_dtype"].b = True
    rep = assert_native_equals_python(monkeypatch, gd, fetches + ["scaled_tiny", "mm"], MODES["fp16"])
    assert rep["decisions"]["mm"]["list"] == "protected"
    assert rep["decisions"]["plus_big"]["list"] == "keep_dtype"


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_through_grappler(k2, monkeypatch, name):
    """Inside grappler (the item's index and classes, fusion first): the same
    output graph and report with the native loops and with Python's."""

    gd, fetches = _graph(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    outs, reps = [], []
    for native in (True, False):
        monkeypatch.setattr(amp.PrecisionPass, "native_paint", native)
        out, rep = optimize_rewritten(cfg, mg, name.encode())
        assert rep["summary"]["precision_paint"] == ("native" if native else "python")
        outs.append(out)
        reps.append(_strip(_strip_times(rep)))
    assert reps[0]["summary"]["casts_inserted"] > 0
    assert outs[0] == outs[1]
    assert reps[0] == reps[1]


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_per_node_build_equals_batched(k2, monkeypatch, name):
    """Issue 17n: ``PrecisionPass.native_batch = False`` (17l's per-node
    array build, the memos asked per node, every checked node visited by
    ``_fix_edges``) gives the graph and report of the batched build; the
    batched run lists the nodes ``_fix_edges`` visits (the native result's
    mismatch column), fewer than the nodes it checks."""
    gd, fetches = _graph(name, k2)
    seen = {}
    orig = amp.PrecisionPass._fix_edges

    def fix_edges(self, shapes):
        seen[self.native_batch] = self._mismatch
        return orig(self, shapes)

    monkeypatch.setattr(amp.PrecisionPass, "_fix_edges", fix_edges)
    res = []
    for batch in (True, False):
        monkeypatch.setattr(amp.PrecisionPass, "native_batch", batch)
        res.append(_rewrite(monkeypatch, gd, fetches, MODES["fp16"], True, []))
    assert seen[False] is None and seen[True], seen.get(True)
    assert res[0][0] == res[1][0], "the batched build rewrote the graph differently"
    assert json.dumps(_strip_times(res[0][1]), default=str) == json.dumps(_strip_times(res[1][1]), default=str)
    assert res[0][1]["summary"]["casts_inserted"] > 0


def test_without_entry_point_python_paints(monkeypatch):
    """No entry point on the context (a library without it, or the engine
    used alone): the Python loops run and the report says so."""
    monkeypatch.setattr(pipeline, "native_paint_entry", lambda: None)
    gd, fetches = control_dependencies_graph()
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, **MODES["fp16"])
    assert rep.summary["precision_paint"] == "python"


def test_non_mix_modes_paint_in_python(monkeypatch):
    gd, fetches = control_dependencies_graph()
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode="force_fp16")
    assert rep.summary["precision_paint"] == "python"


@pytest.mark.parametrize("fault", ["state", "voter", "demote", "mismatch"])
def test_a_planted_fault_is_caught(monkeypatch, fault):
    """The comparison has teeth: a native result with one decision changed
    (a state, a voter, a demotion dropped, the edges to fix not listed)
    differs from the reference."""
    real = pipeline.native_paint_entry()

    def planted(strings, ints, n_out, check):
        out = real(strings, ints, n_out, check)
        W = native_mod.OUT_WIDTH
        for i in range(n_out // W):
            b = i * W
            if fault == "state" and out[b + native_mod.O_DECIDED] == 2 and out[b + native_mod.O_STATE] == 1:
                out[b + native_mod.O_STATE] = 2
                break
            if fault == "voter" and out[b + native_mod.O_VOTER] >= 0:
                out[b + native_mod.O_VOTER] = i
                break
            if fault == "demote" and out[b + native_mod.O_DEMOTED]:
                out[b + native_mod.O_DEMOTED] = 0
                break
            if fault == "mismatch" and out[b + native_mod.O_MISMATCH]:
                out[b + native_mod.O_MISMATCH] = 0
                break
        else:
            raise RuntimeError(f"nothing to plant a {fault} fault on")
        return out

    monkeypatch.setattr(pipeline, "native_paint_entry", lambda: planted)
    gd = bert_like_training_graph()
    with pytest.raises(AssertionError):
        assert_native_equals_python(monkeypatch, gd, ["loss", "train"], MODES["fp16"])


@pytest.mark.parametrize("seed", range(6))
def test_first_indices_equal_numpy_unique(seed):
    """``native.first_indices``: the first node of every class, as ``np.unique``'s
    ``return_index`` gives it, for class ids numbered in order of first appearance (how
    ``paint`` numbers them: ``dict.fromkeys`` of the per-node keys)."""
    from array import array

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5000)) if seed else 1
    keys = rng.integers(0, max(1, n // int(rng.integers(1, 50))), n).tolist()
    ids = dict(zip(dict.fromkeys(keys), range(n)))
    cid = array("i", [ids[k] for k in keys])
    want = np.unique(np.frombuffer(cid, np.int32), return_index=True)[1].tolist()
    assert native_mod.first_indices(cid) == want
    assert native_mod.first_indices(array("i")) == []


# ------------------------------------------------- issue 17: positions, class numbering
def _built_positions(g):
    names = list(g.nodes)
    return dict(zip(names, range(len(names))))


@pytest.mark.parametrize("indexed", [False, True])
def test_positions_equal_the_built_map_through_edits(k2, indexed):
    """``Graph.positions`` is ``name -> index in list(nodes)`` in every state:
    fresh (C++ index adopted or not), after nodes are added one by one and in
    a batch, after a removal (ranks no longer dense: built), after a reindex
    (dense again); a fresh dict each time (the caller may edit it)."""
    from tensorflow.core.framework import node_def_pb2

    from graph_passes.graph import Graph

    gd, _ = _graph("keras_transformer_training", k2)
    g = Graph(gd, index=bridge.graph_index(gd) if indexed else None)
    assert g.prebuilt_index == indexed

    def check(dense):
        assert g._dense_ranks() is dense
        got = g.positions()
        assert got == _built_positions(g) and list(got) == list(g.nodes)
        got["\x00mine"] = -1  # the caller's own
        assert "\x00mine" not in g.positions() and "\x00mine" not in g._seq

    check(True)
    src = next(n for n in g.nodes if g.nodes[n].op == "MatMul")
    g.add_node(node_def_pb2.NodeDef(name="extra_a", op="Identity", input=[src]))
    check(True)
    reader, k = next((c, i) for c, i in g.consumers(src) if i >= 0)
    g.add_and_rewire([(node_def_pb2.NodeDef(name="extra_cast", op="Cast", input=[src]), reader, k, "extra_cast")])
    assert g.nodes[reader].input[k] == "extra_cast"
    check(True)
    g.remove_node("extra_a")
    check(False)
    g.reindex()
    check(True)


def test_positions_reference_switch(monkeypatch, k2):
    from graph_passes.graph import Graph

    gd, _ = _graph("keras_transformer_training", k2)
    g = Graph(gd)
    calls = []
    monkeypatch.setattr(Graph, "_dense_ranks", lambda self: calls.append(1) or True)
    monkeypatch.setattr(Graph, "dense_positions", False)
    assert g.positions() == _built_positions(g) and not calls  # (the reference asks nothing)


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "learning_phase_conds"])
def test_first_by_class_and_dense_positions_equal_the_reference(k2, monkeypatch, name):
    """``native.FIRST_BY_CLASS`` (classes numbered before the odd ones are
    looked for; renumbered only when some are odd) and ``Graph.positions``
    from the graph's ranks give the graph and report of the reference
    (every key's first node from a dict, positions built name by name),
    offline and through grappler.  The fast paths ran: the ranks were dense
    when the painting asked, and the keys were numbered once where no class
    is odd (Keras ResNet50: every node has its C++ class and no cond op) and
    twice where some are (the learning-phase conds).  (On
    BERT-like the fusions remove nodes before the painting, and so do some
    passes before the conds graph's: the ranks have gaps and the positions
    are built; the same answer.)"""
    from graph_passes.graph import Graph

    gd, fetches = _graph(name, k2)
    numbers, dense = [], []
    orig_number, orig_dense = native_mod._number, Graph._dense_ranks

    def number(keys, n):
        numbers[-1] += 1
        return orig_number(keys, n)

    def dense_ranks(self):
        dense.append(orig_dense(self))
        return dense[-1]

    monkeypatch.setattr(native_mod, "_number", number)
    monkeypatch.setattr(Graph, "_dense_ranks", dense_ranks)
    res = {}
    for on in (True, False):
        monkeypatch.setattr(native_mod, "FIRST_BY_CLASS", on)
        monkeypatch.setattr(Graph, "dense_positions", on)
        numbers.append(0)
        offline = _rewrite(monkeypatch, gd, fetches, MODES["fp16"], True, [])
        if name == "learning_phase_conds":
            res[on] = (offline[0], _strip_times(offline[1]))
            continue
        mg, cfg = plugin_only_grappler(gd, fetches)
        out, rep = optimize_rewritten(cfg, mg, name.encode())
        assert rep["summary"]["precision_paint"] == "native"
        res[on] = (offline[0], _strip_times(offline[1]), out, _strip(_strip_times(rep)))
    assert res[True][0] == res[False][0], "the painting rewrote the graph differently"
    assert json.dumps(res[True][1], default=str) == json.dumps(res[False][1], default=str)
    if len(res[True]) > 2:
        assert res[True][2] == res[False][2] and res[True][3] == res[False][3]
    assert dense, "the painting did not ask Graph.positions"
    if name == "keras_resnet50_training":  # (BERT-like's fusions remove nodes: ranks with gaps)
        assert all(dense), dense
    # (the reference numbers once per painting; FIRST_BY_CLASS once more per
    # painting with odd classes)
    on_calls, paintings = numbers
    if name == "keras_resnet50_training":
        assert on_calls == paintings == 2, numbers  # offline and through grappler: no renumbering
    if name == "learning_phase_conds":
        assert on_calls > paintings, numbers  # cond classes are odd: numbered, then renumbered


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "slim_resnet_v1_50",
                                  "learning_phase_conds"])
def test_the_paintings_input_is_the_same_with_the_set_up_switches(k2, monkeypatch, name):
    """Issue 17: the painting's set-up switches (``native.FIRST_BY_CLASS``,
    ``native.SCRATCH_ATTRS_ONLY``: a class's re-typed dtypes from a scratch
    NodeDef of its op and attrs; ``Graph.dense_positions``) hand the C++
    painting the very same input (its strings and ints) as the references,
    painting after painting; a set-up that read a wrong dtype, class or
    position would change those ints."""
    from graph_passes.graph import Graph

    gd, fetches = _graph(name, k2)
    real = pipeline.native_paint_entry()
    seen = []

    def entry(strings, ints, n_out, check):
        seen[-1].append((bytes(strings), ints.tobytes()))
        return real(strings, ints, n_out, check)

    monkeypatch.setattr(pipeline, "native_paint_entry", lambda: entry)
    for on in (True, False):
        for owner, attr in ((native_mod, "FIRST_BY_CLASS"), (native_mod, "SCRATCH_ATTRS_ONLY"),
                            (Graph, "dense_positions")):
            monkeypatch.setattr(owner, attr, on)
        seen.append([])
        _rewrite(monkeypatch, gd, fetches, MODES["fp16"], True, [])
        _rewrite(monkeypatch, gd, fetches, MODES["bf16"], True, [])
    assert seen[0] and len(seen[0]) == len(seen[1])
    for k, (a, b) in enumerate(zip(seen[0], seen[1])):
        assert a[0] == b[0], f"painting {k}: strings differ"
        assert a[1] == b[1], f"painting {k}: ints differ"
