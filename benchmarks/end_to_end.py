"""End-to-end BF16 training throughput: this plugin vs TF's own mixed precision.

Models (training steps, synthetic fixed batch, same initial weights in every
configuration):
  slim_resnet50     TF-Slim ``resnet_v1_50`` in a TF1 Session, Momentum;
  keras_resnet50    ``keras.applications.ResNet50(weights=None)`` called in a
                    TF1 graph (Keras 2: tf.keras on 2.15, tf_keras on 2.21), Momentum;
  keras_fit         the same Keras ResNet-50 trained by ``model.train_on_batch``
                    (the ``fit`` train function) in TF2, SGD with momentum;
  bert              a BERT-base-like encoder from raw ops (hidden 768, 12 heads,
                    FFN 3072, erf-GELU, moments LayerNorm) with Adam, in a TF1
                    Session.  ``--bert-layers`` layers (default 2; BERT-base has 12).

Configurations:
  fp32      stock TF (grappler defaults, remapper on);
  grappler  ``rewrite_options.auto_mixed_precision_onednn_bfloat16 = ON``
            (TF2: ``tf.config.optimizer.set_experimental_options``);
  keras     Keras ``mixed_bfloat16`` policy (keras_fit only);
  ours      ``npu_amp_tf`` ``precision_mode="allow_mix_precision_bf16"``,
            ``graph_level=2`` (``session_config`` / ``enable``).

Every configuration of a model is built first, then timed steps are
interleaved round-robin in this one process (median step time per
configuration), so machine load hits them alike.  The loss after the last
step (``warmup + rounds*steps`` steps from the same start) is compared with
FP32's.  One extra step per session configuration is traced and summarized
by ``npu_amp_tf.tools.profile.summarize`` (the ``npu-amp profile`` code):
BF16 compute share and Cast share of op time.

Prints the CPU's BF16/AMX flags; where they are absent the speed goals
(ours >= 1.8x FP32, >= 1.0x the best of grappler/Keras) do not apply.
Never asserts a time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2  # noqa: E402

import npu_amp_tf  # noqa: E402
from npu_amp_tf.tools import profile as _profile  # noqa: E402

tf1 = tf.compat.v1
MODE = "allow_mix_precision_bf16"


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return []
    want = ("avx512_bf16", "amx_bf16", "amx_tile", "amx_fp16", "avx512f", "avx512_fp16")
    return [f for f in want if re.search(rf"\b{f}\b", text)]


def session_configs():
    g = config_pb2.ConfigProto()
    g.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = rewriter_config_pb2.RewriterConfig.ON
    return {"fp32": config_pb2.ConfigProto(), "grappler": g,
            "ours": npu_amp_tf.session_config(precision_mode=MODE, graph_level=2)}


# ------------------------------------------------------------------ models (TF1 graphs)
def build_slim_resnet(batch, size, classes):
    from real_models import import_slim

    import_slim()
    from tf_slim.nets import resnet_v1

    x = tf1.placeholder(tf.float32, [batch, size, size, 3], name="images")
    y = tf1.placeholder(tf.int32, [batch], name="labels")
    logits, _ = resnet_v1.resnet_v1_50(x, num_classes=classes, is_training=True, global_pool=True)
    logits = tf.reshape(logits, [batch, classes])
    loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    upd = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(upd):
        train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
    return x, y, loss, train


def _keras2():
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 16):
        import tf_keras
        return tf_keras
    return tf.keras


def build_keras_resnet(batch, size, classes):
    K = _keras2()
    x = tf1.placeholder(tf.float32, [batch, size, size, 3], name="images")
    y = tf1.placeholder(tf.int32, [batch], name="labels")
    K.backend.set_learning_phase(1)  # BatchNorm in training mode, built on x itself
    model = K.applications.ResNet50(weights=None, input_tensor=x, classes=classes)
    logits = model.output
    loss = tf.reduce_mean(K.losses.sparse_categorical_crossentropy(y, logits))
    with tf.control_dependencies(model.updates):
        train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, var_list=model.trainable_weights)
    return x, y, loss, train


def build_bert(batch, seq, layers, hidden=768, heads=12, ffn=3072, classes=2):
    D = hidden // heads
    x = tf1.placeholder(tf.float32, [batch, seq, hidden], name="embeddings")
    y = tf1.placeholder(tf.int32, [batch], name="labels")
    init = tf1.truncated_normal_initializer(stddev=0.02)

    def dense(t, n, name):
        w = tf1.get_variable(name + "/kernel", [t.shape[-1], n], initializer=init)
        b = tf1.get_variable(name + "/bias", [n], initializer=tf1.zeros_initializer())
        return tf.nn.bias_add(tf.matmul(t, w), b)

    def layer_norm(t, name):
        g = tf1.get_variable(name + "/gamma", [hidden], initializer=tf1.ones_initializer())
        b = tf1.get_variable(name + "/beta", [hidden], initializer=tf1.zeros_initializer())
        mean, var = tf.nn.moments(t, [-1], keepdims=True)
        return tf.nn.batch_normalization(t, mean, var, b, g, 1e-12)

    def split(t):
        return tf.transpose(tf.reshape(t, [batch, seq, heads, D]), [0, 2, 1, 3])

    h = tf.reshape(x, [batch * seq, hidden])
    for i in range(layers):
        with tf1.variable_scope(f"layer_{i}"):
            q, k, v = (split(dense(h, hidden, n)) for n in ("q", "k", "v"))
            s = tf.matmul(q, k, transpose_b=True) * (1.0 / np.sqrt(D))
            c = tf.matmul(tf.nn.softmax(s), v)
            c = tf.reshape(tf.transpose(c, [0, 2, 1, 3]), [batch * seq, hidden])
            h = layer_norm(dense(c, hidden, "attn_out") + h, "ln1")
            f = dense(h, ffn, "ffn1")
            f = 0.5 * f * (1.0 + tf.math.erf(f / np.sqrt(2.0)))
            h = layer_norm(dense(f, hidden, "ffn2") + h, "ln2")
    pooled = tf.reshape(h, [batch, seq, hidden])[:, 0]
    logits = dense(pooled, classes, "cls")
    loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    train = tf1.train.AdamOptimizer(1e-4).minimize(loss)
    return x, y, loss, train


# ------------------------------------------------------------------ runners
class SessionRunner:
    """One TF1 graph, one Session per configuration (same seed: same init)."""

    def __init__(self, build, args, feeds_fn, cfgs):
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf1.set_random_seed(1)
            self.x, self.y, self.loss, self.train = build()
            init = tf1.global_variables_initializer()
        self.feeds = feeds_fn(self.x, self.y)
        self.sessions = {}
        for name, cfg in cfgs.items():
            s = tf1.Session(graph=self.graph, config=cfg)
            s.run(init)
            self.sessions[name] = s
        self.last_loss = {}

    def step(self, name):
        lv, _ = self.sessions[name].run([self.loss, self.train], self.feeds)
        self.last_loss[name] = float(lv)

    def profile(self, name):
        md = tf1.RunMetadata()
        self.sessions[name].run(self.train, self.feeds,
                                options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
                                run_metadata=md)
        return _profile.summarize([md.step_stats])

    def close(self):
        for s in self.sessions.values():
            s.close()


class FitRunner:
    """Keras ResNet-50 ``train_on_batch`` per configuration (TF2 functions)."""

    def __init__(self, args):
        K = tf.keras
        rng = np.random.RandomState(0)
        self.xb = rng.uniform(-1, 1, [args.batch, args.size, args.size, 3]).astype(np.float32)
        self.yb = rng.randint(0, args.classes, [args.batch]).astype(np.int32)
        self.models, self.last_loss, self.notes = {}, {}, {}
        w0 = None
        for name in ("fp32", "grappler", "keras", "ours"):
            try:
                if name == "grappler":
                    tf.config.optimizer.set_experimental_options({"auto_mixed_precision_onednn_bfloat16": True})
                elif name == "keras":
                    K.mixed_precision.set_global_policy("mixed_bfloat16")
                elif name == "ours":
                    npu_amp_tf.enable(precision_mode=MODE, graph_level=2)
                tf.random.set_seed(1)
                m = K.applications.ResNet50(weights=None, input_shape=(args.size, args.size, 3),
                                            classes=args.classes)
                if w0 is None:
                    w0 = m.get_weights()
                else:
                    m.set_weights(w0)
                m.compile(K.optimizers.SGD(0.01, momentum=0.9), "sparse_categorical_crossentropy")
                m.train_on_batch(self.xb, self.yb)  # instantiates the train function in this config
                self.models[name] = m
            except Exception as exc:  # noqa: BLE001 - report a configuration that TF refuses
                self.notes[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
            finally:
                if name == "grappler":
                    tf.config.optimizer.set_experimental_options({"auto_mixed_precision_onednn_bfloat16": False})
                elif name == "keras":
                    K.mixed_precision.set_global_policy("float32")
                elif name == "ours":
                    npu_amp_tf.disable()
        self.sessions = self.models

    @staticmethod
    def activate(name):
        """TF instantiates a function per call-time config: keep each config's
        rewrite options active for its own steps, not only while building."""
        tf.config.optimizer.set_experimental_options({"auto_mixed_precision_onednn_bfloat16": name == "grappler"})
        if name == "ours":
            npu_amp_tf.enable(precision_mode=MODE, graph_level=2)
        else:
            npu_amp_tf.disable()

    def step(self, name):
        self.activate(name)
        out = self.models[name].train_on_batch(self.xb, self.yb)
        self.last_loss[name] = float(out[0] if isinstance(out, (list, tuple)) else out)

    def profile(self, name):
        return None

    def close(self):
        pass


def measure(runner, warmup, rounds, steps):
    names = list(runner.sessions)
    for name in names:
        for _ in range(warmup):
            runner.step(name)
    times = {n: [] for n in names}
    for _ in range(rounds):
        for name in names:
            t0 = time.perf_counter()
            for _ in range(steps):
                runner.step(name)
            times[name].append((time.perf_counter() - t0) / steps)
    return {n: statistics.median(v) for n, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="slim_resnet50,keras_resnet50,keras_fit,bert")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--bert-layers", type=int, default=2)
    ap.add_argument("--bert-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)

    flags = cpu_flags()
    bf16_units = any(f in flags for f in ("avx512_bf16", "amx_bf16"))
    print(f"TF {tf.__version__}; CPU flags: {', '.join(flags) or 'none'}")
    if not bf16_units:
        print("this CPU has no BF16 units (avx512_bf16 / amx_bf16): the speed goals do not apply here")
    rng = np.random.RandomState(0)

    def img_feeds(x, y):
        return {x: rng.uniform(-1, 1, x.shape.as_list()).astype(np.float32),
                y: rng.randint(0, args.classes, y.shape.as_list()).astype(np.int32)}

    def bert_feeds(x, y):
        return {x: rng.normal(0, 1, x.shape.as_list()).astype(np.float32),
                y: rng.randint(0, 2, y.shape.as_list()).astype(np.int32)}

    rows = []
    for model in args.models.split(","):
        t0 = time.perf_counter()
        if model == "slim_resnet50":
            r = SessionRunner(lambda: build_slim_resnet(args.batch, args.size, args.classes), args, img_feeds,
                              session_configs())
        elif model == "keras_resnet50":
            r = SessionRunner(lambda: build_keras_resnet(args.batch, args.size, args.classes), args, img_feeds,
                              session_configs())
        elif model == "keras_fit":
            r = FitRunner(args)
        elif model == "bert":
            r = SessionRunner(lambda: build_bert(args.bert_batch, args.seq, args.bert_layers), args, bert_feeds,
                              session_configs())
        else:
            raise SystemExit(f"unknown model {model!r}")
        med = measure(r, args.warmup, args.rounds, args.steps)
        n_steps = args.warmup + args.rounds * args.steps
        prof = {n: r.profile(n) for n in ("grappler", "ours") if n in r.sessions}
        base = med.get("fp32")
        peers = [med[n] for n in ("grappler", "keras") if n in med]
        for name, sec in med.items():
            p = prof.get(name) or {}
            rows.append({
                "model": model, "config": name, "step_s": sec,
                "speedup_vs_fp32": base / sec if base else None,
                "ours_vs_best_peer": (min(peers) / sec) if name == "ours" and peers else None,
                "loss": r.last_loss.get(name), "loss_steps": n_steps,
                "loss_rel_diff": (abs(r.last_loss[name] - r.last_loss["fp32"]) / abs(r.last_loss["fp32"])
                                  if "fp32" in r.last_loss and name in r.last_loss else None),
                "bf16_share": p.get("lp_compute_share"), "cast_share": p.get("cast_transdata_share"),
            })
        for name, note in getattr(r, "notes", {}).items():
            rows.append({"model": model, "config": name, "error": note})
        r.close()
        print(f"[{model}: {time.perf_counter() - t0:.0f} s]", flush=True)

    print(f"\n{'model':15s} {'config':9s} {'step ms':>8s} {'x FP32':>7s} {'x best peer':>11s} "
          f"{'loss':>8s} {'dloss':>7s} {'BF16 share':>10s} {'Cast share':>10s}")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for row in rows:
        if "error" in row:
            print(f"{row['model']:15s} {row['config']:9s} not run: {row['error']}")
            continue
        print(f"{row['model']:15s} {row['config']:9s} {row['step_s'] * 1e3:8.0f} "
              f"{fmt(row['speedup_vs_fp32'], '7.2f')} {fmt(row['ours_vs_best_peer'], '11.2f')} "
              f"{fmt(row['loss'], '8.4f')} {fmt(row['loss_rel_diff'], '7.2%')} "
              f"{fmt(row['bf16_share'], '10.1%')} {fmt(row['cast_share'], '10.1%')}")
    print(f"(loss after {args.warmup + args.rounds * args.steps} steps from the same start; "
          f"goals: ours >= 1.8x FP32 and >= 1.0x best peer on BF16 CPUs, |dloss| <= 2%, Cast share < 15%)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"tf": tf.__version__, "cpu_flags": flags, "args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
