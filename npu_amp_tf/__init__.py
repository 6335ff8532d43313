"""npu-amp-tf: Ascend-GE-style automatic mixed precision for stock TensorFlow."""
import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is first imported
from ._version import __version__, check_tensorflow

check_tensorflow()

from . import errors, options  # noqa: E402
from .errors import NpuAmpError, OptionError  # noqa: E402
from .options import Options  # noqa: E402

__all__ = ["__version__", "errors", "options", "NpuAmpError", "OptionError", "Options"]

# The grappler bridge: registers the NpuAmpOptimizer callback (builds the
# custom ops on first use) and the ConfigProto / TF2 entry points.
from . import bridge as _bridge  # noqa: E402
from .config import amp_scope, disable, enable, session_config  # noqa: E402

_bridge.register_on_import()
from .config import register_npu_optimizer_alias as _register_alias  # noqa: E402

_register_alias()  # "NpuOptimizer" entries run the pipeline when tf_adapter is absent
__all__ += ["session_config", "enable", "disable", "amp_scope"]

# Loss scaling (AMP_Optimizer, CANN-compatible managers) and framework entry points.
from . import loss_scale, optimizer  # noqa: E402
from .loss_scale import ExponentialUpdateLossScaleManager, FixedLossScaleManager  # noqa: E402
from .optimizer import AMP_Optimizer, NPULossScaleOptimizer  # noqa: E402

__all__ += ["AMP_Optimizer", "NPULossScaleOptimizer", "FixedLossScaleManager",
            "ExponentialUpdateLossScaleManager", "loss_scale", "optimizer", "keras", "estimator"]


def __getattr__(name):  # lazy submodules: keras / estimator import heavy frameworks
    if name in ("keras", "estimator"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Mixed precision: offline rewrite and the keep-dtype scope (CANN npu_scope.keep_dtype_scope).
from .precision import keep_dtype_scope, rewrite_graph  # noqa: E402

__all__ += ["rewrite_graph", "keep_dtype_scope"]

# Operator fusion: the public rule registry (graph_passes.fusion; graph_level option).
from graph_passes.fusion import fusion_rule, register_fusion_rule  # noqa: E402

__all__ += ["register_fusion_rule", "fusion_rule"]

# Layout: check_align (NC1HWC0 / FRACTAL_Z padding analysis; format_mode="NC1HWC0" runs the pass).
from .layout import check_align  # noqa: E402

__all__ += ["check_align"]
