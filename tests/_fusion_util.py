"""Shared helpers for the fusion tests: build real TF graphs, rewrite, run both."""
from __future__ import annotations

import types
from collections import Counter

import numpy as np
import tensorflow as tf

import npu_amp_tf.fused_ops  # noqa: F401  (loads LayerNorm / FusedAttention kernels)
import graph_passes.fusion  # noqa: F401  (registers the "fusion" pass)
from graph_passes.manager import run_passes

tf1 = tf.compat.v1


def opts(level=2, precision=None, low_dtype="float16", **kw):
    return types.SimpleNamespace(graph_level=level, precision=precision, low_dtype=low_dtype, **kw)


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
        feed = {f"{k}:0": v for k, v in (feeds or {}).items()}
        if steps:
            for _ in range(steps[1]):
                s.run(steps[0], feed)
        return s.run([f if ":" in f else f + ":0" for f in fetches], feed)


def build(fn):
    """Run ``fn()`` inside a new v1 graph; returns (graph_def, fn's result)."""
    g = tf.Graph()
    with g.as_default():
        res = fn()
    return g.as_graph_def(), res
