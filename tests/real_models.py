"""Model code nobody here wrote, for tests: TF-Slim nets on both TF lanes.

TF-Slim 1.1.0 builds its layers through ``tensorflow.python.layers``, which on
TF 2.15 and 2.21 forwards to ``tf_keras.legacy_tf_layers``.  Keras 2.15 ships
those modules as ``keras.src.legacy_tf_layers``; tf_keras 2.21 ships them as
``tf_keras.src.legacy_tf_layers``.  ``import_slim()`` aliases the installed
package under the name TF looks for (the same modules, not copies), then
imports ``tf_slim``.
"""
import importlib
import sys

_SUBMODULES = ("base", "convolutional", "core", "normalization", "pooling",
               "variable_scope_shim")


def import_slim():
    if "tf_keras.legacy_tf_layers" not in sys.modules:
        try:
            import tf_keras  # noqa: F401  (TF >= 2.16 lane)
            src = "tf_keras.src.legacy_tf_layers"
        except ImportError:  # TF 2.15: Keras 2.15 carries the layers itself
            import keras
            sys.modules.setdefault("tf_keras", keras)
            src = "keras.src.legacy_tf_layers"
        pkg = importlib.import_module(src)
        sys.modules["tf_keras.legacy_tf_layers"] = pkg
        for sub in _SUBMODULES:
            try:
                mod = importlib.import_module(f"{src}.{sub}")
            except ImportError:
                continue
            sys.modules[f"tf_keras.legacy_tf_layers.{sub}"] = mod
    import tf_slim
    return tf_slim
