"""Fusion pass: registry, graph_level, Conv/MatMul+bias+activation, BN folding,
attention, precision-aware kernel checks.  Real TF graphs, numerics compared
against the unfused graph."""
import os

import numpy as np
import pytest

from _fusion_util import build, op_counts, rewrite, run_gd, tf, tf1
from graph_passes.fusion import (FusionRuleError, fusion_rule, register_fusion_rule,
                                 unregister_fusion_rule)
from graph_passes.fusion.builtin import onednn_enabled, supported_activations
from graph_passes.pattern import Pat

RNG = np.random.default_rng(0)
#: expected, not asked from the code under test: TF's x86-64 Linux wheels (2.15, 2.21)
#: run oneDNN unless TF_ENABLE_ONEDNN_OPTS=0, and oneDNN's _FusedMatMul takes GELU
ONEDNN = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip().lower() not in ("0", "false")
#: measured: TF 2.15.1 has no float16 _FusedMatMul CPU kernel, TF 2.21.0 has one
# a usable FP16 _FusedMatMul CPU kernel: TF >= 2.16 registers one, but with oneDNN on (the
# default; TF_ENABLE_ONEDNN_OPTS=0 turns it off) it runs as _MklNativeFusedMatMul, measured
# seconds per op, so the registry treats it as absent there
FP16_FUSED_MATMUL = (not tf.__version__.startswith("2.15.")
                     and os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") == "0")


def _dense_graph(act, bias=True, extra_consumer=False):
    def f():
        x = tf1.placeholder(tf.float32, [3, 8], name="x")
        w = tf.constant(RNG.standard_normal((8, 6)).astype(np.float32))
        b = tf.constant(RNG.standard_normal(6).astype(np.float32))
        h = tf.matmul(x, w, name="mm")
        if bias:
            h = tf.nn.bias_add(h, b, name="bias")
        out = act(h) if act else h
        if extra_consumer:
            out = out + tf.reduce_sum(h, name="side")
        return tf.identity(out, name="out")
    return build(f)[0]


FEED = {"x": RNG.standard_normal((3, 8)).astype(np.float32)}


@pytest.mark.parametrize("act,name", [(tf.nn.relu, "Relu"), (tf.nn.relu6, "Relu6"), (tf.nn.elu, "Elu"),
                                      (lambda h: tf.nn.leaky_relu(h, 0.3), "LeakyRelu")])
def test_matmul_bias_act_match_and_numerics(act, name):
    gd = _dense_graph(act)
    new, rep = rewrite(gd, ["out"])
    c = op_counts(new)
    assert c["_FusedMatMul"] == 1 and c["MatMul"] == 0 and c["BiasAdd"] == 0 and c[name] == 0
    fused = [n for n in new.node if n.op == "_FusedMatMul"][0]
    assert list(fused.attr["fused_ops"].list.s) == [b"BiasAdd", name.encode()]
    if name == "LeakyRelu":
        assert fused.attr["leakyrelu_alpha"].f == pytest.approx(0.3)
    assert rep.pass_stats("fusion")["fused"] == {"bias_act": 1}
    a, = run_gd(gd, ["out"], FEED)
    b, = run_gd(new, ["out"], FEED)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_matmul_no_bias_is_no_match():
    gd = _dense_graph(tf.nn.relu, bias=False)
    new, rep = rewrite(gd, ["out"])
    assert op_counts(new)["_FusedMatMul"] == 0
    assert new == gd or op_counts(new) == op_counts(gd)


def test_external_consumer_of_bias_blocks_activation_fusion():
    gd = _dense_graph(tf.nn.relu, extra_consumer=True)
    new, rep = rewrite(gd, ["out"])
    c = op_counts(new)
    # BiasAdd is read by Relu and by Sum: only MatMul+BiasAdd (the anchor) fuse
    assert c["Relu"] == 1 and c["_FusedMatMul"] == 1
    fused = [n for n in new.node if n.op == "_FusedMatMul"][0]
    assert list(fused.attr["fused_ops"].list.s) == [b"BiasAdd"]
    np.testing.assert_allclose(run_gd(gd, ["out"], FEED)[0], run_gd(new, ["out"], FEED)[0], rtol=1e-5)


def test_fetched_inner_tensor_blocks_fusion():
    gd = _dense_graph(tf.nn.relu)
    new, rep = rewrite(gd, ["out", "bias"])
    assert op_counts(new)["Relu"] == 1


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu(approximate):
    """tf.nn.gelu: TF 2.15 writes 0.5*x*(1+erf(x/sqrt2)), TF >= 2.16 0.5*x*erfc(-x/sqrt2)."""
    gd = _dense_graph(lambda h: tf.nn.gelu(h, approximate=approximate))
    new, rep = rewrite(gd, ["out"])
    rule = "bias_gelu_tanh" if approximate else "bias_gelu_exact"
    stats = rep.pass_stats("fusion")
    if ONEDNN:
        assert stats["fused"] == {rule: 1}
        assert op_counts(new)["Erf"] + op_counts(new)["Erfc"] + op_counts(new)["Tanh"] == 0
    else:  # stock Eigen kernel: skipped with a reason, MatMul+BiasAdd still fused
        assert stats["skipped"] == {rule: 1} and stats["fused"] == {"bias": 1}
    np.testing.assert_allclose(run_gd(gd, ["out"], FEED)[0], run_gd(new, ["out"], FEED)[0],
                               rtol=1e-5, atol=1e-5)


def test_bert_style_tanh_gelu():
    def gelu(x):
        cdf = 0.5 * (1.0 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3))))
        return x * cdf
    gd = _dense_graph(gelu)
    new, rep = rewrite(gd, ["out"])
    stats = rep.pass_stats("fusion")
    assert stats["fused"].get("bias_gelu_tanh", 0) + stats["skipped"].get("bias_gelu_tanh", 0) == 1
    np.testing.assert_allclose(run_gd(gd, ["out"], FEED)[0], run_gd(new, ["out"], FEED)[0],
                               rtol=1e-5, atol=1e-5)


