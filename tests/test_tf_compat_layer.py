"""The TF-compat layer: every TensorFlow / Keras internal the plugin uses is
reached through graph_passes/_tf.py (engine) or npu_amp_tf/_tf.py (API).

Each shim is exercised here on the installed TensorFlow with an oracle that
fails if the internal stopped doing its job, and a lint test fails when any
other module reaches into TF's internals itself."""
import ast
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, types_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2

import npu_amp_tf
from graph_passes import _tf as gtf
from graph_passes.errors import NpuAmpError
from npu_amp_tf import _tf as atf
from npu_amp_tf.errors import TFCompatError

from conftest import TF_VERSION, TWO_CPUS, keras2

ROOT = pathlib.Path(__file__).resolve().parents[1]
v1 = tf.compat.v1


# --------------------------------------------------------------------------- errors
def test_missing_module_raises_one_clear_error():
    with pytest.raises(TFCompatError) as ei:
        gtf.require_module("tensorflow.python.no_such_module_xyz")
    msg = str(ei.value)
    assert tf.__version__ in msg and "tensorflow.python.no_such_module_xyz" in msg
    assert "2.15.1" in msg and "2.21.0" in msg
    assert isinstance(ei.value, NpuAmpError)
    assert atf.TFCompatError is TFCompatError is gtf.TFCompatError


def test_missing_attribute_raises_one_clear_error():
    with pytest.raises(TFCompatError, match=r"'Graph\._no_such_scope'") as ei:
        gtf.require_attr(tf.Graph(), "_no_such_scope")
    assert isinstance(atf.require_attr(tf.Graph(), "_attr_scope"), object)
    with pytest.raises(TFCompatError, match="no_such_probe"):
        atf.require_module("tensorflow.python.no_such_probe")
    assert "public alternative: x" in str(atf.compat_error("'y'", None, "x"))
    assert tf.__version__ in str(ei.value)

    class NoConfig:
        pass
    assert not atf.has_context_config(NoConfig())
    with pytest.raises(TFCompatError, match="Context._config"):
        atf.set_context_config(NoConfig(), config_pb2.ConfigProto())


def test_an_error_inside_the_internal_is_not_disguised():
    # only the lookup is guarded: an AttributeError raised by TF's own code
    # (here: no distribution strategy given) propagates as it is
    with tf.Graph().as_default():
        v = tf.Variable([1.0])
        opt = v1.train.GradientDescentOptimizer(0.1)
        with pytest.raises(AttributeError) as ei:
            atf.distributed_apply(opt, None, [(tf.constant([1.0]), v)])
    assert not isinstance(ei.value, TFCompatError)


# --------------------------------------------------------------------------- engine side
def test_op_def():
    od = gtf.op_def("MatMul")
    assert od.name == "MatMul"
    assert [a.name for a in od.input_arg] == ["a", "b"]
    assert {a.name for a in od.attr} >= {"T", "transpose_a", "transpose_b"}
    assert gtf.op_def("NoSuchOpType_npu_amp") is None


def test_registered_kernels():
    kl = gtf.registered_kernels("MatMul")
    cpu_float = [k for k in kl.kernel if k.device_type == "CPU"
                 and any(c.name == "T" and types_pb2.DT_FLOAT in c.allowed_values.list.type
                         for c in k.constraint)]
    assert cpu_float, "MatMul has a float32 CPU kernel in every TF"
    assert not gtf.registered_kernels("NoSuchOpType_npu_amp").kernel


def _documented_onednn_rule(env):
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and env.strip().lower() not in ("0", "false"))


def test_onednn_probe_follows_the_environment_switch():
    env = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1")
    assert gtf.onednn_enabled() is _documented_onednn_rule(env)
    # the opposite setting needs a fresh process (TF reads it once)
    other = "0" if _documented_onednn_rule(env) else "1"
    out = subprocess.run(
        [sys.executable, "-c", "from graph_passes import _tf; print(_tf.onednn_enabled())"],
        env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": other, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(_documented_onednn_rule(other))


def _matmul_graph():
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.ones((2, 3), np.float32), name="x")
        w = tf.constant(np.ones((3, 4), np.float32), name="w")
        tf.matmul(x, w, name="y")
        tf.add(tf.constant(2.0, name="c1"), tf.constant(3.0, name="c2"), name="s")
    return g.as_graph_def()


