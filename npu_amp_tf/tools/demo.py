"""``npu-amp demo``: the plugin end to end on an embedded model.

A small MLP classifier (TF1 graph, raw ``tf.compat.v1`` layers) trains on a
fixed synthetic data set twice, in one process and from the same initial
weights:

* **FP32**: a plain ``Session`` and the bare optimizer;
* **AMP**: the ConfigProto entry (``npu_amp_tf.session_config(...)``, so
  grappler runs the rewrite) and ``npu_amp_tf.AMP_Optimizer`` (dynamic loss
  scaling, overflow skip, FP32 master weights).

It then prints the rewrite report the grappler pass wrote, the loss-scale
history (the dynamic scale starts deliberately high, so the first steps
overflow and the scale comes down, the way a real run finds its level) and
the two losses side by side.

Shapes are tiny on purpose: FP16 MatMul on this CPU has no native kernel
and is ~300x slower than FP32.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile

import numpy as np

DEFAULTS = dict(steps=14, batch=16, features=32, hidden=64, classes=10, lr=0.1, seed=0,
                init_loss_scale=2.0 ** 18, incr_every_n_steps=5)


@dataclasses.dataclass
class DemoResult:
    fp32_loss: list
    amp_loss: list
    loss_scale: list
    overflow: list
    history: list
    report: object
    report_graph: str | None

    def to_json(self):
        d = dataclasses.asdict(self)
        d["report"] = self.report.to_json() if self.report is not None else None
        return d


def _data(cfg):
    rng = np.random.default_rng(cfg["seed"])
    x = rng.standard_normal((cfg["batch"], cfg["features"])).astype(np.float32)
    w = rng.standard_normal((cfg["features"], cfg["classes"])).astype(np.float32)
    y = np.argmax(x @ w, axis=1).astype(np.int32)
    return x, y


def _weights(cfg):
    rng = np.random.default_rng(cfg["seed"] + 1)
    f, h, c = cfg["features"], cfg["hidden"], cfg["classes"]
    return {
        "w1": (rng.standard_normal((f, h)) * np.sqrt(2.0 / f)).astype(np.float32),
        "b1": np.zeros(h, np.float32),
        "w2": (rng.standard_normal((h, c)) * np.sqrt(1.0 / h)).astype(np.float32),
        "b2": np.zeros(c, np.float32),
    }


def build_model(cfg, amp: bool):
    """The embedded default model: x -> Dense+ReLU -> Dense -> softmax CE.
    Returns (graph, x, y, loss, train_op, amp_optimizer or None)."""
    import tensorflow as tf

    import npu_amp_tf

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [cfg["batch"], cfg["features"]], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [cfg["batch"]], name="y")
        init = _weights(cfg)
        v = {k: tf.compat.v1.get_variable(k, initializer=val) for k, val in init.items()}
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, v["w1"], name="dense1/MatMul"), v["b1"], name="dense1/BiasAdd"),
                       name="dense1/Relu")
        logits = tf.nn.bias_add(tf.matmul(h, v["w2"], name="dense2/MatMul"), v["b2"], name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        opt = tf.compat.v1.train.GradientDescentOptimizer(cfg["lr"])
        amp_opt = None
        if amp:
            amp_opt = npu_amp_tf.AMP_Optimizer(opt, init_loss_scale=cfg["init_loss_scale"],
                                               incr_every_n_steps=cfg["incr_every_n_steps"])
            opt = amp_opt
        gs = tf.compat.v1.train.get_or_create_global_step()
        train_op = opt.minimize(loss, global_step=gs)
    return g, x, y, loss, train_op, amp_opt


def run_demo(progress: bool = True, report_dir: str | None = None, **overrides) -> DemoResult:
    import tensorflow as tf
    from tqdm import tqdm

    import npu_amp_tf
    from graph_passes.report import Report

    cfg = dict(DEFAULTS, **overrides)
    xs, ys = _data(cfg)
    own_dir = report_dir is None
    report_dir = report_dir or tempfile.mkdtemp(prefix="npu-amp-demo-")

    # ---- FP32
    g, x, y, loss, train_op, _ = build_model(cfg, amp=False)
    fp32 = []
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in tqdm(range(cfg["steps"]), desc="FP32 training", unit="step", disable=not progress, leave=False):
            lv, _ = sess.run([loss, train_op], {x: xs, y: ys})
            fp32.append(float(lv))

    # ---- AMP through the ConfigProto entry
    g, x, y, loss, train_op, amp_opt = build_model(cfg, amp=True)
    config = npu_amp_tf.session_config(precision_mode="allow_mix_precision", report_path=report_dir)
    amp, scales, overflow = [], [], []
    with g.as_default():
        scale_t = amp_opt.get_loss_scale()
    manager = amp_opt.loss_scale_manager
    with tf.compat.v1.Session(graph=g, config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in tqdm(range(cfg["steps"]), desc="AMP training ", unit="step", disable=not progress, leave=False):
            before = len(manager.history)
            s = sess.run(scale_t)
            lv, _ = sess.run([loss, train_op], {x: xs, y: ys})
            events = manager.history[before:]
            amp.append(float(lv))
            scales.append(float(s))
            overflow.append(any(e.overflow for e in events))
    history = [tuple(e) for e in manager.history]
    report, name = _pick_report(report_dir, Report)
    if own_dir:
        for f in glob.glob(os.path.join(report_dir, "*")):
            os.remove(f)
        os.rmdir(report_dir)
    return DemoResult(fp32, amp, scales, overflow, history, report, name)


def _pick_report(report_dir, Report):
    """The report of the training graph: the one with the most decisions and,
    among grappler's repeated calls on it, the call that inserted the casts."""
    best, best_n, name = None, (-1, -1), None
    for path in sorted(glob.glob(os.path.join(report_dir, "*.json"))):
        try:
            with open(path, encoding="utf-8") as fh:
                r = Report.from_json(json.load(fh))
        except (OSError, ValueError):
            continue
        n = (len(r.decisions), r.summary.get("casts_inserted") or 0)
        if n > best_n:
            best, best_n, name = r, n, os.path.basename(path)
    return best, name


