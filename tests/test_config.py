"""session_config / enable / disable / amp_scope with real TF."""
import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

import npu_amp_tf
from npu_amp_tf import bridge, config as npu_config
from npu_amp_tf.errors import OptionError

RC = rewriter_config_pb2.RewriterConfig
HALF, FLOAT = types_pb2.DT_HALF, types_pb2.DT_FLOAT


@pytest.fixture(autouse=True)
def _clean():
    bridge.clear_reports()
    yield
    npu_amp_tf.disable()


def names(cfg):
    return [c.name for c in cfg.graph_options.rewrite_options.custom_optimizers]


def params_of(cfg, name):
    from npu_amp_tf.options import attr_value_to_python

    for c in cfg.graph_options.rewrite_options.custom_optimizers:
        if c.name == name:
            return {k: attr_value_to_python(v) for k, v in c.parameter_map.items()}
    return None


# ------------------------------------------------------------ session_config
def test_session_config_entry_and_switched_off_passes():
    cfg = npu_amp_tf.session_config(precision_mode="force_fp16", custom_black_list=["Tanh"],
                                    fail_on_error=True)
    assert names(cfg) == ["NpuAmpOptimizer"]
    assert params_of(cfg, "NpuAmpOptimizer") == {
        "precision_mode": "force_fp16", "custom_black_list": ["Tanh"], "fail_on_error": True}
    rw = cfg.graph_options.rewrite_options
    for toggle in ("auto_mixed_precision", "auto_mixed_precision_cpu", "auto_mixed_precision_mkl",
                   "auto_mixed_precision_onednn_bfloat16", "remapping"):
        assert getattr(rw, toggle) == RC.OFF, toggle
    for toggle in npu_config.DISABLED_TOGGLES:  # the docstring names each one
        assert toggle in npu_amp_tf.session_config.__doc__


def test_session_config_keeps_base_and_replaces_its_entry():
    base = config_pb2.ConfigProto(intra_op_parallelism_threads=3, allow_soft_placement=True)
    base.graph_options.rewrite_options.constant_folding = RC.OFF
    base.graph_options.rewrite_options.disable_meta_optimizer = True
    other = base.graph_options.rewrite_options.custom_optimizers.add()
    other.name = "SomeoneElse"
    cfg1 = npu_amp_tf.session_config(base, precision_mode="allow_mix_precision")
    cfg2 = npu_amp_tf.session_config(cfg1, precision_mode="must_keep_origin_dtype")
    assert names(cfg2) == ["SomeoneElse", "NpuAmpOptimizer"]  # replaced, not duplicated
    assert params_of(cfg2, "NpuAmpOptimizer") == {"precision_mode": "must_keep_origin_dtype"}
    assert cfg2.intra_op_parallelism_threads == 3 and cfg2.allow_soft_placement
    assert cfg2.graph_options.rewrite_options.constant_folding == RC.OFF
    assert cfg2.graph_options.rewrite_options.disable_meta_optimizer is False
    # the base is not modified
    assert names(base) == ["SomeoneElse"] and base.graph_options.rewrite_options.remapping == RC.DEFAULT


def test_session_config_bad_values_raise_with_accepted_values():
    with pytest.raises(OptionError) as ei:
        npu_amp_tf.session_config(precision_mode="fp17")
    msg = str(ei.value)
    assert "precision_mode='fp17'" in msg
    for mode in ("allow_mix_precision", "force_fp16", "must_keep_origin_dtype", "cube_fp16in_fp32out"):
        assert repr(mode) in msg
    with pytest.raises(OptionError, match="unknown parameter 'precison_mode'.*accepted keys:.*precision_mode"):
        npu_amp_tf.session_config(precison_mode="force_fp16")
    with pytest.raises(OptionError, match="base must be a tf.compat.v1.ConfigProto"):
        npu_amp_tf.session_config(base={"precision_mode": "force_fp16"})


def test_no_npu_bridge_no_npu_optimizer_entry():
    assert not npu_config.npu_bridge_available()
    assert "NpuOptimizer" not in names(npu_amp_tf.session_config())