def test_grappler_op_properties():
    from tensorflow.core.grappler.costs import op_performance_data_pb2

    mg = meta_graph_pb2.MetaGraphDef()
    mg.graph_def.CopyFrom(_matmul_graph())
    mg.collection_def["train_op"].node_list.value.append("y")
    props = gtf.grappler_op_properties(mg.SerializeToString())
    tp = op_performance_data_pb2.OpInfo.TensorProperties()
    tp.ParseFromString(props["y"][0])
    assert tp.dtype == types_pb2.DT_FLOAT
    assert [d.size for d in tp.shape.dim] == [2, 4]


def test_optimize_graph_runs_grappler():
    mg = meta_graph_pb2.MetaGraphDef()
    mg.graph_def.CopyFrom(_matmul_graph())
    for n in ("y", "s"):
        mg.collection_def["train_op"].node_list.value.append(n)
    cfg = config_pb2.ConfigProto()
    ro = cfg.graph_options.rewrite_options
    ro.optimizers.extend(["constfold"])
    ro.min_graph_nodes = -1
    out = gtf.optimize_graph(cfg, mg, graph_id=b"compat_test")
    nodes = {n.name: n for n in out.node}
    assert nodes["s"].op == "Const"  # 2 + 3 folded
    assert float(tf.make_ndarray(nodes["s"].attr["value"].tensor)) == 5.0
    assert nodes["y"].op == "Const"  # ones(2,3) @ ones(3,4) folded too
    np.testing.assert_array_equal(tf.make_ndarray(nodes["y"].attr["value"].tensor), np.full((2, 4), 3.0))
    assert atf.optimize_graph is gtf.optimize_graph


# --------------------------------------------------------------------------- eager context
def test_context_config_round_trip_reaches_function_calls():
    ctx = atf.eager_context()
    assert ctx is atf.eager_context()
    assert atf.has_context_config(ctx)
    saved = atf.context_config(ctx)
    new = config_pb2.ConfigProto()
    if saved is not None:
        new.CopyFrom(saved)
    new.graph_options.rewrite_options.custom_optimizers.add().name = "CompatProbe"
    try:
        atf.set_context_config(ctx, new)
        assert atf.context_config(ctx) is new
        ctx.function_call_options = None  # re-derived from the context config
        cp = config_pb2.ConfigProto()
        cp.ParseFromString(ctx.function_call_options.config_proto_serialized)
        assert [c.name for c in cp.graph_options.rewrite_options.custom_optimizers] == ["CompatProbe"]
    finally:
        atf.set_context_config(ctx, saved)
        ctx.function_call_options = None
    cp = config_pb2.ConfigProto()
    cp.ParseFromString(ctx.function_call_options.config_proto_serialized)
    assert not cp.graph_options.rewrite_options.custom_optimizers


def test_function_call_options():
    cp = config_pb2.ConfigProto(inter_op_parallelism_threads=3)
    fco = atf.function_call_options("", cp)
    back = config_pb2.ConfigProto()
    back.ParseFromString(fco.config_proto_serialized)
    assert back.inter_op_parallelism_threads == 3 and fco.executor_type == ""


# --------------------------------------------------------------------------- graph building
def test_attr_scope_in_graph_and_function():
    mark = {"_compat_probe": attr_value_pb2.AttrValue(i=7)}
    g = tf.Graph()
    with g.as_default():
        a = tf.constant(1.0, name="outside")
        with atf.attr_scope(g, mark):
            b = tf.add(a, a, name="inside")
    assert b.op.get_attr("_compat_probe") == 7
    with pytest.raises(ValueError):
        a.op.get_attr("_compat_probe")

    @tf.function
    def f(x):
        with atf.attr_scope(tf.compat.v1.get_default_graph(), mark):
            return tf.square(x, name="sq")

    fg = f.get_concrete_function(tf.TensorSpec([2], tf.float32)).graph
    assert fg.get_operation_by_name("sq").get_attr("_compat_probe") == 7


def test_set_op_attr():
    g = tf.Graph()
    with g.as_default():
        c = tf.constant(1.0, name="c")
    atf.set_op_attr(c.op, "_keep_dtype", attr_value_pb2.AttrValue(i=1))
    gd = g.as_graph_def()
    assert {n.name: n for n in gd.node}["c"].attr["_keep_dtype"].i == 1


def test_has_default_summary_writer(tmp_path):
    assert atf.has_default_summary_writer() is False
    with tf.summary.create_file_writer(str(tmp_path)).as_default():
        assert atf.has_default_summary_writer() is True
    assert atf.has_default_summary_writer() is False


