"""The layout pass: counts on real graphs, numerical equivalence, padding hazard,
golden structure, no-change in origin mode, idempotence, check_align."""
import json

import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from graph_passes.layout import formats, transdata_counts
from graph_passes.graph import Graph
from graph_passes.manager import run_passes
from npu_amp_tf import ops  # noqa: F401  (registers TransData for running rewritten graphs)
from npu_amp_tf.errors import NpuAmpError
from npu_amp_tf.options import Options
from npu_amp_tf.pipeline import rewrite_graph

import layout_graphs as lg
from conftest import TF_VERSION

FP32 = dict(format_mode="NC1HWC0", precision_mode="must_keep_origin_dtype", fail_on_error=True,
            validate_graph=True)
OPTS = Options.from_kwargs(_source="test", _env=False, format_mode="NC1HWC0",
                           variable_format_optimize=False)


def boundary_names(gd, kind=None):
    out = []
    for n in gd.node:
        if n.op == "TransData" and not n.attr["_npu_lowering"].b:
            s, d = n.attr["src_format"].s.decode(), n.attr["dst_format"].s.decode()
            k = "filter" if "FRACTAL_Z" in (s, d) else "per_channel" if "C" in (s, d) else "activation"
            if kind in (None, k):
                out.append(n.name)
    return sorted(out)


@pytest.fixture(scope="module")
def resnet():
    # 64x64 keeps conv5 at 2x2: at 1x1 spatial a [1,1,1,C] per-channel operand (Keras 3 unfused
    # batch norm) is indistinguishable from an activation and would count as one
    gd, out = lg.resnet50_inference(hw=64)
    gd2, rep = rewrite_graph(gd, fetches=[out], **FP32)
    return gd, gd2, rep, out


def pooled(gd):
    """The global-average-pool node (Keras 2: resnet50/avg_pool/Mean; Keras 3 renames layers)."""
    (name,) = [n.name for n in gd.node if n.op == "Mean"]
    return name


def test_resnet50_inference_counts(resnet):
    gd, gd2, rep, _ = resnet
    act = boundary_names(gd2, "activation")
    assert len(act) == 2, act
    assert act[0].endswith("TransData_NC1HWC0_to_NHWC") and act[1] == "x/TransData_NHWC_to_NC1HWC0"
    n_conv = lg.count_op(gd, "Conv2D")
    filt = boundary_names(gd2, "filter")
    assert 0 < len(filt) <= n_conv == 53
    assert rep.summary["transdata_activation"] == 2
    assert rep.summary["transdata_filter"] == len(filt)
    assert rep.summary["transdata_before_elimination"] > rep.summary["transdata_eliminated"] > 0
    assert rep.summary["padding_waste_flops"] > 0          # conv1 has Cin=3
    # Keras 3 (TF >= 2.16) decomposes batch norm; where it is fused, all 53 are 5HD
    assert rep.summary["formats_by_op"].get("FusedBatchNormV3", {"NC1HWC0": 53}) == {"NC1HWC0": 53}
    fb = rep.summary["formats_by_op"]   # the fusion pass may have fused Conv2D+BiasAdd
    assert sum(fb.get(op, {}).get("NC1HWC0", 0) for op in ("Conv2D", "_FusedConv2D")) == 53
    assert not any("origin" in fb.get(op, {}) for op in ("Conv2D", "_FusedConv2D", "MaxPool"))
    assert rep.decisions[pooled(gd)]["format"] == "origin"
    if TF_VERSION >= (2, 16):
        # Keras 3 lowers BatchNormalization to x * (gamma*rsqrt(var+eps)) + (beta - mean*...):
        # per-channel Mul/AddV2 that stay in 5HD, one of each per batch norm
        assert lg.count_op(gd, "FusedBatchNormV3") == 0
        assert fb["Mul"] == {"NC1HWC0": 53} and fb["AddV2"]["NC1HWC0"] >= 53


