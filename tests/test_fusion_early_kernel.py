"""Issue 17o: ``core.EARLY_KERNEL_MISS`` (``Builder.stop_if_kernel_missing``) changes no
rewrite and no report.

The bias-family builds (``_emit_fused``) require the fused op's kernel in the dtype the
precision pass will give it; in FP16 on a CPU there is none for ``_FusedMatMul`` (and
``_FusedConv2D`` FP16 is known-broken), so every such match is refused by the framework's
kernel check after the build emitted its nodes.  The early path stops the build before the
emission with the same reason and the same report warning.  Each real graph is rewritten with
it and with the reference (``EARLY_KERNEL_MISS = False``): the GraphDefs must be
byte-identical and the reports equal (timings aside), and in FP16 the early stop must have
fired (the comparison is not vacuous); in BF16 and FP32, where the kernels exist, it never
fires.  Graphs: the BERT-like builder (tests/real_models.py), a Keras ResNet50 training graph,
a Keras 2 transformer block (two LayerNormalization, MultiHeadAttention) and, where Keras 3
is installed (TF 2.21), a Keras 3 transformer layer-norm training step."""
import tensorflow as tf

import npu_amp_tf
from graph_passes.fusion import builtin, core
from test_fusion_skip import keras3_transformer_training_graph, keras_transformer_block_training_graph
from test_precision_fast import _strip_times
from test_speed_paths import _keras_resnet_training_graph, bert_like_training_graph

MODES = {
    "fp16": dict(precision_mode="allow_mix_precision"),
    "bf16": dict(precision_mode="allow_mix_precision_bf16"),
    "fp32": dict(precision_mode="must_keep_origin_dtype"),
}


def _rewrite(monkeypatch, gd, fetches, early, kw):
    """(GraphDef bytes, report without timings, early stops)."""
    monkeypatch.setattr(core, "EARLY_KERNEL_MISS", early)
    # (17p's builtin.KERNEL_FIRST moves the stop before the shape checks, a report change of its
    # own: tests/test_fusion_kernel_first.py; here the stop right before the emission, 17o's)
    monkeypatch.setattr(builtin, "KERNEL_FIRST", False)
    # (builtin.FUSED_KERNEL_POLICY takes the bias family off for the whole run when no matrix op can
    # have its fused kernel, as in FP16 here: tests/test_fusion_fused_kernel_policy.py; here the
    # per-anchor builds it spares, which still run wherever one matrix op could fuse)
    monkeypatch.setattr(builtin, "FUSED_KERNEL_POLICY", False)
    stops = []
    orig = core.KernelMissing.__init__

    def init(self, problems):
        stops.append(list(problems))
        orig(self, problems)

    monkeypatch.setattr(core.KernelMissing, "__init__", init)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, **kw)
    monkeypatch.setattr(core.KernelMissing, "__init__", orig)
    return out.SerializeToString(deterministic=True), _strip_times(rep.to_json()), stops


def assert_same(monkeypatch, gd, fetches, modes=tuple(MODES)):
    """Per mode: the early path equals the reference; returns {mode: early stops}."""
    fired = {}
    for mode in modes:
        fast_gd, fast_rep, stops = _rewrite(monkeypatch, gd, fetches, True, MODES[mode])
        ref_gd, ref_rep, ref_stops = _rewrite(monkeypatch, gd, fetches, False, MODES[mode])
        assert fast_rep["summary"].get("failed_pass") is None, fast_rep["warnings"][:3]
        assert ref_stops == []
        assert fast_gd == ref_gd, f"{mode}: the early kernel check rewrote the graph differently"
        assert fast_rep == ref_rep, f"{mode}: the early kernel check changed the report"
        fired[mode] = stops
    # where the kernels exist, the early path never stops a build
    assert not fired.get("bf16") and not fired.get("fp32"), fired
    return fired


def test_bert_like_training_graph(monkeypatch):
    gd = bert_like_training_graph()
    fired = assert_same(monkeypatch, gd, ["loss", "train"])
    # every FP16 bias / bias_add match of the 2 layers' dense MatMuls stops early, with the
    # framework's own wording (no FP16 CPU _FusedMatMul on 2.15, known-broken on 2.21)
    assert fired["fp16"] and all("_FusedMatMul with {'T': 'float16'}" in p[0] for p in fired["fp16"]), fired


def test_keras_resnet50_training_graph(k2, monkeypatch):
    gd = _keras_resnet_training_graph(k2)
    fired = assert_same(monkeypatch, gd, ["loss", "train"])
    # Conv2D + BiasAdd in FP16: _FusedConv2D FP16 on CPU is known-broken (registry.BROKEN_KERNELS)
    # on TF >= 2.16 and absent on 2.15 (and the classifier's MatMul: no FP16 _FusedMatMul):
    # refused either way, now before the emission
    assert any("_FusedConv2D" in p[0] for p in fired["fp16"]), fired
    assert all("_FusedConv2D" in p[0] or "_FusedMatMul" in p[0] for p in fired["fp16"]), fired


def test_keras2_transformer_block(k2, monkeypatch):
    gd = keras_transformer_block_training_graph(k2)
    assert_same(monkeypatch, gd, ["loss", "train"])


def test_keras3_transformer_layer_norm_training_step(monkeypatch):
    gd, fetches = keras3_transformer_training_graph()
    assert_same(monkeypatch, gd, fetches)


def test_the_early_reason_is_the_kernel_checks_own(monkeypatch):
    """A direct case: one MatMul + BiasAdd in FP16, run through ``_plan_one`` on both
    paths: the same skip reason and the same warning, and the reference emitted the fused
    node (the early path did not get that far)."""
    from graph_passes.fusion import builtin  # noqa: F401  (registers the rules)
    from graph_passes.graph import Graph
    from graph_passes.manager import PassContext
    from graph_passes.pattern import find_matches
    from npu_amp_tf.options import Options

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
        w = tf.constant(1.0, shape=[8, 8], name="w")
        y = tf.nn.bias_add(tf.matmul(x, w, name="mm"), tf.constant(0.5, shape=[8]), name="bias")
        tf.identity(y, name="out")
    graph = Graph(g.as_graph_def())
    ctx = PassContext(Options.from_kwargs(precision_mode="allow_mix_precision"), ["out"])
    rule = core.RULES["bias"]
    outcomes = {}
    for early in (True, False):
        monkeypatch.setattr(core, "EARLY_KERNEL_MISS", early)
        (m,) = find_matches(graph, rule.pattern)
        outcome, plan = core._plan_one(graph, rule, m, ctx, core.ShapeOracle(graph))
        assert plan is None and not outcome.fused
        outcomes[early] = (outcome.reason, outcome.warning)
    assert outcomes[True] == outcomes[False]
    assert "_FusedMatMul with {'T': 'float16'}" in outcomes[True][0]
    assert outcomes[True][1] == "fusion rule 'bias' skipped: " + outcomes[True][0]
