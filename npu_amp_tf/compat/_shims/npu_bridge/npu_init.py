"""tf_adapter ``npu_bridge.npu_init``: ``from npu_bridge.npu_init import *``.

The star import gives what tf_adapter's does, including the name ``tf``:
tf_adapter runs on TF 1.15, where ``import tensorflow as tf`` is TF1, so
here ``tf`` is ``tensorflow.compat.v1``.  Importing this module also hooks
every Session as tf_adapter's does (an ``NpuOptimizer`` entry where the
ConfigProto has none; see ``npu_amp_tf.compat._sessions``).
"""
import os

import tensorflow as _tf2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2  # noqa: F401
from tensorflow.core.protobuf.rewriter_config_pb2 import RewriterConfig
from npu_amp_tf import _tf as _npu_amp_tf_compat

from hccl.manage.api import (create_group, destroy_group, get_group_rank_from_world_rank,  # noqa: F401
                             get_local_rank_id, get_local_rank_size, get_rank_id, get_rank_size,
                             get_world_rank_from_group_rank)
from hccl.split.api import set_split_strategy_by_idx, set_split_strategy_by_size  # noqa: F401
from npu_bridge.estimator import npu_ops  # noqa: F401
from npu_bridge.estimator.npu import npu_scope, util  # noqa: F401
from npu_bridge.estimator.npu.npu_config import (DumpConfig, DynamicInputConfig,  # noqa: F401
                                                 ExperimentalConfig, MemoryConfig, NPURunConfig,
                                                 ProfilingConfig, decorator_tf_session)
from npu_bridge.estimator.npu.npu_hook import (NPUBroadcastGlobalVariablesHook,  # noqa: F401
                                               NPUCheckpointSaverHook, NPUOutputTensorHook,
                                               SetIterationsVarHook)
from npu_bridge.estimator.npu.npu_loss_scale_manager import (  # noqa: F401
    ExponentialUpdateLossScaleManager, FixedLossScaleManager)
from npu_bridge.estimator.npu.npu_loss_scale_optimizer import NPULossScaleOptimizer  # noqa: F401
from npu_bridge.estimator.npu.npu_optimizer import (KerasDistributeOptimizer,  # noqa: F401
                                                    NPUDistributedOptimizer, NPUOptimizer,
                                                    npu_allreduce, npu_distributed_optimizer_wrapper)
from npu_bridge.hccl import hccl_ops  # noqa: F401

if hasattr(_tf2, "estimator"):
    from npu_bridge.estimator.npu.npu_estimator import NPUEstimator, NPUEstimatorSpec  # noqa: F401

#: tf_adapter's scripts use `tf` after the star import: TF1 there
tf = _tf2.compat.v1
session = _npu_amp_tf_compat.session_module()  # tf_adapter's npu_init exports it

experimental_options = {
    "disable_model_pruning": False,
    "function_optimization": RewriterConfig.ON,
    "constant_folding": RewriterConfig.ON,
    "shape_optimization": RewriterConfig.ON,
    "arithmetic_optimization": RewriterConfig.ON,
    "loop_optimization": RewriterConfig.ON,
    "dependency_optimization": RewriterConfig.ON,
    "layout_optimizer": RewriterConfig.ON,
}


def _npu_entry(config):
    for c in config.graph_options.rewrite_options.custom_optimizers:
        if c.name == "NpuOptimizer":
            return c
    c = config.graph_options.rewrite_options.custom_optimizers.add()
    c.name = "NpuOptimizer"
    config.graph_options.rewrite_options.memory_optimization = RewriterConfig.OFF
    return c


def _npu_defaults(config):
    _npu_entry(config)
    config.allow_soft_placement = True
    config.log_device_placement = False
    config.graph_options.rewrite_options.remapping = RewriterConfig.OFF
    config.graph_options.optimizer_options.global_jit_level = config_pb2.OptimizerOptions.OFF
    return config


