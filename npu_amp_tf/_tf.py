"""The API package's one door into TensorFlow and Keras internals.

Every private TensorFlow / Keras module (``tensorflow.python.*``,
``keras.src``, ``tf_keras.src``, ``tf.__internal__``) and private attribute
``npu_amp_tf`` uses is reached through a function here, so a release that
moves one breaks this file only, with a :class:`TFCompatError` naming the
TensorFlow version and the missing internal.  Where a public API does the
same thing, callers use it directly (``tf.RegisterGradient``, ``tf.as_dtype``,
``tf.make_ndarray``, ``tf.compat.v1.train.SessionRunHook``) and it is not
wrapped here.

Each function states the versions it was checked on (both CI lanes:
TensorFlow 2.15.1 with Keras 2.15, and TensorFlow 2.21.0 with Keras 3 and
tf_keras 2.21; tests/test_tf_compat_layer.py exercises every one of them)
and the public alternative, where one exists.  The engine's internals
(OpDefs, kernels, grappler) live in :mod:`graph_passes._tf`; the helpers
used from there are re-exported below.
"""
from __future__ import annotations

import contextlib

from graph_passes._tf import (  # noqa: F401  (re-exported)
    CHECKED_ON,
    TFCompatError,
    compat_error,
    optimize_graph,
    require_attr,
    require_module,
    tf_version,
)


# ---------------------------------------------------------------------------
# eager context (config.enable / amp_scope)
# ---------------------------------------------------------------------------
def eager_context():
    """The process's eager ``Context`` object.

    ``tensorflow.python.eager.context.context()``; checked on TF 2.15.1 and
    2.21.0.  Public alternative: none for the object itself (``tf.config.*``
    sets individual fields of it)."""
    return require_attr(require_module("tensorflow.python.eager.context"), "context", "context")()


def has_context_config(ctx) -> bool:
    """Whether ``ctx`` keeps its base ``ConfigProto`` in the private ``_config``
    attribute (true on TF 2.15.1 and 2.21.0).  Callers fall back to per-thread
    function call options when it does not."""
    return hasattr(ctx, "_config")


def context_config(ctx):
    """The eager context's base ``ConfigProto`` (``ctx._config``; None when
    unset or when the layout differs), which every thread's function call
    options derive from.  Checked on TF 2.15.1 and 2.21.0.  Public
    alternative: none (``tf.config`` exposes single fields only)."""
    return getattr(ctx, "_config", None)


def set_context_config(ctx, config) -> None:
    """Replace the eager context's base ``ConfigProto`` (``ctx._config = config``).
    Checked on TF 2.15.1 and 2.21.0.  Public alternative: none."""
    if not has_context_config(ctx):
        raise compat_error("'Context._config'", None, "npu_amp_tf.amp_scope (per thread)")
    ctx._config = config  # pylint: disable=protected-access


def function_call_options(executor_type, config_proto):
    """A ``FunctionCallOptions`` for ``ctx.function_call_options``.

    ``tensorflow.python.eager.context.FunctionCallOptions``; checked on TF
    2.15.1 and 2.21.0.  Public alternative: none."""
    mod = require_module("tensorflow.python.eager.context")
    cls = require_attr(mod, "FunctionCallOptions", "context")
    return cls(executor_type=executor_type, config_proto=config_proto)


# ---------------------------------------------------------------------------
# graph building
# ---------------------------------------------------------------------------
def attr_scope(graph, attrs: dict):
    """Context manager: every op ``graph`` builds inside it gets ``attrs``
    (``{name: AttrValue}``); works for ``tf.Graph`` and ``tf.function``
    FuncGraphs.

    ``tf.Graph._attr_scope``; checked on TF 2.15.1 and 2.21.0.  Public
    alternative: none (setting the attr on each op afterwards, see
    :func:`set_op_attr`)."""
    return require_attr(graph, "_attr_scope", "Graph")(attrs)


def set_op_attr(op, name: str, value) -> None:
    """Set attr ``name`` (an ``AttrValue``) on an existing ``tf.Operation``.

    ``tf.Operation._set_attr``; checked on TF 2.15.1 and 2.21.0.  Public
    alternative: none after creation (:func:`attr_scope` while building)."""
    require_attr(op, "_set_attr", "Operation")(name, value)


def has_default_summary_writer() -> bool:
    """Whether a default ``tf.summary`` writer is active.

    ``tensorflow.python.ops.summary_ops_v2.has_default_writer``; checked on TF
    2.15.1 and 2.21.0.  Public alternative: none (``tf.summary.record_if``
    controls recording, not the writer)."""
    mod = require_module("tensorflow.python.ops.summary_ops_v2")
    return bool(require_attr(mod, "has_default_writer", "summary_ops_v2")())


