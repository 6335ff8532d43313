"""`make bazel-check`: the Bazel-built library loads into TensorFlow, registers
the custom ops and the grappler optimizer, and the optimizer rewrites a
session graph (MatMul runs in FP16).  Run with NPU_AMP_TF_LIBRARY pointing at
bazel-bin/libnpu_amp_tf.so."""
import os
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

import npu_amp_tf
from npu_amp_tf import _loader

lib = os.environ.get("NPU_AMP_TF_LIBRARY", "")
assert lib and os.path.samefile(_loader.library_path(), lib), (_loader.library_path(), lib)
missing = [op for op in ("TransData", "LayerNorm", "LayerNormGrad", "FusedAttention")
           if op_def_registry.get(op) is None]
assert not missing, f"ops not registered by {lib}: {missing}"

g = tf.Graph()
with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
    # four nodes at least: grappler's meta-optimizer skips smaller graphs
    y = tf.nn.relu(tf.matmul(x, tf.constant(np.eye(3, 4, dtype=np.float32))), name="y")
with tf.compat.v1.Session(graph=g, config=npu_amp_tf.session_config()) as s:
    rm = tf.compat.v1.RunMetadata()
    out = s.run(y, {x: np.ones([2, 3], np.float32)}, run_metadata=rm,
                options=tf.compat.v1.RunOptions(output_partition_graphs=True))
mm = [n.attr["T"].type for pg in rm.partition_graphs for n in pg.node if n.op.endswith("MatMul")]
assert mm == [tf.float16.as_datatype_enum], mm
np.testing.assert_array_equal(out, np.ones([2, 3]) @ np.eye(3, 4))
print(f"bazel ok: {lib} (TF {tf.__version__}): ops registered, NpuAmpOptimizer rewrote MatMul to FP16",
      file=sys.stdout)
