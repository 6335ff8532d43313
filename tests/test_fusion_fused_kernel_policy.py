"""Issue 17: ``builtin.FUSED_KERNEL_POLICY`` (``builtin.fused_kernel_policy``), the
bias family's run-wide policy.

The bias-family builds (``bias``, ``bias_act``, ``bias_add``, ``bias_add_act``, and the GELU
forms ``bias_gelu_exact`` / ``bias_gelu_tanh``; ``bn_act``, whose build refuses every match under
an FP16 plan, has the same switch) skip a match
whose matrix op has no fused kernel in the dtype the precision plan will run it in.  Under FP16
on a CPU there is none (TF 2.15.1 registers no float16 ``_FusedMatMul``; ``_FusedConv2D``
float16 is known-broken or absent), so every match is skipped, each with the same warning.
The policy says so once (the fusion stats' ``rules_off``) when it holds for every matrix op of
the graph.  Checked on real graphs, each rewritten with the policy and with the reference
(``FUSED_KERNEL_POLICY = False``): the GraphDefs byte-identical; in FP16 the family off with
the kernel reason, where the reference fused none of it and skipped every match with that
reason and warning; in FP32 and BF16 (fused kernels exist) nothing off and the reports
identical.  Where one matrix op stays FP32 (``keep_dtype_nodes``) the rules run per anchor and
fuse it, as the reference does; anchors on two device types keep the per-anchor path."""
import pytest
import tensorflow as tf

from graph_passes.fusion import builtin, core
from test_fusion_rule_policy import BIAS_FAMILY as FAMILY, MODES
from test_fusion_rule_policy import _fusion_stats as _stats, _rewrite as _rewrite_with
from test_precision_fast import slim_resnet_graph
from test_speed_paths import _keras_resnet_training_graph, bert_like_training_graph


def _rewrite(monkeypatch, gd, fetches, on, kw):
    return _rewrite_with(monkeypatch, gd, fetches, on, kw, switch=(builtin, "FUSED_KERNEL_POLICY"))


def _check(monkeypatch, gd, fetches, modes=tuple(MODES), **extra):
    """Per mode: (the policy run's rules_off of the family, the reference's report)."""
    out = {}
    for mode in modes:
        kw = dict(MODES[mode], **extra)
        pol_gd, pol = _rewrite(monkeypatch, gd, fetches, True, kw)
        ref_gd, ref = _rewrite(monkeypatch, gd, fetches, False, kw)
        assert pol["summary"].get("failed_pass") is None, pol["warnings"][:3]
        assert pol_gd == ref_gd, f"{mode}: the policy rewrote the graph differently"
        off = {k: v for k, v in _stats(pol).get("rules_off", {}).items() if k in FAMILY}
        assert not {k for k in _stats(ref).get("rules_off", {}) if k in FAMILY}
        if not off:
            assert pol == ref, f"{mode}: no rule off, yet the report differs"
        for rule, entry in off.items():
            # the reference fused none of it, and every match it found was skipped for a kernel
            assert _stats(ref).get("fused", {}).get(rule, 0) == 0, (mode, rule)
            reasons = {d["fusion_reason"] for d in ref["decisions"].values() if d.get("fusion_skipped") == rule}
            assert all("_Fused" in r or "oneDNN" in r for r in reasons), (rule, reasons)
            assert entry["mode"] == kw["precision_mode"], entry
            assert "_Fused" in entry["reason"] or "oneDNN" in entry["reason"], entry
            assert not any(d.get("fusion_skipped") == rule for d in pol["decisions"].values())
            assert not any(str(w["message"]).startswith(f"fusion rule '{rule}' skipped")
                           for w in pol["warnings"])
        out[mode] = (off, ref)
    assert not out.get("fp32", ({},))[0] and not out.get("bf16", ({},))[0], out
    return out


def test_bert_like_training_graph(monkeypatch):
    gd = bert_like_training_graph()
    res = _check(monkeypatch, gd, ["loss", "train"])
    off, ref = res["fp16"]
    assert {"bias", "bias_add"} <= set(off), off
    assert "every MatMul runs in float16" in off["bias"]["reason"]
    # the reference's one warning per skipped match, all gone with the policy
    n_warn = sum(1 for w in ref["warnings"] if str(w["message"]).startswith("fusion rule 'bias"))
    n_matmul_bias = sum(1 for n in gd.node if n.op == "BiasAdd")
    assert n_warn >= n_matmul_bias > 0