# --------------------------------------------------------------------------- tracking, TF1 optimizer
def _ckpt_keys(tmp_path, name, **objs):
    path = tf.train.Checkpoint(**objs).write(str(tmp_path / name))
    return {k for k, _ in tf.train.list_variables(path)}


def test_track_trackable_adds_a_checkpoint_child(tmp_path):
    opt = v1.train.GradientDescentOptimizer(0.1)
    extra = tf.Variable(3.0)
    atf.track_trackable(opt, extra, name="compat_child")
    keys = _ckpt_keys(tmp_path, "t", o=opt)
    assert "o/compat_child/.ATTRIBUTES/VARIABLE_VALUE" in keys


def test_delegating_mixin_gives_the_wrapped_optimizers_layout(tmp_path):
    mixin = atf.delegating_trackable_mixin()
    assert issubclass(npu_amp_tf.optimizer.TF1AmpOptimizer, mixin)
    v = tf.Variable([1.0, 2.0])
    plain = v1.train.AdamOptimizer(0.1)
    plain.minimize(lambda: tf.reduce_sum(v * v), var_list=[v])
    inner = v1.train.AdamOptimizer(0.1)
    amp = npu_amp_tf.optimizer.TF1AmpOptimizer(inner)
    amp.minimize(lambda: tf.reduce_sum(v * v), var_list=[v])
    k_plain = _ckpt_keys(tmp_path, "plain", o=plain, v=v)
    k_amp = _ckpt_keys(tmp_path, "amp", o=amp, v=v)
    # the wrapper is transparent: the wrapped optimizer's layout plus one child
    extra = {k for k in k_amp - k_plain}
    assert k_plain <= k_amp and extra and all(k.startswith("o/loss_scale_manager/") for k in extra)


def test_create_slots_and_distributed_apply():
    with tf.Graph().as_default():
        v = tf.Variable([1.0, 2.0])
        g = tf.constant([0.5, -1.0])
        mom = v1.train.MomentumOptimizer(0.1, momentum=0.9)
        assert mom.get_slot(v, "momentum") is None
        atf.create_slots(mom, [v])
        assert mom.get_slot(v, "momentum") is not None
        sgd = v1.train.GradientDescentOptimizer(0.1)
        op = atf.distributed_apply(sgd, tf.distribute.get_strategy(), [(g, v)], None, "apply")
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            s.run(op)
            np.testing.assert_allclose(s.run(v), [1.0 - 0.05, 2.0 + 0.1], rtol=1e-6)


def test_create_or_restore_slot_variable_restores_slots(tmp_path):
    calls = []

    class Recording(npu_amp_tf.optimizer.TF1AmpOptimizer):
        def _create_or_restore_slot_variable(self, slot_variable_position, slot_name, variable):
            calls.append(slot_name)
            return super()._create_or_restore_slot_variable(slot_variable_position, slot_name,
                                                            variable)

    v = tf.Variable([1.0, 2.0])
    src = v1.train.AdamOptimizer(0.1)
    src.minimize(lambda: tf.reduce_sum(v * v), var_list=[v])
    saved_m, saved_v = src.get_slot(v, "m").numpy(), src.get_slot(v, "v").numpy()
    assert np.all(saved_m != 0) and np.all(saved_v != 0)
    path = tf.train.Checkpoint(o=src, v=v).write(str(tmp_path / "adam"))

    v2 = tf.Variable([0.0, 0.0])
    amp = Recording(v1.train.AdamOptimizer(0.1))
    assert amp.get_slot(v2, "m") is None
    tf.train.Checkpoint(o=amp, v=v2).read(path).expect_partial()
    # TF asked the wrapper (atf.create_or_restore_slot_variable inside) to create the slots
    assert sorted(calls) == ["m", "v"]
    np.testing.assert_allclose(amp.get_slot(v2, "m").numpy(), saved_m, rtol=1e-6)
    np.testing.assert_allclose(amp.get_slot(v2, "v").numpy(), saved_v, rtol=1e-6)


def test_supported_strategy_extended_types():
    types = atf.supported_strategy_extended_types()
    assert isinstance(tf.distribute.MirroredStrategy(TWO_CPUS).extended, types)
    assert isinstance(tf.distribute.OneDeviceStrategy("/cpu:0").extended, types)
    assert not isinstance(tf.distribute.get_strategy().extended, types)


# --------------------------------------------------------------------------- Keras
requires_keras2 = pytest.mark.skipif(
    keras2() is None, reason=f"Keras 2 (tf_keras) is not installed for TensorFlow {tf.__version__}")


