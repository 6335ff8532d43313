"""tf_adapter ``npu_config``: ``NPURunConfig`` and its config objects.

``NPURunConfig`` accepts every keyword of tf_adapter's (same defaults).  The
precision keywords (``precision_mode``, ``precision_mode_v2``,
``modify_mixlist``) and the ones with an equivalent here (``dump_config``,
``profiling_config``, ``buffer_optimize``) go into the ``session_config``
entry of the plugin, validated by ``npu_amp_tf.options``; the device-only
ones that differ from tf_adapter's defaults are passed as GE keys (listed in
the report and logged once as "no effect off the NPU").  The Estimator
keywords go to ``tf.estimator.RunConfig``.
"""
import inspect
import json

import tensorflow as tf

from npu_amp_tf.errors import OptionError

_ESTIMATOR_KEYS = ("model_dir", "tf_random_seed", "save_summary_steps", "save_checkpoints_steps",
                   "save_checkpoints_secs", "keep_checkpoint_max", "keep_checkpoint_every_n_hours",
                   "log_step_count_steps", "train_distribute", "eval_distribute")
_PRECISION_KEYS = ("precision_mode", "precision_mode_v2", "modify_mixlist")
#: NPURunConfig keywords that are objects, unpacked below
_OBJECT_KEYS = ("profiling_config", "dump_config", "dynamic_input_config", "memory_config",
                "experimental_config", "distribute", "session_config")


class ProfilingConfig:
    def __init__(self, enable_profiling=False, profiling_options=None, enable_options=None):
        self._enable_profiling = enable_profiling
        self._profiling_options = profiling_options
        self._enable_options = enable_options

    def params(self):
        if not self._enable_profiling:
            return {}
        opts = self._profiling_options or "{}"
        if not isinstance(opts, str):
            opts = json.dumps(opts)
        return {"profiling_mode": True, "profiling_options": opts}


class DumpConfig:
    def __init__(self, enable_dump=False, dump_path=None, dump_step=None, dump_mode="output",
                 enable_dump_debug=False, dump_debug_mode="all", dump_data="tensor", dump_layer=None):
        self._p = dict(enable_dump=enable_dump, dump_path=dump_path, dump_step=dump_step,
                       dump_mode=dump_mode, enable_dump_debug=enable_dump_debug,
                       dump_debug_mode=dump_debug_mode, dump_data=dump_data, dump_layer=dump_layer)

    def params(self):
        if not (self._p["enable_dump"] or self._p["enable_dump_debug"]):
            return {}
        return {k: v for k, v in self._p.items() if v is not None}


class MemoryConfig:
    def __init__(self, atomic_clean_policy=0, static_memory_policy=None):
        self._p = {"atomic_clean_policy": atomic_clean_policy, "static_memory_policy": static_memory_policy}

    def params(self):
        return {k: v for k, v in self._p.items() if v not in (None, 0)}


class ExperimentalConfig:
    def __init__(self, **kwargs):
        self._p = kwargs

    def params(self):
        return {}


class DynamicInputConfig:
    def __init__(self, input_shape, dynamic_dims, dynamic_node_type):
        self._p = {"input_shape": input_shape, "dynamic_dims": dynamic_dims,
                   "dynamic_node_type": dynamic_node_type}

    def params(self):
        return dict(self._p)