def _keras_cnn(training=False):
    def f():
        x = tf1.placeholder(tf.float32, [2, 8, 8, 3], name="x")
        h = tf.keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c1")(x)
        h = tf.keras.layers.DepthwiseConv2D(3, padding="same", activation="relu", name="dw")(h)
        h = tf.keras.layers.Flatten()(h)
        out = tf.identity(tf.keras.layers.Dense(5, name="d")(h), name="out")
        if training:
            loss = tf.reduce_mean(tf.square(out), name="loss")
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf1.global_variables_initializer()
        return None
    return build(f)[0]


def test_conv_depthwise_dense_inference():
    gd = _keras_cnn()
    new, rep = rewrite(gd, ["out"])
    c = op_counts(new)
    assert c["_FusedConv2D"] == 1 and c["Conv2D"] == 0
    assert c["_FusedMatMul"] == 1
    if ONEDNN:  # only oneDNN has a CPU kernel for _FusedDepthwiseConv2dNative
        assert c["_FusedDepthwiseConv2dNative"] == 1
    else:
        assert c["DepthwiseConv2dNative"] == 1
        assert rep.pass_stats("fusion")["skipped"]
    feed = {"x": RNG.standard_normal((2, 8, 8, 3)).astype(np.float32)}
    a = run_gd(gd, ["out"], feed, init="init")[0]
    b = run_gd(new, ["out"], feed, init="init")[0]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_training_graph_one_step_matches():
    """Backprop reads the fused op's output (ReluGrad reads Relu): still fused,
    and one SGD step gives the same weights."""
    gd = _keras_cnn(training=True)
    new, rep = rewrite(gd, ["train", "loss"])
    c = op_counts(new)
    assert c["_FusedConv2D"] == 1 and c["_FusedMatMul"] == 1
    feed = {"x": RNG.standard_normal((2, 8, 8, 3)).astype(np.float32)}
    fetch = ["c1/kernel/Read/ReadVariableOp", "d/kernel/Read/ReadVariableOp", "loss"]
    a = run_gd(gd, fetch, feed, init="init", steps=("train", 1))
    b = run_gd(new, fetch, feed, init="init", steps=("train", 1))
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def test_precision_mode_fp16_skips_fused_matrix_ops(monkeypatch):
    import graph_passes.precision  # noqa: F401  (the precision pass will run after fusion)
    from graph_passes.fusion import builtin

    gd = _dense_graph(tf.nn.relu)
    new, rep = rewrite(gd, ["out"], precision="allow_mix_precision")
    if FP16_FUSED_MATMUL:
        assert op_counts(new)["_FusedMatMul"] == 1
    else:  # no usable FP16 CPU kernel -> the bias family is off for the run, said once
        assert op_counts(new)["_FusedMatMul"] == 0
        off = rep.pass_stats("fusion")["rules_off"]
        assert {"bias", "bias_act"} <= set(off), off
        reason = off["bias_act"]["reason"]
        assert "float16" in reason and "_FusedMatMul" in reason and off["bias_act"]["anchors"] == 1
        assert "fusion_skipped" not in rep.decisions.get("Relu", {})
        # the reference (builtin.FUSED_KERNEL_POLICY off): the same graph, the reason per node
        monkeypatch.setattr(builtin, "FUSED_KERNEL_POLICY", False)
        ref, rep = rewrite(gd, ["out"], precision="allow_mix_precision")
        assert ref.SerializeToString(deterministic=True) == new.SerializeToString(deterministic=True)
        reason = rep.decisions["Relu"]["fusion_reason"]
        assert "float16" in reason and "_FusedMatMul" in reason
        assert "bias_act" not in rep.pass_stats("fusion").get("rules_off", {})
        monkeypatch.setattr(builtin, "FUSED_KERNEL_POLICY", True)
    new, rep = rewrite(gd, ["out"], precision="allow_mix_precision_bf16")
    assert op_counts(new)["_FusedMatMul"] == 1  # a bf16 CPU kernel exists
    new, rep = rewrite(gd, ["out"], precision="must_keep_origin_dtype")
    assert op_counts(new)["_FusedMatMul"] == 1


