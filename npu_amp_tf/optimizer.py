"""``AMP_Optimizer``: loss scaling, overflow skip, FP32 master weights.

Usage, as in CANN's TF scripts::

    opt = tf.compat.v1.train.AdamOptimizer()
    opt = npu_amp_tf.AMP_Optimizer(opt)            # dynamic loss scale (default)
    train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())

``AMP_Optimizer`` also accepts a Keras 2 optimizer (``tf.keras`` on TF 2.15,
``tf_keras`` on newer TF) and then returns the Keras wrapper of
:mod:`npu_amp_tf.keras`, and a Keras 3 optimizer (``tf.keras`` on TF >= 2.16)
and then returns the wrapper of :mod:`npu_amp_tf.keras3`.

One step, as built by this module (pure TF ops, no custom kernels)::

    loss ──×scale──► grads(scaled) ──[tf.distribute: cast allreduce_dtype, all-reduce SUM,
                                       cast back]──► ONE finiteness check ═► finite
         (small grads + IndexedSlices values concatenated → IsFinite; big grads IsFinite
          each; all flags → a single All)
    grads × 1/scale (FP32) ──► unscaled FP32 grads
    tf.cond(finite,
            inner.apply_gradients(unscaled) [+ refresh FP16 copies] + good-step counters
                (growth: nested rare branch, logged),
            overflow: scale ×decr (hysteresis), counters, logged event)
    global_step += 1                           # always (TF1 wrapper), see below

``global_step`` on a skipped step: the TF1 wrapper increments ``global_step``
on every call, skipped or not, so loops that run to a step count
(``StopAtStepHook``, Estimator ``max_steps``) never stall; the number of
applied updates is ``global_step - skipped_steps``.  Step-dependent optimizer
state (Adam's ``beta1_power``/``beta2_power``, Keras ``optimizer.iterations``)
only advances on applied updates.
"""
from __future__ import annotations

import tensorflow as tf

from .amp_core import (FP16_COPIES_COLLECTION, AmpCore, _options,  # noqa: F401  (re-exported)
                       _PreReduced, check_strategy, fused_unscale_and_check)
from . import _tf
from .errors import OptionError
from .loss_scale import (ExponentialUpdateLossScaleManager, FixedLossScaleManager,  # noqa: F401
                         LossScaleManager, make_manager, non_amp_variables)


# ---------------------------------------------------------------------------
# TF1 wrapper
# ---------------------------------------------------------------------------
class TF1AmpOptimizer(_tf.delegating_trackable_mixin(),
                      tf.compat.v1.train.Optimizer):
    """Loss-scaling wrapper of a ``tf.compat.v1.train.Optimizer``.

    ``compute_gradients`` returns UNSCALED FP32 gradients (clip or inspect
    them as usual); ``apply_gradients`` checks them (one fused check) and
    applies them under ``tf.cond``; ``minimize`` does both, skipping one
    unscale pass.

    Checkpoints: name-based (``Saver``) names are those of the wrapped
    optimizer plus ``loss_scale/*``.  For object-based checkpoints the wrapper
    delegates tracking to the wrapped optimizer (which gets one extra child,
    ``loss_scale_manager``), so the layout equals the plain optimizer's.
    """

    def __init__(self, opt, loss_scale_manager=None, is_distributed=False, **options):
        if not isinstance(opt, tf.compat.v1.train.Optimizer):
            raise OptionError(f"opt={opt!r} is not a tf.compat.v1.train.Optimizer")
        opts = _options(options)
        tf.compat.v1.train.Optimizer.__init__(self, use_locking=False,
                                              name="AMP_" + opt.get_name())
        self._opt = opt
        self._manager = make_manager(loss_scale_manager, opts)
        self._core = AmpCore(self._manager, opts, is_distributed)
        _tf.delegating_trackable_mixin().__init__(self, opt)
        _tf.track_trackable(opt, self._manager, name="loss_scale_manager", overwrite=True)

    def _create_or_restore_slot_variable(self, slot_variable_position, slot_name, variable):
        return _tf.create_or_restore_slot_variable(self._opt, slot_variable_position, slot_name,
                                                   variable)

    # observability ----------------------------------------------------------
    @property
    def loss_scale_manager(self) -> LossScaleManager:
        return self._manager

    @property
    def inner_optimizer(self):
        return self._opt

    def get_loss_scale(self):
        return self._manager.get_loss_scale()

    def fp16_copy(self, var):
        return self._core.fp16_copy(var)

    # gradients --------------------------------------------------------------
    def _scaled_gradients(self, loss, var_list=None, gate_gradients=1, aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None):
        return self._opt.compute_gradients(
            self._core.scale_loss(loss), var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss)

    def compute_gradients(self, loss, var_list=None, gate_gradients=1, aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None):
        gv = self._scaled_gradients(loss, var_list, gate_gradients, aggregation_method,
                                    colocate_gradients_with_ops, grad_loss)
        grads = self._core.unscale([g for g, _ in gv])
        return list(zip(grads, [v for _, v in gv]))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        return self._apply(list(grads_and_vars), global_step, name, scaled=False)

    def minimize(self, loss, global_step=None, var_list=None, gate_gradients=1,
                 aggregation_method=None, colocate_gradients_with_ops=False, name=None,
                 grad_loss=None):
        gv = self._scaled_gradients(loss, var_list, gate_gradients, aggregation_method,
                                    colocate_gradients_with_ops, grad_loss)
        if not [v for g, v in gv if g is not None]:
            raise ValueError(f"No gradients provided for any variable: {[v.name for _, v in gv]}")
        return self._apply(gv, global_step, name, scaled=True)

    def _apply(self, gv, global_step, name, scaled):
        opt = self._opt

        def apply_local(pairs):
            with tf.init_scope():
                _tf.create_slots(opt, [v for _, v in pairs])
            return opt.apply_gradients(pairs, name=name)

        def apply_cross_replica(strategy, grads, var_list):
            return _tf.distributed_apply(opt, _PreReduced(strategy), list(zip(grads, var_list)),
                                         None, name)

        with tf.init_scope():
            _tf.create_slots(opt, [v for g, v in gv if g is not None])
        return self._core.step(gv, scaled, apply_local, apply_cross_replica, global_step)

    # delegation -------------------------------------------------------------
    def get_slot(self, var, name):
        return self._opt.get_slot(var, name)

    def get_slot_names(self):
        return self._opt.get_slot_names()

    def variables(self):
        return self._opt.variables() + self._manager.state_variables

    def _create_slots(self, var_list):
        _tf.create_slots(self._opt, var_list)


