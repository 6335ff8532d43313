"""``bf16_add_relu``, ``bf16_addn_relu_grad``, ``bf16_relu_bn_grad``, ``bf16_bn_grad`` (issue 18, 18f):
the BF16 residual-unit elementwise chain and the training batch-norm gradient run as this
project's kernels (``custom_ops/bf16_elementwise.cc``), measured 1.5-2.4x faster than TF's BF16
ops on ResNet-50's shapes (``benchmarks/fused_forms.py --bf16-elementwise``, table in
``graph_passes/fusion/bf16_elementwise.py``).

Every run happens in a subprocess (``_bf16_elementwise_worker.py``): a kernel may abort TF.

Tolerances.
* AddRelu / AddNReluGrad: TF computes ``AddV2`` / ``AddN`` in FP32 and rounds to BF16, then Relu /
  ReluGrad select or zero; the kernels do the same, so the bits must be equal (tails of 1-15
  elements, denormals, +-0, +-inf included).  NaN results (inf * 0 in ReluGrad) are only checked
  to be NaN: TF's own kernels give 0x7fc0 in their vectorised body and keep the sign in their
  scalar tail.
* BatchNormGradNHWC: dx is FP32 arithmetic rounded once to BF16, so against a float64 reference
  (computed by NumPy in the worker from the same BF16 inputs) each element is off by at most half
  a BF16 ulp of itself plus FP32 noise: max |err| / max |dx| <= 2^-8.  TF's BF16
  FusedBatchNormGradV3 on the same inputs must show that bound too (it is the same computation),
  and ours must not be worse than it by more than 2^-12.  dscale / doffset are FP32 sums of at most
  1024 terms: relative error <= 1e-5.
* Training steps: the forward pass is bit-identical with and without the rules (AddRelu equals
  AddV2 -> Relu), so the loss is equal; the updates differ by BF16 rounding of the gradients
  (another summation order inside the batch-norm gradient): ours must be no further from FP32's
  updates than the unfused BF16 graph (``norule``) is, plus 25%, and ours - norule must be at most
  a tenth of norule - FP32 (what BF16 itself changes; measured on Keras ResNet-50, TF 2.21: 0.016
  vs 1.30 relative L2 over all 23.6M variables after one step from a random start).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from _worker_util import cached_results, rel_l2

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_bf16_elementwise_worker.py")
RULES = ("bf16_add_relu", "bf16_addn_relu_grad", "bf16_relu_bn_grad", "bf16_bn_grad")
EPS_BF16 = 2.0 ** -8

results = cached_results(WORKER, timeout=1500)


def _cpu_has_avx512():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = fh.read()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl"))


@pytest.fixture(scope="module")
def kernel_runs():
    """The ``kernels`` results with the dispatch as on this CPU, and with the portable loop forced."""
    default = results("kernels")
    old = os.environ.get("NPU_AMP_TF_BF16_PORTABLE")
    os.environ["NPU_AMP_TF_BF16_PORTABLE"] = "1"
    try:
        from _worker_util import run_worker

        portable = run_worker(WORKER, "kernels", timeout=900)
    finally:
        if old is None:
            os.environ.pop("NPU_AMP_TF_BF16_PORTABLE")
        else:
            os.environ["NPU_AMP_TF_BF16_PORTABLE"] = old
    return default, portable


@pytest.mark.parametrize("path", ["dispatch", "portable"])
def test_elementwise_kernels_equal_tf_bf16_bit_for_bit(kernel_runs, path):
    runs = kernel_runs[0] if path == "dispatch" else kernel_runs[1]
    rows = [r for r in runs if r["kind"] == "elementwise"]
    sizes = [int(np.prod(r["shape"])) for r in rows]
    assert any(s % 16 for s in sizes) and any(s % 16 == 0 for s in sizes) and min(sizes) < 16
    for r in rows:
        assert r["add_relu_mismatches"] == 0, r
        assert r["addn_relu_grad_mismatches"] == 0, r
        assert r["float_add_relu_equal"] and r["float_addn_relu_grad_equal"], r
    # the data does exercise NaN results (inf * 0) in ReluGrad
    assert sum(r["addn_relu_grad_nans"] for r in rows) > 0


@pytest.mark.parametrize("path", ["dispatch", "portable"])
def test_batch_norm_grad_kernel_against_float64(kernel_runs, path):
    runs = kernel_runs[0] if path == "dispatch" else kernel_runs[1]
    rows = [r for r in runs if r["kind"] == "bn_grad"]
    assert {r["shape"][-1] % 16 == 0 for r in rows} == {True, False}  # vector and portable-only channels
    for r in rows:
        for key in ("plain", "relu"):
            e = r[key]
            assert e["dx_dtype"] == "bfloat16" and e["dscale_dtype"] == "float32"
            assert e["dx_err_tf"] <= EPS_BF16, (r["shape"], key, e)
            assert e["dx_err_ours"] <= EPS_BF16, (r["shape"], key, e)
            assert e["dx_err_ours"] <= e["dx_err_tf"] + 2.0 ** -12, (r["shape"], key, e)
            assert e["dscale_err"] <= 1e-5 and e["doffset_err"] <= 1e-5, (r["shape"], key, e)


def test_portable_and_vector_paths_give_identical_bits(kernel_runs):
    default, portable = kernel_runs
    assert [r["digest"] for r in default] == [r["digest"] for r in portable]
    if not _cpu_has_avx512():
        pytest.skip("no AVX-512 here: both runs took the portable loop")


# ------------------------------------------------------------------ offline rewrites
def _offline(kind, mode=None):
    rows = [r for r in results("offline") if r["kind"] == kind and (mode is None or r.get("mode") == mode)]
    assert len(rows) == 1
    return rows[0]


def test_rules_fire_on_keras_resnet50_offline_in_bf16():
    r = _offline("offline_keras", "allow_mix_precision_bf16")
    # ResNet-50: 16 bottleneck blocks, each ending in relu(shortcut + residual); the last one's
    # Relu feeds only the global average pool, so 15 of their gradients are AddN(2) -> ReluGrad.
    # 33 conv -> BN -> Relu (2 per block + the stem) have ReluGrad -> FusedBatchNormGradV3; of the
    # 20 other batch norms (each block's third + 4 projection shortcuts) at 64x64, batch 4, only
    # the 4 of stage 1 (16x16: 1024 rows) reach MIN_BN_ROWS.
    assert r["orig"] == {"Relu": 49, "FusedBatchNormGradV3": 53, "AddN": 16, "ReluGrad": 49}
    assert r["fused"] == {"bf16_add_relu": 16, "bf16_addn_relu_grad": 15, "bf16_relu_bn_grad": 33, "bf16_bn_grad": 4}
    ops = r["ops"]
    assert ops["AddRelu"] == 16 and ops["AddNReluGrad"] == 15 and ops["BatchNormGradNHWC"] == 37
    assert ops["FusedBatchNormGradV3"] == 16 and "Relu" not in ops
    assert any("measured to pay from 1024 rows" in s for s in r["reasons"])


@pytest.mark.parametrize("mode", ["must_keep_origin_dtype", "allow_mix_precision"])
def test_rules_refused_in_fp32_and_fp16_modes(mode):
    r = _offline("offline_keras", mode)
    assert r["fused"] == {k: 0 for k in RULES}
    assert all(op not in r["ops"] for op in ("AddRelu", "AddNReluGrad", "BatchNormGradNHWC"))
    assert r["reasons"] and all("BF16 only" in s for s in r["reasons"])


def test_rules_refused_with_ge_5hd_layout():
    r = _offline("offline_keras", "allow_mix_precision_bf16:NC1HWC0")
    assert r["fused"] == {k: 0 for k in RULES}
    assert r["reasons"] and all("NC1HWC0" in s for s in r["reasons"])


def test_refusals_broadcast_addn3_small_and_nchw_batch_norms():
    r = _offline("offline_refusals")
    assert r["fused"] == {k: 0 for k in RULES}
    reasons = {k: v for k, v in r["reasons"].items()}
    assert reasons.get("bcast_relu", ["", ""])[0] == "bf16_add_relu"
    assert "no broadcasting" in reasons["bcast_relu"][1]
    bn = [v for k, v in reasons.items() if "FusedBatchNormGradV3" in k]
    assert bn == [["bf16_bn_grad", "N*H*W = 32: measured to pay from 1024 rows"]]
    ops = r["ops"]
    assert ops["FusedBatchNormGradV3"] == 2  # the small NHWC one and the NCHW one stay
    assert ops.get("AddN", 0) >= 1 and "AddNReluGrad" not in ops  # the AddN of 3 stays


# ------------------------------------------------------------------ executed training steps
def _train(kind):
    rows = {r["config"]: r for r in results(kind)}
    return rows["fp32"], rows["ours"], rows["norule"], rows["updates"]


def _count(ops, op, dtype=None):
    return sum(n for k, n in ops.items() if k.split(":")[0] == op and (dtype is None or k.endswith(":" + dtype)))


def _bn_grads(ops, dtype):
    return sum(n for k, n in ops.items() if k.split(":")[0].endswith("FusedBatchNormGradV3") and k.endswith(dtype))


@pytest.mark.parametrize("kind", ["keras", "slim_bn"])
def test_training_step_runs_the_kernels_in_bf16(kind):
    """Keras ResNet50 and TF-Slim resnet_v1_50 under resnet_arg_scope (conv -> BN -> Relu): 16 joins
    forward, 15 backward (the last join feeds only the pool), the 33 conv -> BN -> Relu gradients
    fused with their ReluGrad, every batch-norm gradient still run once in BF16."""
    fp32, ours, norule, _ = _train(kind)
    o, n = ours["ops"], norule["ops"]
    assert _count(o, "AddRelu", "bfloat16") == 16 and _count(o, "AddRelu") == 16
    assert _count(o, "AddNReluGrad", "bfloat16") == 15 and _count(o, "AddNReluGrad") == 15
    fused_bn = _count(o, "BatchNormGradNHWC", "bfloat16")
    assert fused_bn == _count(o, "BatchNormGradNHWC") and fused_bn >= 33
    assert fused_bn + _bn_grads(o, "bfloat16") == _bn_grads(n, "bfloat16") == 53
    assert _count(o, "Relu", "bfloat16") == 0 and _count(n, "Relu", "bfloat16") == 16
    assert _count(o, "ReluGrad", "bfloat16") == _count(n, "ReluGrad", "bfloat16") - 15 - 33
    assert _count(o, "AddN", "bfloat16") == _count(n, "AddN", "bfloat16") - 15
    # no new Cast
    assert _count(o, "Cast") <= _count(n, "Cast"), (_count(o, "Cast"), _count(n, "Cast"))
    assert all(not k.startswith(("AddRelu", "AddNReluGrad", "BatchNormGradNHWC")) for k in fp32["ops"])


@pytest.mark.parametrize("kind", ["keras", "slim_bn"])
def test_training_step_matches_the_unfused_bf16_graph(kind):
    fp32, ours, norule, upd = _train(kind)
    # the forward is bit-identical (AddRelu == AddV2 -> Relu in BF16)
    assert ours["loss"] == norule["loss"]
    assert upd["finite"] and upd["size"] > 20_000_000
    assert upd["ours_fp32"] <= 1.25 * upd["norule_fp32"] + EPS_BF16, upd
    # the kernels move the update far less than BF16 itself does
    assert upd["ours_norule"] <= 0.1 * upd["norule_fp32"], upd


def test_slim_without_batch_norm_backward_join_is_bit_identical():
    """TF-Slim resnet_v1_50 as benchmarks/end_to_end.py builds it (no arg scope): the forward join
    (conv + bias + add + Relu) is one oneDNN conv already (``bias_add_act``), so only the 15
    backward joins are rewritten, and AddNReluGrad is exact: the whole step equals the unfused one."""
    fp32, ours, norule, upd = _train("slim")
    o, n = ours["ops"], norule["ops"]
    assert _count(o, "AddNReluGrad", "bfloat16") == 15 and _count(o, "AddRelu") == 0
    assert _count(o, "AddN", "bfloat16") == _count(n, "AddN", "bfloat16") - 15
    assert _count(o, "ReluGrad", "bfloat16") == _count(n, "ReluGrad", "bfloat16") - 15
    assert _count(o, "Cast") == _count(n, "Cast")
    assert ours["loss"] == norule["loss"] and upd["ours_norule"] == 0.0 and upd["finite"]