# ------------------------------------------------------------- BN folding
def _frozen_conv_bn():
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(4, 3, padding="same", input_shape=(6, 6, 3), name="c"),
        tf.keras.layers.BatchNormalization(name="bn"),
        tf.keras.layers.ReLU(name="r")])
    bn = model.get_layer("bn")
    bn.set_weights([RNG.uniform(0.5, 1.5, 4).astype(np.float32), RNG.standard_normal(4).astype(np.float32),
                    RNG.standard_normal(4).astype(np.float32), RNG.uniform(0.5, 2, 4).astype(np.float32)])
    return _freeze(model, [1, 6, 6, 3])


def _freeze(model, shape):
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    fn = tf.function(lambda x: model(x, training=False))
    cf = fn.get_concrete_function(tf.TensorSpec(shape, tf.float32, name="x"))
    frozen = convert_variables_to_constants_v2(cf)
    gd = frozen.graph.as_graph_def()
    out = frozen.outputs[0].name.split(":")[0]
    inp = frozen.inputs[0].name.split(":")[0]
    return gd, inp, out


def test_bn_fold_level3_only():
    gd, inp, out = _frozen_conv_bn()
    if op_counts(gd)["FusedBatchNormV3"] == 0:
        pytest.skip("this Keras lowers BatchNormalization to elementwise ops; bn_fold folds FusedBatchNorm")
    l2, _ = rewrite(gd, [out], level=2)
    c2 = op_counts(l2)  # level 2 keeps the batch norm (under oneDNN bn_act fuses its Relu into it)
    assert c2["FusedBatchNormV3"] + c2["_FusedBatchNormEx"] == 1
    l3, rep = rewrite(gd, [out], level=3)
    c = op_counts(l3)
    assert c["FusedBatchNormV3"] == 0 and c["_FusedConv2D"] == 1 and c["Relu"] == 0
    assert rep.pass_stats("fusion")["fused"]["bn_fold"] == 1
    feed = {inp: RNG.standard_normal((1, 6, 6, 3)).astype(np.float32)}
    np.testing.assert_allclose(run_gd(gd, [out], feed)[0], run_gd(l3, [out], feed)[0], rtol=1e-4, atol=1e-4)


def test_bn_fold_no_match_on_variables_and_external_consumer():
    def f():
        x = tf1.placeholder(tf.float32, [1, 4, 4, 2], name="x")
        w = tf.constant(RNG.standard_normal((1, 1, 2, 2)).astype(np.float32))
        c = tf.nn.conv2d(x, w, 1, "SAME", name="conv")
        v = tf1.placeholder(tf.float32, [2], name="var")  # not constant: cannot fold
        y, _, _ = tf1.nn.fused_batch_norm(c, tf.ones([2]), tf.zeros([2]), tf.zeros([2]), v, is_training=False)
        side = tf.identity(c, name="side")
        return tf.identity(y, name="out"), side
    gd, _ = build(f)
    new, rep = rewrite(gd, ["out", "side"], level=3)
    assert op_counts(new)["FusedBatchNormV3"] == 1  # conv output escapes to 'side'


