"""``bf16_add_relu``, ``bf16_addn_relu_grad``, ``bf16_relu_bn_grad``, ``bf16_bn_grad`` (issue 18, 18f) and
``bf16_join_grad_sum`` (18h: the batch-None joins of Keras / TF2 function graphs):
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
RULES = ("bf16_add_relu", "bf16_addn_relu_grad", "bf16_relu_bn_grad", "bf16_bn_grad", "bf16_join_grad_sum")
EPS_BF16 = 2.0 ** -8

results = cached_results(WORKER, timeout=900)


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
    from _worker_util import run_worker

    return results("kernels"), run_worker(WORKER, "kernels", timeout=900, portable=True)


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
def test_add_relu_broadcasts_a_leading_dim_of_one_as_tf_does(kernel_runs, path):
    """What the rule lets through for batch-None joins: the two inputs may differ in the leading
    dim at run time, and AddV2 then broadcasts a 1 there; AddRelu must give TF's BF16
    AddV2 -> Relu bits and shape (rows of 1-48 elements: odd tails), and refuse every other
    mismatch with InvalidArgument (AddNReluGrad: any mismatch, as AddN)."""
    runs = kernel_runs[0] if path == "dispatch" else kernel_runs[1]
    rows = [r for r in runs if r["kind"] == "broadcast"]
    assert len(rows) == 4 and {tuple(r["shapes"][0][:1]) == (1,) for r in rows} == {True, False}
    for r in rows:
        assert r["out_shape"] == r["ref_shape"] and r["mismatches"] == 0 and r["float_equal"], r
    errors = [r for r in runs if r["kind"] == "broadcast_errors"][0]["errors"]
    assert "leading dim of 1" in errors["add_relu_2_vs_3"] and "[2,17]" in errors["add_relu_2_vs_3"]
    assert "leading dim of 1" in errors["add_relu_inner"]
    assert "no broadcasting" in errors["addn_relu_grad_lead"]
    assert "leading dim of 1" in errors["join_grad_sum_2"]


@pytest.mark.parametrize("path", ["dispatch", "portable"])
def test_join_grad_sum_forwards_or_sums_the_leading_dim(kernel_runs, path):
    """JoinGradSum (the batch-None join's input gradient): the same bits where the target shape is
    the gradient's; where the target's leading dim is 1, the column sums in FP32 rounded once to
    BF16: within half a BF16 ulp (2^-8 relative) plus FP32 noise of the float64 sums."""
    runs = kernel_runs[0] if path == "dispatch" else kernel_runs[1]
    rows = [r for r in runs if r["kind"] == "join_grad_sum"]
    assert len(rows) == 3
    for r in rows:
        assert r["same_equal"] and r["dtype"] == "bfloat16", r
        assert r["sum_shape"] == [1] + r["shape"][1:], r
        assert r["sum_rel_err"] <= EPS_BF16 * (1 + 2.0 ** -10), r


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
    digests = [[r["digest"] for r in rows if "digest" in r] for rows in (default, portable)]
    assert len(digests[0]) == len(default) - 1 and digests[0] == digests[1]  # (all but the errors row)
    if not _cpu_has_avx512():
        pytest.skip("no AVX-512 here: both runs took the portable loop")


# ------------------------------------------------------------------ offline rewrites
def _offline(kind, mode=None):
    rows = [r for r in results("models") if r["kind"] == kind and (mode is None or r.get("mode") == mode)]
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
    # static shapes: TF's add gradient has no Sum, so bf16_join_grad_sum has nothing to do
    assert r["fused"] == {"bf16_add_relu": 16, "bf16_addn_relu_grad": 15, "bf16_relu_bn_grad": 33, "bf16_bn_grad": 4,
                          "bf16_join_grad_sum": 0}
    ops = r["ops"]
    assert ops["AddRelu"] == 16 and ops["AddNReluGrad"] == 15 and ops["BatchNormGradNHWC"] == 37
    assert ops["FusedBatchNormGradV3"] == 16 and "Relu" not in ops
    assert any("measured to pay from 1024 rows" in s for s in r["reasons"])
    assert r["off"] == {k: None for k in RULES}  # every rule runs in the BF16 mode


def _assert_off(r, mode, why):
    """Outside a BF16 CPU plan each rule is decided once (core.RULE_POLICY, 17p): one rules_off entry
    per rule naming the mode and the reason, with the count of its anchor op in the graph as the
    rule meets it: the input graph's in FP16 (no earlier rule fuses there: no FP16 fused CPU
    kernels); in FP32 ``bn_act`` first fuses the 33 conv -> BN -> Relu into _FusedBatchNormEx, so
    the 16 residual joins' Relus are left for bf16_add_relu."""
    anchors = {"bf16_add_relu": r["orig"]["Relu"], "bf16_addn_relu_grad": r["orig"]["ReluGrad"],
               "bf16_relu_bn_grad": r["orig"]["FusedBatchNormGradV3"],
               "bf16_bn_grad": r["orig"]["FusedBatchNormGradV3"]}
    if mode == "must_keep_origin_dtype":
        anchors["bf16_add_relu"] = 16
    for k in RULES:
        off = r["off"][k]
        assert off is not None and why in off["reason"] and off["mode"] == mode, (k, off)
        if k in anchors:
            assert off["anchors"] == anchors[k], (k, off)
    assert r["reasons"] == []  # no per-anchor skip entries