# ---------------------------------------------------------------------------
# tracking and TF1 optimizer internals (optimizer.py, npu_bridge shims)
# ---------------------------------------------------------------------------
def delegating_trackable_mixin():
    """``tf.__internal__.tracking.DelegatingTrackableMixin``: a base class that
    forwards checkpoint tracking to a wrapped object.  Checked on TF 2.15.1
    and 2.21.0.  Public alternative: none."""
    import tensorflow as tf

    internal = require_attr(tf, "__internal__", "tensorflow")
    tracking = require_attr(internal, "tracking", "tf.__internal__")
    return require_attr(tracking, "DelegatingTrackableMixin", "tf.__internal__.tracking")


def track_trackable(obj, trackable, name: str, overwrite: bool = True):
    """Add ``trackable`` as the checkpoint child ``name`` of ``obj``.

    ``Trackable._track_trackable``; checked on TF 2.15.1 and 2.21.0 (TF
    trackables, Keras 2 and tf_keras optimizers).  Public alternative: an
    attribute assignment on an ``AutoTrackable`` (optimizers are not one)."""
    return require_attr(obj, "_track_trackable")(trackable, name=name, overwrite=overwrite)


def create_slots(opt, var_list) -> None:
    """Create the slots of ``tf.compat.v1.train.Optimizer`` ``opt`` for ``var_list``.

    ``Optimizer._create_slots``; checked on TF 2.15.1 and 2.21.0.  Public
    alternative: none (``apply_gradients`` creates them, inside its own
    control flow)."""
    require_attr(opt, "_create_slots")(var_list)


def distributed_apply(opt, distribution, grads_and_vars, global_step=None, name=None):
    """``tf.compat.v1.train.Optimizer._distributed_apply``: the cross-replica
    update with already-reduced gradients.  Checked on TF 2.15.1 and 2.21.0.
    Public alternative: ``apply_gradients`` in replica context (which reduces
    the gradients itself)."""
    return require_attr(opt, "_distributed_apply")(distribution, grads_and_vars, global_step, name)


def create_or_restore_slot_variable(opt, slot_variable_position, slot_name, variable):
    """``tf.compat.v1.train.Optimizer._create_or_restore_slot_variable`` (the
    hook checkpoint restore calls for deferred slots).  Checked on TF 2.15.1
    and 2.21.0.  Public alternative: none."""
    return require_attr(opt, "_create_or_restore_slot_variable")(
        slot_variable_position, slot_name, variable)


def supported_strategy_extended_types() -> tuple:
    """The ``strategy.extended`` classes whose all-reduce AMP_Optimizer handles:
    ``MirroredExtended`` (also the base of MultiWorkerMirroredStrategy's) and
    ``OneDeviceExtended``.

    ``tensorflow.python.distribute.{mirrored,one_device}_strategy``; checked on
    TF 2.15.1 and 2.21.0.  Public alternative: ``isinstance(strategy,
    tf.distribute.MirroredStrategy)`` etc., which misses the compat.v1 and
    multi-worker classes."""
    ms = require_module("tensorflow.python.distribute.mirrored_strategy")
    od = require_module("tensorflow.python.distribute.one_device_strategy")
    return (require_attr(ms, "MirroredExtended", "mirrored_strategy"),
            require_attr(od, "OneDeviceExtended", "one_device_strategy"))


# ---------------------------------------------------------------------------
# Keras internals (keras.py: Keras 2 / tf_keras; keras3.py: Keras 3)
# ---------------------------------------------------------------------------
def keras2_lso_subclass(name: str, bases: tuple, namespace: dict, lso):
    """A class ``name(*bases)`` where ``bases`` include ``lso``, Keras 2's
    ``mixed_precision.LossScaleOptimizer``, whose metaclass redirects
    construction to its own LossScaleOptimizer: the new class's metaclass
    derives from it and constructs instances of the class itself.

    Relies on Keras 2's ``LossScaleOptimizerMetaclass.__call__``; checked on
    tf.keras 2.15 (TF 2.15.1) and tf_keras 2.21 (TF 2.21.0).  Public
    alternative: none (wrapping instead of subclassing changes the checkpoint
    layout)."""
    lso_meta = type(lso)

    class meta(lso_meta):  # noqa: N801
        def __call__(cls, *args, **kwargs):
            return type.__call__(cls, *args, **kwargs)

    return meta(name, bases, namespace)


def keras2_compute_gradients(base, opt, loss, var_list, grad_loss=None, tape=None):
    """Keras 2 legacy ``OptimizerV2._compute_gradients`` of class ``base`` on
    ``opt`` (the tape-based gradient step ``minimize`` uses).  Checked on
    tf.keras 2.15 and tf_keras 2.21.  Public alternative: ``tape.gradient``."""
    return require_attr(base, "_compute_gradients")(opt, loss, var_list=var_list,
                                                    grad_loss=grad_loss, tape=tape)


