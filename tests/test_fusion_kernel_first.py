"""Issue 17p: ``builtin.KERNEL_FIRST`` changes no rewrite; the bias family's skips keep one
entry per match, and only matches that would also have failed a shape check of the build
(side input, bias, tensordot Reshape) now name the missing kernel instead (with its warning).

In FP16 on a CPU there is no FP16 ``_FusedMatMul`` (and ``_FusedConv2D`` FP16 is absent or
known-broken), so every ``bias`` / ``bias_add`` / ``bias_act`` / ``bias_add_act`` match is
refused.  With ``KERNEL_FIRST`` the build asks for the kernel as soon as the planned dtype is
known, before the side input's and the bias's shape walks.  Each real graph is rewritten with
it and with the reference (``KERNEL_FIRST = False``): the GraphDefs must be byte-identical, the
same anchors skipped by the same rules, every other decision, stat and summary equal; a
reason may differ only for a bias-family match whose new reason is the kernel check's
(its reference reason was a later shape check's), and the only new warnings are those
matches' kernel warnings.  In BF16 and FP32, where the kernels exist, the reports are equal."""
import copy

import pytest
import tensorflow as tf

import npu_amp_tf
from graph_passes.fusion import builtin
from test_fusion_skip import keras3_transformer_training_graph, keras_transformer_block_training_graph
from test_precision_fast import _strip_times
from test_speed_paths import _keras_resnet_training_graph, bert_like_training_graph

MODES = {
    "fp16": dict(precision_mode="allow_mix_precision"),
    "bf16": dict(precision_mode="allow_mix_precision_bf16"),
    "fp32": dict(precision_mode="must_keep_origin_dtype"),
}
BIAS_FAMILY = {"bias", "bias_act", "bias_add", "bias_add_act"}
KERNEL_WORDS = "the precision pass will run"  # the bias family's kernel requirement (builtin._fused_checks)


def _rewrite(monkeypatch, gd, fetches, on, kw):
    monkeypatch.setattr(builtin, "KERNEL_FIRST", on)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, **kw)
    return out.SerializeToString(deterministic=True), _strip_times(rep.to_json())


def assert_same(monkeypatch, gd, fetches, modes=tuple(MODES)):
    """Per mode: KERNEL_FIRST equals the reference but for the allowed reasons; returns
    {mode: [(node, reference reason, new reason)] of the changed reasons}."""
    changed = {}
    for mode in modes:
        new_gd, new = _rewrite(monkeypatch, gd, fetches, True, MODES[mode])
        ref_gd, ref = _rewrite(monkeypatch, gd, fetches, False, MODES[mode])
        assert new["summary"].get("failed_pass") is None, new["warnings"][:3]
        assert new_gd == ref_gd, f"{mode}: KERNEL_FIRST rewrote the graph differently"
        assert set(new["decisions"]) == set(ref["decisions"])
        diffs = []
        new_c, ref_c = copy.deepcopy(new), copy.deepcopy(ref)
        for name, d in ref_c["decisions"].items():
            e = new_c["decisions"][name]
            assert e.get("fusion_skipped") == d.get("fusion_skipped"), name  # same rule, same anchor
            if e.get("fusion_reason") != d.get("fusion_reason"):
                assert d.get("fusion_skipped") in BIAS_FAMILY, (name, d, e)
                assert KERNEL_WORDS in e["fusion_reason"] and KERNEL_WORDS not in d["fusion_reason"], (d, e)
                diffs.append((name, d["fusion_reason"], e["fusion_reason"]))
                e.pop("fusion_reason")
                d.pop("fusion_reason")
        extra = [w for w in new_c["warnings"] if w not in ref_c["warnings"]]
        assert [w for w in new_c["warnings"] if w in ref_c["warnings"]] == ref_c["warnings"]
        want = {(n, f"fusion rule '{new['decisions'][n]['fusion_skipped']}' skipped: {r}") for n, _, r in diffs}
        assert {(w["node"], w["message"]) for w in extra} == want, (extra, want)
        new_c["warnings"] = ref_c["warnings"]
        assert new_c == ref_c, f"{mode}: KERNEL_FIRST changed the report beyond the bias family's reasons"
        changed[mode] = diffs
    # where the kernels exist nothing changes
    assert not changed.get("bf16") and not changed.get("fp32"), changed
    return changed


def test_bert_like_training_graph(monkeypatch):
    assert_same(monkeypatch, bert_like_training_graph(), ["loss", "train"])


def test_keras_resnet50_training_graph(k2, monkeypatch):
    assert_same(monkeypatch, _keras_resnet_training_graph(k2), ["loss", "train"])


def test_keras2_transformer_block(k2, monkeypatch):
    assert_same(monkeypatch, keras_transformer_block_training_graph(k2), ["loss", "train"])


def test_keras3_transformer_layer_norm_training_step(monkeypatch):
    gd, fetches = keras3_transformer_training_graph()
    assert_same(monkeypatch, gd, fetches)


def test_a_side_input_refusal_becomes_the_missing_kernel(monkeypatch):
    """A direct case: MatMul + BiasAdd + Add of a broadcast operand ([8] + [4, 8]: not a
    same-shape side input) in FP16.  The reference refuses it at the side-input shape check; with
    KERNEL_FIRST the missing FP16 _FusedMatMul is named first, with its warning; in BF16 (the
    kernel exists) the side-input reason stays."""
    from graph_passes.fusion import core
    from graph_passes.graph import Graph
    from graph_passes.manager import PassContext
    from graph_passes.pattern import find_matches
    from npu_amp_tf.options import Options

    if not builtin.onednn_enabled():
        pytest.skip("the side-input fusion is oneDNN's (the oneDNN check comes first either way)")
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
        w = tf.constant(1.0, shape=[8, 8], name="w")
        y = tf.nn.bias_add(tf.matmul(x, w, name="mm"), tf.constant(0.5, shape=[8]), name="bias")
        z = tf.add(y, tf.constant(2.0, shape=[8]), name="add")
        tf.identity(z, name="out")
    graph = Graph(g.as_graph_def())
    rule = core.RULES["bias_add"]
    got = {}
    for mode in ("allow_mix_precision", "allow_mix_precision_bf16"):
        ctx = PassContext(Options.from_kwargs(precision_mode=mode), ["out"])
        for first in (True, False):
            monkeypatch.setattr(builtin, "KERNEL_FIRST", first)
            (m,) = find_matches(graph, rule.pattern)
            outcome, plan = core._plan_one(graph, rule, m, ctx, core.ShapeOracle(graph))
            assert plan is None and not outcome.fused
            got[mode, first] = (outcome.reason, outcome.warning)
    assert "same-shape side input" in got["allow_mix_precision", False][0]
    assert not got["allow_mix_precision", False][1]  # (no warning)
    reason, warning = got["allow_mix_precision", True]
    assert "_FusedMatMul with {'T': 'float16'}" in reason and KERNEL_WORDS in reason, reason
    assert warning == "fusion rule 'bias_add' skipped: " + reason
    assert got["allow_mix_precision_bf16", True] == got["allow_mix_precision_bf16", False]
    assert "same-shape side input" in got["allow_mix_precision_bf16", True][0]
