"""The engine's one door into TensorFlow internals.

Every use of a private TensorFlow module (``tensorflow.python.*``) or private
attribute by ``graph_passes`` goes through a function here, so a TensorFlow
release that moves one breaks this file only, with a :class:`TFCompatError`
that names the TensorFlow version and the missing internal.  Where TF has a
public API for the same thing, the callers use the public API directly
(``tf.as_dtype``, ``tf.make_ndarray``, ``tf.make_tensor_proto``) and it is
not wrapped here.

Each function states the TF versions it was checked on (both CI lanes:
2.15.1 and 2.21.0; tests/test_tf_compat_layer.py runs every one of them) and
the public alternative, where one exists.  tests/test_tf_compat_layer.py also
fails when a module other than this one and ``npu_amp_tf/_tf.py`` reaches into
TF's internals.

``npu_amp_tf/_tf.py`` (the API side) re-uses :func:`require_module`,
:func:`require_attr` and the grappler helpers; the engine never imports the
API package.
"""
from __future__ import annotations

import importlib
import os
import platform

from .errors import TFCompatError

#: the TensorFlow versions every function here was checked on (the CI lanes)
CHECKED_ON = ("2.15.1", "2.21.0")


def tf_version() -> str:
    """The installed TensorFlow's version string (public: ``tf.__version__``)."""
    import tensorflow as tf

    return tf.__version__


def compat_error(what: str, exc: BaseException | None = None, alternative: str = "") -> TFCompatError:
    """The one error a missing or changed TF internal raises."""
    why = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    alt = f"; public alternative: {alternative}" if alternative else ""
    return TFCompatError(
        f"TensorFlow {tf_version()}: the internal {what} is missing or changed{why}. "
        f"npu-amp-tf uses it as checked on TensorFlow {' and '.join(CHECKED_ON)}{alt}")


def require_module(name: str, alternative: str = ""):
    """Import the private module ``name`` or raise :class:`TFCompatError`."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise compat_error(f"module '{name}'", exc, alternative) from None


def require_attr(obj, attr: str, what: str | None = None, alternative: str = ""):
    """``getattr(obj, attr)`` for a private attribute, or :class:`TFCompatError`.

    Only the lookup is guarded: an exception raised *by* the internal when it
    is called afterwards is a real fault and propagates unchanged."""
    try:
        return getattr(obj, attr)
    except AttributeError as exc:
        owner = what or (obj.__name__ if isinstance(obj, type) else type(obj).__name__)
        raise compat_error(f"'{owner}.{attr}'", exc, alternative) from None


# ---------------------------------------------------------------- registries
def op_def(op_type: str):
    """The registered ``OpDef`` of ``op_type`` (including custom ops loaded
    with ``tf.load_op_library``), or None for an unknown name.

    ``tensorflow.python.framework.op_def_registry.get``; checked on TF 2.15.1
    and 2.21.0.  Public alternative: none (``tf.raw_ops`` has Python wrappers
    of the built-in ops only, not their OpDefs)."""
    reg = require_module("tensorflow.python.framework.op_def_registry")
    return require_attr(reg, "get", "op_def_registry")(op_type)


def registered_kernels(op_type: str):
    """The ``KernelList`` proto of every kernel registered for ``op_type``
    (empty for an unknown op).

    ``tensorflow.python.framework.kernels.get_registered_kernels_for_op``;
    checked on TF 2.15.1 and 2.21.0.  Public alternative: none."""
    mod = require_module("tensorflow.python.framework.kernels")
    return require_attr(mod, "get_registered_kernels_for_op", "kernels")(op_type)


#: the probe's module, imported once (the fusion rules ask per match)
_PORT = []


def onednn_enabled() -> bool:
    """Whether TF's oneDNN (MKL) graph rewrite is on in this process.

    ``tensorflow.python.util._pywrap_util_port.IsMklEnabled()``; checked on
    TF 2.15.1 and 2.21.0, where it is true for x86-64 Linux wheels unless
    ``TF_ENABLE_ONEDNN_OPTS=0``.  Public alternative: none; if a TF version
    drops the probe, the documented rule above (the environment variable on
    x86-64 Linux) answers instead of an error."""
    try:
        if not _PORT:
            _PORT.append(importlib.import_module("tensorflow.python.util._pywrap_util_port"))
        return bool(_PORT[0].IsMklEnabled())
    except (ImportError, AttributeError):
        env = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip().lower()
        return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
                and env not in ("0", "false"))


# ---------------------------------------------------------------- grappler
def grappler_op_properties(meta_graph_bytes: bytes) -> dict:
    """Grappler's static shape inference (``GraphProperties``) over a
    serialized ``MetaGraphDef`` (it needs a ``train_op`` collection entry):
    ``{node name: [serialized OpInfo.TensorProperties per output]}``.

    ``tensorflow.python.grappler._pywrap_tf_item.TF_NewItem`` /
    ``TF_GetOpProperties``; checked on TF 2.15.1 and 2.21.0.  Public
    alternative: importing the graph into a ``tf.Graph`` and reading
    ``tensor.shape`` (slower; graph_passes.shapes falls back to it)."""
    item_mod = require_module("tensorflow.python.grappler._pywrap_tf_item")
    new_item = require_attr(item_mod, "TF_NewItem", "_pywrap_tf_item")
    get_props = require_attr(item_mod, "TF_GetOpProperties", "_pywrap_tf_item")
    item = new_item(meta_graph_bytes, True, True)
    return get_props(item)


def optimize_graph(config, meta_graph, graph_id: bytes = b"npu_amp"):
    """Run grappler's meta-optimizer with ``config`` (a ``ConfigProto``) on
    ``meta_graph`` (a ``MetaGraphDef``); returns the optimized ``GraphDef``.

    ``tensorflow.python.grappler.tf_optimizer.OptimizeGraph``; checked on TF
    2.15.1 and 2.21.0.  Public alternative: none outside a Session or
    ``tf.function`` (``tf.config.optimizer`` only sets the options)."""
    mod = require_module("tensorflow.python.grappler.tf_optimizer")
    return require_attr(mod, "OptimizeGraph", "tf_optimizer")(config, meta_graph, graph_id=graph_id)


__all__ = ["CHECKED_ON", "TFCompatError", "tf_version", "compat_error", "require_module",
           "require_attr", "op_def", "registered_kernels", "onednn_enabled",
           "grappler_op_properties", "optimize_graph"]