def format_result(res: DemoResult) -> str:
    from .report import format_report

    lines = ["npu-amp demo: an MLP trained on synthetic data, once in FP32 and once with the plugin",
             "(session_config(precision_mode='allow_mix_precision') + AMP_Optimizer, dynamic loss scale)",
             "",
             "== rewrite report (written by the grappler pass"
             + (f", {res.report_graph}" if res.report_graph else "") + ")"]
    if res.report is not None:
        lines.append(format_report(res.report, only_lists=("white", "black", "gray")))
    else:
        lines.append("(no report was written: the plugin did not run in grappler)")
    lines.append("")
    lines.append("== loss-scale history (step, scale, overflow)")
    if res.history:
        for step, scale, ovf in res.history:
            lines.append(f"  step {step:>3}  scale {scale:>10g}  {'OVERFLOW, update skipped' if ovf else 'scale raised'}")
    else:
        lines.append("  (no events: no overflow and no scale change)")
    lines.append("")
    lines.append("== loss, side by side")
    lines.append(f"  {'step':>4}  {'FP32 loss':>10}  {'AMP loss':>10}  {'loss scale':>11}  note")
    for i, (a, b, s, o) in enumerate(zip(res.fp32_loss, res.amp_loss, res.loss_scale, res.overflow)):
        lines.append(f"  {i:>4}  {a:>10.5f}  {b:>10.5f}  {s:>11g}  {'overflow: step skipped' if o else ''}")
    lines.append(f"  final: FP32 {res.fp32_loss[-1]:.5f}  AMP {res.amp_loss[-1]:.5f}")
    return "\n".join(lines)