class NPURunConfig(tf.estimator.RunConfig if hasattr(tf, "estimator") else object):
    """RunConfig with NPU support (tf_adapter's keywords and defaults)."""

    def __init__(self, iterations_per_loop=1, profiling_config=None, model_dir=None,
                 tf_random_seed=None, save_summary_steps=0, save_checkpoints_steps=None,
                 save_checkpoints_secs=None, session_config=None, keep_checkpoint_max=5,
                 keep_checkpoint_every_n_hours=10000, log_step_count_steps=100, distribute=None,
                 enable_data_pre_proc=True, precision_mode=None, enable_reduce_precision=False,
                 variable_format_optimize=None, mix_compile_mode=False, hcom_parallel=True,
                 graph_memory_max_size=None, variable_memory_max_size=None, dump_config=None,
                 stream_max_parallel_num=None, is_tailing_optimization=False, horovod_mode=False,
                 graph_run_mode=1, op_debug_level=None, enable_scope_fusion_passes=None,
                 enable_exception_dump=2, op_select_implmode=None, optypelist_for_implmode=None,
                 dynamic_input_config=None, aoe_mode=None, work_path=None,
                 buffer_optimize="l2_optimize", enable_small_channel=0, fusion_switch_file=None,
                 enable_compress_weight=False, compress_weight_conf=None,
                 op_compiler_cache_mode=None, op_compiler_cache_dir=None, debug_dir=None,
                 hcom_multi_mode=False, dynamic_input=None,
                 dynamic_graph_execute_mode="dynamic_execute", dynamic_inputs_shape_range=None,
                 train_distribute=None, eval_distribute=None, local_rank_id=None,
                 local_device_list=None, session_device_id=None, distribute_config=None,
                 modify_mixlist=None, op_precision_mode=None, device_type="default_device_type",
                 soc_config=None, hccl_timeout=None, op_wait_timeout=None, op_execute_timeout=None,
                 HCCL_algorithm=None, customize_dtypes=None, op_debug_config=None,  # noqa: N803
                 memory_config=None, experimental_config=None, topo_sorting_mode=None,
                 aoe_config_file=None, insert_op_file=None, stream_sync_timeout=-1,
                 event_sync_timeout=-1, external_weight=False, es_cluster_config=None,
                 deterministic=0, frozen_variable=False, variable_placement="Device",
                 jit_compile="auto", precision_mode_v2=None, ac_parallel_enable=None):
        if not hasattr(tf, "estimator"):
            raise OptionError(f"NPURunConfig needs tf.estimator, which TensorFlow {tf.__version__} "
                              "no longer ships (removed in 2.16); use TensorFlow <= 2.15")
        given = dict(locals())
        given.pop("self")
        given.pop("__class__", None)
        defaults = {k: p.default for k, p in inspect.signature(NPURunConfig.__init__).parameters.items()
                    if k != "self"}
        params = {}
        for k in _PRECISION_KEYS:
            if given[k] is not None:
                params[k] = given[k]
        if variable_format_optimize is not None:
            params["variable_format_optimize"] = variable_format_optimize
        for obj in (profiling_config, dump_config, dynamic_input_config, memory_config,
                    experimental_config):
            if obj is not None:
                params.update(obj.params())
        if buffer_optimize != defaults["buffer_optimize"]:
            params["buffer_optimize"] = buffer_optimize
        if device_type != defaults["device_type"]:
            from npu_amp_tf.options import OPTIONS

            if device_type in OPTIONS["device_type"].choices:
                params["device_type"] = device_type
            else:
                params["soc_config"] = params.get("soc_config", device_type)
        skip = set(_ESTIMATOR_KEYS) | set(_PRECISION_KEYS) | set(_OBJECT_KEYS) | {
            "variable_format_optimize", "buffer_optimize", "device_type"}
        for k, v in given.items():
            if k in skip or v == defaults[k]:
                continue
            params[k] = v  # device-only GE keys (validated as known by npu_amp_tf.options)
        from npu_amp_tf import session_config as _session_config

        self._npu_params = params
        cfg = _session_config(session_config, **params)
        train_distribute = train_distribute if train_distribute is not None else distribute
        super().__init__(model_dir=model_dir, tf_random_seed=tf_random_seed,
                         save_summary_steps=save_summary_steps,
                         save_checkpoints_steps=save_checkpoints_steps,
                         save_checkpoints_secs=save_checkpoints_secs, session_config=cfg,
                         keep_checkpoint_max=keep_checkpoint_max,
                         keep_checkpoint_every_n_hours=keep_checkpoint_every_n_hours,
                         log_step_count_steps=log_step_count_steps, train_distribute=train_distribute,
                         eval_distribute=eval_distribute)
        self._iterations_per_loop = iterations_per_loop
        self.iterations_per_loop = iterations_per_loop
        self._precision_mode = precision_mode
        self._modify_mixlist = modify_mixlist

    @property
    def npu_params(self):
        """The plugin / GE parameters this config put into its session_config."""
        return dict(self._npu_params)


def decorator_tf_session(func):
    """tf_adapter's Session.__init__ decorator (the compat layer hooks sessions itself)."""
    return func
