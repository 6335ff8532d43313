"""``filter_grad_1x1`` / ``filter_grad_im2col`` (issue 18): the BF16 weight gradient of a
1x1 conv becomes Reshape -> MatMul(transpose_a) -> Reshape (oneDNN's BF16
Conv2DBackpropFilter is measured 1.4-24x slower than its BF16 MatMul on ResNet-50's 1x1
shapes), and that of a kxk conv with few output positions ExtractImagePatches -> the same
(measured 1.4-6.8x faster there; see the tables in ``graph_passes/fusion/builtin.py`` and
``benchmarks/fused_forms.py --filter-grad``).

Runs happen in a subprocess (``_filter_grad_worker.py``): a BF16 kernel may abort TF.

Tolerances.  ``ours`` and ``level1`` (graph_level 1: no fusion) execute the same forward
graph and the same backward graph up to the filter gradients (the test net has no bias and
no batch norm, so no other level-2 rule applies), so the rewritten filter gradients are the
same sums of products of the same BF16 tensors, accumulated in FP32 by both oneDNN kernels
and rounded once to BF16: each element differs by at most two BF16 roundings (2 x 2^-9) plus
FP32 summation-order differences (~1e-6), so their relative L2 difference is <= 2^-8.  The
other weights' gradients are computed by the same kernels on the same inputs: equal to FP32
summation order (1e-5).  Against plain FP32, ours may be no further than level 1 is, plus
2^-8.  (This tiny net's gradients are near-cancelling sums: BF16 itself puts them 0.09-0.11
from FP32, in level 1 as in ours, so an absolute BF16-vs-FP32 bound would test BF16, not the
rule.)
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from _worker_util import cached_results, onednn_on, rel_l2

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_filter_grad_worker.py")
EPS_BF16 = 2.0 ** -8


results = cached_results(WORKER, timeout=600)


_onednn_on = onednn_on  # the skipif string below evaluates it in this module


needs_onednn = pytest.mark.skipif("not _onednn_on()", reason="the rule fires only under oneDNN "
                                                            "(measured there); this TF runs without it")


def _by_config():
    return {r["config"]: r for r in results("run")}


def _count(ops, prefix, dtype=None):
    return sum(n for k, n in ops.items()
               if prefix in k.split(":")[0] and (dtype is None or k.endswith(":" + dtype)))


@needs_onednn
def test_bf16_filter_gradients_of_1x1_convs_run_as_matmuls():
    r = _by_config()
    ours, lvl1 = r["ours"]["ops"], r["level1"]["ops"]
    # level 1: 4 weight gradients as BF16 Conv2DBackpropFilter (oneDNN's)
    assert _count(lvl1, "Conv2DBackpropFilter", "bfloat16") == 4
    # ours: only the 3x3 on 8x8 is left; the 1x1 ones and the 3x3 on 4x4 are BF16 MatMuls
    assert _count(ours, "Conv2DBackpropFilter", "bfloat16") == 1
    assert _count(ours, "Conv2DBackpropFilter") == 1
    assert _count(ours, "MatMul", "bfloat16") == _count(lvl1, "MatMul", "bfloat16") + 3
    # the stride-2 conv's input subsample (StridedSlice; a Slice after strided_subsample, 18d;
    # _count matches by substring, so "Slice" counts both)
    assert _count(ours, "Slice", "bfloat16") == 1
    assert _count(ours, "ExtractImagePatches", "bfloat16") == 1  # the 3x3 conv's im2col
    # no new casts: the MatMuls read the BF16 activations and gradients the convs read
    assert _count(ours, "Cast") == _count(lvl1, "Cast")


@needs_onednn
def test_bf16_filter_gradients_match_the_unrewritten_graph_and_fp32():
    r = _by_config()
    ours, lvl1, fp32 = r["ours"]["update"], r["level1"]["update"], r["fp32"]["update"]
    for k in ("w1", "w2", "w3"):
        assert rel_l2(ours[k], lvl1[k]) <= EPS_BF16, (k, rel_l2(ours[k], lvl1[k]))
        assert rel_l2(ours[k], fp32[k]) <= rel_l2(lvl1[k], fp32[k]) + EPS_BF16
    for k in ("w0", "dense"):
        assert rel_l2(ours[k], lvl1[k]) <= 1e-5, (k, rel_l2(ours[k], lvl1[k]))


@needs_onednn
def test_rule_fires_for_bf16_only_and_reports_why_not():
    off = {r["mode"]: r for r in results("offline")}
    bf16, fp32 = off["allow_mix_precision_bf16"], off["must_keep_origin_dtype"]
    assert bf16["fused"] == {"filter_grad_1x1": 2, "filter_grad_im2col": 1}
    assert bf16["ops"].get("Conv2DBackpropFilter", 0) == 1
    assert bf16["ops"].get("StridedSlice", 0) + bf16["ops"].get("Slice", 0) >= 1  # (18d: strided_subsample)
    assert bf16["ops"].get("ExtractImagePatches", 0) == 1
    # the 3x3 on 8x8 (64 positions, 16 channels): the reason names the measured limit
    assert any("8x8 output positions" in why for why in bf16["reasons"]["filter_grad_im2col"])
    assert fp32["fused"] == {"filter_grad_1x1": 0, "filter_grad_im2col": 0}
    assert fp32["ops"]["Conv2DBackpropFilter"] == 4
    assert bf16["off"] == {"filter_grad_1x1": None, "filter_grad_im2col": None}
    # outside a BF16 plan (no bfloat16 Conv2DBackpropFilter in the graph) each rule is decided once
    # (core.RULE_POLICY, 17p): one rules_off entry, with the mode, the reason and the 4 anchors
    for rule, off in fp32["off"].items():
        assert off is not None and off["mode"] == "must_keep_origin_dtype" and off["anchors"] == 4, (rule, off)
        assert "measured faster in BF16 only" in off["reason"], off
    assert fp32["reasons"] == {"filter_grad_1x1": [], "filter_grad_im2col": []}, fp32["reasons"]


def test_without_onednn_the_rule_does_not_fire():
    off = {r["mode"]: r for r in results("offline", onednn=False)}
    bf16 = off["allow_mix_precision_bf16"]
    assert bf16["onednn"] is False
    assert bf16["fused"] == {"filter_grad_1x1": 0, "filter_grad_im2col": 0}
    assert bf16["ops"]["Conv2DBackpropFilter"] == 4
    assert any("oneDNN off" in why for why in bf16["reasons"]["filter_grad_im2col"]), bf16["reasons"]
