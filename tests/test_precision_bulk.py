"""Issue 17t: the precision pass's Python around the native painting, in bulk.

``PrecisionPass.bulk_apply`` applies the native result from its columns
(numpy selections) and hands the painted nodes' report entries to the
report as a writer run when its decisions are first read
(``Report.defer_decisions``); ``PrecisionPass.bulk_casts`` inserts the
casts ``_fix_edges`` needs in one batch (``Graph.add_casts``).  False runs
the reference (17n's ``native._apply``, ``cast_to`` per edge).

Each graph is rewritten with the switches on and off: the GraphDefs must be
byte-identical and the reports equal, in the same order (decisions, their
fields, warnings, summary), timings aside.  Real graphs (Keras ResNet50,
Keras 2 and Keras 3 transformer training steps, TF-Slim ResNet-v1-50, the
BERT-like builder), FP16 and BF16, the other precision modes, a
modify_mixlist, name overrides, constants unsafe in the low dtype, offline
and through grappler.  Planted faults in the deferred entries are caught.
"""
import json

import pytest

import npu_amp_tf
from graph_passes.precision import amp
from graph_passes.precision import native as native_mod
from graph_passes.report import Report
from npu_amp_tf import bridge, pipeline
from test_precision_fast import _strip_times
from test_precision_native import _graph, unsafe_constants_graph
from test_speed_paths import optimize_rewritten, plugin_only_grappler

from conftest import assert_same

SWITCHES = ("bulk_apply", "bulk_casts", "batch_saves", "copy_probe", "native_casts")

MODES = {
    "fp16": dict(precision_mode="allow_mix_precision"),
    "bf16": dict(precision_mode="allow_mix_precision_bf16"),
    "fp16_l3": dict(precision_mode="allow_mix_precision", graph_level=3),
    "keep": dict(precision_mode="must_keep_origin_dtype"),
    "fp32_to_fp16": dict(precision_mode="allow_fp32_to_fp16"),
    "force_fp16": dict(precision_mode="force_fp16"),
}


@pytest.fixture(autouse=True)
def _library():
    bridge.register()
    assert pipeline.native_paint_entry() is not None, "the library has no native painting"


def _set(monkeypatch, on):
    for s in SWITCHES:
        if hasattr(amp.PrecisionPass, s):
            monkeypatch.setattr(amp.PrecisionPass, s, on)


def _rewrite(monkeypatch, gd, fetches, kw, on):
    _set(monkeypatch, on)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[f.split(":")[0] for f in fetches], **kw)
    return out.SerializeToString(deterministic=True), rep


def assert_bulk_equals_reference(monkeypatch, gd, fetches, kw, casts=True):
    out_b, rep_b = _rewrite(monkeypatch, gd, fetches, kw, True)
    out_r, rep_r = _rewrite(monkeypatch, gd, fetches, kw, False)
    paint = rep_b.summary.get("precision_paint")
    if str(kw.get("precision_mode", "")).startswith("allow_mix"):
        assert paint == "native", paint  # (the main graph painted natively: the bulk path ran)
    a, b = _strip_times(rep_b.to_json()), _strip_times(rep_r.to_json())
    assert a["summary"].get("failed_pass") is None, a["warnings"][:3]
    if casts:
        assert a["summary"]["casts_inserted"] + a["summary"].get("functions_casts_inserted", 0) > 0
    assert_same(out_b, out_r, "the bulk path's and the reference's graphs")
    assert a["warnings"] == b["warnings"]
    assert a["decisions"] == b["decisions"], _first_difference(a["decisions"], b["decisions"])
    assert a == b
    assert_same(json.dumps(a, default=str), json.dumps(b, default=str), "the reports in their order")
    return a


def _first_difference(a, b):
    for k in list(a) + list(b):
        if a.get(k) != b.get(k):
            return k, a.get(k), b.get(k)
    return list(a)[:5], list(b)[:5]


