"""Loss-scaling machinery shared by every ``AMP_Optimizer`` flavour.

``AmpCore`` (the step: scale, unscale, ONE finiteness check, apply under
``tf.cond``, accumulation, tf.distribute) and :func:`fused_unscale_and_check`
are used by the TF1 wrapper (:mod:`npu_amp_tf.optimizer`), the Keras 2 wrapper
(:mod:`npu_amp_tf.keras`) and any other front end (a Keras 3 optimizer).  They
live here, apart from the wrappers, so that the wrappers import this module and
not each other.

Loss-scaling arithmetic stays FP32 whatever the precision mode: every op that
:func:`fused_unscale_and_check` builds (the up-cast of low-precision gradients,
the ``grad * 1/scale`` multiply, the flatten/concat/``IsFinite``/``All`` check)
is created inside :func:`npu_amp_tf.precision.keep_dtype_scope`, so it carries
``_keep_dtype`` and the ``precision`` pass never converts it.  Un-scaling in
FP16 would flush exactly the small gradients loss scaling exists to keep, and
an FP16 check would turn a finite FP32 gradient above 65504 into a false
overflow.
"""
from __future__ import annotations

import tensorflow as tf

from . import _tf
from .errors import NpuAmpError, OptionError
from .loss_scale import LossScaleManager
from .options import Options
from .precision import keep_dtype_scope

#: TF1 collection of the FP16 working copies (``keep_fp16_copies=True``)
FP16_COPIES_COLLECTION = "npu_amp_tf_fp16_copies"


# ---------------------------------------------------------------------------
# tf.distribute support
# ---------------------------------------------------------------------------
def _current_strategy():
    if not tf.distribute.has_strategy():
        return None
    return tf.distribute.get_strategy()


def check_strategy(strategy):
    """Raise unless ``strategy`` is one this optimizer handles correctly."""
    if strategy is None:
        return
    if isinstance(strategy.extended, _tf.supported_strategy_extended_types()):
        return
    raise NpuAmpError(
        f"AMP_Optimizer does not support {type(strategy).__name__}: the overflow verdict and "
        "the loss scale could differ between replicas or parameter servers. Supported: "
        "no strategy, OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy")


def _comm_options(bucket_size_mb):
    if bucket_size_mb and bucket_size_mb > 0:
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=int(bucket_size_mb * 1024 * 1024))
    return tf.distribute.experimental.CommunicationOptions()


class _PreReducedExtended:
    """``strategy.extended`` whose ``batch_reduce_to`` is the identity: lets a
    TF1 optimizer's ``_distributed_apply`` update with gradients that this
    module already all-reduced (in ``allreduce_dtype``, with packing)."""

    def __init__(self, extended):
        self._extended = extended

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        return [v for v, _ in value_destination_pairs]

    def __getattr__(self, name):
        return getattr(self._extended, name)


class _PreReduced:
    def __init__(self, strategy):
        self._strategy = strategy
        self.extended = _PreReducedExtended(strategy.extended)

    def __getattr__(self, name):
        return getattr(self._strategy, name)


# ---------------------------------------------------------------------------
# the shared machinery
# ---------------------------------------------------------------------------
def _values(g):
    return g.values if isinstance(g, tf.IndexedSlices) else g


#: gradients with at least this many elements get their own IsFinite (their
#: flags join the single All); smaller ones are concatenated first
_BIG_TENSOR = 1 << 14


def fused_unscale_and_check(grads, inv_scale=None, check=True):
    """Unscale (optional) and check a list of gradients with ONE reduction.

    ``grads``: Tensors / IndexedSlices / None.  ``inv_scale``: float32 scalar
    or None (no unscaling).  Returns ``(grads_out, finite)`` where
    ``grads_out`` keeps each gradient's dtype and kind (unscaled in FP32) and
    ``finite`` is a scalar bool (or None when ``check`` is False).

    The check is ONE reduction over all gradients (dense values and
    IndexedSlices values), not one per variable: small gradients are
    flattened into one vector with a single ``IsFinite``; a big gradient
    (>= 16384 elements, where a copy costs more than the check) gets its own
    elementwise ``IsFinite``; all the flags are concatenated into a single
    ``All``.  (TF has no multi-tensor finiteness kernel on CPU.)  It runs on
    the scaled values: multiplying by ``1/scale <= 1`` cannot create or
    remove an inf/NaN.

    Every op built here is marked ``_keep_dtype`` (FP32 in every precision
    mode, see the module docstring); a low-precision gradient is cast up to
    FP32 *before* the multiply by ``1/scale``.
    """
    with keep_dtype_scope():
        return _unscale_and_check(grads, inv_scale, check)