# --------------------------------------------------------------- attention
def _attention_graph(mask=True, extra=False):
    def f():
        q = tf1.placeholder(tf.float32, [2, 2, 5, 4], name="q")
        k = tf1.placeholder(tf.float32, [2, 2, 7, 4], name="k")
        v = tf1.placeholder(tf.float32, [2, 2, 7, 3], name="v")
        s = tf.matmul(q, k, transpose_b=True) * (1.0 / 2.0)
        if mask:
            s = s + tf1.placeholder(tf.float32, [2, 1, 1, 7], name="m")
        p = tf.nn.softmax(s)
        o = tf.matmul(p, v)
        if extra:
            o = o + tf.reduce_mean(p)
        return tf.identity(o, name="out")
    return build(f)[0]


ATT_FEED = {"q": RNG.standard_normal((2, 2, 5, 4)).astype(np.float32),
            "k": RNG.standard_normal((2, 2, 7, 4)).astype(np.float32),
            "v": RNG.standard_normal((2, 2, 7, 3)).astype(np.float32),
            "m": np.where(RNG.random((2, 1, 1, 7)) > 0.3, 0.0, -10000.0).astype(np.float32)}


@pytest.mark.parametrize("mask", [True, False])
def test_attention_level3(mask):
    gd = _attention_graph(mask)
    feed = {k: v for k, v in ATT_FEED.items() if mask or k != "m"}
    l2, _ = rewrite(gd, ["out"], level=2)
    assert op_counts(l2)["ScaleMaskSoftmax"] == 0
    l3, rep = rewrite(gd, ["out"], level=3)
    c = op_counts(l3)
    # the products stay TF's (oneDNN GEMMs); scale, mask add and softmax are one op
    assert c["ScaleMaskSoftmax"] == 1 and c["Softmax"] == 0 and c["Mul"] == 0 and c["AddV2"] == 0
    assert c["BatchMatMulV2"] == 2
    np.testing.assert_allclose(run_gd(gd, ["out"], feed)[0], run_gd(l3, ["out"], feed)[0], rtol=1e-5, atol=1e-5)


def test_attention_external_consumer_no_fusion():
    gd = _attention_graph(extra=True)
    l3, _ = rewrite(gd, ["out"], level=3)
    assert op_counts(l3)["ScaleMaskSoftmax"] == 0 and op_counts(l3)["Softmax"] == 1


# ------------------------------------------------------- graph_level 0/1
def _cast_graph():
    def f():
        x = tf1.placeholder(tf.float16, [2, 3], name="x")
        a = tf.cast(tf.cast(x, tf.float32), tf.float16, name="back")           # exact round trip
        r = tf.cast(tf.reshape(tf.cast(x, tf.float32), [3, 2]), tf.float16, name="sunk")
        n = tf.cast(tf.cast(tf.cast(x, tf.float32), tf.float16), tf.float32, name="narrow_kept")
        i = tf.identity(tf.identity(x), name="ii")
        d1 = tf.cast(x, tf.float32, name="d1")
        d2 = tf.cast(x, tf.float32, name="d2")
        return tf.identity(a, "o1"), tf.identity(r, "o2"), tf.identity(n, "o3"), tf.identity(i, "o4"), \
            tf.identity(d1 + d2, "o5")
    return build(f)[0]