@pytest.mark.parametrize("mode", ["must_keep_origin_dtype", "allow_mix_precision"])
def test_rules_refused_in_fp32_and_fp16_modes(mode):
    r = _offline("offline_keras", mode)
    assert r["fused"] == {k: 0 for k in RULES}
    assert all(op not in r["ops"] for op in ("AddRelu", "AddNReluGrad", "BatchNormGradNHWC"))
    _assert_off(r, mode, "BF16 only")


def test_rules_refused_with_ge_5hd_layout():
    r = _offline("offline_keras", "allow_mix_precision_bf16:NC1HWC0")
    assert r["fused"] == {k: 0 for k in RULES}
    _assert_off(r, "allow_mix_precision_bf16", "NC1HWC0")


def test_batch_none_join_fires_and_other_broadcasts_are_refused():
    """A join of two [None, 4, 4, 16] convs is rewritten (Keras / TF2 function graphs have batch
    None); relu(j + mean(j, [1, 2])) ([None,4,4,16] + [None,1,1,16]) is not."""
    r = _offline("offline_batch_none")
    assert r["fused"]["bf16_add_relu"] == 1 and r["fused"]["bf16_join_grad_sum"] == 0  # (no gradient here)
    assert r["ops"] == {"none_relu": "AddRelu", "none_bcast_relu": "Relu"}
    assert r["reasons"]["none_bcast_relu"][0] == "bf16_add_relu"
    assert "no broadcasting" in r["reasons"]["none_bcast_relu"][1]


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
# The small ResNets of the worker (Keras applications' ResNet code and TF-Slim's resnet_v1 with 2
# stacks / blocks of 2 bottleneck units, 64x64).  Expected counts, from the architecture:
# * 4 residual joins relu(shortcut + residual), each a forward AddV2 -> Relu; 3 backward joins
#   AddN(2) -> ReluGrad (the relu output of every unit but the last is read by the next unit's
#   first conv and by its shortcut; the last one feeds only the pooling);
# * 9 conv -> BN -> Relu (the stem and 2 per unit), whose gradients are ReluGrad -> BN gradient;
# * Keras: 6 other batch norms (each unit's third, the 2 projection shortcuts): 15; TF-Slim: the
#   first block's projection is the identity (stem and unit depth 64), so 5 others: 14.  Those
#   rewritten alone (bf16_bn_grad) depend on rows, so only the sum is pinned.
EXPECTED = {"keras": {"joins": 4, "back_joins": 3, "relu_bn": 9, "bn": 15},
            "slim_bn": {"joins": 4, "back_joins": 3, "relu_bn": 9, "bn": 14}}


