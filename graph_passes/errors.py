"""Error types shared by the engine and the public API.

``NpuAmpError`` is the root of every error the plugin raises.  It lives here
(the engine) because ``graph_passes`` must not import ``npu_amp_tf``; the
public module ``npu_amp_tf.errors`` re-exports the very same classes.
"""


class NpuAmpError(Exception):
    """Root of every npu-amp-tf error."""


class OptionError(NpuAmpError, ValueError):
    """A parameter has an unknown key or a value outside what is accepted."""


class MixlistError(NpuAmpError, ValueError):
    """A modify_mixlist file or custom list is malformed or contradictory."""


class GraphError(NpuAmpError, ValueError):
    """A GraphDef is malformed (dangling input, duplicate name, cycle...)."""


class PassError(NpuAmpError):
    """A graph pass failed; the message names the pass (and node if known)."""

    def __init__(self, pass_name, message, node=None):
        self.pass_name = pass_name
        self.node = node
        where = f"pass '{pass_name}'" + (f" at node '{node}'" if node else "")
        super().__init__(f"{where}: {message}")


class BuildError(NpuAmpError, RuntimeError):
    """The custom ops could not be compiled or loaded."""


class TFCompatError(NpuAmpError, RuntimeError):
    """A TensorFlow / Keras internal the plugin relies on is missing or changed
    in the installed version.  Raised only by the two compatibility modules
    (``graph_passes/_tf.py``, ``npu_amp_tf/_tf.py``); the message names the
    TensorFlow version and the internal."""
