"""Issue 17p: ``core.RULE_POLICY`` (``FusionRule.policy``) changes no rewrite; the report
lists a rule its policy turns off once (the fusion stats' ``rules_off``: the rule, the
precision mode, the reason, the count of anchors of its op types) instead of one skip per
matched anchor.

The BF16-only rules (``bf16_*``: measured to pay in BF16 only) and the rules that rewrite a
BF16 gradient into a MatMul (``bias_grad_*``, ``filter_grad_*``) cannot fuse anything under an
FP16 or FP32 plan, nor the bias family (``bias``, ``bias_act``, ``bias_add``, ``bias_add_act``, ``bias_gelu_*``)
where every matrix op runs in FP16 on a CPU (no fused kernel there, ``builtin.fused_kernel_policy``);
the policy says so once per run (the reference: a skip and a warning per anchor).  Each real graph is rewritten with the
policy and with the reference (``RULE_POLICY = False``): the GraphDefs must be byte-identical,
and the reports equal once the off rules' per-anchor skips (reference) and ``rules_off``
(policy) are set aside; every other decision, warning, summary figure and pass statistic is
the same.  The policy must have turned rules off in FP16 and FP32 (not vacuous), and none in
BF16.  Graphs: the BERT-like builder (tests/real_models.py), a Keras ResNet50 training graph,
a Keras 2 transformer block and, where Keras 3 is installed (TF 2.21), a Keras 3 transformer
layer-norm training step."""
import copy

import tensorflow as tf

import npu_amp_tf
from graph_passes.fusion import core
from test_fusion_skip import keras3_transformer_training_graph, keras_transformer_block_training_graph
from test_precision_fast import _strip_times
from test_speed_paths import _keras_resnet_training_graph, bert_like_training_graph

MODES = {
    "fp16": dict(precision_mode="allow_mix_precision"),
    "bf16": dict(precision_mode="allow_mix_precision_bf16"),
    "fp32": dict(precision_mode="must_keep_origin_dtype"),
}
#: every rule with a policy (bf16_elementwise, bf16_transformer, bf16_apply, bias_grad, builtin)
POLICY_RULES = {"bf16_add_relu", "bf16_join_grad_sum", "bf16_addn_relu_grad", "bf16_relu_bn_grad",
                "bf16_bn_grad", "bf16_gelu", "bf16_attention_train", "bf16_apply_momentum",
                "bias_grad_bn_zero", "bias_grad_matmul", "filter_grad_1x1", "filter_grad_im2col",
                "bias", "bias_act", "bias_add", "bias_add_act", "bias_gelu_exact", "bias_gelu_tanh", "bn_act"}
BIAS_FAMILY = {"bias", "bias_act", "bias_add", "bias_add_act", "bias_gelu_exact", "bias_gelu_tanh", "bn_act"}


def _rewrite(monkeypatch, gd, fetches, on, kw, switch=(core, "RULE_POLICY")):
    """(GraphDef bytes, report without timings) with ``switch`` (module, name) set to ``on``."""
    monkeypatch.setattr(*switch, on)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, **kw)
    return out.SerializeToString(deterministic=True), _strip_times(rep.to_json())


def _fusion_stats(rep):
    (st,) = [p["stats"] for p in rep["passes"] if p["name"] == "fusion"]
    return st


def _without(rep, off):
    """``rep`` with the off rules' traces set aside: their skip counts and ``rules_off`` in the
    fusion stats, and every node's fusion skip naming one of them (the reference) or standing
    where one of them would have written its own (the policy run: an earlier rule's skip of the
    same anchor is no longer overwritten)."""
    rep = copy.deepcopy(rep)
    st = _fusion_stats(rep)
    st.pop("rules_off", None)
    for k in off:
        st.get("skipped", {}).pop(k, None)
    # (the reference's per-anchor kernel warnings of the off rules: "fusion rule 'bias' skipped: ...")
    heads = tuple(f"fusion rule '{k}' skipped: " for k in off)
    rep["warnings"] = [w for w in rep["warnings"] if not str(w.get("message", "")).startswith(heads)]
    return rep