def test_npu_bridge_importable_adds_npu_optimizer_after_ours(tmp_path, monkeypatch):
    pkg = tmp_path / "npu_bridge"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("# stand-in for Huawei's package: only its presence matters\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mixlist = tmp_path / "mix.json"
    mixlist.write_text(json.dumps({"black-list": {"to-add": ["Tanh"]}}))
    assert npu_config.npu_bridge_available()

    base = config_pb2.ConfigProto()
    theirs = base.graph_options.rewrite_options.custom_optimizers.add()
    theirs.name = "NpuOptimizer"  # written before ours, with a setting of its own
    theirs.parameter_map["use_off_line"].b = True
    theirs.parameter_map["precision_mode"].s = b"force_fp32"
    cfg = npu_amp_tf.session_config(base, precision_mode="allow_mix_precision_bf16",
                                    modify_mixlist=str(mixlist))
    assert names(cfg) == ["NpuAmpOptimizer", "NpuOptimizer"]
    npu = params_of(cfg, "NpuOptimizer")
    assert npu == {"use_off_line": True, "precision_mode": "allow_mix_precision_bf16",
                   "modify_mixlist": str(mixlist)}
    assert cfg.graph_options.rewrite_options.memory_optimization == RC.NO_MEM_OPT
    v2 = npu_amp_tf.session_config(precision_mode_v2="mixed_float16")
    assert params_of(v2, "NpuOptimizer") == {"precision_mode_v2": "mixed_float16"}


def test_session_config_runs_the_pipeline_in_a_session():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3])
        w = np.random.RandomState(1).uniform(-1, 1, (3, 2)).astype(np.float32)
        y = tf.nn.softmax(tf.matmul(x, tf.constant(w)), name="y")
    xv = np.random.RandomState(2).uniform(-1, 1, (2, 3)).astype(np.float32)
    with tf.compat.v1.Session(graph=g, config=npu_amp_tf.session_config()) as s:
        rm = tf.compat.v1.RunMetadata()
        out = s.run(y, {x: xv}, run_metadata=rm,
                    options=tf.compat.v1.RunOptions(output_partition_graphs=True))
    ops = {(n.op, n.attr["T"].type) for pg in rm.partition_graphs for n in pg.node}
    # (TF's oneDNN rewrite, when on, runs it as _MklMatMul)
    assert ({("MatMul", HALF), ("_MklMatMul", HALF)} & ops) and out.dtype == np.float32
    logits = xv.astype(np.float64) @ w
    ref = np.exp(logits - logits.max(axis=1, keepdims=True))
    # 3 FP16 products of |v|<=1: logit error <= 3*2^-11 ~ 1.5e-3
    np.testing.assert_allclose(out, ref / ref.sum(axis=1, keepdims=True), atol=2e-3)


def _mlp_adam_step():
    g = tf.Graph()
    with g.as_default(), tf.compat.v1.variable_scope("", use_resource=True):
        x = tf.compat.v1.placeholder(tf.float32, [64, 32], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [64], name="y")
        rng = np.random.RandomState(3)
        h = x
        for i in range(3):
            w = tf.compat.v1.get_variable(f"w{i}", initializer=rng.uniform(-.3, .3, (32, 32)).astype(np.float32))
            h = tf.nn.relu(tf.matmul(h, w) * 1.5 + 0.1)
        w = tf.compat.v1.get_variable("out", initializer=rng.uniform(-.3, .3, (32, 4)).astype(np.float32))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(h, w)),
                              name="loss")
        train = tf.compat.v1.train.AdamOptimizer(1e-2).minimize(loss, name="train")
        init = tf.compat.v1.global_variables_initializer()
    feed = {"x:0": np.random.RandomState(4).standard_normal((64, 32)).astype(np.float32),
            "y:0": np.arange(64, dtype=np.int32) % 4}
    return g, train, init, loss, feed


def test_memory_optimize_sets_recomputation_and_a_training_step_runs():
    """GE's memory_optimize (the lever benchmarks/memory.py measures as
    '+recompute') sets grappler's memory optimizer on the session, and a
    training step runs under it: grappler recomputes forward ops for the
    backward pass ('Recomputed/...' nodes), the losses equal those without it."""
    cfg = npu_amp_tf.session_config(precision_mode="allow_mix_precision_bf16", memory_optimize="on")
    assert cfg.graph_options.rewrite_options.memory_optimization == RC.RECOMPUTATION_HEURISTICS
    assert params_of(cfg, "NpuAmpOptimizer")["precision_mode"] == "allow_mix_precision_bf16"
    plain = npu_amp_tf.session_config(precision_mode="allow_mix_precision_bf16")
    assert plain.graph_options.rewrite_options.memory_optimization == RC.DEFAULT_MEM_OPT
    assert npu_amp_tf.session_config(memory_optimize="off").graph_options.rewrite_options \
        .memory_optimization == RC.NO_MEM_OPT
    losses = {}
    for label, c in (("recompute", cfg), ("plain", plain)):
        g, train, init, loss, feed = _mlp_adam_step()
        with tf.compat.v1.Session(graph=g, config=c) as s:
            s.run(init)
            md = tf.compat.v1.RunMetadata()
            vals = [s.run([train, loss], feed, run_metadata=md,
                          options=tf.compat.v1.RunOptions(output_partition_graphs=True))[1] for _ in range(3)]
        nodes = [n for pg in md.partition_graphs for n in pg.node]
        losses[label] = vals
        recomputed = [n.name for n in nodes if n.name.startswith("Recomputed/")]
        assert bool(recomputed) is (label == "recompute"), recomputed[:5]
        assert any(n.op in ("MatMul", "_MklMatMul") and n.attr["T"].type == types_pb2.DT_BFLOAT16 for n in nodes)
    assert np.all(np.isfinite(losses["recompute"])) and losses["recompute"][2] < losses["recompute"][0]
    np.testing.assert_allclose(losses["recompute"], losses["plain"], rtol=1e-5)


