"""tf_adapter 2.x ``NpuLossScaleOptimizer(inner_optimizer, dynamic=True,
initial_scale=None, dynamic_growth_steps=None)``.

tf_adapter's is a subclass of Keras's ``LossScaleOptimizer`` (same defaults:
initial scale 2**15, growth every 2000 finite steps, x2 up / x0.5 down on
every overflow).  Here it builds the plugin's Keras 2 loss-scaling optimizer
(``npu_amp_tf.keras.LossScaleOptimizer``: FP32 masters, one fused finite
check, skipped overflow steps) with those settings; on Keras 3 it is Keras's
own ``LossScaleOptimizer``.  ``isinstance(opt, NpuLossScaleOptimizer)`` holds
for what it returns.
"""
from npu_amp_tf.errors import OptionError

KERAS_INITIAL_SCALE = 2.0 ** 15
KERAS_GROWTH_STEPS = 2000


class _Meta(type):
    def __instancecheck__(cls, obj):
        from npu_amp_tf.keras import _AmpKerasMixin

        return getattr(obj, "_npu_device_lso", False) or isinstance(obj, _AmpKerasMixin) or \
            type.__instancecheck__(cls, obj)


class NpuLossScaleOptimizer(metaclass=_Meta):
    def __new__(cls, inner_optimizer, dynamic=True, initial_scale=None, dynamic_growth_steps=None):
        from npu_amp_tf import keras as amp_keras
        from npu_amp_tf.loss_scale import ExponentialUpdateLossScaleManager, FixedLossScaleManager

        family = amp_keras.optimizer_family(inner_optimizer)
        if family == "keras3":
            if not dynamic:
                raise OptionError("NpuLossScaleOptimizer(dynamic=False) on Keras 3: Keras 3's "
                                  "LossScaleOptimizer is always dynamic; accepted: dynamic=True")
            import keras

            opt = keras.mixed_precision.LossScaleOptimizer(
                inner_optimizer, initial_scale=initial_scale or KERAS_INITIAL_SCALE,
                dynamic_growth_steps=dynamic_growth_steps or KERAS_GROWTH_STEPS)
            opt._npu_device_lso = True
            return opt
        if dynamic:
            manager = ExponentialUpdateLossScaleManager(
                initial_scale or KERAS_INITIAL_SCALE, dynamic_growth_steps or KERAS_GROWTH_STEPS,
                decr_every_n_nan_or_inf=1, incr_ratio=2, decr_ratio=0.5)
        else:
            if initial_scale is None:
                raise OptionError("NpuLossScaleOptimizer(dynamic=False) needs initial_scale")
            if dynamic_growth_steps is not None:
                raise OptionError("dynamic_growth_steps is only valid with dynamic=True")
            manager = FixedLossScaleManager(initial_scale)
        return amp_keras.LossScaleOptimizer(inner_optimizer, manager)


__all__ = ["NpuLossScaleOptimizer"]
