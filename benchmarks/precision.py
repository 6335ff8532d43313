"""Precision pass vs TF's own grappler ``auto_mixed_precision_cpu``, side by side
in ONE process on the same training graphs.

Graphs (built, never run):
  * ``tf.keras.applications.ResNet50(weights=None)`` + momentum optimizer (TF1 graph);
  * a BERT-base-like encoder (12 layers, hidden 768, 12 heads) + Adam (raw ops).

Grappler runs through ``tf_optimizer.OptimizeGraph`` on a MetaGraph with every
other optimizer off (remapper included: TF 2.15 + oneDNN has aborted inside it on
BERT-style raw-op graphs) and ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16=0``:
in CPU mode grappler otherwise *emulates* FP16 (the ops stay FP32 between
fp32->fp16->fp32 casts, auto_mixed_precision.cc ``ChangeTypeAttrsAndAddCasts``),
which would put 0% of the FLOPs in low precision.

Printed per graph: Cast nodes in the output, low-precision share of matrix/conv
FLOPs (static shapes), pass time (ours: end to end, bytes in -> bytes out;
grappler: OptimizeGraph with AMP on minus with AMP off, medians), and
ours/grappler ratios.  Goals: FLOP share >= 99%, casts <= grappler's, time <=
grappler's.  Times are printed, never asserted.

    python benchmarks/precision.py [--graphs resnet50,bert] [--repeat 3] [--bert-layers 12]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16"] = "0"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.framework import graph_pb2  # noqa: E402
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import npu_amp_tf  # noqa: E402
from graph_passes import registry  # noqa: E402
from graph_passes.graph import Graph, parse_tensor  # noqa: E402
from graph_passes.precision import stats  # noqa: E402

v1 = tf.compat.v1
TF_VERSION = tuple(int(x) for x in tf.__version__.split(".")[:2])


def keras2():
    if TF_VERSION < (2, 16):
        return tf.keras
    import tf_keras
    return tf_keras


# ------------------------------------------------------------------ graphs
def resnet50_training_graph(batch=8):
    k = keras2()
    g = tf.Graph()
    with g.as_default():
        k.backend.set_learning_phase(1) if hasattr(k.backend, "set_learning_phase") else None
        x = v1.placeholder(tf.float32, [batch, 224, 224, 3], name="images")
        y = v1.placeholder(tf.int32, [batch], name="labels")
        model = k.applications.ResNet50(weights=None, input_tensor=x, classes=1000)
        logits = model.output.op.inputs[0] if model.output.op.type == "Softmax" else model.output
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        opt = v1.train.MomentumOptimizer(0.1, 0.9)
        with tf.control_dependencies(model.updates if hasattr(model, "updates") else []):
            train = opt.minimize(loss, var_list=model.trainable_weights, name="train")
    return g, ["loss", train.name.split(":")[0]]


def bert_training_graph(layers=12, hidden=768, heads=12, seq=128, batch=8, vocab=30522, ffn=3072):
    g = tf.Graph()
    with g.as_default():
        init = v1.truncated_normal_initializer(stddev=0.02)
        ids = v1.placeholder(tf.int32, [batch, seq], name="input_ids")
        labels = v1.placeholder(tf.int32, [batch], name="labels")
        emb = v1.get_variable("word_embeddings", [vocab, hidden], initializer=init)
        pos = v1.get_variable("position_embeddings", [seq, hidden], initializer=init)

        def dense(z, n_out, name, act=None):
            with v1.variable_scope(name):
                w = v1.get_variable("kernel", [z.shape[-1], n_out], initializer=init)
                b = v1.get_variable("bias", [n_out], initializer=tf.zeros_initializer())
                out = tf.nn.bias_add(tf.matmul(z, w), b)
                return act(out) if act is not None else out

        def layer_norm(z, name):
            with v1.variable_scope(name):
                gamma = v1.get_variable("gamma", [hidden], initializer=tf.ones_initializer())
                beta = v1.get_variable("beta", [hidden], initializer=tf.zeros_initializer())
                mean, var = tf.nn.moments(z, axes=[-1], keepdims=True)
                return (z - mean) * tf.math.rsqrt(var + 1e-12) * gamma + beta

        h = tf.reshape(tf.gather(emb, ids) + pos, [batch * seq, hidden])
        h = layer_norm(h, "emb_ln")
        dh = hidden // heads
        for i in range(layers):
            with v1.variable_scope(f"layer_{i}"):
                def split(z):
                    return tf.transpose(tf.reshape(z, [batch, seq, heads, dh]), [0, 2, 1, 3])
                q, k_, v = (split(dense(h, hidden, n)) for n in ("query", "key", "value"))
                scores = tf.matmul(q, k_, transpose_b=True) * (1.0 / float(np.sqrt(dh)))
                probs = tf.nn.softmax(scores)
                ctx = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [batch * seq, hidden])
                h = layer_norm(h + dense(ctx, hidden, "attn_out"), "attn_ln")
                inter = dense(h, ffn, "intermediate", act=tf.nn.gelu)
                h = layer_norm(h + dense(inter, hidden, "output"), "out_ln")
        first = tf.reshape(h, [batch, seq, hidden])[:, 0]
        pooled = dense(first, hidden, "pooler", act=tf.tanh)
        logits = dense(pooled, 2, "classifier")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                              name="loss")
        train = v1.train.AdamOptimizer(1e-4).minimize(loss, name="train")
    return g, ["loss", train.name.split(":")[0]]


# ---------------------------------------------------------------- grappler
def grappler_config(amp: bool):
    cfg = config_pb2.ConfigProto()
    ro = cfg.graph_options.rewrite_options
    off = rewriter_config_pb2.RewriterConfig.OFF
    for f in ("layout_optimizer", "constant_folding", "shape_optimization", "remapping",
              "common_subgraph_elimination", "arithmetic_optimization", "dependency_optimization",
              "loop_optimization", "function_optimization", "debug_stripper",
              "scoped_allocator_optimization", "pin_to_host_optimization", "implementation_selector",
              "auto_mixed_precision", "auto_mixed_precision_mkl", "auto_mixed_precision_onednn_bfloat16"):
        setattr(ro, f, off)
    ro.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    ro.disable_model_pruning = True
    ro.min_graph_nodes = -1
    ro.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    ro.auto_mixed_precision_cpu = rewriter_config_pb2.RewriterConfig.ON if amp else off
    return cfg


def run_grappler(graph, fetches, repeat):
    with graph.as_default():
        mg = v1.train.export_meta_graph(graph_def=graph.as_graph_def(add_shapes=True),
                                        clear_devices=True, collection_list=[])
    for f in fetches:
        mg.collection_def["train_op"].node_list.value.append(f)
    times = {True: [], False: []}
    out = None
    for _ in range(repeat):
        for amp in (False, True):
            t0 = time.perf_counter()
            res = tf_optimizer.OptimizeGraph(grappler_config(amp), mg, graph_id=b"bench")
            times[amp].append(time.perf_counter() - t0)
            if amp:
                out = res
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return out, on - off, on, off


# --------------------------------------------------------------------- ours
def run_ours(gd_bytes, fetches, repeat):
    times, ptimes, out, rep = [], [], None, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        gd = graph_pb2.GraphDef()
        gd.ParseFromString(gd_bytes)
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, graph_level=0)
        data = out.SerializeToString()
        times.append(time.perf_counter() - t0)
        ptimes += [p["time_s"] for p in rep.passes if p["name"] == "precision"]
    assert data
    return out, rep, statistics.median(times), (statistics.median(ptimes) if ptimes else float("nan"))


# ------------------------------------------------------------------ metrics
class _CastAwareShapes:
    """Shapes of the original graph looked up through Casts of a rewritten one."""

    def __init__(self, orig_shapes, out_graph):
        self.orig, self.g = orig_shapes, out_graph

    def get(self, ref):
        for _ in range(8):
            src, port, _ = parse_tensor(ref)
            node = self.g.nodes.get(src)
            if node is not None and node.op == "Cast" and src not in self.orig._shapes:
                ref = node.input[0]
                continue
            return self.orig.get(ref)
        return None


class _OutShapes(stats.ShapeTable):
    """Shape table of a rewritten graph: original shapes by name, Casts take
    the shape of their input."""

    def __init__(self, orig_shapes, out_graph):
        super().__init__(out_graph)
        self.orig = orig_shapes

    def node_shapes(self, name):
        s = self.orig.node_shapes(name) if name in self.orig._graph.nodes else None
        if s is None:
            node = self._graph.nodes.get(name)
            if node is not None and node.op == "Cast":
                s = [self.get(node.input[0])]
        return s


def activation_mib(out_gd, orig_shapes):
    g = Graph(out_gd, copy=False)
    return stats.activation_bytes(g, _OutShapes(orig_shapes, g)) / 2 ** 20


def flop_share(out_gd, orig_shapes):
    g = Graph(out_gd, copy=False)
    shapes = _CastAwareShapes(orig_shapes, g)
    lp = total = unknown = 0
    for n in g.nodes.values():
        if n.op not in stats.MATRIX_OPS:
            continue
        f = stats.matmul_flops(n, shapes)
        if f is None:
            unknown += 1
            continue
        total += f
        dt = n.attr["Ta"].type if "Ta" in n.attr else n.attr["T"].type
        if dt in registry.LOW_TYPES:
            lp += f
    return (lp / total if total else float("nan")), total, unknown


def count(gd, op):
    return sum(1 for n in gd.node if n.op == op)


def bench(name, graph, fetches, repeat):
    gd = graph.as_graph_def(add_shapes=True)
    gd_bytes = gd.SerializeToString()
    orig_shapes = stats.ShapeTable(Graph(gd))
    print(f"\n== {name}: {len(gd.node)} nodes, {count(gd, 'Cast')} Casts before", flush=True)
    ours, rep, t_ours, t_pass = run_ours(gd_bytes, fetches, repeat)
    gr_meta_out, t_gr, t_on, t_off = run_grappler(graph, fetches, repeat)
    gr_out = gr_meta_out
    c0 = count(gd, "Cast")
    c_ours, c_gr = count(ours, "Cast") - c0, count(gr_out, "Cast") - c0
    s_ours, flops, unk = flop_share(ours, orig_shapes)
    s_gr, _, _ = flop_share(gr_out, orig_shapes)
    a0, a_ours, a_gr = (activation_mib(x, orig_shapes) for x in (gd, ours, gr_out))
    rows = [
        ("Cast nodes added", f"{c_ours}", f"{c_gr}", _ratio(c_ours, c_gr)),
        (f"activation MiB (FP32: {a0:.0f})", f"{a_ours:.0f}", f"{a_gr:.0f}", _ratio(a_ours, a_gr)),
        ("low-precision FLOP share", f"{s_ours:.2%}", f"{s_gr:.2%}", _ratio(s_ours, s_gr)),
        ("pass time end-to-end (s)", f"{t_ours:.3f}", f"{t_gr:.3f}", _ratio(t_ours, t_gr)),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}} | {'npu-amp-tf':>11} | {'grappler':>11} | ours/grappler")
    for r in rows:
        print(f"{r[0]:{w}} | {r[1]:>11} | {r[2]:>11} | {r[3]}")
    print(f"  matrix/conv GFLOPs per step: {flops / 1e9:.1f} ({unk} matrix ops without static shape)")
    print(f"  ours: precision pass alone {t_pass:.3f}s; report lp_flop_share="
          f"{rep.summary.get('lp_flop_share')}, casts_inserted={rep.summary.get('casts_inserted')}, "
          f"activation bytes {rep.summary.get('activation_bytes_before', 0) / 2**20:.0f} -> "
          f"{rep.summary.get('activation_bytes_after', 0) / 2**20:.0f} MiB")
    print(f"  grappler: OptimizeGraph AMP on {t_on:.3f}s, off {t_off:.3f}s (difference above)")
    goals = {"FLOP share >= 99%": s_ours >= 0.99, "casts <= grappler": c_ours <= c_gr,
             "time <= grappler": t_ours <= t_gr}
    print("  goals: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in goals.items()))
    return {"graph": name, "nodes": len(gd.node), "casts": (c_ours, c_gr), "share": (s_ours, s_gr),
            "time": (t_ours, t_gr)}


def _ratio(a, b):
    return f"{a / b:.2f}" if b else "n/a"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graphs", default="resnet50,bert")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bert-layers", type=int, default=12)
    args = ap.parse_args(argv)
    print(f"TensorFlow {tf.__version__}; TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16="
          f"{os.environ['TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16']}; grappler: only "
          "auto_mixed_precision_cpu on (remapper off)")
    results = []
    for name in args.graphs.split(","):
        if name == "resnet50":
            g, fetches = resnet50_training_graph()
            results.append(bench("ResNet50 + Momentum (training)", g, fetches, args.repeat))
        elif name == "bert":
            g, fetches = bert_training_graph(layers=args.bert_layers)
            results.append(bench(f"BERT-base-like ({args.bert_layers} layers) + Adam (training)",
                                 g, fetches, args.repeat))
        else:
            ap.error(f"--graphs: unknown graph '{name}'; accepted: resnet50, bert")
    return results


if __name__ == "__main__":
    main()