REAL = ["keras_resnet50_training", "keras_transformer_training", "slim_resnet_v1_50", "bert_like"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", REAL)
def test_real_graphs_bulk_equals_reference(k2, monkeypatch, name, mode):
    gd, fetches = _graph(name, k2)
    mixed = MODES[mode]["precision_mode"].startswith("allow_mix")
    assert_bulk_equals_reference(monkeypatch, gd, fetches, MODES[mode], casts=mixed or mode == "force_fp16")


def test_keras3_transformer(monkeypatch):
    from test_fusion_skip import keras3_transformer_training_graph

    gd, fetches = keras3_transformer_training_graph()
    for mode in ("fp16", "bf16"):
        assert_bulk_equals_reference(monkeypatch, gd, fetches, MODES[mode])


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_modify_mixlist_and_overrides(k2, monkeypatch, tmp_path, mode):
    gd, fetches = _graph("bert_like", k2)
    mix = tmp_path / "mixlist.json"
    mix.write_text(json.dumps({"black-list": {"to-remove": ["Exp"], "to-add": ["Tanh"]},
                               "white-list": {"to-remove": ["BatchMatMulV2"]}}))
    names = [n.name for n in gd.node]
    adds = [n.name for n in gd.node if n.op == "AddV2"][:4]
    kw = dict(MODES[mode], modify_mixlist=str(mix), keep_dtype_nodes=adds[:2],
              low_precision_nodes=adds[2:])
    rep = assert_bulk_equals_reference(monkeypatch, gd, fetches, kw)
    assert rep["decisions"][adds[0]]["list"] == "keep_dtype", names[:3]


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_unsafe_constants(monkeypatch, mode):
    gd, fetches = unsafe_constants_graph()
    rep = assert_bulk_equals_reference(monkeypatch, gd, fetches + ["scaled_tiny"], MODES[mode])
    if mode == "fp16":
        assert "const underflow" in rep["decisions"]["mm_tiny"]["reason"]
        assert any("const underflow" in w["message"] for w in rep["warnings"])


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_through_grappler(k2, monkeypatch, name):
    """Inside grappler (the item's index, fusion first): the same output and
    report with the switches on and off."""

    assert_grappler_on_equals_off(k2, name, lambda on: _set(monkeypatch, on))


def assert_grappler_on_equals_off(k2, name, set_on):
    """Through grappler, with a switch on then off (``set_on(bool)``): the
    same output graph and report (times aside), with casts inserted."""
    gd, fetches = _graph(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    outs, reps = [], []
    for on in (True, False):
        set_on(on)
        out, rep = optimize_rewritten(cfg, mg, name.encode())
        outs.append(out)
        reps.append(_strip_times(rep))
    assert reps[0]["summary"]["casts_inserted"] > 0
    assert outs[0] == outs[1]
    assert json.dumps(reps[0], default=str) == json.dumps(reps[1], default=str)


def test_report_decisions_deferred_in_order():
    """A decide() made while entries are deferred lands after them, as if
    everything had been written at once; reading resolves once."""
    r = Report()
    r.decide("a", x=1)
    calls = []

    def writer(d):
        calls.append(1)
        d.setdefault("b", {}).update(y=2)
        d.setdefault("a", {}).update(z=3)

    r.defer_decisions(writer)
    r.decide("c", w=4)
    r.decide("b", v=5)
    assert not calls
    assert list(r.decisions) == ["a", "b", "c"]
    assert r.decisions == {"a": {"x": 1, "z": 3}, "b": {"y": 2, "v": 5}, "c": {"w": 4}}
    assert calls == [1]
    r.decisions = {"q": {}}
    assert r.decisions == {"q": {}}


def test_the_deferred_entries_are_not_built_in_the_pass(monkeypatch):
    """With bulk_apply the pass leaves its painted entries to the report;
    nothing builds them until the report is read."""
    gd, fetches = unsafe_constants_graph()
    built = []
    orig = native_mod._Entries.items

    def items(self):
        built.append(1)
        return orig(self)

    monkeypatch.setattr(native_mod._Entries, "items", items)
    _set(monkeypatch, True)
    from graph_passes.graph import Graph
    from graph_passes.manager import PassContext
    from npu_amp_tf.options import Options

    ctx = PassContext(Options.from_kwargs(**MODES["fp16"]), ["loss", "train"], ())
    ctx.native_paint = pipeline.native_paint_entry()
    amp.PrecisionPass().run(Graph(gd), ctx)
    assert not built
    assert ctx.report.decisions["mm"]["state"] == "low"
    assert built == [1]


@pytest.mark.parametrize("fault", ["demote", "voter", "order", "cast_order", "mask", "const_skip"])
def test_a_planted_fault_is_caught(k2, monkeypatch, fault):
    from graph_passes.graph import Graph

    if fault == "const_skip":  # every Const passed over
        orig_conv = amp.PrecisionPass._convert_consts

        def conv(self):
            if self._const_skip is not None:
                self._const_skip = set(self.g.nodes_of_type("Const"))
            return orig_conv(self)
        monkeypatch.setattr(amp.PrecisionPass, "_convert_consts", conv)

    if fault == "mask":  # one listed input dropped from the native mismatch masks
        orig_fix = amp.PrecisionPass._fix_edges

        def fix(self, shapes):
            m = self._mismatch_inputs
            if m:
                name = next(n for n in sorted(m) if m[n])
                m[name] &= m[name] - 1
                if self._painted_with is not None:  # (the record the C++ plan reads: native_casts)
                    rec = self._painted_with[1]
                    at = self._const_wants[0][name] * native_mod.OUT_WIDTH + native_mod.O_MISMATCH
                    rec[at] = m[name]
            return orig_fix(self, shapes)
        monkeypatch.setattr(amp.PrecisionPass, "_fix_edges", fix)
    if fault == "cast_order":  # the batch's casts added in reverse
        orig_rewire = Graph.add_and_rewire
        monkeypatch.setattr(Graph, "add_and_rewire", lambda self, steps: orig_rewire(self, steps[::-1]))
    orig = native_mod._Entries.items

    def items(self):
        out = list(orig(self))
        if fault == "demote":
            out = [(n, dict(f, reason=f["reason"].replace("kept FP32", "kept fp32"))) for n, f in out]
        elif fault in ("cast_order", "mask", "const_skip"):
            pass
        elif fault == "voter":
            out = [(n, dict(f, reason=f["reason"].replace("followed producer '", "followed '"))) for n, f in out]
        else:
            out = out[1:] + out[:1]
        return iter(out)

    monkeypatch.setattr(native_mod._Entries, "items", items)
    gd, fetches = _graph("keras_resnet50_training", k2)
    with pytest.raises(AssertionError):
        assert_bulk_equals_reference(monkeypatch, gd, fetches, MODES["fp16"])


def test_fp16_copy_reads_between_casts(monkeypatch):
    """``keep_fp16_copies``: the FP16 copy reads the pass adds while it
    inserts casts land in the graph in the reference's order (the batch is
    flushed before each)."""
    import numpy as np
    import tensorflow as tf

    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 3], name="x")
        y = tf1.placeholder(tf.int32, [4], name="y")
        h = x
        for i in range(3):
            w = tf1.get_variable(f"w{i}", initializer=np.full((3, 3), 0.1 * (i + 1), np.float32),
                                 use_resource=True)
            h = tf.nn.relu(tf.matmul(h, w, name=f"mm{i}") + tf.reduce_sum(x, name=f"sx{i}"), name=f"act{i}")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h), name="loss")
        opt = npu_amp_tf.AMP_Optimizer(tf1.train.GradientDescentOptimizer(0.5), keep_fp16_copies=True)
        train = opt.minimize(loss).name
        tf.group(tf1.global_variables_initializer(), name="init_global")
        tf.group(tf1.local_variables_initializer(), name="init_local")
    from graph_passes.graph import Graph

    calls = []
    orig = Graph.add_and_rewire

    def add_and_rewire(self, steps):
        calls.append(len(steps))
        return orig(self, steps)

    monkeypatch.setattr(Graph, "add_and_rewire", add_and_rewire)
    rep = assert_bulk_equals_reference(monkeypatch, g.as_graph_def(),
                                       ["loss", train, "init_global", "init_local"], MODES["fp16"])
    assert rep["summary"]["fp16_copy_reads"] == 3
    assert len(calls) >= 2, calls  # (a batch was flushed before a copy read)


