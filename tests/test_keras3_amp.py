"""AMP_Optimizer on Keras 3 optimizers (tf.keras on TF >= 2.16): model.fit, custom loops,
overflow skip bit-identical, Keras 3's own LossScaleOptimizer as the reference, FP16 copies,
gradient accumulation, summaries, .keras files and tf.train.Checkpoint both ways."""
import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from npu_amp_tf import OptionError

keras = pytest.importorskip("keras")
if int(keras.__version__.split(".")[0]) < 3:
    pytest.skip(f"Keras 3 is not installed for TensorFlow {tf.__version__} (it ships Keras 2)",
                allow_module_level=True)

from npu_amp_tf.keras3 import _AmpKeras3Mixin  # noqa: E402
from _keras_amp_util import (SAVED_SETTINGS, assert_accumulation_equals_one_batch,  # noqa: E402
                             assert_saved_settings, data, reload_as_fresh_process)


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1)])


def _state(opt, model):
    return [v.numpy() for v in model.weights] + [v.numpy() for v in opt.variables]


def _loop(model, opt, x, y, keras2_style=False, eager=False):
    """One custom-loop step function; ``bad`` multiplies the loss by inf."""
    def step(bad):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) * tf.where(bad, np.float32(np.inf), 1.0)
            scaled = opt.get_scaled_loss(loss) if keras2_style else opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        if keras2_style:
            grads = opt.get_unscaled_gradients(grads)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return step if eager else tf.function(step)


def test_fit_trains_fp32_masters_cann_defaults_and_no_double_wrap():
    x, y = data()
    model = _model()
    opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam(0.05), incr_every_n_steps=4)
    # a real Adam, and nominally Keras's LossScaleOptimizer (compile must not wrap it again)
    assert isinstance(opt, keras.optimizers.Adam)
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    assert float(opt.dynamic_scale) == 128.0  # CANN's default initial scale
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        fp16_model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        fp16_opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.SGD(0.1))
        fp16_model.compile(optimizer=fp16_opt, loss="mse")
        assert fp16_model.optimizer is fp16_opt
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    model.compile(optimizer=opt, loss="mse")
    hist = model.fit(x, y, batch_size=8, epochs=4, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    st = opt.loss_scale_manager.state()
    assert st["steps"] == 16 and st["loss_scale"] == 128 * 2 ** 4 and int(opt.iterations) == 16
    assert all(w.dtype == "float32" for w in model.weights)
    # the slots are exactly plain Adam's
    plain = keras.optimizers.Adam(0.05)
    plain.build(model.trainable_variables)
    assert [v.name for v in opt.variables] == [v.name for v in plain.variables]


def test_matches_keras3_loss_scale_optimizer_bit_for_bit():
    """Keras's own LossScaleOptimizer (initial 128, growth every 3, halve on overflow) is the
    reference: with power-of-two scales, unscaling by x*(1/s) or x/s is exact, so weights,
    slots, iterations and the scale must agree exactly, through an overflow step that both
    skip (variables, slots and ``iterations`` keep their bits) - in Keras 3's loop
    (scale_loss + apply_gradients) and in Keras 2's (get_unscaled_gradients first)."""
    x, y = data(8)
    ref = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.05), initial_scale=128,
                                              dynamic_growth_steps=3)
    runs = [(_model(), ref, False)]
    for keras2_style in (False, True):
        runs.append((_model(), npu_amp_tf.AMP_Optimizer(
            keras.optimizers.Adam(0.05), incr_every_n_steps=3, decr_every_n_nan_or_inf=1,
            decr_ratio=0.5), keras2_style))
    # eagerly (the tf.function path is in the other tests): the manager's tf.cond runs
    # one Python branch per step
    steps = [_loop(m, o, x, y, k2, eager=True) for m, o, k2 in runs]
    bad_at = 2
    for i in range(6):
        bad = tf.constant(i == bad_at)
        befores = [_state(o, m) if i == bad_at else None for m, o, _ in runs[1:]]
        for step in steps:
            step(bad)
        for (m, o, _), before in zip(runs[1:], befores):
            if before is not None:
                for a, b in zip(before, _state(o, m)):
                    np.testing.assert_array_equal(a, b)
            for a, b in zip(runs[0][0].weights, m.weights):
                np.testing.assert_array_equal(a.numpy(), b.numpy())
            assert float(o.dynamic_scale) == float(ref.dynamic_scale)
    for _, amp, _ in runs[1:]:
        for a, b in zip(ref.inner_optimizer.variables, amp.variables):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        assert int(amp.iterations) == int(ref.iterations) == 5
        st = amp.loss_scale_manager.state()
        assert st["overflow_count"] == 1 and st["skipped_steps"] == 1 and st["steps"] == 6
        # the history: the overflow at step 3 halves the scale, 3 finite steps double it again
        assert [(e.step, e.scale, e.overflow) for e in amp.loss_scale_manager.history] == [
            (3, 64.0, True), (6, 128.0, False)]


