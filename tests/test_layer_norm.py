"""LayerNorm custom op (C++ kernel vs NumPy, fp32/fp16/bf16, gradient) and the
three LayerNorm fusion rules (BERT moments, Keras 2, Keras 3)."""
import numpy as np
import pytest

from _fusion_util import build, op_counts, rewrite, run_gd, tf, tf1
from npu_amp_tf import fused_ops
from npu_amp_tf.errors import NpuAmpError

RNG = np.random.default_rng(1)


def _ref(x, g, b, eps):
    x = x.astype(np.float64)
    m = x.mean(-1, keepdims=True)
    v = x.var(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * g.astype(np.float64) + b.astype(np.float64)


@pytest.mark.parametrize("dtype,tol", [(tf.float32, 1e-5), (tf.float16, 2e-2), (tf.bfloat16, 1e-1)])
def test_kernel_matches_numpy(dtype, tol):
    x = (RNG.standard_normal((3, 5, 16)) * 3 + 1).astype(np.float32)
    g = RNG.uniform(0.5, 1.5, 16).astype(np.float32)
    b = RNG.standard_normal(16).astype(np.float32)
    xt, gt, bt = (tf.cast(t, dtype) for t in (x, g, b))
    y = fused_ops.layer_norm(xt, gt, bt, epsilon=1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    want = _ref(tf.cast(xt, tf.float32).numpy(), tf.cast(gt, tf.float32).numpy(),
                tf.cast(bt, tf.float32).numpy(), 1e-5)
    np.testing.assert_allclose(tf.cast(y, tf.float32).numpy(), want, atol=tol, rtol=tol)


def test_kernel_multi_axis_gamma():
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    g = RNG.standard_normal((3, 4)).astype(np.float32)
    b = RNG.standard_normal((3, 4)).astype(np.float32)
    y = fused_ops.layer_norm(x, g, b, 1e-3).numpy()
    xf = x.reshape(2, 12)
    np.testing.assert_allclose(y.reshape(2, 12), _ref(xf, g.reshape(-1), b.reshape(-1), 1e-3), atol=1e-5)


def test_kernel_bad_input_one_clear_error():
    with pytest.raises(tf.errors.InvalidArgumentError, match="trailing dims"):
        fused_ops.layer_norm(tf.zeros([2, 5]), tf.ones([4]), tf.zeros([4]))
    with pytest.raises(NpuAmpError, match="epsilon"):
        fused_ops.layer_norm(tf.zeros([2, 4]), tf.ones([4]), tf.zeros([4]), epsilon=-1.0)


def test_gradient_kernels_bad_input_one_clear_error():
    """Both gradient kernels name the op and the input that does not fit (one
    shared check in custom_ops/norm_common.h)."""
    lib = fused_ops._lib
    x, g, row = tf.zeros([3, 4]), tf.ones([4]), tf.zeros([3])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"LayerNormGrad: dy \[2,4\] and x \[3,4\]"):
        lib.layer_norm_grad(tf.zeros([2, 4]), x, g, row, row)
    with pytest.raises(tf.errors.InvalidArgumentError, match="LayerNormGrad: mean/inv_std must have 3 elements, got 2"):
        lib.layer_norm_grad(x, x, g, row, tf.zeros([2]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"RMSNormGrad: dy \[3,5\] and x \[3,4\]"):
        lib.rms_norm_grad(tf.zeros([3, 5]), x, g, row)
    with pytest.raises(tf.errors.InvalidArgumentError, match="RMSNormGrad: inv_rms must have 3 elements, got 4"):
        lib.rms_norm_grad(x, x, g, tf.zeros([4]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="RMSNorm: the trailing dims of x"):
        lib.rms_norm_grad(tf.zeros([3, 5]), tf.zeros([3, 5]), g, row)


#: relative rounding of one value stored in the dtype (half an ulp): the kernel
#: accumulates in fp32, so its only error beyond fp32 noise is that final rounding
HALF_ULP = {tf.float32: 2.0 ** -24, tf.float16: 2.0 ** -11, tf.bfloat16: 2.0 ** -8}


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_gradient(dtype):
    x = tf.constant(RNG.standard_normal((2, 3, 6)), dtype)
    g = tf.constant(RNG.uniform(0.5, 1.5, 6), dtype)
    b = tf.constant(RNG.standard_normal(6), dtype)
    dy = tf.cast(tf.constant(RNG.standard_normal((2, 3, 6)), tf.float32), dtype)
    if dtype == tf.float32:  # against finite differences (their own error is ~1e-3 at this step)
        theo, num = tf.test.compute_gradient(lambda x, g, b: fused_ops.layer_norm(x, g, b, 1e-5), [x, g, b])
        for t, n in zip(theo, num):
            np.testing.assert_allclose(t, n, atol=2e-3, rtol=2e-3)
    # against fp32 autodiff of the unfused formula at the same (already rounded) inputs and dy
    xf, gf, bf, dyf = (tf.cast(t, tf.float32) for t in (x, g, b, dy))
    with tf.GradientTape() as tape:
        tape.watch([xf, gf, bf])
        m, v = tf.nn.moments(xf, [-1], keepdims=True)
        ref = (xf - m) * tf.math.rsqrt(v + 1e-5) * gf + bf
    want = tape.gradient(ref, [xf, gf, bf], output_gradients=dyf)
    with tf.GradientTape() as tape:
        tape.watch([x, g, b])
        y = fused_ops.layer_norm(x, g, b, 1e-5)
    got = tape.gradient(y, [x, g, b], output_gradients=dy)
    # rtol: the output rounding to dtype plus fp32 summation-order noise (1e-5);
    # atol: fp32 cancellation noise in dx's (g - mean(g) - xhat*mean(g*xhat)), 1e-5 of the scale.
    # A zero or wrong-sign gradient fails: every tensor has entries of order 1.
    for a, w in zip(got, want):
        assert a.dtype == dtype
        w = w.numpy()
        assert np.abs(w).max() > 0.1
        np.testing.assert_allclose(tf.cast(a, tf.float32).numpy(), w,
                                   rtol=HALF_ULP[dtype] * 1.01 + 1e-5, atol=1e-5 * np.abs(w).max())


# ------------------------------------------------------------------ fusion
def _bert_ln(axis=-1, extra=False, eps=1e-12):
    def f():
        x = tf1.placeholder(tf.float32, [4, 3, 8], name="x")
        h = x * 2.0
        mean, var = tf.nn.moments(h, [axis], keepdims=True)
        gamma = tf.constant(RNG.uniform(0.5, 1.5, 8).astype(np.float32))
        beta = tf.constant(RNG.standard_normal(8).astype(np.float32))
        if axis != -1:
            gamma, beta = tf.ones([1, 1, 1]), tf.zeros([1, 1, 1])
        y = tf.nn.batch_normalization(h, mean, var, beta, gamma, eps)
        if extra:
            y = y + tf.reduce_sum(mean)
        return tf.identity(y, name="out")
    return build(f)[0]


FEED = {"x": RNG.standard_normal((4, 3, 8)).astype(np.float32)}


def test_bert_moments_fused_and_equal():
    gd = _bert_ln()
    new, rep = rewrite(gd, ["out"])
    c = op_counts(new)
    assert c["LayerNorm"] == 1 and c["Mean"] == 0 and c["Rsqrt"] == 0 and c["SquaredDifference"] == 0
    assert rep.pass_stats("fusion")["fused"] == {"layer_norm_moments": 1}
    ln = [n for n in new.node if n.op == "LayerNorm"][0]
    assert ln.attr["epsilon"].f == pytest.approx(1e-12)
    np.testing.assert_allclose(run_gd(gd, ["out"], FEED)[0], run_gd(new, ["out"], FEED)[0], atol=1e-5)


def test_moments_not_over_last_axis_no_match():
    gd = _bert_ln(axis=1)
    new, rep = rewrite(gd, ["out"])
    assert op_counts(new)["LayerNorm"] == 0
    assert "not over the last axis" in str(rep.decisions)


def test_external_consumer_of_mean_no_fusion():
    gd = _bert_ln(extra=True)
    new, _ = rewrite(gd, ["out"])
    assert op_counts(new)["LayerNorm"] == 0


def _keras_ln_graph(training=False):
    def f():
        x = tf1.placeholder(tf.float32, [4, 3, 8], name="x")
        h = tf.keras.layers.Dense(8, name="d")(x)
        y = tf.keras.layers.LayerNormalization(name="ln")(h)
        out = tf.identity(y, name="out")
        if training:
            loss = tf.reduce_mean(tf.square(out), name="loss")
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return build(f)[0]


def test_keras_layer_normalization_fused():
    gd = _keras_ln_graph()
    new, rep = rewrite(gd, ["out"])
    fused = rep.pass_stats("fusion")["fused"]
    assert op_counts(new)["LayerNorm"] == 1
    assert set(fused) & {"layer_norm_keras2", "layer_norm_keras3", "layer_norm_moments"}
    assert op_counts(new)["FusedBatchNormV3"] == 0 and op_counts(new)["Fill"] == 0  # dead subgraph gone
    a = run_gd(gd, ["out"], FEED, init="init")[0]
    b = run_gd(new, ["out"], FEED, init="init")[0]
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_training_graph_layer_norm_and_gradient_fused():
    """Policy (issue 14): the backward pass that reads the pattern's inner
    tensors becomes one LayerNormGrad; one SGD step gives the same weights
    (tests/test_fusion_ln_training.py has the full matrix)."""
    gd = _keras_ln_graph(training=True)
    new, rep = rewrite(gd, ["train", "loss"])
    c = op_counts(new)
    assert c["LayerNorm"] == 1 and c["LayerNormGrad"] == 1 and c["FusedBatchNormGradV3"] == 0
    fetch = ["d/kernel/Read/ReadVariableOp", "ln/gamma/Read/ReadVariableOp", "loss"]
    a0 = run_gd(gd, fetch, FEED, init="init")
    a = run_gd(gd, fetch, FEED, init="init", steps=("train", 1))
    b = run_gd(new, fetch, FEED, init="init", steps=("train", 1))
    for w0, x, y in zip(a0, a, b):
        assert np.abs(x - w0).max() > 1e-6  # the step moved it (a zero gradient would fail)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_tf_function_frozen_keras3_style_graph():
    """A tf.function graph (frozen), in whichever Keras this TF ships."""
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    layer = tf.keras.layers.LayerNormalization(epsilon=1e-6)
    fn = tf.function(lambda x: layer(x) * 1.0)
    cf = fn.get_concrete_function(tf.TensorSpec([4, 3, 8], tf.float32, name="x"))
    frozen = convert_variables_to_constants_v2(cf)
    gd = frozen.graph.as_graph_def()
    out = frozen.outputs[0].name.split(":")[0]
    inp = frozen.inputs[0].name.split(":")[0]
    new, rep = rewrite(gd, [out])
    assert op_counts(new)["LayerNorm"] == 1, rep.pass_stats("fusion")
    feed = {inp: FEED["x"]}
    np.testing.assert_allclose(run_gd(gd, [out], feed)[0], run_gd(new, [out], feed)[0], atol=1e-4)


# ------------------------------------------- LayerNorm / RMSNorm as people write them
def _gamma_beta(d=8):
    return (tf.constant(RNG.uniform(0.5, 1.5, d).astype(np.float32), name="gamma"),
            tf.constant(RNG.standard_normal(d).astype(np.float32), name="beta"))


def _raw_rsqrt_reduce_mean(x):
    g, b = _gamma_beta()
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-6) * g + b


def _raw_rsqrt_moments(x):
    g, b = _gamma_beta()
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-5) * g + b


def _raw_div_sqrt(x):
    g, b = _gamma_beta()
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    var = tf.math.reduce_variance(x, axis=-1, keepdims=True)
    return g * (x - mean) / tf.sqrt(var + 1e-12) + b


def _raw_no_affine(x):
    mean, var = tf.nn.moments(x, axes=[2], keepdims=True)
    return (x - mean) / tf.sqrt(var + 1e-3)


def _t5_rms(x):  # HF transformers TFT5LayerNorm.call
    w = tf.constant(RNG.uniform(0.5, 1.5, 8).astype(np.float32), name="weight")
    variance = tf.math.reduce_mean(tf.math.square(x), axis=-1, keepdims=True)
    x = x * tf.math.rsqrt(variance + 1e-6)
    return w * x


def _llama_rms(x):  # LLaMA-style: x / sqrt(mean(x**2) + eps) * weight
    w = tf.constant(RNG.uniform(0.5, 1.5, 8).astype(np.float32), name="weight")
    return x / tf.sqrt(tf.reduce_mean(tf.pow(x, 2.0), axis=-1, keepdims=True) + 1e-5) * w


@pytest.mark.parametrize("form,op", [(_raw_rsqrt_reduce_mean, "LayerNorm"), (_raw_rsqrt_moments, "LayerNorm"),
                                     (_raw_div_sqrt, "LayerNorm"), (_raw_no_affine, "LayerNorm"),
                                     (_t5_rms, "RMSNorm"), (_llama_rms, "RMSNorm")])
def test_norm_forms_fuse_to_one_op(form, op):
    def f():
        x = tf1.placeholder(tf.float32, [4, 3, 8], name="x")
        return tf.identity(form(x * 2.0 + 1.0), name="out")
    gd, _ = build(f)
    new, rep = rewrite(gd, ["out"])
    c = op_counts(new)
    assert c[op] == 1, rep.pass_stats("fusion")
    # everything of the norm is gone: only the input's Mul/Add, the op, Identity, Placeholder, Consts
    assert c["Mean"] == 0 and c["Rsqrt"] + c["Sqrt"] == 0 and c["Sub"] == 0
    assert set(c) <= {"Placeholder", "Mul", "AddV2", op, "Identity", "Const"}, c
    np.testing.assert_allclose(run_gd(gd, ["out"], FEED)[0], run_gd(new, ["out"], FEED)[0],
                               rtol=1e-5, atol=2e-5)


def test_fetched_inner_tensor_is_reported():
    def f():
        x = tf1.placeholder(tf.float32, [4, 3, 8], name="x")
        mean = tf.reduce_mean(x, axis=-1, keepdims=True, name="mu")
        var = tf.reduce_mean(tf.square(x - mean), axis=-1, keepdims=True)
        return tf.identity((x - mean) * tf.math.rsqrt(var + 1e-6), name="out")
    gd, _ = build(f)
    new, rep = rewrite(gd, ["out", "mu"])
    assert op_counts(new)["LayerNorm"] == 0
    assert any("not fused: 'mu' is fetched" in str(d.get("fusion_reason")) for d in rep.decisions.values())
    # the tree-matched rules say it too
    gd = _bert_ln()
    new, rep = rewrite(gd, ["out", "moments/mean"])
    assert op_counts(new)["LayerNorm"] == 0
    assert any("not fused: 'moments/mean' is fetched" in str(d.get("fusion_reason"))
               for d in rep.decisions.values()), rep.decisions


def test_keras2_both_paths_and_keras3():
    """tf.keras LayerNormalization on the last axis (Keras 2: FusedBatchNormV3 path;
    Keras 3: moments + Neg) and on a non-last axis list (Keras 2's moments +
    batch_normalization path), frozen from a tf.function."""
    from _fusion_util import freeze
    for axis in (-1, [1, 2]):
        layer = tf.keras.layers.LayerNormalization(axis=axis, epsilon=1e-5)
        layer.build([2, 3, 8])
        layer.set_weights([RNG.uniform(0.5, 1.5, w.shape).astype(np.float32) for w in layer.get_weights()])
        gd, (inp,), out = freeze(lambda x: layer(x), ([2, 3, 8], tf.float32, "x"))
        new, rep = rewrite(gd, [out])
        assert op_counts(new)["LayerNorm"] == 1, (axis, rep.pass_stats("fusion"))
        feed = {inp: RNG.standard_normal((2, 3, 8)).astype(np.float32) * 3}
        np.testing.assert_allclose(run_gd(gd, [out], feed)[0], run_gd(new, [out], feed)[0],
                                   rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype,tol", [(tf.float32, 1e-6), (tf.float16, 1e-3), (tf.bfloat16, 8e-3)])
def test_rms_norm_kernel(dtype, tol):
    x = tf.cast(RNG.standard_normal((3, 5, 16)) * 3, dtype)
    g = tf.cast(RNG.uniform(0.5, 1.5, 16), dtype)
    y = fused_ops.rms_norm(x, g, 1e-6)
    assert y.dtype == dtype
    xf = tf.cast(x, tf.float32).numpy().astype(np.float64)
    want = xf / np.sqrt((xf ** 2).mean(-1, keepdims=True) + 1e-6) * tf.cast(g, tf.float32).numpy()
    # fp32 accumulation: the only error is the final rounding to dtype (half an ulp, relative)
    np.testing.assert_allclose(tf.cast(y, tf.float32).numpy(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_rms_norm_gradient(dtype):
    """RMSNormGrad vs fp32 autodiff of the T5 formula at the same rounded inputs."""
    x = tf.constant(RNG.standard_normal((2, 3, 6)), dtype)
    g = tf.constant(RNG.uniform(0.5, 1.5, 6), dtype)
    dy = tf.cast(tf.constant(RNG.standard_normal((2, 3, 6)), tf.float32), dtype)
    xf, gf, dyf = (tf.cast(t, tf.float32) for t in (x, g, dy))
    with tf.GradientTape() as tape:
        tape.watch([xf, gf])
        ref = gf * (xf * tf.math.rsqrt(tf.reduce_mean(tf.square(xf), -1, keepdims=True) + 1e-6))
    want = tape.gradient(ref, [xf, gf], output_gradients=dyf)
    with tf.GradientTape() as tape:
        tape.watch([x, g])
        y = fused_ops.rms_norm(x, g, 1e-6)
    got = tape.gradient(y, [x, g], output_gradients=dy)
    for a, w in zip(got, want):
        assert a.dtype == dtype
        w = w.numpy()
        assert np.abs(w).max() > 0.1
        np.testing.assert_allclose(tf.cast(a, tf.float32).numpy(), w,
                                   rtol=HALF_ULP[dtype] * 1.01 + 1e-5, atol=1e-5 * np.abs(w).max())
