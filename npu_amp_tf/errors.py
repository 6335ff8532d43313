"""Public error types.  All derive from :class:`NpuAmpError`."""
from graph_passes.errors import (  # noqa: F401  (re-exported)
    BuildError,
    GraphError,
    MixlistError,
    NpuAmpError,
    OptionError,
    PassError,
    TFCompatError,
)

__all__ = ["NpuAmpError", "OptionError", "MixlistError", "GraphError", "PassError", "BuildError", "TFCompatError"]
