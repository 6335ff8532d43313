"""tf_adapter's ``hccl`` rank API (npu-amp-tf compatibility layer)."""
