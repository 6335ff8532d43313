#!/usr/bin/env python
"""TF1 Session + ConfigProto: the Ascend (tf_adapter / GE) way, on stock TensorFlow.

This is the flow an Ascend TF1 training script uses, unchanged except for the
optimizer name in the ConfigProto entry:

1. build a graph (an MLP classifier on scikit-learn's bundled 8x8 digits);
2. wrap ``AdamOptimizer`` in ``npu_amp_tf.AMP_Optimizer`` (dynamic loss scaling,
   overflow skip, FP32 master weights);
3. add the ``NpuAmpOptimizer`` entry to
   ``ConfigProto.graph_options.rewrite_options.custom_optimizers`` *by hand*
   with ``precision_mode=allow_mix_precision`` and a ``custom_black_list``;
4. train with ``tf.compat.v1.Session(config=config)``.

Grappler calls the plugin's pass pipeline on the training graph; the script
prints what it did (low-precision FLOP share, casts, what the black list
kept in FP32), the loss-scale history, and loss / test accuracy against the
same model trained in FP32 from the same initial weights.

    python examples/tf1_session_configproto.py --steps 300
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import npu_amp_tf  # noqa: E402  (registers the NpuAmpOptimizer grappler pass)
from npu_amp_tf import bridge  # noqa: E402

# ops kept in FP32 whatever the built-in lists say (here: the first layer's activation)
BLACK_LIST = ["Tanh"]


def load_digits(seed):
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    d = _load()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)


def initial_weights(seed, sizes=(64, 128, 64, 10)):
    rng = np.random.default_rng(seed)
    ws = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        ws.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32))
        ws.append(np.zeros(fan_out, np.float32))
    return ws


def amp_config():
    """The ConfigProto entry, written by hand exactly as in an Ascend script."""
    config = tf.compat.v1.ConfigProto()
    custom_op = config.graph_options.rewrite_options.custom_optimizers.add()
    custom_op.name = "NpuAmpOptimizer"
    custom_op.parameter_map["precision_mode"].s = tf.compat.as_bytes("allow_mix_precision")
    custom_op.parameter_map["custom_black_list"].s = tf.compat.as_bytes(",".join(BLACK_LIST))
    return config


def train(data, weights, steps, batch, lr, amp, seed):
    x_tr, x_te, y_tr, y_te = data
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        params = [tf.compat.v1.get_variable(f"p{i}", initializer=w) for i, w in enumerate(weights)]
        h = tf.tanh(tf.matmul(x, params[0]) + params[1], name="hidden1")
        h = tf.nn.relu(tf.matmul(h, params[2]) + params[3], name="hidden2")
        logits = tf.add(tf.matmul(h, params[4]), params[5], name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        acc = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), tf.float32))
        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = tf.compat.v1.train.AdamOptimizer(lr)
        if amp:
            opt = npu_amp_tf.AMP_Optimizer(opt)          # dynamic loss scale, 128 to start
        train_op = opt.minimize(loss, global_step=global_step)
        graph_def = graph.as_graph_def()
        fetches = [train_op.name, loss.name]
        init = tf.compat.v1.global_variables_initializer()
        local_init = tf.compat.v1.local_variables_initializer()

    config = amp_config() if amp else tf.compat.v1.ConfigProto()
    rng = np.random.default_rng(seed)
    losses = []
    t0 = time.perf_counter()
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run([init, local_init])
        for _ in range(steps):
            idx = rng.integers(0, len(x_tr), batch)
            _, l = sess.run([train_op, loss], {x: x_tr[idx], y: y_tr[idx]})
            losses.append(float(l))
        test_loss, test_acc = sess.run([loss, acc], {x: x_te, y: y_te})
        ls = opt.loss_scale_manager.state(sess) if amp else None
        if amp:
            m = opt.loss_scale_manager
            ls.update(init_scale=float(sess.run(m.loss_scale.initial_value)),
                      incr_every=m.incr_every_n_steps, incr_ratio=m.incr_ratio)
        history = opt.loss_scale_manager.history if amp else None
        gstep = int(sess.run(global_step))
    return dict(losses=losses, test_loss=float(test_loss), test_acc=float(test_acc),
                loss_scale=ls, history=history, global_step=gstep,
                seconds=time.perf_counter() - t0, graph_def=graph_def, fetches=fetches)


def training_graph_report():
    """The bridge record of the largest graph the pass rewrote (the train step)."""
    best = None
    for rec in bridge.last_reports():
        rep = rec.get("report")
        if rec["status"] != "rewritten" or not rep:
            continue
        if best is None or rec["nodes"] > best[0]:
            best = (rec["nodes"], rep)
    return None if best is None else best[1]


def offline_flop_share(graph_def, fetches):
    """The same rewrite run offline (``npu_amp_tf.rewrite_graph``) on the graph
    as built, before grappler: its report has the MatMul FLOP share."""
    params = {"precision_mode": "allow_mix_precision", "custom_black_list": BLACK_LIST}
    _, report = npu_amp_tf.rewrite_graph(graph_def, fetches=fetches, **params)
    return report.summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    data = load_digits(args.seed)
    weights = initial_weights(args.seed)
    print(f"TensorFlow {tf.__version__}, npu_amp_tf {npu_amp_tf.__version__}; digits: "
          f"{len(data[0])} train / {len(data[1])} test, {args.steps} steps of batch {args.batch}")
    print("ConfigProto entry (written by hand):")
    cfg = amp_config()
    for line in str(cfg.graph_options.rewrite_options).strip().splitlines():
        print("   ", line)

    fp32 = train(data, weights, args.steps, args.batch, args.lr, amp=False, seed=args.seed)
    bridge.clear_reports()
    amp = train(data, weights, args.steps, args.batch, args.lr, amp=True, seed=args.seed)

    rep = training_graph_report()
    if rep is None:
        raise SystemExit("the NpuAmpOptimizer pass did not rewrite the training graph "
                         f"(bridge records: {[r['status'] for r in bridge.last_reports()]})")
    s = rep["summary"]
    share_src = "grappler pass report"
    flops = s
    if s.get("lp_flop_share") is None:
        # the in-grappler report could not infer shapes; preview the same rewrite offline
        share_src = "offline rewrite_graph of the same graph"
        if s.get("shape_inference_error"):
            share_src += f"; in-grappler shape inference failed: {s['shape_inference_error'][:90]}"
        flops = offline_flop_share(amp["graph_def"], amp["fetches"])
    share = flops.get("lp_flop_share")
    share = 0.0 if share is None else share
    print("\nWhat the NpuAmpOptimizer pass did to the training graph:")
    print(f"  nodes in graph            : {s.get('nodes')}")
    print(f"  low-precision FLOP share  : {share:.3f}  "
          f"({flops.get('lp_flops')} of {flops.get('matrix_flops')} MatMul FLOPs per example in "
          f"{s.get('low_dtype')}; source: {share_src})")
    print(f"  low-precision nodes       : {s.get('low_precision_nodes')} of {s.get('float_nodes')} float ops")
    print(f"  casts inserted            : {s.get('casts_inserted')}  (Cast nodes in graph: {s.get('casts')})")
    low_mm = sorted(n for n, d in rep["decisions"].items()
                    if n.endswith("MatMul") or "MatMul_" in n.rsplit("/", 1)[-1]
                    if d.get("dtype") == s.get("low_dtype"))
    print(f"  MatMuls in {s.get('low_dtype')}       : {len(low_mm)} (forward and backward), e.g. {low_mm[:3]}")
    kept = {n: d for n, d in rep["decisions"].items()
            if d.get("list") == "black" and d.get("reason", "").endswith("custom_black_list")}
    act = rep["decisions"].get("hidden1", {})
    if "hidden1" not in kept:   # e.g. TF >= 2.16: remapper fused MatMul+BiasAdd+Tanh and it stayed fused
        print(f"  black list NOT honoured   : 'hidden1' (Tanh) dtype={act.get('dtype')}, reason: {act.get('reason')}")
    for n, d in sorted(kept.items())[:3]:
        print(f"  black-listed  {n:<22}: dtype={d.get('dtype')}  reason: {d.get('reason')}")
    ls = amp["loss_scale"]
    print("\nLoss scale (dynamic, ExponentialUpdateLossScaleManager):")
    print(f"  final loss scale          : {ls['loss_scale']:g}")
    print(f"  overflow steps / skipped  : {ls['overflow_count']} / {ls['skipped_steps']} "
          f"(global_step={amp['global_step']})")
    print(f"  history (step, scale, overflow): {[tuple(e) for e in amp['history']][:8]}")

    def last(xs, k=20):
        return float(np.mean(xs[-k:]))

    print("\n                      FP32        AMP")
    print(f"  train loss (last 20) {last(fp32['losses']):8.4f}   {last(amp['losses']):8.4f}")
    print(f"  test loss            {fp32['test_loss']:8.4f}   {amp['test_loss']:8.4f}")
    print(f"  test accuracy        {fp32['test_acc']:8.4f}   {amp['test_acc']:8.4f}")
    print(f"  wall time [s]        {fp32['seconds']:8.1f}   {amp['seconds']:8.1f}   "
          "(FP16 has no native CPU kernels: slower here, not on an NPU)")
    print(f"RESULT lp_flop_share={share:.4f} low_matmuls={len(low_mm)} tanh_dtype={act.get('dtype')} casts_inserted={s.get('casts_inserted')} "
          f"loss_scale={ls['loss_scale']:g} fp32_acc={fp32['test_acc']:.4f} amp_acc={amp['test_acc']:.4f} "
          f"fp32_loss={fp32['test_loss']:.4f} amp_loss={amp['test_loss']:.4f} "
          f"overflows={ls['overflow_count']} skipped={ls['skipped_steps']} ls_steps={ls['steps']} "
          f"global_step={amp['global_step']} init_scale={ls['init_scale']:g} "
          f"incr_every={ls['incr_every']} incr_ratio={ls['incr_ratio']:g}")


if __name__ == "__main__":
    main()
