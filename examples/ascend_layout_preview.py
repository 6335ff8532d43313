#!/usr/bin/env python
"""NC1HWC0 preview: TransData count and check_align warnings, unaligned vs aligned channels.

Ascend's cube unit works on 5-D NC1HWC0 tensors (C split into C1 blocks of
C0=16 channels); GE inserts TransData nodes where a tensor changes format and
pads channels up to a multiple of 16.  ``format_mode="NC1HWC0"`` makes the
plugin do the same rewrite on stock TensorFlow (the TransData op runs on the
CPU), so a model's layout cost can be previewed without a device.

The script builds the same small CNN for the 8x8 digits twice:

* **unaligned**: 12 and 20 channels (padded to 16 and 32: compute wasted);
* **aligned**: 16 and 32 channels;

and for each it prints

1. ``npu_amp_tf.check_align(graph)``: the unaligned ops, their padded shapes
   and the padding waste;
2. ``npu_amp_tf.rewrite_graph(..., format_mode="NC1HWC0")``: TransData nodes
   (activation / filter / per-channel), casts and the low-precision share;
3. numerics: the rewritten forward graph against FP32 on the test images;
4. training: ``--steps`` steps through ``session_config(format_mode="NC1HWC0")``
   (grappler runs the layout + precision rewrite on the training graph) against
   FP32 from the same initial weights.

    python examples/ascend_layout_preview.py --steps 100
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import npu_amp_tf  # noqa: E402
from npu_amp_tf import bridge  # noqa: E402

VARIANTS = {"unaligned": (12, 20), "aligned": (16, 32)}


def load_digits(seed):
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    d = _load()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    return train_test_split(x, d.target.astype(np.int32), test_size=0.25, random_state=seed,
                            stratify=d.target)


def init_weights(channels, seed):
    rng = np.random.default_rng(seed)
    c1, c2 = channels
    he = lambda *s: (rng.standard_normal(s) * np.sqrt(2.0 / np.prod(s[:-1]))).astype(np.float32)  # noqa: E731
    return {"k1": he(3, 3, 1, c1), "b1": np.zeros(c1, np.float32),
            "k2": he(3, 3, c1, c2), "b2": np.zeros(c2, np.float32),
            "w": he(c2, 10), "b": np.zeros(10, np.float32)}


def forward(x, p):
    h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, p["k1"], 1, "SAME", name="conv1/Conv2D"), p["b1"]),
                   name="conv1/Relu")
    h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, p["k2"], 1, "SAME", name="conv2/Conv2D"), p["b2"]),
                   name="conv2/Relu")
    h = tf.reduce_mean(h, axis=[1, 2], name="gap")
    return tf.add(tf.matmul(h, p["w"], name="fc/MatMul"), p["b"], name="logits")


def frozen_forward(weights, batch):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 8, 8, 1], name="x")
        forward(x, {k: tf.constant(v, name=k) for k, v in weights.items()})
    return g.as_graph_def()


def run_graph(gd, x):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with tf.compat.v1.Session(graph=g) as s:
        return s.run("logits:0", {"x:0": x})


def train(data, weights, steps, batch, lr, layout, seed):
    x_tr, x_te, y_tr, y_te = data
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 8, 8, 1], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [batch], name="y")
        p = {k: tf.compat.v1.get_variable(k, initializer=v) for k, v in weights.items()}
        logits = forward(x, p)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), tf.int32))
        opt = tf.compat.v1.train.AdamOptimizer(lr)
        if layout:
            opt = npu_amp_tf.AMP_Optimizer(opt)
        train_op = opt.minimize(loss)
        init = [tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()]
    config = (npu_amp_tf.session_config(precision_mode="allow_mix_precision", format_mode="NC1HWC0")
              if layout else tf.compat.v1.ConfigProto())
    rng = np.random.default_rng(seed)
    losses = []
    bridge.clear_reports()
    with tf.compat.v1.Session(graph=g, config=config) as sess:
        sess.run(init)
        for _ in range(steps):
            idx = rng.integers(0, len(x_tr), batch)
            losses.append(float(sess.run([train_op, loss], {x: x_tr[idx], y: y_tr[idx]})[1]))
        n = len(x_te) // batch * batch
        hits = sum(sess.run(correct, {x: x_te[i:i + batch], y: y_te[i:i + batch]}) for i in range(0, n, batch))
        scale = opt.loss_scale_manager.state(sess)["loss_scale"] if layout else None
    td = None
    if layout:
        recs = [r for r in bridge.last_reports() if r["status"] == "rewritten" and r.get("report")]
        if recs:
            rep = max(recs, key=lambda r: r["nodes"])["report"]
            s = rep["summary"]
            td = {k: s.get(k) for k in ("transdata", "transdata_activation", "transdata_filter")}
            if not s.get("transdata"):
                # say why the layout pass left the training graph in its origin format
                why = [d.get("layout_reason") for n, d in rep["decisions"].items()
                       if n.endswith("Conv2D") and d.get("layout_reason")]
                td["why_origin"] = (why[0] if why else None)
                if s.get("shape_inference_error"):
                    td["shape_inference_error"] = s["shape_inference_error"][:100]
    return dict(loss=float(np.mean(losses[-10:])), acc=hits / n, loss_scale=scale, transdata=td)


def preview(name, channels, data, args):
    weights = init_weights(channels, args.seed)
    gd = frozen_forward(weights, args.batch)
    print(f"\n=== {name}: channels {channels[0]} -> {channels[1]}")
    align = npu_amp_tf.check_align(gd)
    print("check_align:")
    for line in align.format_table().splitlines():
        print("    " + line)
    new_gd, rep = npu_amp_tf.rewrite_graph(gd, fetches=["logits"], precision_mode="allow_mix_precision",
                                           format_mode="NC1HWC0")
    s = rep.summary
    print(f"rewrite_graph(format_mode='NC1HWC0'): TransData {s.get('transdata')} "
          f"(activation {s.get('transdata_activation')}, filter {s.get('transdata_filter')}, "
          f"per-channel {s.get('transdata_per_channel')}, lowering {s.get('transdata_lowering')}), casts {s.get('casts')}, "
          f"low-precision FLOP share {s.get('lp_flop_share') or 0:.3f}, "
          f"padded FLOPs {s.get('padded_flops')} (waste {s.get('padding_waste_flops')})")
    for w in rep.warnings[:4]:
        print(f"    warning [{w.get('pass')}] {w.get('node')}: {w.get('message')}")
    x = data[1][:args.batch]
    ref, got = run_graph(gd, x), run_graph(new_gd, x)
    rel = float(np.max(np.abs(ref - got)) / max(np.max(np.abs(ref)), 1e-12))
    agree = float(np.mean(ref.argmax(1) == got.argmax(1)))
    print(f"numerics vs FP32 on {len(x)} test images: max rel error {rel:.2e}, argmax agreement {agree:.3f}")
    res = dict(items=len(align["items"]), waste=align.get("waste_share", 0.0), transdata=s.get("transdata"),
               casts=s.get("casts"), share=s.get("lp_flop_share") or 0.0, rel=rel)
    if args.steps:
        fp32 = train(data, weights, args.steps, args.batch, args.lr, False, args.seed)
        amp = train(data, weights, args.steps, args.batch, args.lr, True, args.seed)
        print(f"training {args.steps} steps: FP32 loss {fp32['loss']:.4f} acc {fp32['acc']:.4f} | "
              f"NC1HWC0+AMP loss {amp['loss']:.4f} acc {amp['acc']:.4f} (loss scale {amp['loss_scale']:g}; "
              f"TransData in training graph {amp['transdata']})")
        res.update(fp32_loss=fp32["loss"], fp32_acc=fp32["acc"], amp_loss=amp["loss"], amp_acc=amp["acc"],
                   loss_scale=amp["loss_scale"])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="training steps per run; 0 = preview only")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    x_tr, x_te, y_tr, y_te = load_digits(args.seed)
    data = (x_tr, x_te, y_tr, y_te)
    print(f"TensorFlow {tf.__version__}; digits 8x8x1, batch {args.batch}")
    out = {name: preview(name, ch, data, args) for name, ch in VARIANTS.items()}
    u, a = out["unaligned"], out["aligned"]
    print("\n                        unaligned   aligned")
    print(f"  check_align warnings   {u['items']:9d}   {a['items']:7d}")
    print(f"  padding waste share    {u['waste']:9.3f}   {a['waste']:7.3f}")
    print(f"  TransData nodes        {u['transdata']:9d}   {a['transdata']:7d}")
    print(f"  Cast nodes             {u['casts']:9d}   {a['casts']:7d}")
    print(f"  low-precision share    {u['share']:9.3f}   {a['share']:7.3f}")
    print(f"  max rel err vs FP32    {u['rel']:9.2e}   {a['rel']:7.2e}")
    line = (f"RESULT unaligned_items={u['items']} aligned_items={a['items']} unaligned_waste={u['waste']:.4f} "
            f"aligned_waste={a['waste']:.4f} transdata_unaligned={u['transdata']} transdata_aligned={a['transdata']} "
            f"lp_flop_share={a['share']:.4f} casts={a['casts']} rel_err={max(u['rel'], a['rel']):.4g}")
    if args.steps:
        line += (f" fp32_acc={a['fp32_acc']:.4f} amp_acc={a['amp_acc']:.4f} fp32_loss={a['fp32_loss']:.4f} "
                 f"amp_loss={a['amp_loss']:.4f} loss_scale={a['loss_scale']:g}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