def test_graph_levels():
    gd = _cast_graph()
    fetch = ["o1", "o2", "o3", "o4", "o5"]
    l0, rep0 = rewrite(gd, fetch, level=0)
    assert op_counts(l0) == op_counts(gd) and rep0.pass_stats("fusion")["fused"] == {}
    l1, rep1 = rewrite(gd, fetch, level=1)
    c0, c1 = op_counts(gd), op_counts(l1)
    # a round trip f16->f32->f16 keeps its name as an Identity; casts drop from 9 to 2
    assert c1["Cast"] == 2 and c0["Cast"] == 9 and sum(c1.values()) < sum(c0.values())
    stats = rep1.pass_stats("fusion")
    assert stats["fused"]["cast_chain"] >= 1 and stats["fused"]["cast_sink"] == 1
    assert stats["fused"]["identity_chain"] == 1 and stats["casts_merged"] >= 1
    by = {n.name: n for n in l1.node}
    assert by["sunk"].op == "Reshape" and by["sunk"].attr["T"].type == tf.float16.as_datatype_enum
    feed = {"x": RNG.standard_normal((2, 3)).astype(np.float16)}
    for a, b in zip(run_gd(gd, fetch, feed), run_gd(l1, fetch, feed)):
        np.testing.assert_array_equal(a, b)
    again, rep = rewrite(l1, fetch, level=1)  # idempotent
    assert op_counts(again) == c1 and rep.pass_stats("fusion")["fused"] == {}


def test_level1_does_not_fuse_matmul_and_level2_does():
    gd = _dense_graph(tf.nn.relu)
    assert op_counts(rewrite(gd, ["out"], level=1)[0])["_FusedMatMul"] == 0
    assert op_counts(rewrite(gd, ["out"], level=2)[0])["_FusedMatMul"] == 1


# ------------------------------------------------------------- registry
def test_user_registered_rule_and_kernel_check():
    def build_neg(m, b):
        b.emit("Identity", m.anchor, [m["x"]], {"T": b.anchor.attr["T"]})

    register_fusion_rule("test_double_neg", Pat("Neg", inputs=[Pat("Neg", name="n", inputs=[Pat.any("x")])]),
                         build_neg)

    @fusion_rule("test_no_kernel", Pat("Square", inputs=[Pat.any("x")]))
    def build_sq(m, b):
        b.emit("NoSuchOpAnywhere", m.anchor, [m["x"]])

    try:
        def f():
            x = tf1.placeholder(tf.float32, [4], name="x")
            return tf.identity(tf.negative(tf.negative(x)) + tf.square(x), name="out")
        gd, _ = build(f)
        new, rep = rewrite(gd, ["out"])
        c = op_counts(new)
        assert c["Neg"] == 0 and c["Square"] == 1  # the rule without a kernel never breaks the graph
        stats = rep.pass_stats("fusion")
        assert stats["fused"]["test_double_neg"] == 1 and stats["skipped"]["test_no_kernel"] == 1
        assert any("NoSuchOpAnywhere" in w["message"] for w in rep.warnings)
        feed = {"x": np.arange(4, dtype=np.float32)}
        np.testing.assert_allclose(run_gd(gd, ["out"], feed)[0], run_gd(new, ["out"], feed)[0])
        with pytest.raises(FusionRuleError, match="already registered"):
            register_fusion_rule("test_double_neg", Pat("Neg"), build_neg)
    finally:
        unregister_fusion_rule("test_double_neg")
        unregister_fusion_rule("test_no_kernel")


@pytest.mark.parametrize("kwargs,msg", [
    (dict(name="", pattern=Pat("Neg"), build=lambda m, b: None), "non-empty"),
    (dict(name="r", pattern="Neg", build=lambda m, b: None), "must be a graph_passes.pattern.Pat"),
    (dict(name="r", pattern=Pat("Neg"), build=None), "callable"),
    (dict(name="r", pattern=Pat("Neg"), build=lambda m, b: None, graph_level=4), "graph_level=4"),
    (dict(name="r", pattern=Pat.any("x"), build=lambda m, b: None), "root must be an op"),
])
def test_register_bad_input(kwargs, msg):
    with pytest.raises(FusionRuleError, match=msg):
        register_fusion_rule(**kwargs)


def test_builtin_rule_cannot_be_unregistered():
    with pytest.raises(FusionRuleError, match="built in"):
        unregister_fusion_rule("bias_act")


def test_public_api_export():
    import npu_amp_tf
    assert npu_amp_tf.register_fusion_rule is register_fusion_rule
    assert npu_amp_tf.fusion_rule is fusion_rule


def test_onednn_table_consistent():
    assert "Relu" in supported_activations("Conv2D")
    assert onednn_enabled() == ONEDNN
    assert ("GeluExact" in supported_activations("MatMul")) == ONEDNN


