"""npu-amp-tf's stand-in for Huawei tf_adapter's ``npu_bridge`` (see
``npu_amp_tf.compat``): the same module paths, signatures and defaults,
running the plugin's graph rewrite and loss scaling on CPU/GPU."""
import npu_amp_tf  # noqa: F401  (registers the grappler optimizer and its NpuOptimizer alias)

__npu_amp_tf_compat__ = True