def assert_same(monkeypatch, gd, fetches, modes=tuple(MODES)):
    """Per mode: the policy run equals the reference but for the off rules; returns {mode: rules_off}."""
    offs = {}
    for mode in modes:
        pol_gd, pol_rep = _rewrite(monkeypatch, gd, fetches, True, MODES[mode])
        ref_gd, ref_rep = _rewrite(monkeypatch, gd, fetches, False, MODES[mode])
        assert pol_rep["summary"].get("failed_pass") is None, pol_rep["warnings"][:3]
        assert "rules_off" not in _fusion_stats(ref_rep)
        assert pol_gd == ref_gd, f"{mode}: the rule policy rewrote the graph differently"
        off = _fusion_stats(pol_rep).get("rules_off", {})
        assert set(off) <= POLICY_RULES, off
        ref_st = _fusion_stats(ref_rep)
        for rule, entry in off.items():
            assert ref_st.get("fused", {}).get(rule, 0) == 0, (mode, rule)  # the reference fused none
            assert entry["reason"] and entry["mode"] == MODES[mode]["precision_mode"], entry
            assert entry["anchors"] is None or entry["anchors"] >= 0, entry
        # the per-anchor skips the reference reported for the off rules, and where the policy
        # run kept another rule's skip of the same anchor instead
        moved = {n for n, d in ref_rep["decisions"].items() if d.get("fusion_skipped") in off}
        assert not any(d.get("fusion_skipped") in off for d in pol_rep["decisions"].values())
        pol, ref = _without(pol_rep, off), _without(ref_rep, off)
        for name in moved:
            for r in (pol, ref):
                d = r["decisions"].get(name)
                if d is not None:
                    d.pop("fusion_skipped", None)
                    d.pop("fusion_reason", None)
                    if not d:
                        del r["decisions"][name]
        assert pol == ref, f"{mode}: the rule policy changed the report beyond the off rules' entries"
        offs[mode] = off
    # BF16: every policy rule may apply (none off); FP16 / FP32: the BF16-only rules are off;
    # the bias family only in FP16 (FP32 and BF16 fused kernels exist)
    assert offs.get("bf16", {}) == {}, offs.get("bf16")
    assert not BIAS_FAMILY & set(offs.get("fp32", {})), offs.get("fp32")
    return offs


def test_bert_like_training_graph(monkeypatch):
    gd = bert_like_training_graph()
    offs = assert_same(monkeypatch, gd, ["loss", "train"])
    for mode in ("fp16", "fp32"):
        # the rules whose anchors BERT has, reported once each (the reference: one skip per anchor)
        assert {"bf16_gelu", "bf16_attention_train", "bias_grad_bn_zero", "bias_grad_matmul",
                "bf16_join_grad_sum"} <= set(offs[mode]), offs[mode]
        assert "BF16 only" in offs[mode]["bf16_gelu"]["reason"]
    assert "MatMul runs in float16 or float32" in offs["fp16"]["bias_grad_matmul"]["reason"]
    assert "MatMul runs in float32 (" in offs["fp32"]["bias_grad_matmul"]["reason"]
    # FP16 on a CPU: no usable float16 _FusedMatMul, every dense MatMul of BERT is lowered
    n_biases = sum(1 for n in gd.node if n.op == "BiasAdd")
    assert {"bias", "bias_add"} <= set(offs["fp16"]), offs["fp16"]
    assert "every MatMul runs in float16" in offs["fp16"]["bias"]["reason"]
    assert "_FusedMatMul with {'T': 'float16'}" in offs["fp16"]["bias"]["reason"]
    assert offs["fp16"]["bias"]["anchors"] >= n_biases > 0


def test_keras_resnet50_training_graph(k2, monkeypatch):
    gd = _keras_resnet_training_graph(k2)
    offs = assert_same(monkeypatch, gd, ["loss", "train"])
    n_filter_grads = sum(1 for n in gd.node if n.op == "Conv2DBackpropFilter")
    assert n_filter_grads == 53  # ResNet50's convs (independent count from the input graph)
    for mode in ("fp16", "fp32"):
        assert {"bf16_apply_momentum", "bf16_relu_bn_grad", "bf16_bn_grad", "bf16_add_relu",
                "filter_grad_1x1", "filter_grad_im2col", "bias_grad_bn_zero"} <= set(offs[mode]), offs[mode]
        assert offs[mode]["filter_grad_1x1"]["anchors"] == n_filter_grads


def test_keras2_transformer_block(k2, monkeypatch):
    gd = keras_transformer_block_training_graph(k2)
    assert_same(monkeypatch, gd, ["loss", "train"])


def test_keras3_transformer_layer_norm_training_step(monkeypatch):
    gd, fetches = keras3_transformer_training_graph()
    assert_same(monkeypatch, gd, fetches)


def test_a_bf16_gradient_keeps_the_matmul_rules_on(monkeypatch):
    """The MatMul-form policy is exact only while no anchor is already bfloat16 (``Plan.matrix_dtype``
    leaves a bfloat16 op bfloat16 whatever the mode): with one, the rules run (per anchor) in FP16 too."""
    from graph_passes.fusion import builtin  # noqa: F401  (registers the rules)
    from graph_passes.graph import Graph
    from graph_passes.manager import PassContext
    from npu_amp_tf.options import Options

    def graph(dtype):
        g = tf.Graph()
        with g.as_default():
            dy = tf.compat.v1.placeholder(dtype, [16, 32], name="dy")
            tf.identity(tf.raw_ops.BiasAddGrad(out_backprop=dy), name="db")
        return Graph(g.as_graph_def())

    ctx = PassContext(Options.from_kwargs(precision_mode="allow_mix_precision"), ["db"])
    policy = core.RULES["bias_grad_matmul"].policy
    assert "float16 or float32" in policy(ctx, graph(tf.float32))
    assert policy(ctx, graph(tf.bfloat16)) is None
    bf16_ctx = PassContext(Options.from_kwargs(precision_mode="allow_mix_precision_bf16"), ["db"])
    assert policy(bf16_ctx, graph(tf.float32)) is None
