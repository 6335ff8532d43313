"""``bias_grad_matmul`` / ``bias_grad_bn_zero`` (issue 18, 18d): a BF16 bias gradient (``BiasAddGrad``) becomes one
BF16 MatMul ``ones[1, M] x Reshape(dy, [M, C])`` under oneDNN (TF's BF16 BiasAddGrad is an
Eigen reduction measured 1.8x slower than that MatMul on ResNet-50's and BERT's shapes, and
it accumulates in BF16; ``benchmarks/fused_forms.py --bias-grad``, table in
``graph_passes/fusion/bias_grad.py``).

Runs happen in a subprocess (``_bias_grad_worker.py``): a BF16 kernel may abort TF.

Tolerances.  The rewritten bias gradient is the sum over N*H*W of the BF16 output gradient
``dy``, accumulated in FP32 by oneDNN's MatMul and rounded once to BF16.  Fetched in the same
run, that is checked against the float64 sum of the fetched BF16 ``dy``: each element differs
by one BF16 rounding (<= 2^-9 relative) plus FP32 summation error (~1e-6 for 512 terms), so the
relative L2 difference is <= 2^-8.  (Fetching a tensor keeps it FP32, so the gradients are
fetched in a run of their own; there the rule sums ``dy`` cast to BF16, and the test rounds the
fetched FP32 ``dy`` to BF16 the same way.)  ``norule`` (the same run with the rule removed from the
registry) executes the same graph but for the bias gradients, so every other weight's update is
equal to FP32 summation order (1e-5), and ours is no further from FP32 than ``norule`` plus
2^-8 (BF16 itself puts this tiny net's gradients some 1e-2 from FP32, in both).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from _worker_util import cached_results, onednn_on, rel_l2

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_bias_grad_worker.py")
EPS_BF16 = 2.0 ** -8
RULE = "bias_grad_matmul"
MATCHED = ("Conv/biases", "Conv_1/biases")
LEFT = ("Conv_2/biases", "fully_connected/biases")

results = cached_results(WORKER, timeout=900)


_onednn_on = onednn_on  # the skipif string below evaluates it in this module
needs_onednn = pytest.mark.skipif("not _onednn_on()", reason="the rule fires only under oneDNN "
                                                            "(measured there); this TF runs without it")


def _count(ops, op, dtype=None):
    return sum(n for k, n in ops.items()
               if k.split(":")[0] == op or k.split(":")[0].endswith("Mkl" + op)
               or k.split(":")[0].endswith("MklNative" + op)
               if dtype is None or k.endswith(":" + dtype))


def _runs():
    ours = {r["config"]: r for r in results("run")}
    ref = {r["config"]: r for r in results("run_norule")}
    return ours["ours"], ref["ours"], ours["fp32"]


@needs_onednn
def test_executed_graph_runs_the_bias_gradients_as_bf16_matmuls():
    ours, norule, _ = _runs()
    o, n = ours["ops"], norule["ops"]
    # norule: 4 BiasAddGrad (3 convs + the dense layer); the convs' in BF16 (the dense one reads
    # the FP32 loss gradient: gray, it follows its producer)
    assert _count(n, "BiasAddGrad") == 4 and _count(n, "BiasAddGrad", "bfloat16") >= 3
    # ours: the two with 512 rows are MatMuls; the 128-row conv and the 8-row dense are left
    assert _count(o, "BiasAddGrad") == 2
    assert _count(o, "BiasAddGrad", "bfloat16") == _count(n, "BiasAddGrad", "bfloat16") - 2
    assert _count(o, "MatMul", "bfloat16") == _count(n, "MatMul", "bfloat16") + 2
    assert _count(o, "MatMul", "float") == _count(n, "MatMul", "float")
    # no new cast: the MatMul reads the BF16 gradient the conv gradients read
    assert _count(o, "Cast") == _count(n, "Cast")


@needs_onednn
def test_bias_gradient_is_the_fp32_accumulated_sum_of_the_bf16_gradient():
    ours, _, _ = _runs()
    f = ours["fetched"]
    for k in MATCHED:
        dy = np.asarray(f[k + ":dy"], np.float64)
        exact = dy.reshape(-1, dy.shape[-1]).sum(0)
        err = rel_l2(f[k], exact)
        assert err <= EPS_BF16, (k, err)
        # and the training step applied that gradient (learning rate 1; the fetch run kept
        # dy FP32, the training run computes it in BF16: the same values up to one rounding)
        assert rel_l2(-np.asarray(ours["update"][k]), f[k]) <= EPS_BF16, k


@needs_onednn
def test_updates_match_the_unrewritten_graph_and_fp32():
    ours, norule, fp32 = _runs()
    for k in MATCHED:
        a, b = ours["update"][k], norule["update"][k]
        assert rel_l2(a, b) <= 4 * EPS_BF16, (k, rel_l2(a, b))
        assert rel_l2(a, fp32["update"][k]) <= rel_l2(b, fp32["update"][k]) + EPS_BF16, k
    for k in ours["update"]:
        if k not in MATCHED:
            assert rel_l2(ours["update"][k], norule["update"][k]) <= 1e-5, (k, rel_l2(ours["update"][k],
                                                                                  norule["update"][k]))


@needs_onednn
def test_rule_fires_for_bf16_only_and_reports_why_not():
    r = results("offline")[0]["modes"]
    bf16, fp32 = r["allow_mix_precision_bf16"], r["must_keep_origin_dtype"]
    assert bf16["fused"] == 2
    assert bf16["ops"]["BiasAddGrad"] == 2
    # the emitted MatMuls are typed BF16 by the precision pass (DT_BFLOAT16 = 14)
    assert bf16["matmul_dtypes"] == {"14": 2}
    assert any("128 rows" in why for why in bf16["reasons"]), bf16["reasons"]
    assert any("8 rows" in why for why in bf16["reasons"]), bf16["reasons"]
    assert bf16["off"] == {}  # both rules run in the BF16 mode
    assert fp32["fused"] == 0 and fp32["ops"]["BiasAddGrad"] == 4
    # FP16 mode (offline only: FP16 kernels are not run here): not measured, refused
    fp16 = r["allow_mix_precision"]
    assert fp16["fused"] == 0 and fp16["ops"]["BiasAddGrad"] == 4
    # outside a BF16 plan (and no bfloat16 BiasAddGrad in the graph) both rules are decided once
    # (core.RULE_POLICY, 17p): one rules_off entry each, with the mode, the reason and the 4 anchors
    for mode, runs in (("must_keep_origin_dtype", "float32"), ("allow_mix_precision", "float16 or float32")):
        got = r[mode]
        assert sorted(got["off"]) == ["bias_grad_bn_zero", "bias_grad_matmul"], got["off"]
        for rule, off in got["off"].items():
            assert off["mode"] == mode and off["anchors"] == 4, (rule, off)
            assert f"MatMul runs in {runs} (precision mode {mode}" in off["reason"], off
            assert "measured faster in BF16 only" in off["reason"], off
        assert got["reasons"] == [], got["reasons"]


@needs_onednn
def test_rewriting_the_rewritten_graph_changes_nothing_more():
    for kind in ("offline", "keras"):
        r = results(kind)[0]["modes"]
        again = r["allow_mix_precision_bf16:again"]
        assert again["fused"] == {"bias_grad_bn_zero": 0, "bias_grad_matmul": 0, "strided_subsample": 0}, kind
        assert again["ops"].get("BiasAddGrad", 0) == r["allow_mix_precision_bf16"]["ops"].get("BiasAddGrad", 0)
        assert again["ops"].get("StridedSlice", 0) == r["allow_mix_precision_bf16"]["ops"].get("StridedSlice", 0)


def test_without_onednn_the_rule_does_not_fire():
    r = results("offline", onednn=False)[0]
    assert r["onednn"] is False
    bf16 = r["modes"]["allow_mix_precision_bf16"]
    assert bf16["fused"] == 0 and bf16["ops"]["BiasAddGrad"] == 4
    assert any("oneDNN off" in why for why in bf16["reasons"]), bf16["reasons"]


@needs_onednn
def test_keras_resnet50_in_a_tf1_graph():
    """Every conv of Keras 2 ResNet-50 has a bias and feeds a training batch norm: all 53 bias
    gradients become zero Consts (``bias_grad_bn_zero``); the classifier's (8 rows) stays."""
    r = results("keras")[0]
    rows = r["rows"]
    assert len(rows) == 54  # 53 conv biases + the classifier
    bf16, fp32 = r["modes"]["allow_mix_precision_bf16"], r["modes"]["must_keep_origin_dtype"]
    assert bf16["fused_zero"] == 53
    assert bf16["fused"] == 0  # the classifier's 8 rows are below the MatMul form's measured 256
    assert bf16["ops"]["BiasAddGrad"] == 1
    assert fp32["fused"] == 0 and fp32["fused_zero"] == 0 and fp32["ops"]["BiasAddGrad"] == len(rows)