def test_keras_resnet50_training_graph(k2, monkeypatch):
    gd = _keras_resnet_training_graph(k2)
    res = _check(monkeypatch, gd, ["loss", "train"])
    off, ref = res["fp16"]
    assert {"bias", "bias_act", "bias_add_act", "bn_act"} <= set(off), off
    # bn_act: the FP16 plan refuses every batch norm + Relu (the reference: one skip per pair)
    n_bn = sum(1 for n in gd.node if n.op == "FusedBatchNormV3")
    assert _stats(ref)["skipped"]["bn_act"] >= n_bn // 2 > 0, _stats(ref)["skipped"]
    assert "follows its FP16 producers" in off["bn_act"]["reason"]
    assert "every Conv2D runs in float16" in off["bias"]["reason"]
    assert "every MatMul runs in float16" in off["bias"]["reason"]


def test_slim_resnet_v1_50(monkeypatch):
    pytest.importorskip("tf_slim", reason="tf_slim is not installed in this environment")
    gd, fetches = slim_resnet_graph()
    res = _check(monkeypatch, gd, fetches, ("fp16", "bf16"))
    assert "bias_act" in res["fp16"][0] or "bias" in res["fp16"][0], res["fp16"][0]


def test_one_matrix_op_kept_in_fp32_keeps_the_rules_on(monkeypatch):
    """``keep_dtype_nodes`` keeps one dense MatMul of BERT in FP32, where ``_FusedMatMul`` has a
    kernel: the policy answers None, the rules run per anchor and fuse that MatMul with its bias,
    the others are skipped per anchor: the same graph and report as the reference."""
    gd = bert_like_training_graph()
    readers = {}
    for n in gd.node:
        for i in n.input:
            readers.setdefault(i.split(":")[0].lstrip("^"), []).append(n)
    keep = next(n.name for n in gd.node if n.op == "MatMul" and not n.name.startswith("gradients")
                and any(r.op == "BiasAdd" for r in readers.get(n.name, ())))
    res = _check(monkeypatch, gd, ["loss", "train"], ("fp16",), keep_dtype_nodes=[keep])
    off, ref = res["fp16"]
    assert set(off) <= {"bn_act"}, off  # (bn_act: the plan alone decides; BERT has no batch norm)
    fused = _stats(ref).get("fused", {})
    assert fused.get("bias", 0) + fused.get("bias_add", 0) >= 1, fused


def test_anchors_on_two_device_types_keep_the_per_anchor_path():
    from graph_passes.graph import Graph
    from graph_passes.manager import PassContext
    from npu_amp_tf.options import Options

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
        w = tf.constant(1.0, shape=[8, 8])
        a = tf.nn.bias_add(tf.matmul(x, w, name="mm_a"), tf.zeros([8]), name="bias_a")
        b = tf.nn.bias_add(tf.matmul(a, w, name="mm_b"), tf.zeros([8]), name="bias_b")
        tf.identity(b, name="out")
    gd = g.as_graph_def()
    ctx = PassContext(Options.from_kwargs(precision_mode="allow_mix_precision"), ["out"])
    policy = core.RULES["bias"].policy
    graph = Graph(gd)
    assert "_FusedMatMul with {'T': 'float16'}" in policy(ctx, graph)  # (absent, or known-broken)
    for n in gd.node:
        if n.name == "bias_b":
            n.device = "/device:GPU:0"
    assert policy(ctx, Graph(gd)) is None
    # FP32 and BF16 plans: the kernels exist
    for mode in ("must_keep_origin_dtype", "allow_mix_precision_bf16"):
        assert policy(PassContext(Options.from_kwargs(precision_mode=mode), ["out"]), Graph(g.as_graph_def())) is None


