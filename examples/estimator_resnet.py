#!/usr/bin/env python
"""Estimator: a small ResNet on scikit-learn's digits with ``npu_amp_tf.estimator.RunConfig``.

The Ascend Estimator flow (``NPURunConfig`` + ``NPUEstimator`` there) on stock
TensorFlow: the ``RunConfig`` carries the plugin's ConfigProto entry, the
``model_fn`` wraps its optimizer in ``npu_amp_tf.AMP_Optimizer``.  The script

1. trains a 2-block ResNet (Conv2D + BatchNorm + ReLU, identity shortcuts) on
   the 8x8 digit images for ``--steps`` steps, in FP32 and with the plugin;
2. evaluates both on the held-out quarter of the data;
3. exports the AMP model as a SavedModel and scores the test set with it;
4. resumes AMP training from its checkpoint for ``--resume-steps`` more
   steps, showing that ``global_step`` and the dynamic loss scale continue
   from the checkpoint.

It prints the low-precision share of the conv/matmul FLOPs, the casts the
pass inserted, the loss scale and the FP32-vs-AMP loss and accuracy.

``tf.estimator`` exists up to TensorFlow 2.15 only; on newer TF this example
exits with a message (use ``examples/keras_transformer.py`` there).

    python examples/estimator_resnet.py --steps 200
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import npu_amp_tf  # noqa: E402
from npu_amp_tf import bridge  # noqa: E402

warnings.filterwarnings("ignore", message=r".*(is deprecated|will be removed).*")

CHANNELS = 8
LOSS_SCALE_VAR = "loss_scale/loss_scale"


def load_digits(seed):
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    d = _load()
    x = (d.images / 16.0).astype(np.float32)[..., None]        # N x 8 x 8 x 1 (NHWC)
    y = d.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)


def resnet(images, training):
    v1 = tf.compat.v1

    def conv(x, ch, name):
        return v1.layers.conv2d(x, ch, 3, padding="same", use_bias=False, name=name,
                                kernel_initializer=v1.initializers.he_normal(seed=1))

    def bn(x, name):
        return v1.layers.batch_normalization(x, training=training, name=name, fused=True,
                                            momentum=0.9)  # short runs: fast-moving stats

    x = tf.nn.relu(bn(conv(images, CHANNELS, "stem"), "stem_bn"))
    for b in range(2):
        y = tf.nn.relu(bn(conv(x, CHANNELS, f"block{b}/conv1"), f"block{b}/bn1"))
        y = bn(conv(y, CHANNELS, f"block{b}/conv2"), f"block{b}/bn2")
        x = tf.nn.relu(x + y, name=f"block{b}/out")
    x = tf.reduce_mean(x, axis=[1, 2], name="gap")
    return v1.layers.dense(x, 10, name="logits",
                           kernel_initializer=v1.initializers.glorot_uniform(seed=2))


def model_fn(features, labels, mode, params):
    images = features["image"] if isinstance(features, dict) else features
    training = mode == tf.estimator.ModeKeys.TRAIN
    logits = resnet(images, training)
    classes = tf.argmax(logits, 1, output_type=tf.int32)
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(
            mode, predictions={"classes": classes, "probabilities": tf.nn.softmax(logits)},
            export_outputs={"serving_default": tf.estimator.export.PredictOutput(
                {"classes": classes, "probabilities": tf.nn.softmax(logits)})})
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    metrics = {"accuracy": tf.compat.v1.metrics.accuracy(labels, classes)}
    if mode == tf.estimator.ModeKeys.EVAL:
        return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops=metrics)
    opt = tf.compat.v1.train.AdamOptimizer(params["lr"])
    if params["amp"]:
        # dynamic loss scale; grows x2 every 50 clean steps so the checkpointed
        # scale visibly moves during a short run
        opt = npu_amp_tf.AMP_Optimizer(opt, init_loss_scale=128, incr_every_n_steps=50)
    update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(update_ops):
        train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def make_input_fn(x, y, batch, shuffle, seed, epochs=None):
    def input_fn():
        ds = tf.data.Dataset.from_tensor_slices(({"image": x}, y))
        if shuffle:
            ds = ds.shuffle(len(x), seed=seed).repeat(epochs)
        return ds.batch(batch)
    return input_fn


def estimator(model_dir, amp, lr, seed):
    if amp:
        config = npu_amp_tf.estimator.RunConfig(
            model_dir=model_dir, tf_random_seed=seed, save_checkpoints_steps=10 ** 6,
            log_step_count_steps=10 ** 6, precision_mode="allow_mix_precision")
    else:
        config = tf.estimator.RunConfig(model_dir=model_dir, tf_random_seed=seed,
                                        save_checkpoints_steps=10 ** 6, log_step_count_steps=10 ** 6)
    return tf.estimator.Estimator(model_fn, config=config, params={"amp": amp, "lr": lr})


def train_report():
    """The largest graph the grappler pass rewrote during training."""
    best = None
    for rec in bridge.last_reports():
        rep = rec.get("report")
        if rec["status"] == "rewritten" and rep and (best is None or rec["nodes"] > best[0]):
            best = (rec["nodes"], rep)
    return None if best is None else best[1]


def offline_preview(batch, lr):
    """``npu_amp_tf.rewrite_graph`` on the same model_fn's training graph with a
    fixed batch: every shape is known, so the report has the conv/matmul FLOP
    share (the report grappler hands back may lack it, see README)."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.train.create_global_step()
        img = tf.compat.v1.placeholder(tf.float32, [batch, 8, 8, 1], name="image")
        lab = tf.compat.v1.placeholder(tf.int32, [batch], name="label")
        spec = model_fn({"image": img}, lab, tf.estimator.ModeKeys.TRAIN, {"amp": True, "lr": lr})
    _, report = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=[spec.train_op.name, spec.loss.name],
                                         precision_mode="allow_mix_precision")
    return report.summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    ap.add_argument("--resume-steps", type=int, default=50, help="extra steps after resuming")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="model/export directory (default: a temp dir)")
    args = ap.parse_args(argv)

    if not (hasattr(tf, "estimator") and hasattr(tf.estimator, "Estimator")):
        print(f"SKIP: tf.estimator is not available in TensorFlow {tf.__version__} (removed in 2.16); "
              "this example needs TensorFlow <= 2.15. Use examples/keras_transformer.py instead.")
        return 0
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)

    x_tr, x_te, y_tr, y_te = load_digits(args.seed)
    work = args.workdir or tempfile.mkdtemp(prefix="npu_amp_estimator_")
    print(f"TensorFlow {tf.__version__}; digits {x_tr.shape[1:]} images: {len(x_tr)} train / "
          f"{len(x_te)} test; ResNet with {CHANNELS} channels; workdir {work}")
    train_in = make_input_fn(x_tr, y_tr, args.batch, True, args.seed)
    test_in = make_input_fn(x_te, y_te, 256, False, args.seed)

    results = {}
    for amp in (False, True):
        tag = "amp" if amp else "fp32"
        model_dir = os.path.join(work, tag)
        shutil.rmtree(model_dir, ignore_errors=True)
        est = estimator(model_dir, amp, args.lr, args.seed)
        bridge.clear_reports()
        t0 = time.perf_counter()
        est.train(train_in, steps=args.steps)
        secs = time.perf_counter() - t0
        rep = train_report() if amp else None
        ev = est.evaluate(test_in)
        results[tag] = dict(est=est, eval=ev, seconds=secs, report=rep, model_dir=model_dir)
        print(f"[{tag}] trained {args.steps} steps in {secs:.1f}s; eval loss {ev['loss']:.4f} "
              f"accuracy {ev['accuracy']:.4f} (global_step {ev['global_step']})")

    amp = results["amp"]
    rep = amp["report"]
    if rep is None:
        raise SystemExit("the NpuAmpOptimizer pass did not rewrite the training graph "
                         f"(bridge records: {[r['status'] for r in bridge.last_reports()]})")
    s = rep["summary"]
    share, flops, src = s.get("lp_flop_share"), s, "grappler pass report"
    if share is None:
        src = "offline rewrite_graph of the same model_fn"
        if s.get("shape_inference_error"):
            src += f"; in-grappler shape inference failed: {s['shape_inference_error'][:80]}"
        flops = offline_preview(args.batch, args.lr)
        share = flops.get("lp_flop_share")
    print("\nWhat the pass did to the Estimator's training graph:")
    print(f"  low-precision FLOP share  : {-1.0 if share is None else share:.3f}  ({flops.get('lp_flops')} of "
          f"{flops.get('matrix_flops')} conv/matmul FLOPs per step in {s.get('low_dtype')}; source: {src})")
    print(f"  low-precision nodes       : {s.get('low_precision_nodes')} of {s.get('float_nodes')} float ops")
    print(f"  casts inserted            : {s.get('casts_inserted')}  (Cast nodes in graph: {s.get('casts')})")
    convs = {n: d["dtype"] for n, d in rep["decisions"].items()
             if n.endswith("Conv2D") or "Conv2DBackprop" in n}
    low_convs = sum(1 for d in convs.values() if d == s.get("low_dtype"))
    print(f"  Conv2D (fwd+bwd) in {s.get('low_dtype')}  : {low_convs} of {len(convs)}")

    scale_before = float(tf.train.load_variable(amp["model_dir"], LOSS_SCALE_VAR))
    overflow = int(tf.train.load_variable(amp["model_dir"], "loss_scale/overflow_count"))
    print(f"  loss scale in checkpoint  : {scale_before:g} (started at 128, x2 per 50 clean steps; "
          f"{overflow} overflow steps)")

    # export and score with the SavedModel
    def serving_input_fn():
        img = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1], name="image")
        return tf.estimator.export.ServingInputReceiver({"image": img}, {"image": img})

    export_dir = amp["est"].export_saved_model(os.path.join(work, "export"), serving_input_fn)
    export_dir = export_dir.decode() if isinstance(export_dir, bytes) else export_dir
    loaded = tf.saved_model.load(export_dir)
    pred = loaded.signatures["serving_default"](image=tf.constant(x_te))["classes"].numpy()
    sm_acc = float(np.mean(pred == y_te))
    print(f"\nSavedModel {export_dir}: test accuracy {sm_acc:.4f} (weights are the FP32 masters)")

    # resume from the checkpoint
    est2 = estimator(amp["model_dir"], True, args.lr, args.seed)
    est2.train(train_in, steps=args.resume_steps)
    gs = int(tf.train.load_variable(amp["model_dir"], "global_step"))
    scale_after = float(tf.train.load_variable(amp["model_dir"], LOSS_SCALE_VAR))
    ev2 = est2.evaluate(test_in)
    print(f"resumed: global_step {amp['eval']['global_step']} -> {gs}; loss scale {scale_before:g} -> "
          f"{scale_after:g}; eval accuracy {ev2['accuracy']:.4f}")

    f32 = results["fp32"]
    print("\n                      FP32        AMP")
    print(f"  eval loss            {f32['eval']['loss']:8.4f}   {amp['eval']['loss']:8.4f}")
    print(f"  eval accuracy        {f32['eval']['accuracy']:8.4f}   {amp['eval']['accuracy']:8.4f}")
    print(f"  train time [s]       {f32['seconds']:8.1f}   {amp['seconds']:8.1f}   "
          "(FP16 has no native CPU kernels: slower here, not on an NPU)")
    print(f"RESULT lp_flop_share={-1.0 if share is None else share:.4f} casts_inserted={s.get('casts_inserted')} "
          f"low_convs={low_convs} loss_scale={scale_before:g} loss_scale_resumed={scale_after:g} "
          f"global_step_resumed={gs} fp32_acc={f32['eval']['accuracy']:.4f} "
          f"amp_acc={amp['eval']['accuracy']:.4f} savedmodel_acc={sm_acc:.4f} "
          f"fp32_loss={f32['eval']['loss']:.4f} amp_loss={amp['eval']['loss']:.4f}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