def npu_config_proto(config_proto=None):
    """tf_adapter: the ConfigProto with an ``NpuOptimizer`` entry (the plugin
    here), remapper and memory optimizer off, XLA off."""
    if not isinstance(config_proto, config_pb2.ConfigProto):
        config_proto = config_pb2.ConfigProto()
    return _npu_defaults(config_proto)


def npu_graph_options(graph_options=None):
    if not isinstance(graph_options, config_pb2.GraphOptions):
        graph_options = config_pb2.GraphOptions()
    graph_options.optimizer_options.global_jit_level = config_pb2.OptimizerOptions.OFF
    return graph_options


def npu_optimizer_options(optimizer_options=None):
    if not isinstance(optimizer_options, config_pb2.OptimizerOptions):
        optimizer_options = config_pb2.OptimizerOptions()
    optimizer_options.global_jit_level = config_pb2.OptimizerOptions.OFF
    return optimizer_options


def npu_run_config_init(run_config=None):
    """tf_adapter: a RunConfig whose session_config is :func:`npu_config_proto`'s."""
    if not hasattr(_tf2, "estimator"):
        from npu_amp_tf.errors import OptionError

        raise OptionError(f"npu_run_config_init needs tf.estimator (TensorFlow <= 2.15; this is "
                          f"{_tf2.__version__})")
    if not isinstance(run_config, _tf2.estimator.RunConfig):
        run_config = _tf2.estimator.RunConfig()
    run_config.__dict__["_session_config"] = npu_config_proto(run_config.session_config)
    return run_config


def npu_hooks_append(hooks_list=()):
    if not isinstance(hooks_list, list):
        hooks_list = []
    hooks_list.append(NPUBroadcastGlobalVariablesHook(0, int(os.getenv("RANK_ID", "0"))))
    return hooks_list


def npu_callbacks_append(callbacks_list=()):
    if not isinstance(callbacks_list, list):
        callbacks_list = []
    return callbacks_list


def _keras_backend():
    return tf.keras.backend if hasattr(tf, "keras") and hasattr(tf.keras.backend, "set_session") \
        else None


def set_keras_session_npu_config(config=None):
    """tf_adapter: a Session with :func:`npu_config_proto` set as the Keras session."""
    sess = tf.Session(config=npu_config_proto(config))
    backend = _keras_backend()
    if backend is not None:
        backend.set_session(sess)
    return sess


def init_resource(config=None):
    """tf_adapter: a Session with the NPU config and the (no-op) shutdown op."""
    util.global_dict_init()
    sess = tf.Session(config=npu_config_proto(config))
    sess.run(npu_ops.initialize_system())
    for key, fn in (("npu_rank_id", get_rank_id), ("npu_local_rank_id", get_local_rank_id),
                    ("npu_rank_size", get_rank_size), ("npu_local_rank_size", get_local_rank_size)):
        util.set_value(key, fn())
    return sess, npu_ops.shutdown_system()


def shutdown_resource(sess, npu_shutdown):
    sess.run(npu_shutdown)


def close_session(sess):
    sess.close()


def get_npu_rank_id():
    return get_rank_id()


def get_npu_local_rank_id():
    return get_local_rank_id()


def get_npu_rank_size():
    return get_rank_size()


def get_npu_local_rank_size():
    return get_local_rank_size()


class NpuEmptyHook(_tf2.compat.v1.train.SessionRunHook):
    pass


def npu_keras_optimizer(opt):
    return KerasDistributeOptimizer(opt)


def npu_tf_optimizer(opt):
    return NPUDistributedOptimizer(opt)


def npu_clear_session(config=None):
    backend = _keras_backend()
    if backend is not None:
        backend.clear_session()
        backend.set_session(tf.Session(config=npu_config_proto(config)))


def _hook_sessions():
    from npu_amp_tf.compat import _sessions

    _sessions.patch(npu_entry=True)


_hook_sessions()
