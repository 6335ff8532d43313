"""tf_adapter ``npu_loss_scale_manager`` with its signatures and defaults.

The scale variable is ``loss_scale:0`` at the variable scope the manager is
created in (built right away in a TF1 graph, as tf_adapter does), so scripts
that fetch ``loss_scale:0`` by name find it.
"""
import tensorflow as tf

from npu_amp_tf import loss_scale as _ls


#: tf.Module name (its name scope must not take the name `loss_scale`)
_MODULE_NAME = "loss_scale_manager"


def _float_max_over(incr_ratio, init):
    """tf_adapter grows the scale while it is below 3.4e38 / incr_ratio."""
    try:
        cap = 3.4e38 / float(incr_ratio)
        return max(cap, float(init))
    except (TypeError, ValueError, ZeroDivisionError):
        return None  # the options module reports the bad value


def _build_now(m):
    if not tf.executing_eagerly():
        m.build()


class FixedLossScaleManager(_ls.FixedLossScaleManager):
    """``FixedLossScaleManager(loss_scale, enable_overflow_check=True)``; any scale >= 1."""

    _tf_adapter_names = True

    def __init__(self, loss_scale, enable_overflow_check=True):
        super().__init__(loss_scale, enable_overflow_check, name=_MODULE_NAME)
        _build_now(self)

    def get_enable_overflow_check(self):
        return self.enable_overflow_check


class ExponentialUpdateLossScaleManager(_ls.ExponentialUpdateLossScaleManager):
    """``ExponentialUpdateLossScaleManager(init_loss_scale, incr_every_n_steps,
    decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.8)``; any initial
    scale >= 1 (2**32 is common in ModelZoo scripts)."""

    _tf_adapter_names = True

    def __init__(self, init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf=2,
                 incr_ratio=2, decr_ratio=0.8):
        super().__init__(init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf,
                         incr_ratio, decr_ratio,
                         max_loss_scale=_float_max_over(incr_ratio, init_loss_scale), name=_MODULE_NAME)
        _build_now(self)