@needs_onednn
def test_bias_gradient_before_a_training_batch_norm_is_exactly_zero():
    """tf_keras Conv2D(bias) -> BatchNormalization(training) -> ReLU: the conv bias gradient is
    exactly 0 (the norm removes any per-channel shift); FP32 computes rounding noise there
    (<= 1e-6 of the conv kernel's update), TF's BF16 BiasAddGrad far more.  Every other
    update equals the graph without the bias rules (the same kernels on the same inputs)."""
    res = {r["config"]: r for r in results("run_bn")}
    ours, norule, fp32 = res["ours"], res["norule"], res["fp32"]
    assert _count(ours["ops"], "BiasAddGrad") == 1  # the Dense layer's (8 rows, FP32 loss gradient)
    assert _count(norule["ops"], "BiasAddGrad", "bfloat16") == 2
    assert _count(ours["ops"], "Cast") < _count(norule["ops"], "Cast")  # the bias gradients' casts go
    for i in (0, 1):
        b = f"conv{i}/bias"
        scale = np.linalg.norm(fp32["update"][f"conv{i}/kernel"])
        assert np.all(np.asarray(ours["update"][b]) == 0.0), b
        assert np.linalg.norm(fp32["update"][b]) <= 1e-6 * scale, b  # FP32: noise around the exact 0
    for k in ours["update"]:
        if not k.endswith("/bias") or k.startswith("dense"):
            assert rel_l2(ours["update"][k], norule["update"][k]) <= 1e-5, k


