"""Loss-scale managers: state machine, bounds, validation, history, warnings, summaries."""
import logging
import math

import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from npu_amp_tf import ExponentialUpdateLossScaleManager, FixedLossScaleManager, OptionError
from npu_amp_tf.loss_scale import LOSS_SCALE_COLLECTION, make_manager
from npu_amp_tf.options import Options


def _run(m, flags):
    for f in flags:
        m.update_loss_scale(tf.constant(f))
    return m.state()


def test_defaults_match_the_documented_ones():
    m = make_manager(None, Options.from_kwargs(_groups=("loss_scale",)))
    assert isinstance(m, ExponentialUpdateLossScaleManager)
    assert (m._init_scale, m.incr_every_n_steps, m.decr_every_n_nan_or_inf) == (128.0, 1000, 2)
    assert (m.incr_ratio, m.decr_ratio, m._min, m._max) == (2.0, 0.5, 1.0, 2.0 ** 24)
    assert float(m.get_loss_scale()) == 128.0
    assert isinstance(make_manager("dynamic", Options.from_kwargs(_groups=("loss_scale",))),
                      ExponentialUpdateLossScaleManager)
    fixed = make_manager(64, Options.from_kwargs(_groups=("loss_scale",)))
    assert isinstance(fixed, FixedLossScaleManager) and float(fixed.get_loss_scale()) == 64.0


def test_growth_after_n_good_steps_and_hysteresis():
    m = ExponentialUpdateLossScaleManager(128, 3, decr_ratio=0.5)
    st = _run(m, [True, True])
    assert st["loss_scale"] == 128 and st["good_steps"] == 2
    st = _run(m, [True])
    assert st["loss_scale"] == 256 and st["good_steps"] == 0
    # one overflow: hysteresis keeps the scale; the second one halves it
    st = _run(m, [False])
    assert st["loss_scale"] == 256 and st["bad_steps"] == 1 and st["overflow_count"] == 1
    st = _run(m, [True, False])  # a good step in between does not reset the hysteresis
    assert st["loss_scale"] == 128 and st["bad_steps"] == 0
    assert st["overflow_count"] == 2 and st["skipped_steps"] == 2 and st["steps"] == 6


def test_scale_stays_within_bounds():
    m = ExponentialUpdateLossScaleManager(2.0 ** 23, 1, 1, max_loss_scale=2.0 ** 24)
    assert _run(m, [True] * 5)["loss_scale"] == 2.0 ** 24
    m = ExponentialUpdateLossScaleManager(4, 1000, 1, decr_ratio=0.5)
    assert _run(m, [False] * 6)["loss_scale"] == 1.0
    m = ExponentialUpdateLossScaleManager(16, 1000, 1, 2, 0.5, min_loss_scale=8)
    assert _run(m, [False] * 4)["loss_scale"] == 8.0


def test_fixed_manager_counts_overflows_but_keeps_scale():
    m = FixedLossScaleManager(512)
    st = _run(m, [True, False, False, True])
    assert st["loss_scale"] == 512 and st["overflow_count"] == 2 and st["skipped_steps"] == 2
    m = FixedLossScaleManager(512, enable_overflow_check=False)
    st = _run(m, [False, False])
    assert st["loss_scale"] == 512 and st["overflow_count"] == 0 and st["skipped_steps"] == 0


@pytest.mark.parametrize("kwargs, needle", [
    (dict(init_loss_scale=0.5, incr_every_n_steps=10), "init_loss_scale=0.5"),
    (dict(init_loss_scale=0.5, incr_every_n_steps=10), "[1, 18446744073709551616]"),
    (dict(init_loss_scale=8, incr_every_n_steps=0), "incr_every_n_steps=0"),
    (dict(init_loss_scale=8, incr_every_n_steps=10, decr_every_n_nan_or_inf=0), "decr_every_n_nan_or_inf"),
    (dict(init_loss_scale=8, incr_every_n_steps=10, incr_ratio=1.0), "incr_ratio=1.0"),
    (dict(init_loss_scale=8, incr_every_n_steps=10, incr_ratio=0.5), "(1, inf)"),
    (dict(init_loss_scale=8, incr_every_n_steps=10, decr_ratio=1.0), "decr_ratio=1.0"),
    (dict(init_loss_scale=8, incr_every_n_steps=10, decr_ratio=0), "(0, 1)"),
    (dict(init_loss_scale="big", incr_every_n_steps=10), "expected a number"),
])
def test_bad_dynamic_values_raise_one_clear_error(kwargs, needle):
    with pytest.raises(OptionError) as ei:
        ExponentialUpdateLossScaleManager(**kwargs)
    assert needle in str(ei.value) and "accepted" in str(ei.value)