# ---------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------
def AMP_Optimizer(opt, loss_scale_manager=None, **options):  # noqa: N802 (CANN name)
    """Wrap ``opt`` with loss scaling, overflow skip and FP32 master weights.

    ``opt``: a ``tf.compat.v1.train.Optimizer`` (returns a TF1 optimizer), a
    Keras 2 optimizer (returns the Keras wrapper, see :mod:`npu_amp_tf.keras`)
    or a Keras 3 optimizer (see :mod:`npu_amp_tf.keras3`).
    ``loss_scale_manager``: None or ``"dynamic"`` (dynamic scaling with the
    options below), a number (fixed scale), or a manager instance.
    ``options``: the ``loss_scale`` group of :mod:`npu_amp_tf.options`
    (``init_loss_scale``, ``incr_every_n_steps``, ``decr_every_n_nan_or_inf``,
    ``incr_ratio``, ``decr_ratio``, ``min_loss_scale``, ``max_loss_scale``,
    ``enable_overflow_check``, ``keep_fp16_copies``,
    ``gradient_accumulation_steps``, ``allreduce_dtype``, ``bucket_size_mb``,
    ``loss_scale``).  Rewrite options and GE keys in the same call (the CANN
    AMP guide passes one dict) go to :func:`npu_amp_tf.config.rewrite_everywhere`.
    """
    is_distributed = options.pop("is_distributed", False)
    from .config import rewrite_everywhere, split_rewrite_params

    rewrite_everywhere(split_rewrite_params(options), source="AMP_Optimizer")
    if isinstance(opt, tf.compat.v1.train.Optimizer):
        return TF1AmpOptimizer(opt, loss_scale_manager, is_distributed=is_distributed, **options)
    from . import keras as _keras, keras3 as _keras3

    if _keras3.is_keras3_optimizer(opt):
        return _keras3.LossScaleOptimizer(opt, loss_scale_manager, is_distributed=is_distributed,
                                          **options)
    family = _keras.optimizer_family(opt)
    if family is not None:
        return _keras.LossScaleOptimizer(opt, loss_scale_manager, is_distributed=is_distributed,
                                         **options)
    raise OptionError(
        f"opt={opt!r} ({type(opt).__module__}.{type(opt).__name__}) is not a supported "
        "optimizer; accepted: a tf.compat.v1.train.Optimizer, a Keras 2 optimizer "
        "(tf.keras on TF 2.15, tf_keras on newer TF) or a Keras 3 optimizer (TensorFlow backend)")


def NPULossScaleOptimizer(opt, loss_scale_manager, is_distributed=False):  # noqa: N802
    """CANN-compatible alias of :func:`AMP_Optimizer`."""
    return AMP_Optimizer(opt, loss_scale_manager, is_distributed=is_distributed)