def _unscale_and_check(grads, inv_scale, check):
    idx = [i for i, g in enumerate(grads) if g is not None]
    finite = None
    if check:
        if not idx:
            finite = tf.constant(True)
        else:
            small, flags = [], []
            flat_shape = tf.constant([-1])
            for i in idx:
                v = _values(grads[i])
                n = v.shape.num_elements()
                if n is not None and n >= _BIG_TENSOR:
                    # copying a big gradient costs more than its own IsFinite
                    flags.append(tf.reshape(tf.math.is_finite(v), flat_shape))
                else:
                    if v.dtype != tf.float32:
                        v = tf.cast(v, tf.float32)
                    small.append(tf.reshape(v, flat_shape))
            if small:
                flat = small[0] if len(small) == 1 else tf.concat(small, 0)
                flags.insert(0, tf.math.is_finite(flat))
            flags = flags[0] if len(flags) == 1 else tf.concat(flags, 0)
            finite = tf.reduce_all(flags)
    out = list(grads)
    if inv_scale is not None:
        if inv_scale.dtype != tf.float32:
            inv_scale = tf.cast(inv_scale, tf.float32)
        for i in idx:
            g = grads[i]
            v = _values(g)
            nv = v * inv_scale if v.dtype == tf.float32 else tf.cast(
                tf.cast(v, tf.float32) * inv_scale, v.dtype)
            out[i] = (tf.IndexedSlices(nv, g.indices, g.dense_shape)
                      if isinstance(g, tf.IndexedSlices) else nv)
    return out, finite


