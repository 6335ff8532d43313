"""Precision on real model code vs grappler's own AMP, and one training step
vs FP32 (issue 13).  Same graph, same process, side by side:

  * casts: our pipeline through ``npu_amp_tf.session_config()`` vs grappler's
    ``auto_mixed_precision_cpu`` (TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16=0),
    both after grappler's stock passes, remapper off (tests/amp_peers.py);
  * low-precision share of matrix/conv FLOPs (our report);
  * the loss after ONE training step (Momentum), FP32 Session vs our Session,
    same initial weights (graph seed).

Models: Keras ResNet-50 and MobileNet (weights=None) in a TF1 graph with
Keras's learning-phase placeholder (every BatchNorm under a lowered cond),
TF-Slim resnet_v1_50, and TF's split -> 3 convs -> concat case.  Tiny inputs
(FP16 runs ~130x slower than FP32 on TF 2.15 CPU kernels).  Prints a table;
asserts nothing.

    python benchmarks/precision_real.py [--models resnet50,mobilenet,slim_resnet,fanout]

``--applications DenseNet121,EfficientNetB0,... --mode bf16|fp16 [--size 96 --batch 8]``
instead checks Keras 2 applications (``weights=None``, 10 classes; ``tf_keras`` on TF >= 2.16)
in TF1 graphs, one SGD step each in its own subprocess: FP32, ours and grappler's peer
(``auto_mixed_precision_onednn_bfloat16`` for bf16, ``auto_mixed_precision_cpu`` for fp16) in
three sessions with the **same initial weights** (the first session's values assigned in the
others: Keras's unseeded initializers differ between builds), run in that order so that a peer
that kills its process still leaves ours' figures.  Per model: the forward loss of each, and
the step's weight update against FP32's (cosine, and the norm of the difference over FP32's).
``--peer-emulate`` leaves grappler's FP16 emulation on the CPU at TF's default (on; the other
rows turn it off as tests/amp_peers.py does).

``--saved-model 224,8[,1.0]`` instead measures the offline path on a Keras
MobileNetV2 SavedModel (``model.save``: one function per layer) at that input
size, batch and width: casts of ``npu-amp report`` / ``rewrite`` (calls inlined
first, npu_amp_tf/inline.py) vs the bodies rewritten one by one (the old
offline behaviour) vs the session path (``enable()`` + ``model.predict``,
same model, same process); the estimated activation memory before -> after;
the FP16 count the HTML map draws.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import amp_peers as P  # noqa: E402  (sets the grappler emulation env var)

if os.environ.get("NPU_AMP_TF_PEER_EMULATE") == "1":  # --peer-emulate: TF's default back (read
    os.environ["TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16"] = "1"  # when the pass runs)
import npu_amp_tf  # noqa: E402
from conftest import keras2  # noqa: E402

v1 = tf.compat.v1


def _keras(app, **kw):
    k = keras2()
    g = tf.Graph()
    g.seed = 0
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 32, 32, 3], name="images")
        y = v1.placeholder(tf.int32, [2], name="labels")
        model = getattr(k.applications, app)(weights=None, input_tensor=x, classes=10, **kw)
        logits = model.output.op.inputs[0]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        with tf.control_dependencies(model.updates):
            train = v1.train.MomentumOptimizer(0.01, 0.9).minimize(
                loss, var_list=model.trainable_weights, name="train")
        init = v1.global_variables_initializer()
        feeds = {x: np.random.RandomState(0).rand(2, 32, 32, 3).astype(np.float32),
                 y: np.array([1, 3]), k.backend.learning_phase(): True}
    return g, loss, train, init, feeds


def slim_resnet():
    from real_models import import_slim
    slim = import_slim()
    from tf_slim.nets import resnet_v1
    g = tf.Graph()
    g.seed = 0
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 64, 64, 3], name="images")
        y = v1.placeholder(tf.int32, [4], name="labels")
        with slim.arg_scope(resnet_v1.resnet_arg_scope()):
            logits, _ = resnet_v1.resnet_v1_50(x, num_classes=10, is_training=True, global_pool=True)
        logits = tf.reshape(logits, [4, 10])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            train = v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, name="train")
        init = v1.global_variables_initializer()
        feeds = {x: np.random.RandomState(0).rand(4, 64, 64, 3).astype(np.float32), y: np.array([1, 3, 5, 7])}
    return g, loss, train, init, feeds


def fanout():
    rng = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 16, 16, 6], name="x")
        outs = []
        for i, part in enumerate(tf.split(x, 3, axis=3)):
            w = v1.get_variable(f"w{i}", initializer=rng.randn(3, 3, 2, 8).astype(np.float32) * 0.3)
            outs.append(tf.nn.conv2d(part, w, 1, "SAME"))
        loss = tf.reduce_mean(tf.square(tf.concat(outs, 3)), name="loss")
        train = v1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train")
        init = v1.global_variables_initializer()
    return g, loss, train, init, {x: rng.randn(2, 16, 16, 6).astype(np.float32)}


MODELS = {
    "resnet50": ("Keras ResNet50, TF1 + learning phase, Momentum", lambda: _keras("ResNet50")),
    "mobilenet": ("Keras MobileNet a=0.25, TF1 + learning phase", lambda: _keras("MobileNet", alpha=0.25)),
    "slim_resnet": ("TF-Slim resnet_v1_50, is_training, 4x64x64", slim_resnet),
    "fanout": ("split -> 3 convs -> concat (TF's AMP test shape)", fanout),
}


def step_loss(g, loss, train, init, feeds, config):
    with v1.Session(graph=g, config=config) as s:
        s.run(init)
        l0 = s.run([loss, train], feeds)[0]
        t0 = time.perf_counter()
        l1 = s.run(loss, feeds)
        return l0, l1, time.perf_counter() - t0


def saved_model_row(hw: int, batch: int, alpha: float):
    import tempfile

    from npu_amp_tf.options import Options
    from npu_amp_tf.pipeline import optimize
    from npu_amp_tf.tools import model_io
    from npu_amp_tf.tools.report import write_html

    k = keras2()
    tf.keras.utils.set_random_seed(0)
    inp = k.Input(batch_shape=(batch, hw, hw, 3), name="images")
    model = k.applications.MobileNetV2(weights=None, alpha=alpha, input_tensor=inp)
    d = tempfile.mkdtemp(prefix="mnv2_saved_")
    t0 = time.perf_counter()
    model.save(os.path.join(d, "sm"))
    print(f"MobileNetV2 a={alpha} {batch}x{hw}x{hw} saved with model.save in {time.perf_counter() - t0:.0f} s",
          flush=True)
    m = model_io.load_model(os.path.join(d, "sm"))
    opts = Options.from_kwargs(_groups=("rewrite",))
    res = {}
    for label, gd in (("bodies one by one (before)", m.graph_def),
                      ("calls inlined (report / rewrite)", model_io.inlined_graph_def(m))):
        t0 = time.perf_counter()
        out, rep = optimize(gd, opts, fetches=m.fetch_nodes, preserve=m.preserve_nodes())
        s = rep.summary
        counts = write_html(rep, out, os.path.join(d, "map.html"), model=m)
        res[label] = (s["casts_inserted"] + s.get("functions_casts_inserted", 0),
                      s.get("activation_bytes_before"), s.get("activation_bytes_after"),
                      s.get("activation_bytes_sum_before"), s.get("activation_bytes_sum_after"),
                      counts["float16"], time.perf_counter() - t0)
        print(label, res[label], flush=True)
    npu_amp_tf.bridge.clear_reports()
    x = np.random.RandomState(0).rand(batch, hw, hw, 3).astype(np.float32)
    npu_amp_tf.enable()
    t0 = time.perf_counter()
    model.predict(x, batch_size=batch, verbose=0)
    npu_amp_tf.disable()
    reps = [r for r in npu_amp_tf.bridge.last_reports()
            if "predict_function" in r["graph"] and r["status"] == "rewritten"]
    ss = reps[0]["report"]["summary"]
    session = ss["casts_inserted"] + ss.get("functions_casts_inserted", 0)
    print(f"session path (enable() + predict, {time.perf_counter() - t0:.0f} s): {session} casts", flush=True)
    mib = 2.0 ** 20
    print(f"\n| MobileNetV2 a={alpha} SavedModel, {batch}x{hw}x{hw}, TF {tf.__version__} | casts (session "
          f"path: {session}) | activation peak est. before -> after | activation sum before -> after "
          f"| FP16 ops drawn in the map |")
    print("|---|---|---|---|---|")
    for label, (c, pb, pa, sb, sa, n16, _) in res.items():
        print(f"| {label} | {c} ({(c - session) / session:+.0%}) | {pb / mib:.1f} -> {pa / mib:.1f} MiB "
              f"| {sb / mib:.1f} -> {sa / mib:.1f} MiB | {n16} |")


#: --applications' default list (Keras 2 applications that build at 96x96)
APPLICATIONS = ("DenseNet121,EfficientNetB0,InceptionV3,Xception,MobileNetV2,MobileNetV3Small,"
                "ConvNeXtTiny,RegNetX002,VGG16,ResNet50V2,EfficientNetV2B0,NASNetMobile")
_PEER_FLAG = {"bf16": "auto_mixed_precision_onednn_bfloat16", "fp16": "auto_mixed_precision_cpu"}
_PRECISION_MODE = {"bf16": "allow_mix_precision_bf16", "fp16": "allow_mix_precision"}


def application_step(name: str, mode: str, size: int, batch: int):
    """One application (see the module docstring): prints one ``ROW`` line of
    JSON after ours, and again with the peer's figures after the peer."""
    import json

    k = keras2()
    g = tf.Graph()
    g.seed = 0
    with g.as_default():
        x = v1.placeholder(tf.float32, [batch, size, size, 3], name="images")
        y = v1.placeholder(tf.int32, [batch], name="labels")
        model = getattr(k.applications, name)(weights=None, classes=10, input_shape=(size, size, 3))
        probs = model(x, training=True)
        loss = tf.reduce_mean(k.losses.sparse_categorical_crossentropy(y, probs), name="loss")
        train = v1.train.GradientDescentOptimizer(1e-3).minimize(
            loss, var_list=model.trainable_weights, name="train")
        init = v1.global_variables_initializer()
        holders = [v1.placeholder(w.dtype.base_dtype, w.shape) for w in model.weights]
        assign = tf.group(*[w.assign(h) for w, h in zip(model.weights, holders)])
    rng = np.random.RandomState(0)
    feeds = {x: rng.rand(batch, size, size, 3).astype(np.float32), y: np.arange(batch) % 10}
    trainable = [i for i, w in enumerate(model.weights) if any(w is t for t in model.trainable_weights)]
    peer = P._base_config()
    setattr(peer.graph_options.rewrite_options, _PEER_FLAG[mode], P.RC.ON)
    configs = [("fp32", P._base_config()),
               ("ours", P._base_config(npu_amp_tf.session_config(precision_mode=_PRECISION_MODE[mode],
                                                                 fail_on_error=True))),
               ("peer", peer)]
    start, row, update = None, {"model": name}, {}
    for label, cfg in configs:
        with v1.Session(graph=g, config=cfg) as s:
            s.run(init)
            if start is None:
                start = s.run(model.weights)
            else:
                s.run(assign, dict(zip(holders, start)))
            row[label + "_loss"] = float(s.run([loss, train], feeds)[0])
            after = s.run([model.weights[i] for i in trainable])
        update[label] = np.concatenate([(a - start[i]).ravel().astype(np.float64)
                                        for a, i in zip(after, trainable)])
        if label != "fp32":
            ref = update["fp32"]
            d = update[label]
            row[label + "_cos"] = float(d @ ref / (np.linalg.norm(d) * np.linalg.norm(ref) + 1e-300))
            row[label + "_rel"] = float(np.linalg.norm(d - ref) / (np.linalg.norm(ref) + 1e-300))
            print("ROW " + json.dumps(row), flush=True)