def _models(kind):
    return [r for r in results("models") if r.get("kind") == kind]


def _train(kind):
    rows = {r["config"]: r for r in _models(kind)}
    return rows["fp32"], rows["ours"], rows["norule"], rows["updates"]


def _count(ops, op, dtype=None):
    return sum(n for k, n in ops.items() if k.split(":")[0] == op and (dtype is None or k.endswith(":" + dtype)))


def _bn_grads(ops, dtype):
    return sum(n for k, n in ops.items() if k.split(":")[0].endswith("FusedBatchNormGradV3") and k.endswith(dtype))


@pytest.mark.parametrize("kind", ["keras", "slim_bn"])
def test_training_step_runs_the_kernels_in_bf16(kind):
    """Keras (images of batch None: the joins have an unknown leading dim) and TF-Slim (static
    batch, resnet_arg_scope: conv -> BN -> Relu): every join forward and backward, every
    conv -> BN -> Relu gradient fused with its ReluGrad, every batch-norm gradient still run once
    in BF16."""
    fp32, ours, norule, _ = _train(kind)
    e = EXPECTED[kind]
    o, n = ours["ops"], norule["ops"]
    assert _count(o, "AddRelu", "bfloat16") == e["joins"] == _count(o, "AddRelu")
    assert _count(o, "AddNReluGrad", "bfloat16") == e["back_joins"] == _count(o, "AddNReluGrad")
    fused_bn = _count(o, "BatchNormGradNHWC", "bfloat16")
    assert fused_bn == _count(o, "BatchNormGradNHWC") and fused_bn >= e["relu_bn"]
    # every batch-norm gradient in BF16 (without the rules, Keras' batch-None graph runs 6 of them
    # in FP32, after the FP32 Sums of the add gradients: hence dtype-free counts for norule)
    assert fused_bn + _bn_grads(o, "bfloat16") == _bn_grads(n, "") == e["bn"] and _bn_grads(o, "float32") == 0
    assert _count(o, "Relu", "bfloat16") == 0 and _count(n, "Relu", "bfloat16") == e["joins"]
    assert _count(o, "ReluGrad", "bfloat16") == _count(o, "ReluGrad") == \
        _count(n, "ReluGrad") - e["back_joins"] - e["relu_bn"]
    assert _count(o, "AddN", "bfloat16") == _count(o, "AddN") == _count(n, "AddN") - e["back_joins"]
    # the add gradients: with batch None TF sums each join input's gradient over
    # BroadcastGradientArgs (2 Sums per join), each a BF16 JoinGradSum here (TF's Sum is black on
    # 2.15: FP32 islands); with static shapes TF emits no Sum
    sums = 2 * e["joins"] if kind == "keras" else 0
    assert _count(o, "JoinGradSum", "bfloat16") == sums == _count(o, "JoinGradSum")
    assert _count(o, "Sum") == _count(n, "Sum") - sums
    # no new Cast
    assert _count(o, "Cast") <= _count(n, "Cast"), (_count(o, "Cast"), _count(n, "Cast"))
    assert all(not k.startswith(("AddRelu", "AddNReluGrad", "BatchNormGradNHWC", "JoinGradSum")) for k in fp32["ops"])


@pytest.mark.parametrize("kind", ["keras", "slim_bn"])
def test_training_step_matches_the_unfused_bf16_graph(kind):
    fp32, ours, norule, upd = _train(kind)
    # the forward is bit-identical (AddRelu == AddV2 -> Relu in BF16)
    assert ours["loss"] == norule["loss"]
    assert upd["finite"] and upd["size"] > 50_000
    assert upd["ours_fp32"] <= 1.25 * upd["norule_fp32"] + EPS_BF16, upd
    # the kernels move the update far less than BF16 itself does
    assert upd["ours_norule"] <= 0.1 * upd["norule_fp32"], upd


