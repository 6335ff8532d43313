"""Ascend tf_adapter scripts run unchanged (issue 12): ``npu-amp run`` on
ModelZoo-style scripts (tests/ascend_scripts/), the ``NpuOptimizer`` entry,
GE keys and GE op names, ``npu_amp_tf.compat``.

Every script runs in a subprocess through the real CLI; each mixed run is
compared with the same script in FP32 and the precision map (the report
written through ``--report-path``) must show the expected ops in FP16.
"""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from npu_amp_tf.errors import MixlistError, NpuAmpError, OptionError
from npu_amp_tf.options import Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "ascend_scripts")
HAS_ESTIMATOR = hasattr(tf, "estimator") and hasattr(tf.estimator, "RunConfig")


def _popen(args, env=None):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="2")
    e.pop("NPU_AMP_REPORT_PATH", None)
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e, cwd=ROOT)


class _Done:
    def __init__(self, p):
        out, err = p.communicate(timeout=900)
        self.returncode, self.stdout, self.stderr = p.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every script run of this module, started at once (they are
    independent processes; most of their time is importing TensorFlow)."""
    d = tmp_path_factory.mktemp("compat")
    mix = d / "mix.json"
    mix.write_text(json.dumps({"black-list": {"to-add": ["BatchMatMulV2", "DynamicRNN"]}}))
    bad_mix = d / "bad.json"
    bad_mix.write_text(json.dumps({"black-list": {"to-add": ["SoftmaxV9"]}}))
    fake = d / "site" / "npu_bridge"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    shadow = d / "s.py"
    shadow.write_text("import npu_bridge, sys\nprint('RESULT', '{\"real\": %s}' % "
                      "str(getattr(npu_bridge, 'REAL', False)).lower())\nsys.exit(3)\n")
    R = "npu_amp_tf.run"
    tf1, est = os.path.join(SCRIPTS, "tf1_session_npu.py"), os.path.join(SCRIPTS, "estimator_npu.py")
    keras, plain = os.path.join(SCRIPTS, "keras_npu_device.py"), os.path.join(SCRIPTS, "plain_tf1.py")
    spec = {
        "tf1": ([R, "--report-path", str(d / "tf1"), tf1, "--steps", str(TF1_STEPS)], None),
        "keras": ([R, "--report-path", str(d / "keras"), keras], None),
        "keras_fp32": ([R, keras, "--precision_mode", "must_keep_origin_dtype"], None),
        "plain_fp32": ([R, plain, "3"], None),
        "plain_mix": ([R, "--precision-mode", "allow_mix_precision", "--modify-mixlist", str(mix),
                       "--report-path", str(d / "plain"), plain, "3"], None),
        "plain_tf2": ([R, "--precision-mode", "allow_mix_precision", "--report-path",
                       str(d / "tf2"), os.path.join(SCRIPTS, "plain_tf2.py")], None),
        "hccl": ([R, os.path.join(SCRIPTS, "hccl_two_replicas.py")], None),
        "bad_key": ([R, tf1, "--steps", "1", "--bad-key"], None),
        "shadow": ([R, str(shadow)], {"PYTHONPATH": ROOT + os.pathsep + str(d / "site")}),
        "profile": (["npu_amp_tf.cli", "profile", plain, "--steps", "2", "--out", str(d / "prof"),
                     "--precision-mode", "allow_mix_precision", "--no-progress"], None),
        "bad_mix": ([R, "--modify-mixlist", str(bad_mix), plain], None),
        "missing": ([R, str(d / "nothere.py")], None),
    }
    if HAS_ESTIMATOR:
        spec["est"] = ([R, "--report-path", str(d / "est"), est, "--model_dir", str(d / "m1")], None)
        spec["est_fp32"] = ([R, est, "--model_dir", str(d / "m2"),
                             "--precision_mode", "must_keep_origin_dtype"], None)
    procs = {k: _popen(a, e) for k, (a, e) in spec.items()}
    done = {k: _Done(p) for k, p in procs.items()}
    # the FP32 reference of the TF1 run applies as many updates as the mixed run did
    r = _result(done["tf1"])
    applied = TF1_STEPS - r["finite"].index(True)
    done["tf1_fp32"] = _Done(_popen([R, tf1, "--fp32", "--steps", str(applied)]))
    done["dir"] = d
    return done


TF1_STEPS = 100


def _result(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[-1][len("RESULT "):])


def _decisions(report_dir):
    """node name -> dtype over every report in the directory."""
    out = {}
    files = glob.glob(os.path.join(report_dir, "*.json"))
    assert files, f"no report in {report_dir}"
    reports = [json.load(open(f)) for f in files]
    for r in reports:
        for node, d in r["decisions"].items():
            out[node] = d.get("dtype")
    return out, reports


def _tf_adapter_scale_rule(finite, init, incr_every=1000, decr_every=2, incr_ratio=2.0, decr_ratio=0.8):
    """tf_adapter's ExponentialUpdateLossScaleManager, re-implemented in plain
    Python (float32 arithmetic, as its variable) from its source: the scale
    each step is taken with."""
    f32 = np.float32
    scale, good, bad, seq = f32(init), 0, 0, []
    for f in finite:
        seq.append(float(scale))
        if f:
            if good + 1 >= incr_every:
                scale, good, bad = f32(scale * f32(incr_ratio)), 0, 0
            else:
                good += 1
        else:
            if bad + 1 >= decr_every:
                scale, good, bad = max(f32(1.0), f32(scale * f32(decr_ratio))), 0, 0
            else:
                bad, good = bad + 1, 0
    return seq


# ---------------------------------------------------------------------------
# ModelZoo-style scripts through `npu-amp run`
# ---------------------------------------------------------------------------
def test_tf1_session_npuoptimizer_entry_loss_scale_and_overflow_flag(runs):
    """Hand-written NpuOptimizer entry with device-only GE keys,
    NPULossScaleOptimizer + ExponentialUpdateLossScaleManager(2**32) with
    tf_adapter's defaults, `loss_scale:0` and `overflow_status_reduce_all:0`
    fetched by name; argv and __main__ kept."""
    r = _result(runs["tf1"])
    assert r["argv"] == ["--steps", str(TF1_STEPS)] and r["name"] == "__main__"
    finite = r["finite"]
    # 2**32 overflows FP16 gradients: the first steps are skipped...
    assert finite[0] is False and True in finite
    first = finite.index(True)
    # ...and the scale follows tf_adapter's rule (decr_ratio 0.8 every 2 overflows)
    np.testing.assert_allclose(r["loss_scale"], _tf_adapter_scale_rule(finite, 2.0 ** 32), rtol=1e-6)
    # skipped steps leave the weights bit-identical: the loss does not move
    assert len(set(r["losses"][:first + 1])) == 1
    # FP32 reference with the same number of applied updates
    ref = _result(runs["tf1_fp32"])
    assert len(ref["losses"]) == TF1_STEPS - first
    # FP16 matmuls (10-bit mantissa) over a few SGD steps: 1e-2 relative
    np.testing.assert_allclose(r["losses"][-1], ref["losses"][-1], rtol=1e-2)
    np.testing.assert_allclose(np.array(r["w2"]), np.array(ref["w2"]), rtol=2e-2, atol=2e-3)
    dec, reports = _decisions(runs["dir"] / "tf1")
    assert dec["fc1"] == "float16" and dec["fc2"] == "float16"
    assert any(set(rp["summary"].get("ge_device_only_keys", [])) >= {
        "use_off_line", "mix_compile_mode", "enable_data_pre_proc", "iterations_per_loop"}
        for rp in reports)


@pytest.mark.skipif(not HAS_ESTIMATOR, reason="tf.estimator was removed in TF 2.16")
def test_estimator_script_npurunconfig_npuestimator(runs):
    mixed, ref = _result(runs["est"]), _result(runs["est_fp32"])
    for k in ("w", "u"):
        np.testing.assert_allclose(np.array(mixed[k]), np.array(ref[k]), rtol=2e-2, atol=2e-3)
    assert not np.array_equal(np.array(mixed["w"]), np.array(ref["w"])), \
        "the mixed run must differ from FP32 (FP16 rounding)"
    dec, reports = _decisions(runs["dir"] / "est")
    assert dec["dense1"] == "float16" and dec["dense2"] == "float16"
    # NPURunConfig's non-default device-only keyword reaches the report
    assert any("enable_data_pre_proc" not in rp["summary"].get("ge_device_only_keys", [])
               for rp in reports)  # True is tf_adapter's default: not passed on


def test_tf2_keras_script_npu_device(runs):
    mixed, ref = _result(runs["keras"]), _result(runs["keras_fp32"])
    np.testing.assert_allclose(mixed["loss"], ref["loss"], rtol=1e-2)
    dec, reports = _decisions(runs["dir"] / "keras")
    # Keras 2 names the op .../dense1/MatMul, Keras 3 .../dense1_1/MatMul
    matmuls = {n: d for n, d in dec.items()
               if "dense1" in n and n.rsplit("/", 1)[-1].startswith("MatMul")}
    assert matmuls and all(d == "float16" for d in matmuls.values()), matmuls
    assert any("hcom_parallel" in rp["summary"].get("ge_device_only_keys", []) for rp in reports)


def test_ge_name_mixlist_on_a_plain_script(runs):
    """A plain TF1 script (no npu names) gets the plugin from `npu-amp run`
    flags; a mixlist written with GE op types acts on the TF ops: GE's
    BatchMatMulV2 keeps the batched matmul in FP32, the plain MatMul is FP16;
    GE's NPU-only DynamicRNN is a report warning."""
    ref, mixed = _result(runs["plain_fp32"]), _result(runs["plain_mix"])
    dec, reports = _decisions(runs["dir"] / "plain")
    assert dec["fc1"] == "float16"
    assert dec["fc2"] == "float32"
    np.testing.assert_allclose(mixed["losses"], ref["losses"], rtol=1e-2)
    assert mixed["losses"] != ref["losses"]
    warnings = [w["message"] for rp in reports for w in rp["warnings"]]
    assert any("DynamicRNN" in w and "no TensorFlow op type" in w for w in warnings), warnings


