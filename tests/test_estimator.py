"""Estimator flow: RunConfig, train with overflow, evaluate, export, resume with saved scale."""
import os

import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from npu_amp_tf import NpuAmpError, OptionError

HAS_ESTIMATOR = hasattr(tf, "estimator")
needs_estimator = pytest.mark.skipif(
    not HAS_ESTIMATOR,
    reason=f"tf.estimator is not shipped with TensorFlow {tf.__version__} (removed in 2.16)")


@pytest.mark.skipif(HAS_ESTIMATOR, reason="tf.estimator exists in this TensorFlow")
def test_runconfig_without_tf_estimator_is_a_clear_error():
    with pytest.raises(NpuAmpError, match=r"tf.estimator is not available in TensorFlow 2\.\d+"):
        npu_amp_tf.estimator.RunConfig(model_dir="/tmp/x")


v1 = tf.compat.v1
BAD_STEPS = (2, 7)  # global steps whose loss is made infinite


def _input_fn():
    rng = np.random.RandomState(0)
    x = rng.randn(64, 4).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 2.0, 0.5], np.float32))[:, None]
    return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).repeat().batch(16)


def _model_fn(features, labels, mode):
    dense = v1.layers.Dense(1, name="dense")
    pred = dense(features["x"])
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions={"y": pred})
    loss = tf.reduce_mean(tf.square(pred - labels))
    gs = v1.train.get_or_create_global_step()
    if mode == tf.estimator.ModeKeys.EVAL:
        return tf.estimator.EstimatorSpec(mode, loss=loss)
    bad = tf.reduce_any(tf.equal(gs, tf.constant(BAD_STEPS, tf.int64)))
    train_loss = loss * tf.where(bad, np.float32(np.inf), 1.0)
    opt = npu_amp_tf.AMP_Optimizer(v1.train.AdamOptimizer(0.05), decr_every_n_nan_or_inf=1)
    train_op = opt.minimize(train_loss, global_step=gs)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@needs_estimator
def test_runconfig_builds_the_plugin_session_config(tmp_path):
    cfg = npu_amp_tf.estimator.RunConfig(model_dir=str(tmp_path), save_checkpoints_steps=5,
                                         precision_mode="must_keep_origin_dtype")
    assert isinstance(cfg, tf.estimator.RunConfig) and cfg.save_checkpoints_steps == 5
    names = [c.name for c in cfg.session_config.graph_options.rewrite_options.custom_optimizers]
    assert "NpuAmpOptimizer" in names
    base = v1.ConfigProto(intra_op_parallelism_threads=1)
    cfg = npu_amp_tf.estimator.RunConfig(session_config=base, precision_mode="force_fp32")
    assert cfg.session_config.intra_op_parallelism_threads == 1


@needs_estimator
@pytest.mark.parametrize("kwargs, needle", [
    (dict(precision_mode="fp8"), "precision_mode='fp8'"),
    (dict(init_loss_scale=8), "loss-scale options"),
    (dict(save_every=3), "unknown parameter 'save_every'"),
    (dict(session_config="x"), "session_config='x'"),
])
def test_runconfig_bad_params(kwargs, needle):
    with pytest.raises(OptionError) as ei:
        npu_amp_tf.estimator.RunConfig(**kwargs)
    assert needle in str(ei.value) and "accepted" in str(ei.value)


@needs_estimator
def test_train_evaluate_export_resume_with_saved_scale(tmp_path):
    model_dir = str(tmp_path / "model")
    cfg = npu_amp_tf.estimator.RunConfig(model_dir=model_dir, save_checkpoints_steps=100,
                                         log_step_count_steps=100, save_summary_steps=1,
                                         tf_random_seed=1,
                                         precision_mode="must_keep_origin_dtype")
    est = tf.estimator.Estimator(_model_fn, config=cfg)
    est.train(_input_fn, max_steps=5)  # overflow at global step 2 -> 128 -> 64
    ck = tf.train.latest_checkpoint(model_dir)
    assert tf.train.load_variable(ck, "global_step") == 5  # skipped step did not stall
    assert tf.train.load_variable(ck, "loss_scale/loss_scale") == 64.0
    assert tf.train.load_variable(ck, "loss_scale/skipped_steps") == 1
    assert {"dense/kernel/Adam", "beta1_power"} <= {n for n, _ in tf.train.list_variables(ck)}
    # only 4 updates were applied: beta1_power == 0.9 ** (1 + applied)
    np.testing.assert_allclose(tf.train.load_variable(ck, "beta1_power"), 0.9 ** 5, rtol=1e-6)

    metrics = est.evaluate(_input_fn, steps=2)
    assert np.isfinite(metrics["loss"]) and metrics["global_step"] == 5

    def serving():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        return tf.estimator.export.ServingInputReceiver({"x": x}, {"x": x})

    export_dir = est.export_saved_model(str(tmp_path / "export"), serving).decode()
    loaded = tf.saved_model.load(export_dir)
    out = loaded.signatures["serving_default"](x=tf.ones([2, 4]))
    assert out["y"].shape == (2, 1)
    assert not any("loss_scale" in v.name for v in loaded.variables)  # serving: master weights only

    # resume: continues from the saved scale (64 -> 32 at the overflow at step 7, not 64)
    est2 = tf.estimator.Estimator(_model_fn, config=cfg)
    est2.train(_input_fn, max_steps=10)
    ck = tf.train.latest_checkpoint(model_dir)
    assert tf.train.load_variable(ck, "global_step") == 10
    assert tf.train.load_variable(ck, "loss_scale/loss_scale") == 32.0
    assert tf.train.load_variable(ck, "loss_scale/overflow_count") == 2

    # TensorBoard summaries were written by the Estimator
    from tensorflow.core.util import event_pb2
    tags = set()
    for f in os.listdir(model_dir):
        if f.startswith("events."):
            for rec in tf.data.TFRecordDataset(os.path.join(model_dir, f)):
                tags |= {v.tag for v in event_pb2.Event.FromString(rec.numpy()).summary.value}
    assert {"npu_amp/loss_scale", "npu_amp/overflow_count", "npu_amp/skipped_steps"} <= tags
