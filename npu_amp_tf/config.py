"""Switching the plugin on: ``session_config`` (TF1 sessions, Estimator),
``enable`` / ``disable`` / ``amp_scope`` (TF2 ``tf.function`` and Keras).

All of them produce the same ``RewriterConfig`` entry, the one Ascend users
write by hand::

    custom_op = config.graph_options.rewrite_options.custom_optimizers.add()
    custom_op.name = "NpuAmpOptimizer"
    custom_op.parameter_map["precision_mode"].s = b"allow_mix_precision"

with parameters validated up front by :mod:`npu_amp_tf.options`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading

from . import _tf
from .options import Options

log = logging.getLogger("npu_amp_tf")

OPTIMIZER_NAME = "NpuAmpOptimizer"
NPU_BRIDGE_OPTIMIZER = "NpuOptimizer"

#: RewriterConfig toggles session_config switches OFF (all AMP variants and
#: the remapper); present in every supported TF version.
DISABLED_TOGGLES = ("auto_mixed_precision", "auto_mixed_precision_cpu",
                    "auto_mixed_precision_mkl", "auto_mixed_precision_onednn_bfloat16",
                    "remapping")


def _validated(params, source) -> Options:
    return Options.from_kwargs(_source=source, _groups=("rewrite",), **params)


def npu_bridge_available() -> bool:
    """True when Huawei's ``npu_bridge`` package can be imported (checked
    without importing it)."""
    try:
        return importlib.util.find_spec("npu_bridge") is not None
    except (ImportError, ValueError):
        return False


_alias_state = {"done": False, "registered": False}


def register_npu_optimizer_alias() -> bool:
    """Make grappler run the pipeline for ``"NpuOptimizer"`` entries too (a
    hand-written tf_adapter entry), unless Huawei's ``npu_bridge`` is
    installed (then its GE optimizer owns the name).  Idempotent; called by
    ``import npu_amp_tf``.  Returns True when the alias is active."""
    import ctypes

    if _alias_state["done"]:
        return _alias_state["registered"]
    _alias_state["done"] = True
    if npu_bridge_available():
        log.info("npu_amp_tf: Huawei npu_bridge is installed; 'NpuOptimizer' entries go to GE")
        return False
    from . import bridge

    try:
        lib = bridge.library()
    except Exception as exc:  # noqa: BLE001 - no build: the import-time warning already says so
        log.debug("npu_amp_tf: NpuOptimizer alias not registered: %s", exc)
        return False
    fn = lib.NpuAmpRegisterAlias
    fn.argtypes, fn.restype = [ctypes.c_char_p], ctypes.c_int
    rc = fn(NPU_BRIDGE_OPTIMIZER.encode())
    _alias_state["registered"] = rc in (0, 1)
    return _alias_state["registered"]


def _pop_entries(rewrite_options, name):
    """Remove every custom_optimizers entry called ``name``; return copies."""
    popped = []
    opts = rewrite_options.custom_optimizers
    for i in reversed(range(len(opts))):
        if opts[i].name == name:
            c = type(opts[i])()
            c.CopyFrom(opts[i])
            popped.insert(0, c)
            del opts[i]
    return popped


def session_config(base=None, **params):
    """A ``tf.compat.v1.ConfigProto`` that runs the npu-amp-tf pass pipeline
    in grappler.  ``params`` are the options-module keys (``precision_mode``,
    ``modify_mixlist``, ``custom_black_list``, ``fail_on_error``...); they are
    validated here, so a bad value raises :class:`~npu_amp_tf.OptionError`
    naming the key and the accepted values.

    ``base`` (a ConfigProto, left untouched) is copied first.  On the copy,
    exactly these fields change:

    * ``graph_options.rewrite_options.custom_optimizers``: an entry named
      ``NpuAmpOptimizer`` holding the explicitly set ``params`` in its
      ``parameter_map``; an existing ``NpuAmpOptimizer`` entry is replaced
      in place, so calling this twice never adds a second one.  Grappler
      runs custom optimizers after its built-in ones in each iteration.
    * ``rewrite_options.auto_mixed_precision``, ``auto_mixed_precision_cpu``,
      ``auto_mixed_precision_mkl`` and ``auto_mixed_precision_onednn_bfloat16``
      are set to ``OFF``: grappler's own AMP would paint the graph first and
      fight the plugin's lists.
    * ``rewrite_options.remapping`` is set to ``OFF``: the remapper fuses
      ``Conv2D+BiasAdd+Relu`` / ``MatMul+BiasAdd`` into ``_FusedConv2D`` /
      ``_FusedMatMul``, which have no FP16 CPU kernel (tf_adapter switches it
      off for the same reason; TF 2.15's oneDNN remapper has also been seen
      to abort on raw-op graphs).  A hand-written entry that leaves the
      remapper on still works: the pipeline's ``unfuse`` pass splits those
      nodes back.
    * ``rewrite_options.disable_meta_optimizer`` is set to ``False`` if it was
      ``True`` (with the meta-optimizer off no custom optimizer runs).
    * Without Huawei's ``npu_bridge``: an ``NpuOptimizer`` entry in ``base``
      (tf_adapter's, run by this plugin under that name too) is removed and
      its parameters (GE keys included) are folded into ours, the explicit
      ``params`` winning, so the pipeline runs once.
    * GE's ``memory_optimize`` / ``buffer_optim`` set
      ``rewrite_options.memory_optimization``; ``loss_scale`` sets the default
      manager of later ``AMP_Optimizer`` calls (:func:`apply_ge_keys`).
    * Only when Huawei's ``npu_bridge`` is importable: an ``NpuOptimizer``
      entry is placed *after* ``NpuAmpOptimizer`` (an existing one is moved
      there and keeps its other parameters) with the same ``precision_mode``
      (or ``precision_mode_v2``) and ``modify_mixlist``, so GE sees the same
      settings; and ``rewrite_options.memory_optimization`` is set to
      ``NO_MEM_OPT`` (off), as the CANN documentation requires.

    Nothing else is touched.  The optimizer is registered by ``import
    npu_amp_tf``; a process that only builds this ConfigProto without
    importing the package gets no rewrite (grappler ignores unknown names).
    """
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    _validated(params, "session_config")
    from . import bridge

    bridge.ensure_registered()
    cfg = config_pb2.ConfigProto()
    if base is not None:
        if isinstance(base, (bytes, bytearray)):
            cfg.ParseFromString(bytes(base))
        elif isinstance(base, config_pb2.ConfigProto):
            cfg.CopyFrom(base)
        else:
            from .errors import OptionError

            raise OptionError(f"session_config(base={type(base).__name__}): base must be a "
                              "tf.compat.v1.ConfigProto (or its serialized bytes) or None")
    rw = cfg.graph_options.rewrite_options
    OFF = rewriter_config_pb2.RewriterConfig.OFF
    if not npu_bridge_available():
        # tf_adapter's entry in `base` would run the pipeline a second time
        # through the NpuOptimizer alias: fold its parameters into ours
        # (the explicit params win)
        from .options import attr_value_to_python

        folded = {}
        for old in _pop_entries(rw, NPU_BRIDGE_OPTIMIZER):
            folded.update({k: attr_value_to_python(v) for k, v in old.parameter_map.items()})
        params = {**folded, **params}
    opts = _validated(params, "session_config")

    # our entry, in place of any earlier one
    existing = [i for i, c in enumerate(rw.custom_optimizers) if c.name == OPTIMIZER_NAME]
    if existing:
        entry = rw.custom_optimizers[existing[0]]
        entry.parameter_map.clear()
        for i in reversed(existing[1:]):
            del rw.custom_optimizers[i]
    else:
        entry = rw.custom_optimizers.add()
        entry.name = OPTIMIZER_NAME
    opts.fill_parameter_map(entry.parameter_map)

    for toggle in DISABLED_TOGGLES:
        setattr(rw, toggle, OFF)
    rw.disable_meta_optimizer = False
    apply_ge_keys(cfg, opts)

    if npu_bridge_available():
        old = _pop_entries(rw, NPU_BRIDGE_OPTIMIZER)
        npu = rw.custom_optimizers.add()
        if old:
            npu.CopyFrom(old[0])
        npu.name = NPU_BRIDGE_OPTIMIZER
        for k in ("precision_mode", "precision_mode_v2", "modify_mixlist"):
            if k in npu.parameter_map:
                del npu.parameter_map[k]
        if opts.precision_mode_v2 is not None:
            npu.parameter_map["precision_mode_v2"].s = opts.precision_mode_v2.encode()
        else:
            npu.parameter_map["precision_mode"].s = opts.precision_mode.encode()
        if opts.modify_mixlist:
            npu.parameter_map["modify_mixlist"].s = opts.modify_mixlist.encode()
        rw.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    return cfg


def apply_ge_keys(cfg, opts: Options):
    """The GE keys that act on the ConfigProto itself: ``memory_optimize`` /
    ``buffer_optim`` set ``rewrite_options.memory_optimization``
    (:func:`npu_amp_tf.options.memory_optimization_of`); ``loss_scale`` (CANN
    AMP guide) becomes the default manager of later ``AMP_Optimizer`` calls."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    from .options import memory_optimization_of

    mem = memory_optimization_of(opts.ge)
    if mem is not None:
        cfg.graph_options.rewrite_options.memory_optimization = getattr(
            rewriter_config_pb2.RewriterConfig, mem)
    if "loss_scale" in opts.ge:
        from . import loss_scale as _ls

        _ls.set_default_loss_scale(opts.ge["loss_scale"])
    return cfg


def split_rewrite_params(params: dict) -> dict:
    """Pop the rewrite options and GE keys out of ``params`` (in place) and
    return them; the loss-scale keys stay."""
    from .options import GE_KEYS, REWRITE_KEYS

    return {k: params.pop(k) for k in list(params) if k in REWRITE_KEYS or k in GE_KEYS}


def rewrite_everywhere(params: dict, source="AMP_Optimizer"):
    """Rewrite options given where no ConfigProto is at hand (``AMP_Optimizer``
    with the CANN AMP guide's dict): validated now, then the pipeline runs
    with them in every later TF1 Session that has no plugin entry (the
    ``npu_amp_tf.compat`` session hook) and in every TF2 function
    (:func:`enable`).  A no-op for empty ``params``."""
    if not params:
        return
    _validated(params, source)
    from .compat import _sessions

    _sessions.patch(default_params=params)
    enable(**params)
    log.info("npu_amp_tf: %s rewrite options %s apply to later sessions and functions",
             source, sorted(params))


def entry_params(config) -> dict | None:
    """The parameter_map of the ``NpuAmpOptimizer`` entry of a ConfigProto, as
    python values (None when the entry is absent)."""
    from .options import attr_value_to_python

    for c in config.graph_options.rewrite_options.custom_optimizers:
        if c.name == OPTIMIZER_NAME:
            return {k: attr_value_to_python(v) for k, v in c.parameter_map.items()}
    return None


# ---------------------------------------------------------------------------
# TF2: the eager context's function call options
# ---------------------------------------------------------------------------
_UNSET = object()
_state_lock = threading.Lock()
_saved_context_config = _UNSET
_enabled_params: dict | None = None


def _context():
    return _tf.eager_context()


def enable(**params):
    """Run the pass pipeline on every TF2 function call from now on:
    ``tf.function``, Keras ``fit``/``evaluate``/``predict``, and the function
    bodies they call (nested ``tf.function`` bodies are inlined into the
    caller before grappler runs, so they are rewritten with it).

    TF hands every function call the ``config_proto`` of the eager context's
    *function call options*; grappler reads the ``RewriterConfig`` from it when
    the function is first instantiated.  ``enable`` puts the
    :func:`session_config` entry into the context's base ConfigProto (which
    every thread's function call options are derived from) and refreshes the
    calling thread's options.  ``params`` are validated immediately.

    Caveats: a concrete function already *executed* before ``enable()`` keeps
    the graph it was instantiated with (TF caches it); threads that already
    called functions keep their own per-thread options until they call
    ``enable()`` or use :func:`amp_scope` themselves.  XLA-compiled functions
    (``jit_compile=True``) bypass grappler entirely.
    """
    global _saved_context_config, _enabled_params
    from tensorflow.core.protobuf import config_pb2

    _validated(params, "enable")
    ctx = _context()
    with _state_lock:
        if _saved_context_config is _UNSET:
            cur = _tf.context_config(ctx)
            saved = None
            if cur is not None:
                saved = config_pb2.ConfigProto()
                saved.CopyFrom(cur)
            _saved_context_config = saved
        base = config_pb2.ConfigProto()
        if _saved_context_config is not None:
            base.CopyFrom(_saved_context_config)
        new = session_config(base, **params)
        if _tf.has_context_config(ctx):
            _tf.set_context_config(ctx, new)
        _enabled_params = dict(params)
    # this thread: re-derive from the context config
    ctx.function_call_options = None
    if not _tf.has_context_config(ctx):  # pragma: no cover - very old/new TF layouts
        _set_thread_options(ctx, params)


def disable():
    """Undo :func:`enable`: restore the context's ConfigProto and refresh the
    calling thread's function call options.  A no-op when not enabled."""
    global _saved_context_config, _enabled_params
    ctx = _context()
    with _state_lock:
        if _saved_context_config is _UNSET:
            return
        if _tf.has_context_config(ctx):
            _tf.set_context_config(ctx, _saved_context_config)
        _saved_context_config = _UNSET
        _enabled_params = None
    ctx.function_call_options = None


def enabled_params() -> dict | None:
    """The params of the active :func:`enable` call (None when disabled)."""
    with _state_lock:
        return None if _enabled_params is None else dict(_enabled_params)


def _set_thread_options(ctx, params):
    from tensorflow.core.protobuf import config_pb2

    old = ctx.function_call_options
    cp = config_pb2.ConfigProto()
    if old.config_proto_serialized:
        cp.ParseFromString(old.config_proto_serialized)
    ctx.function_call_options = _tf.function_call_options(
        old.executor_type, session_config(cp, **params))
    return old


@contextlib.contextmanager
def amp_scope(**params):
    """Context manager: function calls made *in this thread* inside the
    ``with`` block run the pass pipeline with ``params``; the previous
    function call options come back on exit.  Nests; validates ``params``
    on entry.  Yields the active ``FunctionCallOptions``."""
    _validated(params, "amp_scope")
    ctx = _context()
    old = _set_thread_options(ctx, params)
    try:
        yield ctx.function_call_options
    finally:
        ctx.function_call_options = old


__all__ = ["session_config", "enable", "disable", "amp_scope", "enabled_params", "entry_params",
           "register_npu_optimizer_alias", "apply_ge_keys",
           "npu_bridge_available", "OPTIMIZER_NAME", "DISABLED_TOGGLES"]