def test_run_flags_reach_the_functions_of_a_plain_tf2_script(runs):
    r = _result(runs["plain_tf2"])
    # sum(relu(ones(4,8) @ w)) with w = range(64)/64: 4 * sum(range(64)) / 64
    np.testing.assert_allclose(r["sum"], 4 * sum(range(64)) / 64.0, rtol=1e-3)
    dec, reports = _decisions(runs["dir"] / "tf2")
    assert dec["mm"] == "float16"
    assert any(rp["summary"].get("env_overrides", {}).get("precision_mode") == "allow_mix_precision"
               for rp in reports)


def test_hccl_ops_on_two_mirrored_replicas(runs):
    """allreduce / broadcast / allgather on tf.distribute collectives; the
    rank size comes from the strategy."""
    reps = _result(runs["hccl"])["replicas"]
    for red, bcast, gathered, size in reps:           # replica 0 holds 1s, replica 1 holds 2s
        assert red == [3.0, 3.0] and bcast == [2.0, 2.0] and size == 2
        assert gathered == [1.0, 1.0, 2.0, 2.0]


def test_profile_script_honours_precision_flag(runs):
    """`npu-amp profile train.py --precision-mode ...` profiles the rewritten
    graph (it used to profile FP32 silently)."""
    p = runs["profile"]
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.load(open(runs["dir"] / "prof" / "summary.json"))
    assert summary["lp_compute_time_us"] > 0, summary