def test_copy_probe_asks_about_copies_only_when_there_are_some(k2, monkeypatch):
    """``PrecisionPass.copy_probe``: without FP16 working copies in the graph
    (Keras ResNet50, no keep_fp16_copies) no new cast asks
    ``_fp16_copy_read``, and the graph is the one asking gives; with copies
    (test_fp16_copy_reads_between_casts) the reads are still made."""
    gd, fetches = _graph("keras_resnet50_training", k2)
    asked = []
    orig = amp.PrecisionPass._fp16_copy_read

    def copy_read(self, src, port, dt):
        asked.append(src)
        return orig(self, src, port, dt)

    monkeypatch.setattr(amp.PrecisionPass, "_fp16_copy_read", copy_read)
    outs = {}
    for probe in (True, False):
        monkeypatch.setattr(amp.PrecisionPass, "copy_probe", probe)
        asked.clear()
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[f.split(":")[0] for f in fetches], **MODES["fp16"])
        outs[probe] = (out.SerializeToString(deterministic=True), len(asked), rep.summary["casts_inserted"])
    assert outs[True][1] == 0 and outs[False][1] >= outs[False][2] > 100, outs
    assert outs[True][0] == outs[False][0]


# ----------------------------------------- issue 17: the casts' plan in C++
def _native_casts(monkeypatch, on):
    _set(monkeypatch, True)
    monkeypatch.setattr(amp.PrecisionPass, "native_casts", on)