def test_one_fused_finiteness_check_vs_keras_per_variable_checks():
    x, y = data(8)
    counts = {}
    for name, opt in (("keras", keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))),
                      ("amp", npu_amp_tf.AMP_Optimizer(keras.optimizers.SGD(0.1)))):
        model = _model()
        opt.build(model.trainable_variables)
        g = _loop(model, opt, x, y).get_concrete_function(tf.constant(False)).graph
        counts[name] = {t: sum(op.type == t for op in g.get_operations())
                        for t in ("IsFinite", "All")}
    assert counts["amp"] == {"IsFinite": 1, "All": 1}, counts      # 4 small gradients, 1 check
    assert counts["keras"]["IsFinite"] == 4, counts                # Keras: one per gradient


def test_hysteresis_fp16_copies_and_summaries(tmp_path):
    x, y = data(8)
    model = _model()
    opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.SGD(0.1), keep_fp16_copies=True)
    step = _loop(model, opt, x, y)
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=0):
        for bad in (False, True, False, True):
            step(tf.constant(bad))
    writer.flush()
    st = opt.loss_scale_manager.state()
    # CANN hysteresis: decr_every_n_nan_or_inf=2 overflows before the scale drops (x0.5)
    assert st["loss_scale"] == 64 and st["overflow_count"] == 2 and int(opt.iterations) == 2
    k = model.weights[0]
    np.testing.assert_array_equal(opt.fp16_copy(k).numpy(), k.numpy().astype(np.float16))
    from tensorflow.core.util import event_pb2
    tags = set()
    for f in tmp_path.iterdir():
        for rec in tf.data.TFRecordDataset(str(f)):
            tags |= {v.tag for v in event_pb2.Event.FromString(rec.numpy()).summary.value}
    assert {"npu_amp/loss_scale", "npu_amp/overflow_count", "npu_amp/skipped_steps"} <= tags


def test_gradient_accumulation_equals_one_big_batch():
    def make_step(model, opt):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(tf.reduce_mean(tf.square(model(xb) - yb)))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
        return step

    assert_accumulation_equals_one_batch(
        _model, lambda n: npu_amp_tf.AMP_Optimizer(keras.optimizers.SGD(0.1),
                                                   gradient_accumulation_steps=n), make_step)


