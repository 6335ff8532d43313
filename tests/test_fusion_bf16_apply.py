"""``bf16_apply_momentum`` (issue 18j): under a BF16 plan the momentum update of a variable whose
gradient a BF16 matrix op produces reads that BF16 gradient directly
(``ResourceApplyMomentumMixed``, ``custom_ops/bf16_apply.cc``) instead of ``Cast(bf16 -> f32) ->
ResourceApplyMomentum``.

Every run happens in a subprocess (``_bf16_apply_worker.py``): a kernel may abort TF.

Tolerance: none.  Widening BF16 to FP32 is exact and the kernel evaluates TF's CPU formula in the
same order with the same roundings, so var and accum must equal TF's ``Cast -> ResourceApply*``
bit for bit (direct calls), and a whole training run with the rule must equal the same BF16 plan
without it (``norule``) bit for bit in every variable and momentum slot after 3 steps (the
forward and backward graphs are the same; only the updates' input Casts go).
"""
from __future__ import annotations

import os

import pytest

from _worker_util import cached_results

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_bf16_apply_worker.py")
MIXED = "ResourceApplyMomentumMixed"

results = cached_results(WORKER, timeout=900)


def _by(kind_results, kind, config=None):
    out = [r for r in kind_results if r["kind"] == kind and (config is None or r.get("config") == config)]
    assert out, (kind, config)
    return out


def test_kernel_equals_cast_plus_tf_apply_bit_for_bit():
    rs = _by(results("kernels"), "kernel")
    assert len(rs) == 2 * 2 * 3 * 2  # keras x nesterov x shapes x grad dtypes
    for r in rs:
        assert r["changed"], r
        assert r["var_equal"] and r["accum_equal"], r


def test_portable_loop_equals_cast_plus_tf_apply_too():
    """The AVX-512 loop (chosen on this CPU where it has avx512f) and the portable loop
    (NPU_AMP_TF_BF16_PORTABLE=1) both give TF's bits."""
    from _worker_util import run_worker

    rs = [r for r in run_worker(WORKER, "kernels", timeout=900, portable=True) if r["kind"] == "kernel"]
    assert len(rs) == 24 and all(r["var_equal"] and r["accum_equal"] and r["changed"] for r in rs)


def test_kernel_rejects_a_gradient_of_another_shape():
    (r,) = _by(results("kernels"), "kernel_error")
    assert "do not have the same shape" in r["error"], r


@pytest.mark.parametrize("kind, apply_op", [("slim", "ResourceApplyMomentum"),
                                            ("slim_bn_nesterov", "ResourceApplyMomentum"),
                                            ("keras", "ResourceApplyMomentum"),
                                            ("keras_sgd", "ResourceApplyKerasMomentum")])
def test_real_resnets_fuse_and_train_bit_identically(kind, apply_op):
    rs = results("models")
    (ours,), (norule,), (cmp,) = (_by(rs, kind, c) for c in ("ours", "norule", "compare"))
    n_mixed = ours["ops"].get(f"{MIXED}:bfloat16", 0)
    # the rule fired on at least every conv / dense kernel (rank >= 2; biases fuse where a BF16
    # MatMul computes their gradient), and every fused update runs BF16
    assert n_mixed >= ours["kernels"] > 0, (n_mixed, ours["kernels"])
    assert f"{MIXED}:float32" not in ours["ops"]
    assert MIXED not in str(norule["ops"])
    # one update per trainable variable either way, and each fused one dropped exactly one widening Cast
    total = ours["ops"].get(f"{apply_op}:float32", 0) + n_mixed
    assert total == norule["ops"][f"{apply_op}:float32"] == ours["trainable"], (total, norule["ops"])
    widen = "Cast:bfloat16->float32"
    assert norule["casts"].get(widen, 0) - ours["casts"].get(widen, 0) == n_mixed, (ours["casts"], norule["casts"])
    # every other executed op is the same, dtype for dtype
    strip = lambda ops: {k: v for k, v in ops.items() if "Apply" not in k and not k.startswith("Cast")}  # noqa: E731
    assert strip(ours["ops"]) == strip(norule["ops"])
    # bit-identical training: losses of the 3 steps, every variable and momentum slot after them
    assert ours["losses"] == norule["losses"]
    assert cmp["n_differ"] == 0, cmp["differ"]
    assert cmp["moved"] > 0


