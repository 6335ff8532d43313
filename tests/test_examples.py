"""Smoke tests of examples/: each script runs as a subprocess with few steps,
and the figures it prints (its ``RESULT key=value ...`` line) are checked:
the plugin really rewrote the graph (low-precision share, casts), the loss
scale is sane, and the AMP run tracks FP32."""
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import TF_VERSION, requires_estimator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run_example(name, *args, timeout=240):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=ROOT)
    out = p.stdout
    assert p.returncode == 0, f"{name} exited {p.returncode}\n{out[-3000:]}\n{p.stderr[-3000:]}"
    if out.startswith("SKIP:") or "\nSKIP:" in out:
        pytest.skip(out.split("SKIP:", 1)[1].strip().splitlines()[0])
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"{name} printed no RESULT line\n{out[-3000:]}"
    res = {}
    for k, v in re.findall(r"(\w+)=(\S+)", lines[-1]):
        try:
            res[k] = float(v)
        except ValueError:
            res[k] = v
    return res, out


def finite(*xs):
    return all(isinstance(x, float) and math.isfinite(x) for x in xs)


def check_loss_scale(r, steps, init_scale=128.0):
    """The dynamic loss scale as CANN's ExponentialUpdateLossScaleManager
    defines it, replayed from the counts the example printed: every step was
    counted, every overflowing step was skipped, and with no overflow the
    scale grew by ``incr_ratio`` once per ``incr_every`` steps from CANN's
    initial 128; with overflows it is below that."""
    assert r["ls_steps"] == steps
    assert r["skipped"] == r["overflows"]
    grown = init_scale * r["incr_ratio"] ** (steps // r["incr_every"])
    if r["overflows"] == 0:
        assert r["loss_scale"] == grown
    else:
        assert r["loss_scale"] < grown


def test_tf1_session_configproto():
    r, out = run_example("tf1_session_configproto.py", "--steps", "30")
    assert "NpuAmpOptimizer" in out and "custom_black_list" in out
    assert r["lp_flop_share"] >= 0.9            # every MatMul in FP16
    assert r["low_matmuls"] >= 3 and r["casts_inserted"] > 0
    assert r["init_scale"] == 128
    check_loss_scale(r, 30)
    assert r["global_step"] == 30 - r["skipped"]        # skipped steps do not advance it
    assert finite(r["fp32_loss"], r["amp_loss"])
    assert abs(r["amp_loss"] - r["fp32_loss"]) <= 0.05 * r["fp32_loss"] + 0.01
    assert abs(r["amp_acc"] - r["fp32_acc"]) <= 0.05
    # custom_black_list=Tanh must keep the first layer's activation in FP32
    # (on TF >= 2.16 the remapper fuses it into _FusedMatMul first; unfuse splits it again)
    assert r["tanh_dtype"] == "float32" and "black-listed  hidden1" in out


@requires_estimator
def test_estimator_resnet():
    r, out = run_example("estimator_resnet.py", "--steps", "40", "--resume-steps", "5")
    assert r["lp_flop_share"] >= 0.9 and r["low_convs"] > 0 and r["casts_inserted"] > 0
    assert r["global_step_resumed"] == 45           # resumed from the checkpoint at 40
    assert r["loss_scale_resumed"] >= r["loss_scale"] >= 128   # scale restored, not reset
    assert finite(r["fp32_loss"], r["amp_loss"]) and r["amp_loss"] < 2.25   # below chance (ln 10)
    # and it tracks FP32: 40 Adam steps from the same weights and batches drift apart only
    # through FP16 rounding (measured 1.27 vs 1.33, 4.5%); a broken step would not learn
    assert abs(r["amp_loss"] - r["fp32_loss"]) <= 0.1 * r["fp32_loss"]
    assert abs(r["savedmodel_acc"] - r["amp_acc"]) <= 0.03
    assert abs(r["amp_acc"] - r["fp32_acc"]) <= 0.2


def test_keras_transformer():
    r, out = run_example("keras_transformer.py", "--epochs", "1", "--samples", "128")
    assert r["lp_share"] >= 0.9 and r["casts_inserted"] > 0
    assert r["einsum"] > 0 and r["low_einsum"] == r["einsum"]
    # the modify_mixlist JSON moved Einsum (attention) to the black list
    assert r["low_einsum_mixlist"] == 0 and r["lp_share_mixlist"] < r["lp_share"]
    assert r["lp_share_mixlist"] > 0                # the feed-forward MatMuls stay FP16
    check_loss_scale(r, 128 // 32)                  # 128 samples, batch 32, 1 epoch
    assert finite(r["fp32_loss"], r["amp_loss"])
    assert abs(r["amp_loss"] - r["fp32_loss"]) <= 0.1


def test_distributed_multiworker():
    r, out = run_example("distributed_multiworker.py", "--steps", "5", "--no-fp32")
    assert r["workers_identical"] == 1
    assert r["lp_share"] >= 0.9 and r["casts_inserted"] > 0
    check_loss_scale(r, 5)
    assert finite(r["amp_loss"]) and r["amp_loss"] < 2.5


def test_debug_precision():
    r, out = run_example("debug_precision.py", "--steps", "30")
    assert r["culprit"] == "conv/Conv2D" and r["culprit_op"] == "Conv2D"
    assert "Conv2D" in r["black_add"].split(",")
    assert r["amp_overflows"] == 30 and r["amp_loss_scale"] == 1          # every step overflowed
    assert r["fixed_overflows"] == 0 and finite(r["fixed_loss"], r["fp32_loss"])
    assert r["fixed_loss"] < 0.9 * math.log(3)                           # it learns
    assert abs(r["fixed_loss"] - r["fp32_loss"]) <= 0.1
    assert 0 < r["lp_share_fixed"] < 1                                   # the MLP stays FP16


def test_ascend_layout_preview():
    r, out = run_example("ascend_layout_preview.py", "--steps", "5")
    assert r["unaligned_items"] > r["aligned_items"]
    assert r["unaligned_waste"] > r["aligned_waste"]
    assert r["transdata_aligned"] > 0 and r["transdata_unaligned"] > 0
    assert r["lp_flop_share"] >= 0.9
    assert r["rel_err"] < 1e-2
    assert finite(r["fp32_loss"], r["amp_loss"])


def test_ascend_script_unchanged():
    """The tf_adapter-style script runs unchanged under `npu-amp run`: FP16
    MatMuls, overflow steps skipped from the 2**32 start, the FP32 override
    never overflows."""
    res, _ = run_example("ascend_script_unchanged.py", "--steps", "60", timeout=400)
    assert res["fp16_matmuls"] == 3
    assert res["skipped"] > 0 and res["fp32_skipped"] == 0
    assert finite(res["loss_amp"], res["loss_fp32"]) and res["acc_amp"] > 0.5
