"""One source of truth for the precision rules (issue 13, part 4): the
planner (graph_passes/precision/planner.py) that fusion and unfuse ask is the
one the precision pass paints with; cleanup removes only pipeline-made nodes;
the bridge cache sees an edited mixlist; a second grappler meta-optimizer
iteration adds no cast.  Real ``Options`` objects throughout."""
import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2

import amp_peers as P
import npu_amp_tf
from graph_passes import registry
from graph_passes.precision.planner import Plan
from npu_amp_tf.options import Options

v1 = tf.compat.v1
F16, F32 = types_pb2.DT_HALF, types_pb2.DT_FLOAT
MODES = ["allow_mix_precision", "allow_mix_precision_bf16", "force_fp16", "allow_fp32_to_fp16",
         "force_fp32", "must_keep_origin_dtype", "cube_fp16in_fp32out"]


def _mlp():
    rng = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        w = tf.constant(rng.randn(8, 16).astype(np.float32), name="w")
        b = tf.constant(rng.randn(16).astype(np.float32), name="b")
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w, name="mm"), b), name="act")
        tf.identity(tf.reduce_sum(h), name="y")
    return g.as_graph_def()


@pytest.mark.parametrize("mode", MODES)
def test_fusion_and_precision_agree_on_the_matmul_dtype(mode):
    gd = _mlp()
    plan = Plan(Options.from_kwargs(_groups=("rewrite",), precision_mode=mode))
    want, why = plan.matrix_dtype("MatMul", "mm", F32)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=["y"], precision_mode=mode, graph_level=2,
                                        fail_on_error=True)
    mats = [n for n in out.node if n.op in ("MatMul", "_FusedMatMul")]
    assert len(mats) == 1
    got = mats[0].attr["T"].type
    assert got == want, (mode, why, mats[0].op)
    # the fused kernel is used exactly when the planned dtype has a CPU kernel
    # (FP32, BF16: yes; FP16: not on TF 2.15 -> left unfused for the precision pass)
    has = registry.has_kernel("_FusedMatMul", "CPU", {"T": want}) and \
        (("_FusedMatMul", "CPU", want) not in registry.BROKEN_KERNELS)
    assert (mats[0].op == "_FusedMatMul") == has, (mode, mats[0].op)


def test_allow_fp32_to_fp16_does_not_split_fused_ops():
    """unfuse asks the planner: allow_fp32_to_fp16 keeps matrix ops FP32, so a
    remapper-fused op must stay fused (no split 'for nothing')."""
    out, _ = npu_amp_tf.rewrite_graph(_mlp(), fetches=["y"], precision_mode="allow_fp32_to_fp16",
                                      graph_level=2)
    fused = [n for n in out.node if n.op == "_FusedMatMul"]
    again, rep = npu_amp_tf.rewrite_graph(out, fetches=["y"], precision_mode="allow_fp32_to_fp16",
                                          graph_level=0)
    assert fused and [n.name for n in again.node if n.op == "_FusedMatMul"] == [n.name for n in fused]
    assert not any(d.get("unfuse") == "split" for d in rep.decisions.values())


def test_cleanup_keeps_user_nodes_named_like_inserted_ones():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 2], name="x")
        y = tf.matmul(x, x, name="y")
        tf.identity(y, name="block/Fused_debug")        # user nodes nobody reads
        tf.cast(y, tf.float16, name="y/CastToFp16")
    out, _ = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=["y"], graph_level=0)
    names = {n.name for n in out.node}
    assert {"block/Fused_debug", "y/CastToFp16"} <= names
    # and the pipeline's own dead casts are still removed: every Cast it made is read
    by_input = {i.split(":")[0] for n in out.node for i in n.input}
    made = [n.name for n in out.node if n.op == "Cast" and n.name not in ("y/CastToFp16",)]
    assert all(m in by_input for m in made)


def test_bridge_cache_keys_on_mixlist_content(tmp_path):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 4], name="x")
        w = tf.constant(np.ones((4, 4), np.float32))
        tf.identity(tf.nn.tanh(tf.matmul(x, w, name="mm"), name="t"), name="y")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"black-list": {"to-add": ["Tanh"]}}))
    a = P.ours_session(g, ["y"], modify_mixlist=str(mix))
    mix.write_text(json.dumps({"black-list": {"to-add": []}}))
    b = P.ours_session(g, ["y"], modify_mixlist=str(mix))
    assert P.dtypes_of(a, "Tanh") == {"t": F32}
    assert P.dtypes_of(b, "Tanh") == {"t": F16}


def test_second_meta_optimizer_iteration_adds_no_cast(k2):
    """Grappler runs the custom optimizer once per meta-optimizer iteration
    (default: two); the second run sees our output and must leave it be."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 8, 8, 3], name="x")
        inp = k2.layers.Input(tensor=x)
        h = k2.layers.Conv2D(4, 3, activation="relu")(inp)
        h = k2.layers.BatchNormalization()(h)
        h = k2.layers.GlobalAveragePooling2D()(h)
        out = k2.layers.Dense(3, activation="softmax")(h)
    from tensorflow.core.protobuf import rewriter_config_pb2 as rc
    one = P.ours_session(g, [out.op.name], iterations=rc.RewriterConfig.ONE)
    two = P.ours_session(g, [out.op.name], iterations=rc.RewriterConfig.TWO)
    assert P.count(one) > 0
    assert P.count(two) == P.count(one)


def test_keras_fit_second_iteration_inserts_no_cast(k2):
    """TF2: enable() + Keras fit/predict.  Grappler calls the optimizer twice
    per function; between the calls its arithmetic optimizer moves Casts in
    front of Reshapes.  The second call must insert no cast."""
    npu_amp_tf.bridge.clear_reports()
    seen0 = npu_amp_tf.bridge.stats().get("skipped_seen", 0)
    npu_amp_tf.enable()
    try:
        L = k2.layers
        inp = L.Input((8, 8, 3))
        h = L.BatchNormalization()(L.Conv2D(4, 3, activation="relu")(inp))
        out = L.Dense(3, activation="softmax")(L.GlobalAveragePooling2D()(h))
        m = k2.Model(inp, out)
        m.compile("sgd", "sparse_categorical_crossentropy")
        x = np.random.RandomState(0).rand(4, 8, 8, 3).astype("float32")
        m.predict(x, verbose=0)
        m.fit(x, np.array([0, 1, 2, 0]), verbose=0, epochs=1)
    finally:
        npu_amp_tf.disable()
    calls = {}
    for r in npu_amp_tf.bridge.last_reports():
        if "predict_function" in r["graph"] or "train_function" in r["graph"]:
            calls.setdefault(r["graph"], []).append(r)
    assert len(calls) == 2, list(calls)
    seen = npu_amp_tf.bridge.stats().get("skipped_seen", 0) - seen0
    for name, rs in calls.items():
        assert rs[0]["status"] == "rewritten", (name, [r["status"] for r in rs])
        if len(rs) == 1:
            # the second iteration was answered in C++ from our output's mark:
            # the pipeline did not run again, so it inserted nothing
            assert seen >= 1, (name, npu_amp_tf.bridge.stats())
        for r in rs[1:]:
            casts = ((r.get("report") or {}).get("summary") or {}).get("casts_inserted", 0)
            assert r["status"] in ("unchanged", "cached") or casts == 0, (name, r["status"], casts)
