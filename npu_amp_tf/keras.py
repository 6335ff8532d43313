"""Keras entry point: the loss-scaling optimizer for ``model.fit`` and custom loops.

Keras 2 is ``tf.keras`` on TF 2.15 and the ``tf_keras`` package on newer TF
(where ``tf.keras`` is Keras 3).  Both Keras 2 optimizer families are
supported: the default ``optimizers.Adam`` etc. and ``optimizers.legacy.*``.
Keras 3 optimizers (``tf.keras`` on TF >= 2.16) are handed to
:mod:`npu_amp_tf.keras3`, which has the same behaviour on Keras 3's interface.

::

    keras = npu_amp_tf.keras.keras_module()          # tf.keras or tf_keras
    opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss=...)           # model.fit works unchanged

    # custom loop (same API as Keras's LossScaleOptimizer):
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
        scaled = opt.get_scaled_loss(loss)
    grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
    opt.apply_gradients(zip(grads, model.trainable_variables))
    # or simply: opt.minimize(loss, model.trainable_variables, tape=tape)

The returned optimizer is an instance of a subclass of the wrapped
optimizer's own class (rebuilt from its config), so slots, ``iterations``
and the checkpoint layout are exactly those of the plain optimizer plus one
child ``loss_scale_manager``: checkpoints load in both directions.  It also
implements Keras's ``BaseLossScaleOptimizer`` interface, so ``compile()``
under a ``mixed_float16`` policy does not wrap it a second time.

On a skipped (overflow) step ``optimizer.iterations`` does not advance, like
every other piece of optimizer state; ``model.fit`` counts batches itself,
so it never stalls.
"""
from __future__ import annotations

import functools
import importlib

import tensorflow as tf

from . import _tf
from .errors import OptionError
from .loss_scale import make_manager
from . import amp_core
from .amp_core import AmpCore, _options


def keras_module():
    """The Keras 2 module: ``tf.keras`` when it is Keras 2, else ``tf_keras``."""
    import keras as _k  # noqa: F401  (tf.keras resolves to this on 2.15)

    if int(_k.__version__.split(".")[0]) < 3:
        return tf.keras
    try:
        import tf_keras
    except ImportError:
        raise OptionError("Keras 2 is needed for npu_amp_tf.keras on this TensorFlow "
                          f"({tf.__version__}, Keras {_k.__version__}); install tf_keras") from None
    return tf_keras


def optimizer_family(opt):
    """'v2' (Keras 2 legacy OptimizerV2), 'new' (Keras 2 Optimizer), 'keras3' or None."""
    return _family_of_class(type(opt))


def _keras2_root(cls):
    """The public top-level Keras 2 module (``keras`` or ``tf_keras``) that ``cls``
    or its nearest Keras base class comes from (None: not Keras 2)."""
    for c in cls.__mro__:
        name = c.__module__.split(".")[0]
        if name not in ("keras", "tf_keras"):
            continue
        root = importlib.import_module(name)
        if int(getattr(root, "__version__", "3").split(".")[0]) < 3:
            return root
    return None


@functools.lru_cache(maxsize=None)
def _amp_class(base):
    root = _keras2_root(base)
    # the public LossScaleOptimizer is Keras 2's BaseLossScaleOptimizer (the
    # interface compile() checks under a mixed_float16 policy)
    lso = root.mixed_precision.LossScaleOptimizer
    bases = (_AmpKerasMixin, lso, base)
    family = "legacy_" if _family_of_class(base) == "v2" else ""
    # Keras's metaclass redirects construction to its own LossScaleOptimizer
    cls = _tf.keras2_lso_subclass(f"AMP_{family}{base.__name__}", bases,
                                  {"_npu_amp_base": base, "__module__": __name__}, lso)
    # model.save/load_model in this process find the class by name
    root.utils.get_custom_objects()[cls.__name__] = cls
    return cls


def _family_of_class(cls):
    """By the public base classes: Keras 2 ``optimizers.legacy.Optimizer`` ('v2'),
    Keras 2 ``optimizers.Optimizer`` ('new'), Keras 3 ``optimizers.Optimizer``."""
    from . import keras3 as _keras3

    k3 = _keras3.keras3()
    if k3 is not None and issubclass(cls, k3.optimizers.Optimizer):
        return "keras3"
    root = _keras2_root(cls)
    if root is None:
        return None
    if issubclass(cls, root.optimizers.legacy.Optimizer):
        return "v2"
    if issubclass(cls, root.optimizers.Optimizer):
        return "new"
    return None