def test_refused_outside_bf16_cpu_plans():
    rs = {r["mode"]: r for r in _by(results("offline"), "offline_slim")}
    bf = rs["allow_mix_precision_bf16"]
    assert 0 < bf["fused"] < bf["n_apply"]
    assert bf["ops"] == {"ResourceApplyMomentum": bf["n_apply"] - bf["fused"], MIXED: bf["fused"]}
    # what stays unfused in the small Slim net is a conv bias whose gradient is a (gray) BiasAddGrad
    assert bf["reasons"] and all("(BiasAddGrad) is not a matrix op planned BF16" in r for r in bf["reasons"])
    assert bf["off"] is None  # the rule runs in the BF16 mode
    # outside a BF16 CPU plan the rule is decided once (core.RULE_POLICY, 17p): one entry in the fusion
    # stats' rules_off naming the mode and the reason, with the count of update ops; no per-anchor skips
    for mode, why in (("must_keep_origin_dtype", "BF16 only"), ("allow_mix_precision", "BF16 only"),
                      ("allow_mix_precision_bf16:NC1HWC0", "NC1HWC0")):
        assert rs[mode]["fused"] == 0 and rs[mode]["ops"] == {"ResourceApplyMomentum": bf["n_apply"]}, mode
        off = rs[mode]["off"]
        assert off is not None and why in off["reason"], (mode, off)
        assert off["mode"] == mode.split(":")[0] and off["anchors"] == bf["n_apply"], (mode, off)
        assert rs[mode]["reasons"] == [], rs[mode]["reasons"]


def test_refusals_in_the_bf16_mode():
    (r,) = _by(results("offline"), "offline_refusals")
    assert r["fused"] == 1
    assert r["ops"]["main/update_w/ResourceApplyMomentum"] == [MIXED, "bfloat16"]  # a MatMul's gradient
    assert r["ops"]["main/update_bias/ResourceApplyMomentum"] == ["ResourceApplyMomentum", "float32"]
    assert "(BiasAddGrad) is not a matrix op" in r["reasons"]["main/update_bias/ResourceApplyMomentum"]
    assert r["ops"]["f64/update_w64/ResourceApplyMomentum"] == ["ResourceApplyMomentum", "float64"]
    assert "float64" in r["reasons"]["f64/update_w64/ResourceApplyMomentum"]
    # a ref variable's ApplyMomentum is not matched at all
    assert r["ops"]["reftrain/update_ref/wref/ApplyMomentum"] == ["ApplyMomentum", "float32"]
    assert not any("ApplyMomentum" == n.rsplit("/", 1)[-1] for n in r["reasons"])


def test_tf2_function_keras_fit_fuses_and_trains_bit_identically():
    """``train_on_batch`` (TF2 function graphs, ``enable()``) with Keras' legacy SGD(momentum): the
    updates are the function's control outputs (preserved nodes); the rule replaces them under their
    names and the precision pass paints their gradient dtype all the same."""
    rs = results("models")
    (ours,), (norule,), (cmp,) = (_by(rs, "keras_fit", c) for c in ("ours", "norule", "compare"))
    n_mixed = ours["ops"].get(f"{MIXED}:bfloat16", 0)
    assert n_mixed >= ours["kernels"] > 0, (n_mixed, ours["kernels"])
    assert f"{MIXED}:float32" not in ours["ops"] and MIXED not in str(norule["ops"])
    assert (ours["ops"]["ResourceApplyKerasMomentum:float32"] + n_mixed
            == norule["ops"]["ResourceApplyKerasMomentum:float32"])
    assert norule["ops"]["Cast:"] - ours["ops"]["Cast:"] == n_mixed
    assert ours["losses"] == norule["losses"]
    assert cmp["n_differ"] == 0 and cmp["moved"] > 0