@pytest.mark.parametrize("mode", ["fp16", "bf16", "fp16_l3"])
@pytest.mark.parametrize("name", REAL)
def test_native_cast_plan_equals_the_python_plan(k2, monkeypatch, name, mode):
    """``PrecisionPass.native_casts``: the C++ painter's plan of the casts on
    mismatched edges (``native.fix_edges``) against ``_fix_edges_bulk``, the
    other switches on: byte-identical graphs, equal reports in their order,
    and the C++ plan was made (the switch is not silently idle)."""
    gd, fetches = _graph(name, k2)
    res = {}
    for on in (True, False):
        _native_casts(monkeypatch, on)
        made, delays = native_mod.CAST_PLANS[0], native_mod.DELAY_PLANS[0]
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[f.split(":")[0] for f in fetches], **MODES[mode])
        res[on] = (out.SerializeToString(deterministic=True), _strip_times(rep.to_json()),
                   native_mod.CAST_PLANS[0] - made, native_mod.DELAY_PLANS[0] - delays)
    assert res[True][2] >= 1 and res[False][2] == 0, (res[True][2], res[False][2])
    assert res[True][1]["summary"]["casts_inserted"] > 0
    if name in ("bert_like", "keras_transformer_training") and mode != "bf16":
        # (FP32 copies of FP16 activations read by the backward pass: the delay's plan, in C++ too)
        assert res[True][1]["summary"]["casts_delayed"] > 0
        assert res[True][3] >= 1 and res[False][3] == 0, (res[True][3], res[False][3])
    assert_same(res[True][0], res[False][0], "the C++ plan's and the Python plan's graphs")
    assert json.dumps(res[True][1], default=str) == json.dumps(res[False][1], default=str)


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "keras_transformer_training"])
def test_native_cast_plan_through_grappler(k2, monkeypatch, name):
    """Inside grappler (the item's index, the fusion pass first, the painting
    strings from the item): the C++ plan gives the Python plan's graph."""
    made = native_mod.CAST_PLANS[0]
    assert_grappler_on_equals_off(k2, name, lambda on: _native_casts(monkeypatch, on))
    assert native_mod.CAST_PLANS[0] > made


def cast_names_graph():
    """FP16 MatMuls reading float32 tensors where the reference's names and
    reuse rules show: ``x/CastToFp16`` is taken by an Identity (the new Cast
    is ``x/CastToFp16_1``), ``y`` has a user Cast to float16 with a control
    input (never reused) and ``z`` one without (reused), and ``w:1`` (port 1
    of a Split) gets ``w/CastToFp16_1`` (the port suffix); ``v`` is read
    through a float32->float32 Cast (its root is ``v``)."""
    import tensorflow as tf

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="x")
        tf.identity(x, name="x/CastToFp16")
        y = tf.compat.v1.placeholder(tf.float32, [4, 4], name="y")
        z = tf.compat.v1.placeholder(tf.float32, [4, 4], name="z")
        v = tf.compat.v1.placeholder(tf.float32, [4, 4], name="v")
        w = tf.split(tf.compat.v1.placeholder(tf.float32, [4, 8], name="wsrc"), 2, axis=1, name="w")
        with tf.control_dependencies([x]):
            yc = tf.cast(y, tf.float16, name="y_user_cast")
        zc = tf.cast(z, tf.float16, name="z_user_cast")
        vv = tf.cast(v, tf.float32, name="v_same")
        outs = [tf.matmul(x, y, name="mm_xy"), tf.matmul(z, w[1], name="mm_zw"),
                tf.matmul(vv, x, name="mm_vx"), tf.matmul(yc, zc, name="mm_user")]
        tf.add_n([tf.cast(o, tf.float32) for o in outs], name="out")
    return g.as_graph_def(), ["out"]


def test_native_cast_plan_names_and_reuse(monkeypatch):
    """The rules the plan follows, derived by hand: a taken name gets "_1",
    port 1 a "_1" suffix, a user Cast with a control input is not reused and
    one without is, a float Cast is seen through to its root."""
    gd, fetches = cast_names_graph()
    res = {}
    for on in (True, False):
        _native_casts(monkeypatch, on)
        made = native_mod.CAST_PLANS[0]
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode="allow_mix_precision")
        res[on] = out
        assert (native_mod.CAST_PLANS[0] > made) == on
    assert_same(res[True].SerializeToString(deterministic=True), res[False].SerializeToString(deterministic=True),
                "the C++ plan's and the Python plan's graphs")
    nodes = {n.name: n for n in res[True].node}
    assert list(nodes["mm_xy"].input) == ["x/CastToFp16_1", "y/CastToFp16"]
    assert nodes["x/CastToFp16_1"].op == "Cast" and list(nodes["x/CastToFp16_1"].input) == ["x"]
    assert nodes["x/CastToFp16"].op == "Identity"
    assert list(nodes["mm_zw"].input) == ["z_user_cast", "w/CastToFp16_1"]
    assert list(nodes["w/CastToFp16_1"].input) == ["w:1"]
    assert list(nodes["mm_vx"].input) == ["v/CastToFp16", "x/CastToFp16_1"]
    assert "y_user_cast" not in nodes["mm_xy"].input