def keras2_create_all_weights(opt, var_list) -> None:
    """Keras 2 legacy ``OptimizerV2._create_all_weights``: slots and
    ``iterations`` for ``var_list``.  Checked on tf.keras 2.15 and tf_keras
    2.21.  Public alternative: none (``apply_gradients`` creates them)."""
    require_attr(opt, "_create_all_weights")(var_list)


def keras3_iterations(opt):
    """A Keras 3 optimizer's own ``iterations`` variable (``opt._iterations``).
    Checked on Keras 3 with TF 2.21.0.  Public alternative: ``opt.iterations``,
    a property that subclasses (LossScaleOptimizer) redefine."""
    return require_attr(opt, "_iterations")


def keras3_trainable_variables(opt):
    """The variables a built Keras 3 optimizer tracks (``opt._trainable_variables``).
    Checked on Keras 3 with TF 2.21.0.  Public alternative: none."""
    return require_attr(opt, "_trainable_variables")


# ---------------------------------------------------------------------------
# sessions, tools
# ---------------------------------------------------------------------------
def session_module():
    """``tensorflow.python.client.session`` (tf_adapter's ``npu_init`` exports
    it as ``session``).  Checked on TF 2.15.1 and 2.21.0.  Public alternative:
    ``tf.compat.v1.Session``."""
    return require_module("tensorflow.python.client.session")


def base_session_class():
    """``BaseSession``, the base of every ``tf.compat.v1.Session``,
    ``InteractiveSession`` and monitored/Estimator session: the one class a
    hook on session creation or ``run`` must wrap.  Its signatures
    ``__init__(self, target='', graph=None, config=None)`` and ``run(self,
    fetches, feed_dict=None, options=None, run_metadata=None)`` are unchanged
    since TF 1.0; checked on TF 2.15.1 and 2.21.0.  Public alternative:
    ``SessionRunHook`` (``MonitoredSession`` only)."""
    return require_attr(session_module(), "BaseSession", "session")


@contextlib.contextmanager
def patched_base_session(attr: str, make):
    """While active, ``BaseSession.<attr>`` is ``make(original)``; restored on exit.
    See :func:`base_session_class`."""
    cls = base_session_class()
    orig = require_attr(cls, attr, "BaseSession")
    setattr(cls, attr, make(orig))
    try:
        yield orig
    finally:
        setattr(cls, attr, orig)


def step_stats_timeline(step_stats, graph=None):
    """A ``Timeline`` over ``StepStats`` (``generate_chrome_trace_format``).

    ``tensorflow.python.client.timeline.Timeline``; checked on TF 2.15.1 and
    2.21.0.  Public alternative: ``tf.profiler`` (TF2 traces, not TF1
    ``RunMetadata``)."""
    mod = require_module("tensorflow.python.client.timeline")
    return require_attr(mod, "Timeline", "timeline")(step_stats, graph)


def tfdbg():
    """TF1 debugger modules ``(debug_data, debug_utils)`` (tensor watches and
    their dump directory reader).

    ``tensorflow.python.debug.lib``; checked on TF 2.15.1 and 2.21.0.  Public
    alternative: ``tf.debugging.experimental.enable_dump_debug_info`` (TF2
    eager/functions only)."""
    return (require_module("tensorflow.python.debug.lib.debug_data"),
            require_module("tensorflow.python.debug.lib.debug_utils"))


def convert_variables_to_constants_v2(concrete_function):
    """A copy of a ``ConcreteFunction`` with its variables frozen into constants.

    ``tensorflow.python.framework.convert_to_constants``; checked on TF 2.15.1
    and 2.21.0.  Public alternative: none for TF2 functions
    (``tf.compat.v1.graph_util.convert_variables_to_constants`` is TF1 only)."""
    mod = require_module("tensorflow.python.framework.convert_to_constants")
    return require_attr(mod, "convert_variables_to_constants_v2", "convert_to_constants")(
        concrete_function)


__all__ = [
    "CHECKED_ON", "TFCompatError", "compat_error", "require_attr", "require_module", "tf_version",
    "optimize_graph", "eager_context", "has_context_config", "context_config", "set_context_config",
    "function_call_options", "attr_scope", "set_op_attr", "has_default_summary_writer",
    "delegating_trackable_mixin", "track_trackable", "create_slots", "distributed_apply",
    "create_or_restore_slot_variable", "supported_strategy_extended_types", "keras2_lso_subclass",
    "keras2_compute_gradients", "keras2_create_all_weights", "keras3_iterations",
    "keras3_trainable_variables", "session_module", "base_session_class", "patched_base_session",
    "step_stats_timeline", "tfdbg", "convert_variables_to_constants_v2",
]