# ---------------------------------------------------------------------------
# bad input: one clear error
# ---------------------------------------------------------------------------
def test_bad_input_gives_one_clear_error(runs):
    # (TF >= 2.16 prints a few C++ log lines while it is imported: look at ours)
    p = runs["missing"]
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith("npu-amp")]
    assert p.returncode == 2 and len(ours) == 1 and "nothere.py' does not exist" in ours[0]
    p = runs["bad_mix"]
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith("npu-amp")]
    assert p.returncode == 2 and len(ours) == 1 and "'SoftmaxV9'" in ours[0], p.stderr
    p = runs["bad_key"]
    assert p.returncode == 1
    assert "unknown parameter 'use_of_line'" in p.stderr and "did you mean 'use_off_line'" in p.stderr


def test_real_tf_adapter_is_never_shadowed_and_exit_code_kept(runs):
    p = runs["shadow"]
    assert p.returncode == 3
    assert '"real": true' in p.stdout.replace("RESULT ", "")
    assert "Huawei's tf_adapter is installed" in p.stderr


# ---------------------------------------------------------------------------
# in-process: options, names, API surface
# ---------------------------------------------------------------------------
def test_ge_keys_act_or_are_listed():
    o = Options.from_kwargs(_groups=("rewrite",), use_off_line=True, mix_compile_mode=False,
                            buffer_optim="off_optimize", precision_mode="allow_mix_precision")
    assert set(o.device_only_keys) == {"use_off_line", "mix_compile_mode"}
    cfg = npu_amp_tf.session_config(memory_optimize="on", hcom_parallel=True)
    from tensorflow.core.protobuf.rewriter_config_pb2 import RewriterConfig

    assert cfg.graph_options.rewrite_options.memory_optimization == RewriterConfig.RECOMPUTATION_HEURISTICS
    cfg = npu_amp_tf.session_config(buffer_optim="off_optimize")
    assert cfg.graph_options.rewrite_options.memory_optimization == RewriterConfig.NO_MEM_OPT
    with pytest.raises(OptionError, match="use_of_line.*did you mean 'use_off_line'"):
        Options.from_kwargs(use_of_line=True)
    with pytest.raises(OptionError, match="buffer_optim='fast'.*l2_optimize, off_optimize"):
        Options.from_kwargs(buffer_optim="fast")
    with pytest.raises(OptionError, match="dump_path"):
        Options.from_kwargs(enable_dump=True)


