"""npu-amp-tf: Ascend-GE-style automatic mixed precision for stock TensorFlow."""
from ._version import __version__, check_tensorflow

check_tensorflow()

from . import errors, options  # noqa: E402
from .errors import NpuAmpError, OptionError  # noqa: E402
from .options import Options  # noqa: E402

__all__ = ["__version__", "errors", "options", "NpuAmpError", "OptionError", "Options"]