@pytest.mark.parametrize("value", [0, 0.99, -4, float("nan"), float("inf"), "x", True])
def test_bad_fixed_scale(value):
    with pytest.raises(OptionError, match=r"loss_scale=.*accepted"):
        FixedLossScaleManager(value)
    with pytest.raises(OptionError, match="enable_overflow_check"):
        FixedLossScaleManager(8, enable_overflow_check="maybe")


def test_bad_manager_argument():
    with pytest.raises(OptionError, match="loss_scale_manager='static'.*accepted"):
        npu_amp_tf.AMP_Optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), "static")
    with pytest.raises(OptionError, match="loss_scale=0.5"):
        npu_amp_tf.AMP_Optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), 0.5)


def test_history_and_warnings(caplog):
    m = ExponentialUpdateLossScaleManager(16, 2, 1, decr_ratio=0.5)
    with caplog.at_level(logging.INFO, logger="npu_amp_tf.loss_scale"):
        _run(m, [True, True, False, True, False, False, False, False])
    h = m.history
    # growth at step 2, then overflow events at steps 3, 5, 6, 7, 8
    assert [(e.step, e.scale, e.overflow) for e in h] == [
        (2, 32.0, False), (3, 16.0, True), (5, 8.0, True), (6, 4.0, True), (7, 2.0, True),
        (8, 1.0, True)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("keeps leaving the normal 8..1024 band" in w for w in warnings), warnings
    assert any("collapsed to 2" in w and "real NaN" in w for w in warnings), warnings
    m.clear_history()
    assert m.history == []


def test_no_warning_in_a_healthy_run(caplog):
    m = ExponentialUpdateLossScaleManager(128, 2, 2, decr_ratio=0.5)
    with caplog.at_level(logging.WARNING, logger="npu_amp_tf.loss_scale"):
        _run(m, [True, True, False, True, True, False, False, True, True])
    assert not caplog.records
    assert [e.scale for e in m.history] == [256, 256, 512, 512, 256, 512]


def test_tf1_graph_variables_are_checkpointed_and_collected(tmp_path):
    g = tf.Graph()
    with g.as_default():
        m = ExponentialUpdateLossScaleManager(64, 2, 1, decr_ratio=0.5)
        flag = tf.compat.v1.placeholder(tf.bool, [])
        up = m.update_loss_scale(flag)
        summaries = m.summaries()
        names = sorted(v.op.name for v in g.get_collection(LOSS_SCALE_COLLECTION))
        assert names == ["loss_scale/bad_steps", "loss_scale/good_steps", "loss_scale/loss_scale",
                         "loss_scale/overflow_count", "loss_scale/skipped_steps", "loss_scale/steps"]
        assert not g.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
        assert {s.op.name for s in summaries} >= {"npu_amp/loss_scale", "npu_amp/overflow_count"}
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            s.run(up, {flag: False})
            path = saver.save(s, str(tmp_path / "ck"))
    assert tf.train.load_variable(path, "loss_scale/loss_scale") == 32.0
    assert tf.train.load_variable(path, "loss_scale/overflow_count") == 1
    # the same python manager rebuilds its variables in a new graph (Estimator reuse)
    with tf.Graph().as_default() as g2:
        m.update_loss_scale(tf.constant(True))
        assert m.loss_scale.graph is g2


def test_tf2_summaries_written(tmp_path):
    m = ExponentialUpdateLossScaleManager(128, 1, decr_ratio=0.5)
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        m.update_loss_scale(tf.constant(True))
        m.summaries(step=1)
    writer.flush()
    from tensorflow.core.util import event_pb2
    tags = {}
    for f in tmp_path.iterdir():
        for rec in tf.data.TFRecordDataset(str(f)):
            ev = event_pb2.Event.FromString(rec.numpy())
            for v in ev.summary.value:
                tags[v.tag] = tf.make_ndarray(v.tensor).item()
    assert tags["npu_amp/loss_scale"] == 256.0
    assert tags["npu_amp/overflow_count"] == 0.0 and tags["npu_amp/skipped_steps"] == 0.0


def test_update_inside_tf_function_matches_eager():
    m = ExponentialUpdateLossScaleManager(128, 2, 1, decr_ratio=0.5)
    m.build()

    @tf.function
    def step(f):
        m.update_loss_scale(f)

    for f in [True, True, False, True]:
        step(tf.constant(f))
    st = m.state()
    assert st["loss_scale"] == 128 and st["overflow_count"] == 1
    assert math.isclose(float(m.get_loss_scale()), 128.0)
    assert [e.scale for e in m.history] == [256.0, 128.0]
    np.testing.assert_equal(m.state()["steps"], 4)