def test_sweeps_reach_a_fix_point_and_a_self_rewriting_rule_is_bounded():
    gd = _dense_graph(tf.nn.relu)
    _, rep = rewrite(gd, ["out"])
    assert rep.pass_stats("fusion")["sweeps"] == 2  # one that fuses, one that finds nothing

    def same(m, b):  # rewrites Neg into Neg: never reaches a fix-point
        b.emit("Neg", m.anchor, [m["x"]], {"T": b.anchor.attr["T"]})

    register_fusion_rule("test_self_rewrite", Pat("Neg", inputs=[Pat.any("x")]), same)
    try:
        gd, _ = build(lambda: tf.identity(tf.negative(tf1.placeholder(tf.float32, [2], name="x")), name="out"))
        new, rep = rewrite(gd, ["out"])
        stats = rep.pass_stats("fusion")
        assert stats["fixpoint"] is False and stats["sweeps"] == 8
        assert any("no fix-point after 8 sweeps" in w["message"] and "test_self_rewrite" in w["message"]
                   for w in rep.warnings)
    finally:
        unregister_fusion_rule("test_self_rewrite")


# ------------------------------------------------- forms as real code writes them
def test_keras_dense_3d_input_fuses_through_reshape():
    """Keras 2 and Keras 3 Dense on a [B, S, E] input lower to tensordot:
    Reshape -> MatMul -> Reshape -> BiasAdd -> activation."""
    from _fusion_util import freeze
    d = tf.keras.layers.Dense(6, activation="relu")
    gd, (inp,), out = freeze(lambda x: d(x), ([2, 3, 8], tf.float32, "x"))
    assert op_counts(gd)["BiasAdd"] == 1 and op_counts(gd)["MatMul"] == 1
    new, rep = rewrite(gd, [out])
    c = op_counts(new)
    assert c["_FusedMatMul"] == 1 and c["MatMul"] == 0 and c["BiasAdd"] == 0 and c["Relu"] == 0
    assert rep.pass_stats("fusion")["fused"] == {"bias_act": 1}
    fused = [n for n in new.node if n.op == "_FusedMatMul"][0]
    assert list(fused.attr["fused_ops"].list.s) == [b"BiasAdd", b"Relu"]
    # the Reshape now comes after the fused op
    (rs,) = [n for n in new.node if n.op == "Reshape" and n.input[0] == fused.name]
    feed = {inp: RNG.standard_normal((2, 3, 8)).astype(np.float32)}
    np.testing.assert_allclose(run_gd(gd, [out], feed)[0], run_gd(new, [out], feed)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["tf.nn.gelu", "keras"])
@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_both_ways_after_3d_dense(how, approximate):
    """tf.nn.gelu (erf: TF 2.15's 1+erf form and TF >= 2.16's erfc form; tanh)
    after a Keras Dense on a 3-D input."""
    from _fusion_util import freeze
    d = tf.keras.layers.Dense(6)
    if how == "keras":
        act = lambda h: tf.keras.activations.gelu(h, approximate=approximate)  # noqa: E731
    else:
        act = lambda h: tf.nn.gelu(h, approximate=approximate)  # noqa: E731
    gd, (inp,), out = freeze(lambda x: act(d(x)), ([2, 3, 8], tf.float32, "x"))
    new, rep = rewrite(gd, [out])
    rule = "bias_gelu_tanh" if approximate else "bias_gelu_exact"
    stats = rep.pass_stats("fusion")
    if ONEDNN:
        assert stats["fused"] == {rule: 1}, stats
        c = op_counts(new)
        assert c["Erf"] + c["Erfc"] + c["Tanh"] == 0 and c["_FusedMatMul"] == 1
    else:  # stock Eigen kernels have no GELU: skipped with the reason, bias still fused
        assert stats["skipped"] == {rule: 1} and stats["fused"] == {"bias": 1}
    feed = {inp: RNG.standard_normal((2, 3, 8)).astype(np.float32)}
    np.testing.assert_allclose(run_gd(gd, [out], feed)[0], run_gd(new, [out], feed)[0], rtol=1e-5, atol=1e-5)


