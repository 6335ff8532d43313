"""Keras 2 wrapper: model.fit, custom loops, overflow skip, checkpoints, mixed policy."""
import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from npu_amp_tf import OptionError
from _keras_amp_util import (SAVED_SETTINGS, assert_accumulation_equals_one_batch,
                             assert_saved_settings, data, reload_as_fresh_process)

try:
    K = npu_amp_tf.keras.keras_module()
except OptionError as exc:  # newer TF without tf_keras
    pytest.skip(f"Keras 2 not available: {exc}", allow_module_level=True)

FAMILIES = {"default": lambda lr: K.optimizers.Adam(lr),
            "legacy": lambda lr: K.optimizers.legacy.Adam(lr)}


def _model(seed=0):
    K.utils.set_random_seed(seed)
    return K.Sequential([K.layers.Dense(8, activation="relu", input_shape=(4,)),
                         K.layers.Dense(1)])


def _opt_state(opt, model):
    out = {f"w{i}": v.numpy() for i, v in enumerate(model.weights)}
    for i, v in enumerate(opt.variables()):
        out[f"opt{i}:{v.name}"] = v.numpy()
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fit_trains_and_keeps_fp32_masters(family):
    x, y = data()
    model = _model()
    opt = npu_amp_tf.AMP_Optimizer(FAMILIES[family](0.05), incr_every_n_steps=4)
    assert isinstance(opt, type(FAMILIES[family](0.1)))  # a real optimizer of the same class
    model.compile(optimizer=opt, loss="mse")
    hist = model.fit(x, y, batch_size=8, epochs=4, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    st = opt.loss_scale_manager.state()
    assert st["steps"] == 16 and st["loss_scale"] == 128 * 2 ** 4 and int(opt.iterations) == 16
    assert all(w.dtype == tf.float32 for w in model.weights)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_custom_loop_overflow_skips_and_continues(family):
    x, y = data(8)
    model = _model()
    opt = npu_amp_tf.AMP_Optimizer(FAMILIES[family](0.05), decr_every_n_nan_or_inf=1)

    @tf.function
    def step(bad):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) * tf.where(bad, np.float32(np.inf), 1.0)
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step(tf.constant(False))
    step(tf.constant(False))
    before = _opt_state(opt, model)
    step(tf.constant(True))
    after = _opt_state(opt, model)
    assert before.keys() == after.keys()
    for k in before:  # weights, slots and iterations bit-identical
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    assert int(opt.iterations) == 2
    st = opt.loss_scale_manager.state()
    assert st["loss_scale"] == 64 and st["overflow_count"] == 1 and st["skipped_steps"] == 1
    step(tf.constant(False))
    assert int(opt.iterations) == 3
    assert not np.array_equal(model.weights[0].numpy(), before["w0"])