# ------------------------------------------------------------ TF2
def function_graph_nodes(fn, *args):
    """Run ``fn`` and return the nodes of the partition graphs that executed."""
    ctx = context.context()
    ctx.enable_run_metadata()
    ctx.export_run_metadata()  # drop function graphs an earlier test left in the context's buffer
    try:
        out = fn(*args)
        md = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return out, [n for fg in md.function_graphs for pg in fg.partition_graphs for n in pg.node]


def matmul_types(nodes):
    # (oneDNN, when on, runs MatMul / _FusedMatMul under its own op names)
    return {n.name: n.attr["T"].type for n in nodes
            if n.op in ("MatMul", "_MklMatMul", "_FusedMatMul", "_MklFusedMatMul", "_MklNativeFusedMatMul")}


def test_enable_reaches_tf_function_and_nested_bodies():
    @tf.function
    def inner(a, b):
        return tf.matmul(a, b)

    @tf.function
    def outer(a, b):
        return tf.nn.softmax(inner(a, b) + 1.0)

    a, b = tf.ones([2, 3]), tf.ones([3, 4])
    _, nodes = function_graph_nodes(outer, a, b)  # not enabled yet: FP32, bridge not called
    assert set(matmul_types(nodes).values()) == {FLOAT}
    assert not bridge.last_reports()

    npu_amp_tf.enable(precision_mode="allow_mix_precision")
    assert npu_config.enabled_params() == {"precision_mode": "allow_mix_precision"}
    opts = config_pb2.ConfigProto.FromString(context.context().function_call_options.config_proto_serialized)
    assert params_of(opts, "NpuAmpOptimizer") == {"precision_mode": "allow_mix_precision"}
    out, nodes = function_graph_nodes(outer, a, b)
    mm = matmul_types(nodes)
    assert mm and set(mm.values()) == {HALF}, mm  # the nested body's MatMul, inlined
    softmax = [n for n in nodes if n.op.endswith("Softmax")]
    assert softmax and all(n.attr["T"].type == FLOAT for n in softmax)
    assert out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), np.full((2, 4), 0.25), atol=1e-3)

    npu_amp_tf.disable()
    assert npu_config.enabled_params() is None
    count = bridge.optimize_count()

    @tf.function
    def after(a, b):
        return tf.matmul(a, b) * 3.0

    _, nodes = function_graph_nodes(after, a, b)
    assert set(matmul_types(nodes).values()) == {FLOAT}
    assert bridge.optimize_count() == count


def test_amp_scope_is_restored_and_nests():
    ctx = context.context()
    before = ctx.function_call_options.config_proto_serialized
    with npu_amp_tf.amp_scope(precision_mode="force_fp16") as o1:
        assert params_of(config_pb2.ConfigProto.FromString(o1.config_proto_serialized),
                         "NpuAmpOptimizer") == {"precision_mode": "force_fp16"}
        with npu_amp_tf.amp_scope(precision_mode="must_keep_origin_dtype"):
            @tf.function
            def f(a):
                return tf.matmul(a, a) - 1.0

            _, nodes = function_graph_nodes(f, tf.ones([2, 2]))
            assert set(matmul_types(nodes).values()) == {FLOAT}  # origin dtype kept
        assert ctx.function_call_options is o1
    assert ctx.function_call_options.config_proto_serialized == before
    with pytest.raises(OptionError, match="precision_mode='half'"):
        with npu_amp_tf.amp_scope(precision_mode="half"):
            pass


def test_keras_fit_with_enable(tmp_path):
    npu_amp_tf.enable(report_path=str(tmp_path / "reports"))
    keras = tf.keras
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                  jit_compile=False)  # XLA-compiled functions bypass grappler
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    y = (np.arange(8) % 2).astype(np.int32)

    hist, nodes = function_graph_nodes(
        lambda: model.fit(x, y, epochs=2, batch_size=4, verbose=0))
    losses = hist.history["loss"]
    assert len(losses) == 2 and all(np.isfinite(losses))
    mm = matmul_types(nodes)
    # forward and backward MatMuls of both Dense layers ran in FP16
    assert len([t for t in mm.values() if t == HALF]) >= 5, mm
    assert all(v.dtype == tf.float32 for v in model.trainable_variables)  # FP32 masters
    train = [r for r in bridge.last_reports() if "train_function" in r["graph"] or
             "multi_step_on_iterator" in r["graph"]]
    assert any(r["status"] == "rewritten" for r in train), [r["graph"] for r in bridge.last_reports()]
    written = list((tmp_path / "reports").glob("*.json"))
    assert written and all(json.loads(p.read_text())["passes"] for p in written)