def test_slim_without_batch_norm_backward_join_is_bit_identical():
    """TF-Slim resnet_v1 as benchmarks/end_to_end.py builds it (no arg scope): the forward join
    (conv + bias + add + Relu) is one oneDNN conv already (``bias_add_act``), so only the 3
    backward joins are rewritten, and AddNReluGrad is exact: the whole step equals the unfused one."""
    fp32, ours, norule, upd = _train("slim")
    o, n = ours["ops"], norule["ops"]
    assert _count(o, "AddNReluGrad", "bfloat16") == 3 and _count(o, "AddRelu") == 0
    assert _count(o, "AddN", "bfloat16") == _count(n, "AddN", "bfloat16") - 3
    assert _count(o, "ReluGrad", "bfloat16") == _count(n, "ReluGrad", "bfloat16") - 3
    assert _count(o, "Cast") == _count(n, "Cast")
    assert ours["loss"] == norule["loss"] and upd["ours_norule"] == 0.0 and upd["finite"]


@pytest.mark.parametrize("kind", ["join", "join_bcast"])
def test_batch_none_join_in_a_session_equals_tf(kind):
    """relu(conv(xa) + conv(xb)) with xa, xb of batch None, fed 3 and 3 (equal shapes) or 1 and 3
    (AddV2 broadcasts the leading dim): AddRelu runs in BF16 and the output, its gradient and the
    update are bit-identical to the unfused BF16 graph's."""
    fp32, ours, norule, upd = _train(kind)
    assert _count(ours["ops"], "AddRelu", "bfloat16") == 1 and _count(norule["ops"], "AddRelu") == 0
    assert _count(ours["ops"], "Relu") == 0 and _count(norule["ops"], "Relu", "bfloat16") == 1
    assert _count(ours["ops"], "JoinGradSum", "bfloat16") == 2 and _count(ours["ops"], "Sum") == 0
    assert ours["loss_digest"] == norule["loss_digest"] and ours["loss"] == norule["loss"]
    assert upd["finite"]
    if kind == "join":  # JoinGradSum forwards the gradient: the step is the unfused one, bit for bit
        assert upd["ours_norule"] == 0.0
    else:  # the batch-1 side's gradient is summed over 3 rows in FP32 and rounded once (TF: FP32 Sum,
        # then the Cast to BF16 for the conv's gradient): at most BF16 rounding apart
        assert upd["ours_norule"] <= EPS_BF16, upd


def test_keras_train_on_batch_runs_the_joins_in_bf16():
    """Keras' own ``train_on_batch`` (the fit train function, TF2) of the small Keras ResNet: the
    joins (batch None in the traced function) run as AddRelu / AddNReluGrad in BF16, every
    conv -> BN -> Relu gradient fused, the loss equal to the unfused BF16 function's."""
    rows = {r["config"]: r for r in _models("keras_fit")}
    o, n = rows["ours"]["ops"], rows["norule"]["ops"]
    e = EXPECTED["keras"]
    assert _count(o, "AddRelu", "bfloat16") == e["joins"] == _count(o, "AddRelu")
    assert _count(o, "AddNReluGrad", "bfloat16") == e["back_joins"] == _count(o, "AddNReluGrad")
    assert _count(o, "BatchNormGradNHWC", "bfloat16") >= e["relu_bn"] and _count(o, "BatchNormGradNHWC", "float32") == 0
    assert _count(o, "BatchNormGradNHWC") + _bn_grads(o, "") == _bn_grads(n, "") == e["bn"]
    assert _count(o, "Relu") == 0 and _count(n, "Relu", "bfloat16") == e["joins"]
    assert _count(o, "Cast") <= _count(n, "Cast")
    assert rows["ours"]["loss"] == rows["norule"]["loss"]
