#!/usr/bin/env python
"""TF2 Keras: a small transformer classifier with ``npu_amp_tf.enable(...)``.

``npu_amp_tf.enable(**params)`` puts the plugin's ConfigProto entry into the
eager context, so grappler runs the pass pipeline on every ``tf.function``
Keras builds (``fit``'s train function included).  The optimizer is the Keras
AMP wrapper (``npu_amp_tf.AMP_Optimizer(keras_optimizer)``): dynamic loss
scaling, overflow skip, FP32 master weights.

The task is synthetic: sequences of 16 tokens from a 32-token vocabulary; the
label is 1 when token 1 occurs more often than token 2 (it needs the whole
sequence: attention + pooling).  The same model, from the same initial
weights, is trained three times:

* **FP32**: no plugin;
* **AMP**: ``enable(precision_mode="allow_mix_precision")``;
* **AMP + mixlist**: ``enable(..., modify_mixlist="mixlist.json")`` where the
  JSON (CANN's ``modify_mixlist`` format, written next to the run) moves
  ``Einsum`` (the attention contractions of ``MultiHeadAttention``) to the
  black list: attention stays FP32, the feed-forward MatMuls stay FP16, and
  the report's low-precision share drops accordingly.

It prints the low-precision FLOP share and casts of each rewritten train
function, the loss scale, and loss / accuracy against FP32.

Runs with whichever Keras ``tf.keras`` is: Keras 2 on TF 2.15, Keras 3 on newer TF.

    python examples/keras_transformer.py --epochs 3
"""
from __future__ import annotations

import argparse
import json
import re
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import npu_amp_tf  # noqa: E402
from npu_amp_tf import bridge  # noqa: E402

VOCAB, SEQ, DIM, HEADS, FF = 32, 16, 32, 2, 64

MIXLIST = {"black-list": {"to-add": ["Einsum"]}}


def keras_version(keras):
    try:
        return keras.__version__                     # tf_keras
    except AttributeError:                           # tf.keras on TF 2.15 (Keras 2 package)
        import keras as _k
        return _k.__version__


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (n, SEQ)).astype(np.int32)
    # make the two counted tokens frequent enough that the label is not trivial
    hot = rng.random((n, SEQ)) < 0.3
    x[hot] = rng.integers(1, 3, hot.sum())
    y = ((x == 1).sum(1) > (x == 2).sum(1)).astype(np.int32)
    return x, y


def build_model(keras):
    L = keras.layers
    inp = keras.Input((SEQ,), dtype="int32", name="tokens")
    tok = L.Embedding(VOCAB, DIM, name="tok_emb")(inp)
    pos = L.Embedding(SEQ, DIM, name="pos_emb")(tf.range(SEQ)[None, :])
    h = tok + pos
    a = L.MultiHeadAttention(HEADS, DIM // HEADS, name="mha")(h, h)
    h = L.LayerNormalization(name="ln1")(h + a)
    f = L.Dense(FF, activation="relu", name="ff1")(h)
    f = L.Dense(DIM, name="ff2")(f)
    h = L.LayerNormalization(name="ln2")(h + f)
    h = L.GlobalAveragePooling1D(name="pool")(h)
    out = L.Dense(2, name="head")(h)
    return keras.Model(inp, out, name="tiny_transformer")


def train(keras, weights, data, epochs, batch, lr, amp_params):
    """amp_params None: FP32.  Else: enable(**amp_params) + Keras AMP optimizer."""
    (x, y), (xt, yt) = data
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)                     # same shuffling order in every run
    model = build_model(keras)
    model.set_weights(weights)
    opt = keras.optimizers.Adam(lr)
    if amp_params is not None:
        npu_amp_tf.enable(**amp_params)
        opt = npu_amp_tf.AMP_Optimizer(opt)            # Keras wrapper: dynamic loss scale
    bridge.clear_reports()
    try:
        model.compile(optimizer=opt, jit_compile=False, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        t0 = time.perf_counter()
        hist = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=True)
        secs = time.perf_counter() - t0
        rep = largest_report() if amp_params is not None else None
        loss, acc = model.evaluate(xt, yt, batch_size=256, verbose=0)
    finally:
        if amp_params is not None:
            npu_amp_tf.disable()
    ls = None
    if amp_params is not None:
        m = opt.loss_scale_manager
        ls = dict(m.state(), history=[tuple(e) for e in m.history],
                  incr_every=m.incr_every_n_steps, incr_ratio=m.incr_ratio)
    return dict(train_loss=float(hist.history["loss"][-1]), loss=float(loss), acc=float(acc),
                seconds=secs, report=rep, loss_scale=ls)


CUBE_OP = re.compile(r"^(MatMul|Einsum|BatchMatMul(V2|V3)?|Conv2D\w*)(_\d+)?$")


def largest_report():
    """The first rewrite of the train function.  Grappler calls custom
    optimizers once per meta-optimizer iteration; the first call sees the
    graph as Keras built it, later ones the already rewritten graph."""
    recs = [r for r in bridge.last_reports() if r["status"] == "rewritten" and r.get("report")
            and "train_function" in str(r["graph"])]
    if not recs:
        recs = [r for r in bridge.last_reports() if r["status"] == "rewritten" and r.get("report")]
    if not recs:
        return None
    name = max(recs, key=lambda r: r["nodes"])["graph"]
    return next(r for r in recs if r["graph"] == name)["report"]