class AmpCore:
    """Loss-scaling step logic shared by the TF1 and Keras wrappers.

    ``apply_local(grads_and_vars)`` applies unscaled gradients with the wrapped
    optimizer (no aggregation); ``apply_cross_replica(strategy, grads, vars)``
    does the same from cross-replica context for tf.distribute.
    """

    def __init__(self, manager: LossScaleManager, options: Options, is_distributed=False):
        self.manager = manager
        self.options = options
        self.check = manager.enable_overflow_check
        self.accum_n = options.gradient_accumulation_steps
        self.allreduce_dtype = tf.as_dtype(options.allreduce_dtype)
        self.comm_options = _comm_options(options.bucket_size_mb)
        self.keep_fp16_copies = options.keep_fp16_copies
        self.is_distributed = bool(is_distributed)
        self._accum = None      # (graph, {var_ref: acc}, count)
        self._copies = {}       # var ref -> fp16 copy
        with tf.init_scope():
            if tf.executing_eagerly():
                strategy = _current_strategy()
                check_strategy(strategy)
                self._check_accumulation(strategy)
                manager.build()

    def _check_accumulation(self, strategy):
        if strategy is not None and self.accum_n > 1:
            raise OptionError(
                f"gradient_accumulation_steps={self.accum_n} is not supported under "
                f"{type(strategy).__name__} yet; accepted there: 1")

    # -------------------------------------------------------------- scaling
    def loss_scale(self):
        return self.manager.get_loss_scale()

    def scale_loss(self, loss):
        if callable(loss):
            return lambda: self.scale_loss(loss())
        loss = tf.convert_to_tensor(loss)
        if loss.dtype != tf.float32:
            loss = tf.cast(loss, tf.float32)
        return loss * tf.cast(self.loss_scale(), tf.float32)

    def inv_scale(self):
        with keep_dtype_scope():
            return tf.math.reciprocal(tf.cast(self.loss_scale(), tf.float32))

    def unscale(self, grads):
        out, _ = fused_unscale_and_check(list(grads), self.inv_scale(), check=False)
        return out

    # -------------------------------------------------------------- state
    def _graph_key(self):
        with tf.init_scope():
            return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()

    def _local_var(self, name, dtype, shape):
        """A zero-initialised, non-checkpointed helper variable (TF1: LOCAL_VARIABLES)."""
        with tf.init_scope():
            if tf.executing_eagerly():
                return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)
            return tf.compat.v1.get_variable(
                name, shape=shape, dtype=dtype, initializer=tf.compat.v1.zeros_initializer(),
                trainable=False, use_resource=True,
                collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def fp16_copy(self, var):
        """The FP16 working copy of ``var`` (``keep_fp16_copies=True``) or None."""
        return self._copies.get(var.ref())

    def prepare(self, var_list):
        """Create copies and accumulators before any tf.cond."""
        self.manager.build()
        if self.keep_fp16_copies:
            for v in var_list:
                if v.dtype.base_dtype != tf.float32 or v.ref() in self._copies:
                    continue
                name = v.name.split(":")[0] + "/Fp16Copy"
                with tf.init_scope():
                    if tf.executing_eagerly():
                        c = tf.Variable(tf.cast(v.read_value(), tf.float16), trainable=False,
                                        name=name.replace("/", "_"))
                    else:
                        # local (never checkpointed), initialised from the (restored) master
                        c = tf.compat.v1.get_variable(
                            name, dtype=tf.float16, trainable=False,
                            # (LOCAL_VARIABLES run after global init / restore)
                            initializer=tf.cast(v.read_value(), tf.float16),
                            use_resource=True,
                            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
                                         FP16_COPIES_COLLECTION])
                self._copies[v.ref()] = c
        if self.accum_n > 1:
            g = self._graph_key()
            if self._accum is None or self._accum[0] is not g:
                accs = {}
                for v in var_list:
                    name = v.name.split(":")[0].replace("/", "_") + "_npu_amp_accum"
                    accs[v.ref()] = self._local_var(name, tf.float32, v.shape)
                count = self._local_var("npu_amp_accum_count", tf.int64, ())
                self._accum = (g, accs, count)

    def refresh_copies(self, var_list):
        ops = []
        for v in var_list:
            c = self._copies.get(v.ref())
            if c is not None:
                ops.append(c.assign(tf.cast(v.read_value(), tf.float16), read_value=False))
        return tf.group(*ops)

    # -------------------------------------------------------------- the step
    def step(self, grads_and_vars, scaled, apply_local, apply_cross_replica=None,
             global_step=None):
        """Build/run one loss-scaled optimizer step.  Returns an op (graph) or None."""
        gv = [(g, v) for g, v in grads_and_vars if g is not None]
        if not gv:
            raise ValueError("No gradients provided for any variable: "
                             f"{[v.name for _, v in grads_and_vars]}")
        grads = [g for g, _ in gv]
        var_list = [v for _, v in gv]
        strategy = _current_strategy()
        check_strategy(strategy)
        if self.is_distributed and strategy is None:
            raise NpuAmpError(
                "is_distributed=True needs a tf.distribute MirroredStrategy or "
                "MultiWorkerMirroredStrategy scope (use strategy.run); Horovod/HCCL are not "
                "supported")
        self._check_accumulation(strategy)
        self.prepare(var_list)
        if strategy is not None and tf.distribute.in_cross_replica_context():
            raise NpuAmpError("AMP_Optimizer.apply_gradients must be called in replica context "
                              "(inside strategy.run), not in cross-replica context")
        if strategy is not None:
            return self._step_distributed(strategy, grads, var_list, scaled,
                                          apply_cross_replica, global_step)
        inv = self.inv_scale() if scaled else None
        grads, finite = fused_unscale_and_check(grads, inv, self.check)
        if self.accum_n > 1:
            op = self._accumulate(grads, var_list, finite, apply_local)
        else:
            def do_apply():
                with tf.control_dependencies([_as_dep(apply_local(list(zip(grads, var_list))))]):
                    return tf.group(self.refresh_copies(var_list))
            # one tf.cond: apply + counters (+ rare growth) | overflow (skip, shrink)
            op = self.manager.update_loss_scale(
                finite if finite is not None else tf.constant(True), apply_fn=do_apply)
        return self._finish(op, global_step)

    def _finish(self, op, global_step):
        if tf.executing_eagerly():
            if global_step is not None:
                global_step.assign_add(1)
            return None
        self.manager.summaries()
        if global_step is not None:
            with tf.control_dependencies([op]):
                return tf.compat.v1.assign_add(global_step, 1).op
        return op

    def _accumulate(self, grads, var_list, finite, apply_local):
        _, accs, count = self._accum
        n = self.accum_n
        acc_list = [accs[v.ref()] for v in var_list]
        if finite is None:
            finite = tf.constant(True)

        def add():
            adds = []
            for a, g in zip(acc_list, grads):
                if isinstance(g, tf.IndexedSlices):
                    g = tf.convert_to_tensor(tf.IndexedSlices(
                        tf.cast(g.values, tf.float32), g.indices, g.dense_shape))
                adds.append(a.assign_add(tf.cast(g, tf.float32), read_value=False))
            with tf.control_dependencies(adds):
                return count.assign_add(1)

        def reset():
            return tf.group(*[a.assign(tf.zeros_like(a), read_value=False) for a in acc_list],
                            count.assign(0, read_value=False))

        def discard():
            with tf.control_dependencies([reset()]):
                return tf.constant(0, tf.int64)

        c = tf.cond(finite, add, discard)
        do = tf.logical_and(finite, c >= n)

        def apply_acc():
            avg = [tf.cast(a.read_value() / n, v.dtype) for a, v in zip(acc_list, var_list)]
            with tf.control_dependencies([_as_dep(apply_local(list(zip(avg, var_list))))]):
                with tf.control_dependencies([self.refresh_copies(var_list)]):
                    return reset()

        applied = tf.cond(do, apply_acc, tf.no_op)
        # an overflow in any micro-step discards the accumulated update
        return tf.group(applied, self.manager.update_loss_scale(finite))

    def _step_distributed(self, strategy, grads, var_list, scaled, apply_cross_replica,
                          global_step):
        ctx = tf.distribute.get_replica_context()
        rd = self.allreduce_dtype
        scale = tf.cast(self.loss_scale(), tf.float32)
        send = []
        for g in grads:
            v = _values(g)
            if rd != tf.float32:
                v = tf.cast(v, tf.float32)
                if not scaled:
                    v = v * scale   # reduce scaled grads so FP16 keeps their range
                v = tf.cast(v, rd)
            send.append(tf.IndexedSlices(v, g.indices, g.dense_shape)
                        if isinstance(g, tf.IndexedSlices) else v)
        was_scaled = scaled or rd != tf.float32
        # one collective (packed by bucket_size_mb); an inf/NaN on any replica
        # makes the sum non-finite on every replica: all replicas agree.
        reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, send, options=self.comm_options)
        reduced = [(tf.IndexedSlices(tf.cast(r.values, g.values.dtype), r.indices, r.dense_shape)
                    if isinstance(r, tf.IndexedSlices) else tf.cast(r, g.dtype))
                   for r, g in zip(reduced, grads)]
        unscaled, finite = fused_unscale_and_check(
            reduced, tf.math.reciprocal(scale) if was_scaled else None, self.check)
        if finite is None:
            finite = tf.constant(True)

        def merge_fn(strat, unscaled, finite):
            finite = strat.experimental_local_results(finite)[0]

            def do_apply():
                with tf.control_dependencies([_as_dep(apply_cross_replica(strat, unscaled, var_list))]):
                    return tf.group(self.refresh_copies(var_list))
            ops = [self.manager.update_loss_scale(finite, apply_fn=do_apply)]
            if global_step is not None:
                with tf.control_dependencies(ops):
                    ops.append(global_step.assign_add(1, read_value=False))
            if not tf.executing_eagerly():
                self.manager.summaries()
            return tf.group(*ops)

        return ctx.merge_call(merge_fn, args=(unscaled, finite))


