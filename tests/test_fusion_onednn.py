"""oneDNN-only fusions (issue 18): ``bias_add_act`` / ``bias_add`` (conv + bias + residual
add [+ activation] -> ``_FusedConv2D[BiasAdd,Add,<act>]``) and ``bn_act`` (FusedBatchNorm +
Relu -> ``_FusedBatchNormEx``), on real TF-Slim and Keras training graphs.

Every run happens in a subprocess (``_onednn_fusion_worker.py``): a fused kernel that TF
cannot run may abort the process.  For each model and precision (FP32, BF16) the worker
trains one step from the same weights under grappler's own rewrite (remapper + oneDNN BF16
AMP), ours at graph_level 2 and ours at graph_level 1 (no fusion), and reports the fused
nodes TF executed.  We check

* the counts against the model's structure (3 residual units, 2 Conv->BN->ReLU blocks) and
  against grappler's counts on the same graph: ours equal them, or exceed them where
  grappler's remapper declines a valid match (see ``test_slim_residual_units``);
* numerical equivalence with the unfused graph: the forward loss and the weight update of
  one training step.  FP32: the fused oneDNN primitive computes the same sums (rel 1e-5 on
  the loss, 1e-4 on the update).  BF16: fusing conv+bias+add removes one BF16 rounding
  (relative error <= 2^-9 each) per fused op, and a rounding may propagate through every
  later layer, so the bound is depth x 2^-8 (slim: 12 weight layers -> 4.7e-2) on the
  update's relative L2 norm, and 2^-8 on the loss (a mean, the errors average out);
  BN+Relu in one kernel computes the same values (BN's output is rounded once either way);
* with oneDNN off (``TF_ENABLE_ONEDNN_OPTS=0``) the rules do not fire (the report says
  why) and the same training runs.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from _worker_util import cached_results, onednn_on

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_onednn_fusion_worker.py")
EPS_BF16 = 2.0 ** -8


results = cached_results(WORKER, timeout=900,
                         transform=lambda out: {(r.get("prec") or r["kind"], r["config"]): r for r in out})


_onednn_on = onednn_on  # the skipif string below evaluates it in this module


needs_onednn = pytest.mark.skipif("not _onednn_on()", reason="this TF build/platform runs without oneDNN "
                                                            "(the fusions exist only as oneDNN kernels)")


def count(r, key_prefix, dtype=None):
    return sum(v for k, v in r["fused"].items()
               if k.split(":")[0] == key_prefix and (dtype is None or k.endswith(":" + dtype)))


def rel_l2(a_list, b_list):
    a = np.concatenate([np.asarray(x, np.float64) for x in a_list])
    b = np.concatenate([np.asarray(x, np.float64) for x in b_list])
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_equivalent(res, prec, depth):
    ours, ref = res[prec, "ours"], res[prec, "unfused"]
    if prec == "fp32":
        loss_tol, upd_tol = 1e-5, 1e-4
    else:
        loss_tol, upd_tol = EPS_BF16, depth * EPS_BF16
    assert abs(ours["loss"] - ref["loss"]) <= loss_tol * abs(ref["loss"]), (prec, ours["loss"], ref["loss"])
    upd_o, upd_r = ours["update"], ref["update"]
    if prec != "fp32" and ("fp32", "ours") in res:
        # (18d) a weight whose exact gradient is zero (a conv bias before a training batch norm,
        # which removes any per-channel shift) gets only rounding noise: FP32 ~1e-8, the unfused
        # BF16 BiasAddGrad (BF16 accumulation) ~1e-3, ours 0 (bias_grad_bn_zero; bias_grad_matmul's
        # FP32 accumulation gave ~1e-5).  Those are compared with FP32's update instead: ours no
        # further from it.
        f32 = [np.asarray(u, np.float64) for u in res["fp32", "ours"]["update"]]
        total = float(np.linalg.norm(np.concatenate(f32)))
        zero = {i for i, u in enumerate(f32) if np.linalg.norm(u) <= 1e-5 * total}
        for i in zero:
            d_o = np.linalg.norm(np.asarray(upd_o[i]) - f32[i])
            d_r = np.linalg.norm(np.asarray(upd_r[i]) - f32[i])
            assert d_o <= d_r + 1e-6 * total, (prec, i, d_o, d_r)
        upd_o = [u for i, u in enumerate(upd_o) if i not in zero]
        upd_r = [u for i, u in enumerate(upd_r) if i not in zero]
    err = rel_l2(upd_o, upd_r)
    assert err <= upd_tol, f"{prec}: weight update differs from the unfused graph's by {err:.3g} > {upd_tol:.3g}"


# ------------------------------------------------------------------ TF-Slim resnet_v1 units
RESIDUAL = "_MklNativeFusedConv2D[BiasAdd,Add,Relu]"


@needs_onednn
@pytest.mark.parametrize("prec,dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_slim_residual_units(prec, dtype):
    """3 bottleneck units -> 3 conv+bias+add+relu kernels.  Grappler's remapper fuses 2: it
    declines the unit whose shortcut is the 1x1 MaxPool subsample (resnet_v1_50: 13 of 16
    units); the fused kernel is valid there too (numerics below)."""
    res = results("slim")
    ours, peer, unf = res[prec, "ours"], res[prec, "peer"], res[prec, "unfused"]
    assert count(ours, RESIDUAL, dtype) == 3
    assert count(ours, RESIDUAL, dtype) >= count(peer, RESIDUAL, dtype) >= 2
    assert count(ours, "AddV2") == 0 and count(ours, "Relu") == 0
    # everything else the peer fused, we fused too
    for k in ("_MklNativeFusedConv2D[BiasAdd,Relu]", "_MklNativeFusedMatMul[BiasAdd]"):
        assert count(ours, k, dtype) == count(peer, k, dtype) > 0, k
    assert count(unf, RESIDUAL) == 0 and count(unf, "AddV2") == 3


@needs_onednn
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_slim_numerics_vs_unfused(prec):
    assert_equivalent(results("slim"), prec, depth=12)  # 11 convs + the logits layer


# ------------------------------------------------------------------ Keras Conv -> BN -> ReLU
BN_EX = "_MklNativeFusedBatchNormEx"


@needs_onednn
@pytest.mark.parametrize("kind", ["keras_tf1", "keras_fit"])
@pytest.mark.parametrize("prec,dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_keras_bn_relu(kind, prec, dtype):
    """2 Conv->BN(training)->ReLU blocks -> 2 _FusedBatchNormEx (run as oneDNN's kernel),
    exactly what grappler's remapper gives on the same graph; the gradient still reads the
    batch norm's reserve spaces (FusedBatchNormGradV3 unchanged)."""
    res = results(kind)
    ours, peer, unf = res[prec, "ours"], res[prec, "peer"], res[prec, "unfused"]
    assert count(ours, BN_EX, dtype) == 2 == count(peer, BN_EX, dtype)
    assert count(ours, "Relu") == 0 and count(ours, "_MklNativeFusedBatchNormV3") == 0
    # the gradient: oneDNN's in FP32; in BF16 the 18f rule bf16_relu_bn_grad runs it with its
    # ReluGrad as BatchNormGradNHWC (this project's kernel), reading the same reserve spaces
    grad = "BatchNormGradNHWC" if prec == "bf16" else "_MklNativeFusedBatchNormGradV3"
    assert count(ours, grad, dtype) == 2
    assert count(unf, BN_EX) == 0 and count(unf, "Relu") == 2


@needs_onednn
@pytest.mark.parametrize("kind", ["keras_tf1", "keras_fit"])
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_keras_numerics_vs_unfused(kind, prec):
    assert_equivalent(results(kind), prec, depth=3)  # 2 convs + the logits layer


# ------------------------------------------------------------------ oneDNN off
def test_without_onednn_rules_do_not_fire_and_training_runs():
    off = results("offline", onednn=False)
    for kind in ("slim", "keras_tf1"):
        r = off[kind, "offline"]
        assert r["onednn"] is False
        for rule in ("bias_add_act", "bias_add", "bn_act"):
            assert r["fused"].get(rule, 0) == 0, (kind, rule)
        assert "_FusedBatchNormEx" not in r["ops"]
        assert any("oneDNN" in why for why in r["reasons"]), r["reasons"]
    res = results("slim", onednn=False)
    for prec in ("fp32", "bf16"):
        # the residual adds stay (in BF16 as AddRelu: the 18f rule bf16_add_relu needs no oneDNN)
        assert count(res[prec, "ours"], "AddV2") + count(res[prec, "ours"], "AddRelu") == 3
        assert np.isfinite(res[prec, "ours"]["loss"])
        assert_equivalent(res, prec, depth=12)


# ------------------------------------------------------------------ rewrite only (no kernels run)
@needs_onednn
def test_rewrite_is_idempotent_and_reported():
    """Rewriting the rewritten graph changes nothing (grappler calls the optimizer once per
    meta-optimizer iteration); the report names each fusion."""
    import tensorflow as tf

    import npu_amp_tf
    import _onednn_fusion_worker as W

    for build, rule, n in ((W.build_slim, "bias_add_act", 3), (W.build_keras_tf1, "bn_act", 2)):
        g = tf.Graph()
        with g.as_default():
            _, loss, train = build()
        fetches = [loss.op.name, train.name]
        kw = dict(fetches=fetches, precision_mode="allow_mix_precision_bf16", graph_level=2)
        gd1, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), **kw)
        assert rep.pass_stats("fusion")["fused"][rule] == n
        assert sum(1 for d in rep.decisions.values() if d.get("fusion") == rule) == n
        gd2, rep2 = npu_amp_tf.rewrite_graph(gd1, **kw)
        assert rep2.pass_stats("fusion").get("fused", {}).get(rule, 0) == 0
        key = lambda gd: sorted((x.name, x.op, tuple(x.input)) for x in gd.node)  # noqa: E731
        assert key(gd2) == key(gd1)