def cube_ops(rep):
    """{node: dtype} of the matrix (cube) ops, forward and backward, by node name."""
    return {n: d["dtype"] for n, d in rep["decisions"].items()
            if "dtype" in d and CUBE_OP.match(n.rsplit("/", 1)[-1])}


def describe(tag, res):
    rep = res["report"]
    if rep is None:
        raise SystemExit(f"[{tag}] the pass did not rewrite the train function "
                         f"(bridge records: {[r['status'] for r in bridge.last_reports()]})")
    s = rep["summary"]
    low = s.get("low_dtype")
    cubes = cube_ops(rep)
    einsum = {n: d for n, d in cubes.items() if "Einsum" in n.rsplit("/", 1)[-1]}
    low_einsum = sum(1 for d in einsum.values() if d == low)
    share = s.get("lp_flop_share")
    if share is not None:
        what = f"low-precision FLOP share {share:.3f} ({s.get('lp_flops')} of {s.get('matrix_flops')})"
    else:
        # no FLOPs without shapes: count the matrix ops instead
        share = sum(1 for d in cubes.values() if d == low) / max(len(cubes), 1)
        what = (f"low-precision share of matrix ops {share:.3f} (by count; FLOPs unavailable: "
                f"{s.get('shape_inference_error', 'no static shapes')[:70]})")
    ls = res["loss_scale"]
    print(f"[{tag}] train function ({s.get('nodes')} nodes): {what}")
    print(f"[{tag}] casts inserted {s.get('casts_inserted')} (Cast nodes in graph {s.get('casts')}); "
          f"matrix ops in {low}: {sum(1 for d in cubes.values() if d == low)} of {len(cubes)}, "
          f"of which Einsum (attention): {low_einsum} of {len(einsum)}")
    print(f"[{tag}] loss scale {ls['loss_scale']:g}, overflow steps {ls['overflow_count']}, "
          f"skipped {ls['skipped_steps']} of {ls['steps']} steps; events {ls['history'][:5]}")
    return share, low_einsum, len(einsum)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=3, help="epochs over --samples sequences (default 3)")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mixlist", default=None,
                    help="where to write the modify_mixlist JSON (default: a temp file)")
    args = ap.parse_args(argv)

    keras = tf.keras        # Keras 2 on TF 2.15, Keras 3 on newer TF: AMP_Optimizer wraps both
    keras.utils.set_random_seed(args.seed)
    data = (make_data(args.samples, args.seed), make_data(1024, args.seed + 1))
    weights = build_model(keras).get_weights()
    print(f"TensorFlow {tf.__version__}, Keras {keras_version(keras)}; {args.samples} sequences of "
          f"{SEQ} tokens, {args.epochs} epochs of batch {args.batch}; positive rate "
          f"{data[0][1].mean():.2f}")

    mixlist = args.mixlist or os.path.join(tempfile.mkdtemp(prefix="npu_amp_keras_"), "mixlist.json")
    with open(mixlist, "w", encoding="utf-8") as fh:
        json.dump(MIXLIST, fh, indent=1)
    print(f"modify_mixlist {mixlist}: {json.dumps(MIXLIST)}")

    fp32 = train(keras, weights, data, args.epochs, args.batch, args.lr, None)
    amp = train(keras, weights, data, args.epochs, args.batch, args.lr,
                dict(precision_mode="allow_mix_precision"))
    mix = train(keras, weights, data, args.epochs, args.batch, args.lr,
                dict(precision_mode="allow_mix_precision", modify_mixlist=mixlist))
    print()
    share_amp, e_amp, e_n = describe("AMP", amp)
    share_mix, e_mix, _ = describe("AMP+mixlist", mix)

    print("\n                      FP32        AMP   AMP+mixlist")
    print(f"  train loss (last ep) {fp32['train_loss']:8.4f}   {amp['train_loss']:8.4f}   {mix['train_loss']:8.4f}")
    print(f"  test loss            {fp32['loss']:8.4f}   {amp['loss']:8.4f}   {mix['loss']:8.4f}")
    print(f"  test accuracy        {fp32['acc']:8.4f}   {amp['acc']:8.4f}   {mix['acc']:8.4f}")
    print(f"  fit time [s]         {fp32['seconds']:8.1f}   {amp['seconds']:8.1f}   {mix['seconds']:8.1f}"
          "   (FP16 has no native CPU kernels)")
    print(f"RESULT lp_share={share_amp:.4f} lp_share_mixlist={share_mix:.4f} "
          f"low_einsum={e_amp} low_einsum_mixlist={e_mix} einsum={e_n} "
          f"casts_inserted={amp['report']['summary'].get('casts_inserted')} "
          f"loss_scale={amp['loss_scale']['loss_scale']:g} fp32_acc={fp32['acc']:.4f} "
          f"amp_acc={amp['acc']:.4f} mixlist_acc={mix['acc']:.4f} fp32_loss={fp32['loss']:.4f} "
          f"amp_loss={amp['loss']:.4f} overflows={amp['loss_scale']['overflow_count']} "
          f"skipped={amp['loss_scale']['skipped_steps']} ls_steps={amp['loss_scale']['steps']} "
          f"incr_every={amp['loss_scale']['incr_every']} incr_ratio={amp['loss_scale']['incr_ratio']:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
