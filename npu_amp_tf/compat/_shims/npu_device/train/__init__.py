"""tf_adapter ``npu_device.train``."""
from npu_device.train import optimizer  # noqa: F401