def test_cann_amp_guide_config_selects_the_manager():
    """{"precision_mode", "loss_scale", "custom_black_list"} through
    session_config and AMP_Optimizer."""
    from npu_amp_tf import loss_scale as ls

    guide = {"precision_mode": "allow_mix_precision", "loss_scale": "dynamic",
             "custom_black_list": ["SoftmaxV2", "ReduceSumD"]}
    try:
        cfg = npu_amp_tf.session_config(**dict(guide, loss_scale=512))
        params = npu_amp_tf.config.entry_params(cfg)
        assert tuple(params["custom_black_list"]) == ("Softmax", "Sum")
        with tf.Graph().as_default():
            opt = npu_amp_tf.AMP_Optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
            assert isinstance(opt.loss_scale_manager, ls.FixedLossScaleManager)
            opt = npu_amp_tf.AMP_Optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                           loss_scale="dynamic")
            assert isinstance(opt.loss_scale_manager, ls.ExponentialUpdateLossScaleManager)
    finally:
        ls.set_default_loss_scale(None)


def test_ge_op_names_map_to_tf_ops_and_to_remove_makes_gray():
    from graph_passes.precision import ge_names, lists

    for ge, tf_types in {"SoftmaxV2": ("Softmax",), "MatMulV2": ("MatMul",), "ReduceSumD": ("Sum",),
                         "ReduceMeanD": ("Mean",),
                         "BatchMatMulV2": ("BatchMatMulV2", "BatchMatMulV3")}.items():
        assert ge_names.map_names([ge])[0] == tf_types
    assert ge_names.map_names(["DynamicRNN"])[1] == ("DynamicRNN",)
    assert ge_names.map_names(["NoSuchOpXyz"])[2] == ("NoSuchOpXyz",)
    for tf_type in {t for ts in ge_names.GE_TO_TF.values() for t in ts}:
        assert ge_names.is_tf_op(tf_type, extra=set().union(*lists.default_lists().values())), tf_type
    resolved = lists.resolve_lists(mixlist={"white-list": {"to-remove": ["MatMul"]},
                                            "black-list": {"to-remove": ["Softmax"]}})
    assert "MatMul" in resolved["gray"] and "MatMul" not in resolved["white"]
    assert "Softmax" in resolved["gray"] and "Softmax" not in resolved["black"]
    with pytest.raises(MixlistError, match="'SoftmaxV9'"):
        Options.from_kwargs(custom_white_list=["SoftmaxV9"])


