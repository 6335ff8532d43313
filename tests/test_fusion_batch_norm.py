"""The ``batch_norm_moments`` fusion rule (graph_passes/fusion/batch_norm.py): a training
batch norm written as moments + arithmetic becomes FusedBatchNormV3 and its gradient region
one FusedBatchNormGradV3.

Every TF run happens in a subprocess (``_batch_norm_worker.py``): a fused BF16 kernel TF
cannot run may abort the process.  Checked on real graphs:

* Keras 3's BatchNormalization (tf.keras on TF >= 2.16; Keras 2 on TF 2.15 trains with
  FusedBatchNormV3 already), including a residual unit whose final Add grappler's
  AddOpsRewrite spreads over AddN trees, a batch norm without gamma/beta (axis=3), and a
  projection shortcut (two norms, one incoming gradient, CSE-shared gradient ops);
* a hand-written ``tf.nn.moments`` + ``tf.nn.batch_normalization`` batch norm with
  ``assign_moving_average``-style updates in a TF1 Session (TF-Slim / ModelZoo style),
  on both TF versions, oneDNN on and off.

Assertions: the op types and dtypes TF executed (fused forward + gradient, no
SquaredDifference/moments Mean left; BF16 in BF16 mode), the weights' one-step updates
(SGD, learning rate 1: minus the gradients) and the moving statistics against plain TF
FP32, and no firing in FP16 mode or on a rank-2 batch norm.

Tolerances:
* FP32 mode: the fused kernels compute the same functions in FP32 with another summation
  order (and the closed-form gradient; the moments' StopGradient changes no value since
  d var / d mean = 0): updates within 1e-4 of the largest |update| of the same weight
  (float32 sums of <= 512 terms: ~n * 2^-24 = 3e-5, and the batch norm backward's
  ``dy - mean(dy) - xhat * mean(dy * xhat)`` cancels), moving statistics within 1e-5.
* BF16 mode: the inputs are the same BF16 tensors; the fused kernels accumulate in FP32
  and round once.  Ours must be no further from FP32 than the unfused BF16 rewrite
  (graph_level=1, the same precision plan without fusion) plus 4 BF16 roundings
  (4 * 2^-8) of the weight's update scale; the moving statistics plus 2 roundings.
* A conv bias right before a batch norm has a zero gradient (the norm removes the mean):
  its FP32 "update" is rounding noise, so it is compared in absolute terms against the
  scale of the conv kernel's update.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from _worker_util import run_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_batch_norm_worker.py")
U = 2.0 ** -8


def _by_config(results):
    return {r["config"]: r for r in results if "config" in r}


def _count(ops, *names, dtype=None):
    return sum(v for k, v in ops.items()
               if any(n in k.split(":")[0] for n in names) and (dtype is None or k.endswith(":" + dtype)))


def _err(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def _scale(v):
    return float(np.abs(np.asarray(v)).max())


def _bias_before_bn(name):
    return name.endswith("conv2d_1/bias")


def _check(runs, n_bn, bn_dtype_name="bfloat16"):
    ref, f32, ours, lvl1, fp16 = (runs[k] for k in ("fp32", "ours_fp32", "ours", "level1", "fp16"))
    # the unfused graph has the moments arithmetic
    assert _count(ref["ops"], "SquaredDifference") == n_bn and ref["fused"] == 0
    kernel_scale = max(_scale(v) for k, v in ref["update"].items() if "kernel" in k or k.endswith("w"))
    for run, dt in ((f32, "float32"), (ours, bn_dtype_name)):
        assert run["fused"] == n_bn, run["fused"]
        ops = run["ops"]
        assert _count(ops, "SquaredDifference") == 0, ops
        # forward (FusedBatchNormV3, or with the ReLU: _FusedBatchNormEx; oneDNN's names) and gradient
        assert _count(ops, "FusedBatchNormV3", "FusedBatchNormEx", dtype=dt) == n_bn, ops
        # (in BF16 the 18f rules run it as BatchNormGradNHWC, this project's kernel)
        assert _count(ops, "FusedBatchNormGradV3", "BatchNormGradNHWC", dtype=dt) == n_bn, ops
    for k, r in ref["update"].items():
        if _bias_before_bn(k):
            assert _err(f32["update"][k], r) <= 1e-4 * kernel_scale, k
            assert _scale(ours["update"][k]) <= _scale(lvl1["update"][k]) + U * kernel_scale, k
            continue
        s = _scale(r)
        assert _err(f32["update"][k], r) <= 1e-4 * s, (k, _err(f32["update"][k], r), s)
        e_ours, e_l1 = _err(ours["update"][k], r), _err(lvl1["update"][k], r)
        assert e_ours <= e_l1 + 4 * U * s, (k, e_ours, e_l1, s)
    for k, r in ref["stats"].items():
        s = _scale(r)
        assert _err(f32["stats"][k], r) <= 1e-5 * s, (k, _err(f32["stats"][k], r))
        e_ours, e_l1 = _err(ours["stats"][k], r), _err(lvl1["stats"][k], r)
        assert e_ours <= e_l1 + 2 * U * s, (k, e_ours, e_l1)
    assert abs(f32["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    # not in FP16 mode (not measured there): the moments arithmetic stays
    assert fp16["fused"] == 0 and _count(fp16["ops"], "SquaredDifference") == n_bn
    assert lvl1["fused"] == 0 and _count(lvl1["ops"], "SquaredDifference") == n_bn


@pytest.mark.parametrize("kind", ["keras3", "keras3_dynamic"], ids=["static_batch", "dynamic_batch"])
def test_keras3_batch_norm_fused_forward_and_gradient(kind):
    """Static batch (train_on_batch, a tf.function called with fixed shapes) and unknown batch
    (model.fit's trace): then the moving variance's (n-1)/n comes from Size(x) at run time."""
    keras = pytest.importorskip("keras")
    if int(keras.__version__.split(".")[0]) < 3:
        pytest.skip(f"Keras {keras.__version__}: its BatchNormalization trains with FusedBatchNormV3 "
                    "already (no moments form to fuse)")
    runs = _by_config(run_worker(WORKER, kind))
    _check(runs, n_bn=4)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn_on", "onednn_off"])
def test_hand_written_moments_batch_norm_in_a_session(onednn):
    """tf.nn.moments + tf.nn.batch_normalization + moving averages read by Sub nodes (TF1)."""
    runs = _by_config(run_worker(WORKER, "slim", onednn=onednn))
    _check(runs, n_bn=1)
    # the moving averages read the fused op's statistics, not a leftover Mean
    assert _count(runs["ours"]["ops"], "Mean") == _count(runs["fp32"]["ops"], "Mean") - 2


def test_offline_counts_and_refusals():
    res = [r for r in run_worker(WORKER, "offline") if r.get("config") == "offline"]
    got = {(r["rank"], r["mode"]): r for r in res}
    for mode in ("allow_mix_precision_bf16", "must_keep_origin_dtype"):
        r = got[(4, mode)]
        fwd = r["ops"].get("FusedBatchNormV3", 0) + r["ops"].get("_FusedBatchNormEx", 0)
        assert r["fused"] == 1 and fwd == 1 \
            and r["ops"].get("FusedBatchNormGradV3") == 1 and "SquaredDifference" not in r["ops"], r
        r2 = got[(2, mode)]
        # statistics over axis 0 of a [N, C] tensor: not a per-channel NHWC norm, not matched
        assert r2["fused"] == 0 and r2["ops"].get("SquaredDifference") == 1, r2
    r = got[(4, "allow_mix_precision")]
    assert r["fused"] == 0 and any("FP16" in s for s in r["reasons"]), r["reasons"]
    assert r["ops"].get("SquaredDifference") == 1
