"""tf_adapter ``npu_optimizer``: ``NPUDistributedOptimizer``, ``NPUOptimizer``,
``npu_distributed_optimizer_wrapper``, ``npu_allreduce``.

Gradients are averaged across workers with ``tf.distribute`` (inside
``strategy.run``); with one worker the wrappers apply the gradients as the
wrapped optimizer would (HCCL's all-reduce over one rank is the identity).
"""
import tensorflow as tf

from npu_amp_tf import _tf
from npu_amp_tf.errors import OptionError
from npu_bridge.hccl import hccl_ops


def _rank_size():
    from hccl.manage.api import get_rank_size

    return get_rank_size()


def npu_allreduce(values, reduction="mean", fusion=1, fusion_id=-1, group="hccl_world_group"):
    single = not isinstance(values, (list, tuple))
    vals = [values] if single else list(values)
    out = [None if v is None else hccl_ops.allreduce(v, reduction, fusion, fusion_id, group)
           for v in vals]
    return out[0] if single else out


def allreduce(tensor, average=True):
    return hccl_ops.allreduce(tensor, "mean" if average else "sum")


class _Wrapper(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer that forwards to ``optimizer`` (slots, variables)."""

    def __init__(self, optimizer, name):
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise OptionError(f"optimizer={optimizer!r} is not a tf.compat.v1.train.Optimizer")
        super().__init__(use_locking=False, name=name or ("Distributed" + type(optimizer).__name__))
        self._optimizer = optimizer

    def _average(self, grads_and_vars):
        if not (tf.distribute.has_strategy() and tf.distribute.get_replica_context() is not None
                and tf.distribute.get_replica_context().num_replicas_in_sync > 1):
            return list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        return list(zip(npu_allreduce(grads, "mean"), [v for _, v in grads_and_vars]))

    def compute_gradients(self, *args, **kwargs):
        return self._average(self._optimizer.compute_gradients(*args, **kwargs))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        return self._optimizer.apply_gradients(grads_and_vars, global_step, name)

    def _create_slots(self, var_list):
        _tf.create_slots(self._optimizer, var_list)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)

    def _distributed_apply(self, *args, **kwargs):
        return _tf.distributed_apply(self._optimizer, *args, **kwargs)


class NPUDistributedOptimizer(_Wrapper):
    """``NPUDistributedOptimizer(optimizer, is_weight_update_sharding=False, name=None)``."""

    def __init__(self, optimizer, is_weight_update_sharding=False, name=None):
        if is_weight_update_sharding and _rank_size() > 1:
            raise OptionError("is_weight_update_sharding=True (HCCL weight-update sharding) has no "
                              "tf.distribute equivalent here; accepted: False")
        super().__init__(optimizer, name)


class NPUOptimizer(_Wrapper):
    """``NPUOptimizer(opt, loss_scale_manager=None, is_distributed=False,
    is_loss_scale=False, is_tailing_optimization=False, name=None)``: loss
    scaling (with ``is_loss_scale``) and distribution in one wrapper."""

    def __init__(self, opt, loss_scale_manager=None, is_distributed=False, is_loss_scale=False,
                 is_tailing_optimization=False, name=None):
        inner = opt
        if is_loss_scale:
            if loss_scale_manager is None:
                raise OptionError("NPUOptimizer(is_loss_scale=True) needs a loss_scale_manager")
            from npu_bridge.estimator.npu.npu_loss_scale_optimizer import NPULossScaleOptimizer

            inner = NPULossScaleOptimizer(opt, loss_scale_manager, is_distributed=is_distributed)
        elif is_distributed:
            inner = NPUDistributedOptimizer(opt)
        super().__init__(inner, name or "NPUOptimizer")

    def minimize(self, *args, **kwargs):
        return self._optimizer.minimize(*args, **kwargs)


def npu_distributed_optimizer_wrapper(optimizer):
    """tf_adapter: wrap a TF1 optimizer for HCCL when more than one rank runs;
    here the same with tf.distribute (the optimizer itself on one worker)."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return NPUDistributedOptimizer(optimizer) if _rank_size() > 1 else optimizer
    return optimizer


class KerasDistributeOptimizer:  # noqa: D101 - tf_adapter name; Keras optimizers distribute themselves
    def __new__(cls, optimizer, name="NpuKerasOptimizer", **kwargs):
        return optimizer
