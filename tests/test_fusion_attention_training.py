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


@pytest.mark.parametrize("n", [3, 8, 16, 37])  # tail only, one block, two blocks, blocks + tail
def test_forward_rows_with_masked_entries(n):
    """The fp32 one-pass row (scale + mask + max in one AVX2 pass) on rows with
    -1e9 and -inf mask entries, against tf.nn.softmax (FP32): probabilities of
    masked entries are (practically) zero, the rest renormalised; their gradient too."""
    s = tf.constant(RNG.standard_normal((3, 4, n)) * 5, tf.float32)
    m = np.zeros((3, 1, n), np.float32)
    m[0, 0, : n // 2] = -1e9
    m[1, 0, -1] = -np.inf
    m = tf.constant(m)
    dp = tf.constant(RNG.standard_normal((3, 4, n)), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(s)
        got = fused_ops.scale_mask_softmax(s, m, scale=0.5)
        want = tf.nn.softmax(s * 0.5 + m)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(tape.gradient(got, s, output_gradients=dp).numpy(),
                               tape.gradient(want, s, output_gradients=dp).numpy(), rtol=1e-5, atol=1e-6)


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


# ------------------------------------------------------------------ the training-graph rewrite
# Every graph below is built the way real code writes it and trained one step in
# tests/_attention_train_worker.py (a subprocess: FP16/BF16 kernels may abort TF),
# once fused at graph_level 3 and once unfused, same weights, same feeds, the same
# dropout mask (its uniform noise is fed to both graphs, or a frozen Keras 3 seed).
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
#: unit roundoff of the compute dtype
U = {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
KERAS3 = tf.__version__ >= "2.16"


@pytest.fixture(scope="module")
def worker():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE,
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_attention_train_worker.py")],
                          capture_output=True, text=True, env=env, timeout=900)
    cases = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("CASE ")]
    if proc.returncode != 0 or "DONE" not in proc.stdout:
        last = cases[-1] if cases else "(before the first case)"
        pytest.fail(f"the attention worker died (rc={proc.returncode}) in case '{last}':\n"
                    f"{(proc.stderr or '')[-3000:]}")
    return {r["name"]: r for r in (json.loads(ln[7:]) for ln in proc.stdout.splitlines()
                                   if ln.startswith("RESULT "))}


def _assert_fused(r):
    c, before = r["counts"], r["before"]
    assert c.get("ScaleMaskSoftmax") == 1 and c.get("ScaleMaskSoftmaxGrad") in (1, 2), (c, r["decisions"])
    assert c.get("Softmax", 0) == 0 and before["Softmax"] == 1
    # TF's softmax gradient (Mul, Sum, Sub, Mul) is gone: its one Sub, its row Sum
    assert before.get("Sub", 0) - c.get("Sub", 0) == 1
    assert before["Sum"] - c.get("Sum", 0) >= 1
    # the dropout stays TF ops (its noise, keep mask and scaling), forward and backward
    for op in ("RandomUniform", "GreaterEqual"):
        assert c.get(op, 0) == before.get(op, 0)


def _assert_same_step(r, tol_u, kernels):
    """One-step updates of the fused graph equal the unfused graph's within
    ``tol_u`` unit roundoffs of the largest update.  ``kernels``: weights whose
    gradient flows through the fused ops (q/k: through ScaleMaskSoftmaxGrad alone),
    each with a real update, each within a quarter of its own update too: a zero
    or wrong gradient there (err = its whole update) fails."""
    u = U[r["dtype"]]
    vs = r["vars"]
    gscale = max(e["scale"] for e in vs.values())
    assert gscale > 1e-2
    for name in kernels:
        assert vs[name]["scale"] >= 0.02 * gscale, (name, vs)
        assert vs[name]["err"] <= 0.25 * vs[name]["scale"], (name, vs[name])
    for name, e in vs.items():
        assert e["err"] <= tol_u * u * gscale, (name, e, tol_u * u * gscale)
        if "err_fused32" in e:  # fused in FP32 arithmetic: not less accurate than the unfused low-precision graph
            assert e["err_fused32"] <= e["err_unfused32"] + 2 * u * gscale, (name, e)


# FP32: the two graphs differ by the kernels' fp32 reassociation (row sums, the
# polynomial exp, ~2 ulp) carried through ~4 matmuls: 32 ulp of the largest update.
# FP16/BF16: each graph rounds every op's result to the dtype; between the loss and
# the q/k update sit ~8 rounded ops (3 products forward, the softmax, 4 backward), of
# which the fused graph rounds fewer: 8 unit roundoffs (measured: 1-2).
@pytest.mark.parametrize("dtype,tol_u", [("fp32", 32), ("fp16", 8), ("bf16", 8)])
def test_bert_block_tf1_session_one_step(worker, dtype, tol_u):
    """BERT-style block in TF1 ops (tensordot Dense, heads by reshape/transpose,
    BatchMatMulV2, scores * 1/sqrt(d), additive mask, softmax, tf.nn.dropout(0.1)),
    GradientDescentOptimizer.minimize, one Session step."""
    r = worker[f"bert_{dtype}"]
    _assert_fused(r)
    assert r["counts"]["ScaleMaskSoftmaxGrad"] == 1  # a constant mask: no mask gradient
    # the backward region replaced, as TF1's gradient functions build it (_SoftmaxGrad: mul, Sum,
    # sub, mul_1; _AddGrad with static shapes: the mask side's Sum + Reshape only; _MulGrad: both
    # sides; each with its tuple group_deps + control_dependency Identities)
    tup = ["tuple/group_deps", "tuple/control_dependency", "tuple/control_dependency_1"]
    want = ([f"gradients/probs_grad/{n}" for n in ("mul", "Sum", "sub", "mul_1")]
            + [f"gradients/add_grad/{n}" for n in ["Sum", "Reshape"] + tup]
            + [f"gradients/Mul_grad/{n}" for n in ["Mul", "Mul_1", "Sum", "Reshape"] + tup])
    assert sorted(r["decisions"]["probs"]["fused_gradient_nodes"]) == sorted(want)
    assert r["decisions"]["probs"]["fusion"] == "attention_train"
    _assert_same_step(r, tol_u, ["wq", "wk", "wv", "wo"])


@pytest.mark.parametrize("dtype,tol_u", [("fp32", 32), ("bf16", 8)])
def test_einsum_division_and_where_mask(worker, dtype, tol_u):
    """The einsum form (as Keras 3 writes it): scale by division, boolean mask through
    tf.where, dropout: the RealDiv's and the where's gradients are in the region."""
    r = worker[f"einsum_{dtype}"]
    _assert_fused(r)
    assert r["counts"].get("RealDiv", 0) < r["before"]["RealDiv"]
    _assert_same_step(r, tol_u, ["wq", "wk", "wv", "wo"])


def test_dynamic_batch(worker):
    """Batch None: the shapes are partial, so autodiff reduces the mask Add's
    gradient through Shape + BroadcastGradientArgs + Sum + Reshape; all in the region."""
    r = worker["dynamic_batch"]
    _assert_fused(r)
    assert r["counts"]["BroadcastGradientArgs"] < r["before"]["BroadcastGradientArgs"]
    _assert_same_step(r, 32, ["wq", "wk", "wv", "wo"])


def test_keras2_multi_head_attention_tf1(worker):
    r = worker["keras_tf1"]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    _assert_fused(r)
    _assert_same_step(r, 32, ["mha/query/kernel", "mha/key/kernel", "mha/value/kernel"])


def test_keras2_multi_head_attention_tf2_tape_frozen(worker):
    """Keras 2 MultiHeadAttention in a tf.function step with GradientTape (TF2's
    tape names its gradient ops ``gradient_tape/<scope>/...``), frozen; the dropout's
    noise fed; gradients compared."""
    r = worker["keras_tf2"]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["deterministic"]
    _assert_fused(r)
    names = [n for n in r["vars"] if "kernel" in n]
    _assert_same_step(r, 32, [n for n in names if "attention_output" not in n])


def test_keras_multi_head_attention_under_enable(worker):
    """The TF2 product path: enable(graph_level=3) rewrites the tf.function step
    after grappler's own passes (which fold the Keras 3 einsum's Transpose gradient
    into the product).  Keras 2 on TF 2.15 (dropout off: its dropout is unseeded),
    Keras 3 on 2.21 (dropout 0.1, the same seed in both layers).  The executed
    graph holds the fused ops; gradients equal the plain step's."""
    r = worker["keras_enable"]
    c = r["counts"]
    assert c.get("ScaleMaskSoftmax") == 1 and c.get("ScaleMaskSoftmaxGrad") in (1, 2), (c, r["decisions"])
    assert not any(op.endswith("Softmax") and op != "ScaleMaskSoftmax" for op in c), c
    if KERAS3:
        assert r["rate"] > 0 and c.get("GreaterEqual") == 1  # the dropout ran, after the fused softmax
    kernels = [n for n in r["vars"] if n.split(":")[0].endswith("kernel") and "attention_output" not in n]
    assert len(kernels) == 3
    _assert_same_step(r, 32, kernels)


@pytest.mark.parametrize("dtype,tol_u", [("fp32", 32), ("fp16", 8), ("bf16", 8)])
def test_session_config_with_precision_modes(worker, dtype, tol_u):
    """The TF1 product path (session_config -> grappler bridge) on the BERT-style
    block, FP32 and mixed precision (allow_mix_precision, ..._bf16): the executed
    graph holds the fused ops (kept FP32 by the precision pass, like their
    forward), and the step equals the same mode without the attention fusion."""
    r = worker[f"session_{dtype}"]
    c = r["counts"]
    assert c.get("ScaleMaskSoftmax") == 1 and c.get("ScaleMaskSoftmaxGrad") == 1, c
    assert not any(op.endswith("Softmax") and op != "ScaleMaskSoftmax" for op in c), c
    _assert_same_step(r, tol_u, ["wq", "wk", "wv", "wo"])


@pytest.mark.parametrize("case,dtype,tol_u,extra", [
    ("mask_bias_fp32", "fp32", 32, "kbias"), ("mask_full_fp32", "fp32", 32, "fullmask"),
    ("t5_fp32", "fp32", 32, "pos_bias"), ("t5_bf16", "bf16", 8, "pos_bias")])
def test_learned_mask_keeps_its_gradient(worker, case, dtype, tol_u, extra):
    """A mask that needs a gradient: a learned key bias [1, 1, 1, S] broadcast under
    a scaled BERT block (d/dmask = ScaleMaskSoftmaxGrad(scale=1), summed over the
    broadcast dims), and T5's unscaled attention with a learned relative-position
    bias [1, H, S, S] plus the mask (d/dmask is d/dscores itself: one op).  The
    bias is trained too, and its update must match.  Also a learned mask of the
    scores' full shape under a scale (two gradients of one shape, told apart by
    their readers)."""
    r = worker[case]
    assert r["dtype"] == dtype
    _assert_fused(r)
    assert r["counts"]["ScaleMaskSoftmaxGrad"] == (2 if case.startswith("mask_") else 1)
    _assert_same_step(r, tol_u, ["wq", "wk", "wv", extra])


def test_mask_gradient_of_unknown_shape_is_refused(worker):
    """A mask that needs a gradient (a learned scale on it) with a dynamic batch:
    its gradient's reduction cannot be planned statically, so the rewrite is
    refused (the graph keeps TF's ops, the step is unchanged) and the report says why."""
    r = worker["mask_grad"]
    assert r["counts"].get("ScaleMaskSoftmax", 0) == 0 and r["counts"]["Softmax"] == 1
    reason = r["decisions"]["probs"]["fusion_reason"]
    assert reason.startswith("not fused: the mask 'mul' needs a gradient") and "not static" in reason, reason
    assert all(e["err"] == 0.0 for e in r["vars"].values())


def test_fetched_probabilities_are_reported(worker):
    r = worker["probs_fetched"]
    assert r["counts"].get("ScaleMaskSoftmax", 0) == 0
    assert r["decisions"]["probs"]["fusion_reason"].startswith("not fused: 'probs' is fetched")