def _as_dep(x):
    if x is None:
        return tf.no_op()
    if isinstance(x, tf.Operation):
        return x
    if isinstance(x, (list, tuple)):
        return tf.group(*[_as_dep(i) for i in x])
    return tf.group(x) if isinstance(x, tf.Tensor) else tf.no_op()


def _options(options, source="AMP_Optimizer") -> Options:
    return Options.from_kwargs(_source=source, _groups=("loss_scale",), **options)


def _options(options, source="AMP_Optimizer") -> Options:
    return Options.from_kwargs(_source=source, _groups=("loss_scale",), **options)


__all__ = ["AmpCore", "fused_unscale_and_check", "check_strategy", "FP16_COPIES_COLLECTION"]


def amp_config(manager, options) -> dict:
    """The ``npu_amp`` entry the Keras wrappers add to ``get_config``: the
    loss-scale settings (not its state, which travels in checkpoints) and the
    AMP options, enough to rebuild the wrapper in ``from_config``."""
    opts = {k: options[k] for k in ("keep_fp16_copies", "gradient_accumulation_steps",
                                    "allreduce_dtype", "bucket_size_mb")}
    m = manager
    if m.is_dynamic:
        lsm = None
        opts.update(init_loss_scale=m._init_scale, incr_every_n_steps=m.incr_every_n_steps,  # pylint: disable=protected-access
                    decr_every_n_nan_or_inf=m.decr_every_n_nan_or_inf,
                    incr_ratio=m.incr_ratio, decr_ratio=m.decr_ratio,
                    min_loss_scale=m._min, max_loss_scale=m._max)  # pylint: disable=protected-access
    else:
        lsm = m._init_scale  # pylint: disable=protected-access
        opts["enable_overflow_check"] = m.enable_overflow_check
    return {"loss_scale_manager": lsm, "options": opts}


