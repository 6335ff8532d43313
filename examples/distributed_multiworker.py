#!/usr/bin/env python
"""Two MultiWorkerMirroredStrategy workers on 127.0.0.1 with AMP and FP16 all-reduce.

Run it without arguments: the script is its own launcher.  It picks two free
ports, starts two worker processes of itself with ``TF_CONFIG`` set (the way a
cluster scheduler would), waits for them and prints what they did.  It does
this twice, from the same initial weights and data shards:

* **FP32**: plain Keras Adam, FP32 gradient all-reduce;
* **AMP**: ``npu_amp_tf.enable(precision_mode="allow_mix_precision")`` (the
  grappler pass rewrites the distributed step function) and
  ``npu_amp_tf.AMP_Optimizer(adam, allreduce_dtype="float16",
  bucket_size_mb=...)``: dynamic loss scaling, the *scaled* gradients
  all-reduced in FP16 (the analogue of Ascend's ``HCCL_FP16_ENABLE``), packed
  into buckets of ``bucket_size_mb`` (tf.distribute ``bytes_per_pack``).  An
  overflow on either worker makes the all-reduced sum non-finite on both, so
  both skip the step and their loss scales stay identical.

Each worker trains an MLP on its own half of scikit-learn's digits (custom
loop, ``strategy.run``) and reports loss, test accuracy, loss scale, the
pass report and a checksum of its weights; the launcher checks that both
workers ended with identical weights and loss scale.

Keras 2 is needed (``tf.keras`` on TF 2.15, ``tf_keras`` on newer TF).

    python examples/distributed_multiworker.py --steps 100
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = 2


# --------------------------------------------------------------------------- worker
def worker(args):
    import numpy as np
    import tensorflow as tf

    import npu_amp_tf
    from npu_amp_tf import bridge

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    amp = args.mode == "amp"
    keras = npu_amp_tf.keras.keras_module()
    if amp:
        npu_amp_tf.enable(precision_mode="allow_mix_precision")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split((d.data / 16.0).astype(np.float32),
                                              d.target.astype(np.int32), test_size=0.25,
                                              random_state=0, stratify=d.target)
    x_tr, y_tr = x_tr[task::WORKERS], y_tr[task::WORKERS]     # this worker's shard
    global_batch = args.batch * WORKERS

    with strategy.scope():
        keras.utils.set_random_seed(0)                         # same initial weights everywhere
        model = keras.Sequential([keras.layers.Dense(64, activation="relu", input_shape=(64,)),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        opt = keras.optimizers.Adam(args.lr)
        if amp:
            opt = npu_amp_tf.AMP_Optimizer(opt, allreduce_dtype="float16",
                                           bucket_size_mb=args.bucket_size_mb)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(xb, yb):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                per_ex = loss_obj(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(per_ex, global_batch_size=global_batch)
            if amp:
                opt.minimize(loss, model.trainable_variables, tape=tape)   # scale, FP16 all-reduce, check
            else:
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        per_replica = strategy.run(replica_fn, args=(xb, yb))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    rng = np.random.default_rng(task)
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        idx = rng.integers(0, len(x_tr), args.batch)
        losses.append(float(train_step(tf.constant(x_tr[idx]), tf.constant(y_tr[idx]))))
    secs = time.perf_counter() - t0
    logits = model(x_te, training=False)
    acc = float(np.mean(np.argmax(logits.numpy(), 1) == y_te))
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    out = dict(task=task, mode=args.mode, losses=losses, test_acc=acc, seconds=secs,
               weights_sum=float(np.sum(weights, dtype=np.float64)),
               weights_head=[float(v) for v in weights[:8]])
    if amp:
        m = opt.loss_scale_manager
        out["loss_scale"] = m.state()
        out["incr"] = (m.incr_every_n_steps, m.incr_ratio)
        out["history"] = [tuple(e) for e in m.history]
        recs = [r for r in bridge.last_reports() if r["status"] == "rewritten" and r.get("report")]
        if recs:
            name = max(recs, key=lambda r: r["nodes"])["graph"]
            rep = next(r for r in recs if r["graph"] == name)["report"]     # first rewrite of it
            s = rep["summary"]
            coll = sum(1 for n in rep["decisions"] if "Collective" in n or "allreduce" in n.lower())
            mm = {n: dd["dtype"] for n, dd in rep["decisions"].items()
                  if "dtype" in dd and n.rsplit("/", 1)[-1].split("_")[0] == "MatMul"}
            out["report"] = dict(graph=name, nodes=s.get("nodes"), casts_inserted=s.get("casts_inserted"),
                                 casts=s.get("casts"), lp_flop_share=s.get("lp_flop_share"),
                                 shape_inference_error=s.get("shape_inference_error"),
                                 low_matmuls=sum(1 for v in mm.values() if v == s.get("low_dtype")),
                                 matmuls=len(mm), collective_nodes=coll)
        out["bridge_statuses"] = [r["status"] for r in bridge.last_reports()]
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


# --------------------------------------------------------------------------- launcher
def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(mode, args, tmp):
    ports = free_ports(WORKERS)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs, outs = [], []
    for i in range(WORKERS):
        out = os.path.join(tmp, f"{mode}_w{i}.json")
        outs.append(out)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
                   OMP_NUM_THREADS="1", TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode, "--out", out,
               "--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr),
               "--bucket-size-mb", str(args.bucket_size_mb)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=args.timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode != 0:
            raise SystemExit(f"{mode} worker {i} failed (exit {p.returncode}):\n{log[-3000:]}")
    results = []
    for o in outs:
        with open(o, encoding="utf-8") as fh:
            results.append(json.load(fh))
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="training steps per worker (default 100)")
    ap.add_argument("--batch", type=int, default=32, help="per-worker batch")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bucket-size-mb", type=float, default=0.01,
                    help="all-reduce packing size in MB (small here so the 3-layer MLP spans several packs)")
    ap.add_argument("--no-fp32", action="store_true",
                    help="skip the FP32 reference pair (the CI smoke test uses this)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the workers")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("fp32", "amp"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    import tensorflow as tf

    import npu_amp_tf

    try:
        npu_amp_tf.keras.keras_module()
    except npu_amp_tf.NpuAmpError as exc:
        print(f"SKIP: {exc}")
        return 0
    print(f"TensorFlow {tf.__version__}: {WORKERS} MultiWorkerMirroredStrategy workers on 127.0.0.1, "
          f"{args.steps} steps of {args.batch} per worker; AMP: allreduce_dtype=float16, "
          f"bucket_size_mb={args.bucket_size_mb}")
    with tempfile.TemporaryDirectory(prefix="npu_amp_mwms_") as tmp:
        t0 = time.perf_counter()
        fp32 = None if args.no_fp32 else launch("fp32", args, tmp)
        t1 = time.perf_counter()
        amp = launch("amp", args, tmp)
        t2 = time.perf_counter()

    for tag, res in (("FP32", fp32 or []), ("AMP", amp)):
        for r in res:
            extra = ""
            if "loss_scale" in r:
                ls = r["loss_scale"]
                extra = (f", loss scale {ls['loss_scale']:g} (overflows {ls['overflow_count']}, "
                         f"skipped {ls['skipped_steps']})")
            print(f"[{tag} worker {r['task']}] final loss {np.mean(r['losses'][-10:]):.4f}, test accuracy "
                  f"{r['test_acc']:.4f}, weight checksum {r['weights_sum']:.6f}{extra}")
    rep = amp[0].get("report")
    if rep is None:
        raise SystemExit(f"the pass did not rewrite the step function (bridge: {amp[0].get('bridge_statuses')})")
    share = rep["lp_flop_share"]
    if share is None:
        share = rep["low_matmuls"] / max(rep["matmuls"], 1)
        share_txt = (f"{share:.3f} of MatMul ops by count ({rep['low_matmuls']} of {rep['matmuls']}; "
                     f"FLOPs unavailable: {str(rep['shape_inference_error'])[:60]})")
    else:
        share_txt = f"{share:.3f} of MatMul FLOPs"
    print(f"\nWhat the pass did to the distributed step function '{rep['graph']}' ({rep['nodes']} nodes):")
    print(f"  low-precision share       : {share_txt}")
    print(f"  casts inserted            : {rep['casts_inserted']} (Cast nodes in graph {rep['casts']})")
    same_w = abs(amp[0]["weights_sum"] - amp[1]["weights_sum"]) == 0 and \
        amp[0]["weights_head"] == amp[1]["weights_head"]
    same_ls = amp[0]["loss_scale"] == amp[1]["loss_scale"]
    print(f"  workers agree             : weights {'identical' if same_w else 'DIFFER'}, "
          f"loss-scale state {'identical' if same_ls else 'DIFFERS'}")

    nan = float("nan")
    f_loss = float(np.mean([np.mean(r["losses"][-10:]) for r in fp32])) if fp32 else nan
    a_loss = float(np.mean([np.mean(r["losses"][-10:]) for r in amp]))
    f_acc = fp32[0]["test_acc"] if fp32 else nan
    print("\n                      FP32        AMP (FP16 all-reduce)")
    print(f"  train loss (last 10) {f_loss:8.4f}   {a_loss:8.4f}")
    print(f"  test accuracy        {f_acc:8.4f}   {amp[0]['test_acc']:8.4f}")
    print(f"  wall time [s]        {t1 - t0:8.1f}   {t2 - t1:8.1f}   (incl. process start-up)")
    print(f"RESULT lp_share={share:.4f} casts_inserted={rep['casts_inserted']} "
          f"loss_scale={amp[0]['loss_scale']['loss_scale']:g} workers_identical={int(same_w and same_ls)} "
          f"fp32_acc={f_acc:.4f} amp_acc={amp[0]['test_acc']:.4f} "
          f"fp32_loss={f_loss:.4f} amp_loss={a_loss:.4f} "
          f"overflows={amp[0]['loss_scale']['overflow_count']} skipped={amp[0]['loss_scale']['skipped_steps']} "
          f"ls_steps={amp[0]['loss_scale']['steps']} incr_every={amp[0]['incr'][0]} incr_ratio={amp[0]['incr'][1]:g}")
    return 0 if (same_w and same_ls) else 1


if __name__ == "__main__":
    import numpy as np  # noqa: F401  (launcher tables)

    sys.exit(main())
