"""``bf16_gelu`` and ``bf16_attention_train`` (issue 18, 18g): in a BF16 training graph the exact
GELU and its autodiff gradient run as ``GeluErf`` / ``GeluErfGrad`` (custom_ops/gelu.cc), and the
attention's scale + softmax and their backward as ``ScaleMaskSoftmax`` / ``ScaleMaskSoftmaxGrad``
with BF16 I/O (graph_passes/fusion/bf16_transformer.py).  Measured on the BERT-like benchmark
(docs/benchmarks.md, 18g).

Every run happens in a subprocess (``_bf16_transformer_worker.py``): a kernel may abort TF.

Tolerances.
* Kernels (GeluErf/Grad, the BF16 rows of ScaleMaskSoftmax/Grad and LayerNorm/Grad): each computes
  its formula in FP32 and rounds once to BF16, so against a float64
  reference computed from the same BF16 inputs each element is off by at most half a BF16 ulp of
  itself (2^-8 |ref|: 8 significant bits) plus the FP32 error of erf / exp / the row sums
  (``floor``: 2e-6 max(|x|, 1) for the GELU, scaled by |dy| for its gradient; 1e-6 for the
  probabilities; 1e-5 max|ref| for the softmax gradient).  The worker reports
  max |err| / (2^-8 |ref| + floor), which must be <= 1.  TF's own BF16 GELU chain on the same data
  must be worse (it rounds after every op: erf(x/sqrt2) rounds to -1 below x = -3.4, so its GELU
  is 0 there): that proves the comparison can fail.  Float kernels: 1e-6 relative + the floor.
* BERT step: the loss is read after BF16 matmuls, so ours must be within 1% of FP32's (the issue's
  goal is 2% after 50 steps); the gradients (Adam's first moments after one step:
  m = (1 - beta1) * g) must be no further from FP32's than the unfused BF16 graph's (``norule``)
  plus 25%: the fused kernels round once where TF's chains round at every op.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from _worker_util import cached_results

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_bf16_transformer_worker.py")
RULES = ("bf16_gelu", "bf16_attention_train")
LAYERS = 2

results = cached_results(WORKER, timeout=900)


@pytest.fixture(scope="module")
def kernel_runs():
    """``kernels`` with the dispatch as on this CPU, and with the portable loops forced."""
    from _worker_util import run_worker

    return results("kernels"), run_worker(WORKER, "kernels", timeout=600, portable=True)


@pytest.mark.parametrize("path", ["dispatch", "portable"])
def test_gelu_kernels_round_once_from_fp32(kernel_runs, path):
    rows = [r for r in (kernel_runs[0] if path == "dispatch" else kernel_runs[1]) if r["kind"] == "gelu"]
    assert {r["n"] for r in rows} >= {1, 15, 16, 17, 1000}  # tails and full 16-lane blocks
    for r in rows:
        assert r["dtype"] == "bfloat16", r
        assert r["fwd"] <= 1.0 and r["grad"] <= 1.0, r
        assert r["float_fwd"] <= 1.0 and r["float_grad"] <= 1.0, r
    big = [r for r in rows if r["n"] >= 200]
    # TF's BF16 op chain on the same data misses the bound by far (the test can fail)
    assert all(r["tf_fwd"] > 2.0 and r["tf_grad"] > 2.0 for r in big), big


@pytest.mark.parametrize("path", ["dispatch", "portable"])
def test_softmax_bf16_rows_round_once_from_fp32(kernel_runs, path):
    rows = [r for r in (kernel_runs[0] if path == "dispatch" else kernel_runs[1]) if r["kind"] == "softmax"]
    assert any(r["shape"][-1] % 16 for r in rows) and len(rows) == 4
    for r in rows:
        assert r["dtype"] == "bfloat16", r
        assert r["fwd"] <= 1.0 and r["grad"] <= 1.0, r


@pytest.mark.parametrize("path", ["dispatch", "portable"])
def test_layer_norm_bf16_rows_round_once_from_fp32(kernel_runs, path):
    """LayerNorm / LayerNormGrad BF16 rows (AVX-512 rows since 18g): y and dx one rounding from an
    FP32 computation whose sums over D <= 768 terms err by < D * 2^-24 of the largest value (the
    1e-5 / 1e-4 max|ref| floors); dgamma / dbeta sum over rows in FP32, rounded to BF16."""
    rows = [r for r in (kernel_runs[0] if path == "dispatch" else kernel_runs[1]) if r["kind"] == "layer_norm"]
    assert len(rows) == 3 and any(r["shape"][1] % 16 for r in rows)
    for r in rows:
        assert r["dtype"] == "bfloat16", r
        assert max(r["fwd"], r["dx"], r["dgamma"], r["dbeta"]) <= 1.0, r


@pytest.fixture(scope="module")
def bert_runs():
    return {r["config"]: r for r in results("graphs") if r["kind"] == "bert"}


def test_bert_step_runs_the_fused_ops_in_bf16(bert_runs):
    ours, norule, fp32 = bert_runs["ours"]["ops"], bert_runs["norule"]["ops"], bert_runs["fp32"]["ops"]
    for op in ("GeluErf", "GeluErfGrad", "ScaleMaskSoftmax", "ScaleMaskSoftmaxGrad"):
        assert ours.get(f"{op}:bfloat16") == LAYERS, (op, ours)
        assert not any(k.startswith(op + ":") for k in norule) and not any(k.startswith(op + ":") for k in fp32)
    # what they replace is gone: no Erf, no TF softmax (oneDNN's _MklSoftmax once rewritten)
    assert not any(k.split(":")[0] in ("Erf", "Erfc", "Softmax", "_MklSoftmax", "Exp") for k in ours), ours
    # tf.nn.gelu: erf up to TF 2.15, erfc from TF 2.16
    assert norule.get("Erf:bfloat16", 0) + norule.get("Erfc:bfloat16", 0) == LAYERS, norule
    assert sum(v for k, v in ours.items() if k.startswith("Cast:")) < \
        sum(v for k, v in norule.items() if k.startswith("Cast:"))
    assert bert_runs["ours"]["fused"] == {"bf16_gelu": LAYERS, "bf16_attention_train": LAYERS}
    assert bert_runs["norule"]["fused"] == {}


def test_bert_step_values(bert_runs):
    f = bert_runs["fp32"]
    assert abs(bert_runs["ours"]["loss"] - f["loss"]) <= 0.01 * abs(f["loss"])

    def dist(cfg):
        keys = sorted(f["m"])
        a = np.concatenate([np.asarray(bert_runs[cfg]["m"][k], np.float64) for k in keys])
        b = np.concatenate([np.asarray(f["m"][k], np.float64) for k in keys])
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    d_ours, d_norule = dist("ours"), dist("norule")
    assert 0 < d_norule < 0.05, d_norule  # BF16 does change the gradients, a little
    assert d_ours <= 1.25 * d_norule, (d_ours, d_norule)


def _erfs(ops):
    """Erf + Erfc nodes (tf.nn.gelu: erf up to TF 2.15, erfc from TF 2.16)."""
    return ops.get("Erf", 0) + ops.get("Erfc", 0)


@pytest.fixture(scope="module")
def offline_runs():
    return results("graphs")


def test_offline_counts_and_refusals(offline_runs):
    by = {r["mode"]: r for r in offline_runs if r["kind"] == "offline_bert"}
    bf16 = by["bf16"]
    assert bf16["fused"] == {"bf16_gelu": LAYERS, "bf16_attention_train": LAYERS}, bf16
    assert _erfs(bf16["ops"]) == 0 and bf16["ops"].get("Softmax", 0) == 0
    assert bf16["ops"]["GeluErf"] == bf16["ops"]["GeluErfGrad"] == LAYERS
    assert bf16["off"] == {} and bf16["softmax"] == LAYERS
    # outside a BF16 CPU plan each rule is decided once (core.RULE_POLICY, 17p): one rules_off entry
    # per rule (the mode, the reason, the count of its anchor op), no per-anchor skip entries
    for label, mode, why in (("fp32", "must_keep_origin_dtype", "BF16 only"), ("fp16", "allow_mix_precision", "BF16 only"),
                             ("nc1hwc0", "allow_mix_precision_bf16", "NC1HWC0")):
        r = by[label]
        assert r["fused"] == {} and r["ops"].get("GeluErf", 0) == 0 and _erfs(r["ops"]) == LAYERS, r
        assert r["refused"] == {}, r["refused"]
        assert sorted(r["off"]) == sorted(RULES), r["off"]
        for rule, off in r["off"].items():
            assert why in off["reason"] and off["mode"] == mode, (label, rule, off)
        assert r["off"]["bf16_attention_train"]["anchors"] == LAYERS  # its anchors: the Softmax ops


def test_keras_transformer_block(offline_runs):
    r = next(r for r in offline_runs if r["kind"] == "keras_block")
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["fused"] == {"bf16_gelu": 1, "bf16_attention_train": 1}, r["refused"]
    assert r["ops"]["GeluErfGrad"] == 1 and r["ops"]["ScaleMaskSoftmaxGrad"] == 1
    assert _erfs(r["ops"]) == 0


@pytest.mark.parametrize("case,why", [("dynamic", "is not static"), ("not_gelu", "constant is not 0.5")])
def test_refused_shapes_and_forms(offline_runs, case, why):
    r = next(r for r in offline_runs if r["kind"] == "offline_refusal" and r["case"] == case)
    assert r["fused"] == {} and r["ops"].get("GeluErf", 0) == 0 and r["ops"]["Erf"] == 1
    assert [x for x in r["refused"].values() if x[0] == "bf16_gelu" and why in x[1]], r["refused"]
