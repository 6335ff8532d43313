"""Training-step peak memory: FP32 vs ours (FP16, BF16) vs grappler's AMP vs
Keras mixed precision, side by side in ONE process on the same graphs.

Graphs (TF1 training graphs, fixed batch, activations dominate):
  * ResNet-50 (``tf.keras.applications``, Keras 2) + Momentum, ``--image`` px;
  * the BERT-like encoder of benchmarks/precision.py + Adam.

Peak memory is measured, not estimated: one traced training step
(``FULL_TRACE``) per configuration after one warm-up step (the first step
after the initializers also allocates the variables' buffers), the figure
``npu-amp profile`` prints (``npu_amp_tf.tools.profile.allocator_peaks``: the
peak running total of TF's allocation records for the step).  Variables and
optimizer slots live outside the step and are not in it; their bytes are
printed separately (identical in every configuration: FP32 masters).

Configurations, each on a fresh copy of the graph, the same feeds, the same
session config (remapper off, as the tools run):
  fp32            the graph as built
  ours-fp16       npu_amp_tf.rewrite_graph(precision_mode=allow_mix_precision)
  ours-bf16       ... allow_mix_precision_bf16
  grappler-fp16   rewrite_options.auto_mixed_precision_cpu (real FP16: EMULATE_FP16=0)
  grappler-bf16   rewrite_options.auto_mixed_precision_onednn_bfloat16
  keras-fp16      Keras mixed_float16 policy (ResNet-50 only: built with Keras)
  keras-bf16      Keras mixed_bfloat16 policy
  ours-bf16-nodelay
                  ours-bf16 with delay_fp32_copies=False (FP32 copies for the
                  backward made as soon as their input is ready)
  ours-fp16-fused / ours-bf16-fused
                  ours-fp16 / ours-bf16 at graph_level 2, the default (the other
                  ours-* run graph_level 0): LayerNorm and its gradient become
                  LayerNorm / LayerNormGrad (issue 14)
  ours-bf16+recompute / +scheduling
                  ours-bf16 with grappler's memory optimizer set to
                  RECOMPUTATION_HEURISTICS / SCHEDULING_HEURISTICS (the CPU-side
                  levers next to GE's memory_optimize)

Also printed: the rewrite report's estimated activation bytes (before for
fp32, after for ours) and estimate/measured.  Goal: ours <= 0.65x FP32 and no
more than grappler's or Keras's.

    python benchmarks/memory.py [--models resnet50,bert] [--batch 16] [--image 96]
                                [--bert-batch 16] [--bert-layers 2] [--configs fp32,ours-bf16,...]

The README figures (2026-12-01): on TF 2.15.1 ``--models resnet50 --batch 32
--image 128 --configs fp32,ours-bf16,grappler-bf16,keras-bf16,ours-bf16+recompute,ours-bf16+scheduling``
and ``--models bert --bert-batch 32 --configs
fp32,ours-bf16,grappler-bf16,ours-bf16+recompute,ours-bf16+scheduling`` (BF16
runs fast here; an FP16 step takes minutes on TF 2.15's Eigen kernels); the
FP16 rows on TF 2.21.0 (FP16 matmul at about FP32's speed there) with
``--configs fp32,ours-fp16,grappler-fp16,ours-bf16,grappler-bf16`` (plus
``keras-fp16,keras-bf16`` for ResNet-50), same batches.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16"] = "0"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import npu_amp_tf  # noqa: E402
from npu_amp_tf.tools import model_io  # noqa: E402
from npu_amp_tf.tools.profile import allocator_peaks  # noqa: E402

v1 = tf.compat.v1
TF_VERSION = tuple(int(x) for x in tf.__version__.split(".")[:2])
MiB = 2 ** 20
RC = rewriter_config_pb2.RewriterConfig


def keras2():
    if TF_VERSION < (2, 16):
        return tf.keras
    import tf_keras
    return tf_keras


# ------------------------------------------------------------------ graphs
def resnet50(batch, image, policy=None):
    k = keras2()
    g = tf.Graph()
    old = k.mixed_precision.global_policy().name
    try:
        if policy:
            k.mixed_precision.set_global_policy(policy)
        with g.as_default():
            if hasattr(k.backend, "set_learning_phase"):
                k.backend.set_learning_phase(1)
            x = v1.placeholder(tf.float32, [batch, image, image, 3], name="images")
            y = v1.placeholder(tf.int32, [batch], name="labels")
            model = k.applications.ResNet50(weights=None, input_tensor=x, classes=1000)
            logits = model.output.op.inputs[0] if model.output.op.type == "Softmax" else model.output
            logits = tf.cast(logits, tf.float32)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                                  name="loss")
            opt = v1.train.MomentumOptimizer(0.01, 0.9)
            with tf.control_dependencies(model.updates if hasattr(model, "updates") else []):
                train = opt.minimize(loss, var_list=model.trainable_weights, name="train")
            init = v1.global_variables_initializer()
    finally:
        k.mixed_precision.set_global_policy(old)
    rng = np.random.default_rng(0)
    feeds = {"images:0": rng.standard_normal((batch, image, image, 3)).astype(np.float32),
             "labels:0": rng.integers(0, 1000, batch).astype(np.int32)}
    return g, train.name, init.name, feeds


def bert(batch, layers, seq=128):
    from precision import bert_training_graph

    g, fetches = bert_training_graph(layers=layers, batch=batch, seq=seq)
    with g.as_default():
        init = v1.global_variables_initializer()
    rng = np.random.default_rng(0)
    feeds = {"input_ids:0": rng.integers(0, 30522, (batch, seq)).astype(np.int32),
             "labels:0": rng.integers(0, 2, batch).astype(np.int32)}
    return g, fetches[1], init.name, feeds


# ------------------------------------------------------------------ running
def measure(graph_def, train, init, feeds, config):
    """(peak bytes of the traced step, variable bytes, step seconds)."""
    g = model_io.import_graph(graph_def)
    opts = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE)
    with v1.Session(graph=g, config=config) as s:
        s.run(init)
        var_bytes = _variable_bytes(g)
        s.run(train, feeds)
        md = v1.RunMetadata()
        t0 = time.perf_counter()
        s.run(train, feeds, options=opts, run_metadata=md)
        dt = time.perf_counter() - t0
    return max(allocator_peaks(md.step_stats).values()), var_bytes, dt


def _variable_bytes(g):
    total = 0
    for op in g.get_operations():
        if op.type in ("VarHandleOp", "VariableV2"):
            shape = tf.TensorShape(op.get_attr("shape"))
            if shape.is_fully_defined():
                total += shape.num_elements() * tf.as_dtype(op.get_attr("dtype")).size
    return total


def config_for(name):
    cfg = model_io.session_config()
    ro = cfg.graph_options.rewrite_options
    if name == "grappler-fp16":
        ro.auto_mixed_precision_cpu = RC.ON
    elif name == "grappler-bf16":
        ro.auto_mixed_precision_onednn_bfloat16 = RC.ON
    if name.endswith("+recompute"):
        ro.memory_optimization = RC.RECOMPUTATION_HEURISTICS
    elif name.endswith("+scheduling"):
        ro.memory_optimization = RC.SCHEDULING_HEURISTICS
    return cfg


CONFIGS = ("fp32", "ours-fp16", "ours-bf16", "grappler-fp16", "grappler-bf16", "keras-fp16", "keras-bf16",
           "ours-bf16+recompute", "ours-bf16+scheduling", "ours-bf16-nodelay", "ours-bf16-fused",
           "ours-fp16-fused")


def run_model(label, build, configs, keras_ok):
    rows = {}
    base = None
    for name in configs:
        if name.startswith("keras") and not keras_ok:
            continue
        policy = {"keras-fp16": "mixed_float16", "keras-bf16": "mixed_bfloat16"}.get(name)
        if policy or base is None:
            built = build(policy)
            if not policy:
                base = built
        g, train, init, feeds = built if policy else base
        gd = g.as_graph_def()
        est = None
        if name.startswith("ours"):
            mode = "allow_mix_precision_bf16" if "bf16" in name else "allow_mix_precision"
            # "-fused": graph_level 2 (LayerNorm and its gradient fused, issue 14)
            gd, rep = npu_amp_tf.rewrite_graph(gd, fetches=[train.split(":")[0], init],
                                               precision_mode=mode,
                                               graph_level=2 if name.endswith("-fused") else 0,
                                               delay_fp32_copies="nodelay" not in name)
            est = rep.summary.get("activation_bytes_after")
        elif name == "fp32":
            _, rep = npu_amp_tf.rewrite_graph(gd, fetches=[train.split(":")[0], init],
                                              precision_mode="must_keep_origin_dtype", graph_level=0)
            est = rep.summary.get("activation_bytes_before")
        try:
            peak, var_bytes, dt = measure(gd, train, init, feeds, config_for(name))
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result, not a crash
            print(f"  {name:<22} failed: {str(exc).splitlines()[0][:150]}", flush=True)
            continue
        rows[name] = (peak, est)
        ratio = peak / rows["fp32"][0] if "fp32" in rows else float("nan")
        est_s = f"  estimate {est / MiB:8.1f} MiB ({est / peak:4.2f}x measured)" if est else ""
        print(f"  {name:<22} peak {peak / MiB:8.1f} MiB  {ratio:5.2f}x fp32  step {dt:6.2f} s  "
              f"variables {var_bytes / MiB:6.1f} MiB{est_s}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--batch", type=int, default=16, help="ResNet-50 batch")
    ap.add_argument("--image", type=int, default=96, help="ResNet-50 image size")
    ap.add_argument("--bert-batch", type=int, default=16)
    ap.add_argument("--bert-layers", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if "fp32" in configs:
        configs.remove("fp32")
    configs = ["fp32"] + configs
    print(f"TF {tf.__version__}")
    results = {}
    for m in args.models.split(","):
        if m == "resnet50":
            label = f"ResNet-50 b{args.batch} {args.image}x{args.image}"
            print(label, flush=True)
            results[m] = run_model(label, lambda p: resnet50(args.batch, args.image, p), configs, True)
        elif m == "bert":
            label = f"BERT-like x{args.bert_layers} b{args.bert_batch} s128"
            print(label, flush=True)
            results[m] = run_model(label, lambda p: bert(args.bert_batch, args.bert_layers), configs, False)
    print("goal: ours <= 0.65x fp32 and <= grappler's / Keras's (same dtype)")
    for m, rows in results.items():
        if "fp32" not in rows:
            continue
        f32 = rows["fp32"][0]
        for ours, peers in (("ours-fp16", ("grappler-fp16", "keras-fp16")),
                            ("ours-bf16", ("grappler-bf16", "keras-bf16")),
                            ("ours-bf16-fused", ("grappler-bf16", "keras-bf16")),
                            ("ours-fp16-fused", ("grappler-fp16", "keras-fp16"))):
            if ours not in rows:
                continue
            r = rows[ours][0] / f32
            worse = [p for p in peers if p in rows and rows[ours][0] > rows[p][0]]
            verdict = "met" if r <= 0.65 and not worse else "MISSED"
            print(f"  {m} {ours}: {r:.2f}x fp32 {verdict}"
                  + (f" (more than {', '.join(worse)})" if worse else ""))


if __name__ == "__main__":
    main()
