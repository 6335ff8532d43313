"""TransData custom op: C++ kernels vs the NumPy reference in graph_passes.layout.formats."""
import numpy as np
import pytest
import tensorflow as tf

from graph_passes.layout import formats
from npu_amp_tf import ops
from npu_amp_tf.errors import NpuAmpError

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16, "int8": tf.int8}


def _rand(shape, dtype, seed=0):
    rng = np.random.RandomState(seed)
    if dtype == "int8":
        return rng.randint(-128, 128, size=shape).astype(np.int8)
    return tf.constant(rng.randn(*shape).astype(np.float32) + 0.5, dtype=DTYPES[dtype]).numpy()


def _np(t):
    return t.numpy().astype(np.float32) if t.dtype == tf.bfloat16 else t.numpy()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("channels", [3, 17, 24])
@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
def test_activation_roundtrip_matches_reference(dtype, channels, fmt):
    shape = [1, 5, 4, channels] if fmt == "NHWC" else [1, channels, 5, 4]
    x = _rand(shape, dtype)
    y = ops.trans_data(x, fmt, "NC1HWC0")
    c0 = 32 if dtype == "int8" else 16
    assert y.shape == (1, -(-channels // c0), 5, 4, c0)
    ref = formats.to_nc1hwc0(x if dtype != "bfloat16" else x.astype(np.float32), fmt, c0)
    np.testing.assert_array_equal(_np(y), ref.astype(_np(y).dtype))
    # padding lanes are zero
    if channels % c0:
        assert not _np(y)[:, -1, ..., channels % c0:].any()
    orig = [-1, -1, -1, channels] if fmt == "NHWC" else [-1, channels, -1, -1]
    back = ops.trans_data(y, "NC1HWC0", fmt, orig_shape=orig)
    np.testing.assert_array_equal(_np(back), x if dtype != "bfloat16" else x.astype(np.float32))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cin,cout", [(3, 17), (17, 24), (24, 3)])
def test_fractal_z_roundtrip_matches_reference(dtype, cin, cout):
    w = _rand([3, 2, cin, cout], dtype, seed=1)
    f = ops.trans_data(w, "HWCN", "FRACTAL_Z")
    assert list(f.shape) == formats.fractal_z_shape([3, 2, cin, cout], dtype)
    wf = w if dtype != "bfloat16" else w.astype(np.float32)
    ref = formats.to_fractal_z(wf, 32 if dtype == "int8" else 16)
    np.testing.assert_array_equal(_np(f), ref)
    np.testing.assert_array_equal(formats.from_fractal_z(ref, [3, 2, cin, cout]), wf)
    back = ops.trans_data(f, "FRACTAL_Z", "HWCN", orig_shape=[3, 2, cin, cout])
    np.testing.assert_array_equal(_np(back), wf)


def test_per_channel_vector():
    b = np.arange(1, 18, dtype=np.float32)
    y = ops.trans_data(b, "C", "NC1HWC0").numpy()
    assert y.shape == (1, 2, 1, 1, 16)
    np.testing.assert_array_equal(y, formats.to_nc1hwc0(b, "C"))
    assert y[0, 1, 0, 0, 1:].sum() == 0
    np.testing.assert_array_equal(ops.trans_data(y, "NC1HWC0", "C", orig_shape=[17]).numpy(), b)


def test_shape_function_in_graph_mode():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 7, 7, 17])
        y = ops.trans_data(x, "NHWC", "NC1HWC0")
        assert y.shape.as_list() == [None, 2, 7, 7, 16]
        z = ops.trans_data(y, "NC1HWC0", "NHWC", orig_shape=[-1, -1, -1, 17])
        assert z.shape.as_list() == [None, 7, 7, 17]
        w = tf.compat.v1.placeholder(tf.int8, [3, 3, 17, 20])
        assert ops.trans_data(w, "HWCN", "FRACTAL_Z").shape.as_list() == [9, 2, 16, 32]  # C0=32: C1=1


def test_gradient_is_the_inverse_transdata():
    x = tf.constant(np.random.RandomState(2).randn(1, 3, 2, 17), tf.float64)

    def f(v):
        y = ops.trans_data(tf.cast(v, tf.float32), "NHWC", "NC1HWC0")
        return tf.cast(y * 1.5, tf.float64)

    theo, num = tf.test.compute_gradient(f, [x], delta=1e-2)
    np.testing.assert_allclose(theo[0], num[0], atol=1e-3)
    w = tf.Variable(np.random.RandomState(3).randn(2, 2, 17, 5).astype(np.float32))
    with tf.GradientTape() as tape:
        f = ops.trans_data(w, "HWCN", "FRACTAL_Z")
        loss = tf.reduce_sum(f * f)
    g = tape.gradient(loss, w)
    np.testing.assert_allclose(g.numpy(), 2 * w.numpy(), rtol=1e-6)
    y = tf.Variable(np.random.RandomState(4).randn(1, 2, 3, 3, 16).astype(np.float32))
    with tf.GradientTape() as tape:
        z = ops.trans_data(y, "NC1HWC0", "NHWC", orig_shape=[-1, -1, -1, 17])
        loss = tf.reduce_sum(z)
    gy = tape.gradient(loss, y).numpy()
    assert gy.shape == (1, 2, 3, 3, 16)
    assert gy[:, 0].min() == 1 and gy[:, 1, ..., 0].min() == 1 and gy[:, 1, ..., 1:].max() == 0


def test_bad_input_errors_name_the_accepted_values():
    with pytest.raises(NpuAmpError, match="accepted"):
        ops.trans_data(np.zeros([1, 2, 2, 3], np.float32), "NHWC", "FRACTAL_Z")
    with pytest.raises(NpuAmpError, match="float64"):
        ops.trans_data(np.zeros([1, 2, 2, 3]), "NHWC", "NC1HWC0")
    with pytest.raises(NpuAmpError, match="orig_shape"):
        ops.trans_data(np.zeros([1, 1, 2, 2, 16], np.float32), "NC1HWC0", "NHWC")
    with pytest.raises(tf.errors.InvalidArgumentError, match="channel count"):
        ops.trans_data(np.zeros([1, 1, 2, 2, 16], np.float32), "NC1HWC0", "NHWC",
                       orig_shape=[-1, -1, -1, 40])
    with pytest.raises(formats.FormatError, match="accepted"):
        formats.c0_for("float64")
