"""Shared helpers for the fusion tests: build real TF graphs, rewrite, run both."""
from __future__ import annotations

from collections import Counter

import numpy as np
import tensorflow as tf

import npu_amp_tf.fused_ops  # noqa: F401  (loads LayerNorm / FusedAttention kernels)
import graph_passes.fusion  # noqa: F401  (registers the "fusion" pass)
from graph_passes.manager import run_passes

tf1 = tf.compat.v1


def opts(level=2, precision=None, **kw):
    """Real, validated Options.  ``precision`` None keeps the graph's dtypes
    (must_keep_origin_dtype), so only the fusion pass's own behaviour shows."""
    from npu_amp_tf.options import Options
    return Options.from_kwargs(graph_level=level, precision_mode=precision or "must_keep_origin_dtype",
                               _env=False, **kw)


def rewrite(gd, fetches, level=2, **kw):
    out, report = run_passes(gd, ["fusion"], options=opts(level, **kw), fetches=fetches, validate=True)
    return out, report


def op_counts(gd):
    return Counter(n.op for n in gd.node)


def run_gd(gd, fetches, feeds=None, init=None, steps=None):
    """Import ``gd`` into a fresh graph and run ``fetches`` (names) with feeds
    {name: value}.  ``init``: op name run first; ``steps``: (train_op, n) run before."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    cfg = tf1.ConfigProto()
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf1.Session(graph=g, config=cfg) as s:
        if init:
            s.run(init)
        feed = {(k if ":" in k else f"{k}:0"): v for k, v in (feeds or {}).items()}
        if steps:
            for _ in range(steps[1]):
                s.run(steps[0], feed)
        return s.run([f if ":" in f else f + ":0" for f in fetches], feed)


def freeze(fn, *specs):
    """Trace ``fn`` as a tf.function with TensorSpecs ``(shape, dtype, name)`` and
    freeze variables to constants (how Keras 3 / TF2 code reaches a GraphDef).
    Returns (graph_def, input names, output name)."""
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    cf = tf.function(fn).get_concrete_function(*[tf.TensorSpec(s, d, name=n) for s, d, n in specs])
    frozen = convert_variables_to_constants_v2(cf)
    gd = frozen.graph.as_graph_def()
    return gd, [t.name.split(":")[0] for t in frozen.inputs], frozen.outputs[0].name.split(":")[0]


def build(fn):
    """Run ``fn()`` inside a new v1 graph; returns (graph_def, fn's result)."""
    g = tf.Graph()
    with g.as_default():
        res = fn()
    return g.as_graph_def(), res
