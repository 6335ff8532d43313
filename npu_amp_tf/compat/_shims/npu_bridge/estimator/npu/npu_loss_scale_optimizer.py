"""tf_adapter ``NPULossScaleOptimizer(opt, loss_scale_manager, is_distributed=False)``.

A class (``isinstance`` and subclassing work) on top of the plugin's TF1
loss-scaling optimizer: the loss is scaled, gradients are unscaled and
checked with one reduction, an overflowing step is skipped and the manager
updated.  The all-finite flag is the tensor ``overflow_status_reduce_all:0``
(at the name scope ``minimize`` / ``apply_gradients`` is called in), True
when every gradient is finite, as tf_adapter's.
"""
import logging

import tensorflow as tf

from npu_amp_tf.errors import OptionError
from npu_amp_tf.loss_scale import LossScaleManager
from npu_amp_tf.optimizer import TF1AmpOptimizer

OVERFLOW_FLAG_NAME = "overflow_status_reduce_all"


class NPULossScaleOptimizer(TF1AmpOptimizer):
    def __init__(self, opt, loss_scale_manager, is_distributed=False):
        if not isinstance(loss_scale_manager, LossScaleManager):
            raise OptionError(
                f"loss_scale_manager={loss_scale_manager!r} is not valid; accepted: a "
                "FixedLossScaleManager or ExponentialUpdateLossScaleManager "
                "(npu_bridge.estimator.npu.npu_loss_scale_manager)")
        self._is_distributed = bool(is_distributed)
        multi = tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1
        if is_distributed and not multi:
            logging.getLogger("npu_amp_tf").info(
                "NPULossScaleOptimizer(is_distributed=True) with one worker: the overflow flag "
                "all-reduce over one rank is the identity")
        super().__init__(opt, loss_scale_manager, is_distributed=bool(is_distributed and multi))
        self._name = "NPULossScaleOptimizer{}".format(type(opt).__name__)

    @property
    def is_distributed(self):
        return self._is_distributed

    def _apply(self, gv, global_step, name, scaled):
        m = self.loss_scale_manager
        orig = type(m).update_loss_scale

        def update_loss_scale(finite_grads, apply_fn=None):
            flag = tf.identity(tf.convert_to_tensor(finite_grads), name=OVERFLOW_FLAG_NAME)
            return orig(m, flag, apply_fn=apply_fn)

        m.__dict__["update_loss_scale"] = update_loss_scale
        try:
            return super()._apply(gv, global_step, name, scaled)
        finally:
            m.__dict__.pop("update_loss_scale", None)