def _keras3():
    import keras
    return keras if int(keras.__version__.split(".")[0]) >= 3 else None


requires_keras3 = pytest.mark.skipif(
    _keras3() is None, reason=f"Keras 3 does not come with TensorFlow {tf.__version__} (Keras 2.15)")


@requires_keras2
def test_keras2_lso_subclass_constructs_its_own_class():
    k = keras2()
    lso = k.mixed_precision.LossScaleOptimizer
    base = k.optimizers.legacy.SGD
    cls = atf.keras2_lso_subclass("CompatProbeLSO", (lso, base),
                                  {"__init__": lambda self: base.__init__(self, 0.5),
                                   "__module__": __name__}, lso)
    obj = cls()
    assert type(obj) is cls and isinstance(obj, lso)
    assert float(obj.get_config()["learning_rate"]) == 0.5
    amp = npu_amp_tf.AMP_Optimizer(k.optimizers.legacy.SGD(0.1))
    assert type(amp).__name__ == "AMP_legacy_SGD" and isinstance(amp, lso)


@requires_keras2
def test_keras2_compute_gradients_and_create_all_weights():
    k = keras2()
    opt = k.optimizers.legacy.Adam(0.1)
    v = tf.Variable([1.0, -3.0])
    tape = tf.GradientTape()
    with tape:
        loss = tf.reduce_sum(v * v)
    gv = atf.keras2_compute_gradients(type(opt), opt, loss, [v], None, tape)
    np.testing.assert_allclose(gv[0][0].numpy(), [2.0, -6.0])
    assert gv[0][1] is v
    assert not opt.weights
    atf.keras2_create_all_weights(opt, [v])
    assert opt.get_slot(v, "m") is not None and opt.get_slot(v, "v") is not None
    assert int(opt.iterations.numpy()) == 0


@requires_keras3
def test_keras3_private_attributes():
    k = _keras3()
    opt = k.optimizers.SGD(0.1)
    v = tf.Variable([1.0, 2.0])
    opt.build([v])
    assert atf.keras3_iterations(opt) is opt.iterations
    tv = atf.keras3_trainable_variables(opt)
    assert len(tv) == 1 and tv[0] is v
    opt.apply([tf.constant([1.0, 1.0])], [v])
    assert int(atf.keras3_iterations(opt).numpy()) == 1


# --------------------------------------------------------------------------- sessions, tools
def test_session_classes():
    base = atf.base_session_class()
    assert issubclass(v1.Session, base) and issubclass(v1.InteractiveSession, base)
    assert atf.session_module().Session is v1.Session


def test_patched_base_session_wraps_and_restores_run():
    base = atf.base_session_class()
    orig = base.run
    calls = []

    def make(o):
        def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
            calls.append(fetches)
            return o(self, fetches, feed_dict, options, run_metadata)
        return run

    with tf.Graph().as_default():
        c = tf.constant(4.0) * 2.0
        with v1.Session() as s:
            with atf.patched_base_session("run", make) as got:
                assert got is orig
                assert s.run(c) == 8.0
            assert s.run(c) == 8.0
    assert calls == [c] and base.run is orig


def _traced_step():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 3], name="x")
        y = tf.matmul(x, tf.ones([3, 2]), name="traced_mm")
    md = v1.RunMetadata()
    with v1.Session(graph=g) as s:
        s.run(y, {x: np.ones((2, 3), np.float32)},
              options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE), run_metadata=md)
    return g, md


def test_step_stats_timeline():
    g, md = _traced_step()
    trace = json.loads(atf.step_stats_timeline(md.step_stats, g).generate_chrome_trace_format())
    names = {ev.get("args", {}).get("name") for ev in trace["traceEvents"]}
    assert "traced_mm" in names


def test_tfdbg_dumps_a_watched_tensor():
    debug_data, debug_utils = atf.tfdbg()
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 3], name="x")
        y = tf.matmul(x, tf.ones([3, 2]), name="watched")
    tmp = tempfile.mkdtemp(prefix="npu_amp_compat_dbg_")
    opts = v1.RunOptions(output_partition_graphs=True)
    debug_utils.add_debug_tensor_watch(opts, "watched", 0, "DebugIdentity", debug_urls=["file://" + tmp])
    md = v1.RunMetadata()
    with v1.Session(graph=g) as s:
        s.run(y, {x: np.arange(6, dtype=np.float32).reshape(2, 3)}, options=opts, run_metadata=md)
    dd = debug_data.DebugDumpDir(tmp, partition_graphs=md.partition_graphs, validate=False)
    data = [d for d in dd.dumped_tensor_data if d.node_name == "watched"]
    assert len(data) == 1
    np.testing.assert_array_equal(data[0].get_tensor(), [[3.0, 3.0], [12.0, 12.0]])