def custom_objects() -> dict:
    """``{name: class}`` of the loss-scaled versions of every Keras optimizer,
    for ``load_model(path, custom_objects=npu_amp_tf.keras.custom_objects())``
    in a process that has not built them yet.  Holds the Keras 2 classes
    (``tf.keras`` on TF 2.15, ``tf_keras`` when installed) and the Keras 3
    ones (``keras`` 3, under their registered names ``npu_amp_tf>AMP_<Name>``),
    so the same call works with either ``load_model``."""
    from . import keras3 as _keras3

    out = _keras3.custom_objects()
    try:
        k = keras_module()
    except OptionError:  # Keras 3 only (no tf_keras)
        return out
    for mod in (k.optimizers, k.optimizers.legacy):
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, type) and _family_of_class(obj) in ("v2", "new") and \
                    obj not in (k.optimizers.Optimizer, k.optimizers.legacy.Optimizer):
                cls = _amp_class(obj)
                out[cls.__name__] = cls
    return out


def LossScaleOptimizer(opt, loss_scale_manager=None, is_distributed=False, **options):  # noqa: N802
    """Keras 2 loss-scaling optimizer (what :func:`npu_amp_tf.AMP_Optimizer` returns
    for a Keras optimizer).  Options as for ``AMP_Optimizer``."""
    family = optimizer_family(opt)
    if family == "keras3":
        from . import keras3 as _keras3

        return _keras3.LossScaleOptimizer(opt, loss_scale_manager, is_distributed, **options)
    if family is None:
        raise OptionError(f"opt={opt!r} is not a Keras optimizer; accepted: a Keras 2 "
                          "(tf.keras on TF 2.15, tf_keras) or Keras 3 optimizer")
    if isinstance(opt, _AmpKerasMixin):
        raise OptionError(f"opt={type(opt).__name__} is already loss-scaled; wrap it only once")
    opts = _options(options)
    manager = make_manager(loss_scale_manager, opts)
    new = _amp_class(type(opt))._npu_amp_rebuild(opt)
    new._npu_amp_setup(opt, family, manager, AmpCore(manager, opts, is_distributed))
    return new


class _AmpKerasMixin(amp_core.KerasAmpMixin):
    """Methods added on top of the wrapped Keras 2 optimizer's class (the
    serialization and loss-scale properties shared with Keras 3 are in
    :class:`npu_amp_tf.amp_core.KerasAmpMixin`)."""

    _npu_amp_wrap = staticmethod(LossScaleOptimizer)

    def _npu_amp_setup(self, inner, family, manager, core):
        self.__dict__["_npu_amp_inner"] = inner
        self.__dict__["_npu_amp_family"] = family
        self.__dict__["_npu_amp_core"] = core
        self.__dict__["_npu_amp_manager"] = manager
        _tf.track_trackable(self, manager, name="loss_scale_manager", overwrite=True)

    # ---------------------------------------------------- Keras LSO interface
    @property
    def loss_scale_manager(self):
        return self._npu_amp_manager

    @property
    def dynamic_counter(self):
        return self._npu_amp_manager.good_steps if self.dynamic else None

    def fp16_copy(self, var):
        return self._npu_amp_core.fp16_copy(var)

    # ------------------------------------------------------------- training
    def minimize(self, loss, var_list, *args, tape=None, **kwargs):
        base = self._npu_amp_base
        tape = tape if tape is not None else tf.GradientTape()
        if callable(loss):
            scaled = self._npu_amp_core.scale_loss(loss)
        else:
            with tape:
                scaled = self._npu_amp_core.scale_loss(loss)
        name = kwargs.pop("name", None)
        if self._npu_amp_family == "v2":
            grad_loss = kwargs.pop("grad_loss", args[0] if args else None)
            if len(args) > 1:
                name = args[1]
            gv = _tf.keras2_compute_gradients(base, self, scaled, var_list, grad_loss, tape)
        else:
            gv = base.compute_gradients(self, scaled, var_list, tape)
        return self._npu_amp_apply(list(gv), scaled=True, name=name)

    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Apply UNSCALED gradients (as from ``get_unscaled_gradients``)."""
        return self._npu_amp_apply(list(grads_and_vars), scaled=False, name=name)

    def _npu_amp_apply(self, gv, scaled, name):
        base = self._npu_amp_base
        var_list = [v for g, v in gv if g is not None]
        if self._npu_amp_family == "v2":
            flag = {"experimental_aggregate_gradients": False}
            with tf.init_scope():
                _tf.keras2_create_all_weights(self, var_list)
        else:
            flag = {"skip_gradients_aggregation": True}
            with tf.init_scope():
                self.build(var_list)

        def apply_local(pairs):
            return base.apply_gradients(self, pairs, name=name, **flag)

        def apply_cross_replica(strategy, grads, var_list):
            return strategy.extended.call_for_each_replica(
                lambda g: apply_local(list(zip(g, var_list))), args=(grads,))

        return self._npu_amp_core.step(gv, scaled, apply_local, apply_cross_replica)
