"""Helpers shared by the Keras 2 (test_keras_amp.py) and Keras 3
(test_keras3_amp.py) AMP_Optimizer tests."""
import numpy as np
import pytest

import npu_amp_tf

#: loss-scale settings the save/load tests give AMP_Optimizer and expect back
SAVED_SETTINGS = dict(incr_every_n_steps=7, decr_ratio=0.25, keep_fp16_copies=True)


def data(n=32):
    """x [n, 4] and y = x @ w for a fixed w (a linear target a Dense net learns)."""
    rng = np.random.RandomState(0)
    x = rng.randn(n, 4).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)).astype(np.float32)


def reload_as_fresh_process(keras_mod, model, path, registry, prefix, class_name):
    """``model.save(path)``, then ``load_model`` as a process that has not built
    the AMP classes: with the ``prefix`` entries taken out of ``registry`` it
    must fail naming ``class_name``, and load with
    ``npu_amp_tf.keras.custom_objects()``.  The registry is restored."""
    model.save(path)
    saved = {k: registry.pop(k) for k in list(registry) if k.startswith(prefix)}
    try:
        with pytest.raises(Exception, match=class_name):
            keras_mod.models.load_model(path)
        return keras_mod.models.load_model(path, custom_objects=npu_amp_tf.keras.custom_objects())
    finally:
        registry.update(saved)


def assert_saved_settings(lopt):
    """The loaded optimizer carries SAVED_SETTINGS."""
    m = lopt.loss_scale_manager
    assert (m.incr_every_n_steps, m.decr_ratio) == (SAVED_SETTINGS["incr_every_n_steps"],
                                                    SAVED_SETTINGS["decr_ratio"])
    assert lopt._npu_amp_core.keep_fp16_copies
    return m


def assert_accumulation_equals_one_batch(make_model, make_opt, make_step):
    """gradient_accumulation_steps=2 over two micro-batches of 8 == one step on
    the batch of 16: no update after the first micro-batch, one after the
    second, the same weights.  ``make_opt(n)`` builds the AMP optimizer with
    ``gradient_accumulation_steps=n``; ``make_step(model, opt)`` returns a
    ``tf.function`` step ``(xb, yb)``."""
    import tensorflow as tf

    x, y = data(16)
    res = []
    for n, batches in ((2, [(x[:8], y[:8]), (x[8:], y[8:])]), (1, [(x, y)])):
        model = make_model()
        opt = make_opt(n)
        w0 = model.weights[0].numpy()
        step = make_step(model, opt)
        for i, (xb, yb) in enumerate(batches):
            step(tf.constant(xb), tf.constant(yb))
            if n == 2 and i == 0:
                np.testing.assert_array_equal(model.weights[0].numpy(), w0)
                assert int(opt.iterations) == 0
        assert int(opt.iterations) == 1
        res.append([w.numpy() for w in model.weights])
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