def test_compat_api_surface_matches_tf_adapter():
    """Names, signatures and defaults taken from tf_adapter's sources."""
    import inspect

    from npu_amp_tf import compat

    assert compat.install() is True
    try:
        import npu_bridge.npu_init as ni
        from npu_bridge.estimator import npu_ops
        from npu_bridge.estimator.npu import npu_loss_scale_manager as lsm
        from npu_bridge.estimator.npu import npu_loss_scale_optimizer as lso
        from npu_bridge.estimator.npu import util
        from npu_bridge.hccl import hccl_ops

        import npu_device

        assert ni.tf is tf.compat.v1
        for name in ("npu_config_proto", "npu_run_config_init", "npu_hooks_append", "RewriterConfig",
                     "init_resource", "shutdown_resource", "close_session",
                     "set_keras_session_npu_config", "get_rank_size", "get_rank_id",
                     "get_npu_rank_id", "get_npu_rank_size", "NPULossScaleOptimizer",
                     "FixedLossScaleManager", "ExponentialUpdateLossScaleManager",
                     "NPUDistributedOptimizer", "NPUOptimizer", "npu_distributed_optimizer_wrapper",
                     "npu_scope", "util", "npu_ops", "hccl_ops", "NPURunConfig"):
            assert hasattr(ni, name), name
        sig = inspect.signature(lsm.ExponentialUpdateLossScaleManager.__init__)
        assert [(p.name, p.default) for p in list(sig.parameters.values())[1:]] == [
            ("init_loss_scale", inspect.Parameter.empty), ("incr_every_n_steps", inspect.Parameter.empty),
            ("decr_every_n_nan_or_inf", 2), ("incr_ratio", 2), ("decr_ratio", 0.8)]
        assert isinstance(lso.NPULossScaleOptimizer, type)
        assert "is_distributed" in inspect.signature(lso.NPULossScaleOptimizer.__init__).parameters
        tf_adapter_run_config = (
            "iterations_per_loop profiling_config model_dir tf_random_seed save_summary_steps "
            "save_checkpoints_steps save_checkpoints_secs session_config keep_checkpoint_max "
            "keep_checkpoint_every_n_hours log_step_count_steps distribute enable_data_pre_proc "
            "precision_mode enable_reduce_precision variable_format_optimize mix_compile_mode "
            "hcom_parallel graph_memory_max_size variable_memory_max_size dump_config "
            "stream_max_parallel_num is_tailing_optimization horovod_mode graph_run_mode "
            "op_debug_level enable_scope_fusion_passes enable_exception_dump op_select_implmode "
            "optypelist_for_implmode dynamic_input_config aoe_mode work_path buffer_optimize "
            "enable_small_channel fusion_switch_file enable_compress_weight compress_weight_conf "
            "op_compiler_cache_mode op_compiler_cache_dir debug_dir hcom_multi_mode dynamic_input "
            "dynamic_graph_execute_mode dynamic_inputs_shape_range train_distribute eval_distribute "
            "local_rank_id local_device_list session_device_id distribute_config modify_mixlist "
            "op_precision_mode device_type soc_config hccl_timeout op_wait_timeout "
            "op_execute_timeout HCCL_algorithm customize_dtypes op_debug_config memory_config "
            "experimental_config topo_sorting_mode aoe_config_file insert_op_file "
            "stream_sync_timeout event_sync_timeout external_weight es_cluster_config deterministic "
            "frozen_variable variable_placement jit_compile precision_mode_v2 ac_parallel_enable"
        ).split()
        from npu_bridge.estimator.npu.npu_config import NPURunConfig

        assert list(inspect.signature(NPURunConfig.__init__).parameters)[1:] == tf_adapter_run_config
        if HAS_ESTIMATOR:
            from npu_bridge.estimator.npu.npu_estimator import NPUEstimator, NPUEstimatorSpec

            assert issubclass(NPUEstimator, tf.estimator.Estimator)
            assert issubclass(NPUEstimatorSpec, tf.estimator.EstimatorSpec)
            cfg = NPURunConfig(precision_mode="allow_mix_precision", iterations_per_loop=10,
                               enable_data_pre_proc=False)
            params = npu_amp_tf.config.entry_params(cfg.session_config)
            assert params["precision_mode"] == "allow_mix_precision"
            assert params["iterations_per_loop"] == 10
            with pytest.raises(OptionError, match="precision_mode='fast16'"):
                NPURunConfig(precision_mode="fast16")
        # one worker: collectives are the identity; rank helpers 1 / 0
        os.environ.pop("RANK_SIZE", None)
        assert (ni.get_rank_size(), ni.get_rank_id(), ni.get_npu_rank_size()) == (1, 0, 1)
        os.environ.update(RANK_SIZE="4", RANK_ID="2")
        try:
            assert (ni.get_rank_size(), ni.get_rank_id()) == (4, 2)
        finally:
            os.environ.pop("RANK_SIZE")
            os.environ.pop("RANK_ID")
        x = tf.constant([1.0, 2.0])
        np.testing.assert_array_equal(hccl_ops.allreduce(x, "sum").numpy(), [1.0, 2.0])
        np.testing.assert_array_equal(hccl_ops.broadcast([x], 0)[0].numpy(), [1.0, 2.0])
        d = npu_ops.dropout(tf.ones([1000]), keep_prob=0.5, seed=1).numpy()
        assert set(np.unique(d)) <= {0.0, 2.0} and 350 < (d > 0).sum() < 650
        with tf.Graph().as_default() as g:
            a = tf.compat.v1.placeholder(tf.float32, [2], name="a")
            b = tf.identity(a, name="b")
            util.keep_tensors_dtypes(g, ["b:0"])
            assert b.op.get_attr("_keep_dtype") == 1
        opts = npu_device.global_options()
        opts.precision_mode = "allow_mix_precision"
        with pytest.raises(OptionError, match="precison_mode"):
            opts.precison_mode = "x"
        assert opts.params() == {"precision_mode": "allow_mix_precision"}
        sig = inspect.signature(npu_device.train.optimizer.NpuLossScaleOptimizer.__new__)
        assert [(p.name, p.default) for p in list(sig.parameters.values())[1:]] == [
            ("inner_optimizer", inspect.Parameter.empty), ("dynamic", True), ("initial_scale", None),
            ("dynamic_growth_steps", None)]
    finally:
        compat.uninstall()