class KerasAmpMixin:
    """What the Keras 2 (:mod:`npu_amp_tf.keras`) and Keras 3
    (:mod:`npu_amp_tf.keras3`) loss-scaled optimizer classes share: the
    ``npu_amp`` serialization and the loss-scale part of Keras's
    LossScaleOptimizer interface.

    A subclass sets ``_npu_amp_base`` (the wrapped optimizer class, set per
    built class) and ``_npu_amp_wrap`` (its module's ``LossScaleOptimizer``
    function); instances expose the manager as ``loss_scale_manager`` and the
    step logic (an :class:`AmpCore`) as ``_npu_amp_core``.  Methods call the
    wrapped class explicitly, never ``super()``: the next class in the MRO is
    Keras's LossScaleOptimizer.
    """

    _npu_amp_base = None
    _npu_amp_wrap = None

    # ------------------------------------------------------- serialization
    def get_config(self):
        """The wrapped optimizer's config plus an ``npu_amp`` entry (loss-scale
        settings), so ``model.save``/``load_model`` rebuild the AMP optimizer.
        The loss-scale *state* travels in ``tf.train.Checkpoint``s, not here."""
        cfg = self._npu_amp_base.get_config(self)
        cfg["npu_amp"] = amp_config(self.loss_scale_manager, self._npu_amp_core.options)
        return cfg

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        amp = config.pop("npu_amp", None)
        if amp is None:  # building the instance inside LossScaleOptimizer()
            return cls._npu_amp_base.from_config.__func__(cls, config, custom_objects)
        inner = cls._npu_amp_base.from_config(config, custom_objects)
        return cls._npu_amp_wrap(inner, amp.get("loss_scale_manager"), **amp.get("options", {}))

    @classmethod
    def _npu_amp_rebuild(cls, opt):
        """A new instance of this class from ``opt``'s config (``_npu_amp_setup``
        still to be called on it)."""
        try:
            return cls.from_config(opt.get_config())
        except Exception as exc:  # noqa: BLE001
            raise OptionError(f"cannot rebuild {type(opt).__name__} from its config for loss "
                              f"scaling: {exc}; pass a freshly constructed optimizer") from None

    # ---------------------------------------------------- LSO interface
    @property
    def inner_optimizer(self):
        """The optimizer passed in (its configuration source; updates run on this object)."""
        return self._npu_amp_inner

    @property
    def dynamic(self):
        return self.loss_scale_manager.is_dynamic

    @property
    def initial_scale(self):
        return self.loss_scale_manager._init_scale  # pylint: disable=protected-access

    @property
    def dynamic_growth_steps(self):
        return getattr(self.loss_scale_manager, "incr_every_n_steps", None)

    @property
    def loss_scale(self):
        return tf.convert_to_tensor(self.loss_scale_manager.get_loss_scale())

    def get_scaled_loss(self, loss):
        return self._npu_amp_core.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        return self._npu_amp_core.unscale(list(grads))