def test_resnet50_inference_numerics(resnet):
    gd, gd2, _, out = resnet
    x = np.random.RandomState(0).rand(1, 64, 64, 3).astype(np.float32)
    pre = pooled(gd)    # pooled features: before the softmax flattens differences
    a = lg.run_graph(gd, [out + ":0", pre + ":0"], {"x:0": x})
    b = lg.run_graph(gd2, [out + ":0", pre + ":0"], {"x:0": x})
    for u, v in zip(a, b):
        np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-6)


def test_idempotent_and_origin_mode_is_a_no_op(resnet):
    gd, gd2, _, out = resnet
    again, rep = run_passes(gd2, ["layout"], OPTS, fetches=[out])
    assert again == gd2
    assert rep.summary["transdata_activation"] == 2
    same, rep = run_passes(gd, ["layout"], Options.from_kwargs(_source="test", _env=False, format_mode="origin"), fetches=[out])
    assert same == gd and "transdata_activation" not in rep.summary
    gd_o, _ = rewrite_graph(gd, fetches=[out], precision_mode="must_keep_origin_dtype")
    assert lg.count_op(gd_o, "TransData") == 0


def test_resnet50_training_count_bounded():
    gd = lg.resnet50_training()
    gd2, rep = run_passes(gd, ["layout"], OPTS)
    s = rep.summary
    n_conv = lg.count_op(gd, "Conv2D")
    if TF_VERSION < (2, 16):
        # input, ->Mean, Mean-grad->5HD, and per conv the BiasAddGrad and ShapeN boundaries
        # (measured: 106 for 53 convs); bounded at two per conv
        assert 2 <= s["transdata_activation"] <= 2 * n_conv, s
    else:
        # Keras 3 trains batch norm through moments (Mean over N,H,W of x and of the squared
        # difference) and its gradient through Sum/Tile: channel-preserving reductions, which
        # the pass treats as padding hazards, so the 5HD region stops at each of them
        # (measured on TF 2.21: 420 for 53 convs, ~8 per conv)
        assert 2 * n_conv < s["transdata_activation"] <= 8 * n_conv, s
    # one FRACTAL_Z per filter read + one gradient back to HWCN per filter
    assert s["transdata_filter"] <= 2 * n_conv
    assert len([n for n in boundary_names(gd2, "filter") if n.endswith("FRACTAL_Z_to_HWCN")]) == n_conv
    assert s["transdata_before_elimination"] > 5 * (s["transdata_activation"] + s["transdata_filter"])