def applications(names: str, mode: str, size: int, batch: int, emulate: bool):
    """Each application of ``names`` in its own subprocess (a crash is a row)."""
    import json
    import signal
    import subprocess

    env = dict(os.environ)
    if emulate:
        env["NPU_AMP_TF_PEER_EMULATE"] = "1"
    rows = []
    for name in names.split(","):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name, "--mode", mode,
                               "--size", str(size), "--batch", str(batch)],
                              env=env, capture_output=True, text=True, timeout=1800)
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        row = got[-1] if got else {"model": name}
        if proc.returncode != 0:
            rc = proc.returncode
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
            where = "the peer" if "ours_loss" in row else "before ours' figures"
            row["status"] = f"{how} in {where}"
            if not got:
                row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
        rows.append(row)
        print(json.dumps(row), flush=True)

    def fmt(row, key, spec):
        v = row.get(key)
        return "—" if v is None else format(v, spec)

    print(f"\n| {mode}, {size}x{size}, batch {batch}, TF {tf.__version__} | forward loss FP32 / ours / "
          f"peer | update cosine with FP32's, ours / peer | update error, ours / peer | notes |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {fmt(r, 'fp32_loss', '.4f')} / {fmt(r, 'ours_loss', '.4f')} / "
              f"{fmt(r, 'peer_loss', '.4f')} | {fmt(r, 'ours_cos', '.3f')} / {fmt(r, 'peer_cos', '.3f')} | "
              f"{fmt(r, 'ours_rel', '.3f')} / {fmt(r, 'peer_rel', '.3f')} | "
              f"{r.get('status', '')} {r.get('error', '')} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--saved-model", default=None, metavar="HW,BATCH[,ALPHA]")
    ap.add_argument("--applications", nargs="?", const=APPLICATIONS, default=None, metavar="NAMES")
    ap.add_argument("--mode", choices=sorted(_PEER_FLAG), default="bf16")
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--peer-emulate", action="store_true",
                    help="grappler's FP16 emulation on the CPU left at TF's default (on)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        application_step(args.one, args.mode, args.size, args.batch)
        return
    if args.applications:
        applications(args.applications, args.mode, args.size, args.batch, args.peer_emulate)
        return
    if args.saved_model:
        parts = args.saved_model.split(",")
        saved_model_row(int(parts[0]), int(parts[1]), float(parts[2]) if len(parts) > 2 else 1.0)
        return
    rows = []
    for key in args.models.split(","):
        title, build = MODELS[key]
        g, loss, train, init, feeds = build()
        fetches = [loss.op.name, train.name]
        peer = P.grappler_amp(g, fetches)
        npu_amp_tf.bridge.clear_reports()
        ours = P.ours_session(g, fetches)
        rep = [r for r in npu_amp_tf.bridge.last_reports() if r["status"] == "rewritten"][0]["report"]
        share = rep["summary"].get("lp_flop_share")
        l32 = step_loss(g, loss, train, init, feeds, P._base_config())
        l16 = step_loss(g, loss, train, init, feeds,
                        P._base_config(npu_amp_tf.session_config(fail_on_error=True)))
        cg = P._base_config()
        cg.graph_options.rewrite_options.auto_mixed_precision_cpu = P.RC.ON
        lg = step_loss(g, loss, train, init, feeds, cg)
        rows.append((title, P.count(ours), P.count(peer), share, l32[1], l16[1], lg[1]))
        print(f"{title}: casts {P.count(ours)} / grappler {P.count(peer)}; lp FLOP share "
              f"{share:.1%}; loss before {l32[0]:.4f} / {l16[0]:.4f} / {lg[0]:.4f}, after one step "
              f"{l32[1]:.4f} (FP32) / {l16[1]:.4f} (ours) / {lg[1]:.4f} (grappler)", flush=True)
    print("\n| model | casts ours / grappler | low-precision FLOP share | loss after one step FP32 / ours / grappler AMP |")
    print("|---|---|---|---|")
    for t, a, b, sh, x, y, z in rows:
        print(f"| {t} | {a} / {b} | {sh:.1%} | {x:.4f} / {y:.4f} / {z:.4f} |")


if __name__ == "__main__":
    main()
