"""The precision pass, rule by rule: golden before/expected graphs (built with
TF ops in tf.compat.v1 graphs), no-change cases, modes, overrides, errors."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

import npu_amp_tf
from graph_passes.errors import MixlistError, OptionError
from graph_passes import registry
from graph_passes.graph import Graph, parse_tensor
from graph_passes.manager import run_passes
from npu_amp_tf.options import Options

F32, F16, BF16 = types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16
v1 = tf.compat.v1


def precision(gd, fetches=(), **params):
    """Run only the precision pass (validating), twice: return the first
    result and check that the second run changes nothing."""
    opts = Options.from_kwargs(_env=False, **params)
    out, rep = run_passes(gd, ["precision"], options=opts, fetches=fetches, validate=True)
    again, rep2 = run_passes(out, ["precision"], options=opts, fetches=fetches, validate=True)
    assert again == out, "precision pass is not idempotent"
    assert rep2.summary["casts_inserted"] == 0
    json.dumps(rep.to_json())
    return out, rep


def structure(gd):
    """{name: (op, inputs, {type attr: dtype})} -- what golden graphs compare."""
    out = {}
    for n in gd.node:
        types = {k: v.type for k, v in n.attr.items() if v.WhichOneof("value") == "type"}
        out[n.name] = (n.op, tuple(n.input), types)
    return out


def casts(gd):
    return sorted(n.name for n in gd.node if n.op == "Cast")


def dtype_of(gd, name, attr="T"):
    for n in gd.node:
        if n.name == name:
            return n.attr[attr].type
    raise KeyError(name)


def build(fn):
    g = tf.Graph()
    with g.as_default():
        fn()
    return g.as_graph_def()


def run_graph(gd, fetches, feeds):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with v1.Session(graph=g) as s:
        return s.run(fetches, feeds)


def ph(name, shape=(2, 2), dtype=tf.float32):
    return v1.placeholder(dtype, list(shape), name=name)


def cst(name, shape=(2, 2), value=0.5, dtype=tf.float32):
    return tf.constant(np.full(shape, value, np.float32), dtype=dtype, name=name)


# ----------------------------------------------------------------- golden
def test_white_matmul_golden():
    """x ─► MatMul ◄─ w(Const)  ─►  y(Identity, fetched)"""
    def before():
        mm = tf.matmul(ph("x"), cst("w"), name="mm")
        tf.identity(mm, name="y")

    out, rep = precision(build(before), fetches=["y"])
    expected = {
        "x": ("Placeholder", (), {"dtype": F32}),
        "w": ("Const", (), {"dtype": F16}),                         # converted in place
        "x/CastToFp16": ("Cast", ("x",), {"SrcT": F32, "DstT": F16}),
        "mm": ("MatMul", ("x/CastToFp16", "w"), {"T": F16}),
        "mm/CastToFp32": ("Cast", ("mm",), {"SrcT": F16, "DstT": F32}),
        "y": ("Identity", ("mm/CastToFp32",), {"T": F32}),         # fetched: keeps float32
    }
    assert structure(out) == expected
    assert rep.decisions["mm"]["list"] == "white"
    assert rep.decisions["y"]["reason"].startswith("fetched")
    assert rep.summary["casts_inserted"] == 2
    assert rep.summary["lp_flop_share"] == 1.0
    assert rep.summary["low_precision_nodes"] == 1


def test_black_after_white_and_gray_follows():
    """mm(white) ─► Add(gray, both inputs low) ─► Softmax(black) ─► Mul(gray: hard FP32 wins the tie)"""
    def before():
        x = ph("x")
        a = tf.matmul(x, cst("w1"), name="a")
        b = tf.matmul(x, cst("w2"), name="b")
        s = tf.add(a, b, name="s")
        sm = tf.nn.softmax(s, name="sm")
        m = tf.multiply(sm, a, name="m")
        tf.identity(m, name="y")

    out, rep = precision(build(before), fetches=["y"])
    st = structure(out)
    assert st["s"] == ("AddV2", ("a", "b"), {"T": F16})
    assert st["sm"] == ("Softmax", ("s/CastToFp32",), {"T": F32})
    # the tie (sm: hard FP32, a: low) goes to FP32 because black propagates
    assert st["m"] == ("Mul", ("sm", "a/CastToFp32"), {"T": F32})
    assert "followed producer 'a'" in rep.decisions["s"]["reason"]
    assert rep.decisions["m"]["state"] == "hard"
    # one cast per (tensor, dtype): x is cast once for two MatMuls
    assert casts(out) == ["a/CastToFp32", "s/CastToFp32", "x/CastToFp16"]


def test_gray_without_low_producers_is_untouched():
    def before():
        x, z = ph("x"), ph("z")
        t = tf.tanh(tf.add(x, z, name="add"), name="t")
        tf.nn.softmax(t, name="y")

    gd = build(before)
    out, rep = precision(gd, fetches=["y"])
    assert out == gd
    assert rep.summary["casts_inserted"] == 0
    assert rep.summary["low_precision_nodes"] == 0
    assert "followed producer 'x'" in rep.decisions["add"]["reason"]


def test_must_keep_origin_dtype_changes_nothing():
    def before():
        tf.nn.relu(tf.matmul(ph("x"), cst("w")), name="y")

    gd = build(before)
    for params in ({"precision_mode": "must_keep_origin_dtype"}, {"precision_mode_v2": "origin"}):
        out, rep = precision(gd, fetches=["y"], **params)
        assert out == gd
        assert rep.summary["precision_mode"] == "must_keep_origin_dtype"


def test_no_cast_chain_and_cast_reuse():
    """An FP16 tensor cast to FP32 by the user feeds a MatMul: the MatMul reads
    the FP16 root directly (no Cast->Cast); an existing Cast that fits is reused."""
    def before():
        h = ph("h", dtype=tf.float16)
        h32 = tf.cast(h, tf.float32, name="h32")
        mm = tf.matmul(h32, cst("w"), name="mm")
        x = ph("x")
        x16 = tf.cast(x, tf.float16, name="x16")        # user's cast of x, reusable
        tf.identity(x16, name="keep_x16")
        mm2 = tf.matmul(x, cst("w2"), name="mm2")
        tf.add(mm, mm2, name="s")
        tf.identity(tf.add(mm, mm2), name="y")

    out, rep = precision(build(before), fetches=["y", "keep_x16"])
    st = structure(out)
    assert st["mm"][1] == ("h", "w")
    assert st["mm2"][1] == ("x16", "w2")
    assert casts(out) == ["Add/CastToFp32", "h32", "x16"]
    for n in out.node:
        if n.op == "Cast":
            src = [m for m in out.node if m.name == n.input[0]][0]
            assert src.op != "Cast", f"Cast chain {src.name} -> {n.name}"


def test_int_to_float_cast_is_retargeted():
    def before():
        i = ph("i", dtype=tf.int32)
        f = tf.cast(i, tf.float32, name="f")
        tf.identity(tf.matmul(f, cst("w"), name="mm"), name="y")

    out, _ = precision(build(before), fetches=["y"])
    st = structure(out)
    assert st["f"] == ("Cast", ("i",), {"SrcT": types_pb2.DT_INT32, "DstT": F16})
    assert st["mm"][1] == ("f", "w")
    assert casts(out) == ["f", "mm/CastToFp32"]


def test_constant_underflow_keeps_consumer_fp32():
    """epsilon=1e-8 would become 0 in FP16 (the CANN pitfall)."""
    def before():
        mm = tf.matmul(ph("x"), cst("w"), name="mm")
        eps = tf.constant(1e-8, name="eps")
        d = tf.add(mm, eps, name="d")
        big = tf.constant(1e6, name="big")
        e = tf.multiply(mm, big, name="e")
        tf.identity(d + e, name="y")

    gd = build(before)
    out, rep = precision(gd, fetches=["y"])
    st = structure(out)
    assert st["eps"][2] == {"dtype": F32}
    assert st["d"][2] == {"T": F32}
    assert st["big"][2] == {"dtype": F32}
    assert st["e"][2] == {"T": F32}
    assert rep.decisions["d"]["reason"].startswith("const underflow: input 'eps' underflows to 0")
    assert "overflows to inf" in rep.decisions["e"]["reason"]
    msgs = [w["message"] for w in rep.warnings]
    assert any("eps" in m and "underflows" in m for m in msgs)
    x = np.full((2, 2), 1e-3, np.float32)
    a, b = run_graph(gd, "y:0", {"x:0": x}), run_graph(out, "y:0", {"x:0": x})
    np.testing.assert_allclose(b, a, rtol=2e-3)


def test_fused_matmul_without_fp16_kernel_falls_back_with_warning():
    """_FusedMatMul has no FP16 CPU kernel: stays FP32 with a warning; BF16 has one."""
    gd = graph_pb2.GraphDef()
    x = gd.node.add(name="x", op="Placeholder")
    x.attr["dtype"].type = F32
    w = gd.node.add(name="w", op="Const")
    w.attr["dtype"].type = F32
    w.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.ones((2, 2), np.float32)))
    b = gd.node.add(name="b", op="Const")
    b.attr["dtype"].type = F32
    b.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.ones((2,), np.float32)))
    f = gd.node.add(name="fused", op="_FusedMatMul", input=["x", "w", "b"])
    f.attr["T"].type = F32
    f.attr["num_args"].i = 1
    f.attr["fused_ops"].list.s.extend([b"BiasAdd"])
    out, rep = precision(gd, fetches=[])
    if registry.has_kernel("_FusedMatMul", "CPU", {"T": F16}):  # TF >= 2.16 registers one
        assert dtype_of(out, "fused") == F16
    else:                                                         # TF 2.15
        assert dtype_of(out, "fused") == F32
        assert rep.decisions["fused"]["reason"].startswith("no kernel: _FusedMatMul has no float16 kernel on CPU")
        assert any(w["node"] == "fused" for w in rep.warnings)
    # an explicit device type with no kernels at all: never converted, warned
    out_gpu, rep_gpu = precision(gd, device_type="GPU")
    if not registry.has_kernel("_FusedMatMul", "GPU", {"T": F16}):
        assert dtype_of(out_gpu, "fused") == F32
        assert "no float16 kernel on GPU" in rep_gpu.decisions["fused"]["reason"]
    out16, rep16 = precision(gd, precision_mode="allow_mix_precision_bf16")
    assert dtype_of(out16, "fused") == BF16
    assert casts(out16) == ["x/CastToBf16"]
    assert rep16.summary["low_dtype"] == "bfloat16"


def test_keep_dtype_scope_and_name_overrides():
    def before():
        x = ph("x")
        with npu_amp_tf.keep_dtype_scope():
            k = tf.matmul(x, cst("w"), name="kept")
        n = tf.matmul(k, cst("w2"), name="named")
        s = tf.nn.softmax(n, name="sm")
        tf.identity(tf.matmul(s, cst("w3"), name="mm3"), name="y")

    gd = build(before)
    node = [n for n in gd.node if n.name == "kept"][0]
    assert node.attr["_keep_dtype"].i == 1
    out, rep = precision(gd, fetches=["y"], keep_dtype_nodes=["named"], low_precision_nodes=["sm"])
    assert dtype_of(out, "kept") == F32 and rep.decisions["kept"]["list"] == "keep_dtype"
    assert dtype_of(out, "named") == F32
    assert dtype_of(out, "sm") == F16            # black, but forced by name
    assert dtype_of(out, "mm3") == F16
    assert rep.decisions["sm"]["reason"].startswith("low_precision_nodes")
    # "mm" is an exact name (matches nothing here); "blk/" is a prefix
    out2, _ = precision(gd, fetches=["y"], keep_dtype_nodes=["mm"])
    assert dtype_of(out2, "mm3") == F16

    def scoped():
        x = ph("x")
        with tf.name_scope("blk"):
            a = tf.matmul(x, cst("w"), name="a")
            b = tf.matmul(a, cst("w2"), name="b")
        tf.identity(tf.matmul(b, cst("w3"), name="c"), name="y")

    out3, rep3 = precision(build(scoped), fetches=["y"], keep_dtype_nodes=["blk/"])
    assert [dtype_of(out3, n) for n in ("blk/a", "blk/b", "c")] == [F32, F32, F16]
    assert rep3.decisions["blk/a"]["list"] == "keep_dtype"


def test_custom_lists_and_mixlist(tmp_path):
    def before():
        mm = tf.matmul(ph("x"), cst("w"), name="mm")
        r = tf.nn.relu(mm, name="r")
        tf.identity(tf.tanh(r, name="t"), name="y")

    gd = build(before)
    out, _ = precision(gd, fetches=["y"])
    assert [dtype_of(out, n) for n in ("mm", "r", "t")] == [F16, F16, F16]
    out, rep = precision(gd, fetches=["y"], custom_black_list=["Tanh"])
    assert [dtype_of(out, n) for n in ("mm", "r", "t")] == [F16, F16, F32]
    assert "custom_black_list" in rep.decisions["t"]["reason"]
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"white-list": {"to-remove": ["MatMul"]}}))
    out, rep = precision(gd, fetches=["y"], modify_mixlist=str(mix))
    assert out == gd                      # CANN: removed from white -> gray -> follows x (FP32)
    assert rep.decisions["mm"]["reason"].startswith("gray: followed producer 'x'")


def test_variables_stay_fp32_and_reads_are_cast_once():
    def before():
        x = ph("x")
        w = v1.get_variable("w", [2, 2])
        a = tf.matmul(x, w, name="a")
        loss = tf.reduce_sum(tf.matmul(a, w, name="b"), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")

    out, rep = precision(build(before), fetches=["loss", "train"])
    byname = {n.name: n for n in out.node}
    assert byname["w"].attr["dtype"].type == F32
    reads = [n for n in out.node if n.op == "ReadVariableOp"]
    assert all(n.attr["dtype"].type == F32 for n in reads)
    upd = [n for n in out.node if n.op == "ResourceApplyGradientDescent"][0]
    assert upd.attr["T"].type == F32
    grad_src = byname[upd.input[2]]
    assert grad_src.op == "Cast" and grad_src.attr["DstT"].type == F32
    mm = [n for n in out.node if n.op == "MatMul"]
    assert len(mm) == 6 and all(n.attr["T"].type == F16 for n in mm)
    # every ReadVariableOp -> FP16 tensor exists once
    keys = [(n.input[0], n.attr["DstT"].type) for n in out.node if n.op == "Cast"]
    assert len(keys) == len(set(keys))


# ------------------------------------------------------------------ modes
def _mode_graph():
    x = ph("x")
    mm = tf.matmul(x, cst("w"), name="mm")
    ba = tf.nn.bias_add(mm, tf.constant([0.1, 0.2], name="bias"), name="ba")
    sm = tf.nn.softmax(ba, name="sm")
    tf.identity(sm, name="y")


@pytest.mark.parametrize("params,expect", [
    ({}, {"mm": F16, "ba": F16, "sm": F32}),
    ({"precision_mode": "allow_mix_precision_fp16"}, {"mm": F16, "ba": F16, "sm": F32}),
    ({"precision_mode_v2": "mixed_float16"}, {"mm": F16, "ba": F16, "sm": F32}),
    # BF16: Softmax is black for FP16's range only, so it follows its producers (lists.BF16_GRAY)
    ({"precision_mode": "allow_mix_precision_bf16"}, {"mm": BF16, "ba": BF16, "sm": BF16}),
    ({"precision_mode_v2": "mixed_bfloat16"}, {"mm": BF16, "ba": BF16, "sm": BF16}),
    ({"precision_mode": "force_fp16"}, {"mm": F16, "ba": F16, "sm": F16}),
    ({"precision_mode_v2": "fp16"}, {"mm": F16, "ba": F16, "sm": F16}),
    ({"precision_mode": "cube_fp16in_fp32out"}, {"mm": F16, "ba": F32, "sm": F32}),
    ({"precision_mode_v2": "cube_fp16in_fp32out"}, {"mm": F16, "ba": F32, "sm": F32}),
    ({"precision_mode": "allow_fp32_to_fp16"}, {"mm": F32, "ba": F32, "sm": F32}),
    ({"precision_mode": "force_fp32"}, {"mm": F32, "ba": F32, "sm": F32}),
])
def test_modes(params, expect):
    gd = build(_mode_graph)
    out, rep = precision(gd, fetches=["y"], **params)
    assert {n: dtype_of(out, n) for n in expect} == expect
    if params.get("precision_mode", "").startswith("cube") or params.get("precision_mode_v2", "").startswith("cube"):
        assert casts(out) == ["mm/CastToFp32", "x/CastToFp16"]
    x = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
    a, b = run_graph(gd, "y:0", {"x:0": x}), run_graph(out, "y:0", {"x:0": x})
    np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-3)


def test_force_fp32_raises_an_fp16_graph():
    def before():
        x = ph("x", dtype=tf.float16)
        mm = tf.matmul(x, cst("w", dtype=tf.float16), name="mm")
        tf.nn.relu(mm, name="r")
        tf.cast(tf.nn.relu(mm), tf.float32, name="y")

    gd = build(before)
    out, rep = precision(gd, fetches=["y"], precision_mode="force_fp32")
    assert dtype_of(out, "mm") == F32 and dtype_of(out, "r") == F32
    assert dtype_of(out, "w", "dtype") == F32       # const raised in place
    assert casts(out) == ["x/CastToFp32", "y"]
    assert dtype_of(out, "y", "SrcT") == F32         # the user's cast follows its producer


# ----------------------------------------------------------------- errors
def test_bad_mode_error_names_key_value_and_choices():
    with pytest.raises(OptionError) as e:
        npu_amp_tf.rewrite_graph(build(_mode_graph), precision_mode="allow_mixed")
    msg = str(e.value)
    assert "precision_mode='allow_mixed'" in msg
    for m in ("allow_mix_precision", "force_fp16", "must_keep_origin_dtype", "cube_fp16in_fp32out",
              "allow_fp32_to_fp16", "force_fp32", "allow_mix_precision_bf16"):
        assert m in msg
    with pytest.raises(OptionError, match="precision_mode and precision_mode_v2 are both set"):
        npu_amp_tf.rewrite_graph(build(_mode_graph), precision_mode="force_fp16", precision_mode_v2="fp16")
    with pytest.raises(OptionError, match="precision_mode_v2='fp8'.*'mixed_bfloat16'"):
        npu_amp_tf.rewrite_graph(build(_mode_graph), precision_mode_v2="fp8")


def test_bad_mixlist_file_errors(tmp_path):
    bad_key = tmp_path / "bad_key.json"
    bad_key.write_text(json.dumps({"white-list": {"to-add": ["Tanh"]}, "grey-list": {"to-add": ["Relu"]}}))
    with pytest.raises(MixlistError) as e:
        npu_amp_tf.rewrite_graph(build(_mode_graph), modify_mixlist=str(bad_key))
    assert str(bad_key) in str(e.value) and "'grey-list'" in str(e.value)
    assert "black-list, white-list, gray-list" in str(e.value)
    bad_action = tmp_path / "bad_action.json"
    bad_action.write_text(json.dumps({"black-list": {"add": ["Tanh"]}}))
    with pytest.raises(MixlistError, match=r"unknown key 'black-list.add'; accepted: to-add, to-remove"):
        npu_amp_tf.rewrite_graph(build(_mode_graph), modify_mixlist=str(bad_action))
    not_json = tmp_path / "nj.json"
    not_json.write_text("{white-list: }")
    with pytest.raises(MixlistError, match="is not valid JSON"):
        npu_amp_tf.rewrite_graph(build(_mode_graph), modify_mixlist=str(not_json))
    with pytest.raises(MixlistError, match="cannot be read"):
        npu_amp_tf.rewrite_graph(build(_mode_graph), modify_mixlist=str(tmp_path / "missing.json"))


def test_op_in_two_lists_errors(tmp_path):
    mix = tmp_path / "two.json"
    mix.write_text(json.dumps({"white-list": {"to-add": ["Tanh"]}, "black-list": {"to-add": ["Tanh"]}}))
    with pytest.raises(MixlistError) as e:
        npu_amp_tf.rewrite_graph(build(_mode_graph), modify_mixlist=str(mix))
    assert "op 'Tanh' is put in two lists" in str(e.value) and str(mix) in str(e.value)
    with pytest.raises(MixlistError, match="op 'Relu' is put in two lists: white .custom_white_list. and black"):
        npu_amp_tf.rewrite_graph(build(_mode_graph), custom_white_list=["Relu"], custom_black_list="Relu")


def test_env_override_reaches_the_pass(monkeypatch):
    monkeypatch.setenv("NPU_AMP_PRECISION_MODE", "must_keep_origin_dtype")
    gd = build(_mode_graph)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=["y"], graph_level=0)
    assert rep.summary["precision_mode"] == "must_keep_origin_dtype"
    assert casts(out) == []


# ----------------------------------------------------------------- report
def test_report_summary_keys_and_activation_bytes():
    def before():
        x = ph("x", shape=(4, 8))
        h = tf.nn.relu(tf.matmul(x, cst("w", (8, 8)), name="mm"), name="r")
        tf.nn.softmax(tf.matmul(h, cst("w2", (8, 8)), name="mm2"), name="y")

    out, rep = npu_amp_tf.rewrite_graph(build(before), fetches=["y"], graph_level=0)
    s = rep.summary
    for k in ("lp_flop_share", "casts_inserted", "low_precision_nodes", "float_nodes",
              "activation_bytes_before", "activation_bytes_after"):
        assert k in s, k
    assert s["lp_flop_share"] == 1.0
    assert s["matrix_flops"] == 2 * (2 * 4 * 8 * 8)
    # mm, r, mm2 (4x8 each) halve; one cast (4x8 fp32) is added before softmax,
    # one (4x8 fp16) after x
    assert s["activation_bytes_sum_before"] == 4 * 32 * 4
    assert s["activation_bytes_sum_after"] == 2 * 32 * 3 + 4 * 32 + 4 * 32 + 2 * 32
    # estimated step peak: a chain frees each tensor after its consumer (and Relu writes into mm's buffer),
    # so two [4,8] tensors are live at most: FP32 r+mm2 (2 x 128 B); mixed: the FP32 cast-back + softmax
    assert s["activation_bytes_before"] == 2 * 4 * 32
    assert s["activation_bytes_after"] == 2 * 4 * 32
    assert s["casts_inserted"] == 2
    assert s["low_precision_nodes"] == 3 and s["float_nodes"] == 4
    data = json.loads(rep.dumps())
    assert data["decisions"]["mm"]["dtype"] == "float16"
    assert [p["name"] for p in data["passes"]][-2:] == ["precision", "cleanup"]


def test_graph_from_bytes_roundtrip_identity_for_non_float_graph():
    def before():
        i = ph("i", dtype=tf.int32)
        tf.add(i, i, name="y")

    gd = build(before)
    out, rep = precision(gd, fetches=["y"])
    assert out == gd and rep.summary["float_nodes"] == 0 and rep.summary["lp_flop_share"] is None
    assert Graph(out).validate() == []


def test_keep_fp16_copies_are_read_instead_of_casting_the_master():
    """AMP_Optimizer(keep_fp16_copies=True) keeps `<var>/Fp16Copy`; the rewrite
    reads it instead of casting the FP32 master every step."""
    import npu_amp_tf

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [4], name="y")
        w = tf.compat.v1.get_variable("w", initializer=np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2),
                                      use_resource=True)
        logits = tf.matmul(x, w, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        opt = npu_amp_tf.AMP_Optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5), keep_fp16_copies=True)
        train = opt.minimize(loss).name
        tf.group(tf.compat.v1.global_variables_initializer(), name="init_global")
        tf.group(tf.compat.v1.local_variables_initializer(), name="init_local")  # copies: after the masters
    out, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=["loss", train, "init_global", "init_local"])
    G = Graph(out)
    mm = G.nodes["logits"]
    assert mm.attr["T"].type == types_pb2.DT_HALF
    w_in = G.nodes[parse_tensor(mm.input[1])[0]]
    assert w_in.op == "ReadVariableOp" and w_in.input[0] == "w/Fp16Copy", w_in
    assert rep.summary["fp16_copy_reads"] == 1
    # no Cast reads the master weight any more
    for n in G.nodes.values():
        if n.op == "Cast":
            src = G.nodes[parse_tensor(n.input[0])[0]]
            assert not (src.op == "ReadVariableOp" and src.input[0] == "w"), n.name
    # it trains, and the copy follows the master after each update
    feeds = {"x:0": np.random.RandomState(0).randn(4, 3).astype(np.float32), "y:0": np.array([0, 1, 1, 0])}
    tg = tf.Graph()
    with tg.as_default():
        tf.graph_util.import_graph_def(out, name="")
        with tf.compat.v1.Session(graph=tg) as sess:
            sess.run("init_global")
            sess.run("init_local")
            l0 = sess.run("loss:0", feeds)
            for _ in range(3):
                sess.run(train, feeds)
            l3 = sess.run("loss:0", feeds)
            master_read = next(n.name for n in G.nodes.values()
                               if n.op == "ReadVariableOp" and n.input[0] == "w")
            master, copy = sess.run([master_read + ":0", w_in.name + ":0"])
    assert l3 < l0
    np.testing.assert_array_equal(copy, master.astype(np.float16))