def test_convert_variables_to_constants_v2():
    v = tf.Variable([2.0, 3.0])

    @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
    def f(x):
        return x * v

    frozen = atf.convert_variables_to_constants_v2(f.get_concrete_function())
    ops = {n.op for n in frozen.graph.as_graph_def().node}
    assert "ReadVariableOp" not in ops and "VarHandleOp" not in ops
    v.assign([10.0, 10.0])  # frozen: the old values stay
    np.testing.assert_allclose(frozen(tf.constant([1.0, 1.0]))[0].numpy(), [2.0, 3.0])


# --------------------------------------------------------------------------- lint
#: private TF / Keras attribute names only the two _tf.py modules may touch
PRIVATE_NAMES = frozenset({
    "_config", "_attr_scope", "_set_attr", "_track_trackable", "_create_slots",
    "_distributed_apply", "_create_or_restore_slot_variable", "_get_control_flow_context",
    "_allocator_maximums", "_pywrap_util_port", "_pywrap_tf_item", "_compute_gradients",
    "_create_all_weights", "_iterations", "_trainable_variables", "__internal__", "BaseSession",
})
PRIVATE_MODULES = ("tensorflow.python", "keras.src", "tf_keras.src")
COMPAT_MODULES = {ROOT / "graph_passes" / "_tf.py", ROOT / "npu_amp_tf" / "_tf.py"}


def _violations(path):
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for n in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(n, 'lineno', '?')}"
        if isinstance(n, ast.ImportFrom):
            mods = [n.module or ""]
            mods += [f"{n.module}.{a.name}" for a in n.names]
        elif isinstance(n, ast.Import):
            mods = [a.name for a in n.names]
        else:
            mods = []
        for m in mods:
            if m.startswith(PRIVATE_MODULES) or m.split(".")[-1] in PRIVATE_NAMES:
                out.append(f"{where}: imports {m}")
        if isinstance(n, ast.Attribute) and n.attr in PRIVATE_NAMES:
            out.append(f"{where}: uses .{n.attr}")
        if isinstance(n, ast.Attribute) and n.attr == "__call__" and isinstance(n.value, ast.Name) \
                and n.value.id == "type":
            out.append(f"{where}: metaclass trick type.__call__")
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            if n.value in PRIVATE_NAMES or n.value.startswith(PRIVATE_MODULES):
                out.append(f"{where}: names {n.value!r}")
    return out


def test_lint_only_the_compat_modules_touch_tf_internals():
    files = [p for pkg in ("graph_passes", "npu_amp_tf") for p in sorted((ROOT / pkg).rglob("*.py"))
             if p not in COMPAT_MODULES]
    assert len(files) > 40
    bad = [v for p in files for v in _violations(p)]
    assert not bad, "TF internals outside graph_passes/_tf.py and npu_amp_tf/_tf.py:\n" + "\n".join(bad)


def test_lint_catches_each_kind(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""docstring may mention tensorflow.python freely"""\n'
        "from tensorflow.python.framework import ops\n"
        "import keras.src.layers\n"
        "from tf_keras.src import optimizers\n"
        "x = tf.__internal__.tracking\n"
        "opt._create_slots([])\n"
        "ctx._config = None\n"
        "getattr(ctx, '_config', None)\n"
        "type.__call__(cls)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = _violations(sample)
    finally:
        ROOT = saved
    assert len({f.split(": ")[0] for f in found}) == 8, found  # every line but the docstring
    assert not any(":1:" in f for f in found)


def test_graph_passes_never_imports_npu_amp_tf():
    for p in (ROOT / "graph_passes").rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom):
                assert not (n.module or "").startswith("npu_amp_tf"), p
            if isinstance(n, ast.Import):
                assert not any(a.name.startswith("npu_amp_tf") for a in n.names), p


def test_every_shim_is_exercised_here():
    here = pathlib.Path(__file__).read_text()
    for mod in (gtf, atf):
        for name in mod.__all__:
            if name in ("CHECKED_ON", "TFCompatError", "tf_version",
                        "create_or_restore_slot_variable"):  # through TF1AmpOptimizer's restore
                continue
            assert any(f"{p}.{name}{end}" in here for p in ("gtf", "atf") for end in "( "), \
                f"{mod.__name__}.{name}"
    assert TF_VERSION >= (2, 15)
