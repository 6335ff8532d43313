"""Fusion benchmark: op count and median step time of inference graphs, FP32, CPU.

Graphs
  * BERT-base-like encoder built from raw ops (hidden 768, 12 heads, FFN 3072,
    erf-GELU, moments LayerNorm, additive mask), batch 8, seq 128,
    ``--layers`` encoder layers (default 2 to fit the time budget; BERT-base has 12).
  * ``tf.keras.applications.ResNet50(weights=None)``, batch 8, 224x224.
Both are frozen (weights are constants), as an inference deployment is.

Configurations, measured side by side in this process
  (a) TF, grappler remapping OFF
  (b) TF, remapping ON (stock)
  (c2) this plugin's fusion pass at graph_level 2 (default), remapping OFF
  (c3) the same at graph_level 3 (adds BN folding and FusedAttention)
Steps of all configurations are interleaved in one process (median per
configuration), so load on a shared machine hits them alike.

"ops" is the node count of the graph TF actually executes (the partition
graph after grappler), so (b) shows the remapper's own fusions.

TF 2.15 with oneDNN has been seen to abort inside grappler's remapper on a
BERT-like graph built from raw ops.  Config (b) is therefore first probed in a
subprocess; if the probe dies, (b) is reported as such and not run here.

Prints a table; never asserts a time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: E402

tf1 = tf.compat.v1
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


# ------------------------------------------------------------------ graphs
def bert_graph(layers=2, batch=8, seq=128, hidden=768, heads=12, ffn=3072, seed=0):
    rng = np.random.default_rng(seed)
    dh = hidden // heads

    def w(*shape):
        return tf.constant((rng.standard_normal(shape) * 0.02).astype(np.float32))

    def dense(x, n_out, act=None):
        y = tf.nn.bias_add(tf.matmul(x, w(int(x.shape[-1]), n_out)), w(n_out))
        return act(y) if act else y

    def gelu(x):
        return x * 0.5 * (1.0 + tf.math.erf(x / np.float32(np.sqrt(2.0))))

    def layer_norm(x):
        mean, var = tf.nn.moments(x, [-1], keepdims=True)
        return tf.nn.batch_normalization(x, mean, var, w(hidden), 1.0 + w(hidden), 1e-12)

    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch * seq, hidden], name="input")
        mask = tf1.placeholder(tf.float32, [batch, 1, 1, seq], name="mask_adder")
        h = x
        for i in range(layers):
            with tf.name_scope(f"layer_{i}"):
                def heads_of(t):
                    return tf.transpose(tf.reshape(t, [batch, seq, heads, dh]), [0, 2, 1, 3])
                q, k, v = (heads_of(dense(h, hidden)) for _ in range(3))
                s = tf.matmul(q, k, transpose_b=True) * (1.0 / np.sqrt(dh))
                p = tf.nn.softmax(s + mask)
                ctx = tf.reshape(tf.transpose(tf.matmul(p, v), [0, 2, 1, 3]), [batch * seq, hidden])
                h = layer_norm(dense(ctx, hidden) + h)
                h = layer_norm(dense(dense(h, ffn, gelu), hidden) + h)
        tf.identity(h, name="output")
    feeds = {"input:0": rng.standard_normal((batch * seq, hidden)).astype(np.float32),
             "mask_adder:0": np.where(rng.random((batch, 1, 1, seq)) > 0.1, 0.0, -10000.0).astype(np.float32)}
    return g.as_graph_def(), feeds, "output"


def resnet_graph(batch=8):
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    model = tf.keras.applications.ResNet50(weights=None)
    fn = tf.function(lambda x: model(x, training=False))
    cf = fn.get_concrete_function(tf.TensorSpec([batch, 224, 224, 3], tf.float32, name="images"))
    frozen = convert_variables_to_constants_v2(cf)
    gd = frozen.graph.as_graph_def()
    inp = frozen.inputs[0].name
    out = frozen.outputs[0].name.split(":")[0]
    feeds = {inp: np.random.default_rng(0).standard_normal((batch, 224, 224, 3)).astype(np.float32)}
    return gd, feeds, out


# ------------------------------------------------------------------ running
def session_config(remapping: bool):
    cfg = tf1.ConfigProto()
    ro = cfg.graph_options.rewrite_options
    ro.remapping = rewriter_config_pb2.RewriterConfig.ON if remapping else rewriter_config_pb2.RewriterConfig.OFF
    return cfg


def open_session(gd, remapping):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    return tf1.Session(graph=g, config=session_config(remapping))


def measure(gd, feeds, out, remapping, steps, warmup=2):
    """Single configuration (used by the probe child)."""
    return measure_interleaved({"x": (gd, remapping)}, feeds, out, steps, warmup)["x"]


def measure_interleaved(configs, feeds, out, steps, warmup=2):
    """configs: name -> (graph_def, remapping).  Steps of all configurations
    alternate, so load on the shared machine hits them alike; median per config."""
    sessions = {k: open_session(gd, rm) for k, (gd, rm) in configs.items()}
    res = {}
    try:
        for k, s in sessions.items():
            meta = tf1.RunMetadata()
            opts = tf1.RunOptions(output_partition_graphs=True)
            value = s.run(out + ":0", feeds, options=opts, run_metadata=meta)
            res[k] = [sum(len(pg.node) for pg in meta.partition_graphs), [], value]
            for _ in range(warmup):
                s.run(out + ":0", feeds)
        for _ in range(steps):
            for k, s in sessions.items():
                t0 = time.perf_counter()
                s.run(out + ":0", feeds)
                res[k][1].append(time.perf_counter() - t0)
    finally:
        for s in sessions.values():
            s.close()
    return {k: (ops, statistics.median(ts), value) for k, (ops, ts, value) in res.items()}


def fuse(gd, out, level):
    import npu_amp_tf.fused_ops  # noqa: F401  (kernels for LayerNorm / FusedAttention)
    import graph_passes.fusion  # noqa: F401
    import graph_passes.cleanup  # noqa: F401
    from graph_passes.manager import run_passes

    class Opts:
        graph_level = level
        precision = "must_keep_origin_dtype"

    new, report = run_passes(gd, ["fusion", "cleanup"], options=Opts(), fetches=[out])
    return new, report.pass_stats("fusion")


def probe(name, layers):
    """Run config (b) once in a child process; returns (ok, returncode, tail of stderr)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", name, "--layers", str(layers)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode == 0, proc.returncode, proc.stderr.strip().splitlines()[-1:] if proc.stderr else []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--only", choices=("bert", "resnet"))
    ap.add_argument("--probe", choices=("bert", "resnet"))
    args = ap.parse_args()
    builders = {"bert": lambda: bert_graph(args.layers), "resnet": resnet_graph}
    if args.probe:
        gd, feeds, out = builders[args.probe]()
        measure(gd, feeds, out, remapping=True, steps=1, warmup=0)
        return
    print(f"TF {tf.__version__}, oneDNN {'on' if os.environ.get('TF_ENABLE_ONEDNN_OPTS', '1') != '0' else 'off'}, "
          f"FP32, CPU threads {os.cpu_count()}, median of {args.steps} steps")
    rows = []
    for name in ([args.only] if args.only else ["bert", "resnet"]):
        label = f"BERT-like x{args.layers} layers b8 s128" if name == "bert" else "ResNet50 b8 224"
        gd, feeds, out = builders[name]()
        fused, stats, rw = {}, {}, {}
        for level in (2, 3):
            t0 = time.perf_counter()
            fused[level], stats[level] = fuse(gd, out, level)
            rw[level] = time.perf_counter() - t0
        ok, rc, tail = probe(name, args.layers)
        configs = {"a": (gd, False), "c2": (fused[2], False), "c3": (fused[3], False)}
        if ok:
            configs["b"] = (gd, True)
        m = measure_interleaved(configs, feeds, out, args.steps)
        errs = {k: float(np.max(np.abs(m["a"][2] - m[k][2]))) for k in ("c2", "c3")}
        rows.append((label, m, errs, rw, stats, rc, tail))
    print()
    print("| graph | (a) ops / ms | (b) ops / ms | (c2) ops / ms | (c3) ops / ms | (c2)/(b) | (c3)/(b) | (c3)/(a) | max abs diff c2 / c3 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, m, errs, rw, stats, rc, tail in rows:
        cell = {k: f"{m[k][0]} / {m[k][1] * 1e3:.1f}" for k in m}
        b_t = m["b"][1] if "b" in m else None
        print(f"| {label} | {cell['a']} | {cell.get('b', f'ABORTED (rc {rc})')} | {cell['c2']} | {cell['c3']} | "
              f"{(m['c2'][1] / b_t) if b_t else float('nan'):.2f} | {(m['c3'][1] / b_t) if b_t else float('nan'):.2f} | "
              f"{m['c3'][1] / m['a'][1]:.2f} | {errs['c2']:.1e} / {errs['c3']:.1e} |")
    print()
    for label, m, errs, rw, stats, rc, tail in rows:
        for level in (2, 3):
            print(f"{label}: graph_level {level}: fusion pass {rw[level]:.2f}s, fused {stats[level].get('fused')}, "
                  f"skipped {stats[level].get('skipped')}")
        if tail:
            print(f"  (b) probe: rc {rc}: {tail}")
    print("goals: (c)/(b) <= 0.8 on the BERT-like encoder, <= 1.0 on ResNet-50")


if __name__ == "__main__":
    main()