def test_run_errors_are_npu_amp_errors():
    from npu_amp_tf.compat import run_script

    with pytest.raises(NpuAmpError, match="does not exist"):
        run_script("/nonexistent/train.py")


def _tiny_graph():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 4], name="x")
        w = tf.constant(np.ones((4, 4), np.float32), name="w")
        tf.nn.relu(tf.matmul(x, w, name="mm"), name="y")
    return g


def test_ge_dump_keys_write_the_graphs(tmp_path):
    """enable_dump + dump_path: the graph before / after the rewrite and the
    report land in dump_path/<graph>/."""
    from npu_amp_tf import pipeline

    opts = Options.from_kwargs(_groups=("rewrite",), enable_dump=True, dump_path=str(tmp_path),
                               dump_step="0|5", dump_mode="all")
    out, rep = pipeline.optimize(_tiny_graph().as_graph_def(), opts, fetches=["y"], graph_name="g1")
    d = tmp_path / "g1"
    assert rep.summary["ge_dump"] == str(d)
    from tensorflow.core.framework import graph_pb2

    after = graph_pb2.GraphDef.FromString((d / "after.pb").read_bytes())
    before = graph_pb2.GraphDef.FromString((d / "before.pb").read_bytes())
    assert any(n.op == "Cast" for n in after.node) and not any(n.op == "Cast" for n in before.node)
    assert json.load(open(d / "meta.json"))["dump_step"] == "0|5"
    assert json.load(open(d / "report.json"))["decisions"]["mm"]["dtype"] == "float16"


