"""Loss-scale managers with CANN's interface.

Two managers, drop-in for Ascend scripts::

    FixedLossScaleManager(loss_scale, enable_overflow_check=True)
    ExponentialUpdateLossScaleManager(init_loss_scale, incr_every_n_steps,
                                      decr_every_n_nan_or_inf=2,
                                      incr_ratio=2, decr_ratio=0.8)

Both expose ``get_loss_scale()`` (the scale as a float32 tensor/variable) and
``update_loss_scale(finite_grads)`` (an op that advances the state machine).

State lives in non-trainable variables that are saved in checkpoints (TF1
``Saver`` by name under ``<name>/...``; TF2 object checkpoints as children of
the manager):

==================  =========  ==============================================
variable            dtype      meaning
==================  =========  ==============================================
``loss_scale``      float32    current scale, kept in [min_loss_scale, max_loss_scale]
``good_steps``      int64      consecutive finite steps since the last change
``bad_steps``       int64      overflowing steps counted towards the hysteresis
``overflow_count``  int64      total overflowing (micro-)steps
``skipped_steps``   int64      total optimizer updates skipped (or discarded)
``steps``           int64      total calls of ``update_loss_scale``
==================  =========  ==============================================

Every *event* (a step with an overflow, or a step that changed the scale) is
appended to :attr:`LossScaleManager.history` as ``(step, scale, overflow)``
and logged on the ``npu_amp_tf.loss_scale`` logger.  A warning is logged when
the scale keeps leaving the normal 8..1024 band or collapses toward 1: that
pattern means a real inf/NaN in the model (log(0), 0/0, an exploding layer),
not FP16 range.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading

import tensorflow as tf

from .errors import OptionError
from .options import OPTIONS, Options

logger = logging.getLogger("npu_amp_tf.loss_scale")

#: TF1 graph collection holding every loss-scale state variable (so a
#: non-AMP checkpoint can be restored into an AMP graph with
#: ``Saver(var_list=non_amp_variables())``).
LOSS_SCALE_COLLECTION = "npu_amp_tf_loss_scale"

#: the band a healthy dynamic loss scale lives in
NORMAL_BAND = (8.0, 1024.0)
#: warn once the scale has left the band this many times
OUT_OF_BAND_WARN_AFTER = 3

_UNBUILT = object()

LossScaleEvent = collections.namedtuple("LossScaleEvent", ["step", "scale", "overflow"])

_FIXED_SCALE_OPTION = dataclasses.replace(OPTIONS["init_loss_scale"], name="loss_scale",
                                          doc="Fixed loss scale.")


def _validated(**kwargs) -> Options:
    return Options.from_kwargs(_groups=("loss_scale",), **kwargs)


class LossScaleManager(tf.Module):
    """Base class: state variables, history, summaries.  Use a subclass."""

    #: TF1 graphs: name the scale variable `loss_scale` at the current scope
    #: (tf_adapter's layout, used by npu_amp_tf.compat); else `<name>/loss_scale`
    _tf_adapter_names = False

    def __init__(self, *, init_scale: float, enable_overflow_check: bool,
                 min_loss_scale: float, max_loss_scale: float, name: str):
        super().__init__(name=name)
        self._init_scale = float(init_scale)
        self._check = bool(enable_overflow_check)
        self._min = float(min_loss_scale)
        self._max = float(max_loss_scale)
        self._built_graph = _UNBUILT
        self._log = _EventLog()
        self.log_events = True

    # ------------------------------------------------------------------ state
    @property
    def enable_overflow_check(self) -> bool:
        return self._check

    @property
    def is_dynamic(self) -> bool:
        return False

    def build(self):
        """Create the state variables in the current graph (idempotent).

        Called lazily by :meth:`get_loss_scale`; variable creation is lifted out
        of ``tf.function``/``tf.cond`` with ``tf.init_scope``.  In TF1 graph mode
        a manager reused across graphs (Estimator calls ``model_fn`` once per
        graph) gets fresh variables in each graph.
        """
        with tf.init_scope():
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            if self._built_graph is graph:
                return
            strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
            kw = {}
            if strategy is not None:
                # written only from cross-replica context with identical values
                kw = dict(aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            if graph is not None and self._tf_adapter_names:
                # tf_adapter layout: the scale is `loss_scale:0` at the scope
                # the manager is built in (scripts fetch it by that name)
                # `loss_scale:0` is a read of the (resource) variable, so that
                # fetching it gives the value, as tf_adapter's ref variable does
                self.loss_scale = self._var("loss_scale_value", tf.float32, self._init_scale, kw)
                self.loss_scale_tensor = tf.identity(self.loss_scale, name="loss_scale")
            with (tf.compat.v1.variable_scope(
                    None, default_name=self.name + ("_state" if self._tf_adapter_names else ""))
                  if graph is not None else _null()):
                if graph is None or not self._tf_adapter_names:
                    self.loss_scale = self._var("loss_scale", tf.float32, self._init_scale, kw)
                self.good_steps = self._var("good_steps", tf.int64, 0, kw)
                self.bad_steps = self._var("bad_steps", tf.int64, 0, kw)
                self.overflow_count = self._var("overflow_count", tf.int64, 0, kw)
                self.skipped_steps = self._var("skipped_steps", tf.int64, 0, kw)
                self.steps = self._var("steps", tf.int64, 0, kw)
            self._built_graph = graph

    def _var(self, name, dtype, value, kw):
        if tf.executing_eagerly():
            return tf.Variable(tf.constant(value, dtype), trainable=False, name=name, **kw)
        v = tf.compat.v1.get_variable(
            name, shape=(), dtype=dtype, initializer=tf.compat.v1.constant_initializer(value),
            trainable=False, use_resource=True,
            collections=[tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, LOSS_SCALE_COLLECTION], **kw)
        return v

    @property
    def state_variables(self):
        self.build()
        return [self.loss_scale, self.good_steps, self.bad_steps, self.overflow_count,
                self.skipped_steps, self.steps]

    def get_loss_scale(self):
        """The current loss scale (float32 variable; CANN interface)."""
        self.build()
        return self.loss_scale

    # --------------------------------------------------------------- updates
    def _grows(self, good):
        """Bool tensor: does a finite step now change the scale?  (None: never)"""
        return None

    def _grown(self, scale):
        return scale

    def _on_overflow(self, scale, bad):
        """(new_scale, new_bad) after an overflowing step."""
        return scale, bad

    def update_loss_scale(self, finite_grads, apply_fn=None):
        """Advance the state machine (CANN interface).

        ``finite_grads``: scalar bool, True when every gradient was finite
        (ignored when the overflow check is off).  An overflowing step counts
        in ``overflow_count`` and ``skipped_steps``.  Returns an op.

        The state is read once, then ONE ``tf.cond`` runs the branch of this
        step: finite (counters; growth as branchless scalar selects) or
        overflow.  Events (growth, overflow) are logged from inside the branch.
        ``apply_fn`` (used by ``AMP_Optimizer``): a callable building the
        optimizer update; it runs inside the finite branch, so skipping the
        update costs no second conditional and the update graph exists once
        (a lowered conditional pays per node of its untaken branch).
        """
        self.build()
        good, steps = self.good_steps.read_value(), self.steps.read_value()
        zero = tf.zeros([], tf.int64)
        step1 = steps + 1

        def log(new_scale, overflow):
            return tf.py_function(self._record_event, [step1, new_scale, tf.constant(overflow)],
                                  tf.bool)

        def growth_step():  # rare
            scale = self.loss_scale.read_value()
            new_scale = self._grown(scale)
            with tf.control_dependencies([scale]):
                ops = [self.loss_scale.assign(new_scale, read_value=False),
                       self.good_steps.assign(zero, read_value=False),
                       self.bad_steps.assign(zero, read_value=False)]
            if self.log_events:
                with tf.control_dependencies(ops):
                    ops.append(log(new_scale, False))
            return tf.group(*ops)

        def finite_step():  # the hot path: two counter writes
            deps = [good, steps]
            if apply_fn is not None:
                applied = apply_fn()
                deps.append(applied if applied is not None else tf.no_op())
            with tf.control_dependencies(deps):
                ops = [self.steps.assign(step1, read_value=False)]
                grows = self._grows(good)
                if grows is None:
                    ops.append(self.good_steps.assign(good + 1, read_value=False))
                else:
                    ops.append(tf.cond(grows, growth_step, lambda: tf.group(
                        self.good_steps.assign(good + 1, read_value=False))))
            return tf.group(*ops)

        def overflow_step():
            scale, bad = self.loss_scale.read_value(), self.bad_steps.read_value()
            new_scale, new_bad = self._on_overflow(scale, bad)
            with tf.control_dependencies([scale, bad, good, steps]):
                ops = [self.loss_scale.assign(new_scale, read_value=False),
                       self.good_steps.assign(zero, read_value=False),
                       self.bad_steps.assign(new_bad, read_value=False),
                       self.steps.assign(step1, read_value=False),
                       self.overflow_count.assign_add(1, read_value=False),
                       self.skipped_steps.assign_add(1, read_value=False)]
            if self.log_events:
                with tf.control_dependencies(ops):
                    ops.append(log(new_scale, True))
            return tf.group(*ops)

        if not self._check:
            return tf.group(finite_step(), name="update_loss_scale")
        finite = tf.convert_to_tensor(finite_grads)
        if finite.dtype != tf.bool:
            finite = tf.cast(finite, tf.bool)
        return tf.group(tf.cond(finite, finite_step, overflow_step), name="update_loss_scale")

    # ----------------------------------------------------------- observability
    def _record_event(self, step, scale, overflow):
        ev = LossScaleEvent(int(step.numpy()), float(scale.numpy()), bool(overflow.numpy()))
        log = self._log
        with log.lock:
            prev = log.events[-1].scale if log.events else self._init_scale
            log.events.append(ev)
            self._diagnose(ev, prev)
        return True

    def _diagnose(self, ev, prev_scale):
        lo, hi = NORMAL_BAND
        logger.info("loss scale event: step=%d scale=%g overflow=%s", ev.step, ev.scale, ev.overflow)
        log = self._log
        if ev.scale != prev_scale and not lo <= ev.scale <= hi:
            log.out_of_band += 1
            if log.out_of_band >= OUT_OF_BAND_WARN_AFTER and (
                    log.out_of_band - log.band_warned_at >= OUT_OF_BAND_WARN_AFTER
                    or log.band_warned_at == 0):
                log.band_warned_at = log.out_of_band
                logger.warning(
                    "loss scale keeps leaving the normal %g..%g band (now %g at step %d, "
                    "%d times so far, %d overflows): the model produces real inf/NaN "
                    "values (log(0), 0/0, an exploding layer), not an FP16 range problem; "
                    "inspect the loss and the layers named in the overflow steps of "
                    "manager.history", lo, hi, ev.scale, ev.step, log.out_of_band,
                    sum(e.overflow for e in log.events))
        if ev.overflow and ev.scale <= max(2.0 * self._min, 2.0) and not log.collapsed_warned:
            log.collapsed_warned = True
            logger.warning(
                "loss scale collapsed to %g at step %d after repeated overflows: even "
                "unscaled gradients are inf/NaN, so this is a real NaN in the model, not "
                "FP16 range; check the loss and the inputs", ev.scale, ev.step)
        if ev.scale >= lo:
            log.collapsed_warned = False

    @property
    def history(self) -> list[LossScaleEvent]:
        """Events recorded in this process: ``(step, scale, overflow)`` for every
        step that overflowed or changed the scale.  ``step`` counts calls of
        ``update_loss_scale`` (see the ``steps`` variable)."""
        with self._log.lock:
            return list(self._log.events)

    def clear_history(self):
        with self._log.lock:
            self._log.reset()

    def summaries(self, step=None):
        """Write TensorBoard scalars: loss_scale, overflow_count, skipped_steps.

        TF1 graph mode: adds ``tf.compat.v1.summary.scalar`` ops to the
        SUMMARIES collection (Estimator writes them).  TF2: writes to the
        default ``tf.summary`` writer when one is active (no-op otherwise).
        """
        self.build()
        items = (("npu_amp/loss_scale", self.loss_scale),
                 ("npu_amp/overflow_count", self.overflow_count),
                 ("npu_amp/skipped_steps", self.skipped_steps))
        if not tf.compat.v1.executing_eagerly_outside_functions():
            return [tf.compat.v1.summary.scalar(n, tf.cast(v, tf.float32)) for n, v in items]
        from . import _tf

        if not _tf.has_default_summary_writer():
            return []  # like tf.summary.*: nothing to do (and no variable reads per step)
        if step is None:
            step = tf.summary.experimental.get_step()
            if step is None:
                step = self.steps
        # tf.summary.write (TF core) with the "scalars" plugin metadata: works
        # without the tensorboard package (tf.summary.scalar needs it on TF >= 2.16)
        from tensorflow.core.framework import summary_pb2

        meta = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
        return [tf.summary.write(n, tf.cast(v, tf.float32), step=step, metadata=meta)
                for n, v in items]

    def state(self, session=None) -> dict:
        """Current state as python numbers (pass a session in TF1 graph mode)."""
        names = ["loss_scale", "good_steps", "bad_steps", "overflow_count", "skipped_steps", "steps"]
        vals = self.state_variables
        out = session.run(vals) if session is not None else [v.numpy() for v in vals]
        return {n: (float(x) if n == "loss_scale" else int(x)) for n, x in zip(names, out)}


class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale (CANN ``FixedLossScaleManager``).

    With ``enable_overflow_check=True`` overflowing steps are still detected
    and skipped (and counted); with ``False`` no finiteness check is built and
    every update is applied.
    """

    def __init__(self, loss_scale, enable_overflow_check=True, name="loss_scale"):
        scale = _FIXED_SCALE_OPTION.convert(loss_scale)
        check = OPTIONS["enable_overflow_check"].convert(enable_overflow_check)
        super().__init__(init_scale=scale, enable_overflow_check=check,
                         min_loss_scale=scale, max_loss_scale=scale, name=name)

    def __repr__(self):
        return (f"FixedLossScaleManager(loss_scale={self._init_scale:g}, "
                f"enable_overflow_check={self._check})")


