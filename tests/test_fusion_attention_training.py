"""Attention in training graphs (issue 14): the ScaleMaskSoftmaxGrad kernel and
ScaleMaskSoftmax's registered gradient, then the level-3 rewrite of the softmax
forward *and* the backward region autodiff built (real Keras / TF1 / einsum
graphs, one training step compared with the unfused graph)."""
import numpy as np
import pytest

from _fusion_util import tf
from npu_amp_tf import fused_ops

RNG = np.random.default_rng(14)

#: relative rounding of one value stored in the dtype (half an ulp)
HALF_ULP = {tf.float32: 2.0 ** -24, tf.float16: 2.0 ** -11, tf.bfloat16: 2.0 ** -8}
#: half the spacing of the subnormals: below the smallest normal (fp16: 6.1e-5) the
#: rounding is absolute (bf16/fp32 subnormals are below 1e-38, never reached here)
HALF_ULP_ABS = {tf.float32: 0.0, tf.float16: 2.0 ** -25, tf.bfloat16: 0.0}
#: fp32 arithmetic noise of the kernel's dot product and subtraction, relative
#: to the magnitudes involved (a 40-term sum: 40 * 2^-24 ~ 2.4e-6, doubled)
F32_NOISE = 5e-6


def _f32(t):
    return tf.cast(t, tf.float32).numpy().astype(np.float64)


def _inputs(shape, dtype, mask_shape):
    s = tf.cast(RNG.standard_normal(shape) * 3, dtype)
    m = tf.cast(np.where(RNG.random(mask_shape) > 0.25, 0.0, -30.0) + RNG.standard_normal(mask_shape), dtype)
    dp = tf.cast(RNG.standard_normal(shape), dtype)
    return s, m, dp


def _bound(dp, p, scale):
    """Per-element size of the terms of scale * (dp - sum(dp*p)) * p."""
    return abs(scale) * np.abs(p) * (np.abs(dp) + (np.abs(dp * p)).sum(-1, keepdims=True))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
@pytest.mark.parametrize("n", [19, 40])  # 19: one AVX2 block + tail; 40: two 16-wide blocks + 8
def test_grad_kernel_formula(dtype, n):
    """The kernel at the probabilities the forward op stored, against the formula
    in float64 at the same (already rounded) values: only the output rounding to
    dtype (half an ulp of the result) and fp32 noise may differ."""
    s, m, dp = _inputs((2, 3, 5, n), dtype, (2, 1, 5, n))
    with tf.GradientTape() as tape:
        tape.watch(s)
        p = fused_ops.scale_mask_softmax(s, m, scale=0.375)
    got = tape.gradient(p, s, output_gradients=dp)
    assert got.dtype == dtype and got.shape == s.shape
    pf, dpf = _f32(p), _f32(dp)
    want = 0.375 * (dpf - (dpf * pf).sum(-1, keepdims=True)) * pf
    assert np.abs(want).max() > 0.05  # a zero gradient cannot pass
    err = np.abs(_f32(got) - want)
    tol = HALF_ULP[dtype] * 1.01 * np.abs(want) + HALF_ULP_ABS[dtype] + F32_NOISE * _bound(dpf, pf, 0.375)
    assert (err <= tol).all(), (err - tol).max()


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_gradient_matches_softmax_autodiff(dtype):
    """d/dscores and d/dmask of the fused op against TF's fp32 autodiff of
    softmax(scores * scale + mask) at the same rounded inputs.  Beyond the
    kernel's own rounding, the fused op's probabilities are stored in dtype (the
    unfused reference keeps them fp32): a relative half-ulp on p enters every
    term, hence 3 half-ulps of the terms' size, plus half an ulp of the result."""
    scale = 0.125
    s, m, dp = _inputs((2, 2, 6, 24), dtype, (2, 1, 1, 24))
    with tf.GradientTape() as tape:
        tape.watch([s, m])
        p = fused_ops.scale_mask_softmax(s, m, scale=scale)
    got = tape.gradient(p, [s, m], output_gradients=dp)
    sf, mf, dpf = (tf.cast(t, tf.float32) for t in (s, m, dp))
    with tf.GradientTape() as tape:
        tape.watch([sf, mf])
        ref = tf.nn.softmax(sf * scale + mf)
    want = tape.gradient(ref, [sf, mf], output_gradients=dpf)
    pr = ref.numpy().astype(np.float64)
    terms = _bound(dpf.numpy(), pr, 1.0)
    for k, (a, w) in enumerate(zip(got, want)):
        assert a.dtype == dtype
        w = w.numpy().astype(np.float64)
        assert np.abs(w).max() > 0.01
        t = terms * scale if k == 0 else terms
        if k == 1:  # the mask's gradient sums the [2, 2, 6] rows onto [2, 1, 1]
            t = t.sum(axis=(1, 2), keepdims=True)
        # p's own subnormal rounding (fp16) enters like dp: scaled by the row's dp sizes
        tol = (HALF_ULP[dtype] * 1.01 * np.abs(w) + (3 * HALF_ULP[dtype] + F32_NOISE) * t
               + HALF_ULP_ABS[dtype] * (1 + 4 * np.abs(dpf.numpy()).max()))
        if dtype == tf.float32:
            tol = tol + 1e-6 * np.abs(w).max()  # TF's own fp32 Softmax/Sum ordering
        err = np.abs(_f32(a) - w)
        assert (err <= tol).all(), (k, (err - tol).max(), err.max())


def test_gradient_without_mask_and_finite_differences():
    s = tf.constant(RNG.standard_normal((3, 7)), tf.float32)
    theo, num = tf.test.compute_gradient(lambda x: fused_ops.scale_mask_softmax(x, None, 0.7), [s])
    assert np.abs(theo[0]).max() > 0.05
    np.testing.assert_allclose(theo[0], num[0], atol=2e-3)


def test_grad_op_shape_function_and_errors():
    lib = fused_ops._lib
    f = tf.function(lambda a, b: lib.scale_mask_softmax_grad(a, b, scale=2.0))
    cf = f.get_concrete_function(tf.TensorSpec([None, 4, 9]), tf.TensorSpec([3, None, 9]))
    assert cf.outputs[0].shape.as_list() == [3, 4, 9]
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="same shape|Dimension"):
        lib.scale_mask_softmax_grad(tf.zeros([2, 3]), tf.zeros([2, 4]))
    from graph_passes import registry
    assert registry.opdef_allows("ScaleMaskSoftmaxGrad", {"T": tf.bfloat16.as_datatype_enum})
    assert not registry.opdef_allows("ScaleMaskSoftmaxGrad", {"T": tf.float64.as_datatype_enum})
    for dt in (tf.float32, tf.float16, tf.bfloat16):
        assert registry.has_kernel("ScaleMaskSoftmaxGrad", "CPU", {"T": dt.as_datatype_enum})