def test_profiling_mode_entry_traces_the_session(tmp_path):
    """profiling_mode in an NpuOptimizer entry (compat session hook) writes the
    profile tool's files to profiling_options.output."""
    from npu_amp_tf.compat import _sessions

    g = _tiny_graph()
    cfg = tf.compat.v1.ConfigProto()
    e = cfg.graph_options.rewrite_options.custom_optimizers.add()
    e.name = "NpuOptimizer"
    e.parameter_map["profiling_mode"].b = True
    e.parameter_map["profiling_options"].s = json.dumps({"output": str(tmp_path / "p")}).encode()
    e.parameter_map["buffer_optim"].s = b"off_optimize"
    _sessions.patch()
    try:
        with tf.compat.v1.Session(graph=g, config=cfg) as sess:
            from tensorflow.core.protobuf.rewriter_config_pb2 import RewriterConfig

            for _ in range(3):
                sess.run("y:0", {"x:0": np.ones((2, 4), np.float32)})
            used = sess._config.graph_options.rewrite_options  # pylint: disable=protected-access
            assert used.memory_optimization == RewriterConfig.NO_MEM_OPT
            assert used.remapping == RewriterConfig.OFF
    finally:
        _sessions.unpatch()
    summary = json.load(open(tmp_path / "p" / "summary.json"))
    assert summary["steps"] == 2 and summary["lp_compute_time_us"] > 0
    assert (tmp_path / "p" / "timeline.json").exists()


def test_cann_amp_guide_dict_given_to_amp_optimizer_reaches_the_session():
    """AMP_Optimizer(opt, **guide): loss_scale picks the manager, the rewrite
    keys (GE names in the lists) reach a plain Session made afterwards."""
    from npu_amp_tf import bridge
    from npu_amp_tf import loss_scale as ls
    from npu_amp_tf.compat import _sessions

    guide = {"precision_mode": "allow_mix_precision", "loss_scale": 256,
             "custom_black_list": ["MatMulV2"], "buffer_optim": "l2_optimize"}
    try:
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
            w = tf.compat.v1.get_variable("w", initializer=tf.ones([8, 8]) * 0.1)
            h = tf.nn.relu(tf.matmul(x, w, name="mm"), name="h")
            loss = tf.reduce_mean(tf.square(h))
            opt = npu_amp_tf.AMP_Optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), **guide)
            assert isinstance(opt.loss_scale_manager, ls.FixedLossScaleManager)
            train = opt.minimize(loss)
            bridge.clear_reports()
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(train, {x: np.ones((4, 8), np.float32)})
        reps = [r["report"] for r in bridge.last_reports() if r.get("report")]
        decided = {n: d["dtype"] for r in reps for n, d in r["decisions"].items()}
        assert decided.get("mm") == "float32"          # MatMulV2 (GE) -> MatMul black
        assert any(list(r["options"].get("custom_black_list", ())) == ["MatMul"] for r in reps)
    finally:
        npu_amp_tf.disable()
        _sessions.unpatch()
