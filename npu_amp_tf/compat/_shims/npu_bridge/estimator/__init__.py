"""tf_adapter ``npu_bridge.estimator`` (npu-amp-tf compatibility layer)."""
