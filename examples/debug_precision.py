#!/usr/bin/env python
"""Troubleshooting a NaN loss under FP16: dump, compare, tune-mixlist, rerun.

The Ascend checklist for "the loss is NaN with mixed precision" is: dump one
step, compare it with FP32 to find the first op that overflows, move that op
to the black list with ``modify_mixlist``, rerun.  This script walks through
it with the plugin's own tools, on a model that really breaks:

* Raw 16-bit ADC signals (amplitude ~3e4, as a sensor delivers them) go
  straight into a 1-D convolution followed by a layer norm, then a small MLP
  classifies the signal's frequency (3 classes).  In FP32 the layer norm
  absorbs the scale and training converges.  In FP16 the convolution's
  output (~1e5) is above the FP16 maximum 65504: inf, then NaN after the
  layer norm, so every step overflows and the dynamic loss scale collapses.

1. train in FP32 and with AMP (``session_config`` + ``AMP_Optimizer``): the
   AMP loss is NaN, every step is skipped;
2. freeze the forward graph (``model.pb``) and one batch (``inputs.npz``);
3. ``npu-amp dump`` + ``npu-amp compare`` name the first op whose output
   becomes inf/NaN in the mixed graph only;
4. ``npu-amp tune-mixlist`` searches for the smallest black-list addition
   that brings the outputs within ``--rtol`` of FP32 and writes a CANN
   ``modify_mixlist`` JSON;
5. the AMP run is repeated with ``session_config(modify_mixlist=...)``: it
   converges, and the rest of the network (the MLP) still runs in FP16.

    python examples/debug_precision.py --steps 150
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import npu_amp_tf  # noqa: E402
from npu_amp_tf import bridge  # noqa: E402

LENGTH, CLASSES, FILTERS, KERNEL, HIDDEN = 64, 3, 8, 9, 32
AMPLITUDE = 30000.0          # raw int16 ADC counts


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    t = np.arange(LENGTH)
    freq = np.array([2.0, 5.0, 9.0])[y][:, None]
    phase = rng.uniform(0, 2 * np.pi, (n, 1))
    x = AMPLITUDE * (0.8 * np.sin(2 * np.pi * freq * t / LENGTH + phase)
                     + 0.2 * rng.standard_normal((n, LENGTH)))
    return np.clip(x, -32768, 32767).astype(np.float32), y.astype(np.int32)


def initial_weights(seed):
    rng = np.random.default_rng(seed)
    return {
        "conv": (rng.standard_normal((1, KERNEL, 1, FILTERS)) * 0.5).astype(np.float32),
        "w1": (rng.standard_normal((FILTERS * LENGTH // 4, HIDDEN)) * 0.05).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.standard_normal((HIDDEN, CLASSES)) * 0.2).astype(np.float32),
        "b2": np.zeros(CLASSES, np.float32),
    }


def forward(x, p):
    """x: [B, LENGTH] raw signal -> logits [B, CLASSES]."""
    s = tf.reshape(x, [-1, 1, LENGTH, 1], name="as_image")                    # NHWC, H=1
    c = tf.nn.conv2d(s, p["conv"], strides=[1, 1, 1, 1], padding="SAME", name="conv/Conv2D")
    mean, var = tf.nn.moments(c, axes=[1, 2, 3], keepdims=True, name="layernorm/moments")
    n = tf.multiply(c - mean, tf.math.rsqrt(var + 1e-5), name="layernorm/normalized")
    n = tf.nn.relu(n, name="conv/Relu")
    n = tf.nn.max_pool2d(n, [1, 1, 4, 1], [1, 1, 4, 1], "VALID", name="pool")
    f = tf.reshape(n, [-1, FILTERS * LENGTH // 4], name="flatten")
    h = tf.nn.relu(tf.matmul(f, p["w1"], name="fc1/MatMul") + p["b1"], name="fc1/Relu")
    return tf.add(tf.matmul(h, p["w2"], name="fc2/MatMul"), p["b2"], name="logits")


def train(data, weights, steps, batch, lr, amp, seed, mixlist=None):
    (x_tr, y_tr), (x_te, y_te) = data
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, LENGTH], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        p = {k: tf.compat.v1.get_variable(k, initializer=v) for k, v in weights.items()}
        logits = forward(x, p)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        acc = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), tf.float32))
        opt = tf.compat.v1.train.AdamOptimizer(lr)
        if amp:
            opt = npu_amp_tf.AMP_Optimizer(opt)
        train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        init = [tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()]
    params = {"precision_mode": "allow_mix_precision"}
    if mixlist:
        params["modify_mixlist"] = mixlist
    config = npu_amp_tf.session_config(**params) if amp else tf.compat.v1.ConfigProto()
    rng = np.random.default_rng(seed)
    losses = []
    bridge.clear_reports()
    with tf.compat.v1.Session(graph=g, config=config) as sess:
        sess.run(init)
        for _ in range(steps):
            idx = rng.integers(0, len(x_tr), batch)
            _, l = sess.run([train_op, loss], {x: x_tr[idx], y: y_tr[idx]})
            losses.append(float(l))
        test_loss, test_acc = sess.run([loss, acc], {x: x_te, y: y_te})
        state = opt.loss_scale_manager.state(sess) if amp else None
    rep = None
    if amp:
        recs = [r for r in bridge.last_reports() if r["status"] == "rewritten" and r.get("report")]
        if recs:
            rep = max(recs, key=lambda r: r["nodes"])["report"]
    return dict(losses=losses, test_loss=float(test_loss), test_acc=float(test_acc), state=state,
                report=rep)


def freeze_forward(weights, path):
    """The forward graph with the weights as constants: what dump/compare/tune read."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, LENGTH], name="x")
        forward(x, {k: tf.constant(v, name=k) for k, v in weights.items()})
    with open(path, "wb") as fh:
        fh.write(g.as_graph_def().SerializeToString())


