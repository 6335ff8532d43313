#!/usr/bin/env python
"""An Ascend (tf_adapter) training script, run here unchanged with ``npu-amp run``.

``ASCEND_SCRIPT`` below is written the way ModelZoo TF1 scripts are:
``from npu_bridge.npu_init import *``, a hand-written ``NpuOptimizer`` entry
with GE keys (``use_off_line``, ``mix_compile_mode``, ...),
``NPULossScaleOptimizer`` with ``ExponentialUpdateLossScaleManager(2**32)``
and the loss scale fetched as ``loss_scale:0``.  Nothing in it names
npu-amp-tf.  This example writes it to a temporary file and runs it twice:

1. ``npu-amp run --precision-mode must_keep_origin_dtype train.py``: the flag
   overrides the script's own ``precision_mode`` -> an FP32 reference;
2. ``npu-amp run --report-path rep/ train.py``: the script as written
   (``allow_mix_precision``), with the precision map saved.

It prints the two runs side by side (loss, test accuracy, final loss scale,
skipped steps) and what the plugin did (MatMuls in FP16, GE keys that have
no effect off the NPU).

    python examples/ascend_script_unchanged.py --steps 300
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ASCEND_SCRIPT = r'''
import argparse, json
import numpy as np
from npu_bridge.npu_init import *
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

parser = argparse.ArgumentParser()
parser.add_argument("--train_steps", type=int, default=300)
parser.add_argument("--learning_rate", type=float, default=0.1)
args = parser.parse_args()
tf.disable_eager_execution()

d = load_digits()
x_tr, x_te, y_tr, y_te = train_test_split((d.data / 16.0).astype(np.float32), d.target.astype(np.int32),
                                          test_size=0.25, random_state=0, stratify=d.target)
rng = np.random.RandomState(0)
x = tf.placeholder(tf.float32, [None, 64], name="input")
y = tf.placeholder(tf.int32, [None], name="label")
h = x
for i, (n_in, n_out) in enumerate([(64, 128), (128, 64)]):
    w = tf.get_variable("w%d" % i, initializer=tf.constant(rng.randn(n_in, n_out).astype(np.float32) * 0.1))
    b = tf.get_variable("b%d" % i, initializer=tf.zeros([n_out]))
    h = tf.nn.relu(tf.nn.bias_add(tf.matmul(h, w, name="fc%d" % i), b))
w = tf.get_variable("w_out", initializer=tf.constant(rng.randn(64, 10).astype(np.float32) * 0.1))
logits = tf.matmul(h, w, name="logits")
loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
acc = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), tf.float32))

opt = tf.train.MomentumOptimizer(args.learning_rate, 0.9)
loss_scale_manager = ExponentialUpdateLossScaleManager(init_loss_scale=2**32, incr_every_n_steps=1000,
                                                       decr_every_n_nan_or_inf=2, decr_ratio=0.5)
opt = NPULossScaleOptimizer(opt, loss_scale_manager, is_distributed=get_rank_size() > 1)
train_op = opt.minimize(loss)

config = tf.ConfigProto()
custom_op = config.graph_options.rewrite_options.custom_optimizers.add()
custom_op.name = "NpuOptimizer"
custom_op.parameter_map["use_off_line"].b = True
custom_op.parameter_map["mix_compile_mode"].b = False
custom_op.parameter_map["iterations_per_loop"].i = 1
custom_op.parameter_map["precision_mode"].s = tf.compat.as_bytes("allow_mix_precision")
config.graph_options.rewrite_options.remapping = RewriterConfig.OFF
config.graph_options.rewrite_options.memory_optimization = RewriterConfig.OFF

skipped = 0
with tf.Session(config=config) as sess:
    sess.run(tf.global_variables_initializer())
    for step in range(args.train_steps):
        idx = np.random.RandomState(step).randint(0, len(x_tr), 64)
        _, l, finite = sess.run([train_op, loss, "overflow_status_reduce_all:0"],
                                {x: x_tr[idx], y: y_tr[idx]})
        skipped += int(not finite)
    scale = sess.run("loss_scale:0")
    test_acc, test_loss = sess.run([acc, loss], {x: x_te, y: y_te})
print("SCRIPT " + json.dumps({"loss": float(test_loss), "acc": float(test_acc),
                              "loss_scale": float(scale), "skipped": skipped}))
'''


def npu_amp_run(flags, script, script_args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "npu_amp_tf.run", *flags, script, *script_args],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"npu-amp run failed ({p.returncode}):\n{p.stderr[-3000:]}")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("SCRIPT ")][-1]
    return json.loads(line[len("SCRIPT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    try:
        import sklearn  # noqa: F401
    except ImportError:
        print("SKIP: scikit-learn is not installed (the script uses its bundled digits data)")
        return
    work = tempfile.mkdtemp(prefix="ascend_script_")
    script = os.path.join(work, "train.py")
    with open(script, "w", encoding="utf-8") as fh:
        fh.write(ASCEND_SCRIPT)
    rep = os.path.join(work, "report")
    script_args = ["--train_steps", str(args.steps)]
    fp32 = npu_amp_run(["--precision-mode", "must_keep_origin_dtype"], script, script_args)
    mixed = npu_amp_run(["--report-path", rep], script, script_args)

    decisions, device_only = {}, set()
    for f in glob.glob(os.path.join(rep, "*.json")):
        r = json.load(open(f))
        device_only.update(r["summary"].get("ge_device_only_keys", []))
        for node, d in r["decisions"].items():
            decisions[node] = d.get("dtype")
        for node, d in r["decisions"].items():  # a MatMul fused with its bias/activation
            for inner in d.get("fused_nodes", ()):  # runs in the fused node's dtype
                decisions.setdefault(inner, d.get("dtype"))
    fp16 = sorted(n for n in ("fc0", "fc1", "logits") if decisions.get(n) == "float16")

    print(f"{'':22}{'FP32 (flag override)':>22}{'as written (mixed)':>22}")
    for k in ("loss", "acc", "loss_scale", "skipped"):
        print(f"{k:22}{fp32[k]:>22.6g}{mixed[k]:>22.6g}")
    print(f"MatMuls in FP16: {', '.join(fp16) or 'none'}")
    print(f"GE keys with no effect off the NPU (in the report): {', '.join(sorted(device_only))}")
    print(f"RESULT loss_fp32={fp32['loss']:.6g} loss_amp={mixed['loss']:.6g} acc_fp32={fp32['acc']:.4g} "
          f"acc_amp={mixed['acc']:.4g} loss_scale={mixed['loss_scale']:.6g} skipped={mixed['skipped']} "
          f"fp16_matmuls={len(fp16)} fp32_skipped={fp32['skipped']}")


if __name__ == "__main__":
    main()
