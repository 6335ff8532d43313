"""npu-amp-tf's stand-in for Huawei tf_adapter 2.x's ``npu_device`` (TF2)::

    import npu_device as npu
    npu.global_options().precision_mode = "allow_mix_precision"
    npu.open().as_default()        # the plugin now rewrites every tf.function / Keras step

``global_options()`` holds tf_adapter's option names; ``open().as_default()``
calls ``npu_amp_tf.enable`` with the ones set (validated by
``npu_amp_tf.options``; device-only ones are listed in the report).
"""
import contextlib
import os
import threading

import npu_amp_tf  # noqa: F401  (registers the grappler optimizer)
from npu_amp_tf.errors import OptionError
from npu_amp_tf.precision import keep_dtype_scope  # noqa: F401

from npu_device import distribute, train  # noqa: F401,E402
from npu_device.distribute import npu_distributed_keras_optimizer_wrapper  # noqa: F401,E402

__npu_amp_tf_compat__ = True

_UNSET = object()


class _Group:
    """An options group: attributes with tf_adapter's defaults; an unknown
    attribute is an error naming it."""

    _fields = {}

    def __init__(self):
        object.__setattr__(self, "_values", dict(self._fields))
        object.__setattr__(self, "_set", set())

    def __getattr__(self, name):
        vals = object.__getattribute__(self, "_values")
        if name in vals:
            return vals[name]
        raise AttributeError(f"{type(self).__name__} has no option {name!r}")

    def __setattr__(self, name, value):
        if name not in self._values:
            raise OptionError(f"npu_device option {name!r} is unknown; accepted: "
                              + ", ".join(sorted(self._values)))
        self._values[name] = value
        self._set.add(name)

    def params(self):
        return {k: self._values[k] for k in self._set}


class NpuDumpConfig(_Group):
    _fields = dict(enable_dump=False, dump_path=None, dump_step=None, dump_mode="output",
                   enable_dump_debug=False, dump_debug_mode="all", dump_data="tensor", dump_layer=None)

    def params(self):
        p = super().params()
        return p if (self.enable_dump or self.enable_dump_debug) else {}


class NpuProfilingConfig(_Group):
    _fields = dict(enable_profiling=False, profiling_options=None)

    def params(self):
        if not self.enable_profiling:
            return {}
        return {"profiling_mode": True, "profiling_options": self.profiling_options or "{}"}


class _Ignored(_Group):
    """A nested tf_adapter group with no equivalent here (aoe, memory, experimental)."""

    def __getattr__(self, name):
        vals = object.__getattribute__(self, "_values")
        return vals.get(name)

    def __setattr__(self, name, value):
        self._values[name] = value
        self._set.add(name)


class NpuConfig(_Group):
    _fields = dict(
        graph_run_mode=1, graph_memory_max_size=None, variable_memory_max_size=None,
        variable_format_optimize=None, enable_scope_fusion_passes=None, fusion_switch_file=None,
        precision_mode=None, op_select_implmode=None, optypelist_for_implmode=None,
        op_compiler_cache_mode="enable", op_compiler_cache_dir=None, stream_max_parallel_num=None,
        ac_parallel_enable=None, hcom_parallel=True, hcom_multi_mode=None,
        is_tailing_optimization=False, op_debug_level=None, op_debug_config=None, debug_dir=None,
        modify_mixlist=None, enable_exception_dump=2, enable_small_channel=False, deterministic=0,
        op_precision_mode=None, graph_exec_timeout=None, topo_sorting_mode=None,
        customize_dtypes=None, overflow_flag=1, stream_sync_timeout=-1, event_sync_timeout=-1,
        external_weight=False, jit_compile="auto", graph_compiler_cache_dir=None,
        precision_mode_v2=None)
    _groups = ("dump_config", "profiling_config", "aoe_config", "memory_config", "experimental")

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "dump_config", NpuDumpConfig())
        object.__setattr__(self, "profiling_config", NpuProfilingConfig())
        for g in ("aoe_config", "memory_config", "experimental"):
            object.__setattr__(self, g, _Ignored())

    def __setattr__(self, name, value):
        if name in self._groups:
            raise OptionError(f"npu_device option group {name!r} cannot be replaced; set its fields")
        super().__setattr__(name, value)

    def params(self):
        """The plugin / GE parameters of the options set so far."""
        out = {}
        for k, v in super().params().items():
            if k == "overflow_flag":
                continue  # the plugin always checks overflow in its loss scaling
            if k == "variable_format_optimize" and v is None:
                continue
            out[k] = v
        out.update(self.dump_config.params())
        out.update(self.profiling_config.params())
        return out


_global = None
_lock = threading.Lock()


def global_options():
    """The process-wide options (tf_adapter ``npu_device.global_options()``)."""
    global _global
    with _lock:
        if _global is None:
            _global = NpuConfig()
    return _global


class NpuDeviceHandle:
    def __init__(self, device_id):
        self._device_id = device_id
        self.workers_num = int(os.getenv("RANK_SIZE", "1"))
        self.worker_id = int(os.getenv("RANK_ID", "0"))

    @property
    def device_id(self):
        return self._device_id

    def as_default(self):
        """Run the plugin on every tf.function / Keras step from now on, with
        ``global_options()`` (``npu_amp_tf.enable``)."""
        global _global_ctx
        npu_amp_tf.enable(**global_options().params())
        _global_ctx = self
        return self

    def __enter__(self):
        return self.as_default()

    def __exit__(self, *exc):
        npu_amp_tf.disable()
        return False


_global_ctx = None


def open(device_id=None):  # noqa: A001 - tf_adapter's name
    """tf_adapter: open the NPU; here a handle whose ``as_default()`` enables the plugin."""
    if device_id is None:
        device_id = int(os.getenv("ASCEND_DEVICE_ID", "0"))
    return NpuDeviceHandle(device_id)


def global_npu_ctx():
    return _global_ctx


def set_npu_loop_size(loop_size):
    """On the NPU: steps per device loop.  Here each step returns to the host."""
    from npu_amp_tf.options import _log_device_only

    _log_device_only(["set_npu_loop_size"])


def npu_compat_function(func=None, *args, **kwargs):
    import tensorflow as tf

    return tf.function(func, *args, **kwargs) if func is not None else tf.function(*args, **kwargs)


@contextlib.contextmanager
def npu_recompute_scope():
    yield


def is_inf_nan_enabled():
    return True