def test_model_save_and_load_with_and_without_amp(tmp_path):
    x, y = data(16)
    model = _model()
    opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.AdamW(0.05), **SAVED_SETTINGS)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    loaded = reload_as_fresh_process(keras, model, str(tmp_path / "m.keras"),
                                     keras.saving.get_custom_objects(), "npu_amp_tf>", "AMP_AdamW")
    lopt = loaded.optimizer
    assert isinstance(lopt, _AmpKeras3Mixin) and isinstance(lopt, keras.optimizers.AdamW)
    m = assert_saved_settings(lopt)
    for a, b in zip(opt.variables, lopt.variables):  # slots travel in the .keras file
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # training resumes with AMP
    assert m.state()["steps"] == 2
    # the same .keras file loads without AMP (a plain AdamW with the same slots) ...
    plain = _model()
    plain.compile(optimizer=keras.optimizers.AdamW(0.05), loss="mse")
    with tf.GradientTape() as tape:   # one eager step: non-zero slots
        loss = tf.reduce_mean(tf.square(plain(x) - y))
    plain.optimizer.apply_gradients(zip(tape.gradient(loss, plain.trainable_variables),
                                        plain.trainable_variables))
    plain_path = str(tmp_path / "plain.keras")
    plain.save(plain_path)
    # ... and a plain model's file loads into an AMP-compiled model's optimizer
    amp_model = _model(1)
    amp_model.compile(optimizer=npu_amp_tf.AMP_Optimizer(keras.optimizers.AdamW(0.05)),
                      loss="mse")
    amp_model.optimizer.build(amp_model.trainable_variables)
    amp_model.load_weights(plain_path)
    assert len(plain.optimizer.variables) == len(amp_model.optimizer.variables) == 10
    for a, b in zip(plain.optimizer.variables, amp_model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_tf_train_checkpoint_both_ways(tmp_path):
    x, y = data(8)
    model_a, model_p = _model(), _model()
    amp = npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam(0.05))
    plain = keras.optimizers.Adam(0.05)
    step_a = _loop(model_a, amp, x, y)
    for bad in (False, True, False):
        step_a(tf.constant(bad))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model_p(x) - y))
    plain.apply_gradients(zip(tape.gradient(loss, model_p.trainable_variables),
                              model_p.trainable_variables))
    amp_path = tf.train.Checkpoint(model=model_a, optimizer=amp).save(str(tmp_path / "amp"))
    plain_path = tf.train.Checkpoint(model=model_p, optimizer=plain).save(str(tmp_path / "plain"))
    names = [n for n, _ in tf.train.list_variables(amp_path)]
    assert "optimizer/loss_scale_manager/loss_scale/.ATTRIBUTES/VARIABLE_VALUE" in names

    # AMP checkpoint -> plain optimizer: slots and iterations restored
    m2, o2 = _model(1), keras.optimizers.Adam(0.05)
    o2.build(m2.trainable_variables)
    tf.train.Checkpoint(model=m2, optimizer=o2).restore(amp_path).expect_partial()
    for a, b in zip(amp.variables, o2.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(o2.iterations) == 2

    # plain checkpoint -> AMP optimizer: slots restored, loss scale stays at its default
    m3 = _model(1)
    o3 = npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam(0.05))
    o3.build(m3.trainable_variables)
    status = tf.train.Checkpoint(model=m3, optimizer=o3).restore(plain_path)
    unmatched = str(pytest.raises(AssertionError, status.assert_existing_objects_matched).value)
    assert "loss_scale:0" in unmatched and "adam" not in unmatched  # only the AMP state is new
    for a, b in zip(plain.variables, o3.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert float(o3.dynamic_scale) == 128.0

    # AMP -> AMP: the loss-scale state too
    m4 = _model(1)
    o4 = npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam(0.05))
    o4.build(m4.trainable_variables)
    tf.train.Checkpoint(model=m4, optimizer=o4).restore(amp_path).assert_consumed()
    assert o4.loss_scale_manager.state() == amp.loss_scale_manager.state()


class Adam(keras.optimizers.Adam):
    """A user subclass that shares its name with Keras's Adam."""


def test_user_subclass_with_a_builtin_name_gets_its_own_class():
    a = npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam())
    b = npu_amp_tf.AMP_Optimizer(Adam())
    assert type(a) is not type(b) and isinstance(b, Adam) and not isinstance(a, Adam)
    assert keras.saving.get_registered_object(keras.saving.get_registered_name(type(b))) is type(b)


def test_stateless_apply_behaves_as_keras_tf_backend():
    model = _model()
    opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam())
    opt.build(model.trainable_variables)
    plain = keras.optimizers.Adam()
    plain.build(model.trainable_variables)
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    msgs = []
    for o in (plain, opt):
        with pytest.raises(ValueError) as exc:
            o.stateless_apply([v.value for v in o.variables], grads,
                              [v.value for v in model.trainable_variables])
        msgs.append(str(exc.value))
    assert msgs[0] == msgs[1] and "TensorFlow backend" in msgs[0]


def test_bad_input_is_one_clear_error():
    opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam())
    with pytest.raises(OptionError, match="already loss-scaled"):
        npu_amp_tf.AMP_Optimizer(opt)
    with pytest.raises(OptionError, match="already loss-scaled"):
        npu_amp_tf.AMP_Optimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))
    with pytest.raises(OptionError, match="loss_scale_factor=4.0.*accepted: None"):
        npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam(loss_scale_factor=4.0))
    with pytest.raises(OptionError, match="gradient_accumulation_steps is set twice"):
        npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam(gradient_accumulation_steps=2),
                                 gradient_accumulation_steps=2)
    built = keras.optimizers.Adam()
    built.build(_model().trainable_variables)
    with pytest.raises(OptionError, match="already built"):
        npu_amp_tf.AMP_Optimizer(built)
    with pytest.raises(OptionError, match="decr_ratio=2.*accepted"):
        npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam(), decr_ratio=2)