def _att(q, k, v, scale_on, scale_kind, mask_kind, op):
    d = int(q.shape[-1])
    c = tf.math.rsqrt(tf.cast(tf.shape(k)[-1], tf.float32)) if scale_kind == "rsqrt" else np.float32(d ** -0.5)
    div = scale_kind == "div"
    sc = (lambda t: t / np.float32(d ** 0.5)) if div else (lambda t: t * c)
    if scale_on == "q":
        q = sc(q)
    elif scale_on == "k":
        k = sc(k)
    if op == "einsum":
        s = tf.einsum("bhqd,bhkd->bhqk", q, k)
    else:
        s = tf.matmul(q, k, transpose_b=True)
    if scale_on == "scores":
        s = sc(s)
    if mask_kind == "add":
        s = s + tf1.placeholder(tf.float32, [2, 1, 1, 7], name="m")
    elif mask_kind == "bool":
        s = tf.where(tf1.placeholder(tf.bool, [2, 1, 5, 7], name="bm"), s, -1e9)
    p = tf.nn.softmax(s)
    return tf.einsum("bhqk,bhkd->bhqd", p, v) if op == "einsum" else tf.matmul(p, v)


@pytest.mark.parametrize("scale_on,scale_kind,mask_kind,op", [
    ("scores", "mul", "add", "bmm"), ("scores", "div", "none", "bmm"), ("q", "mul", "add", "bmm"),
    ("k", "rsqrt", "bool", "bmm"), ("q", "div", "bool", "einsum"), ("scores", "rsqrt", "add", "einsum")])
def test_attention_variants(scale_on, scale_kind, mask_kind, op):
    def f():
        q = tf1.placeholder(tf.float32, [2, 2, 5, 4], name="q")
        k = tf1.placeholder(tf.float32, [2, 2, 7, 4], name="k")
        v = tf1.placeholder(tf.float32, [2, 2, 7, 3], name="v")
        return tf.identity(_att(q, k, v, scale_on, scale_kind, mask_kind, op), name="out")
    gd, _ = build(f)
    new, rep = rewrite(gd, ["out"], level=3)
    c = op_counts(new)
    assert c["ScaleMaskSoftmax"] == 1 and c["Softmax"] == 0 and c["Einsum"] + c["BatchMatMulV2"] == 2, \
        rep.pass_stats("fusion")
    assert c["Mul"] + c["RealDiv"] + c["Rsqrt"] + c["AddV2"] + c["Select"] == 0, c  # all moved into the op
    fa = [n for n in new.node if n.op == "ScaleMaskSoftmax"][0]
    assert fa.attr["scale"].f == pytest.approx(0.5)  # 1/sqrt(4), wherever it was applied
    feed = {k: v for k, v in ATT_FEED.items() if k != "m" or mask_kind == "add"}
    if mask_kind == "bool":
        feed["bm"] = RNG.random((2, 1, 5, 7)) > 0.3
    np.testing.assert_allclose(run_gd(gd, ["out"], feed)[0], run_gd(new, ["out"], feed)[0], rtol=1e-5, atol=1e-5)


def test_keras_multi_head_attention():
    """tf.keras MultiHeadAttention (Keras 2: einsum, scale on q, additive mask,
    dropout Identity; Keras 3: einsum, scale on scores, mask via where)."""
    from _fusion_util import freeze
    mha = tf.keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    xs = RNG.standard_normal((2, 5, 8)).astype(np.float32)
    mask = RNG.random((2, 5, 5)) > 0.3
    mha(xs, xs, attention_mask=mask)
    gd, (inp, minp), out = freeze(lambda x, m: mha(x, x, attention_mask=m),
                                  ([2, 5, 8], tf.float32, "x"), ([2, 5, 5], tf.bool, "mask"))
    new, rep = rewrite(gd, [out], level=3)
    c = op_counts(new)
    assert c["ScaleMaskSoftmax"] == 1 and c["Softmax"] == 0, rep.pass_stats("fusion")
    feed = {inp: xs, minp: mask}
    np.testing.assert_allclose(run_gd(gd, [out], feed)[0], run_gd(new, [out], feed)[0], rtol=1e-5, atol=1e-5)


