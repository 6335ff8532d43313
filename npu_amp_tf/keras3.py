"""Keras 3 entry point: ``AMP_Optimizer`` for Keras 3 optimizers (TensorFlow backend).

On TF >= 2.16 ``tf.keras`` is Keras 3.  ``npu_amp_tf.AMP_Optimizer(keras.optimizers.AdamW())``
returns an optimizer that behaves like Keras 3's own
``keras.optimizers.LossScaleOptimizer`` (same interface: ``scale_loss``,
``apply``/``apply_gradients`` on gradients of the scaled loss, ``model.fit``
unchanged) with CANN's loss-scale managers and defaults (initial scale 128,
hysteresis), the project's single fused finiteness check, FP32 master
weights, ``keep_fp16_copies``, ``gradient_accumulation_steps``, the
loss-scale history and TensorBoard summaries::

    opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.AdamW(1e-3))
    model.compile(optimizer=opt, loss=...)       # model.fit works unchanged

    # custom loop, Keras 3 style (what model.fit does):
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(loss_fn(model(x), y))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables))

    # custom loop, Keras 2 LossScaleOptimizer style:
    with tf.GradientTape() as tape:
        scaled = opt.get_scaled_loss(loss_fn(model(x), y))
    grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
    opt.apply_gradients(zip(grads, model.trainable_variables))

Which gradients ``apply`` expects: gradients of the scaled loss (Keras 3's
convention, so ``model.fit`` works), unless ``get_unscaled_gradients`` was
called since the last ``apply`` (Keras 2's convention): then they are taken
as already unscaled.  The decision is made in Python program order, so it
holds inside ``tf.function`` too.

Design (the reasons):

* The returned object is an instance of a subclass of the wrapped
  optimizer's own class, rebuilt from its config (as for Keras 2).  Its
  ``variables`` (slots, ``iterations``, ...) are exactly those of the plain
  optimizer, so ``.keras`` files and ``tf.train.Checkpoint``s load in both
  directions; the loss-scale state is one extra checkpoint child
  ``loss_scale_manager``.  The class is also nominally a
  ``keras.optimizers.LossScaleOptimizer`` (every attribute that class
  defines resolves to the wrapped optimizer's implementation or to this
  module's), so ``model.compile`` under a ``mixed_float16`` policy does not
  wrap it a second time.
* The update runs inside the finite branch of the manager's single
  ``tf.cond``: on overflow, variables, slots and ``iterations`` keep their
  exact bits.
* ``tf.distribute``: Keras 3 TF optimizers all-reduce the gradients inside
  ``apply`` (there is no public switch to skip it, unlike Keras 2's
  ``skip_gradients_aggregation``), so here each replica unscales and checks
  its local gradients (one fused check), the verdict is all-reduced (one
  scalar collective: an overflow on any replica skips the step on every
  replica), and the update then runs Keras's own all-reduce and apply from
  cross-replica context.  ``allreduce_dtype``/``bucket_size_mb`` therefore
  cannot apply to Keras 3 optimizers under a strategy and are refused there.
* ``stateless_apply``: the TensorFlow backend of Keras 3 never calls it and
  refuses it (``ValueError``), for plain and loss-scaled optimizers alike;
  this module keeps that behaviour.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from . import _tf
from .errors import NpuAmpError, OptionError
from . import amp_core
from .loss_scale import make_manager
from .optimizer import AmpCore, _options, check_strategy, fused_unscale_and_check

#: ``keras.saving`` package prefix of the registered AMP classes
PACKAGE = "npu_amp_tf"


def keras3():
    """The Keras 3 module, or None when the installed ``keras`` is older."""
    try:
        import keras
    except ImportError:  # pragma: no cover
        return None
    return keras if int(keras.__version__.split(".")[0]) >= 3 else None


def is_keras3_optimizer(opt) -> bool:
    k = keras3()
    return k is not None and isinstance(opt, k.optimizers.Optimizer)


# ---------------------------------------------------------------------------
# class construction
# ---------------------------------------------------------------------------
_NOT_COPIED = {"__module__", "__doc__", "__dict__", "__weakref__", "__qualname__"}


def _resolve(base, name):
    for klass in base.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


@functools.lru_cache(maxsize=None)
def _mixin_names():
    """Every name the mixin and its shared base define (these win over LossScaleOptimizer's)."""
    return frozenset().union(*(vars(c) for c in _AmpKeras3Mixin.__mro__ if c is not object))


@functools.lru_cache(maxsize=None)
def amp_class(base):
    """``AMP_<base>``: ``base`` plus loss scaling, nominally a Keras LossScaleOptimizer."""
    k = keras3()
    lso = k.optimizers.LossScaleOptimizer
    ns = {"_npu_amp_base": base, "__module__": __name__,
          "__doc__": f"{base.__name__} with npu_amp_tf loss scaling (see npu_amp_tf.keras3)."}
    # Everything LossScaleOptimizer defines resolves to the wrapped class (its
    # __init__, variables, iterations, learning_rate, build, ...) unless the
    # mixin defines it: the LossScaleOptimizer base is for isinstance only.
    for name in vars(lso):
        if name in _NOT_COPIED or name in _mixin_names():
            continue
        attr = _resolve(base, name)
        if attr is not None:
            ns[name] = attr
    name = f"AMP_{base.__name__}"
    if k.saving.get_registered_object(f"{PACKAGE}>{name}") is not None:
        # another optimizer class of the same name (a user subclass called "Adam")
        name = f"AMP_{base.__module__.replace('.', '_')}_{base.__name__}"
    cls = type(name, (_AmpKeras3Mixin, lso, base), ns)
    # model.save/load_model in this process find the class by its registered name; in a
    # fresh process custom_objects() rebuilds the built-in ones (user subclasses: call
    # amp_class(MyOptimizer) or AMP_Optimizer(MyOptimizer()) before loading)
    return k.saving.register_keras_serializable(package=PACKAGE)(cls)


def custom_objects() -> dict:
    """``{registered name: class}`` of the loss-scaled version of every Keras 3 optimizer."""
    k = keras3()
    if k is None:
        return {}
    out = {}
    for name in dir(k.optimizers):
        obj = getattr(k.optimizers, name)
        if (isinstance(obj, type) and issubclass(obj, k.optimizers.Optimizer)
                and obj is not k.optimizers.Optimizer
                and not issubclass(obj, k.optimizers.LossScaleOptimizer)
                and obj.__module__.startswith("keras")):
            cls = amp_class(obj)
            out[k.saving.get_registered_name(cls)] = cls
    return out


def LossScaleOptimizer(opt, loss_scale_manager=None, is_distributed=False, **options):  # noqa: N802
    """Keras 3 loss-scaling optimizer (what :func:`npu_amp_tf.AMP_Optimizer`
    returns for a Keras 3 optimizer).  Options as for ``AMP_Optimizer``."""
    k = keras3()
    if k is None or not isinstance(opt, k.optimizers.Optimizer):
        raise OptionError(f"opt={opt!r} is not a Keras 3 optimizer")
    if k.backend.backend() != "tensorflow":
        raise OptionError(f"opt={type(opt).__name__}: Keras backend "
                          f"{k.backend.backend()!r} is not supported; accepted: 'tensorflow'")
    if isinstance(opt, (_AmpKeras3Mixin, k.optimizers.LossScaleOptimizer)):
        raise OptionError(f"opt={type(opt).__name__} is already loss-scaled; wrap it only once")
    if opt.built:
        raise OptionError(f"opt={type(opt).__name__} is already built (it has slots); "
                          "accepted: a freshly constructed optimizer")
    if opt.loss_scale_factor is not None:
        raise OptionError(f"opt={type(opt).__name__} has loss_scale_factor="
                          f"{opt.loss_scale_factor!r}; accepted: None (AMP_Optimizer scales "
                          "the loss itself)")
    opts = _options(options)
    if opt.gradient_accumulation_steps and opts.gradient_accumulation_steps > 1:
        raise OptionError(
            f"gradient_accumulation_steps is set twice: {opt.gradient_accumulation_steps} on "
            f"{type(opt).__name__} and {opts.gradient_accumulation_steps} on AMP_Optimizer; "
            "accepted: one of them")
    if tf.distribute.has_strategy():
        _check_distributed_options(opts)
    manager = make_manager(loss_scale_manager, opts)
    new = amp_class(type(opt))._npu_amp_rebuild(opt)
    new._npu_amp_setup(opt, manager, AmpCore(manager, opts, is_distributed))
    return new


def _check_distributed_options(o):
    if tf.as_dtype(o.allreduce_dtype) != tf.float32 or (o.bucket_size_mb or 0) > 0:
        raise OptionError(
            f"allreduce_dtype={o.allreduce_dtype!r}, bucket_size_mb={o.bucket_size_mb!r}: "
            "a Keras 3 optimizer all-reduces the gradients itself in float32 without "
            "packing; accepted with Keras 3 under tf.distribute: the defaults "
            "(allreduce_dtype='float32', bucket_size_mb=0)")


def _tf_var(v):
    """The tf.Variable behind a Keras 3 variable (public ``Variable.value``)."""
    return v if isinstance(v, tf.Variable) else v.value


class _AmpKeras3Mixin(amp_core.KerasAmpMixin):
    """Methods added on top of the wrapped Keras 3 optimizer's class (the
    serialization and loss-scale properties shared with Keras 2 are in
    :class:`npu_amp_tf.amp_core.KerasAmpMixin`).

    Methods call the wrapped class explicitly (``self._npu_amp_base``), never
    ``super()``: the next class in the MRO is LossScaleOptimizer.
    """

    _npu_amp_wrap = staticmethod(LossScaleOptimizer)

    def _npu_amp_setup(self, inner, manager, core):
        # plain attributes (not tracked): the passed optimizer and the step logic
        self.__dict__["_npu_amp_inner"] = inner
        self.__dict__["_npu_amp_core"] = core
        self.__dict__["_npu_amp_unscaled_next"] = False
        # tracked: the loss-scale state is one checkpoint child
        self.loss_scale_manager = manager

    # ---------------------------------------------------- LSO interface
    @property
    def dynamic_scale(self):
        """The current loss scale (float32 variable), as Keras 3's LossScaleOptimizer."""
        return self.loss_scale_manager.get_loss_scale()

    def scale_loss(self, loss):
        """Keras 3: the loss times the current scale (``model.fit`` calls this)."""
        return self._npu_amp_core.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """Unscale (FP32 arithmetic); the next ``apply`` takes unscaled gradients."""
        self.__dict__["_npu_amp_unscaled_next"] = True
        return amp_core.KerasAmpMixin.get_unscaled_gradients(self, grads)

    def check_finite(self, grads):
        """One fused finiteness check over ``grads`` (scalar bool)."""
        return fused_unscale_and_check(list(grads), None, True)[1]

    def fp16_copy(self, var):
        """The FP16 working copy of ``var`` (``keep_fp16_copies=True``) or None."""
        return self._npu_amp_core.fp16_copy(_tf_var(var))

    # ------------------------------------------------------------- training
    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return _tf.keras3_iterations(self)

    def apply(self, grads, trainable_variables=None):
        scaled = not self.__dict__.get("_npu_amp_unscaled_next", False)
        self.__dict__["_npu_amp_unscaled_next"] = False
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError("When passing `grads` without `variables`, the optimizer "
                                 "must already be built; call `optimizer.build(vars)` first")
            trainable_variables = _tf.keras3_trainable_variables(self)
        kvars = list(trainable_variables)
        if not self.built:
            with tf.init_scope():
                self.build(kvars)
        base = self._npu_amp_base
        by_id = {id(_tf_var(v)): v for v in kvars}

        def apply_local(pairs):
            base.apply(self, [g for g, _ in pairs], [by_id[id(v)] for _, v in pairs])

        core = self._npu_amp_core
        gv = [(g, _tf_var(v)) for g, v in zip(grads, kvars) if g is not None]
        if not gv:
            raise ValueError(f"No gradients provided for any variable: {[v.name for v in kvars]}")
        strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        if strategy is None:
            core.step(gv, scaled, apply_local)
            return
        self._npu_amp_apply_distributed(strategy, gv, scaled, by_id)

    def _npu_amp_apply_distributed(self, strategy, gv, scaled, by_id):
        core = self._npu_amp_core
        check_strategy(strategy)
        core._check_accumulation(strategy)  # pylint: disable=protected-access
        _check_distributed_options(core.options)
        if tf.distribute.in_cross_replica_context():
            raise NpuAmpError("AMP_Optimizer.apply must be called in replica context "
                              "(inside strategy.run), not in cross-replica context")
        grads = [g for g, _ in gv]
        var_list = [v for _, v in gv]
        core.prepare(var_list)
        unscaled, finite = fused_unscale_and_check(
            grads, core.inv_scale() if scaled else None, core.check)
        ctx = tf.distribute.get_replica_context()
        if finite is not None:
            # one scalar collective: every replica gets the same verdict
            bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                 tf.cast(tf.logical_not(finite), tf.float32))
            finite = tf.equal(bad, 0.0)
        else:
            finite = tf.constant(True)
        base = self._npu_amp_base
        kvars = [by_id[id(v)] for v in var_list]

        def merge_fn(strat, unscaled, finite):
            finite = strat.experimental_local_results(finite)[0]

            def do_apply():
                # Keras's own all-reduce and update, replica by replica
                strat.extended.call_for_each_replica(
                    lambda g: base.apply(self, list(g), kvars), args=(unscaled,))
                return core.refresh_copies(var_list)

            op = core.manager.update_loss_scale(finite, apply_fn=do_apply)
            if not tf.executing_eagerly():
                core.manager.summaries()
            return op

        ctx.merge_call(merge_fn, args=(unscaled, finite))
