"""Issue 18: the plugin never aborts the user's process, BF16 above all.

* golden cases for the OpDef guard (graph_passes/opdef_check.py) and the
  kernel check (registry.has_kernel refuses dtypes the OpDef refuses, and the
  known-broken table);
* the pipeline keeps the ORIGINAL graph, with a warning naming the node, when
  a rewrite breaks an OpDef (offline and through the bridge);
* every precision mode x graph_level 0-3 on a TF-Slim conv net, a Keras CNN
  and a BERT-style block, each kind in ONE subprocess (tests/_combo_worker.py)
  so an abort inside TF fails the test and names the combo; the executed
  graph's conv/matmul dtypes and the loss vs plain TF FP32 are checked.

Tolerances (relative, on an MSE loss of O(1) over 3-6 layers):
* BF16 keeps 8 significant bits: unit roundoff 2**-9 = 0.2%.  Each product
  rounds both operands (<= 0.4%); oneDNN accumulates in FP32; through ~3
  matrix layers and a square (doubling the relative error) the worst case is
  ~2.4%, so 2.5e-2.  grappler's own oneDNN BF16 AMP must meet the same bound.
* FP16 keeps 11 bits: 2**-11 = 0.05%, the same argument gives ~0.6%: 6e-3.
* FP32 modes: only fusion reorders sums: 1e-4.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

import npu_amp_tf
from graph_passes import opdef_check, registry
from graph_passes.errors import PassError
from graph_passes.fusion import core as fusion_core
from graph_passes.pattern import Pat

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BF16, F16, F32 = types_pb2.DT_BFLOAT16, types_pb2.DT_HALF, types_pb2.DT_FLOAT
TF_MINOR = tuple(int(p) for p in tf.__version__.split(".")[:2])

RTOL = {"bf16": 2.5e-2, "fp16": 6e-3, "fp32": 1e-4}
MODE_KIND = {"must_keep_origin_dtype": "fp32", "force_fp32": "fp32", "allow_fp32_to_fp16": "fp16",
             "allow_mix_precision_bf16": "bf16", "allow_mix_precision": "fp16", "force_fp16": "fp16",
             "cube_fp16in_fp32out": "fp16", "grappler_onednn_bf16": "bf16", "plain_tf": "fp32"}
#: the dtype the executed convs/matmuls must have (modes with a crisp answer)
EXPECT_DTYPE = {"must_keep_origin_dtype": "float32", "force_fp32": "float32",
                "allow_mix_precision_bf16": "bfloat16", "allow_mix_precision": "float16",
                "force_fp16": "float16", "grappler_onednn_bf16": "bfloat16"}


# ---------------------------------------------------------------- golden: registry + guard
def _node(op, name, inputs=(), **attrs):
    n = node_def_pb2.NodeDef(op=op, name=name)
    n.input.extend(inputs)
    for k, v in attrs.items():
        if isinstance(v, tuple) and v[0] == "types":
            n.attr[k].list.type.extend(v[1])
        elif isinstance(v, tuple) and v[0] == "s":
            n.attr[k].list.s.extend(v[1])
        elif k in ("T", "dtype", "SrcT", "DstT"):
            n.attr[k].type = v
        elif isinstance(v, bytes):
            n.attr[k].s = v
        elif isinstance(v, int):
            n.attr[k].i = v
        elif isinstance(v, list):
            n.attr[k].list.i.extend(v)
    return n


def _placeholder(name, dt):
    n = _node("Placeholder", name, dtype=dt)
    return n


def _fused_conv(T, targs, bias_dt):
    gd = graph_pb2.GraphDef()
    gd.node.extend([_placeholder("x", T), _placeholder("w", T), _placeholder("b", bias_dt),
                    _node("_FusedConv2D", "conv", ["x", "w", "b"], T=T, TArgs=("types", targs),
                          num_args=1, strides=[1, 1, 1, 1], padding=b"SAME",
                          fused_ops=("s", [b"BiasAdd"]))])
    return gd


def test_has_kernel_refuses_dtypes_the_opdef_refuses():
    # TF registers a CPU bfloat16 kernel for _FusedConv2D, but its OpDef allows
    # T in {half, float, double, int8, qint8}: the kernel check must say no.
    assert any(dev == "CPU" and not label and BF16 in cons.get("T", ())
               for dev, label, cons in registry._kernels("_FusedConv2D"))
    assert not registry.opdef_allows("_FusedConv2D", {"T": BF16})
    assert not registry.has_kernel("_FusedConv2D", "CPU", {"T": BF16})
    assert registry.has_kernel("_FusedConv2D", "CPU", {"T": F32})
    assert registry.opdef_allows("_FusedMatMul", {"T": BF16})


def test_every_known_broken_combination_is_refused():
    assert registry.BROKEN_KERNELS, "the table is empty"
    for (op, dev, dt), why in registry.BROKEN_KERNELS.items():
        assert why, (op, dev, dt)
        assert not registry.has_kernel(op, dev, {"T": dt}), (op, dev, dt)


def test_fused_args_follow_the_op_dtype():
    gd = _fused_conv(F32, [F32], F32)
    node = gd.node[3]
    registry.retype(node, ["T"], BF16)
    assert node.attr["T"].type == BF16 and list(node.attr["TArgs"].list.type) == [BF16]
    registry.retype(node, ["T"], F32)
    assert list(node.attr["TArgs"].list.type) == [F32]


def test_guard_names_the_abort_case():
    # the graph that aborted TF: T=bfloat16 with a float fused bias
    probs = opdef_check.graph_problems(_fused_conv(BF16, [F32], F32))
    text = "\n".join(probs)
    assert "attr T=bfloat16 is not allowed by its OpDef" in text
    assert "known-broken" in text
    # a consistent FP32 fused conv is clean; a TArgs/bias mismatch is an edge problem
    assert opdef_check.graph_problems(_fused_conv(F32, [F32], F32)) == []
    mismatch = opdef_check.graph_problems(_fused_conv(F32, [BF16], F32))
    assert any("'b' -> 'conv':2 carries float32 but _FusedConv2D expects bfloat16" in p for p in mismatch), mismatch


def test_guard_checks_attrs_and_arity():
    gd = graph_pb2.GraphDef()
    gd.node.extend([_placeholder("x", F32), _placeholder("y", F32),
                    _node("AddV2", "no_t", ["x", "y"]),                       # required attr missing
                    _node("Relu", "extra", ["x"], T=F32, bogus=3),            # attr not in the OpDef
                    _node("MatMul", "arity", ["x"], T=F32)])                  # one input short
    text = "\n".join(opdef_check.graph_problems(gd))
    assert "node 'no_t' (AddV2) lacks attr 'T'" in text
    assert "node 'extra' (Relu) has attr 'bogus'" in text
    assert "node 'arity' (MatMul) has 1 data inputs, its signature wants 2" in text


def _bad_rule_graph():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        tf.identity(tf.nn.relu(tf.matmul(x, tf.ones([3, 3])), name="act"), name="out")
    return g.as_graph_def()


def test_pipeline_keeps_the_original_graph_when_a_rewrite_breaks_an_opdef():
    def build(m, b):  # a user rule whose node is valid alone but mistyped for its input edge
        b.emit("Relu", m.anchor, [m["x"]], {"T": ("type", types_pb2.DT_DOUBLE)})

    fusion_core.register_fusion_rule("test_i18_bad", Pat("Relu", inputs=[Pat.any("x")]), build,
                                     graph_level=2)
    try:
        gd = _bad_rule_graph()
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=["out"], precision_mode="allow_mix_precision_bf16",
                                            graph_level=2)
        assert out == gd  # the original, not a partial rewrite
        warn = [w for w in rep.warnings if w["pass"] == "opdef_check"]
        assert warn and warn[0]["node"] in ("act", "out"), rep.warnings  # the mistyped node or its reader
        assert "-> 'act':0 carries" in warn[0]["message"] and "expects float64" in warn[0]["message"]
        assert "left unchanged" in warn[0]["message"]
        assert rep.summary["failed_pass"] == "opdef_check"
        with pytest.raises(PassError, match="opdef_check"):
            npu_amp_tf.rewrite_graph(gd, fetches=["out"], graph_level=2, fail_on_error=True)
    finally:
        fusion_core.unregister_fusion_rule("test_i18_bad")


def test_fusion_refuses_an_emitted_node_that_breaks_its_opdef():
    def build(m, b):  # carries an attr Relu does not have: TF would reject the graph
        b.emit("Relu", m.anchor, [m["x"]], {"T": ("type", F32), "not_an_attr": 1})

    fusion_core.register_fusion_rule("test_i18_attr", Pat("Relu", inputs=[Pat.any("x")]), build,
                                     graph_level=2)
    try:
        gd = _bad_rule_graph()
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=["out"], precision_mode="must_keep_origin_dtype",
                                            graph_level=2)
        assert rep.pass_stats("fusion")["skipped"]["test_i18_attr"] == 1
        assert "has attr 'not_an_attr', which its OpDef does not define" in \
            rep.decisions["act"]["fusion_reason"]
        assert not [w for w in rep.warnings if w["pass"] == "opdef_check"]
    finally:
        fusion_core.unregister_fusion_rule("test_i18_attr")


def test_bf16_rewrite_never_emits_a_known_broken_or_opdef_invalid_node():
    from real_models import import_slim

    slim = import_slim()
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8, 8, 3], name="x")
        n = slim.conv2d(slim.conv2d(x, 8, 3), 8, 3)
        out = slim.fully_connected(slim.flatten(n), 4, activation_fn=None)
        loss = tf.reduce_mean(tf.square(out), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    gd = g.as_graph_def()
    for level in (2, 3):
        new, rep = npu_amp_tf.rewrite_graph(gd, fetches=["loss", "train"],
                                            precision_mode="allow_mix_precision_bf16", graph_level=level)
        assert not [w for w in rep.warnings if w["pass"] == "opdef_check"]
        assert opdef_check.graph_problems(new) == []
        for n in new.node:
            if "T" in n.attr:
                assert (n.op, "CPU", n.attr["T"].type) not in registry.BROKEN_KERNELS, n
        bf16_mm = [n for n in new.node if n.op in ("MatMul", "_FusedMatMul") and n.attr["T"].type == BF16]
        assert bf16_mm, "the matmuls should run in bfloat16"
        convs = [n for n in new.node if n.op in ("Conv2D", "_FusedConv2D", "_MklNativeFusedConv2D")]
        assert len(convs) == 2 and all(n.attr["T"].type == BF16 for n in convs), convs
        if registry.onednn_enabled():
            # conv+bias+relu fused in the oneDNN form whose OpDef allows BF16, args in BF16 too
            for n in convs:
                assert n.op == "_MklNativeFusedConv2D" and n.attr["_kernel"].s == b"MklNameChangeOp", n
                assert list(n.attr["TArgs"].list.type) == [BF16]
                assert list(n.attr["fused_ops"].list.s) == [b"BiasAdd", b"Relu"]
        else:  # no OpDef-valid BF16 fused conv: stays unfused, still BF16
            assert all(n.op == "Conv2D" for n in convs)


# ---------------------------------------------------------------- subprocess matrix
def _run_worker(kind, extra_env=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_combo_worker.py"), kind],
                          capture_output=True, text=True, env=env, timeout=timeout)
    combos = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("COMBO ")]
    results = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or "DONE" not in proc.stdout:
        last = combos[-1] if combos else "(before the first combo)"
        tail = (proc.stderr or "")[-3000:]
        pytest.fail(f"the {kind} worker died (rc={proc.returncode}) during combo '{last}':\n{tail}")
    return results


def _check(results, kind, levels=(0, 1, 2, 3), modes=None):
    by = {(r["mode"], r["level"]): r for r in results}
    ref = by[("plain_tf", -1)]
    problems = []
    for (mode, level), r in sorted(by.items(), key=str):
        where = f"{kind} {mode} level {level}"
        if r["opdef_warnings"]:
            problems.append(f"{where}: the OpDef guard had to reject our rewrite: {r['opdef_warnings']}")
        want = EXPECT_DTYPE.get(mode)
        if want:
            for what in ("conv", "matmul"):
                if r[what] and r[what] != [want]:
                    problems.append(f"{where}: executed {what} dtypes {r[what]}, expected [{want}]")
            if not r["matmul"]:
                problems.append(f"{where}: no matmul found in the executed graph")
        tol = RTOL[MODE_KIND[mode]] if level != 3 or MODE_KIND[mode] != "fp32" else RTOL["fp32"]
        for key in ("loss", "loss_after", "eval"):
            if key in r:
                got, exp = r[key], ref[key]
                if not np.isfinite(got) or abs(got - exp) > tol * abs(exp):
                    problems.append(f"{where}: {key} {got} vs FP32 {exp} (rtol {tol})")
    assert not problems, "\n".join(problems)
    for mode in modes or EXPECT_DTYPE:
        if mode != "grappler_onednn_bf16":
            assert all((mode, lv) in by for lv in levels), f"{kind}: {mode} did not run at every level"


@pytest.fixture(scope="module")
def matrix():
    """All three kinds in one subprocess (one TF start-up), results by kind."""
    results = _run_worker("slim,keras,transformer")
    return {k: [r for r in results if r["kind"] == k] for k in ("slim", "keras", "transformer")}


@pytest.mark.parametrize("kind", ["slim", "keras", "transformer"])
def test_every_mode_and_level_runs(matrix, kind):
    results = matrix[kind]
    _check(results, kind)
    if kind != "keras":  # the session graphs: the grappler peer ran and met the BF16 bound too
        assert any(r["mode"] == "grappler_onednn_bf16" for r in results)
    if kind in ("slim", "keras"):
        bf16 = [r for r in results if r["mode"] == "allow_mix_precision_bf16"]
        assert all(r["conv"] == ["bfloat16"] for r in bf16), bf16  # the conv actually runs in BF16


def test_bf16_with_onednn_off_does_not_abort():
    """TF_ENABLE_ONEDNN_OPTS=0: TF's Eigen kernels.  _FusedConv2D has no valid
    BF16 form, and on TF 2.15 _FusedMatMul BF16 fails at run time; the rewrite
    must avoid both (the table entries installed for this process)."""
    results = _run_worker("slim,keras", {"TF_ENABLE_ONEDNN_OPTS": "0",
                                          "COMBO_MODES": "allow_mix_precision_bf16", "COMBO_NO_PEERS": "1"})
    for kind in ("slim", "keras"):
        _check([r for r in results if r["kind"] == kind], kind, modes=["allow_mix_precision_bf16"])
