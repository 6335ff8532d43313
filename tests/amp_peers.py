"""Run a TF1 graph through grappler the way a Session does, with TF's own AMP
or with npu_amp_tf, in this process, and count what came out.

* :func:`grappler_amp` -- grappler's ``auto_mixed_precision_cpu`` (the CPU form
  of ``auto_mixed_precision``: same lists, FP16) with
  ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16=0`` (otherwise grappler
  only *emulates* FP16 on CPU and keeps the ops FP32).  Works on TF 2.15 and
  2.21 alike.  The remapper is off in both runs (TF 2.15's aborts on some
  graphs; it is not what is compared).
* :func:`ours_session` -- the graph through ``npu_amp_tf.session_config()``
  (grappler's default passes, then NpuAmpOptimizer), as a Session would.
"""
import os

os.environ["TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16"] = "0"

import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

import npu_amp_tf  # noqa: E402

v1 = tf.compat.v1
RC = rewriter_config_pb2.RewriterConfig


def _metagraph(graph, fetches):
    with graph.as_default():
        mg = v1.train.export_meta_graph(graph_def=graph.as_graph_def(add_shapes=True),
                                        clear_devices=True, collection_list=[])
    for f in fetches:
        mg.collection_def["train_op"].node_list.value.append(f.split(":")[0])
    return mg


def _base_config(cfg=None):
    cfg = cfg or config_pb2.ConfigProto()
    ro = cfg.graph_options.rewrite_options
    ro.remapping = RC.OFF
    ro.min_graph_nodes = -1
    return cfg


def grappler_amp(graph, fetches, amp=True, iterations=None):
    """GraphDef after grappler's default passes (+ auto_mixed_precision_cpu)."""
    cfg = _base_config()
    ro = cfg.graph_options.rewrite_options
    ro.auto_mixed_precision_cpu = RC.ON if amp else RC.OFF
    if iterations:
        ro.meta_optimizer_iterations = iterations
    return tf_optimizer.OptimizeGraph(cfg, _metagraph(graph, fetches), graph_id=b"peer")


def ours_session(graph, fetches, iterations=None, **params):
    """GraphDef after grappler's default passes + NpuAmpOptimizer (session_config)."""
    params.setdefault("fail_on_error", True)
    cfg = _base_config(npu_amp_tf.session_config(**params))
    if iterations:
        cfg.graph_options.rewrite_options.meta_optimizer_iterations = iterations
    return tf_optimizer.OptimizeGraph(cfg, _metagraph(graph, fetches), graph_id=b"ours")


def count(gd, op="Cast"):
    n = sum(1 for x in gd.node if x.op == op)
    for f in gd.library.function:
        n += sum(1 for x in f.node_def if x.op == op)
    return n


def dtypes_of(gd, op, attr="T"):
    """{node name: dtype} of every ``op`` node (main graph)."""
    return {n.name: n.attr[attr].type for n in gd.node if n.op == op}