class ExponentialUpdateLossScaleManager(LossScaleManager):
    """Dynamic loss scale (CANN ``ExponentialUpdateLossScaleManager``).

    * ``incr_every_n_steps`` consecutive finite steps multiply the scale by
      ``incr_ratio`` (capped at ``max_loss_scale``);
    * every ``decr_every_n_nan_or_inf`` overflowing steps multiply it by
      ``decr_ratio`` (floored at ``min_loss_scale``).  The overflow counter is
      not reset by finite steps (hysteresis, as in TF contrib and CANN); a
      change of the scale resets both counters.
    """

    def __init__(self, init_loss_scale=None, incr_every_n_steps=None, decr_every_n_nan_or_inf=2,
                 incr_ratio=2, decr_ratio=0.8, *, min_loss_scale=None, max_loss_scale=None,
                 name="loss_scale"):
        given = dict(init_loss_scale=init_loss_scale, incr_every_n_steps=incr_every_n_steps,
                     decr_every_n_nan_or_inf=decr_every_n_nan_or_inf, incr_ratio=incr_ratio,
                     decr_ratio=decr_ratio, min_loss_scale=min_loss_scale,
                     max_loss_scale=max_loss_scale)
        o = _validated(**{k: v for k, v in given.items() if v is not None})
        super().__init__(init_scale=o.init_loss_scale, enable_overflow_check=True,
                         min_loss_scale=o.min_loss_scale, max_loss_scale=o.max_loss_scale,
                         name=name)
        self.incr_every_n_steps = o.incr_every_n_steps
        self.decr_every_n_nan_or_inf = o.decr_every_n_nan_or_inf
        self.incr_ratio = o.incr_ratio
        self.decr_ratio = o.decr_ratio

    @property
    def is_dynamic(self) -> bool:
        return True

    def _grows(self, good):
        return good + 1 >= self.incr_every_n_steps

    def _grown(self, scale):
        return tf.minimum(scale * self.incr_ratio, self._max)

    def _on_overflow(self, scale, bad):
        bad1 = bad + 1
        shrink = bad1 >= self.decr_every_n_nan_or_inf
        return (tf.where(shrink, tf.maximum(scale * self.decr_ratio, self._min), scale),
                tf.where(shrink, tf.zeros_like(bad1), bad1))

    def __repr__(self):
        return (f"ExponentialUpdateLossScaleManager(init_loss_scale={self._init_scale:g}, "
                f"incr_every_n_steps={self.incr_every_n_steps}, "
                f"decr_every_n_nan_or_inf={self.decr_every_n_nan_or_inf}, "
                f"incr_ratio={self.incr_ratio:g}, decr_ratio={self.decr_ratio:g})")


