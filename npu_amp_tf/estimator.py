"""Estimator entry point: ``npu_amp_tf.estimator.RunConfig(**params)``.

::

    config = npu_amp_tf.estimator.RunConfig(model_dir=..., precision_mode="allow_mix_precision",
                                            save_checkpoints_steps=100)
    est = tf.estimator.Estimator(model_fn, config=config)

``params`` mixes the plugin's rewrite options (the ``rewrite`` group of
:mod:`npu_amp_tf.options`: ``precision_mode``, ``modify_mixlist``..., and
GE's keys, ``GE_KEYS``) with
ordinary ``tf.estimator.RunConfig`` arguments.  The rewrite options go into
the ``session_config`` (``npu_amp_tf.config.session_config``), on top of a
``session_config`` you pass.  Loss-scale options belong to
``AMP_Optimizer`` inside your ``model_fn``.

``tf.estimator`` exists up to TF 2.15; on newer TF this raises a clear error.
"""
from __future__ import annotations

import inspect

import tensorflow as tf

from .errors import NpuAmpError, OptionError
from .options import GE_KEYS, LOSS_SCALE_KEYS, REWRITE_KEYS, Options


def estimator_module():
    """``tf.estimator``, or a clear error where TensorFlow no longer ships it."""
    est = getattr(tf, "estimator", None)
    if est is None or not hasattr(est, "RunConfig"):
        raise NpuAmpError(
            f"tf.estimator is not available in TensorFlow {tf.__version__} (it was removed in "
            "2.16); npu_amp_tf.estimator needs TensorFlow <= 2.15. On newer TF use Keras "
            "(npu_amp_tf.keras) or a custom loop with npu_amp_tf.AMP_Optimizer")
    return est


def RunConfig(**params):  # noqa: N802 (mirrors tf.estimator.RunConfig)
    """A ``tf.estimator.RunConfig`` whose ``session_config`` runs the plugin."""
    est = estimator_module()
    misplaced = sorted(k for k in params if k in LOSS_SCALE_KEYS)
    if misplaced:
        raise OptionError(
            f"{', '.join(misplaced)} (RunConfig) are loss-scale options; pass them to "
            "npu_amp_tf.AMP_Optimizer(opt, ...) in the model_fn; accepted here: "
            "tf.estimator.RunConfig arguments and the rewrite options "
            f"({', '.join(REWRITE_KEYS)})")
    # the plugin's rewrite options and GE's keys (npu_amp_tf.options.GE_KEYS)
    plugin = {k: params.pop(k) for k in list(params) if k in REWRITE_KEYS or k in GE_KEYS}
    accepted = [p for p in inspect.signature(est.RunConfig.__init__).parameters if p != "self"]
    unknown = sorted(k for k in params if k not in accepted)
    if unknown:
        raise OptionError(
            f"unknown parameter {', '.join(repr(k) for k in unknown)} (RunConfig); accepted: "
            f"{', '.join(accepted)} and the rewrite options {', '.join(REWRITE_KEYS)}")
    base = params.pop("session_config", None)
    if base is not None and not isinstance(base, tf.compat.v1.ConfigProto):
        raise OptionError(f"session_config={base!r} (RunConfig) is not valid; accepted: a "
                          "tf.compat.v1.ConfigProto or None")
    try:
        from .config import session_config as _session_config
    except ImportError:  # the rewrite entry point is not installed: validate, pass through
        Options.from_kwargs(_source="RunConfig", _groups=("rewrite",), **plugin)
        session_config = base
    else:
        session_config = _session_config(base, **plugin)
    return est.RunConfig(session_config=session_config, **params)