def test_minimize_in_a_loop_matches_plain_adam_when_nothing_overflows():
    x, y = data(8)
    res = []
    for wrap in (True, False):
        model = _model()
        opt = FAMILIES["legacy"](0.05)
        if wrap:
            opt = npu_amp_tf.AMP_Optimizer(opt, loss_scale_manager=1024)
        for _ in range(3):
            opt.minimize(lambda: tf.reduce_mean(tf.square(model(x) - y)), model.trainable_variables)
        res.append([w.numpy() for w in model.weights])
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_checkpoint_round_trip_both_directions(tmp_path):
    x, y = data(8)

    def train(model, opt, steps, bad_at=()):
        for i in range(steps):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
                if i in bad_at:
                    loss = loss * np.float32(np.inf)
            opt.minimize(loss, model.trainable_variables, tape=tape)

    m1 = _model()
    o1 = npu_amp_tf.AMP_Optimizer(K.optimizers.Adam(0.05), decr_every_n_nan_or_inf=1)
    train(m1, o1, 3, bad_at=(1,))
    assert float(o1.loss_scale) == 64.0
    amp_path = tf.train.Checkpoint(model=m1, optimizer=o1).save(str(tmp_path / "amp"))
    # AMP -> plain Adam
    m2 = _model(seed=5)
    o2 = K.optimizers.Adam(0.05)
    train(m2, o2, 1)  # create slots
    tf.train.Checkpoint(model=m2, optimizer=o2).restore(amp_path).expect_partial()
    for a, b in zip(m1.weights, m2.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(o1.variables(), o2.variables()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    plain_path = tf.train.Checkpoint(model=m2, optimizer=o2).save(str(tmp_path / "plain"))
    # plain -> AMP (fresh scale), and AMP -> AMP (saved scale)
    m3 = _model(seed=7)
    o3 = npu_amp_tf.AMP_Optimizer(K.optimizers.Adam(0.05))
    tf.train.Checkpoint(model=m3, optimizer=o3).restore(plain_path)
    for a, b in zip(m2.weights, m3.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert float(o3.loss_scale) == 128.0
    m4 = _model(seed=9)
    o4 = npu_amp_tf.AMP_Optimizer(K.optimizers.Adam(0.05))
    tf.train.Checkpoint(model=m4, optimizer=o4).restore(amp_path)
    st = o4.loss_scale_manager.state()
    assert st["loss_scale"] == 64.0 and st["overflow_count"] == 1 and st["steps"] == 3


def test_mixed_float16_policy_fit_is_not_wrapped_twice():
    x, y = data(16)
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model()
        opt = npu_amp_tf.AMP_Optimizer(K.optimizers.Adam(0.05))
        model.compile(optimizer=opt, loss="mse")
        assert model.optimizer is opt  # Keras recognises it as a loss-scale optimizer
        assert model.layers[0].kernel.dtype == tf.float32  # FP32 masters
        hist = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
        assert np.isfinite(hist.history["loss"]).all()
        assert hist.history["loss"][-1] < hist.history["loss"][0]
        assert opt.loss_scale_manager.state()["steps"] == 6
    finally:
        K.mixed_precision.set_global_policy("float32")


def test_keep_fp16_copies_and_errors():
    model = _model()
    opt = npu_amp_tf.AMP_Optimizer(K.optimizers.legacy.SGD(0.1), keep_fp16_copies=True)
    x, y = data(8)
    opt.minimize(lambda: tf.reduce_mean(tf.square(model(x) - y)), model.trainable_variables)
    k = model.layers[0].kernel
    np.testing.assert_array_equal(opt.fp16_copy(k).numpy(), k.numpy().astype(np.float16))
    with pytest.raises(OptionError, match="already loss-scaled"):
        npu_amp_tf.AMP_Optimizer(opt)
    with pytest.raises(OptionError, match="decr_ratio=2.*accepted"):
        npu_amp_tf.AMP_Optimizer(K.optimizers.Adam(), decr_ratio=2)


def test_keras3_optimizer_goes_to_the_keras3_wrapper():
    """Keras 2 and Keras 3 side by side (TF >= 2.16 with tf_keras): each optimizer gets the
    wrapper of its own Keras (tests/test_keras3_amp.py covers the Keras 3 one)."""
    keras3 = pytest.importorskip("keras")
    if int(keras3.__version__.split(".")[0]) < 3:
        pytest.skip(f"Keras 3 is not installed for TensorFlow {tf.__version__} (it ships Keras 2)")
    from npu_amp_tf.keras3 import _AmpKeras3Mixin
    from npu_amp_tf.keras import _AmpKerasMixin

    o3 = npu_amp_tf.keras.LossScaleOptimizer(keras3.optimizers.Adam())
    o2 = npu_amp_tf.AMP_Optimizer(K.optimizers.Adam())
    assert isinstance(o3, _AmpKeras3Mixin) and isinstance(o3, keras3.optimizers.Adam)
    assert isinstance(o2, _AmpKerasMixin) and isinstance(o2, K.optimizers.Adam)
    objs = npu_amp_tf.keras.custom_objects()   # one dict serves both load_model()s
    assert objs["AMP_Adam"] is type(o2) and objs["npu_amp_tf>AMP_Adam"] is type(o3)


def test_gradient_accumulation_equivalence_keras():
    """2 micro-batches of 8 == one batch of 16 (FP32, SGD, mean loss)."""
    def make_step(model, opt):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb) - yb))
            opt.minimize(loss, model.trainable_variables, tape=tape)
        return step

    assert_accumulation_equals_one_batch(
        _model, lambda n: npu_amp_tf.AMP_Optimizer(K.optimizers.legacy.SGD(0.1),
                                                   gradient_accumulation_steps=n), make_step)


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_model_save_and_load_keep_the_amp_optimizer(tmp_path, suffix):
    pytest.importorskip("h5py")
    from npu_amp_tf.keras import _AmpKerasMixin

    x, y = data(16)
    model = _model()
    opt = npu_amp_tf.AMP_Optimizer(K.optimizers.Adam(0.05), **SAVED_SETTINGS)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    loaded = reload_as_fresh_process(K, model, str(tmp_path / ("m" + suffix)),
                                     K.utils.get_custom_objects(), "AMP_", "AMP_Adam")
    lopt = loaded.optimizer
    assert isinstance(lopt, _AmpKerasMixin) and type(lopt).__name__ == "AMP_Adam"
    m = assert_saved_settings(lopt)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # training resumes with AMP
    assert m.state()["steps"] == 2