#: the CANN AMP guide's ``loss_scale`` key given to session_config / enable:
#: the default of later AMP_Optimizer calls that name no manager
_config_loss_scale = None


def set_default_loss_scale(value):
    """Record ``loss_scale`` ('dynamic' or a number >= 1, validated by
    :mod:`npu_amp_tf.options`) given to ``session_config`` / ``enable``; None clears."""
    global _config_loss_scale
    _config_loss_scale = None if value is None else OPTIONS["loss_scale"].convert(value, "loss_scale")
    if value is not None:
        logger.info("loss_scale=%r (session_config/enable): default manager of AMP_Optimizer", value)


def make_manager(loss_scale_manager, options: Options) -> LossScaleManager:
    """Resolve ``AMP_Optimizer``'s ``loss_scale_manager`` argument.  With no
    manager, the ``loss_scale`` option ('dynamic' or a number) decides; when
    it was not given, a ``loss_scale`` set through session_config / enable."""
    if isinstance(loss_scale_manager, LossScaleManager):
        return loss_scale_manager
    if loss_scale_manager is None:
        ls = options.loss_scale if "loss_scale" in options.explicit else (
            _config_loss_scale if _config_loss_scale is not None else "dynamic")
        if ls != "dynamic":
            return FixedLossScaleManager(ls, options.enable_overflow_check)
    if loss_scale_manager is None or (isinstance(loss_scale_manager, str)
                                      and loss_scale_manager.strip().lower() == "dynamic"):
        m = ExponentialUpdateLossScaleManager(
            options.init_loss_scale, options.incr_every_n_steps, options.decr_every_n_nan_or_inf,
            options.incr_ratio, options.decr_ratio, min_loss_scale=options.min_loss_scale,
            max_loss_scale=options.max_loss_scale)
        return m
    if isinstance(loss_scale_manager, (int, float)) and not isinstance(loss_scale_manager, bool):
        return FixedLossScaleManager(loss_scale_manager, options.enable_overflow_check)
    raise OptionError(
        f"loss_scale_manager={loss_scale_manager!r} is not valid; accepted: None or 'dynamic' "
        "(dynamic loss scaling), a number >= 1 (fixed scale), or a FixedLossScaleManager / "
        "ExponentialUpdateLossScaleManager instance")


def non_amp_variables(graph=None):
    """TF1: global variables minus the loss-scale state; use as
    ``Saver(var_list=...)`` to restore a checkpoint written without AMP."""
    graph = graph or tf.compat.v1.get_default_graph()
    amp = {id(v) for v in graph.get_collection(LOSS_SCALE_COLLECTION)}
    return [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            if id(v) not in amp]


class _EventLog:
    """Plain (untracked) holder of the python-side event history."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.events = []
        self.out_of_band = 0
        self.band_warned_at = 0
        self.collapsed_warned = False


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