def npu_amp(*args):
    """Run the ``npu-amp`` command line; returns its stdout (raises on failure)."""
    exe = os.path.join(os.path.dirname(sys.executable), "npu-amp")
    cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "npu_amp_tf.cli"]) + list(args)
    print("$ npu-amp " + " ".join(args))
    p = subprocess.run(cmd, capture_output=True, text=True)
    out = p.stdout.strip()
    for line in out.splitlines():
        print("    " + line)
    if p.returncode != 0:
        raise SystemExit(f"npu-amp {args[0]} failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
    return out


def lp_share(rep):
    """Low-precision share of the matrix ops: FLOPs when the report has them, else by count."""
    if rep is None:
        return 0.0, "no rewrite"
    s = rep["summary"]
    if s.get("lp_flop_share") is not None:
        return s["lp_flop_share"], "of conv/matmul FLOPs"
    cube = {n: d["dtype"] for n, d in rep["decisions"].items() if "dtype" in d and re.match(
        r"^(MatMul|Conv2D\w*)(_\d+)?$", n.rsplit("/", 1)[-1])}
    low = sum(1 for d in cube.values() if d == s.get("low_dtype"))
    return low / max(len(cube), 1), f"of conv/matmul ops by count ({low} of {len(cube)})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="training steps per run (default 150)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rtol", type=float, default=0.05, help="tune-mixlist tolerance on the outputs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where model.pb, inputs.npz, the dump and fix.json go")
    args = ap.parse_args(argv)

    work = args.workdir or tempfile.mkdtemp(prefix="npu_amp_debug_")
    os.makedirs(work, exist_ok=True)
    data = (make_data(1024, args.seed), make_data(300, args.seed + 1))
    weights = initial_weights(args.seed)
    print(f"TensorFlow {tf.__version__}; raw signals of {LENGTH} samples, amplitude ~{AMPLITUDE:g} "
          f"(FP16 max 65504); {args.steps} steps of batch {args.batch}; workdir {work}")

    print("\n== 1. train: FP32, then AMP")
    fp32 = train(data, weights, args.steps, args.batch, args.lr, amp=False, seed=args.seed)
    amp = train(data, weights, args.steps, args.batch, args.lr, amp=True, seed=args.seed)
    st = amp["state"]
    print(f"FP32: final loss {np.mean(fp32['losses'][-10:]):.4f}, test accuracy {fp32['test_acc']:.4f}")
    print(f"AMP : final loss {np.mean(amp['losses'][-10:]):.4f}, test accuracy {amp['test_acc']:.4f}; "
          f"loss scale {st['loss_scale']:g}, {st['overflow_count']} of {st['steps']} steps overflowed, "
          f"{st['skipped_steps']} skipped")

    print("\n== 2. freeze the forward graph and one batch")
    model, inputs = os.path.join(work, "model.pb"), os.path.join(work, "inputs.npz")
    freeze_forward(weights, model)
    np.savez(inputs, x=data[0][0][:args.batch])
    print(f"{model}, {inputs}")

    print("\n== 3. find the op: dump one step of FP32 and mixed, compare")
    dump_dir = os.path.join(work, "dump")
    shutil.rmtree(dump_dir, ignore_errors=True)
    npu_amp("dump", model, "--inputs", inputs, "--out", dump_dir, "--no-progress",
            "--precision-mode", "allow_mix_precision")
    out = npu_amp("compare", dump_dir)
    m = re.search(r"OVERFLOW: first inf/NaN in the mixed graph at op '([^']+)' \(([^,]+),", out)
    culprit, culprit_op = (m.group(1), m.group(2)) if m else (None, None)
    print(f"-> first overflow: node {culprit!r}, op type {culprit_op!r}")

    print("\n== 4. tune-mixlist: smallest black-list addition within rtol")
    fix = os.path.join(work, "fix.json")
    npu_amp("tune-mixlist", model, "--inputs", inputs, "--rtol", str(args.rtol), "--out", fix,
            "--no-progress")
    with open(fix, encoding="utf-8") as fh:
        mixlist = json.load(fh)
    print(f"-> {fix}: {json.dumps(mixlist)}")
    black = mixlist.get("black-list", {}).get("to-add", [])

    print("\n== 5. rerun AMP with session_config(modify_mixlist=fix.json)")
    fixed = train(data, weights, args.steps, args.batch, args.lr, amp=True, seed=args.seed, mixlist=fix)
    st2 = fixed["state"]
    share_amp, how_amp = lp_share(amp["report"])
    share_fix, how_fix = lp_share(fixed["report"])
    print(f"AMP+fix: final loss {np.mean(fixed['losses'][-10:]):.4f}, test accuracy {fixed['test_acc']:.4f}; "
          f"loss scale {st2['loss_scale']:g}, {st2['overflow_count']} overflow steps")
    casts = (fixed["report"] or {}).get("summary", {}).get("casts_inserted")
    print(f"low-precision share: AMP {share_amp:.3f}, AMP+fix {share_fix:.3f} {how_fix}; "
          f"casts inserted with the fix: {casts}")

    print("\n                      FP32        AMP    AMP+fix")
    f = lambda r: float(np.mean(r["losses"][-10:]))  # noqa: E731
    print(f"  train loss (last 10) {f(fp32):8.4f}   {f(amp):8.4f}   {f(fixed):8.4f}")
    print(f"  test accuracy        {fp32['test_acc']:8.4f}   {amp['test_acc']:8.4f}   {fixed['test_acc']:8.4f}")
    print(f"  overflow steps       {0:8d}   {st['overflow_count']:8d}   {st2['overflow_count']:8d}")
    print(f"RESULT culprit={culprit} culprit_op={culprit_op} black_add={','.join(black) or '-'} "
          f"amp_overflows={st['overflow_count']} amp_loss_scale={st['loss_scale']:g} "
          f"amp_final_loss={f(amp):.4f} fixed_overflows={st2['overflow_count']} "
          f"fixed_loss_scale={st2['loss_scale']:g} lp_share_fixed={share_fix:.4f} "
          f"fp32_acc={fp32['test_acc']:.4f} amp_acc={amp['test_acc']:.4f} fixed_acc={fixed['test_acc']:.4f} "
          f"fp32_loss={f(fp32):.4f} fixed_loss={f(fixed):.4f}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