# ------------------------------------------------------------------ strided_subsample (18d)
def test_strided_subsample_is_reshape_slice_with_the_same_values():
    """x[:, ::sh, ::sw, :] with H, W divisible -> Reshape -> Slice -> Reshape: the same elements
    (FP32 mode: bit-equal to plain TF); an odd size and an offset start are left alone, with
    the reason.  Fires in both modes (an exact selection, measured faster in FP32 and BF16)."""
    res = {r["mode"]: r for r in results("subsample")}
    for mode, r in res.items():
        assert r["fused"] == 3, (mode, r["fused"])
        assert r["ops"].get("StridedSlice:float32", 0) + r["ops"].get("StridedSlice:bfloat16", 0) == 2
        assert sum(n for k, n in r["ops"].items() if k.startswith("Slice:")) == 3
        assert r["shapes"] == r["ref_shapes"]
        assert any("7x7 not divisible" in why for why in r["reasons"]), r["reasons"]
        assert any("not a whole-tensor strided view" in why for why in r["reasons"]), r["reasons"]
    assert all(e == 0.0 for e in res["must_keep_origin_dtype"]["err"].values())
    # BF16 mode: the MatMuls reading the subsamples run BF16 (5 terms, BF16 inputs), alike for
    # the rewritten and the untouched subsamples
    assert all(e <= 2.0 ** -5 for e in res["allow_mix_precision_bf16"]["err"].values())


@needs_onednn
def test_stride2_1x1_filter_gradient_subsample_runs_as_slice():
    ours, _, _ = _runs()
    o = ours["ops"]
    assert sum(n for k, n in o.items() if k.startswith("StridedSlice:")) == 0
    assert o.get("Slice:bfloat16", 0) == 1  # Conv_2's weight gradient reads x[:, ::2, ::2, :]
