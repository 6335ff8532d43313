"""tf_adapter ``npu_bridge.estimator.npu_ops`` (the parts with a TF equivalent)."""
import tensorflow as tf

from npu_amp_tf.errors import OptionError


def dropout(x, keep_prob, noise_shape=None, seed=None, name=None):
    """tf_adapter's NPU dropout (DropOutGenMask + DropOutDoMask): keeps each
    element with probability ``keep_prob`` and scales kept ones by
    ``1/keep_prob``; here ``tf.nn.dropout(x, rate=1 - keep_prob)``."""
    if isinstance(keep_prob, (int, float)) and not 0.0 < keep_prob <= 1.0:
        raise OptionError(f"dropout(keep_prob={keep_prob!r}) is not valid; accepted: 0 < keep_prob <= 1")
    with tf.name_scope(name or "npu_dropout"):
        if isinstance(keep_prob, (int, float)) and keep_prob == 1.0:
            return tf.identity(x)
        rate = 1.0 - tf.cast(keep_prob, x.dtype) if not isinstance(keep_prob, (int, float)) \
            else 1.0 - keep_prob
        return tf.nn.dropout(x, rate=rate, noise_shape=noise_shape, seed=seed)


def initialize_system(name=None):
    """The NPU system init op; a no-op off the NPU."""
    return tf.no_op(name=name or "npu_initialize_system")


def shutdown_system(name=None):
    return tf.no_op(name=name or "npu_shutdown_system")
