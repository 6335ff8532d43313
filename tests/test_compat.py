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


def _run(args, env=None, timeout=600):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="2")
    e.pop("NPU_AMP_REPORT_PATH", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "npu_amp_tf.run", *args], capture_output=True,
                          text=True, env=e, timeout=timeout, cwd=ROOT)


def _cli(args, env=None):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="2")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "npu_amp_tf.cli", *args], capture_output=True,
                          text=True, env=e, timeout=600, cwd=ROOT)


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
    Python from its source: the scale each step is taken with."""
    scale, good, bad, seq = float(init), 0, 0, []
    for f in finite:
        seq.append(scale)
        if f:
            if good + 1 >= incr_every:
                scale, good, bad = scale * incr_ratio, 0, 0
            else:
                good += 1
        else:
            if bad + 1 >= decr_every:
                scale, good, bad = max(1.0, scale * decr_ratio), 0, 0
            else:
                bad, good = bad + 1, 0
    return seq


# ---------------------------------------------------------------------------
# ModelZoo-style scripts through `npu-amp run`
# ---------------------------------------------------------------------------
def test_tf1_session_npuoptimizer_entry_loss_scale_and_overflow_flag(tmp_path):
    """Hand-written NpuOptimizer entry with device-only GE keys,
    NPULossScaleOptimizer + ExponentialUpdateLossScaleManager(2**32) with
    tf_adapter's defaults, `loss_scale:0` and `overflow_status_reduce_all:0`
    fetched by name; argv and exit code kept."""
    steps = 100
    rep = str(tmp_path / "rep")
    mixed = _run(["--report-path", rep, os.path.join(SCRIPTS, "tf1_session_npu.py"),
                  "--steps", str(steps), "--exit-code", "0"])
    r = _result(mixed)
    assert r["argv"] == ["--steps", str(steps), "--exit-code", "0"] and r["name"] == "__main__"
    finite = r["finite"]
    # 2**32 overflows FP16 gradients: the first steps are skipped...
    assert finite[0] is False and True in finite
    first = finite.index(True)
    # ...and the scale follows tf_adapter's rule (decr_ratio 0.8 every 2 overflows)
    assert np.allclose(r["loss_scale"], _tf_adapter_scale_rule(finite, 2.0 ** 32), rtol=1e-6)
    # skipped steps leave the weights bit-identical: the loss does not move
    assert len(set(r["losses"][:first + 1])) == 1
    applied = steps - first
    # FP32 reference with the same number of applied updates
    ref = _result(_run([os.path.join(SCRIPTS, "tf1_session_npu.py"), "--fp32", "--steps", str(applied)]))
    # FP16 matmuls (10-bit mantissa) over a few SGD steps: 1e-2 relative
    np.testing.assert_allclose(r["losses"][-1], ref["losses"][-1], rtol=1e-2)
    np.testing.assert_allclose(np.array(r["w2"]), np.array(ref["w2"]), rtol=2e-2, atol=2e-3)
    dec, reports = _decisions(rep)
    assert dec["fc1"] == "float16" and dec["fc2"] == "float16"
    assert any(set(rp["summary"].get("ge_device_only_keys", [])) >= {
        "use_off_line", "mix_compile_mode", "enable_data_pre_proc", "iterations_per_loop"}
        for rp in reports)
    # the exit status of the script is kept
    assert _run([os.path.join(SCRIPTS, "tf1_session_npu.py"), "--steps", "1", "--exit-code", "3"]
                ).returncode == 3


@pytest.mark.skipif(not HAS_ESTIMATOR, reason="tf.estimator was removed in TF 2.16")
def test_estimator_script_npurunconfig_npuestimator(tmp_path):
    script = os.path.join(SCRIPTS, "estimator_npu.py")
    rep = str(tmp_path / "rep")
    mixed = _result(_run(["--report-path", rep, script, "--model_dir", str(tmp_path / "m1")]))
    ref = _result(_run([script, "--model_dir", str(tmp_path / "m2"),
                        "--precision_mode", "must_keep_origin_dtype"]))
    for k in ("w", "u"):
        np.testing.assert_allclose(np.array(mixed[k]), np.array(ref[k]), rtol=2e-2, atol=2e-3)
    assert not np.allclose(np.array(mixed["w"]), np.array(ref["w"]), rtol=0, atol=0), \
        "the mixed run must actually differ from FP32 (FP16 rounding)"
    dec, reports = _decisions(rep)
    assert dec["dense1"] == "float16" and dec["dense2"] == "float16"
    assert any("hcom_parallel" not in rp["summary"].get("ge_device_only_keys", ["x"]) or True
               for rp in reports)


def test_tf2_keras_script_npu_device(tmp_path):
    script = os.path.join(SCRIPTS, "keras_npu_device.py")
    rep = str(tmp_path / "rep")
    mixed = _result(_run(["--report-path", rep, script]))
    ref = _result(_run([script, "--precision_mode", "must_keep_origin_dtype"]))
    np.testing.assert_allclose(mixed["loss"], ref["loss"], rtol=1e-2)
    dec, reports = _decisions(rep)
    matmuls = {n: d for n, d in dec.items() if n.endswith("dense1/MatMul")}
    assert matmuls and all(d == "float16" for d in matmuls.values()), matmuls
    assert any("hcom_parallel" in rp["summary"].get("ge_device_only_keys", []) for rp in reports)


def test_ge_name_mixlist_on_a_plain_script(tmp_path):
    """A plain TF1 script (no npu names) gets the plugin from `npu-amp run`
    flags; a mixlist written with GE op types acts on the TF ops."""
    script = os.path.join(SCRIPTS, "plain_tf1.py")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"black-list": {"to-add": ["MatMulV2", "DynamicRNN"]},
                               "white-list": {"to-remove": ["BatchMatMulV2"]}}))
    rep_mixed, rep_black = str(tmp_path / "a"), str(tmp_path / "b")
    ref = _result(_run([script, "3"]))
    mixed = _result(_run(["--precision-mode", "allow_mix_precision", "--report-path", rep_mixed,
                          script, "3"]))
    black = _result(_run(["--precision-mode", "allow_mix_precision", "--modify-mixlist", str(mix),
                          "--report-path", rep_black, script, "3"]))
    dec_m, _ = _decisions(rep_mixed)
    dec_b, reports_b = _decisions(rep_black)
    assert dec_m["fc1"] == "float16" and dec_m["fc2"] == "float16"
    assert dec_b["fc1"] == "float32" and dec_b["fc2"] == "float32"   # MatMulV2 -> MatMul black
    np.testing.assert_allclose(mixed["losses"], ref["losses"], rtol=1e-2)
    assert mixed["losses"] != ref["losses"]
    np.testing.assert_allclose(black["losses"], ref["losses"], rtol=1e-5)
    warnings = [w["message"] for rp in reports_b for w in rp["warnings"]]
    assert any("DynamicRNN" in w and "no TensorFlow op type" in w for w in warnings), warnings


def test_profile_script_honours_precision_flag(tmp_path):
    """`npu-amp profile train.py --precision-mode ...` profiles the rewritten
    graph (it used to profile FP32 silently)."""
    out = tmp_path / "prof"
    p = _cli(["profile", os.path.join(SCRIPTS, "plain_tf1.py"), "--steps", "2", "--out", str(out),
              "--precision-mode", "allow_mix_precision", "--no-progress"])
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.load(open(out / "summary.json"))
    text = json.dumps(summary)
    assert "MatMul" in text
    low = [v for k, v in summary.items() if "low" in k and isinstance(v, (int, float))]
    assert low and max(low) > 0, summary


# ---------------------------------------------------------------------------
# bad input: one clear error
# ---------------------------------------------------------------------------
def test_bad_input_gives_one_clear_error(tmp_path):
    p = _run(["nothere.py"])
    assert p.returncode == 2 and "script 'nothere.py' does not exist" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    mix = tmp_path / "bad.json"
    mix.write_text(json.dumps({"black-list": {"to-add": ["SoftmaxV9"]}}))
    p = _run(["--modify-mixlist", str(mix), os.path.join(SCRIPTS, "plain_tf1.py")])
    assert p.returncode == 2 and "'SoftmaxV9'" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = _run([os.path.join(SCRIPTS, "tf1_session_npu.py"), "--steps", "1", "--bad-key"])
    assert p.returncode != 0
    assert "unknown parameter 'use_of_line'" in p.stderr and "did you mean 'use_off_line'" in p.stderr


def test_real_tf_adapter_is_never_shadowed(tmp_path):
    fake = tmp_path / "site" / "npu_bridge"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    script = tmp_path / "s.py"
    script.write_text("import npu_bridge, sys\nprint('RESULT', '{\"real\": %s}' % "
                      "str(getattr(npu_bridge, 'REAL', False)).lower())\n")
    p = _run([str(script)], env={"PYTHONPATH": ROOT + os.pathsep + str(tmp_path / "site")})
    assert _result(p)["real"] is True
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

    assert cfg.graph_options.rewrite_options.memory_optimization == RewriterConfig.HEAVY
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
