"""User-facing precision helpers: ``keep_dtype_scope`` (CANN's
``npu_scope.keep_dtype_scope``) and ``rewrite_graph``.

Ops built inside ``keep_dtype_scope()`` carry the node attr ``_keep_dtype``
(an int 1, as CANN writes it); the ``precision`` pass never converts them::

    with npu_amp_tf.keep_dtype_scope():
        logits = tf.matmul(h, w)        # stays FP32 whatever the lists say

Works for TF1 graphs and inside ``tf.function`` (the scope applies to the
graph being built).  Eager ops are not graph nodes and are unaffected.
"""
from __future__ import annotations

import contextlib

from .pipeline import rewrite_graph  # noqa: F401  (re-exported)

KEEP_DTYPE_ATTR = "_keep_dtype"


@contextlib.contextmanager
def keep_dtype_scope():
    """Mark every op created inside the block with ``_keep_dtype`` (never converted).

    TensorFlow has no public API that adds a node attr to every op built in a
    block; this uses :func:`npu_amp_tf._tf.attr_scope` (``Graph._attr_scope``,
    for ``tf.Graph`` and ``tf.function`` FuncGraphs alike; tested by
    tests/test_precision.py and tests/test_loss_scale_fp32.py).
    """
    import tensorflow as tf
    from tensorflow.core.framework import attr_value_pb2

    from . import _tf

    graph = tf.compat.v1.get_default_graph()
    with _tf.attr_scope(graph, {KEEP_DTYPE_ATTR: attr_value_pb2.AttrValue(i=1)}):
        yield


__all__ = ["keep_dtype_scope", "rewrite_graph", "KEEP_DTYPE_ATTR"]