def test_small_cnn_training_step_equal():
    gd, feeds, names = lg.small_cnn_training()
    fetch = [names["loss"].split(":")[0], names["train"], names["init"]] + \
        [v.split(":")[0] for v in names["reads"].values()]
    gd2, rep = rewrite_graph(gd, fetches=fetch, **FP32)
    s = rep.summary
    assert s["transdata_activation"] <= 8 and s["transdata_filter"] == 4, s
    assert rep.summary["formats_by_op"]["Conv2DBackpropFilter"] == {"NC1HWC0": 2}
    l1, v1 = lg.run_training_step(gd, feeds, names)
    l2, v2 = lg.run_training_step(gd2, feeds, names)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    for k in v1:
        np.testing.assert_allclose(v2[k], v1[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert any(np.abs(v1[k] - lg.run_training_step(gd, feeds, dict(names, train=names["init"]))[1][k]).max() > 0
               for k in ("w1", "w2"))   # the step really changed the filters


def test_variable_format_optimize_keeps_filters_in_fractal_z():
    gd, feeds, names = lg.small_cnn_training()
    fetch = [names["loss"].split(":")[0], names["train"], names["init"]] + \
        [v.split(":")[0] for v in names["reads"].values()]
    gd2, rep = rewrite_graph(gd, fetches=fetch, variable_format_optimize=True, **FP32)
    assert rep.summary["variables_fractal_z"] == 2
    var = {n.name: n for n in gd2.node}["w2"]
    assert [d.size for d in var.attr["shape"].shape.dim] == formats.fractal_z_shape([3, 3, 17, 24])
    # no per-step filter conversion is left: the update and the conv both use FRACTAL_Z
    assert not any(n.endswith("Conv2DBackpropFilter/TransData_FRACTAL_Z_to_HWCN") for n in boundary_names(gd2))
    l1, v1 = lg.run_training_step(gd, feeds, names)
    l2, v2 = lg.run_training_step(gd2, feeds, names)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    for k in v1:    # user reads still see HWCN
        np.testing.assert_allclose(v2[k], v1[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _hazard_graph():
    """conv(17 ch) -> sigmoid -> {Log, x / sigmoid, softmax over C, sum over C}."""
    rng = np.random.RandomState(5)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 6, 6, 3], name="x")
        w = tf.constant(rng.randn(3, 3, 3, 17).astype(np.float32))
        h = tf.nn.conv2d(x, w, 1, "SAME")
        s = tf.nn.sigmoid(h, name="sig")
        outs = [tf.math.log(s, name="log"), tf.math.divide(h, s, name="div"),
                tf.nn.softmax(s, axis=-1, name="softmax"), tf.reduce_sum(s, axis=-1, name="sum_c"),
                tf.nn.relu(h, name="relu")]
        outs = [tf.identity(o, name=o.op.name + "_out") for o in outs]   # fetch after the op
    return g.as_graph_def(), [o.op.name for o in outs], {"x:0": rng.rand(1, 6, 6, 3).astype(np.float32)}


def test_padding_hazard_never_reaches_log_div_softmax_reduction():
    gd, outs, feeds = _hazard_graph()
    gd2, rep = rewrite_graph(gd, fetches=outs, **FP32)
    nodes = {n.name: n for n in gd2.node}
    for name in ("log", "div", "softmax", "sum_c"):
        assert rep.decisions[name]["format"] == "origin"
        assert "padding hazard" in rep.decisions[name]["layout_reason"] or name == "softmax"
        src = nodes[nodes[name].input[0].split(":")[0]]
        assert not (src.op == "TransData" and src.attr["dst_format"].s == b"NC1HWC0")
    # every tensor of the rewritten graph, padding lanes included, is finite
    every = [n.name + ":0" for n in gd2.node if n.op not in ("Const", "Placeholder") and
             not n.name.startswith("^")]
    vals = lg.run_graph(gd2, every, feeds)
    for n, v in zip(every, vals):
        assert np.isfinite(v).all(), n
    a = lg.run_graph(gd, [o + ":0" for o in outs], feeds)
    b = lg.run_graph(gd2, [o + ":0" for o in outs], feeds)
    for u, v, o in zip(a, b, outs):
        np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-6, err_msg=o)


def test_golden_structure():
    """x -> Conv2D -> BiasAdd -> Relu -> Reshape: exactly these nodes are inserted."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 4, 4, 3], name="x")
        c = tf.nn.conv2d(x, tf.constant(np.ones([1, 1, 3, 5], np.float32), name="w"), 1, "SAME", name="conv")
        r = tf.nn.relu(tf.nn.bias_add(c, tf.constant(np.arange(5, dtype=np.float32), name="b"), name="bias"),
                       name="relu")
        tf.reshape(r, [1, -1], name="flat")
    gd2, rep = run_passes(g.as_graph_def(), ["layout"], OPTS, fetches=["flat"])
    td = {n.name: (n.input[0], n.attr["src_format"].s.decode(), n.attr["dst_format"].s.decode())
          for n in gd2.node if n.op == "TransData" and not n.attr["_npu_lowering"].b}
    assert td == {
        "x/TransData_NHWC_to_NC1HWC0": ("x", "NHWC", "NC1HWC0"),
        "w/TransData_HWCN_to_FRACTAL_Z": ("w", "HWCN", "FRACTAL_Z"),
        "b/TransData_C_to_NC1HWC0": ("b", "C", "NC1HWC0"),
        "relu/TransData_NC1HWC0_to_NHWC": ("relu", "NC1HWC0", "NHWC"),
    }
    nodes = {n.name: n for n in gd2.node}
    assert nodes["flat"].input[0] == "relu/TransData_NC1HWC0_to_NHWC"
    assert nodes["bias"].op == "AddV2" and nodes["relu"].input[0] == "bias"
    assert nodes["conv"].input[0] == "conv/Lowered/in0/TransData_NC1HWC0_to_NHWC"
    assert nodes["conv/Lowered/in0/TransData_NC1HWC0_to_NHWC"].input[0] == "x/TransData_NHWC_to_NC1HWC0"
    assert rep.decisions["relu"]["format"] == "NC1HWC0" and rep.decisions["flat"]["format"] == "origin"
    assert transdata_counts(Graph(gd2)) == {"activation": 2, "filter": 1, "per_channel": 1, "lowering": 3}
    x = np.random.RandomState(1).rand(1, 4, 4, 3).astype(np.float32)
    np.testing.assert_allclose(lg.run_graph(gd2, "flat:0", {"x:0": x}),
                               lg.run_graph(g.as_graph_def(), "flat:0", {"x:0": x}), rtol=1e-6)


def test_no_match_graph_without_conv_is_unchanged():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8], name="x")
        tf.nn.relu(tf.matmul(x, tf.ones([8, 4])), name="y")
    gd = g.as_graph_def()
    gd2, rep = run_passes(gd, ["layout"], OPTS, fetches=["y"])
    assert lg.count_op(gd2, "TransData") == 0 and rep.pass_stats("layout")["ops_nc1hwc0"] == 0


def test_check_align_tensor_shape_and_graph():
    r = npu_amp_tf.check_align(((1, 56, 56, 17), "float16"))
    it = r["items"][0]
    assert it["padded_shape"] == [1, 2, 56, 56, 16] and it["waste_share"] == pytest.approx(15 / 32)
    assert npu_amp_tf.check_align(((1, 8, 8, 17), "int8"))["items"][0]["padded_shape"] == [1, 1, 8, 8, 32]
    assert npu_amp_tf.check_align(tf.zeros([1, 8, 8, 32]))["items"] == []
    m = npu_amp_tf.check_align(((100, 30), "float32"))["items"][0]
    assert m["padded_shape"] == [112, 32] and m["unaligned_dims"] == {"rows": 100, "cols": 30}
    gd, _, _ = _hazard_graph()
    rg = npu_amp_tf.check_align(gd)
    conv = rg["items"][0]
    assert conv["op"] == "Conv2D" and conv["unaligned_dims"] == {"Cin": 3, "Cout": 17}
    # 2*N*H*W*Kh*Kw*Cin*Cout real vs padded to 16 x 32
    assert conv["flops"] == 2 * 36 * 9 * 3 * 17 and conv["padded_flops"] == 2 * 36 * 9 * 16 * 32
    assert rg["total_padding_waste_flops"] == conv["padded_flops"] - conv["flops"]
    json.dumps(rg)
    table = rg.format_table()
    assert "Conv2D" in table and "padding waste" in table
    with pytest.raises(NpuAmpError, match="accepted"):
        npu_amp_tf.check_align("model.pb")
    with pytest.raises(NpuAmpError, match="float64"):
        npu_amp_tf.check_align(((1, 2, 2, 3), "float64"))


def test_shape_inference_failure_is_reported_not_silent():
    """An op TensorFlow does not know (no _output_shapes): TF refuses the graph, no shapes
    are known, the conv keeps its layout - and the report says so."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 8, 8, 16], name="x")
        y = tf.nn.relu(x, name="r")
        z = tf.nn.conv2d(y, tf.ones([3, 3, 16, 16]), 1, "SAME", name="conv")
        tf.identity(z, name="out")
    gd = g.as_graph_def()
    for n in gd.node:
        if n.name == "r":
            n.op = "NpuAmpTestUnregisteredOp"   # not an op TF can import
    gd2, rep = run_passes(gd, ["layout"], OPTS, fetches=["out"])
    assert lg.count_op(gd2, "TransData") == 0
    msgs = [w["message"] for w in rep.warnings if w["pass"] == "layout"]
    assert len(msgs) == 1 and "without shapes" in msgs[0] and "conv" in msgs[0], rep.warnings
    assert "NpuAmpTestUnregisteredOp" in msgs[0] or "could not import" in msgs[0]