def test_through_grappler_the_same_bytes(k2, monkeypatch):
    """Inside grappler (the bridge tells the pass that no node of the item has a device string:
    only the nodes a pass created or edited are read): the same output bytes with the policy as
    without, and the family off in FP16."""
    from test_precision_native import _graph
    from test_speed_paths import optimize_rewritten, plugin_only_grappler

    from graph_passes.fusion import fusion_pass

    gd, fetches = _graph("bert_like", k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    stats = []
    real = fusion_pass.FusionPass.run

    def run(self, graph, ctx):
        out = real(self, graph, ctx)
        stats.append((graph.source_has_device() if graph.source_has_device else None, out))
        return out

    monkeypatch.setattr(fusion_pass.FusionPass, "run", run)
    outs = []
    for on in (True, False):
        monkeypatch.setattr(builtin, "FUSED_KERNEL_POLICY", on)
        outs.append(optimize_rewritten(cfg, mg, b"policy")[0])
    assert outs[0] == outs[1]
    (has_dev, st_on), (_, st_off) = stats[0], stats[-1]
    assert has_dev is False
    assert {"bias", "bias_add"} <= set(st_on.get("rules_off", {})), st_on.get("rules_off")
    assert not {"bias", "bias_add"} & set(st_off.get("rules_off", {}))


def test_anchor_devices_reads_the_edited_nodes():
    from graph_passes.graph import Graph

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
        tf.nn.bias_add(tf.matmul(x, tf.ones([8, 8]), name="mm"), tf.zeros([8]), name="b")
    graph = Graph(g.as_graph_def())
    graph.source_has_device = lambda: False
    assert builtin._anchor_devices(graph) == {""}
    graph.nodes["b"].device = "/device:GPU:0"
    graph.touch("b")
    assert builtin._anchor_devices(graph) == {"", "/device:GPU:0"}
    graph.source_has_device = None  # (offline: every anchor-type node is read)
    assert builtin._anchor_devices(graph) == {"/device:GPU:0"}


@pytest.mark.parametrize("graph_name", ["bert_like", "keras_resnet50"])
def test_planned_dtype_by_type_gives_the_per_node_answers(graph_name, k2, monkeypatch):
    """``builtin.PLANNED_BY_TYPE``: the policies ask the precision plan once per (op type,
    dtype) of the matrix ops when no plan rule reads node names, else per node.  Every
    family policy answers as with the reference (per node) under plans with and without
    name rules (one matrix op kept FP32 by name, one forced low by name, a name scope), and
    with name rules the plan is asked per node."""
    from graph_passes.graph import Graph
    from graph_passes.manager import PassContext
    from npu_amp_tf.options import Options

    if graph_name == "bert_like":
        gd, op = bert_like_training_graph(), "MatMul"
    else:
        gd, op = _keras_resnet_training_graph(k2), "Conv2D"
    mm = [n.name for n in gd.node if n.op == op]
    plans = [dict(precision_mode="allow_mix_precision"),
             dict(precision_mode="allow_mix_precision", keep_dtype_nodes=[mm[0]]),
             dict(precision_mode="allow_mix_precision", keep_dtype_nodes=[mm[1].rsplit("/", 1)[0] + "/"]),
             dict(precision_mode="must_keep_origin_dtype", low_precision_nodes=[mm[-1]]),
             dict(precision_mode="allow_mix_precision_bf16")]
    calls = []
    real = builtin.planned_dtype
    monkeypatch.setattr(builtin, "planned_dtype", lambda *a: calls.append(a[2]) or real(*a))
    for kw in plans:
        answers = {}
        for on in (False, True):
            monkeypatch.setattr(builtin, "PLANNED_BY_TYPE", on)
            ctx = PassContext(Options.from_kwargs(**kw), ["loss", "train"])
            del calls[:]
            answers[on] = {name: core.RULES[name].policy(ctx, Graph(gd)) for name in sorted(FAMILY)
                           if core.RULES[name].policy is not None}
            asked = len(calls)
            names_matter = "keep_dtype_nodes" in kw or "low_precision_nodes" in kw
            if on and not names_matter:
                assert asked <= 2 * len(answers[on]), (kw, asked)  # (≤ one per op type and dtype)
            elif kw["precision_mode"] == "allow_mix_precision":
                assert asked >= len(mm) or any(a is None for a in answers[on].values()), (kw, asked)
        assert answers[True] == answers[False], kw
        if kw == plans[0]:
            assert any(answers[True].values()), "FP16: the family is off"
        if kw == plans[1]:
            assert not any(answers[True].get(r) for r in ("bias", "bias_add")), answers[True]