def test_attention_fetched_probs_reported():
    def f():
        q = tf1.placeholder(tf.float32, [2, 2, 5, 4], name="q")
        k = tf1.placeholder(tf.float32, [2, 2, 7, 4], name="k")
        v = tf1.placeholder(tf.float32, [2, 2, 7, 3], name="v")
        p = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) * 0.5, name="probs")
        return tf.identity(tf.matmul(p, v), name="out")
    gd, _ = build(f)
    new, rep = rewrite(gd, ["out", "probs"], level=3)
    assert op_counts(new)["ScaleMaskSoftmax"] == 0
    assert any(d.get("fusion_reason") == "not fused: 'probs' is fetched or preserved"
               for d in rep.decisions.values()), rep.decisions


@pytest.mark.parametrize("dtype,tol", [(tf.float32, 1e-6), (tf.float16, 1e-3), (tf.bfloat16, 8e-3)])
def test_scale_mask_softmax_kernel(dtype, tol):
    from npu_amp_tf import fused_ops
    s = RNG.standard_normal((2, 3, 4, 19)).astype(np.float32) * 4  # 19: vector body + scalar tail
    m = np.where(RNG.random((2, 1, 4, 19)) > 0.3, 0.0, -1e4).astype(np.float32)
    st, mt = tf.cast(s, dtype), tf.cast(m, dtype)
    got = fused_ops.scale_mask_softmax(st, mt, scale=0.3)
    assert got.dtype == dtype
    z = tf.cast(st, tf.float32).numpy().astype(np.float64) * 0.3 + tf.cast(mt, tf.float32).numpy()
    want = np.exp(z - z.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    # fp32 arithmetic: the error is the output rounding to dtype (relative), plus exp's ~1 ulp in fp32
    np.testing.assert_allclose(tf.cast(got, tf.float32).numpy(), want, rtol=tol, atol=tol * 1e-2)
    np.testing.assert_allclose(fused_ops.scale_mask_softmax(s[0, 0], None, 1.0).numpy(),
                               tf.nn.softmax(s[0, 0]).numpy(), rtol=1e-6, atol=1e-7)


def test_pre_ln_transformer_block_in_plain_ops():
    """The issue's example: a pre-LN block written with plain TF ops
    (tf.nn.moments and (x-mean)*rsqrt(var+eps)*gamma+beta, Dense on 3-D via
    tensordot, tf.nn.gelu, attention with the scale after q.k^T)."""
    b_, s_, e_, h_ = 2, 5, 8, 2

    def w(*shape):
        return tf.constant((RNG.standard_normal(shape) * 0.3).astype(np.float32))

    def ln(x):
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-6) * (1.0 + w(e_)) + w(e_)

    def dense(x, n):
        return tf.tensordot(x, w(int(x.shape[-1]), n), axes=1) + w(n)

    def f():
        x = tf1.placeholder(tf.float32, [b_, s_, e_], name="x")
        h = ln(x)
        q, k, v = (tf.transpose(tf.reshape(dense(h, e_), [b_, s_, h_, e_ // h_]), [0, 2, 1, 3])
                   for _ in range(3))
        p = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / np.sqrt(e_ // h_).astype(np.float32))
        a = tf.reshape(tf.transpose(tf.matmul(p, v), [0, 2, 1, 3]), [b_, s_, e_])
        x = x + dense(a, e_)
        x = x + dense(tf.nn.gelu(dense(ln(x), 16)), e_)
        return tf.identity(x, name="out")
    gd, _ = build(f)
    new, rep = rewrite(gd, ["out"], level=3)
    c, c0 = op_counts(new), op_counts(gd)
    stats = rep.pass_stats("fusion")["fused"]
    assert c["LayerNorm"] == 2 and c["ScaleMaskSoftmax"] == 1 and c["Softmax"] == 0, stats
    assert c["_FusedMatMul"] == 6 and c["MatMul"] == 0, stats  # q, k, v, out, ffn1 (+gelu), ffn2
    expect_gelu = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") != "0"  # oneDNN's _FusedMatMul has GELU
    assert (c["Erf"] + c["Erfc"] == 0) == expect_gelu, stats
    removed = sum(c0.values()) - sum(c.values())
    # was 6 (only the bias adds) before; TF >= 2.16 writes erf-GELU with 2 ops fewer
    assert removed >= 37, (removed, sum(c0.values()))
    feed = {"x": RNG.standard_normal((b_, s_, e_)).astype(np.float32)}
    np.testing.assert_allclose(run_gd(gd, ["out"], feed)[0], run_gd(new, ["out"], feed)[0], rtol=1e-4, atol=1e-5)
